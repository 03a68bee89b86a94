"""megatron-core torch_dist checkpoints, written and read one tensor at a time in one process.

The checkpoint keys, shapes and the GLU gate/up split come from megatron itself: a meta-device
model (no memory) at TP=PP=EP=1 gives its `sharded_state_dict`. We only supply tensor data,
lazily, through the DCP save planner, so peak memory is a few tensors, not the model.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem

from mcore_rl.convert.hf_io import CheckpointError
from mcore_rl.models.mappings import Param, mapping_for
from mcore_rl.models.config import HFModel

log = logging.getLogger("mcore_rl.convert")
MCORE_RL_META = "mcore_rl.json"
HF_DIR = "hf"  # config and tokenizer files travel with the checkpoint


@dataclass
class Entry:
    """One megatron parameter and the checkpoint keys it is stored under."""

    param: Param
    keys: list[str]
    shapes: list[tuple[int, ...]]
    factory: object | None  # megatron ShardedTensorFactory (GLU split) or None
    buffer: bool = False  # a buffer megatron keeps in fp32 whatever the model's dtype (expert bias)


def _ensure_single_process_group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def skeleton(hf: HFModel, dtype: torch.dtype = torch.bfloat16):
    """Megatron's sharded state dict for `hf` on the meta device, plus our Entry per parameter."""
    from mcore_rl import patches

    with patches.cuda_untouched():  # the planner's driver would otherwise hold a CUDA context all run
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

        from mcore_rl.models.builder import build_model
        from mcore_rl.models.config import transformer_config
        from mcore_rl.models.builder import sharded_state_dict
        from mcore_rl.parallel.groups import Layout, init_distributed

        _ensure_single_process_group()
        if dist.get_world_size() != 1:
            raise RuntimeError("skeleton() builds an unsharded model and must run in one process")
        if not ps.model_parallel_is_initialized():
            init_distributed(Layout(), seed=None)  # unseeded: seeding reads the CUDA RNG
        with torch.device("meta"):
            model = build_model(hf, transformer_config(hf, dtype=dtype, cpu=True, sequence_parallel=False,
                                                       perform_initialization=False),
                                pre_process=True, post_process=True)
    sharded = sharded_state_dict(model)
    buffers = {n for n, _ in model.named_buffers()}
    params = mapping_for(hf).by_mcore(hf)
    entries: dict[str, Entry] = {}
    for name, v in sharded.items():
        if name not in params:
            raise KeyError(f"megatron parameter {name} has no mapping rule")
        if isinstance(v, ShardedTensorFactory):
            built = v.build()
            keys, shapes = [s.key for s in built], [tuple(s.local_shape) for s in built]
        else:
            keys, shapes, v = [v.key], [tuple(v.local_shape)], None
        entries[name] = Entry(params.pop(name), keys, shapes, v, buffer=name in buffers)
    if params:
        raise KeyError(f"mapping rules with no megatron parameter: {sorted(params)[:5]}")
    return sharded, entries


def write_torch_dist(hf: HFModel, produce: Callable[[Param], torch.Tensor], out: str,
                     dtype: torch.dtype = torch.bfloat16, progress=None, meta: dict | None = None,
                     stored_dtype: Callable[[Param], torch.dtype] | None = None):
    """Write a torch_dist checkpoint; `produce(param)` returns the full tensor for one parameter.

    Parameters are stored in `dtype`, or in `stored_dtype(param)` where given (a checkpoint keeping
    its tensors' own dtypes); buffers megatron keeps in fp32 (the expert bias) stay fp32.
    """
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    sharded, entries = skeleton(hf, dtype)
    by_key: dict[str, tuple[Entry, int]] = {}
    for e in entries.values():
        for i, k in enumerate(e.keys):
            by_key[k] = (e, i)
    for name, v in list(sharded.items()):
        if isinstance(v, ShardedTensorFactory):
            sharded[name] = v.build()
        if stored_dtype is not None and not entries[name].buffer:
            want = stored_dtype(entries[name].param)
            for sh in sharded[name] if isinstance(sharded[name], list) else [sharded[name]]:
                sh.data, sh.dtype = sh.data.to(want), want  # meta tensors: only the dtype changes
    sharded, _common = save_preprocess(sharded, validate_access_integrity=True)
    sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, False)
    pyt = mcore_to_pyt_state_dict(sharded, False)
    cache: dict[str, list] = {}

    class LazyPlanner(MCoreSavePlanner):
        written = None

        def resolve_data(self, item):
            # torch's FileSystemWriter keeps a reference to every tensor it has written; with its
            # serial loader (per_thread_copy_ahead=0) the previous tensor is on disk when the next
            # one is asked for, so its storage is released here: memory stays at a few tensors
            if self.written is not None:
                self.written.untyped_storage().resize_(0)
            e, i = by_key[item.index.fqn]
            if e.param.mcore not in cache:
                # the planned dtype: `dtype` or stored_dtype for parameters, fp32 for the expert bias
                full = produce(e.param).to(item.tensor_data.properties.dtype)
                if e.factory is None:
                    parts = [full]
                else:
                    f = e.factory
                    parts = [s.data for s in f.build_fn(f.key, full, f.replica_id, None)]
                cache[e.param.mcore] = [p.contiguous().clone() for p in parts]
            parts = cache[e.param.mcore]
            t, parts[i] = parts[i], None
            if all(p is None for p in parts):
                del cache[e.param.mcore]
            if progress is not None:
                progress.update(t.numel() * t.element_size())
            self.written = t
            return t

    writer = FileSystemWriter(out, single_file_per_rank=True, thread_count=1, sync_files=False,
                              per_thread_copy_ahead=0)
    dcp_save(pyt, storage_writer=writer, planner=LazyPlanner(dedup_replicated_tensors=False,
                                                             flatten_state_dict=False))
    torch.save({}, os.path.join(out, "common.pt"))
    save_config(CheckpointingConfig("torch_dist", 1), out)
    with open(os.path.join(out, MCORE_RL_META), "w") as f:
        json.dump({"dtype": str(dtype).removeprefix("torch."), **(meta or {})}, f, indent=2)


