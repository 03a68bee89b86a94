"""Optimizer states in model space: saved at one parallel layout, loaded at any other.

Each rank writes the fp32 main params and Adam moments it owns, one piece per model tensor it
holds part of. A piece names the tensor by its checkpoint key (the model's torch_dist key),
where its local block sits in the global tensor, and which flat range of that block this rank's
distributed-optimizer shard covers. Loading at another TP/EP/PP/DP layout assembles each rank's
own ranges from whatever pieces overlap them. (megatron 0.16's own model-space format needs
`flattened_range`, which its checkpointing no longer accepts; its `fully_reshardable` one
gathers the whole state on a rank.)

Saving copies nothing: the pieces are views of the live tensors, or, while the trainer's states
are offloaded, of their pinned host copies (`read`), and torch.save writes storage by storage.
Loading maps the files (mmap) and copies one tensor's block at a time.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import torch

from mcore_rl.parallel.optimizer import _subs

FORMAT = "mcore_rl.optim_state/1"
STATES = ("exp_avg", "exp_avg_sq")


class OptimStateError(ValueError):
    """An optimizer checkpoint that cannot restore this optimizer exactly."""


@dataclass(frozen=True)
class Region:
    """A contiguous run [start, start + numel) of a param's elements that is one checkpoint
    tensor's local block: `key` at `offset` in a tensor of `global_shape`, of `shape`."""
    key: str
    global_shape: tuple
    offset: tuple
    shape: tuple
    start: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def regions(model) -> dict[int, list[Region]]:
    """id(param) -> the checkpoint tensors its elements belong to (whole param, per-expert
    slices, gate/up halves), from the model's own sharded state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from mcore_rl.checkpoint.model import unwrap
    from mcore_rl.models.builder import sharded_state_dict

    model = unwrap(model)
    params = [p for p in model.parameters()]
    out: dict[int, list[Region]] = {id(p): [] for p in params}
    by_storage: dict[int, list] = {}
    for p in params:
        by_storage.setdefault(p.untyped_storage()._cdata, []).append(p)
    for item in nested_values(sharded_state_dict(model)):
        built = nested_values(item.build()) if isinstance(item, ShardedTensorFactory) else [item]
        for sh in built:
            if not isinstance(sh, ShardedTensor):
                continue
            d = sh.data
            owner = next((p for p in by_storage.get(d.untyped_storage()._cdata, [])
                          if p.storage_offset() <= d.storage_offset() < p.storage_offset() + p.numel()), None)
            if owner is None:
                continue  # a buffer (the router's expert bias): the model checkpoint carries it
            if not d.is_contiguous():
                raise OptimStateError(f"{sh.key}: not a contiguous part of its parameter")
            pre = (1,) * sh.prepend_axis_num
            out[id(owner)].append(Region(sh.key, tuple(sh.global_shape), tuple(sh.global_offset),
                                         pre + tuple(d.shape), d.storage_offset() - owner.storage_offset()))
    return out


def _owned(opt):
    """(model param, [start, end) of its flattened elements this rank owns, main param (flat view
    of those elements), inner optimizer) for every param this rank's optimizer steps."""
    for sub in _subs(opt):
        inner = getattr(sub, "optimizer", None)
        if inner is None:
            continue
        if hasattr(sub, "gbuf_ranges"):  # distributed optimizer: a flat shard per param
            for per_dtype in sub.gbuf_ranges:
                for buckets in per_dtype.values():
                    for bucket in buckets:
                        for p, ranges in bucket["param_map"].items():
                            r = ranges["param"]
                            gi, go = sub.model_param_group_index_map[p]
                            yield p, r.start, r.end, inner.param_groups[gi]["params"][go], inner
        elif hasattr(sub, "float16_groups"):  # every DP rank holds whole fp32 copies
            for models, mains in zip(sub.float16_groups, sub.fp32_from_float16_groups):
                for p, main in zip(models, mains):
                    yield p, 0, p.numel(), main, inner
            for group in sub.fp32_from_fp32_groups:
                for p in group:
                    yield p, 0, p.numel(), p, inner
        else:  # fp32 optimizer: the model params are the main params
            for group in inner.param_groups:
                for p in group["params"]:
                    yield p, 0, p.numel(), p, inner


def _writes(opt) -> bool:
    """Without the distributed optimizer every DP rank holds the same state: DP rank 0 writes it."""
    from megatron.core import parallel_state as ps

    return any(hasattr(s, "gbuf_ranges") for s in _subs(opt)) or ps.get_data_parallel_rank() == 0


def save(opt, model, path: str, extra: dict, read=None, where: dict | None = None) -> None:
    """This rank's pieces to `path` (torch.save, written via `path.tmp`). read(t) maps a live
    tensor to the tensor to write (the host copy of an offloaded state); identity if None.
    where: `regions(model)`, made while the params are on the device (they depend on the layout only)."""
    read = read or (lambda t: t)
    where = where or regions(model)
    pieces, step = [], None
    if _writes(opt):
        for p, s, e, main, inner in _owned(opt):
            state = inner.state.get(main, {})
            if "step" in state:
                step = int(read(state["step"]))
            flat = {"fp32_param": read(main).reshape(-1)}  # this rank's elements [s, e) of p
            flat.update({k: read(state[k]).reshape(-1) for k in STATES if k in state})
            for r in where[id(p)]:
                lo, hi = max(r.start, s), min(r.start + r.numel, e)
                if lo >= hi:
                    continue
                pieces.append({"key": r.key, "global_shape": r.global_shape, "offset": r.offset, "shape": r.shape,
                               "range": (lo - r.start, hi - r.start),
                               "tensors": {k: v[lo - s:hi - s] for k, v in flat.items()}})
    tmp = path + ".tmp"
    torch.save({"format": FORMAT, "step": step, "pieces": pieces, **extra}, tmp)
    os.replace(tmp, path)


