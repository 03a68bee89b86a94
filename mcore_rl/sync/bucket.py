"""Flattened buckets in SGLang's "flattened_bucket" wire format, without importing SGLang.

A bucket is one uint8 buffer holding its tensors back to back plus, per tensor, (name, shape,
dtype, start, end, numel) with byte offsets: the fields of SGLang's FlattenedTensorMetadata.
vLLM's worker extension unpacks with `unflatten`; tests check both directions against SGLang's own
FlattenedTensorBucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Meta:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int  # bytes, as in SGLang (numel of the uint8 view)


def layout(named: list[tuple[str, torch.Size, torch.dtype]]) -> tuple[list[Meta], int]:
    """Byte offsets for tensors placed back to back; refuses a misaligned one (sort by itemsize)."""
    metas, offset = [], 0
    for name, shape, dtype in named:
        size = torch.Size(shape).numel() * dtype.itemsize
        if offset % dtype.itemsize:
            raise ValueError(f"{name}: byte offset {offset} is not aligned for {dtype}; "
                             "put larger itemsizes first")
        metas.append(Meta(name, torch.Size(shape), dtype, offset, offset + size, size))
        offset += size
    return metas, offset


def flatten(named: list[tuple[str, torch.Tensor]], out: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, list[Meta]]:
    """Copy tensors into one uint8 buffer (`out` to reuse one), returning it and the metadata."""
    metas, total = layout([(n, t.shape, t.dtype) for n, t in named])
    if out is None:
        device = named[0][1].device if named else "cpu"
        out = torch.empty(total, dtype=torch.uint8, device=device)
    elif out.numel() < total:
        raise ValueError(f"bucket buffer of {out.numel()} bytes is smaller than {total}")
    if named:  # one cat, not a copy per tensor: a bucket of experts holds hundreds of small tensors
        torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named], out=out[:total])
    return out[:total], metas


def unflatten(flat: torch.Tensor, metas) -> list[tuple[str, torch.Tensor]]:
    """Views into `flat` for each tensor (any object with Meta's fields works, SGLang's too)."""
    return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in metas]
