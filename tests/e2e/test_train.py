"""The main job end to end: GRPO over Ray with 2 Megatron actor processes (EP=2) and SGLang's real
engine doing the rollout learns the embedded task, writes metrics, plots and checkpoints, prints
one short line a step and no warnings, and resumes after SIGKILL; the embedded engine still learns
it too."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.unit.test_metrics import check_readme_job_plots

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train(out, *overrides, env=None, config="configs/tiny_cpu.yaml", **popen):
    cmd = [sys.executable, "-m", "mcore_rl.train", "--config", config,
           f"trainer.output_dir={out}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", **(env or {})), **popen)


def _failure(log: str) -> str:
    """The driver's own lines of a failed run's log (not Ray workers' output or native stack frames)."""
    own = [ln for ln in log.splitlines() if not ln.lstrip().startswith(("\x1b[36m(", "(", "frame #"))]
    return "\n".join(own)[-6000:]  # a dead trainer rank's error ends with its stderr (mcore_rl.actor.deaths)


def _records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def by_step(out) -> dict[int, dict]:
    """All metrics of a step in one dict (a step logs its update, then its sync and validation)."""
    merged: dict[int, dict] = {}
    for r in _records(out):
        merged.setdefault(r["step"], {}).update(r)
    return merged


def _reward_rises(out):
    rec = [r for r in _records(out) if "reward/mean" in r]
    reward_rises(rec)
    return rec


def reward_rises(steps: list[dict]) -> None:
    """The tiny task learned: the reward of the first 3 steps below 0.3 on average, of the last 3 above 0.7."""
    first, last = (sum(m["reward/mean"] for m in part) / 3 for part in (steps[:3], steps[-3:]))
    assert first < 0.3 and last > 0.7, f"reward did not rise: first {first:.2f}, last {last:.2f}"


def _step_numbers(log: str) -> list[int]:
    """The steps of a run's console lines ("step 7/30 | reward ..."), in the order printed."""
    return [int(ln.split()[1].split("/")[0]) for ln in log.splitlines() if ln.startswith("step ")]


# megatron-core's dist_checkpointing, once in each actor as it loads a checkpoint (a resume)
CHECKPOINT_LOAD_WARNING = "FutureWarning: `load_state_dict` is deprecated"
STALE_LOCK_WARNING = "ended without releasing it; taking it over"


START_PHASES = ("starting Ray, placing the trainer", "writing the model's config",
                "building the trainer's model (2 ranks)", "making the optimizer", "offloading the trainer's states",
                "starting the sglang engines", "setting up the weight sync", "first weight sync")
# beside the trainer's build (its line before the engines' start ends, which waits for it)
PARALLEL_PHASES = ("starting the sglang engines' processes and importing SGLang",)


def _check_start(log: str, phases: tuple[str, ...], first_step: int) -> None:
    """The start-up's progress: one line per phase with its seconds, in the order they ran (a phase
    still running after 5 s also said so before), then the seconds to the first step."""
    from mcore_rl.metrics.console import PARALLEL, start_record

    rec = start_record(log.splitlines())
    assert [name for name, _ in rec["phases"]] == list(phases) and rec["failed"] is None, log
    assert [name for name, _ in rec["parallel"]] == list(PARALLEL_PHASES), log
    lines = log.splitlines()
    imported = next(i for i, ln in enumerate(lines) if ln.startswith(f"start: {PARALLEL_PHASES[0]}{PARALLEL} "))
    assert imported < next(i for i, ln in enumerate(lines) if re.match(r"start: starting the sglang engines \d", ln))
    running = re.findall(r"^start: (.+) \.\.\.$", log, re.M)
    assert set(running) <= set(phases) and len(running) == len(set(running)), log
    assert rec["ready_for_step"] == first_step and rec["ready_s"] >= sum(s for _, s in rec["phases"]) - 0.5, log
    first_line = next(i for i, ln in enumerate(log.splitlines()) if ln.startswith("step "))
    assert all(not ln.startswith("start: ") for ln in log.splitlines()[first_line:]), log


def _check_console(log: str, steps: list[int], allowed: tuple[str, ...] = ()) -> None:
    """A console a person can read: one short line a step (exactly `steps`), a few lines besides
    (the start-up's progress, `_check_start`, apart), no warnings (but lines holding one of
    `allowed`), the engines' output in files of their own."""
    lines = log.splitlines()
    assert len([ln for ln in lines if not ln.startswith("start: ")]) <= len(steps) + 15, log
    assert not [ln for ln in lines if "warn" in ln.lower() and not any(a in ln for a in allowed)], log
    assert _step_numbers(log) == steps, log
    assert all(len(ln) < 100 for ln in lines if ln.startswith("step ")), log


def test_tiny_grpo_learns_with_sglang_and_resumes_after_sigkill(tmp_path):
    """The README's run (30 steps, a checkpoint every 10) is SIGKILLed, driver and Ray workers
    together, once its step-10 checkpoint exists; the same command, with a half-written newer
    checkpoint left in the way, resumes from step 10 and ends. Over the two runs each step is
    logged exactly once (the steps the kill cut short are redone), and the run learns as one run
    would: the reward rises, SGLang's log-probs equal the trainer's after every sync, metrics,
    plots, tensorboard and the last checkpoint are written, and each run's console has one short
    line a step and no warnings. (One run where there were two, each starting Ray, Megatron and
    both engines: the learning run and the SIGKILL resume.)"""
    import threading

    out = str(tmp_path / "run")
    ckpts = os.path.join(out, "checkpoints")
    t0 = time.time()
    p = _train(out, start_new_session=True)
    first: list[str] = []  # read as it comes, so the pipe never fills while we wait
    reader = threading.Thread(target=lambda: first.extend(p.stdout), daemon=True)
    reader.start()
    deadline = time.time() + 600
    while not os.path.exists(os.path.join(ckpts, "step_10")) and time.time() < deadline and p.poll() is None:
        time.sleep(0.2)
    assert os.path.exists(os.path.join(ckpts, "step_10")), "run never reached step 10:\n" + _failure("".join(first))
    os.killpg(p.pid, signal.SIGKILL)  # the driver, its Ray workers, everything
    p.wait()
    reader.join(timeout=30)
    first_log = "".join(first)
    killed_at = max(r["step"] for r in _records(out))
    assert killed_at >= 10
    os.makedirs(os.path.join(ckpts, "step_99.tmp"))  # a half-written checkpoint must be ignored
    p = _train(out)
    log, _ = p.communicate(timeout=900)
    assert p.returncode == 0, _failure(log)
    assert time.time() - t0 < 900
    assert "resumed from" in log and "step_10" in log.split("resumed from")[1].splitlines()[0]
    # steps after the checkpoint are redone, and each step is logged exactly once
    assert [r["step"] for r in _records(out) if "reward/mean" in r] == list(range(1, 31))
    assert len(_reward_rises(out)) == 30
    steps = by_step(out)
    # after every sync SGLang's log-probs of its own samples equal the trainer's (same weights, fp32)
    diffs = [steps[k]["rollout/logp_diff_abs_mean"] for k in range(1, 31)]
    assert max(diffs) < 1e-3, diffs
    # the engine-trainer mismatch metrics every step; without routing replay the trainer routes live
    from tests.e2e.test_routing_replay import MISMATCH

    assert all(set(MISMATCH) <= set(steps[k]) and 0 < steps[k]["rollout/route_agreement"] <= 1
               for k in range(1, 31)), steps[30]
    assert all(steps[k]["sync/bytes"] > 0 for k in range(1, 31))
    # a prompt's rollout.n samples go to one engine, which prefills the prompt once before them (SGLang
    # computes a prompt's last token again): each sample finds the rest of its prompt cached
    hit = [steps[k]["rollout/prefix_cache_hit_rate"] for k in range(1, 31)]
    assert all(0.5 < h < 1 for h in hit), hit
    # the colocated phases' timings every step but step 10, whose sync is the resumed run's first
    # (of the checkpoint's weights, as step 0's is of the initial ones): each run's first sync is
    # read back from both engines
    assert all(steps[k]["timing/release_rollout"] >= 0 for k in range(1, 31) if k != 10)
    assert steps[0]["sync/verified"] == 1.0 and steps[10]["sync/verified"] == 1.0
    assert os.path.exists(os.path.join(ckpts, "step_30", "trainer_state.json"))
    assert not os.path.exists(os.path.join(ckpts, "step_99.tmp"))
    check_readme_job_plots(out)
    assert os.listdir(os.path.join(out, "tensorboard"))
    # the killed run printed its steps up to the kill; the resumed one prints steps 11 to 30
    printed = _step_numbers(first_log)
    assert printed and printed[0] == 1, first_log
    _check_console(first_log, list(range(1, len(printed) + 1)))
    # the killed run never released its run.lock: the resumed run names the dead pid and takes it over
    assert len([ln for ln in log.splitlines() if STALE_LOCK_WARNING in ln]) == 1, log
    _check_console(log, list(range(11, 31)), allowed=(CHECKPOINT_LOAD_WARNING, STALE_LOCK_WARNING))
    _check_start(first_log, START_PHASES, 1)
    _check_start(log, START_PHASES[:4] + ("loading checkpoint step_10",) + START_PHASES[4:], 11)  # the resume
    assert sorted(os.listdir(os.path.join(out, "logs"))) == ["engine_0_node0.log", "engine_1_node0.log"]


def test_tiny_grpo_learns_with_the_embedded_engine(tmp_path):
    """Also: the address file an earlier `ray start` left behind (ray_current_cluster, its cluster
    gone) does not make a local run try to join that cluster."""
    out = str(tmp_path / "run")
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths live under it
    try:
        os.makedirs(os.path.join(ray_tmp, "ray"))
        with open(os.path.join(ray_tmp, "ray", "ray_current_cluster"), "w") as f:
            f.write("127.0.0.1:9")
        p = _train(out, "rollout.engine=embedded", "trainer.save_freq=-1", "trainer.test_freq=-1",
                   env={"RAY_TMPDIR": ray_tmp})
        log, _ = p.communicate(timeout=900)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert p.returncode == 0, _failure(log)
    _reward_rises(out)
