"""GPU memory readings from NVML, matched by UUID (NVML indices ignore CUDA_VISIBLE_DEVICES).

`visible_uuids()` resolves CUDA_VISIBLE_DEVICES entries (NVML indices, full UUIDs or unique UUID
prefixes, as CUDA accepts them) to UUIDs and refuses duplicates such as "0,1,0,1", which CUDA
would otherwise turn into two torch devices sharing one GPU (and one memory budget).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


class GpuSelectionError(ValueError):
    pass


class NvmlUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class GpuMemory:
    uuid: str
    index: int  # NVML index (physical order), not the torch device index
    total: int
    used: int
    free: int


def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception as e:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded
        raise NvmlUnavailable(f"NVML is not available: {e}") from None


def all_gpus() -> list[GpuMemory]:
    """Every GPU of the node as NVML sees it (physical order)."""
    nv = _nvml()
    out = []
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        uuid = nv.nvmlDeviceGetUUID(h)
        out.append(GpuMemory(uuid.decode() if isinstance(uuid, bytes) else uuid, i,
                             int(mem.total), int(mem.used), int(mem.free)))
    return out


def process_usage(index: int) -> dict[int, int]:
    """{pid: bytes} of the compute processes on GPU `index` (NVML order). A process NVML lists
    without a figure (no permission) is left out."""
    nv = _nvml()
    procs = nv.nvmlDeviceGetComputeRunningProcesses(nv.nvmlDeviceGetHandleByIndex(index))
    return {p.pid: int(p.usedGpuMemory) for p in procs if p.usedGpuMemory}


def parse_visible(spec: str | None, uuids: list[str]) -> list[str]:
    """UUIDs named by a CUDA_VISIBLE_DEVICES value, given the node's UUIDs in NVML order.

    None means all GPUs. CUDA stops at the first invalid entry; we refuse it instead, so a typo
    cannot silently shrink the job.
    """
    if spec is None:
        return list(uuids)
    out: list[str] = []
    for raw in (s.strip() for s in spec.split(",")):
        if not raw:
            raise GpuSelectionError(f"CUDA_VISIBLE_DEVICES={spec!r} has an empty entry")
        if raw.lstrip("-").isdigit():
            i = int(raw)
            if not 0 <= i < len(uuids):
                raise GpuSelectionError(f"CUDA_VISIBLE_DEVICES={spec!r}: index {i} is not one of the "
                                        f"node's {len(uuids)} GPUs")
            uuid = uuids[i]
        else:
            key = raw if raw.startswith(("GPU-", "MIG-")) else f"GPU-{raw}"
            matches = [u for u in uuids if u.startswith(key)]
            if len(matches) != 1:
                raise GpuSelectionError(f"CUDA_VISIBLE_DEVICES={spec!r}: {raw!r} matches "
                                        f"{len(matches)} GPUs (need exactly one)")
            uuid = matches[0]
        if uuid in out:
            raise GpuSelectionError(f"CUDA_VISIBLE_DEVICES={spec!r} names GPU {uuid} twice; two "
                                    "devices would share one GPU's memory")
        out.append(uuid)
    return out


def visible_gpus(env: dict | None = None) -> list[GpuMemory]:
    """Readings of this process's visible GPUs, in torch device order."""
    env = os.environ if env is None else env
    gpus = all_gpus()
    by_uuid = {g.uuid: g for g in gpus}
    return [by_uuid[u] for u in parse_visible(env.get("CUDA_VISIBLE_DEVICES"), [g.uuid for g in gpus])]


def reading_for(uuid: str) -> GpuMemory:
    for g in all_gpus():
        if g.uuid == uuid:
            return g
    raise GpuSelectionError(f"no GPU with UUID {uuid} on this node")


def torch_device_uuid(index: int) -> str:
    """The NVML-style UUID ('GPU-...') of torch device `index`."""
    import torch

    raw = str(torch.cuda.get_device_properties(index).uuid)
    return raw if raw.startswith(("GPU-", "MIG-")) else f"GPU-{raw}"


def plan_capacity(gpu_memory_gb: float | None, env: dict | None = None) -> tuple[int, str]:
    """Bytes to plan for on each GPU and where the number came from.

    The smallest free memory among the visible GPUs (NVML), capped by `gpu_memory_gb` when it
    is set; without NVML, `gpu_memory_gb` alone.
    """
    cap = None if gpu_memory_gb is None else int(gpu_memory_gb * (1 << 30))
    try:
        gpus = visible_gpus(env)
    except NvmlUnavailable:
        gpus = []
    if gpus:
        free = min(g.free for g in gpus)
        source = f"NVML: least free of {len(gpus)} visible GPUs"
        if cap is not None and cap < free:
            return cap, "memory.gpu_memory_gb (below NVML's free memory)"
        return free, source
    if cap is None:
        raise GpuSelectionError("no GPU readings (NVML unavailable or no GPUs): set memory.gpu_memory_gb")
    return cap, "memory.gpu_memory_gb (no NVML)"
