"""A model's initial weights read straight from an HF checkpoint, on every rank at once.

Each rank walks its own megatron sharded state dict (its pipeline stage's layers, its EP rank's
experts, its TP slices, as megatron's own checkpoint loader would fill them) and reads only the
HF tensors those are made of, and of each only the rows its slice is made of: every mapping's
Transform only reorders whole rows (Transform.runs), so a slice along dim 0 (column-parallel
weights, a GLU's gate and up, a QKV's KV groups, the vocabulary) is a few runs of HF rows. Read
whole: a slice along another dim (row-parallel weights at TP > 1: their rows are contiguous in the
file, a column block is not) and FP8 block-scaled weights with their scales (a block spans 128
rows). Each slice is copied into the parameter at once, so a rank holds its shard plus the rows in
flight; no torch_dist copy is written.
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
    places it in the unsharded tensor: only the rows of p's HF tensors that the slice is made of
    (p.transform's runs), each tensor read once, then cut along the other dims."""
    if st.prepend_axis_num or st.flattened_range is not None:
        raise NotImplementedError(f"{st.key}: a sharded tensor with prepended axes or a flattened range")
    offset, shape, whole = tuple(st.global_offset), tuple(st.local_shape), tuple(st.global_shape)
    runs = _runs(ckpt, hf, p, [parts * whole[0], *whole[1:]] if whole else [])
    if not whole:
        return ckpt.get(p.hf[0])  # a scalar
    lo = part * whole[0] + offset[0]
    pieces, at = [], 0  # the slice's rows [lo, lo + shape[0]) of the megatron tensor, as runs of HF rows
    for i, a, b in runs:
        a2, b2 = a + max(lo - at, 0), min(b, a + lo + shape[0] - at)
        if a2 < b2:
            pieces.append((i, a2, b2))
        at += b - a
    span = {i: (min(a for j, a, _ in pieces if j == i), max(b for j, _, b in pieces if j == i)) for i, _, _ in pieces}
    read = {i: ckpt.get_rows(p.hf[i], a, b) for i, (a, b) in span.items()}
    rows = [read[i][a - span[i][0]:b - span[i][0]] for i, a, b in pieces]
    t = rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
    return t[(slice(None), *(slice(o, o + n) for o, n in zip(offset[1:], shape[1:])))]


def _runs(ckpt: HFCheckpoint, hf: HFModel, p: Param, need: list[int]) -> list[tuple[int, int, int]]:
    """p.transform's runs of p's HF tensors, checked to make a megatron tensor of shape `need`."""
    missing = [h for h in p.hf if h not in ckpt]
    if missing:
        raise CheckpointError(f"{ckpt.path}: tensor {missing[0]!r} is not in the checkpoint")
    shapes = [list(ckpt.meta[h]["shape"]) for h in p.hf]
    try:
        runs = p.transform.runs(hf, [s[0] if s else 1 for s in shapes])
    except ValueError:
        runs = None
    if runs is None or any(s[1:] != need[1:] for s in shapes) or sum(b - a for _, a, b in runs) != (need or [1])[0]:
        raise CheckpointError(f"{ckpt.path}: {p.mcore} is made of {', '.join(p.hf)} of shape(s) "
                              f"{', '.join(map(str, shapes))}; the model needs {need}")
    return runs
