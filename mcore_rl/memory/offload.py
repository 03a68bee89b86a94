"""Move a trainer's parameters, gradients and optimizer states to host memory and back.

Tensors keep their identity (only `.data` moves), so the model, the optimizer and any views
into them stay valid. Host buffers are pinned, allocated on the first offload and reused, so
repeated cycles do not grow host memory.
"""

from __future__ import annotations

import contextlib

import torch


class StateOffloader:
    def __init__(self, params: list[torch.Tensor], optimizers: list[torch.optim.Optimizer] = ()):
        self.params = list(params)
        self.optimizers = list(optimizers)
        self._host: dict[tuple, torch.Tensor] = {}
        self.device: torch.device | None = None

    def _tensors(self):
        """(key, tensor) for every tensor to move; keys are stable across cycles."""
        for i, p in enumerate(self.params):
            yield ("param", i), p
            if p.grad is not None:
                yield ("grad", i), p.grad
        for k, opt in enumerate(self.optimizers):
            for j, group in enumerate(opt.param_groups):
                for i, p in enumerate(group["params"]):
                    for name, v in opt.state.get(p, {}).items():
                        if torch.is_tensor(v) and v.dim() > 0:  # Adam's 'step' is a CPU scalar
                            yield ("opt", k, j, i, name), v

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self._tensors())

    @torch.no_grad()
    def offload(self) -> int:
        """Copy everything to host buffers and free the device copies; returns bytes moved."""
        moved = 0
        for key, t in self._tensors():
            if t.device.type == "cpu" and key in self._host and t.data_ptr() == self._host[key].data_ptr():
                continue  # already offloaded
            self.device = t.device
            host = self._host.get(key)
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                                   pin_memory=torch.cuda.is_available())
                self._host[key] = host
            host.copy_(t.data, non_blocking=True)
            t.data = host
            moved += host.numel() * host.element_size()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return moved

    @torch.no_grad()
    def onload(self, device: torch.device | str | None = None) -> None:
        device = torch.device(device) if device is not None else self.device
        if device is None:
            return  # never offloaded
        for _, t in self._tensors():
            if t.device != device:
                t.data = t.data.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()


class PinnedBuffer:
    """`nbytes` of page-locked host memory, exactly: a plain host allocation registered with CUDA.

    torch's pinned allocator (`pin_memory=True`) rounds every block up to a power of two and keeps
    freed blocks cached for reuse, so buffers re-made at a new size (optimizer states appear after
    the first step) held about twice the state on the host. `free()` unregisters and lets go at once.
    """

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.registered = bool(nbytes) and torch.cuda.is_available()  # plain host memory on a CPU-only run
        if self.registered:
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {err}")

    def free(self) -> None:
        if self.tensor is not None and self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        self.tensor = None


