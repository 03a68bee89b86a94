"""The trainer's CUDA caching allocator on expandable segments, with plain segments for IPC.

Each colocated step frees the trainer's states and cache for the engine, then rebuilds them and
runs the update; with fixed-size segments the update's activations land in whatever gaps the
states left, and the reserved-but-unused memory shows up as a peak the plan cannot know.
Expandable segments map pages into one growing range instead (and `empty_cache` unmaps them), so
what is reserved follows what is allocated.

CUDA IPC cannot always open expandable-segment memory (SGLang refuses it, torch's support varies by
version), so the weight-sync buffers the engine maps are allocated inside `ipc_shareable()`.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

_enabled = False


def _set(setting: str) -> None:
    # newer torch has it under torch._C, and the old name warns on every call
    fn = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    fn(setting)


def use_expandable_segments(on: bool) -> None:
    """Set once per trainer process, before its states are allocated (GPU only)."""
    global _enabled
    if torch.cuda.is_available():
        _set(f"expandable_segments:{on}")
        _enabled = on


@contextmanager
def ipc_shareable():
    """Allocations made inside come from plain cudaMalloc segments, which CUDA IPC can share."""
    if not _enabled:
        yield
        return
    _set("expandable_segments:False")
    try:
        yield
    finally:
        _set("expandable_segments:True")
