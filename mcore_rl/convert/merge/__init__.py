"""Merge sharded training checkpoints (verl FSDP, our megatron torch_dist) into one HF model.

Both backends check completeness (every rank / data file exactly once, consistent shapes and world
size) before anything is written, stream one tensor (FSDP: one layer) at a time, and write into a
temporary directory that is renamed to the target only when complete.
"""

from __future__ import annotations

import logging
import os

import torch

from mcore_rl.convert.hf_mcore import DTYPES, _bar, mcore_to_hf
from mcore_rl.convert.hf_io import CheckpointError, atomic_dir, copy_side_files
from mcore_rl.convert.merge import lora
from mcore_rl.convert.merge.fsdp import FSDPCheckpoint
from mcore_rl.convert.merge.megatron import locate_checkpoint
from mcore_rl.convert.merge.validate import ValidationFailed, checker
from mcore_rl.convert.planned_writer import Planned, PlannedWriter

log = logging.getLogger("mcore_rl.convert.merge")
BACKENDS = ("fsdp", "megatron")

__all__ = ["merge", "merge_fsdp", "merge_megatron", "ValidationFailed", "BACKENDS"]


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def merge_fsdp(dirs: list[str], out: str, manifest: str | None = None, hf_config: str | None = None,
               dtype: str | None = None, max_shard_bytes: int = 5 * 2**30, validate: str | None = None,
               atol: float = 0.0, rtol: float = 0.0, lora_alpha: float | None = None) -> str:
    ck = FSDPCheckpoint(dirs, manifest, hf_config)
    check = checker(validate, atol, rtol)
    cast = DTYPES[dtype] if dtype else None
    groups = ck.rules.groups(ck.base, ck.meta)
    plan = [Planned(n, tuple(t.shape), _cast(t, cast).dtype)
            for g in groups for n, t in ck.rules.to_disk(ck.meta(g)).items()]
    adapter = None
    if ck.lora:
        shapes = {n: ck.sources[n].shape for n in ck.lora}
        adapter = lora.adapter_config(shapes, ck.lora_meta, lora_alpha, os.path.abspath(ck.side))
    with atomic_dir(out) as tmp, _bar(sum(p.nbytes for p in plan), "fsdp -> hf") as bar:
        writer = PlannedWriter(tmp, plan, max_shard_bytes)
        for g in groups:
            _write_group(writer, ck.rules.to_disk(ck.tensors(g)), cast, bar)
        writer.close()
        if adapter:
            lora.write_adapter(tmp, {n: _cast(ck.tensors([n])[n], cast) for n in sorted(ck.lora)}, adapter)
        copy_side_files(ck.side, tmp)
        ck.close()
        if check:
            check(tmp)
    return out


def _write_group(writer: PlannedWriter, tensors: dict[str, torch.Tensor], cast, bar) -> None:
    # a function, so that no reference to this group outlives it while the next one is read
    for name, t in tensors.items():
        t = _cast(t, cast)
        writer.write(name, t)
        bar.update(t.numel() * t.element_size())


def merge_megatron(dirs: list[str], out: str, hf_config: str | None = None, dtype: str | None = None,
                   max_shard_bytes: int = 5 * 2**30, validate: str | None = None,
                   atol: float = 0.0, rtol: float = 0.0) -> str:
    primary, files = locate_checkpoint(dirs)
    return mcore_to_hf(primary, out, hf_config, dtype, max_shard_bytes, files=files,
                       check=checker(validate, atol, rtol))


def merge(backend: str, dirs: list[str], out: str, manifest: str | None = None, **kw) -> str:
    if backend == "fsdp":
        return merge_fsdp(dirs, out, manifest, **kw)
    if backend != "megatron":
        raise CheckpointError(f"unknown backend {backend!r}; choose from {BACKENDS}")
    if manifest:
        raise CheckpointError("--manifest is for the fsdp backend; pass the megatron directories")
    kw.pop("lora_alpha", None)
    return merge_megatron(dirs, out, **kw)
