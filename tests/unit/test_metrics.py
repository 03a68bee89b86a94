"""Metrics logger sinks, secret hygiene, and the plot CLI (its panels on a real run: tests/e2e/test_train.py)."""

import io
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import yaml

from mcore_rl.metrics.logger import MetricsLogger, is_secret_key, redact
from mcore_rl.metrics.plot import PANELS, distinct, load_metrics, phase_times, plot_run, select_panels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLANTED = {"WANDB_API_KEY": "planted-wandb-key-1234", "HF_TOKEN": "hf_plantedtoken5678",
           "NCCL_TEST_SECRET": "planted-nccl-secret-42", "MY_DB_PASSWORD": "planted-password-99"}


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_jsonl_console_and_tensorboard_sinks(tmp_path):
    console = io.StringIO()
    with MetricsLogger(str(tmp_path), ["console", "jsonl", "tensorboard"], stream=console) as log:
        log.log({"critic/score/mean": torch.tensor(0.5), "actor/entropy": 1.25, "timing_s/gen": 2,
                 "bad": float("nan"), "not_scalar": "text", "vector": torch.tensor([1.0, 3.0])}, step=1)
        log.log({"critic/score/mean": 0.75}, step=2)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["critic/score/mean"] == 0.5 and records[0]["timing_s/gen"] == 2
    assert records[0]["bad"] is None and "not_scalar" not in records[0] and records[0]["vector"] == 2.0
    assert "step 1 | actor/entropy: 1.25 | bad: nan" in console.getvalue()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == [(1, 0.5), (2, 0.75)]
    # a resumed run appends to the same file
    with MetricsLogger(str(tmp_path), ["jsonl"]) as log:
        log.log({"critic/score/mean": 0.9}, step=2)
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 3
    with pytest.raises(ValueError, match="tensorbord"):
        MetricsLogger(str(tmp_path), ["tensorbord"])


def test_planted_secrets_never_reach_any_output(tmp_path, monkeypatch):
    for name, value in PLANTED.items():
        monkeypatch.setenv(name, value)
    config = {"trainer": {"experiment": f"run-{PLANTED['HF_TOKEN']}", "logger": ["jsonl"]},
              "actor": {"ppo_max_token_len_per_gpu": 4096}, "wandb_api_key": "literal-config-secret",
              "env_dump": dict(os.environ)}
    console = io.StringIO()
    backends = ["console", "jsonl", "tensorboard"]
    try:
        import wandb  # noqa: F401
        monkeypatch.setenv("WANDB_MODE", "offline")
        backends.append("wandb")
    except ImportError:
        pass
    with MetricsLogger(str(tmp_path), backends, config=config, stream=console) as log:
        log.log({"actor/pg_loss": 0.1, "debug/api_key": 123.0, f"x/{PLANTED['WANDB_API_KEY']}": 1.0,
                 "perf/total_num_tokens": 77}, step=0)
    dumped = [console.getvalue()]
    for folder, _, files in os.walk(tmp_path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                dumped.append(f.read().decode("utf-8", errors="replace"))
    everything = "\n".join(dumped)
    for secret in [*PLANTED.values(), "literal-config-secret"]:
        assert secret not in everything, secret
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["actor"]["ppo_max_token_len_per_gpu"] == 4096  # not a secret just for saying "token"
    assert saved["wandb_api_key"] == "***" and saved["trainer"]["experiment"] == "run-***"
    record = read_jsonl(tmp_path / "metrics.jsonl")[0]
    assert "debug/api_key" not in record and record["perf/total_num_tokens"] == 77
    assert "NCCL_TEST_SECRET" not in json.loads((tmp_path / "run_info.json").read_text())["env"]


def test_secret_key_rule_and_redact():
    assert is_secret_key("wandb_api_key") and is_secret_key("HF_TOKEN") and is_secret_key("db.password")
    assert not is_secret_key("ppo_max_token_len_per_gpu") and not is_secret_key("num_tokens")
    assert redact({"a": ["xx-sekrit-xx"], "token": "t"}, ["sekrit"]) == {"a": ["xx-***-xx"], "token": "***"}


def write_run(run_dir, steps=3):
    with MetricsLogger(str(run_dir), ["jsonl"]) as log:
        for step in range(steps):
            log.log({"critic/score/mean": 1 - math.exp(-step / 8), "actor/entropy": 2.0 * math.exp(-step / 10)},
                    step=step)


def test_load_metrics_merges_a_steps_records_and_skips_partial_lines(tmp_path):
    write_run(tmp_path, steps=3)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 1, "time": 0, "critic/score/mean": 42.0, "x": None}) + "\n")
        f.write('{"step": 3, "critic/sc')  # killed mid-write
    series = load_metrics(str(tmp_path / "metrics.jsonl"))
    assert series["critic/score/mean"] == ([0, 1, 2], [0.0, 42.0, pytest.approx(1 - math.exp(-2 / 8))])
    assert series["actor/entropy"][0] == [0, 1, 2]  # step 1's first record is kept where not overridden
    assert "x" not in series