class _Index:
    """Every piece of one optimizer's checkpoint files, by key (files memory-mapped)."""

    def __init__(self, files: list[str]):
        self.by_key: dict[str, list[dict]] = {}
        self.steps, self.extras = set(), []
        for f in files:
            try:
                # on the host whatever device saved it (a run that never offloads saves device tensors)
                d = torch.load(f, mmap=True, weights_only=True, map_location="cpu")
            except Exception as e:  # noqa: BLE001 - a truncated or foreign file: name it
                raise OptimStateError(f"{f}: unreadable optimizer state ({type(e).__name__}: {e})") from None
            if not isinstance(d, dict) or d.get("format") != FORMAT:
                raise OptimStateError(f"{f}: not an optimizer state of this format ({FORMAT})")
            if d["step"] is not None:
                self.steps.add(d["step"])
            self.extras.append({k: v for k, v in d.items() if k not in ("pieces", "format", "step")})
            for pc in d["pieces"]:
                self.by_key.setdefault(pc["key"], []).append(pc)

    def fill(self, r: Region, a: int, b: int, names) -> dict[str, torch.Tensor]:
        """Elements [a, b) of region r's block, per state name, from the pieces that overlap it."""
        pieces = self.by_key.get(r.key, [])
        for pc in pieces:  # the same layout: one piece holds the whole range
            lo, hi = pc["range"]
            if tuple(pc["offset"]) == r.offset and tuple(pc["shape"]) == r.shape and lo <= a and b <= hi:
                return {n: pc["tensors"][n][a - lo:b - lo] for n in names if n in pc["tensors"]}
        got, have = {}, torch.zeros(r.shape, dtype=torch.bool)
        for pc in pieces:
            box = [(max(o, po), min(o + s, po + ps)) for o, s, po, ps in
                   zip(r.offset, r.shape, pc["offset"], pc["shape"])]
            if any(lo >= hi for lo, hi in box):
                continue
            src_sl = tuple(slice(lo - po, hi - po) for (lo, hi), po in zip(box, pc["offset"]))
            dst_sl = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(box, r.offset))
            mask = torch.zeros(pc["shape"], dtype=torch.bool)
            mask.view(-1)[slice(*pc["range"])] = True
            m = mask[src_sl]
            for n, t in pc["tensors"].items():
                if n not in names:
                    continue
                src = torch.empty(pc["shape"], dtype=t.dtype)
                src.view(-1)[slice(*pc["range"])] = t
                dst = got.setdefault(n, torch.empty(r.shape, dtype=t.dtype))
                dst[dst_sl][m] = src[src_sl][m]
            have[dst_sl] |= m
        if not have.view(-1)[a:b].all():
            raise OptimStateError(f"optimizer state of {r.key} is incomplete: a rank's file is missing")
        return {n: v.view(-1)[a:b] for n, v in got.items()}


@torch.no_grad()
def load(opt, model, files: list[str], where: dict | None = None) -> dict:
    """Restore this rank's main params, Adam moments and step from the pieces in `files` (every
    rank's file of one optimizer, saved at any layout); returns the saver's extras (rank 0's)."""
    if not files:
        raise OptimStateError("no optimizer state files")
    index = _Index(files)
    if len(index.steps) > 1:
        raise OptimStateError(f"optimizer state files of different steps {sorted(index.steps)}: {files[0]}...")
    step = next(iter(index.steps), None)
    where = where or regions(model)
    for p, s, e, main, inner in _owned(opt):
        state = inner.state[main]
        if step is None:  # saved before the first update: no moments, as a new optimizer has none
            state.clear()
        elif not all(k in state for k in STATES):
            state.update({k: torch.zeros_like(main) for k in STATES})
        targets = {"fp32_param": main.view(-1)}
        targets.update({k: state[k].view(-1) for k in STATES if k in state})
        for r in where[id(p)]:
            lo, hi = max(r.start, s), min(r.start + r.numel, e)
            if lo >= hi:
                continue
            vals = index.fill(r, lo - r.start, hi - r.start, targets)
            for n, t in targets.items():
                if n not in vals:
                    raise OptimStateError(f"optimizer state of {r.key} lacks {n}")
                t[lo - s:hi - s].copy_(vals[n])
        if step is not None:
            dev = state["step"].device if torch.is_tensor(state.get("step")) else torch.device("cpu")
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=dev)
    return index.extras[0] if index.extras else {}


def files(step_dir: str, part: str) -> list[str]:
    """Every rank's optimizer file of one part ("model" or "critic") of a checkpoint."""
    return sorted(glob.glob(os.path.join(step_dir, "optim", f"{part}.rank*.pt")))
