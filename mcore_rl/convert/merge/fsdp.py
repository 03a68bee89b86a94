"""verl FSDP checkpoints -> HF safetensors.

verl writes, per rank, `model_world_size_{W}_rank_{R}.pt` = `torch.save(model.state_dict())` of
the FSDP-wrapped HF model: DTensors (FSDP2, or FSDP1 with a device mesh) sharded along one mesh
dimension, plain tensors for replicated buffers. Rank 0 adds `fsdp_config.json` and
`huggingface/` (config, tokenizer). Across nodes without a shared file system each node's
directory holds its own ranks. Everything is checked from metadata before a byte is written;
tensors are then assembled one at a time from positioned reads.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass

import torch

from mcore_rl.convert.hf_io import CheckpointError
from mcore_rl.convert.merge.hf_layout import HFSaveRules
from mcore_rl.convert.merge.locate import check_dirs, find_side_dir
from mcore_rl.convert.merge.lora import TRAIN_META, base_name, is_lora
from mcore_rl.convert.merge.torch_files import TorchFile, local_tensor
from mcore_rl.preflight.bad_input import read_json_object

log = logging.getLogger("mcore_rl.convert.merge")
RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
FSDP_CONFIG = "fsdp_config.json"
HF_SUBDIR = "huggingface"


def rank_file_name(world: int, rank: int) -> str:
    return f"model_world_size_{world}_rank_{rank}.pt"


def _ranges(ranks: list[int]) -> str:
    ranks, parts = sorted(ranks), []
    for r in ranks:
        if parts and parts[-1][1] == r - 1:
            parts[-1][1] = r
        else:
            parts.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts)


def discover(dirs: list[str], manifest: str | None = None) -> tuple[int, dict[int, str]]:
    """(world size, rank -> file): every rank exactly once, world sizes agreeing everywhere."""
    found: dict[int, list[str]] = {}
    worlds: dict[int, list[str]] = {}
    if manifest:
        listed = read_json_object(manifest).get("ranks")
        if not isinstance(listed, dict):
            raise CheckpointError(f'{manifest}: needs "ranks": {{"0": "path", ...}}')
        base = os.path.dirname(os.path.abspath(manifest))
        paths = [os.path.join(base, p) for p in listed.values()]
        for r, p in zip(listed, paths):
            m = RANK_FILE.match(os.path.basename(p))
            if not m or int(m.group(2)) != int(r):
                raise CheckpointError(f"{manifest}: rank {r} points at {p}, not a rank-{r} model file")
            if not os.path.exists(p):
                raise CheckpointError(f"rank {r}: {p} (from {manifest}) does not exist")
    else:
        paths = []
        for d in dirs:
            mine = [os.path.join(d, n) for n in sorted(os.listdir(d)) if RANK_FILE.match(n)]
            if not mine:
                raise CheckpointError(f"{d}: no model_world_size_*_rank_*.pt files")
            paths += mine
    for p in paths:
        w, r = map(int, RANK_FILE.match(os.path.basename(p)).groups())
        worlds.setdefault(w, []).append(p)
        found.setdefault(r, []).append(p)
    if len(worlds) > 1:
        desc = "; ".join(f"world_size {w}: {len(ps)} file(s), e.g. {ps[0]}" for w, ps in sorted(worlds.items()))
        raise CheckpointError(f"rank files disagree on the world size: {desc}")
    (world,) = worlds
    for d in dirs:
        cfg = os.path.join(d, FSDP_CONFIG)
        if os.path.exists(cfg):
            with open(cfg) as f:
                stated = json.load(f).get("world_size")
            if stated != world:
                raise CheckpointError(f"{cfg} says world_size {stated}, the rank files say {world} "
                                      f"(e.g. {worlds[world][0]})")
    twice = {r: ps for r, ps in found.items() if len(ps) > 1}
    if twice:
        r, ps = min(twice.items())
        raise CheckpointError(f"rank {r} appears more than once: {', '.join(ps)}")
    bad = sorted(r for r in found if r >= world)
    if bad:
        raise CheckpointError(f"rank {bad[0]} is outside world size {world}: {found[bad[0]][0]}")
    missing = [r for r in range(world) if r not in found]
    if missing:
        r = missing[0]
        near = max((q for q in found if q < r), default=min(found))
        home = os.path.dirname(found[near][0])
        held = [q for q in found if os.path.dirname(found[q][0]) == home]
        raise CheckpointError(
            f"rank {r} of {world} missing: {rank_file_name(world, r)} expected in {home} "
            f"(which holds ranks {_ranges(held)}); {len(missing)} rank(s) missing in all "
            f"({_ranges(missing)}); searched: {', '.join(dirs) or manifest}")
    return world, {r: ps[0] for r, ps in found.items()}


@dataclass
class Source:
    """How to assemble one full tensor: (rank file, meta local tensor, index along `dim`) pieces."""

    name: str  # name in the rank files
    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int | None  # concatenation dim; None = replicated, take the first piece
    pieces: list[tuple[TorchFile, torch.Tensor]]


class _Meshes:
    """Device-mesh rank tables are tensors in the file too: read each one once."""

    def __init__(self):
        self.seen: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}

    def __call__(self, f: TorchFile, v) -> torch.Tensor:
        key = (id(f), id(v.device_mesh))
        if key not in self.seen:  # keep the mesh object alive so its id stays unique
            self.seen[key] = (v.device_mesh, f.read(v.device_mesh.mesh).clone())
        return self.seen[key][1]


def _placement_plan(name: str, v, mesh: torch.Tensor, world: int) -> tuple[int | None, list[int]]:
    """(shard dim, ranks whose local tensors form the full tensor, in order) for DTensor `v`."""
    from torch.distributed.tensor.placement_types import Replicate, Shard

    if mesh.numel() != world:
        raise CheckpointError(f"{name}: device mesh of {mesh.numel()} ranks in a world of {world}")
    shard_dims = [i for i, p in enumerate(v.placements) if isinstance(p, Shard)]
    if any(not isinstance(p, (Shard, Replicate)) for p in v.placements) or len(shard_dims) > 1:
        raise CheckpointError(f"{name}: placements {v.placements} are not supported (one Shard "
                              f"mesh dimension, the others Replicate)")
    index = [slice(None)] * mesh.dim()
    for i, p in enumerate(v.placements):
        if isinstance(p, Replicate):
            index[i] = 0  # replicas (HSDP's replicate dim) are identical: take the first
    ranks = mesh[tuple(index)].reshape(-1).tolist()
    return (v.placements[shard_dims[0]].dim if shard_dims else None), ranks


def plan_sources(files: dict[int, TorchFile], world: int) -> dict[str, Source]:
    """Cross-check every rank's state dict and describe how each tensor is put back together."""
    ref = files[0].state
    if not isinstance(ref, dict):
        raise CheckpointError(f"{files[0].path}: not a state dict ({type(ref).__name__})")
    for r, f in files.items():
        if not isinstance(f.state, dict) or set(f.state) != set(ref):
            diff = sorted(set(ref) ^ set(f.state if isinstance(f.state, dict) else {}))
            raise CheckpointError(f"{f.path}: rank {r} holds different tensors than rank 0, e.g. {diff[:3]}")
    sources, mesh_of = {}, _Meshes()
    for name, v0 in ref.items():
        if not isinstance(v0, torch.Tensor):
            raise CheckpointError(f"{files[0].path}: {name} is a {type(v0).__name__}, not a tensor")
        dtensor = hasattr(v0, "placements")
        mesh0 = mesh_of(files[0], v0) if dtensor else None
        dim, ranks = _placement_plan(name, v0, mesh0, world) if dtensor else (None, [0])
        for r, f in files.items():
            v = f.state[name]
            if hasattr(v, "placements") != dtensor or v.shape != v0.shape or v.dtype != v0.dtype or (
                    dtensor and (v.placements != v0.placements or not torch.equal(mesh_of(f, v), mesh0))):
                raise CheckpointError(f"{f.path}: {name} of rank {r} does not match rank 0 "
                                      f"({type(v).__name__} {tuple(v.shape)} {v.dtype})")
            f.check_tensor(name, local_tensor(v))
        pieces = [(files[r], local_tensor(files[r].state[name])) for r in ranks]
        if dim is not None:
            got = [p.shape[dim] for _, p in pieces]
            want = list(torch.empty(v0.shape, device="meta").chunk(len(ranks), dim))
            want = [w.shape[dim] for w in want] + [0] * (len(ranks) - len(want))
            if got != want:
                raise CheckpointError(f"{name}: shard sizes along dim {dim} by rank are {got}, "
                                      f"expected {want} for global shape {tuple(v0.shape)}")
        sources[name] = Source(name, tuple(v0.shape), v0.dtype, dim, pieces)
    return sources


