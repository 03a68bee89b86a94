"""Read `torch.save` files lazily: structure first (no tensor bytes), then one tensor at a time.

`torch.load(map_location="meta", weights_only=True)` gives the whole structure with meta tensors
whose storages carry their byte offset in the file (`_checkpoint_offset`); `read` then fetches
exactly the bytes of one tensor with a positioned read. Unlike `mmap=True`, nothing stays mapped,
so resident memory does not grow with the amount read.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from mcore_rl.convert.hf_io import CheckpointError


def _dtensor_types() -> list:
    """The types a DTensor pickle refers to (FSDP2 and FSDP1-with-device-mesh state dicts)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _dtensor_spec as spec
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    types = [DeviceMesh, DTensor, spec.DTensorSpec, spec.TensorMeta, Partial, Replicate, Shard]
    return types + ([spec.ShardOrderEntry] if hasattr(spec, "ShardOrderEntry") else [])


@contextlib.contextmanager
def _quiet_device_mesh():
    # unpickling a DeviceMesh without process groups logs a torch.compile warning per file
    logger = logging.getLogger("torch.distributed.device_mesh")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def local_tensor(v) -> torch.Tensor:
    """The tensor whose bytes are in the file: a DTensor's local shard, or the tensor itself."""
    return v._local_tensor if hasattr(v, "_local_tensor") else v


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) element of the storage that `t` touches."""
    if t.numel() == 0:
        return t.storage_offset(), t.storage_offset()
    return t.storage_offset(), t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1


class TorchFile:
    """One `torch.save` file: `.state` is its object with meta tensors; `read(t)` loads one tensor."""

    def __init__(self, path: str, what: str = "file"):
        self.path, self.size = path, os.path.getsize(path)
        try:
            with _quiet_device_mesh(), torch.serialization.safe_globals(_dtensor_types()):
                self.state = torch.load(path, map_location="meta", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any failure to parse is reported with the file name
            msg = str(e).strip().splitlines()[0]
            hint = (" (FSDP1 ShardedTensor state dicts are not supported: save FSDP1 with a device mesh "
                    "so that it writes DTensors)") if "ShardedTensor" in str(e) else ""
            raise CheckpointError(f"{path}: cannot read {what}: {msg}{hint}") from None
        self._fh = None

    def check_tensor(self, name: str, t: torch.Tensor) -> None:
        """Every byte `t` needs lies inside the file (catches files cut short)."""
        lo, hi = _extent(t)
        end = t.untyped_storage()._checkpoint_offset + hi * t.element_size()
        if end > self.size:
            raise CheckpointError(f"{self.path}: truncated: {name} needs bytes up to {end}, "
                                  f"file has {self.size}")

    def read(self, t: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """The real contents of meta tensor `t` (which must come from this file's `state`),
        read straight into `into` when both are contiguous (no temporary buffer)."""
        lo, hi = _extent(t)
        item = t.element_size()
        direct = into is not None and t.is_contiguous() and into.is_contiguous()
        buf = into.reshape(-1).view(torch.uint8) if direct else torch.empty((hi - lo) * item, dtype=torch.uint8)
        if self._fh is None:
            self._fh = open(self.path, "rb")
        self._fh.seek(t.untyped_storage()._checkpoint_offset + lo * item)
        if buf.numel() and self._fh.readinto(memoryview(buf.numpy())) != buf.numel():
            raise CheckpointError(f"{self.path}: truncated while reading")
        if direct:
            return into
        out = buf.view(t.dtype).as_strided(t.shape, t.stride())
        return out if into is None else into.copy_(out)

    def close(self):
        if self._fh is not None:
            self._fh.close()
            self._fh = None
