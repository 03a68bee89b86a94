"""Where one training step's time goes, from a torch.profiler chrome trace.

Three views of one step (the `step` user annotation's window):
- phases: GPU time of the kernels launched inside each of the code's record_function ranges
  (PHASES: packing, forward, loss head, optimizer) and inside autograd's backward nodes (backward,
  with recompute; the DDP hooks' fp32 grad accumulation apart), on every stream;
- kernels: GPU time by kernel kind (attention, grouped and dense GEMMs, NCCL collectives by type,
  compiled Triton kernels, copies, the rest);
- timeline: the step's wall time, the time some kernel ran (busy), idle gaps, and how much of the
  NCCL time no compute kernel hid (exposed communication);
plus host synchronisations: CUDA sync calls and blocking copies (count and host time), and the ops
that read device values on the host (.item(), .tolist(), nonzero).
On a CPU-only trace there are no kernels: phases then report host time.
"""

from __future__ import annotations

import json

# record_function ranges in mcore_rl (actor, pipeline, optim) -> phase
PHASES = {"actor/pack": "pack + unpack", "model/forward": "forward", "model/loss": "loss head",
          "optim/finalize_grads": "grad reduce (finalize)", "optim/step": "optimizer step"}
BACKWARD = "autograd::engine::evaluate_function"
ACCUMULATE = "AccumulateGrad"
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
HOST_READS = ("aten::_local_scalar_dense", "aten::nonzero")
NCCL_KINDS = (("allgather", "NCCL all-gather"), ("reducescatter", "NCCL reduce-scatter"),
              ("allreduce", "NCCL all-reduce"), ("alltoall", "NCCL all-to-all"),
              ("sendrecv", "NCCL send/recv"), ("broadcast", "NCCL broadcast"))


def kernel_kind(name: str, cat: str) -> str:
    n = name.lower()
    if cat == "gpu_memcpy":
        return "memcpy " + ("D2H" if "dtoh" in n else "H2D" if "htod" in n else "D2D")
    if cat == "gpu_memset":
        return "memset"
    if "nccl" in n:
        return next((label for key, label in NCCL_KINDS if key in n), "NCCL other")
    if any(k in n for k in ("flash", "fmha", "sdpa", "attention", "attn")):
        return "attention"
    if any(k in n for k in ("grouped", "groupproblemshape", "ptr_array")):
        return "grouped GEMM (experts)"
    if any(k in n for k in ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "sm90_", "sm80_")):
        return "dense GEMM"
    if n.startswith("triton") or "triton_" in n:
        return "compiled (Triton)"
    return "other kernels"


