"""Is a resumed run's next step the uninterrupted run's? (issue 24, resume exactness, on the path
users run: `python -m mcore_rl.train`).

1. An uninterrupted run of N steps saves at N-1 and N and dumps every step's rollout
   (`trainer.rollout_dump_dir`).
2. Its step-N checkpoint and metrics are set aside, so step N-1 is the newest checkpoint.
3. The run is resumed in place with `--replay` of those dumps: step N trains on the very batch the
   uninterrupted run sampled (the engine's sampling cannot differ), then saves.
4. Step N's learning metrics and the saved optimizer states (fp32 main weights, both Adam moments:
   the updated weights in fp32) are compared, tensor by tensor.

On CPU (fp32, gloo) the two are bit-exact; on a GPU they agree within bf16 noise. Prints a table
and writes JSON:

    python tests/gpu/resume_check.py --config configs/tiny_cpu.yaml --out resume.json
    python tests/gpu/resume_check.py --config configs/moonlight_2gpu.yaml --out resume.json \\
        cluster.n_gpus_per_node=1 parallel.ep=1 rollout.tp_size=1 model.hf_config.num_hidden_layers=4

Disk: two checkpoints and one's optimizer states at once (step N-1, the resumed N and the
uninterrupted N's optimizer states): about 2.9 checkpoints.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.harness import table, write_json  # noqa: E402
from mcore_rl.metrics.plot import records_by_step  # noqa: E402

NOT_LEARNING = ("time", "timing/", "perf/", "memory/", "sync/", "checkpoint/")


def run(args: list[str], log: str) -> None:
    with open(log, "w") as f:
        p = subprocess.run([sys.executable, "-m", "mcore_rl.train", *args], cwd=ROOT, stdout=f,
                           stderr=subprocess.STDOUT)
    if p.returncode:
        with open(log) as f:
            sys.exit(f"resume_check: {' '.join(args[:3])} failed (rc {p.returncode}):\n{f.read()[-3000:]}")


def step_metrics(path: str, step: int) -> dict:
    merged = records_by_step(path)[step]
    return {k: v for k, v in merged.items() if k != "step" and not k.startswith(NOT_LEARNING)}


def optimizer_pieces(step_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of every rank's optimizer file, by rank, piece key and tensor name."""
    out = {}
    for path in sorted(glob.glob(os.path.join(step_dir, "optim", "*.pt"))):
        rank = os.path.basename(path)
        for piece in torch.load(path, weights_only=True, map_location="cpu")["pieces"]:
            for name, t in piece["tensors"].items():
                out[f"{rank}:{piece['key']}:{name}"] = t
    return out


def compare_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    if a.keys() != b.keys():
        return {"keys_differ": sorted(a.keys() ^ b.keys())[:10]}
    equal, worst, worst_rel, elements = 0, 0.0, 0.0, 0
    for k in a:
        x, y = a[k].double(), b[k].double()
        elements += x.numel()
        if torch.equal(a[k], b[k]):
            equal += 1
            continue
        d = (x - y).abs()
        worst = max(worst, d.max().item())
        worst_rel = max(worst_rel, (d.norm() / x.norm().clamp_min(1e-30)).item())
    return {"tensors": len(a), "elements": elements, "bit_equal": equal, "max_abs_diff": worst,
            "max_rel_l2_diff": worst_rel}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True, help="JSON written here")
    p.add_argument("--steps", type=int, default=3, help="N: the uninterrupted run's steps (resumed from N-1)")
    p.add_argument("--work", help="working directory (default: a new temporary one, removed after)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides for both runs")
    a = p.parse_args()
    if a.steps < 2:
        p.error("--steps must be at least 2")
    work = a.work or tempfile.mkdtemp(prefix="resume_check_")
    os.makedirs(work, exist_ok=True)
    n, run_dir, dumps = a.steps, os.path.join(work, "run"), os.path.join(work, "dumps")
    common = ["--config", a.config, f"trainer.output_dir={run_dir}", "trainer.test_freq=-1",
              "trainer.val_before_train=false", f"trainer.total_training_steps={n}", *a.overrides]
    try:
        run([*common, f"trainer.save_freq={n - 1}", "trainer.max_checkpoints=2", "trainer.save_last=true",
             f"trainer.rollout_dump_dir={dumps}"], os.path.join(work, "uninterrupted.log"))
        aside = os.path.join(work, f"uninterrupted_step_{n}")
        os.replace(os.path.join(run_dir, "checkpoints", f"step_{n}"), aside)
        for part in os.listdir(aside):  # only its optimizer states are compared: the rest frees disk
            if part != "optim":
                path = os.path.join(aside, part)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        shutil.copy(os.path.join(run_dir, "metrics.jsonl"), os.path.join(work, "uninterrupted_metrics.jsonl"))
        run(["--replay", dumps, *common, "trainer.save_freq=-1", "trainer.save_last=true"],
            os.path.join(work, "resumed.log"))
        with open(os.path.join(work, "resumed.log")) as f:
            resumed_from = next((line.split("resumed from")[1].split()[0] for line in f
                                 if "resumed from" in line), None)
        want = step_metrics(os.path.join(work, "uninterrupted_metrics.jsonl"), n)
        got = step_metrics(os.path.join(run_dir, "metrics.jsonl"), n)
        # a replay has no engine: its generation's own figures (tokens/s, routes) are not logged
        metrics = {k: {"uninterrupted": want[k], "resumed": got[k]} for k in sorted(want.keys() & got.keys())
                   if isinstance(want[k], (int, float))}
        engine_only = sorted(want.keys() - got.keys())
        if not want.get("actor/grad_norm"):  # random weights at real width: every reward 0, no advantage
            print(f"resume_check: step {n} had no gradient (actor/grad_norm 0): its update compares the states' "
                  "read-back only; pass actor.entropy_coeff=0.01 for a step that moves the weights")
        print(f"resumed from {resumed_from}; step {n}, uninterrupted against resumed (same batch):")
        print(table(["metric", "uninterrupted", "resumed", "equal"],  # before the states' long comparison
                    [[k, v["uninterrupted"], v["resumed"], v["uninterrupted"] == v["resumed"]]
                     for k, v in metrics.items()], digits=8), flush=True)
        states = compare_tensors(optimizer_pieces(aside), optimizer_pieces(os.path.join(run_dir, "checkpoints",
                                                                                        f"step_{n}")))
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)
    result = {"config": a.config, "overrides": a.overrides, "steps": n, "resumed_from": resumed_from,
              "step_metrics": metrics, "not_in_a_replay": engine_only, "optimizer_states_after_step": states,
              "metrics_bit_equal": all(v["uninterrupted"] == v["resumed"] for v in metrics.values())}
    print("optimizer states after the step:", json.dumps(states))
    write_json(result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
