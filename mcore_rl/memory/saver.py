"""torch_memory_saver, decided once and guarded.

- `decide(enabled, hook_mode)` fixes the hook mode for the process. Importing megatron-core sets
  `torch_memory_saver.hook_mode = "torch"` (inference/contexts/dynamic_context.py), and raises if
  the saver was already used. So `decide` runs megatron's import first (if megatron is installed)
  and sets our mode after it; a later megatron import is then a no-op. Call it before building
  any model; a second call with other arguments is refused.
- Without torch_memory_saver or CUDA the saver is a no-op that keeps the same bookkeeping, so
  the choreography runs (and is tested) on CPU.
- `resume` checks the device's free memory against the bytes the tag released before calling
  torch_memory_saver, whose resume calls exit(1) on CUDA_ERROR_OUT_OF_MEMORY with no traceback.
- Routed experts can be allocated in chunk tags (`chunk_tags`) and resumed one chunk at a time.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch

MiB = 1 << 20


class SaverOrderError(RuntimeError):
    """The saver mode was decided twice, or after torch_memory_saver was already in use."""


class ResumeRefused(MemoryError):
    """Resuming a tag would not fit in the GPU's free memory (instead of exit(1) in the saver)."""

    def __init__(self, tag: str, need: int, free: int):
        self.tag, self.need, self.free = tag, need, free
        super().__init__(f"refusing to resume memory-saver tag {tag!r}: it needs {need / MiB:,.0f} MiB "
                         f"but the GPU has {free / MiB:,.0f} MiB free (short by {(need - free) / MiB:,.0f} "
                         "MiB); release the trainer's states first or lower rollout.mem_fraction_static")


@dataclass
class _Tag:
    allocated: int = 0  # bytes measured when the region was allocated
    released: int = 0  # bytes measured when it was last paused
    paused: bool = False


def _free_bytes() -> int:
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0


@dataclass
class MemorySaver:
    """Region/pause/resume per tag over torch_memory_saver, or a no-op (`impl` None)."""

    impl: object | None
    hook_mode: str | None
    reason: str = ""  # why the saver is a no-op
    margin: int = 256 * MiB  # left free after a resume (allocator slack, NCCL)
    tags: dict[str, _Tag] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.impl is not None

    @contextlib.contextmanager
    def region(self, tag: str, cpu_backup: bool = False):
        """Allocations inside belong to `tag`. Sync/IPC buffers must be allocated outside."""
        info = self.tags.setdefault(tag, _Tag())
        if info.paused:
            raise RuntimeError(f"memory-saver tag {tag!r} is paused; resume it before allocating in it")
        if not self.active:
            yield
            return
        torch.cuda.synchronize()
        before = _free_bytes()
        with self.impl.region(tag=tag, enable_cpu_backup=cpu_backup):
            yield
        torch.cuda.synchronize()
        info.allocated += max(0, before - _free_bytes())

    def pause(self, tag: str) -> int:
        """Release `tag`'s memory; returns the bytes the device got back (0 when a no-op)."""
        info = self._known(tag)
        if info.paused:
            raise RuntimeError(f"memory-saver tag {tag!r} is already paused")
        freed = 0
        if self.active:
            torch.cuda.synchronize()
            before = _free_bytes()
            self.impl.pause(tag)
            freed = max(0, _free_bytes() - before)
        info.released, info.paused = freed, True
        return freed

    def need(self, tag: str) -> int:
        info = self._known(tag)
        return max(info.allocated, info.released)

    def resume(self, tag: str) -> None:
        """Resume `tag` if its bytes (plus the margin) fit; raise ResumeRefused otherwise."""
        info = self._known(tag)
        if not info.paused:
            raise RuntimeError(f"memory-saver tag {tag!r} is not paused")
        if self.active:
            need = self.need(tag) + self.margin
            free = _free_bytes()
            if free < need:
                torch.cuda.empty_cache()  # cached blocks of the default pool count as used
                free = _free_bytes()
            if free < need:
                raise ResumeRefused(tag, need, free)
            self.impl.resume(tag)
        info.paused = False

    def resume_in_order(self, tags) -> None:
        """Resume tags one at a time (weights before KV cache, experts chunk by chunk)."""
        for tag in tags:
            self.resume(tag)

    def _known(self, tag: str) -> _Tag:
        if tag not in self.tags:
            raise KeyError(f"unknown memory-saver tag {tag!r}; allocate it in region({tag!r}) first")
        return self.tags[tag]


def chunk_tags(prefix: str, sizes: list[int], limit: int) -> list[str]:
    """A tag per item, grouping consecutive items into chunks of at most `limit` bytes."""
    tags, chunk, used = [], 0, 0
    for n in sizes:
        if used and used + n > limit:
            chunk, used = chunk + 1, 0
        tags.append(f"{prefix}/{chunk}")
        used += n
    return tags


_DECIDED: tuple[tuple, MemorySaver] | None = None


def decide(enabled: bool = True, hook_mode: str = "torch") -> MemorySaver:
    """The process's saver; the first call decides, later calls must agree."""
    global _DECIDED
    key = (enabled, hook_mode)
    if _DECIDED is not None:
        if _DECIDED[0] != key:
            raise SaverOrderError(f"memory saver already decided as enabled={_DECIDED[0][0]}, "
                                  f"hook_mode={_DECIDED[0][1]!r}; asked for enabled={enabled}, "
                                  f"hook_mode={hook_mode!r}")
        return _DECIDED[1]
    if hook_mode not in ("torch", "preload"):
        raise ValueError(f"hook_mode must be 'torch' or 'preload', got {hook_mode!r}")
    saver = _make(enabled, hook_mode)
    _DECIDED = (key, saver)
    return saver


def _make(enabled: bool, hook_mode: str) -> MemorySaver:
    if not enabled:
        return MemorySaver(None, None, "disabled in the config")
    if not torch.cuda.is_available():
        return MemorySaver(None, None, "no CUDA device")
    try:
        from torch_memory_saver import torch_memory_saver as tms
    except ImportError:
        return MemorySaver(None, None, "torch_memory_saver is not installed")
    if getattr(tms, "_impl", None) is not None:
        raise SaverOrderError("torch_memory_saver was used before its mode was decided; call "
                              "mcore_rl.memory.saver.decide() first thing in the process")
    try:  # megatron assigns hook_mode = "torch" at import: let it happen now, not after us
        import megatron.core.inference.contexts.dynamic_context  # noqa: F401
    except ImportError:
        pass
    if hook_mode == "preload" and "torch_memory_saver" not in os.environ.get("LD_PRELOAD", ""):
        raise SaverOrderError("hook_mode 'preload' needs the process started with torch_memory_saver's "
                              "library in LD_PRELOAD (preload_env() gives the environment)")
    tms.hook_mode = hook_mode
    return MemorySaver(tms, hook_mode)


def preload_env(env: dict | None = None) -> dict:
    """A copy of `env` with torch_memory_saver's preload library in LD_PRELOAD (for a child)."""
    from torch_memory_saver.hooks.mode_preload import configure_subprocess

    env = dict(os.environ if env is None else env)
    with configure_subprocess():  # sets LD_PRELOAD for the duration of the block only
        env["LD_PRELOAD"] = os.environ["LD_PRELOAD"]
    return env
