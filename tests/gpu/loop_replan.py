"""The 27-layer 4 x H200 loop runs of 2026-11-28 (docs/performance.md), with today's planner, against
the memory plan for what each step ran: `Plan.train_at` at the step's largest micro-batch, beside the start-up bound.

    python tests/gpu/loop_replan.py

Runs logged before the trainer recorded its micro-batches (`memory/micro_batch_*`) are
reconstructed here as their trainer formed them: the step's prompts (`loop.sources.step_prompts`)
with responses of max_response_len (`rollout.ignore_eos`), each rank's data-parallel rows, the
balanced micro-batches every rank repacks into the same number of, each padded to the longest over
the ranks (`actor.lockstep`). Each run's plan is remade at its recorded capacity; its train figure
must equal the recorded one (it is checked); the sync and rollout phases against it as made. Host: each step's PSS of the node against the host plan's
fullest node, less the save's staging in the phases no save overlaps.
"""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from mcore_rl.config.sections import load_config  # noqa: E402
from mcore_rl.data.prompts import load_prompt_sources  # noqa: E402
from mcore_rl.loop import micro_batches as mb  # noqa: E402
from mcore_rl.loop.sources import step_prompts  # noqa: E402
from mcore_rl.memory.plan import apply_choice, plan_for_config  # noqa: E402
from mcore_rl.memory.host import CKPT  # noqa: E402
from mcore_rl.memory.planner import LARGEST_MICRO, GiB  # noqa: E402

LOGS = os.path.join(REPO, "benchmarks", "gpu", "full27_logs")
LONG = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.max_response_len=8176",
        "cluster.host_memory_gb=480"]
# run -> (its JSON, or the config and overrides docs/performance.md gives for runs cut before writing one)
RUNS = {
    "tp4_r3": "full27_tp4_r3_h200x4.json",
    "tp4x2nodes": "full27_tp4x2nodes_h200x4.json",
    "tp4ep4": "full27_tp4ep4_h200x4.json",
    "tp4ep4_32x8x1k": "full27_tp4ep4_32x8x1k_h200x4.json",
    "tp1_64x8k": ("configs/moonlight_4gpu.yaml", ["rollout.tp_size=1", "trainer.total_training_steps=3", *LONG]),
    "tp4ep4_64x8k": ("configs/moonlight_4gpu.yaml", ["rollout.tp_size=4", "rollout.ep_size=4",
                                                     "trainer.total_training_steps=3", *LONG]),
}


def config_of(run: str):
    spec = RUNS[run]
    if isinstance(spec, str):
        with open(os.path.join(REPO, "benchmarks", "gpu", spec)) as f:
            d = json.load(f)
        spec = (d["config"], d["overrides"])
    return load_config(os.path.join(REPO, spec[0]), spec[1])


def largest_micro_batch(cfg, task, step: int) -> tuple[int, int]:
    """(packed tokens, log-prob rows) of the largest micro-batch step `step`'s update ran, over ranks."""
    dp = cfg.cluster.nnodes * cfg.cluster.n_gpus_per_node  # the actor's ranks (tp = pp = 1 here)
    R = cfg.rollout.max_response_len
    lengths = [len(task.prompts[i]) + R for i in step_prompts(cfg, task, step) for _ in range(cfg.rollout.n)]
    per, mini = -(-len(lengths) // dp), cfg.actor.ppo_mini_batch_size * cfg.rollout.n // dp
    tokens = rows = 0
    for start in range(0, per, mini):
        ranks = [lengths[r * per:(r + 1) * per][start:start + mini] for r in range(dp)]
        count = 1
        while True:  # every rank repacks into the most micro-batches any rank needs
            bins = [mb.balanced_micro_batches(x, cfg.actor.ppo_max_token_len_per_gpu, count) for x in ranks]
            if len({len(b) for b in bins}) == 1:
                break
            count = max(len(b) for b in bins)
        for k in range(count):
            tokens = max(tokens, max(sum(x[i] for i in b[k]) for x, b in zip(ranks, bins)))
            rows = max(rows, max(R * len(b[k]) for b in bins))
    return tokens, rows


def main() -> int:
    print(f"{'run':<16}{'step':>5}{'tokens':>8}{'rows':>7}{'measured':>10}{'bound':>9}{'error':>8}"
          f"{'step plan':>11}{'error':>8}")
    host, other = [], []
    for run in RUNS:
        with open(os.path.join(LOGS, run, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        cfg = config_of(run)
        plan, _ = plan_for_config(cfg, capacity=round(records[0]["plan/gpu_capacity_gib"] * GiB))
        assert abs(plan.total("train") / GiB - records[0]["plan/gpu_gib_train"]) < 0.01, run  # the run's own plan
        apply_choice(cfg, plan)
        task = load_prompt_sources(cfg)[0]
        bound = plan.total("train") / GiB
        for r in (r for r in records if r["step"] >= 2):  # step 1 allocates Adam's moments only in its optimizer step: not its peak
            measured = r.get("memory/gpu_peak_gib_train")
            if measured is None:
                continue
            tokens, rows = ((int(r[LARGEST_MICRO[0]]), int(r[LARGEST_MICRO[1]])) if LARGEST_MICRO[0] in r
                            else largest_micro_batch(cfg, task, r["step"]))
            step_plan = plan.train_at(tokens, rows) / GiB
            print(f"{run:<16}{r['step']:>5}{tokens:>8}{rows:>7}{measured:>10.2f}{bound:>9.2f}"
                  f"{100 * (measured / bound - 1):>+7.1f}%{step_plan:>11.2f}{100 * (measured / step_plan - 1):>+7.1f}%")
        for phase in ("sync", "rollout"):  # the phases the micro-batches leave alone: the plan as made
            got = [r[f"memory/gpu_peak_gib_{phase}"] for r in records if r["step"] >= 2 and r.get(f"memory/gpu_peak_gib_{phase}")]
            if got:
                planned = plan.total(phase) / GiB
                other.append(f"{run:<16}{phase:>8}{max(got):>10.2f}{planned:>9.2f}{100 * (max(got) / planned - 1):>+7.1f}%")
        node = plan.host.nodes[plan.host.fullest]
        for r in records:
            for phase in ("train", "rollout", "sync", "save"):
                # a save stages after the sync and holds it through the rollout that follows (the writes
                # go on in the background): those phases' plan is the node's total, the others' less it
                staged = "memory/host_pss_peak_gib_save" in r and phase in ("save", "rollout")
                planned = (sum(node.values()) - (0 if staged else node[CKPT])) / GiB
                got = r.get(f"memory/host_pss_peak_gib_{phase}") if r["step"] >= 2 else None
                if got is not None:
                    host.append(f"{run:<16}{r['step']:>5}{phase:>8}{got:>10.2f}{planned:>9.2f}"
                                f"{100 * (got / planned - 1):>+7.1f}%")
    print(f"\nGPU, the most of steps 2..N\n{'run':<16}{'phase':>8}{'measured':>10}{'plan':>9}{'error':>8}")
    print("\n".join(other))
    print(f"\nhost PSS of the node\n{'run':<16}{'step':>5}{'phase':>8}{'measured':>10}{'plan':>9}{'error':>8}")
    print("\n".join(host))
    return 0


if __name__ == "__main__":
    sys.exit(main())