def test_one_line_per_distinct_quantity_and_the_phases_of_a_step():
    same, other = ([1, 2], [0.5, 0.25]), ([1, 2], [0.5, 0.75])
    assert distinct({"reward/mean": same, "critic/score/mean": same, "critic/rewards/mean": other}) == \
        {"reward/mean = critic/score/mean": same, "critic/rewards/mean": other}
    # timing/to_rollout holds the save and the sync: its own bar is the rest
    times = phase_times({"timing/rollout": ([1], [2.0]), "timing/to_rollout": ([1], [1.5]), "sync/seconds": ([1], [1.0]),
                         "timing/save": ([1], [0.25]), "timing/update_actor": ([1], [3.0])})
    assert times == {"rollout": ([1], [2.0]), "update": ([1], [3.0]), "save": ([1], [0.25]),
                     "to_rollout": ([1], [0.25]), "sync": ([1], [1.0])}


def drawn(series) -> dict[str, tuple[str, list[str]]]:
    """{panel: (its title, its legend's labels)} as plot_run draws them."""
    import matplotlib.pyplot as plt

    from mcore_rl.metrics.plot import _draw

    out = {}
    for name, (title, ylabel, data) in select_panels(series).items():
        fig, ax = plt.subplots()
        _draw(ax, name, title, ylabel, data)
        out[name] = (ax.get_title(), ax.get_legend_handles_labels()[1])
        plt.close(fig)
    return out


def test_memory_panels_draw_each_phases_peak_against_the_plan(tmp_path):
    """A GPU run's keys: the plan's figures in the first record (mcore_rl.train logs plan.metrics()
    with the first sync), each phase's peaks (PhaseMonitor's keys) in every step's."""
    from mcore_rl.config.sections import load_config
    from mcore_rl.memory.planner import PHASES, GiB
    from mcore_rl.memory.plan import plan_for_config

    plan, _ = plan_for_config(load_config(os.path.join(ROOT, "configs", "tiny_gpu.yaml")), 141 * GiB)
    with MetricsLogger(str(tmp_path), ["jsonl"]) as log:
        log.log({"sync/seconds": 0.1, **plan.metrics()}, step=0)
        for step in (1, 2, 3):
            peaks = {f"memory/{what}_peak_gib_{ph}": step + i for i, ph in enumerate(PHASES) for what in ("gpu", "host_rss")}
            log.log({**peaks, "memory/gpu_at_peak_gib_train_trainer": 0.5}, step=step)
    panels = drawn(load_metrics(str(tmp_path / "metrics.jsonl")))
    assert panels["gpu_memory"][0] == "GPU memory per phase: peak, dashed: the plan"
    assert sorted(panels["gpu_memory"][1]) == sorted([f"{ph} peak" for ph in PHASES] + [f"gpu_gib_{ph}" for ph in PHASES]
                                                     + ["gpu_capacity_gib"])
    assert panels["host_memory"] == ("Host memory per phase: RSS peak, dashed: the plan",
                                     sorted(f"{ph} peak" for ph in PHASES) + ["host_gib"])


# a CPU run measures no GPU memory: every other panel is drawn for the README job
README_JOB_PANELS = sorted(f"{name}.png" for name in PANELS if name != "gpu_memory") + ["overview.png"]


def check_readme_job_plots(run_dir: str) -> None:
    """The plots of a README job (tests/e2e/test_train.py): every panel, timing and length included,
    drawn from the metrics.jsonl that run wrote; the plot CLI writes the same set."""
    assert sorted(os.listdir(os.path.join(run_dir, "plots"))) == sorted(README_JOB_PANELS)
    series = load_metrics(os.path.join(run_dir, "metrics.jsonl"))
    assert {"rollout", "to_train", "update", "to_rollout", "sync"} <= set(phase_times(series))
    assert {"response/length", "response/length_max", "response/length_min"} <= set(series)
    panels = drawn(series)  # what each panel shows: one line per distinct quantity, every phase
    assert panels["reward"][1] == ["reward/mean = critic/rewards/mean = critic/score/mean", "val/reward"]
    assert panels["length"][1] == ["response/length", "response/length_max", "response/length_min"]
    assert {"rollout", "to_train", "update", "to_rollout", "sync"} <= set(panels["timing"][1])
    assert panels["host_memory"] == ("Host memory per phase: RSS peak, no plan in this run",
                                     ["rollout peak", "save peak", "sync peak", "train peak"])
    out = os.path.join(run_dir, "plots_cli")
    proc = subprocess.run([sys.executable, "-m", "mcore_rl.metrics.plot", run_dir, "--out", out], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.path.basename(p) for p in proc.stdout.split()) == sorted(README_JOB_PANELS)
    for name in README_JOB_PANELS:
        data = open(os.path.join(out, name), "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_refuses_a_run_without_metrics(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text(json.dumps({"step": 0, "foo": 1}) + "\n")
    with pytest.raises(ValueError, match="no plottable metrics"):
        plot_run(str(empty))
    missing = subprocess.run([sys.executable, "-m", "mcore_rl.metrics.plot", str(tmp_path / "nope")],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert missing.returncode == 1 and "metrics.jsonl" in missing.stderr
