"""Sharded safetensors output whose layout is planned before the first byte is written.

`hf_io.ShardedWriter` keeps a whole shard in memory until it is full. The converter and the
merger know every output name, shape and dtype up front (from metadata only), so they write each
shard's header first and then stream every tensor straight to its place: memory is one tensor.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from mcore_rl.convert.hf_io import INDEX, SAFETENSORS_DTYPES, CheckpointError


@dataclass(frozen=True)
class Planned:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _header(entries: list[Planned]) -> bytes:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for e in entries:
        header[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


class PlannedWriter:
    """Write tensors, in plan order, into `out/model-0000i-of-0000n.safetensors` plus the index."""

    def __init__(self, out: str, plan: list[Planned], max_shard_bytes: int = 5 * 2**30):
        self.out, self.plan = out, plan
        self.shards: list[list[Planned]] = [[]]
        size = 0
        for e in plan:
            if self.shards[-1] and size + e.nbytes > max_shard_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append(e)
            size += e.nbytes
        n = len(self.shards)
        self.files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self._next = 0  # index into plan
        self._shard, self._file = -1, None

    def write(self, name: str, t: torch.Tensor) -> None:
        if self._next >= len(self.plan):
            raise CheckpointError(f"{name}: more tensors than planned")
        want = self.plan[self._next]
        if (name, tuple(t.shape), t.dtype) != (want.name, want.shape, want.dtype):
            raise CheckpointError(f"expected {want} next, got {name} {tuple(t.shape)} {t.dtype}")
        if self._file is None or self._pos == len(self.shards[self._shard]):
            self._open_next()
        data = t.detach().contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))
        self._pos += 1
        self._next += 1

    def _open_next(self):
        if self._file is not None:
            self._file.close()
        self._shard += 1
        self._file = open(os.path.join(self.out, self.files[self._shard]), "wb")
        self._file.write(_header(self.shards[self._shard]))
        self._pos = 0

    def close(self) -> dict[str, str]:
        if self._file is not None:
            self._file.close()
        if self._next != len(self.plan):
            raise CheckpointError(f"only {self._next} of {len(self.plan)} planned tensors were written")
        weight_map = {e.name: f for f, shard in zip(self.files, self.shards) for e in shard}
        total = sum(e.nbytes for e in self.plan)
        with open(os.path.join(self.out, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        return weight_map
