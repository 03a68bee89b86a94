"""The RL loop as users run it, timed: `python -m mcore_rl.train` with SGLang doing the rollout,
then the same engine alone on the same GPUs generating the same batch shape.

    python benchmarks/rl_loop_bench.py --config configs/moonlight_2gpu.yaml [key=value ...] --out r.json

Reports the start-up (each phase's seconds as the console's `start:` lines give them, the seconds to
step 1 and step 1's own) and, per step (medians over steps 2..N; step 1 warms up): each phase's seconds (rollout;
release + trainer onload; old log-probs; update; trainer offload + resume weights + sync + resume
KV), SGLang's generation tokens/s in the loop and alone, the sync's seconds and GB/s (bytes the
trainer sent, over the sync's wall time), the update's TFLOP/s per GPU (6 x active parameters +
causal attention per token, over the update's wall time) and % of the measured 790 TFLOP/s bf16
peak, and memory: the per-phase peaks the loop logs each step (`memory/gpu_peak_gib_{train,sync,
rollout,save}`: NVML, all processes, the max over GPUs; `memory/host_rss_peak_gib_save`: the
actors' host RSS during the checkpoint), `timing/save` and `checkpoint/state_gib`, per step and as
the max over steps 2..N, next to the memory plan's per-phase GiB (`mcore_rl.memory.plan`; the train
phase also next to the plan for what each step ran, `plan/gpu_gib_step_train`, where they differ most;
host PSS against the host plan's fullest node), and the whole run's GPU and host-RSS peaks sampled from here. The checkpoint stays in the loop
(`trainer.save_freq` as configured; the last step always saves). Prints a table ("not measured"
where the loop logged nothing); writes JSON.

    python benchmarks/rl_loop_bench.py --config configs/tiny_cpu.yaml --out modes.json \
        --modes sync,one_step_off,fully_async [key=value ...]

compares the trainer modes (issue 26) instead: the loop once per mode, the same config and
overrides (engines on resources of their own: cluster.colocate=false; fully_async also with
trainer.partial_rollout_tokens=8 unless overridden), and a table of samples/s over steps 2..N (every
step trains data.train_batch_size x rollout.n samples), the speedup over the mean of the sync runs, the staleness mean
and max, the partial fraction, the engine's and trainer's idle fractions and the response length,
each the mean over steps 2..N.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import MATMUL_PEAK, attention_flops_per_token, table, write_json  # noqa: E402
from mcore_rl.metrics.plot import records_by_step  # noqa: E402
from mcore_rl.memory.planner import LARGEST_MICRO  # noqa: E402

PHASES = ("timing/rollout", "timing/to_train", "timing/old_log_prob", "timing/update_actor", "timing/to_rollout",
          "timing/offload_trainer", "timing/resume_weights", "sync/seconds", "sync/begin_end_seconds",
          "sync/gather_seconds", "sync/send_seconds", "sync/engine_call_seconds", "sync/engine_wait_seconds",
          "timing/offload_weights", "timing/resume_kv_cache")
MEMORY_PHASES = ("train", "sync", "rollout", "save")
TRAIN_AT_ALLOCATOR_PEAK = "memory/gpu_at_allocator_peak_gib_train"  # the trainer's reading (actor.memory)
# the loop's memory metrics (mcore_rl.memory.monitor), reported per step
MEMORY = (*(f"memory/gpu_peak_gib_{ph}" for ph in MEMORY_PHASES),
          *(f"memory/trainer_max_{k}_gib_{p}" for p in ("onload", "old_log_prob", "update")
            for k in ("allocated", "reserved")), "memory/trainer_offloaded_allocated_gib",
          "memory/trainer_offloaded_reserved_gib", "memory/trainer_max_reserved_gib_sync",
          "memory/host_rss_peak_gib_save", "memory/host_pss_peak_gib_save",
          *(f"memory/host_pss_peak_gib_{ph}" for ph in ("train", "rollout", "sync")), "timing/save", "checkpoint/state_gib",
          "plan/gpu_gib_step_train", *LARGEST_MICRO, TRAIN_AT_ALLOCATOR_PEAK)


MISMATCH = ("logp_diff_abs_mean", "token_mult_prob_error", "route_agreement")  # engine vs trainer, each step


def train_peak(step: dict) -> float | None:
    """The train phase's GPU peak: NVML's sampled one, or the trainer's reading at its allocator's
    peak where the sampler missed it (it can: a peak shorter than its 50 ms)."""
    got = [step[k] for k in ("memory/gpu_peak_gib_train", TRAIN_AT_ALLOCATOR_PEAK) if step.get(k)]
    return max(got, default=None)


def train_vs_step_plan(steps: list[dict]) -> dict:
    """The train phase's peak (`train_peak`) against the plan for what the step ran
    (plan/gpu_gib_step_train: the plan's model at the step's largest micro-batch), at the step where
    they differ most."""
    pairs = [(train_peak(s), s["plan/gpu_gib_step_train"], s.get("step")) for s in steps
             if train_peak(s) and s.get("plan/gpu_gib_step_train")]
    if not pairs:
        return {}
    measured, planned, step = max(pairs, key=lambda p: abs(p[0] / p[1] - 1))
    return {"step_planned_gib": round(planned, 2), "step_measured_gib": round(measured, 2),
            "over_step_plan_pct": round(100 * (measured / planned - 1), 1), "at_step": step}


def host_vs_plan(memory_max: dict, planned: dict) -> dict:
    """The node's host PSS, the most of any phase of steps 2..N, against the host plan's fullest node."""
    measured = max((v for k, v in memory_max.items() if k.startswith("memory/host_pss_peak_gib_") and v), default=None)
    plan = planned.get("host")
    return {"measured_pss_gib": measured, "planned_gib": plan,
            "over_plan_pct": round(100 * (measured / plan - 1), 1) if measured and plan else None}


def at_peak(step: dict) -> dict:
    """Who held each phase's GPU and host PSS peak: `memory/{gpu,host_pss}_at_peak_gib_{phase}_{role}` (GPU runs)."""
    return {k: v for k, v in sorted(step.items()) if k.startswith(("memory/gpu_at_peak_gib_", "memory/host_pss_at_peak_gib_"))}


