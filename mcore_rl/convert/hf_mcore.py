"""HF <-> megatron-core torch_dist conversion, streaming, with validation before any write."""

from __future__ import annotations

import collections
import functools
import json
import logging
import math
import os
import re

import torch
from tqdm import tqdm

from mcore_rl.convert.hf_io import CheckpointError, HFCheckpoint, atomic_dir, copy_side_files
from mcore_rl.models.mappings import mapping_for
from mcore_rl.convert.mcore_ckpt import HF_DIR, MCORE_RL_META, TorchDistReader, write_torch_dist
from mcore_rl.convert.planned_writer import Planned, PlannedWriter
from mcore_rl.memory.layout import hf_shapes, inventory
from mcore_rl.models.checks import unread_keys_warning
from mcore_rl.models.config import HFModel, validate_layout

log = logging.getLogger("mcore_rl.convert")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
CONFIG_DTYPE_KEYS = ("dtype", "torch_dtype")  # transformers 5 writes the first, older ones the second


def _bar(total: int, desc: str, unit: str = "B"):
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True,
                unit_divisor=1024 if unit == "B" else 1000,
                disable=os.environ.get("MCORE_RL_NO_PROGRESS") == "1")


def plan_hf_import(hf: HFModel, ckpt: HFCheckpoint) -> list:
    """Check the HF checkpoint has every tensor the mapping needs; report what is skipped."""
    params = list(mapping_for(hf).params(hf))
    needed = {h for p in params for h in p.hf}
    missing = sorted(needed - set(ckpt.names()))
    if missing:
        raise CheckpointError(f"{ckpt.path}: {len(missing)} tensor(s) missing, e.g. {missing[:3]}")
    extra = [n for n in ckpt.names() if n not in needed and not n.endswith("_scale_inv")]
    mtp = [n for n in extra if (m := _LAYER.match(n)) and int(m.group(1)) >= hf.num_layers]
    if mtp:
        layers = sorted({int(_LAYER.match(n).group(1)) for n in mtp})
        log.warning("skipping %d multi-token-prediction tensors (layers %s): megatron MTP is not "
                    "converted", len(mtp), layers)
    other = sorted(set(extra) - set(mtp))
    if other:
        raise CheckpointError(f"{ckpt.path}: tensors with no mapping rule: {other[:5]}")
    check_shapes_and_dtypes(hf, ckpt, [h for p in params for h in p.hf])
    return params


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")


def check_shapes_and_dtypes(hf: HFModel, ckpt: HFCheckpoint, names) -> None:
    """Every tensor the model reads has the shape its config.json implies and a floating dtype
    (FP8 only with its block scales), checked from the shard headers before anything is written:
    a transposed or reshaped tensor would otherwise be written under the planned metadata and
    fail only when read. The first misfit in the model's order is named."""
    expected = hf_shapes(hf)
    for name in names:
        got, want = tuple(ckpt.meta[name]["shape"]), expected.get(name)
        dtype = ckpt.meta[name]["dtype"]
        if want is not None and got != want:
            raise CheckpointError(f"{ckpt.path}: tensor {name} has shape {list(got)}, config.json implies "
                                  f"{list(want)}; nothing written")
        fp8 = dtype in FP8_DTYPES and name + "_scale_inv" in ckpt.meta
        if dtype not in FLOAT_DTYPES and not fp8:
            why = "FP8 without its _scale_inv block scales" if dtype in FP8_DTYPES else "not a floating dtype"
            raise CheckpointError(f"{ckpt.path}: tensor {name} has dtype {dtype} ({why}); nothing written")


def hf_to_mcore(hf_dir: str, out: str, tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1,
                dtype: str | None = None) -> str:
    """dtype: cast every parameter to it; None keeps each tensor's own dtype (bit-exact round trips)."""
    hf, ckpt, params = checked_hf_checkpoint(hf_dir)
    validate_layout(hf, tp, pp, ep, etp)
    cast = DTYPES[dtype] if dtype else None
    model_dtype = cast or checkpoint_dtype(hf, ckpt, params)

    def stored(p) -> torch.dtype:
        return cast or functools.reduce(torch.promote_types, (ckpt.dtype(h) for h in p.hf))

    total = sum(math.prod(ckpt.meta[h]["shape"]) * stored(p).itemsize for p in params for h in p.hf)
    with atomic_dir(out) as tmp, _bar(total, "hf -> mcore") as bar:
        write_torch_dist(hf, lambda p: p.to_mcore(hf, [ckpt.get(h) for h in p.hf]), tmp,
                         model_dtype, bar, meta={"layout": dict(tp=tp, pp=pp, ep=ep, etp=etp),
                                                 "source": os.path.abspath(hf_dir)},
                         stored_dtype=stored)
        os.makedirs(os.path.join(tmp, HF_DIR))
        copy_side_files(hf_dir, os.path.join(tmp, HF_DIR))
        _write_config(hf, os.path.join(tmp, HF_DIR), cast)
    ckpt.close()
    return out


def checked_hf_checkpoint(hf_dir: str) -> tuple[HFModel, HFCheckpoint, list]:
    """The model, checkpoint and parameters of the HF checkpoint at hf_dir, checked whole from its
    config and shard headers (every tensor there, of the shape the config implies) before any
    tensor is read."""
    hf = _checked_model(hf_dir)
    ckpt = HFCheckpoint.of_model(hf_dir, hf)
    return hf, ckpt, plan_hf_import(hf, ckpt)


