"""How a bucket reaches the engine: one small class per path, behind one interface.

- CudaIpcTransport: colocated engines. Each trainer rank flattens its bucket into one buffer on its
  own GPU and serializes it (CUDA IPC handle, not data); the driver hands SGLang one payload per
  engine tp rank (`update_weights_from_tensor(load_format="flattened_bucket")`).
- NcclBroadcastTransport: engines on other GPUs. The driver broadcasts each flattened bucket over a
  group it shares with every engine rank (`init_weights_update_group` /
  `update_weights_from_distributed(load_format="flattened_bucket")`).
- DiskTransport: the fallback. The driver writes sharded HF safetensors atomically and calls
  `update_weights_from_disk`.
All engine calls sit between `begin_weight_update()` and `end_weight_update()` (SGLang 0.5.23).
"""

from __future__ import annotations

import io
import os
import threading
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist

from mcore_rl.sync.bucket import flatten


class Transport:
    """Called on every trainer rank in lockstep; only the driver talks to the engine."""

    def __init__(self, engine, driver: int = 0):
        self.engine, self.driver = engine, driver

    @property
    def is_driver(self) -> bool:
        return dist.get_rank() == self.driver

    def begin(self) -> None:
        if self.is_driver:
            self.engine.begin_weight_update()

    def send(self, named: list[tuple[str, torch.Tensor]], last: bool) -> None:
        raise NotImplementedError

    def end(self) -> None:
        if self.is_driver:
            self.engine.end_weight_update()


def torch_serializer(obj) -> bytes:
    """ForkingPickler bytes, as SGLang's MultiprocessingSerializer writes them (CUDA -> IPC handle)."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


def sglang_wire():
    """(serializer, metadata class) for a real SGLang engine; SGLang's unpickler accepts only its own
    FlattenedTensorMetadata, and CUDA handles must carry GPU UUIDs (monkey_patch_torch_reductions)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    monkey_patch_torch_reductions()
    return MultiprocessingSerializer.serialize, FlattenedTensorMetadata


class CudaIpcTransport(Transport):
    def __init__(self, engine, engine_rank_of: dict[int, int], driver: int = 0, serializer=None,
                 meta_cls=None, group=None):
        super().__init__(engine, driver)
        if serializer is None or meta_cls is None:
            serializer, meta_cls = sglang_wire()
        self.engine_rank_of, self.serialize, self.meta_cls, self.group = engine_rank_of, serializer, meta_cls, group

    def send(self, named, last):
        flat, metas = flatten(named)
        payload = None
        if dist.get_rank() in self.engine_rank_of:
            payload = self.serialize({"flattened_tensor": flat,
                                      "metadata": [self.meta_cls(**vars(m)) for m in metas]})
        gathered = [None] * dist.get_world_size(self.group) if self.is_driver else None
        dist.gather_object(payload, gathered, dst=self.driver, group=self.group)
        if self.is_driver:
            per_rank = [None] * len(self.engine_rank_of)
            for t, r in self.engine_rank_of.items():
                per_rank[r] = gathered[t]
            self.engine.update_weights_from_tensor(per_rank, load_format="flattened_bucket", flush_cache=last)
        dist.barrier(group=self.group)  # the engine has copied out of every rank's buffer


class NcclBroadcastTransport(Transport):
    """The driver (rank `driver` of the trainer) is rank 0 of `update_group`; engine ranks 1..tp."""

    def __init__(self, engine, update_group, group_name: str = "weight_update_group", driver: int = 0):
        super().__init__(engine, driver)
        self.group, self.group_name = update_group, group_name

    def send(self, named, last):
        if not self.is_driver:
            return
        flat, metas = flatten(named)
        call = threading.Thread(target=self.engine.update_weights_from_distributed, kwargs=dict(
            names=[m.name for m in metas], dtypes=[str(m.dtype).removeprefix("torch.") for m in metas],
            shapes=[list(m.shape) for m in metas], group_name=self.group_name,
            load_format="flattened_bucket", flush_cache=last))
        call.start()  # the engine posts its receive while we broadcast
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([flat], opts).wait()
        call.join()


def update_group(master_address: str, master_port: int, world_size: int, rank: int = 0,
                 backend: str = "nccl"):
    """The trainer's end of SGLang's weight-update group (engine ranks join with rank_offset=1)."""
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size)


class DiskTransport(Transport):
    """Sharded HF safetensors under `out` (atomic rename), then update_weights_from_disk."""

    def __init__(self, engine, out: str, hf_dir: str | None = None, driver: int = 0,
                 max_shard_bytes: int = 5 << 30):
        super().__init__(engine, driver)
        self.out, self.hf_dir, self.max = out, hf_dir, max_shard_bytes
        self._ctx = self._writer = None

    def begin(self):
        from converters.hf_io import ShardedWriter, atomic_dir

        if self.is_driver:
            self._ctx = atomic_dir(self.out)
            self._writer = ShardedWriter(self._ctx.__enter__(), self.max)
        super().begin()

    def send(self, named, last):
        if self.is_driver:
            self._writer.add_all(named)

    def end(self):
        from converters.hf_io import copy_side_files

        if self.is_driver:
            self._writer.close()
            if self.hf_dir:
                copy_side_files(self.hf_dir, self._writer.out)
            self._ctx.__exit__(None, None, None)
            self.engine.update_weights_from_disk(os.path.abspath(self.out))
        super().end()