# each mode's settings, before the command line's overrides (which win)
MODE_ARGS = {"sync": (), "one_step_off": ("trainer.mode=one_step_off",),
             "fully_async": ("trainer.mode=fully_async", "trainer.partial_rollout_tokens=8")}
STEP_KEYS = ("time", "timing/", "sync/seconds", "async/", "perf/samples_per_s", "response/length")
MULTITURN = ("multiturn/turns_mean", "multiturn/tool_calls_mean", "multiturn/observation_tokens_mean",
             "multiturn/tool_failures", "multiturn/prefix_cache_hit_rate", "timing/rollout_generate",
             "timing/rollout_tools")
MODE_METRICS = ("async/staleness_mean", "async/staleness_max", "async/partial_fraction", "async/engine_idle_fraction",
                "async/trainer_idle_fraction", "response/length")


def active_params(hf) -> float:
    """Non-embedding parameters a token passes through (routed experts x topk / E), from the config."""
    from mcore_rl.memory.layout import inventory

    dense = sum(w.numel for w in inventory(hf) if w.expert is None and "embedding" not in w.mcore
                and w.split != "buffer")
    routed = sum(w.numel for w in inventory(hf) if w.expert is not None)
    return dense + (routed * hf.get("num_experts_per_tok") / hf.num_experts if hf.num_experts else 0)


