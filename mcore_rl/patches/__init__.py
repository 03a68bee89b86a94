"""Patches to megatron-core, by cause, each named, saying why it exists and gated on the
megatron-core versions it was written against:

- `megatron`: bugs and host syncs of megatron-core itself (each names the upstream version);
- `no_te`: megatron's fallbacks for running without TransformerEngine or Apex;
- `cpu`: stand-ins for the CUDA calls megatron makes even on a CPU build; imported only on CPU.

`apply()` is idempotent and runs before a model is built (`mcore_rl.models.builder.build_model`). Model
semantics are not patched: DeepSeek/GLM routing is a router class in the layer spec
(mcore_rl.models.router).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os

import torch

from mcore_rl.patches.cuda_proxy import CUDA_CALLERS, CpuTorch, without_module
from mcore_rl.patches.patch import Patch

log = logging.getLogger(__name__)

PATCHED_VERSIONS = ("0.16.",)
# Comma-separated patch names that apply() leaves out (benchmarks measure the unpatched path).
SKIP_ENV = "MCORE_RL_SKIP_PATCHES"


_applied: set[str] = set()


def megatron_version() -> str:
    from megatron.core.package_info import __version__

    return __version__


def patches_for(cpu: bool) -> tuple[Patch, ...]:
    """The patches of this device: the CPU stand-ins only on a CPU (their module is not imported
    elsewhere)."""
    from mcore_rl.patches import megatron, no_te

    if not cpu:
        return megatron.PATCHES + no_te.PATCHES
    from mcore_rl.patches import cpu as cpu_patches

    return megatron.PATCHES + no_te.PATCHES + cpu_patches.PATCHES


def apply(cpu: bool | None = None) -> list[str]:
    """Apply the patches that this megatron-core version and device need; return their names."""
    version = megatron_version()
    if not version.startswith(PATCHED_VERSIONS):
        log.warning("megatron-core %s is not one the patches were written for (%s); applying none",
                    version, PATCHED_VERSIONS)
        return []
    cpu = (not torch.cuda.is_available()) if cpu is None else cpu
    patches = patches_for(cpu)
    skip = {n.strip() for n in os.environ.get(SKIP_ENV, "").split(",") if n.strip()}
    unknown = skip - {p.name for p in patches}
    if unknown:
        raise ValueError(f"{SKIP_ENV} names unknown patches: {sorted(unknown)}")
    for patch in patches:
        if patch.name in _applied or patch.name in skip:
            continue
        patch.fn()
        _applied.add(patch.name)
        log.debug("patch %s (%s): %s", patch.name, patch.upstream, patch.why)
    return sorted(_applied)


# those of them a model build runs (not the optimizer's or the checkpoint writer's, whose code a
# background save may be running in another thread of the same process)
BUILD_CUDA_CALLERS = tuple(m for m in CUDA_CALLERS if m.startswith(
    ("megatron.core.models.", "megatron.core.transformer.", "megatron.core.tensor_parallel.")))


@contextlib.contextmanager
def cuda_untouched(modules: tuple[str, ...] = BUILD_CUDA_CALLERS):
    """Within: flashinfer is not imported and `modules` see the CPU as their torch.cuda, so importing
    megatron and a meta-device build (the planner's and converter's skeleton) open no CUDA context on
    a GPU host. megatron's models import flashinfer, whose import asks the GPU; RoPE and the router ask
    torch.cuda.current_device() (MLA's RoPE ignores use_cpu_initialization). 0.6 GiB held all run
    otherwise."""
    with without_module("flashinfer"):
        apply()  # first: what is restored below must include the CPU patches a build inside would apply
        mods = [importlib.import_module(m) for m in modules]
        saved = [m.torch for m in mods]
        for m in mods:
            m.torch = CpuTorch("torch")
        try:
            yield
        finally:
            for m, t in zip(mods, saved):
                m.torch = t


__all__ = ["Patch", "SKIP_ENV", "apply", "cuda_untouched", "megatron_version", "patches_for"]