class StorageOffloader:
    """Moves whole storages to pinned host memory and back: the device memory is freed (the storage
    shrinks to 0 bytes) but every tensor and view into it stays the same object, so megatron's
    contiguous param/grad buffers, the params viewing them and the optimizer's shard views all stay
    valid. `tensors()` is asked at every offload (optimizer states appear after the first step);
    host buffers are reused while the storages keep their sizes. While offloaded, `read(t)` gives
    a tensor's values from the host copy (the weight sync streams them to the GPU bucket by bucket).
    Used for the trainer's states while a colocated engine runs (`MegatronActor.offload_states`).
    `device_type` is where the live storages are: "cuda" in runs, "cpu" where a CPU test drives the
    same moves.
    """

    def __init__(self, tensors, device_type: str = "cuda"):
        self.tensors, self.device_type = tensors, device_type
        self.storages: list = []
        self.host: list[PinnedBuffer] = []
        self.by_storage: dict[int, torch.Tensor] = {}  # StorageImpl address -> its host copy


    @property
    def offloaded(self) -> bool:
        return bool(self.by_storage)

    @torch.no_grad()
    def offload(self) -> int:
        if self.offloaded:
            return 0
        self.wait()  # a background onload still copying into these storages finishes first
        self.storages = live_storages(self.tensors(), self.device_type)
        sizes = [s.nbytes() for s in self.storages]
        if sizes != [h.nbytes for h in self.host]:
            # the old copies are stale (the live states are on the GPU): free them before the new
            # ones exist, so host memory never holds two sets (optimizer states appear after step 1)
            for h in self.host:
                h.free()
            self.host = [PinnedBuffer(n) for n in sizes]
        for s, host in zip(self.storages, self.host):
            host.tensor.copy_(torch.empty(0, dtype=torch.uint8, device=s.device).set_(s), non_blocking=True)
        _synchronize(self.device_type)
        for s, host in zip(self.storages, self.host):
            self.by_storage[s._cdata] = host.tensor
            s.resize_(0)
        if self.device_type == "cuda":
            torch.cuda.empty_cache()  # the engine's processes cannot use our allocator's cached blocks
        return sum(sizes)

    @torch.no_grad()
    def onload(self, background: bool = False) -> None:
        """Back to the device. With `background` (CUDA), the copies run on a side stream and this
        returns at once: the memory is taken now, the values arrive while the caller computes, and
        `wait()` must come before anything reads them."""
        if not self.offloaded:
            return
        for s, host in zip(self.storages, self.host):
            s.resize_(host.nbytes)  # taken on the current stream, as the states' users will use it
        side = torch.cuda.Stream() if background and self.device_type == "cuda" else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())  # the memory's last users are done first
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for s, host in zip(self.storages, self.host):
                torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).copy_(host.tensor, non_blocking=True)
        if side is None:
            _synchronize(self.device_type)
        else:
            self._arrived = side.record_event()
        self.by_storage.clear()

    def wait(self) -> None:
        """The current stream waits for a background onload's copies (a no-op when none is pending)."""
        ev, self._arrived = getattr(self, "_arrived", None), None
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)

    def read(self, t: torch.Tensor) -> torch.Tensor:
        """`t` itself, or, while its storage is offloaded, the same view of the host copy."""
        host = self.by_storage.get(t.untyped_storage()._cdata)
        if host is None:
            return t
        return torch.empty(0, dtype=t.dtype).set_(host.untyped_storage(), t.storage_offset(), t.size(), t.stride())


class StorageDropper:
    """Frees whole storages whose values are not needed after the phase change, and gives them back
    zeroed: the gradient buffers, which every optimizer step zeroes before its first backward
    (`optim.zero_grad`), so carrying them to the host and back would move bytes nobody reads.
    Tensors and views keep their identity, as with StorageOffloader."""

    def __init__(self, tensors, device_type: str = "cuda"):
        self.tensors, self.device_type = tensors, device_type
        self.dropped: dict[int, tuple] = {}  # StorageImpl address -> (storage, its bytes)

    @property
    def offloaded(self) -> bool:
        return bool(self.dropped)

    @property
    def by_storage(self) -> dict:
        return {}  # nothing is kept: a dropped storage has no copy to read

    def dropped_bytes(self) -> dict[int, int]:
        return {k: n for k, (_, n) in self.dropped.items()}

    def offload(self) -> int:
        """Frees the storages; returns the bytes moved (none)."""
        if self.offloaded:
            return 0
        self.dropped = {s._cdata: (s, s.nbytes()) for s in live_storages(self.tensors(), self.device_type)}
        _synchronize(self.device_type)  # no kernel may still write what is freed
        for s, _ in self.dropped.values():
            s.resize_(0)
        return 0

    @torch.no_grad()
    def onload(self) -> None:
        for s, n in self.dropped.values():
            s.resize_(n)
            torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).zero_()
        self.dropped.clear()

    def read(self, t: torch.Tensor) -> torch.Tensor:
        return t


def live_storages(tensors, device_type: str) -> list:
    """The distinct, not yet freed storages under `tensors` that live on `device_type`."""
    out, seen = [], set()
    for t in tensors:
        s = t.untyped_storage()
        if t.device.type == device_type and s._cdata not in seen and s.nbytes():
            seen.add(s._cdata)
            out.append(s)
    return out


def _synchronize(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()
