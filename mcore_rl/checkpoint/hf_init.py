"""A model's initial weights read straight from an HF checkpoint, on every rank at once.

Each rank walks its own megatron sharded state dict (its pipeline stage's layers, its EP rank's
experts, its TP slices, as megatron's own checkpoint loader would fill them) and reads only the
HF tensors those are made of: where its slice is a run of rows of one HF tensor (a copied or
gate/up weight split along dim 0), only those rows; else the whole tensors, put together by the
mapping's Transform as the converter does, and cut. Each slice is copied into the parameter at
once, so a rank holds its shard plus the tensor in flight; no torch_dist copy is written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from mcore_rl.checkpoint.model import unwrap
from mcore_rl.convert.hf_io import CheckpointError, HFCheckpoint
from mcore_rl.models.builder import global_names, sharded_state_dict
from mcore_rl.models.config import HFModel
from mcore_rl.models.mappings import Param, mapping_for


@dataclass
class Loaded:
    """What one rank read: HF tensor name -> bytes read of it, and the seconds it took."""

    read: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(self.read.values())


def load_hf(model, hf_dir: str, hf: HFModel, skip=lambda name: False) -> Loaded:
    """Fill every parameter and buffer of this rank's `model` from the HF checkpoint at `hf_dir`
    (a model of config `hf`), but those whose unsharded name `skip(name)` is true (a critic's
    value head). Every rank of the model's layout calls this; no collective runs."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    t0 = time.perf_counter()
    model = unwrap(model)
    ckpt = HFCheckpoint.of_model(hf_dir, hf)
    params = mapping_for(hf).by_mcore(hf)
    global_name = global_names(model, hf.num_experts)
    filled = set()
    with torch.no_grad():
        for name, item in sharded_state_dict(model).items():
            full_name = global_name(name)
            if skip(full_name):
                continue
            # a tied output layer on the last stage has no rule of its own: megatron stores it as the embedding
            p = params.get(full_name) or params.get(item.key)
            if p is None:
                raise KeyError(f"{name} (unsharded: {full_name}): no mapping rule gives this parameter")
            # megatron stores a GLU weight as two tensors (gate, up), each split over TP on its own;
            # the factory's parts are views of this rank's [gate_i; up_i]
            parts = item.build() if isinstance(item, ShardedTensorFactory) else [item]
            for i, st in enumerate(parts):
                st.data.copy_(_local_part(ckpt, hf, p, i, len(parts), st))
            filled.add(name)
    unfilled = [n for n in model.state_dict(keep_vars=True)
                if n not in filled and not n.endswith("_extra_state") and not skip(global_name(n))]
    if unfilled:
        raise KeyError(f"{hf_dir}: nothing filled {unfilled[:5]}")
    return Loaded(dict(ckpt.bytes_read), time.perf_counter() - t0)


def _local_part(ckpt: HFCheckpoint, hf: HFModel, p: Param, part: int, parts: int, st) -> torch.Tensor:
    """This rank's slice of part `part` of megatron parameter p, as megatron's sharded tensor `st`
    places it in the unsharded tensor."""
    if st.prepend_axis_num or st.flattened_range is not None:
        raise NotImplementedError(f"{st.key}: a sharded tensor with prepended axes or a flattened range")
    offset, shape, whole = tuple(st.global_offset), tuple(st.local_shape), tuple(st.global_shape)
    source = p.transform.part_source(part, parts)
    cut = [d for d in range(len(shape)) if shape[d] != whole[d]]
    if source is not None and cut in ([], [0]):  # only its rows: read just those
        name = p.hf[source]
        _check_shape(ckpt, name, whole)
        return ckpt.get_rows(name, offset[0], offset[0] + shape[0]) if shape else ckpt.get(name)
    full = p.to_mcore(hf, [ckpt.get(h) for h in p.hf])
    t = full.chunk(parts, dim=0)[part] if parts > 1 else full  # as megatron's factory cuts it at TP 1
    if tuple(t.shape) != whole:
        raise CheckpointError(f"{ckpt.path}: {p.mcore} has shape {list(t.shape)} from {', '.join(p.hf)}, "
                              f"the model needs {list(whole)}")
    return t[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def _check_shape(ckpt: HFCheckpoint, name: str, want: tuple[int, ...]) -> None:
    got = tuple(ckpt.meta[name]["shape"]) if name in ckpt else None
    if got is not None and got != want:
        raise CheckpointError(f"{ckpt.path}: tensor {name} has shape {list(got)}, the model needs {list(want)}")
