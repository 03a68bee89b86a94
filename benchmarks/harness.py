"""What the benchmark scripts share: timing, child processes' wall time and peak RSS, worker processes
that fail loudly, JSON, plain-text tables; FLOP counts and the peaks figures are reported against;
model shapes read from configs/, so each model is written down once.

GPU and host memory over a whole run (NVML, RSS/PSS of a process tree) is the loop's own sampler,
`mcore_rl.memory.monitor.PhaseMonitor`, so a benchmark reads memory exactly as the trainer logs it.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import time
from typing import Callable, Sequence

import torch
import yaml

GiB = 1 << 30


def device_sync() -> Callable[[], None]:
    """torch.cuda.synchronize on a GPU, else a no-op: a timer must wait for queued kernels."""
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


def run_command(script: str, commands: dict[str, Callable[[list[str]], int]], argv: list[str] | None) -> int:
    """`python benchmarks/SCRIPT COMMAND ...`: COMMAND's function on the rest of argv."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in commands:
        print(f"usage: python benchmarks/{script} {{{','.join(commands)}}} ... (-h: its options)", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


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


# ----------------------------------------------------------------------------- FLOPs and peaks
SPEC_PEAK = 989e12  # dense bf16, H100/H200 SXM spec sheet
MATMUL_PEAK = 790e12  # 8192^3 bf16 matmul measured on the lent machines (device KINDS.md)


def active_params(model, hf) -> float:
    """Non-embedding parameters a token passes through: dense + routed x topk/E, summed over the
    model-parallel ranks (the output layer counts where the model has one)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dense = sum(p.numel() for n, p in model.named_parameters() if "embedding" not in n and "local_experts" not in n)
    routed = sum(p.numel() for n, p in model.named_parameters() if "local_experts" in n)
    dev = next(model.parameters()).device
    d = torch.tensor(float(dense), device=dev)
    r = torch.tensor(float(routed), device=dev)
    dist.all_reduce(d, group=ps.get_model_parallel_group())
    dist.all_reduce(r, group=ps.get_expert_tensor_model_pipeline_parallel_group())
    return d.item() + (r.item() * hf.get("num_experts_per_tok") / hf.num_experts if hf.num_experts else 0)


def attention_flops_per_token(hf, seq: int) -> float:
    """fwd+bwd FLOPs of causal attention per token of a `seq`-token sequence."""
    qk = hf.get("qk_nope_head_dim", 0) + hf.get("qk_rope_head_dim", 0) if hf.is_mla else hf.head_dim
    v = hf.get("v_head_dim") if hf.is_mla else hf.head_dim
    return 6 * hf.num_layers * hf.num_attention_heads * (qk + v) * seq * 0.5


def flops_per_token(model, hf, seq: int) -> float:
    """fwd+bwd FLOPs per token of a `seq`-token sequence: 6 x active parameters + causal attention."""
    return 6 * active_params(model, hf) + attention_flops_per_token(hf, seq)


def sequences_flops(active: float, hf, lengths) -> float:
    """fwd+bwd FLOPs of training on sequences of these lengths (each attends only to itself)."""
    return sum(n * (6 * active + attention_flops_per_token(hf, n)) for n in lengths)


# ----------------------------------------------------------------------------- model shapes
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hf_config(config: str, layers: int | None = None) -> dict:
    """`model.hf_config` of a config (a path, or a name in configs/), optionally with fewer layers."""
    path = config if os.path.exists(config) else os.path.join(ROOT, "configs", config)
    with open(path) as f:
        cfg = dict(yaml.safe_load(f)["model"]["hf_config"])
    if layers:
        cfg["num_hidden_layers"] = layers
    return cfg


def moonlight(layers: int | None = None) -> dict:
    """Moonlight-16B-A3B's config.json (configs/moonlight_16b.yaml)."""
    return hf_config("moonlight_16b.yaml", layers)