def assemble(src: Source) -> torch.Tensor:
    """The full tensor, filled shard by shard: peak memory is the tensor plus one shard."""
    if src.dim is None:
        f, t = src.pieces[0]
        return f.read(t)
    out = torch.empty(src.shape, dtype=src.dtype)
    at = 0
    for f, t in src.pieces:
        n = t.shape[src.dim]
        if n:
            f.read(t, into=out.narrow(src.dim, at, n))
        at += n
    return out


class FSDPCheckpoint:
    """Validated view of a verl FSDP checkpoint; `tensors(group)` yields assembled tensors."""

    def __init__(self, dirs: list[str], manifest: str | None = None, hf_config: str | None = None):
        self.dirs = check_dirs(dirs)
        self.world, paths = discover(self.dirs, manifest)
        search = self.dirs or [os.path.dirname(os.path.abspath(manifest))]
        self.side = hf_config or find_side_dir(search + [os.path.dirname(p) for p in paths.values()],
                                               HF_SUBDIR)
        if self.side is None:
            raise CheckpointError(f"no {HF_SUBDIR}/config.json in {', '.join(search)}; pass --hf-config DIR")
        self.files = {r: TorchFile(p, f"rank {r} model file") for r, p in sorted(paths.items())}
        self.sources = plan_sources(self.files, self.world)
        self.rules = HFSaveRules(self.side)
        self.lora = {n for n in self.sources if is_lora(n)}
        self.base = {base_name(n): n for n in self.sources if n not in self.lora}
        self.rules.check({b: self.sources[n].shape for b, n in self.base.items()}, self.files[0].path)
        self.lora_meta = self._train_meta(search)
        log.info("FSDP checkpoint: world size %d, %d tensors (%d LoRA), config from %s",
                 self.world, len(self.sources), len(self.lora), self.side)

    @staticmethod
    def _train_meta(dirs: list[str]) -> dict | None:
        for d in dirs:
            p = os.path.join(d, TRAIN_META)
            if os.path.exists(p):
                with open(p) as f:
                    return json.load(f)
        return None

    def tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Full tensors for model names (base names for PEFT-wrapped checkpoints)."""
        return {n: assemble(self.sources[self.base.get(n, n)]) for n in names}

    def meta(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: torch.empty(self.sources[self.base.get(n, n)].shape,
                               dtype=self.sources[self.base.get(n, n)].dtype, device="meta")
                for n in names}

    def close(self):
        for f in self.files.values():
            f.close()