class TorchDistReader:
    """Read whole parameters from a torch_dist checkpoint written at any TP/PP/EP layout."""

    def __init__(self, ckpt: str, hf: HFModel, files: dict[str, str] | None = None):
        """`files`: data file name -> directory, for a checkpoint spread over several nodes'
        directories (`ckpt` then is the one holding metadata.json and .metadata)."""
        from megatron.core.dist_checkpointing.core import maybe_load_config
        from torch.distributed.checkpoint import FileSystemReader

        cfg = maybe_load_config(ckpt)
        if cfg is None or cfg.sharded_backend != "torch_dist":
            raise FileNotFoundError(f"{ckpt}: not a megatron torch_dist checkpoint (metadata.json)")
        self.ckpt, self.hf = ckpt, hf
        self.reader = FileSystemReader(ckpt)
        if files:
            self.reader.fs = _SpreadFileSystem(files)
        self.metadata = self.reader.read_metadata()
        check_data_files(ckpt, self.metadata, files)
        # DCP's load() re-reads .metadata on every call; parse it once
        self.reader.read_metadata = lambda *a, **kw: self.metadata
        _, self.entries = skeleton(hf)
        stored = self.metadata.state_dict_metadata
        read = {k for e in self.entries.values() for k in e.keys}
        unread = sorted(k for k, md in stored.items() if k not in read and hasattr(md, "size"))
        if unread:  # never dropped without a word
            log.warning("%s: %d checkpoint tensor(s) with no mapping rule are not exported: %s",
                        ckpt, len(unread), ", ".join(unread[:5]) + (", ..." if len(unread) > 5 else ""))
        for e in self.entries.values():
            for k, shape in zip(e.keys, e.shapes):
                if k not in stored:
                    raise KeyError(f"{ckpt}: checkpoint has no tensor {k}")
                if tuple(stored[k].size) != shape:
                    raise ValueError(f"{ckpt}: {k} has shape {tuple(stored[k].size)}, "
                                     f"the model needs {shape}")

    def _load(self, keys: list[str]) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint import load as dcp_load

        stored = self.metadata.state_dict_metadata
        out = {k: torch.empty(tuple(stored[k].size), dtype=stored[k].properties.dtype) for k in keys}
        dcp_load(out, storage_reader=self.reader)
        return out

    def params(self, max_bytes: int = 2**30) -> Iterator[tuple[Param, torch.Tensor]]:
        """Yield (param, full tensor) in mapping order, reading about `max_bytes` per DCP call."""
        stored = self.metadata.state_dict_metadata
        batch: list = []
        size = 0

        def flush():
            loaded = self._load([k for e in batch for k in e.keys])
            for e in batch:
                yield e.param, _merged(e, [loaded.pop(k) for k in e.keys])

        for e in self._ordered():
            batch.append(e)
            size += sum(_nbytes(stored[k]) for k in e.keys)
            if size >= max_bytes:
                yield from flush()
                batch, size = [], 0
        if batch:
            yield from flush()

    def meta_params(self) -> Iterator[tuple[Param, torch.Tensor]]:
        """(param, meta tensor) in the order of params(): shapes and dtypes, no data read."""
        stored = self.metadata.state_dict_metadata
        for e in self._ordered():
            yield e.param, _merged(e, [torch.empty(tuple(stored[k].size), dtype=stored[k].properties.dtype,
                                                   device="meta") for k in e.keys])

    def _ordered(self) -> list:
        order = {p.mcore: i for i, p in enumerate(mapping_for(self.hf).params(self.hf))}
        return sorted(self.entries.values(), key=lambda e: order[e.param.mcore])


def check_data_files(ckpt: str, metadata, files: dict[str, str] | None = None) -> None:
    """Every data file the metadata points into is there and long enough: a missing or truncated
    .distcp is named before anything is read (DCP would fail mid-export with a bare EOFError)."""
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        path = os.path.join((files or {}).get(name, ckpt), name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing (the checkpoint's .metadata lists it)")
        have = os.path.getsize(path)
        if have < size:
            raise CheckpointError(f"{path}: truncated: {have} bytes, the checkpoint's .metadata needs {size}")


def _merged(entry, parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if entry.factory is None else entry.factory.merge_fn(parts)


class _SpreadFileSystem(FileSystem):
    """Resolve each checkpoint file in the directory that holds it (one directory per node)."""

    def __init__(self, files: dict[str, str]):
        super().__init__()
        self.files = files

    def concat_path(self, path, suffix):
        return super().concat_path(self.files.get(str(suffix), path), suffix)


def _nbytes(md) -> int:
    n = 1
    for s in md.size:
        n *= s
    return n * torch.tensor([], dtype=md.properties.dtype).element_size()
