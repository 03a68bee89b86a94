"""Samples per second of the async trainer modes against sync, at the same batch and sample count,
with long-tailed response lengths (issue 26). Not a test.

    python benchmarks/async_bench.py --out async.json [--steps 12] [--modes sync,one_step_off,fully_async] \
        [dotted.key=value ...]

Each mode runs `python -m mcore_rl.train` on configs/tiny_cpu.yaml with the engines on a "GPU" of
their own (`cluster.colocate=false`, the same placement for every mode) and
rollout.max_response_len=64: the random tiny model stops at its EOS about once in 16 tokens, so
response lengths are geometric, the longest of a batch several times the median (the JSON records
both). samples/s is over steps 2..N (start-up and the first step excluded), from metrics.jsonl's
times; beside it the staleness and the engine's and trainer's idle fractions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEPARATE = ("cluster.n_gpus_per_node=3", "cluster.colocate=false", "cluster.rollout_gpus=1")
LONG_TAIL = ("rollout.max_response_len=64", "model.hf_config.max_position_embeddings=128", "actor.micro_batch_size=8")
MODE_ARGS = {"sync": (), "one_step_off": ("trainer.mode=one_step_off",),
             "fully_async": ("trainer.mode=fully_async", "trainer.partial_rollout_tokens=8")}


def run_mode(mode: str, steps: int, extra: list[str], out_dir: str) -> dict:
    out = os.path.join(out_dir, mode)
    cmd = [sys.executable, "-m", "mcore_rl.train", "--config", "configs/tiny_cpu.yaml", f"trainer.output_dir={out}",
           f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.save_freq=-1",
           "trainer.val_before_train=false", "trainer.rollout_dump_dir=" + os.path.join(out, "dumps"),
           *SEPARATE, *LONG_TAIL, *MODE_ARGS[mode], *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"))
    if p.returncode:
        raise SystemExit(f"{mode} failed:\n{(p.stdout + p.stderr)[-3000:]}")
    steps_seen: dict[int, dict] = {}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            steps_seen.setdefault(r["step"], {}).update(r)
    trained = [steps_seen[k] for k in sorted(steps_seen) if k >= 1]
    first, last = trained[0], trained[-1]
    samples = sum(len_of(os.path.join(out, "dumps", f"step_{k}.pt")) for k in range(2, steps + 1))
    lengths = response_lengths(os.path.join(out, "dumps"), steps)

    def mean(key):
        vals = [s[key] for s in trained[1:] if key in s]
        return round(statistics.mean(vals), 4) if vals else None

    return {"mode": mode, "samples_per_s": round(samples / (last["time"] - first["time"]), 2),
            "reward_last3": round(statistics.mean(s["reward/mean"] for s in trained[-3:]), 3),
            "staleness_mean": mean("async/staleness_mean"), "staleness_max": mean("async/staleness_max"),
            "partial_fraction": mean("async/partial_fraction"),
            "engine_idle_fraction": mean("async/engine_idle_fraction"),
            "trainer_idle_fraction": mean("async/trainer_idle_fraction"),
            "response_len_median": statistics.median(lengths), "response_len_max": max(lengths)}


def len_of(path: str) -> int:
    import torch

    return len(torch.load(path, weights_only=True)["index"])


def response_lengths(dump_dir: str, steps: int) -> list[int]:
    import torch

    out = []
    for k in range(1, steps + 1):
        out += torch.load(os.path.join(dump_dir, f"step_{k}.pt"), weights_only=True)["batch"]["response_mask"] \
            .sum(1).long().tolist()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--modes", default="sync,one_step_off,fully_async")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="async_bench") as tmp:
        rows = [run_mode(m, a.steps, a.overrides, tmp) for m in a.modes.split(",")]
    base = next((r for r in rows if r["mode"] == "sync"), None)
    for r in rows:
        r["speedup_vs_sync"] = round(r["samples_per_s"] / base["samples_per_s"], 2) if base else None
        print(json.dumps(r), flush=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