def _union(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _clip(intervals, lo, hi):
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _launch_phases(ranges, launches) -> dict:
    """correlation id -> the phase of the innermost labelled host range around its launch. Host
    ranges of one thread nest (they follow the call stack), so one sweep with a stack does it."""
    items: dict = {}
    for e in ranges:
        items.setdefault((e["pid"], e["tid"]), []).append((e["ts"], 0, e["ts"] + e["dur"], _phase_of(e["name"])))
    for corr, e in launches.items():
        items.setdefault((e["pid"], e["tid"]), []).append((e["ts"], 1, corr, None))
    out = {}
    for thread_items in items.values():
        stack: list[tuple[float, str]] = []  # (end, phase), innermost last
        for ts, is_launch, x, phase in sorted(thread_items, key=lambda t: (t[0], t[1])):
            while stack and stack[-1][0] < ts:
                stack.pop()
            if is_launch:
                out[x] = stack[-1][1] if stack else "other"
            else:
                stack.append((x, phase))
    return out


def _phase_of(name: str) -> str | None:
    if name in PHASES:
        return PHASES[name]
    if name.startswith(BACKWARD):
        return "backward: fp32 grad accumulation (DDP hooks)" if ACCUMULATE in name else "backward"
    return None


def breakdown(trace: dict, step: str = "bench/step") -> dict:
    """The breakdown of the `step` annotation's window in a chrome trace (torch.profiler's export)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    windows = [e for e in events if e.get("name") == step and e.get("cat") == "user_annotation"]
    if not windows:
        raise ValueError(f"no {step!r} range in the trace")
    lo, hi = windows[0]["ts"], windows[0]["ts"] + windows[0]["dur"]
    inside = [e for e in events if lo <= e["ts"] <= hi]
    gpu = [e for e in inside if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launches = {e["args"]["correlation"]: e for e in inside
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ranges = [e for e in inside if e.get("cat") in ("user_annotation", "cpu_op")
              and _phase_of(e["name"]) is not None]
    phase_of_launch = _launch_phases(ranges, launches)

    phases: dict[str, float] = {}
    kinds: dict[str, float] = {}
    for k in gpu:
        kind = kernel_kind(k["name"], k["cat"])
        kinds[kind] = kinds.get(kind, 0.0) + k["dur"]
        phase = phase_of_launch.get(k.get("args", {}).get("correlation"), "other")
        phases[phase] = phases.get(phase, 0.0) + k["dur"]
    host_phases: dict[str, float] = {}
    for e in ranges:  # host time (the CPU view; the only one on a CPU-only trace)
        label = _phase_of(e["name"])
        host_phases[label] = host_phases.get(label, 0.0) + e["dur"]

    busy = _union(_clip([(k["ts"], k["ts"] + k["dur"]) for k in gpu], lo, hi))
    compute = _union(_clip([(k["ts"], k["ts"] + k["dur"]) for k in gpu if "nccl" not in k["name"].lower()], lo, hi))
    nccl = _union(_clip([(k["ts"], k["ts"] + k["dur"]) for k in gpu if "nccl" in k["name"].lower()], lo, hi))
    wall = hi - lo
    syncs = {n: dict(count=0, host_ms=0.0) for n in SYNC_CALLS}
    for e in inside:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in syncs:
            syncs[e["name"]]["count"] += 1
            syncs[e["name"]]["host_ms"] += e["dur"] / 1e3
    reads = {n: sum(1 for e in inside if e.get("cat") == "cpu_op" and e["name"] == n) for n in HOST_READS}
    ms = lambda d: {k: v / 1e3 for k, v in sorted(d.items(), key=lambda kv: -kv[1])}  # noqa: E731
    return dict(
        wall_ms=wall / 1e3, gpu_busy_ms=_length(busy) / 1e3, gpu_idle_ms=(wall - _length(busy)) / 1e3,
        compute_busy_ms=_length(compute) / 1e3, nccl_ms=_length(nccl) / 1e3,
        nccl_exposed_ms=(_length(busy) - _length(compute)) / 1e3, kernels=len(gpu),
        phases_gpu_ms=ms(phases), phases_host_ms=ms(host_phases), kernel_kinds_ms=ms(kinds),
        host_syncs=syncs, host_sync_calls=sum(v["count"] for v in syncs.values()),
        host_sync_ms=sum(v["host_ms"] for v in syncs.values()), host_reads=reads)


def from_file(path: str, step: str = "bench/step") -> dict:
    with open(path) as f:
        return breakdown(json.load(f), step)


def table(b: dict) -> str:
    """A compact text table of one breakdown."""
    lines = [f"step {b['wall_ms']:.1f} ms: GPU busy {b['gpu_busy_ms']:.1f}, idle {b['gpu_idle_ms']:.1f}, "
             f"NCCL {b['nccl_ms']:.1f} (exposed {b['nccl_exposed_ms']:.1f}), {b['kernels']} kernels; "
             f"host syncs {b['host_sync_calls']} ({b['host_sync_ms']:.1f} ms blocked), host reads "
             + ", ".join(f"{k.split('::')[1]} {v}" for k, v in b["host_reads"].items())]
    view = "phases_gpu_ms" if b["kernels"] else "phases_host_ms"
    lines.append(f"  {'phase (' + ('GPU' if b['kernels'] else 'host') + ' ms)':<48}" + "".join(
        f"\n    {k:<46}{v:>10.1f}" for k, v in b[view].items()))
    if b["kernels"]:
        lines.append(f"  {'kernel kind (GPU ms, all streams)':<48}" + "".join(
            f"\n    {k:<46}{v:>10.1f}" for k, v in b["kernel_kinds_ms"].items()))
    return "\n".join(lines)
