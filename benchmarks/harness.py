"""What the benchmark scripts share: timing, child processes' wall time and peak RSS, worker processes
that fail loudly, JSON, plain-text tables.

GPU and host memory over a whole run (NVML, RSS/PSS of a process tree) is the loop's own sampler,
`mcore_rl.memory.monitor.PhaseMonitor`, so a benchmark reads memory exactly as the trainer logs it.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import time
from typing import Callable, Sequence

GiB = 1 << 30


def device_sync() -> Callable[[], None]:
    """torch.cuda.synchronize on a GPU, else a no-op: a timer must wait for queued kernels."""
    import torch

    return torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def timed_calls(fn: Callable[[], object], iters: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `iters` calls of fn after `warmup` untimed ones, the device synced around each."""
    sync = device_sync()
    times = []
    for i in range(warmup + iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def run_child(cmd: list[str], **popen) -> dict:
    """Run cmd to completion: its wall seconds and peak RSS (GiB, from wait4). wait4's ru_maxrss also
    counts the parent's peak recorded at exec, so a large parent inflates it: keep the caller small."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **popen)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {os.waitstatus_to_exitcode(status)}:\n"
                         f"{err[-3000:]}")
    return {"wall_s": time.perf_counter() - t0, "peak_rss_gib": usage.ru_maxrss / 2**20}


def wait_for(q, procs: list, what: str):
    """q.get(), raising if any of `procs` (multiprocessing processes) died first: no silent hang."""
    while True:
        try:
            return q.get(timeout=2)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{what}: process {dead[0].name} exited with {dead[0].exitcode}")


def shutdown(procs: list, grace: float) -> None:
    """Join every process within `grace` seconds in all, then terminate the ones still running."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()


def config_only_model(hf_config: dict, path: str) -> str:
    """A model directory holding only config.json (SGLang's dummy load format, its server args):
    with `architectures`, which SGLang picks its model class by and only a saved model writes."""
    import transformers

    config = transformers.AutoConfig.for_model(**hf_config)
    config.architectures = [transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.save_pretrained(path)
    return path


def write_json(report: dict, path: str) -> None:
    """Written whole or not at all (a benchmark killed mid-write leaves the previous file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


def _cell(v, digits: int) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}e}" if v and abs(v) < 10 ** -digits else f"{v:,.{digits}f}"
    return str(v)


def table(header: Sequence[str], rows: Sequence[Sequence], digits: int = 3) -> str:
    """Rows under a header: text columns left-aligned, numbers right-aligned; floats to `digits`
    decimals (smaller ones in e-notation), None as "-"."""
    cells = [list(header)] + [[_cell(v, digits) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    text = [i == 0 or all(isinstance(r[i], str) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if text[i] else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])