def _checked_model(model_dir: str) -> HFModel:
    """The model of a config.json given to a converter: one the builder cannot take is refused
    naming the file, and keys nothing reads are named in a warning."""
    hf = HFModel.checked_dir(model_dir)
    line = unread_keys_warning(hf.cfg, os.path.join(model_dir, "config.json"))
    if line:
        log.warning(line.removeprefix("warning: "))
    return hf


def checkpoint_dtype(hf: HFModel, ckpt: HFCheckpoint, params: list) -> torch.dtype:
    """The model's dtype: what its config says, else that of most of its parameters' elements."""
    for key in CONFIG_DTYPE_KEYS:
        if hf.get(key) in DTYPES:
            return DTYPES[hf.get(key)]
    counts = collections.Counter()
    for p in params:
        for h in p.hf:
            counts[ckpt.dtype(h)] += math.prod(ckpt.meta[h]["shape"])
    return counts.most_common(1)[0][0]


def _write_config(hf: HFModel, dst: str, cast: torch.dtype | None = None):
    # weights are dequantized on import, so the exported config must not claim FP8
    cfg = {k: v for k, v in hf.cfg.items() if k != "quantization_config"}
    if cast is not None:  # the config says what the tensors now are
        keys = [k for k in CONFIG_DTYPE_KEYS if k in cfg] or CONFIG_DTYPE_KEYS[:1]
        cfg.update({k: str(cast).removeprefix("torch.") for k in keys})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def mcore_to_hf(ckpt_dir: str, out: str, hf_config: str | None = None, dtype: str | None = None,
                max_shard_bytes: int = 5 * 2**30, files: dict[str, str] | None = None,
                check=None) -> str:
    """`files` locates data files spread over several directories (see TorchDistReader);
    `check(tmp_dir)` runs on the finished output before it is renamed into place."""
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: no such checkpoint directory")
    side = hf_config or os.path.join(ckpt_dir, HF_DIR)
    if not os.path.exists(os.path.join(side, "config.json")):
        raise CheckpointError(f"no HF config.json in {side}; pass --hf-config DIR")
    hf = _checked_model(side)
    reader = TorchDistReader(ckpt_dir, hf, files)
    cast = DTYPES[dtype] if dtype else None

    def exported(param, x: torch.Tensor) -> torch.Tensor:
        # the expert bias stays fp32, as transformers keeps it (and as megatron trains it)
        return x if cast is None or reader.entries[param.mcore].buffer else x.to(cast)

    total = sum(reader.metadata.state_dict_metadata[k].size.numel() for e in reader.entries.values()
                for k in e.keys)
    # every output tensor's name, shape and dtype is known from metadata: shard headers are
    # written first and each tensor goes straight to its place (memory: one read batch)
    plan = [Planned(name, tuple(x.shape), exported(param, x).dtype) for param, meta in reader.meta_params()
            for name, x in param.to_hf(hf, meta).items()]
    with atomic_dir(out) as tmp, _bar(total, "mcore -> hf", unit=" params") as bar:
        writer = PlannedWriter(tmp, plan, max_shard_bytes)
        for param, t in reader.params():
            bar.update(t.numel())
            for name, x in param.to_hf(hf, t).items():
                writer.write(name, exported(param, x))
        writer.close()
        copy_side_files(side, tmp)
        _write_config(hf, tmp, cast)
        if check is not None:
            check(tmp)
    return out


def random_hf(hf_config: str, out: str, dtype: str = "bf16", seed: int = 0,
              max_shard_bytes: int = 5 * 2**30) -> str:
    """An HF checkpoint of random weights for `hf_config`'s config.json, at its full size, written a
    tensor at a time (host memory: one shard): a start from an HF checkpoint, measured without
    downloading one. Matrices are N(0, initializer_range), norms ones, other vectors zeros (the
    expert bias, fp32 as transformers keeps it). Each tensor is drawn from a generator seeded by
    `seed` and its name: the same files whatever the order or sharding."""
    import zlib

    from mcore_rl.convert.hf_io import ShardedWriter

    hf = _checked_model(hf_config)
    cast, std = DTYPES[dtype], float(hf.get("initializer_range", 0.02))
    weights = inventory(hf)
    total = sum(math.prod(shape) for w in weights for _, shape in w.hf)
    with atomic_dir(out) as tmp, _bar(total, "random hf", unit=" params") as bar:
        writer = ShardedWriter(tmp, max_shard_bytes)
        for w in weights:
            for name, shape in w.hf:
                if w.split == "buffer":
                    t = torch.zeros(shape, dtype=torch.float32)
                elif len(shape) == 1:
                    t = (torch.ones if "norm" in name else torch.zeros)(shape, dtype=cast)
                else:
                    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                    t = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=g).to(cast)
                writer.add(name, t)
                bar.update(t.numel())
        writer.close()
        copy_side_files(hf_config, tmp)
        _write_config(hf, tmp, cast)
    return out


def read_meta(ckpt_dir: str) -> dict:
    with open(os.path.join(ckpt_dir, MCORE_RL_META)) as f:
        return json.load(f)