def run_loop(config: str, overrides: list[str], out: str, logs: str | None = None) -> tuple[dict[int, dict], dict, dict]:
    """The loop's metrics by step, its whole-run peaks (GPU; host RSS of the loop's process tree,
    which on a local Ray run holds the raylet, actors and engines) and its start-up (each phase's
    seconds and the seconds to step 1, `console.start_record`). logs: where the run's engine logs
    (`out`/logs) and its metrics.jsonl are copied when it ends, failed or cut (SIGTERM, as `timeout` sends) too."""
    from mcore_rl.metrics.console import start_record
    from mcore_rl.memory.monitor import PhaseMonitor

    cmd = [sys.executable, "-m", "mcore_rl.train", "--config", config, f"trainer.output_dir={out}",
           "trainer.test_freq=-1", "trainer.val_before_train=false", *overrides]
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    p = None
    try:
        with PhaseMonitor(interval_s=0.2) as mon, mon.phase("run"):
            p = subprocess.Popen(cmd, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            mon.watch(p.pid)
            tail, start = collections.deque(maxlen=60), []
            for line in p.stdout:  # passed on as it comes: a run cut by a time limit still shows how far it got
                sys.stdout.write(line)
                tail.append(line)
                if line.startswith("start: "):
                    start.append(line)
            p.wait()
    finally:
        if p is not None and p.poll() is None:  # cut: the run (and the Ray it started) goes too
            p.terminate()
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        if logs:
            os.makedirs(logs, exist_ok=True)
            if os.path.isdir(os.path.join(out, "logs")):
                shutil.copytree(os.path.join(out, "logs"), logs, dirs_exist_ok=True)
            if os.path.exists(os.path.join(out, "metrics.jsonl")):  # what a cut run measured
                shutil.copy(os.path.join(out, "metrics.jsonl"), logs)
    if p.returncode:
        sys.exit("the RL loop failed:\n" + "".join(tail)[-4000:])
    return records_by_step(os.path.join(out, "metrics.jsonl")), mon.take(), start_record(start)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through run_loop's cleanup


def engine_alone(cfg, model_dir: str, batch: int, prompt_len: int, max_new: int, repeats: int = 3) -> float:
    """Generation tokens/s of the same SGLang engine on the same GPUs, without the trainer."""
    import ray
    from ray.util.placement_group import placement_group

    from mcore_rl.rollout.base import SamplingParams
    from mcore_rl.rollout.group import EngineSlot
    from mcore_rl.rollout.launch import start_sglang
    from mcore_rl.rollout.placement import plan_placement
    from mcore_rl.config.checks import attention_dp
    from mcore_rl.sync.engine_layout import EngineLayout
    from mcore_rl.loop.startup import memory_plan

    placement, plan = plan_placement(cfg), memory_plan(cfg)  # sized as in the loop (GPU: the plan's KV tokens)
    tp, cpu = cfg.rollout.tp_size, cfg.cluster.device == "cpu"
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             **({"_node_ip_address": "127.0.0.1"} if cpu else {}))
    try:
        slots = []
        for nodes in placement.engines:
            pg = placement_group([{"CPU": 1} if cpu else {"GPU": len(n.gpus), "CPU": 1} for n in nodes],
                                 strategy="PACK")
            ray.get(pg.ready())
            slots += [EngineSlot(n.engine, n.node_rank, pg, i, None, owns_pg=True) for i, n in enumerate(nodes)]
        layout = EngineLayout(tp, cfg.rollout.ep_size, placement.nnodes, tp // placement.nnodes, attention_dp(cfg))
        group = start_sglang(cfg, model_dir, slots, layout, 0 if cpu else tp, plan)
        try:
            prompts = [[5 + (i + j) % 11 for j in range(prompt_len)] for i in range(batch)]
            params = SamplingParams(n=1, temperature=cfg.rollout.temperature, max_new_tokens=max_new, seed=1)
            rates = []
            for _ in range(repeats + 1):  # the first warms up
                t0 = time.perf_counter()
                done = group.generate(prompts, params)
                rates.append(sum(len(c.token_ids) for g in done for c in g) / (time.perf_counter() - t0))
            return statistics.median(rates[1:])
        finally:
            group.shutdown()
    finally:
        ray.shutdown()


def train_seconds(trained: list[dict]) -> float:
    """Wall seconds from the end of the first step to the end of the last, less the validations and
    checkpoint saves in between: the last step always validates and saves, and a 42 GiB save or a
    long greedy validation would swamp a few steps' time (the fourth pass's sync mode: 17.5 s a step
    where its steps took 2.8)."""
    skipped = sum(s.get("timing/validate", 0.0) + s.get("timing/save", 0.0) for s in trained[1:])
    return trained[-1]["time"] - trained[0]["time"] - skipped


def compare_modes(config: str, overrides: list[str], modes: list[str], out: str) -> int:
    """The loop once per trainer mode; samples/s and the async metrics side by side."""
    from mcore_rl.config import sections as C
    from mcore_rl.config import checks as config_checks

    work = tempfile.mkdtemp(prefix="rl_loop_modes_")
    rows = []
    for mode in modes:
        args = [*MODE_ARGS[mode], *overrides]
        cfg = C.load_config(config, args)
        run_dir = os.path.join(work, f"{len(rows)}_{mode}")
        steps, _, _ = run_loop(config, args, run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)  # its checkpoints: the next mode needs the disk
        by_step = {k: s for k, s in sorted(steps.items()) if k >= 1 and "reward/mean" in s}
        trained = list(by_step.values())
        later = trained[1:]  # step 1 warms up
        samples = len(later) * cfg.data.train_batch_size * cfg.rollout.n
        means = {k.split("/")[1]: statistics.mean(s[k] for s in later) if all(k in s for s in later) else None
                 for k in MODE_METRICS}  # None: the mode does not log it (sync: no async/*)
        # where a step's time goes, to explain a mode's samples/s (each phase's median over the later steps)
        phases = {k: statistics.median(s[k] for s in later) for k in ("timing/step", *PHASES)
                  if later and all(k in s for s in later)}
        rows.append({"mode": mode, "overrides": args, "steps": len(trained),
                     "samples_per_s": samples / train_seconds(trained),
                     "reward_last3": statistics.mean(s["reward/mean"] for s in trained[-3:]), **means,
                     "phases_s": phases,
                     # every step's own timings: a slow step is attributed, not only outvoted by medians
                     "per_step": [{"step": k, **{m: v for m, v in s.items() if m.startswith(STEP_KEYS)}}
                                  for k, s in by_step.items()]})
        write_json({"config": config, "overrides": overrides, "modes": rows}, out)  # kept if a later mode is cut
        print(f"{mode}: {rows[-1]['samples_per_s']:.2f} samples/s", flush=True)
    # a mode may run more than once (sync,fully_async,sync): the speedup is over the mean of the sync runs,
    # whose spread on one machine (46-51 samples/s, ninth pass) is as large as the effects measured
    syncs = [r["samples_per_s"] for r in rows if r["mode"] == "sync"]
    base = statistics.mean(syncs) if syncs else None
    for r in rows:
        r["speedup_vs_sync"] = r["samples_per_s"] / base if base else None
        r["speedup_vs_each_sync"] = [r["samples_per_s"] / b for b in syncs]
    write_json({"config": config, "overrides": overrides, "modes": rows}, out)
    print(table(["mode", "samples/s", "vs sync", "staleness mean", "staleness max", "partial fraction",
                 "engine idle", "trainer idle", "response length", "reward (last 3)"],
                [[r["mode"], r["samples_per_s"], r["speedup_vs_sync"], r["staleness_mean"], r["staleness_max"],
                  r["partial_fraction"], r["engine_idle_fraction"], r["trainer_idle_fraction"], r["length"],
                  r["reward_last3"]] for r in rows], digits=2))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--logs", help="copy the run's engine logs (logs/engine_<k>_node<n>.log) and metrics.jsonl to "
                                   "this directory when it ends, however it ends")
    ap.add_argument("--run-dir", help="the run's output directory, kept afterwards (its checkpoints: export them); "
                                      "default: a temporary one, deleted")
    ap.add_argument("--no-engine-alone", action="store_true",
                    help="skip the engine-alone measurement (reported as not measured)")
    ap.add_argument("--modes", help="comma-separated trainer modes (sync,one_step_off,fully_async) to compare "
                                    "instead of timing one run's phases; one may repeat (sync,fully_async,sync)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.modes:
        if unknown := set(a.modes.split(",")) - set(MODE_ARGS):
            ap.error(f"--modes: unknown {sorted(unknown)}; choose from {sorted(MODE_ARGS)}")
        return compare_modes(a.config, a.overrides, a.modes.split(","), a.out)
    from mcore_rl.config import sections as C
    from mcore_rl.config import checks as config_checks
    from mcore_rl.models.config import HFModel
    from mcore_rl.memory.plan import plan_for_config

    cfg = C.load_config(a.config, a.overrides)
    hf = HFModel.from_dict(config_checks.hf_model_dims(cfg.model))
    work = tempfile.mkdtemp(prefix="rl_loop_bench_")
    run_dir = os.path.abspath(a.run_dir) if a.run_dir else os.path.join(work, "run")
    t0, launched = time.perf_counter(), time.time()
    steps, run_peaks, start_phases = run_loop(a.config, a.overrides, run_dir, a.logs)
    wall = time.perf_counter() - t0
    timed = [s for k, s in sorted(steps.items()) if k >= 2 and "reward/mean" in s]
    med = lambda key: statistics.median(s[key] for s in timed) if all(key in s for s in timed) else None  # noqa: E731
    gpus = config_checks.actor_gpus(cfg)
    B = cfg.data.train_batch_size * cfg.rollout.n
    prompt = statistics.mean(len(p) for p in __import__("mcore_rl.data.prompts", fromlist=["x"])
                             .load_prompt_sources(cfg)[0].prompts[:256])
    seq = prompt + med("response/length")
    tokens = B * seq
    flops = tokens * (6 * active_params(hf) + attention_flops_per_token(hf, int(seq))) * cfg.actor.ppo_epochs
    update_s = med("timing/update_actor")
    sync_s, sync_b = med("sync/seconds"), med("sync/bytes")
    alone = None if a.no_engine_alone else engine_alone(cfg, os.path.join(run_dir, "engine_hf"), B,
                                                        int(round(prompt)), cfg.rollout.max_response_len)
    shutil.rmtree(work, ignore_errors=True)  # checkpoints of tens of GB: a later run needs the disk
    # max over steps 2..N of the steps that logged it (the checkpoint only runs on save steps); None: never
    memory_max = {m: max((s[m] for s in timed if s.get(m) is not None), default=None) for m in MEMORY}
    planned = {}
    if cfg.cluster.device == "gpu":
        try:
            plan, _ = plan_for_config(cfg)
            planned = {ph: round(plan.total(ph) / 2**30, 2) for ph in plan.phases}
            planned["components"] = {ph: {c: round(b / 2**30, 3) for c, b in comps.items()}
                                     for ph, comps in plan.phases.items()}
            planned["micro_batch"] = {"tokens": plan.inputs.micro_tokens, "recompute": plan.inputs.recompute}
            if plan.host is not None:
                planned["host"] = round(plan.host.total(plan.host.fullest) / 2**30, 2)
                planned["host_items"] = {k: round(v / 2**30, 3) for k, v in plan.host.nodes[plan.host.fullest].items()}
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            planned = {"error": str(e)}
    first = steps.get(1, {})
    # start: from the launch to the beginning of step 1 (its end, less its own seconds)
    to_step1 = round(first["time"] - launched, 1) if "time" in first else None
    start = round(to_step1 - first["timing/step"], 1) if to_step1 is not None and "timing/step" in first else None
    vs_plan = {ph: {"measured_gib": memory_max.get(f"memory/gpu_peak_gib_{ph}"), "planned_gib": planned.get(ph),
                    "over_plan_pct": round(100 * (memory_max[f"memory/gpu_peak_gib_{ph}"] / planned[ph] - 1), 1)
                    if memory_max.get(f"memory/gpu_peak_gib_{ph}") and isinstance(planned.get(ph), float) else None}
               for ph in MEMORY_PHASES}
    vs_plan["train"].update(train_vs_step_plan(timed))  # beside the bound: every micro-batch full
    vs_plan["host"] = host_vs_plan(memory_max, planned)
    # each offload's GB/s per GPU: the bytes the busiest rank moved over the phase's seconds (issue 46's bound:
    # scripts/gpu/host_bandwidth.py on the same node)
    offload_gbs = {k: (med(f"memory/moved_gib_{k}") * 2**30 / 1e9 / med(f"timing/{k}"))
                   if med(f"memory/moved_gib_{k}") and med(f"timing/{k}") else None
                   for k in ("offload_trainer", "offload_weights")}
    result = dict(config=a.config, offload_gb_per_s_per_gpu=offload_gbs, overrides=a.overrides, steps=len(timed) + 1, wall_s=round(wall, 1),
                  start_s=start, to_step1_s=to_step1, step1_s=first.get("timing/step"), memory_vs_plan=vs_plan,
                  start_phases=start_phases,
                  phases_s={k: med(k) for k in PHASES}, step_s=med("timing/step"),
                  rollout_tokens_per_s=med("perf/rollout_tokens_per_s"), engine_alone_tokens_per_s=alone,
                  response_length=med("response/length"), sync_s=sync_s, sync_bytes=sync_b,
                  sync_gb_per_s=sync_b / sync_s / 1e9 if sync_s else None,
                  update_tflops_per_gpu=flops / update_s / gpus / 1e12,
                  update_pct_of_790=100 * flops / update_s / gpus / MATMUL_PEAK,
                  logp_diff_abs_mean=med("rollout/logp_diff_abs_mean"),
                  token_mult_prob_error=med("rollout/token_mult_prob_error"),
                  route_agreement=med("rollout/route_agreement"), reward=[s.get("reward/mean") for s in timed],
                  mismatch_per_step={k: {m: s.get(f"rollout/{m}") for m in MISMATCH} for k, s in sorted(steps.items())
                                     if k >= 1},
                  memory_per_step={k: {**{m: s.get(m) for m in MEMORY}, **at_peak(s)} for k, s in sorted(steps.items())
                                   if k >= 1},
                  memory_max=memory_max, run_peak_gib=run_peaks, planned_gib=planned, first_sync=steps.get(0, {}),
                  # conversations (rollout.env): turns, tool calls and failures, prefix-cache hits, time in tools
                  multiturn={k: med(k) for k in MULTITURN if med(k) is not None})
    write_json(result, a.out)
    print(f"{'phase':<28}{'median s':>14}")
    for k, v in result["phases_s"].items():
        print(f"{k:<28}{'not measured' if v is None else round(v, 3):>14}")
    for k in ("start_s", "to_step1_s", "step1_s", "step_s", "rollout_tokens_per_s", "engine_alone_tokens_per_s", "sync_s", "sync_gb_per_s",
              "update_tflops_per_gpu", "update_pct_of_790", "logp_diff_abs_mean", "token_mult_prob_error",
              "route_agreement"):
        v = result[k]
        print(f"{k:<28}{'not measured' if v is None else round(v, 4):>14}")
    for k, v in result["multiturn"].items():
        print(f"{k.split('/', 1)[1]:<28}{round(v, 4):>14}")
    print(f"\n{'memory, max of steps 2..N':<32}{'measured':>14}{'planned GiB':>14}")
    for m in MEMORY:
        v, ph = memory_max[m], m.rsplit("_", 1)[-1]
        plan_v = planned.get(ph, "not planned") if m.startswith("memory/gpu_") else ""
        print(f"{m:<32}{'not measured' if v is None else round(v, 3):>14}{plan_v:>14}")
    print("train vs the step's plan:", vs_plan["train"].get("over_step_plan_pct", "not measured"), "%; host vs plan:",
          vs_plan["host"]["over_plan_pct"], "%")
    print("offload GB/s per GPU:", {k: v and round(v, 1) for k, v in offload_gbs.items()})
    print("whole run (sampled here):", {k: round(v, 2) for k, v in run_peaks.items()} or "not measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
