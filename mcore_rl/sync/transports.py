"""How a bucket reaches the engine: one small class per path, behind one interface.

- CudaIpcTransport: colocated engines. Each trainer rank flattens its bucket into a buffer on its
  own GPU and serializes it (CUDA IPC handle, not data); the driver hands SGLang one payload per
  engine tp rank (`update_weights_from_tensor(load_format="flattened_bucket")`), and the next
  bucket is gathered while the engine loads this one.
- NcclBroadcastTransport: engines on other GPUs. The driver broadcasts each flattened bucket over a
  group it shares with every engine rank (`init_weights_update_group` /
  `update_weights_from_distributed(load_format="flattened_bucket")`).
- DiskTransport: the fallback. The driver writes sharded HF safetensors atomically (a new
  version directory per sync) and calls `update_weights_from_disk`.
All engine calls sit between `begin_weight_update()` and `end_weight_update()` (SGLang 0.5.23).
"""

from __future__ import annotations

import io
import os
import re
import shutil
import threading
import time
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist

from mcore_rl.sync.bucket import flatten, layout


class Transport:
    """Called on every trainer rank in lockstep; only the driver talks to the engine."""

    engine_wait_s = 0.0  # of a sync, the seconds the driver only waited for the engine (pipelined ones)
    engine_call_s = 0.0  # of a sync, the seconds its engine calls took, from issue to return (pipelined ones)

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


def by_value():
    """(serializer, metadata class) for CPU tensors: the bucket travels as it is (through Ray) and
    the engine's side serializes it for its schedulers (`SGLangServer.update_weights_from_tensor`)."""
    return (lambda obj: obj), dict


class CudaIpcTransport(Transport):
    """`engine_rank_of[trainer rank]` is the index of the payload it produces in the list the
    engine call takes: its engine tp rank, or engine * tp_size + tp rank with several engines.

    Pipelined: the engine loads bucket k (its own process, a thread here waits for it) while every
    rank gathers and flattens bucket k + 1 into the other of two buffers. A buffer is written again
    only once the engine call that read it has returned and every rank has heard so (a barrier)."""

    def __init__(self, engine, engine_rank_of: dict[int, int], driver: int = 0, serializer=None,
                 meta_cls=None, group=None, direct: tuple | None = None, capacity: int = 0):
        """direct: (engine layout, HF model) to have the engine copy each bucket straight into its
        parameters (`engine.load_weights_direct`, rollout.sync_load: direct) instead of loading it
        through SGLang's load_weights. capacity: bytes of this rank's largest bucket, each buffer's
        size from its first use."""
        super().__init__(engine, driver)
        self.direct, self.capacity = direct, capacity
        if serializer is None or meta_cls is None:
            serializer, meta_cls = sglang_wire()
        self.engine_rank_of, self.serialize, self.meta_cls, self.group = engine_rank_of, serializer, meta_cls, group
        self._buffers: list[torch.Tensor | None] = [None, None]  # per sync, alternating between buckets
        self._sent = 0
        self._pending: _Concurrently | None = None  # the driver's engine call still loading

    def begin(self) -> None:
        self._sent, self.engine_wait_s, self.engine_call_s = 0, 0.0, 0.0
        super().begin()

    def send(self, named, last):
        flat, metas = flatten(named, out=self._buffer_for(named, self._sent % 2))
        self._sent += 1
        payload = None
        if dist.get_rank() in self.engine_rank_of:
            payload = self.serialize({"flattened_tensor": flat,
                                      "metadata": [self.meta_cls(**vars(m)) for m in metas]})
        gathered = [None] * dist.get_world_size(self.group) if self.is_driver else None
        dist.gather_object(payload, gathered, dst=self.driver, group=self.group)
        if self.is_driver:
            self._wait()  # the previous bucket's load: its buffer is the next one written
            per_rank = [None] * len(self.engine_rank_of)
            for t, r in self.engine_rank_of.items():
                per_rank[r] = gathered[t]
            if self.direct:
                layout, hf = self.direct
                self._pending = _Concurrently(self.engine.load_weights_direct, payloads=per_rank, layout=layout,
                                              hf=hf, flush_cache=last)
            else:
                self._pending = _Concurrently(self.engine.update_weights_from_tensor, payloads=per_rank,
                                              load_format="flattened_bucket", flush_cache=last)
        dist.barrier(group=self.group)  # the previous bucket's buffer is free on every rank

    def _wait(self) -> None:
        if self._pending is not None:
            t0 = time.perf_counter()
            pending, self._pending = self._pending, None
            pending.join()  # re-raises the engine's error
            self.engine_wait_s += time.perf_counter() - t0
            self.engine_call_s += pending.seconds

    def _buffer_for(self, named, which: int) -> torch.Tensor | None:
        """Bucket buffer `which`, grown to fit `named`: the trainer's share of the sync phase stays
        two buckets plus the gathers filling one, whatever the bucket count. A block sent over IPC
        goes back to the allocator only once the engine has let go of it, so fresh buffers per
        bucket could pile up. Sized at `capacity` from the start: grown bucket by bucket, the
        allocations took 89 of a sync's 226 host ms (Qwen3-30B-A3B, 4 layers, 12 buckets, H200)."""
        from mcore_rl.memory.allocator import ipc_shareable

        if not named or named[0][1].device.type != "cuda":
            return None  # CPU buckets travel by value, a new one each time
        need = layout([(n, t.shape, t.dtype) for n, t in named])[1]
        buf = self._buffers[which]
        if buf is None or buf.numel() < need:
            self._buffers[which] = None  # the smaller one goes first
            with ipc_shareable():  # the engine maps this buffer through CUDA IPC
                self._buffers[which] = torch.empty(max(need, self.capacity), dtype=torch.uint8,
                                                   device=named[0][1].device)
        return self._buffers[which]

    def end(self) -> None:
        try:
            if self.is_driver:
                self._wait()
            dist.barrier(group=self.group)  # the last bucket's buffer too is free on every rank
            super().end()
        finally:
            self._pending = None
            if any(b is not None for b in self._buffers):
                self._buffers = [None, None]
                torch.cuda.ipc_collect()  # frees them once the engine has let go of its mappings


