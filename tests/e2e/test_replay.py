"""Dump and replay (mcore_rl.loop.rollout_dump): a dumped rollout round-trips, and `--replay` trains on
one fixed batch without an engine, with the same grad norm at EP=2, PP=2 and TP=2 (gloo, CPU), each
started from the HF checkpoint, every rank reading its own shard."""

from __future__ import annotations

import os
import re

import pytest
import torch

from mcore_rl.loop.rollout_dump import DumpError, ReplaySource, dump_rollout
from tests.support.rl_batch import rl_batch
from tests.e2e.test_train_algos import _train
from tests.support.tiny_models import make_hf_model

ROLLOUT_KEYS = ("tokens", "attention_mask", "response_mask", "rollout_log_probs")


def fixed_rollout(directory: str) -> dict:
    """rl_batch's samples as step 1's rollout: 3 prompts x 2 samples, each group with unequal scores."""
    batch = {k: v for k, v in rl_batch().items() if k in ROLLOUT_KEYS}
    score = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    dump_rollout(directory, 1, batch, [4, 4, 7, 7, 9, 9], score, score - 0.25)
    return batch


def test_dump_round_trips_and_replay_errors(tmp_path):
    batch = fixed_rollout(str(tmp_path))
    replay = ReplaySource(str(tmp_path))
    sb = replay.next_batch(1)
    got, idx, score, reward = sb.batch, sb.idx, sb.score, sb.reward
    assert replay.steps == [1] and idx == [4, 4, 7, 7, 9, 9] and torch.equal(reward, score - 0.25)
    assert all(torch.equal(got[k], batch[k]) for k in ROLLOUT_KEYS)
    with pytest.raises(DumpError, match=r"no dump for step 2 \(the directory has steps \[1\]\)"):
        replay.next_batch(2)
    with pytest.raises(DumpError, match="no rollout dumps"):
        ReplaySource(str(tmp_path / "empty"))


def test_replay_grad_norm_agrees_across_layouts(tmp_path):
    make_hf_model("deepseek_v3", str(tmp_path / "hf"))  # MoE + MLA, 4 layers, 8 experts, vocab 256
    fixed_rollout(str(tmp_path / "dump"))
    norms = {}
    for name, layout in {"ep2": ["parallel.ep=2"], "pp2": ["parallel.ep=1", "parallel.pp=2"],
                         "tp2": ["parallel.ep=1", "parallel.tp=2", "parallel.etp=2",
                                 "parallel.sequence_parallel=true"]}.items():
        recs, log = _train(str(tmp_path / name), "configs/tiny_cpu.yaml", "--replay", str(tmp_path / "dump"),
                         "model.hf_config=null", f"model.hf_path={tmp_path / 'hf'}", "rollout.n=2",
                         "rollout.max_response_len=8", "data.train_batch_size=3", "actor.ppo_mini_batch_size=3",
                         "actor.micro_batch_size=3", "trainer.total_training_steps=1", "trainer.save_freq=-1",
                         "trainer.logger=[jsonl]", *layout)
        _started_from_hf(log, str(tmp_path / "hf"), str(tmp_path / name))
        step = next(r for r in recs if "actor/grad_norm" in r)
        norms[name] = step["actor/grad_norm"]
        assert step["reward/mean"] == pytest.approx(0.5) and "timing/rollout" in step
    assert norms["ep2"] > 0
    for name in ("pp2", "tp2"):
        assert norms[name] == pytest.approx(norms["ep2"], rel=1e-2), norms


def _started_from_hf(log: str, hf: str, run_dir: str) -> None:
    """The start from an HF checkpoint on the console: its check against the model's shapes, the first
    phase, and each rank reading its own shard (phases with their seconds, and what they read), and no
    converted copy in the run directory."""
    from mcore_rl.metrics.console import start_record

    phases = [name for name, _ in start_record(log.splitlines())["phases"]]
    assert phases[:2] == [f"checking {hf} against the model's shapes", "starting Ray, placing the trainer"], log
    assert phases[2:5] == ["building the trainer's model (2 ranks)",
                           f"reading the initial weights, each rank its shard of {hf}", "making the optimizer"], log
    assert re.search(r"^initial weights: 2 ranks read [\d.]+ GiB \([\d.]+-[\d.]+ GiB a rank\) in [\d.]+ s", log, re.M), log
    copies = [d for d, _, files in os.walk(run_dir) if "metadata.json" in files  # a torch_dist checkpoint
              and os.path.relpath(d, run_dir).split(os.sep)[0] != "checkpoints"]
    assert not copies, copies
