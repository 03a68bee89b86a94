"""Metrics logger sinks, secret hygiene, timing, rollout metrics, and the plot CLI."""

import io
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import yaml

from mcore_rl.metrics import MetricsLogger, is_secret_key, redact, rollout_metrics, timed
from mcore_rl.plot import PANELS, load_metrics, plot_run

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


def test_timed_accumulates_phases():
    metrics = {}
    for _ in range(2):
        with timed("gen", metrics):
            sum(range(10000))
    with pytest.raises(RuntimeError), timed("update_actor", metrics):
        raise RuntimeError("still timed")
    assert set(metrics) == {"timing_s/gen", "timing_s/update_actor"} and metrics["timing_s/gen"] > 0


def test_rollout_metrics_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 9.0], [-1.0, -1.0, -1.0]])
    m = rollout_metrics(scores, scores - 0.5 * mask, adv, adv, mask, max_response_len=3)
    assert m["critic/score/mean"] == 0.5 and m["critic/score/max"] == 1.0
    assert m["critic/rewards/mean"] == pytest.approx((0.0 - 1.5) / 2)
    assert m["critic/advantages/max"] == 1.0 and m["critic/advantages/mean"] == pytest.approx(-1 / 5)
    assert m["response_length/mean"] == 2.5 and m["response_length/clip_ratio"] == 0.5


def write_run(run_dir, steps=30):
    with MetricsLogger(str(run_dir), ["jsonl"]) as log:
        for step in range(steps):
            log.log({"critic/score/mean": 1 - math.exp(-step / 8), "critic/score/max": 1.0,
                     "actor/entropy": 2.0 * math.exp(-step / 10), "actor/ppo_kl": 0.001 * step,
                     "actor/kl_loss": 0.002 * step, "actor/pg_loss": -0.1 + 0.01 * math.sin(step),
                     "timing_s/gen": 3 + math.sin(step), "timing_s/update_actor": 5.0,
                     "response_length/mean": 100 + step}, step=step)


def test_load_metrics_merges_a_steps_records_and_skips_partial_lines(tmp_path):
    write_run(tmp_path, steps=3)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 1, "time": 0, "critic/score/mean": 42.0, "x": None}) + "\n")
        f.write('{"step": 3, "critic/sc')  # killed mid-write
    series = load_metrics(str(tmp_path / "metrics.jsonl"))
    assert series["critic/score/mean"] == ([0, 1, 2], [0.0, 42.0, pytest.approx(1 - math.exp(-2 / 8))])
    assert series["actor/entropy"][0] == [0, 1, 2]  # step 1's first record is kept where not overridden
    assert "x" not in series


def test_panels_pick_their_metrics():
    shows = {name: wants for name, (_, _, wants) in PANELS.items()}
    assert shows["reward"]("critic/score/mean") and shows["reward"]("val/reward")
    assert not shows["reward"]("critic/score/max") and not shows["reward"]("actor/reward_kl_penalty")
    assert shows["kl"]("actor/reward_kl_penalty") and not shows["kl"]("actor/pg_clipfrac")
    assert shows["timing"]("timing_s/gen") and shows["loss"]("actor/pg_loss")


def test_plot_cli_writes_pngs(tmp_path):
    write_run(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "mcore_rl.plot", str(tmp_path)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    names = sorted(os.path.basename(p) for p in proc.stdout.split())
    assert names == ["entropy.png", "kl.png", "length.png", "loss.png", "overview.png", "reward.png",
                     "timing.png"]
    for name in names:
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text(json.dumps({"step": 0, "foo": 1}) + "\n")
    with pytest.raises(ValueError, match="no plottable metrics"):
        plot_run(str(empty))
    missing = subprocess.run([sys.executable, "-m", "mcore_rl.plot", str(tmp_path / "nope")],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert missing.returncode == 1 and "metrics.jsonl" in missing.stderr