class _Concurrently:
    """Run one engine call in a thread while this thread does the matching collective; join()
    re-raises the call's error (an engine that refused must not look like a finished update)."""

    def __init__(self, fn, **kwargs):
        self.error, self.seconds = None, 0.0  # seconds: how long the call took
        self.thread = threading.Thread(target=self._run, args=(fn, kwargs), daemon=True)
        self.thread.start()

    def _run(self, fn, kwargs):
        t0 = time.perf_counter()
        try:
            fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the joining thread
            self.error = e
        finally:
            self.seconds = time.perf_counter() - t0

    def failed(self) -> bool:
        return not self.thread.is_alive() and self.error is not None

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


class NcclBroadcastTransport(Transport):
    """The driver (rank `driver` of the trainer) is rank 0 of `update_group`; engine ranks 1..tp.
    Any backend works: NCCL on GPUs, gloo on CPU (the group decides)."""

    def __init__(self, engine, update_group, group_name: str = "weight_update_group", driver: int = 0,
                 timeout_s: float = 600.0):
        super().__init__(engine, driver)
        self.group, self.group_name, self.timeout_s = update_group, group_name, timeout_s

    def send(self, named, last):
        if not self.is_driver:
            return
        flat, metas = flatten(named)
        call = _Concurrently(  # the engine posts its receive while we broadcast
            self.engine.update_weights_from_distributed,
            names=[m.name for m in metas], dtypes=[str(m.dtype).removeprefix("torch.") for m in metas],
            shapes=[list(m.shape) for m in metas], group_name=self.group_name,
            load_format="flattened_bucket", flush_cache=last)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        work = self.group.broadcast([flat], opts)
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():  # an engine that failed its receive must not leave us waiting
            if call.failed():
                call.join()  # raises the engine's error
            if time.monotonic() > deadline:
                raise TimeoutError(f"the weight broadcast did not complete within {self.timeout_s:.0f}s "
                                   "(an engine rank died or never joined the update group)")
            time.sleep(0.005)
        call.join()


def update_group(master_address: str, master_port: int, world_size: int, rank: int = 0,
                 backend: str = "nccl", group_name: str = "weight_update_group"):
    """The trainer's end of SGLang's weight-update group (engine ranks join with rank_offset=1).

    The store keys must be the ones SGLang's side uses: its init_custom_process_group goes through
    torch's own path, which nests PrefixStore(group_name), PrefixStore(group_name + "/") and
    PrefixStore(device + "/") over the tcp:// rendezvous store. Built from the public classes here,
    so this process may also host an engine rank that registers the same group name.
    """
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r}: use 'nccl' (GPUs) or 'gloo' (CPU)")
    device = next(iter(BackendConfig(Backend(backend)).get_device_backend_map()))
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0)
    store = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size)


def open_update_group(engine, master_address: str, master_port: int, engine_ranks: int,
                      backend: str = "nccl", group_name: str = "weight_update_group"):
    """Form the weight-update group with the engine: its ranks join (in a thread here, since the
    call returns only once the group exists) while this process joins as rank 0."""
    call = _Concurrently(engine.init_weights_update_group, master_address=master_address,
                         master_port=master_port, rank_offset=1, world_size=1 + engine_ranks,
                         group_name=group_name, backend=backend)
    try:
        group = update_group(master_address, master_port, 1 + engine_ranks, 0, backend, group_name)
    finally:
        call.join()
    return group


class DiskTransport(Transport):
    """Each sync writes sharded HF safetensors to a new version directory `out/vNNNNNN` (atomic
    rename), the engine loads it with update_weights_from_disk, then older versions are removed."""

    def __init__(self, engine, out: str, hf_dir: str | None = None, driver: int = 0,
                 max_shard_bytes: int = 5 << 30):
        super().__init__(engine, driver)
        self.out, self.hf_dir, self.max = os.path.abspath(out), hf_dir, max_shard_bytes
        self.path = self._ctx = self._writer = None

    def _versions(self) -> list[str]:
        names = os.listdir(self.out) if os.path.isdir(self.out) else []
        return sorted(n for n in names if _VERSION.fullmatch(n))

    def begin(self):
        from mcore_rl.convert.hf_io import ShardedWriter, atomic_dir

        if self.is_driver:
            last = self._versions()
            self.path = os.path.join(self.out, f"v{int(last[-1][1:]) + 1 if last else 0:06d}")
            self._ctx = atomic_dir(self.path)
            self._writer = ShardedWriter(self._ctx.__enter__(), self.max)
        super().begin()

    def send(self, named, last):
        if self.is_driver:
            self._writer.add_all(named)

    def end(self):
        from mcore_rl.convert.hf_io import copy_side_files

        if self.is_driver:
            self._writer.close()
            if self.hf_dir:
                copy_side_files(self.hf_dir, self._writer.out)
            self._ctx.__exit__(None, None, None)
            self.engine.update_weights_from_disk(self.path)
            for old in self._versions():  # the engine has read the new version
                if os.path.join(self.out, old) != self.path:
                    shutil.rmtree(os.path.join(self.out, old))
        super().end()


_VERSION = re.compile(r"v\d{6}")
