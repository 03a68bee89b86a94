"""Pipeline parallelism in the actor: at PP=2 (gloo processes, megatron's 1F1B schedule) every
MegatronActor method gives what the PP=1 actor gives from the same HF weights: log-probs,
one PPO update over micro-batches of different packed lengths (grad norm, stats and the updated
weights), the embedded rollout's sampled tokens, and a critic's update and values; for a MoE+MLA
and a dense tied-embedding model, and at PP=2 x DP=2 x EP=2. Then the trainer end to end at PP=2.
The scenario itself (also runnable on GPUs, and with TP=2 x PP=2) is tests/support/actor_pp_scenario.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.support import actor_pp_scenario as S
from tests.support import distributed
from tests.support.rl_batch import B

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("actor_pp")
    S.prepare(str(root))
    return root


def _run_actor(rank, world, *args):
    S.run_actor(rank, world, 0, *args)  # tests/support/distributed.py has set up the gloo group


def test_pp2_actor_matches_pp1(tiny):
    from mcore_rl.loop import micro_batches as mb

    batch = torch.load(tiny / "batch.pt", weights_only=True)
    lengths = mb.sample_lengths(batch["attention_mask"])
    packed = [sum(lengths[i] for i in m) for m in mb.fixed_micro_batches(B, S.MICRO)]
    assert len(packed) >= 2 and len(set(packed)) == len(packed), packed  # 17, 11 and 16 tokens
    for world, *layout in S.LAYOUTS:
        distributed.run(_run_actor, world, world, str(tiny), *layout)
    diffs = S.compare(str(tiny))
    assert len(diffs) == 3, sorted(diffs)  # both families at PP=2, DeepSeek-V3 at PP=2 x DP=2 x EP=2
    bad = {k: d for k, d in diffs.items() if not S.agree(d)}
    assert not bad, json.dumps(bad, indent=1)
    mask = batch["response_mask"].bool()
    for fam in S.FAMILIES:  # the agreement is not the trivial one: the updates moved policy and critic head
        ref = torch.load(tiny / fam / f"{S.name(1, 1, 1)}.pt", weights_only=True)
        assert (ref["log_probs_after"] - ref["log_probs"])[mask].abs().max() > 1e-3
        assert ref["values"][mask].abs().min() > 0 and ref["update"]["actor/grad_norm"] > 0


def test_pp2_training_run_finishes(tmp_path):
    """The trainer over Ray at PP=2: PPO with a critic (tied embeddings across the two stages)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "mcore_rl.train", "--config", "configs/tiny_ppo_cpu.yaml", "parallel.pp=2",
           "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.save_freq=-1",
           "trainer.val_before_train=false", f"trainer.output_dir={out}"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"))
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "critic/vf_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    rewarded = [r for r in steps if r["critic/rewards/mean"] > 0]  # an all-zero batch has no gradient
    assert rewarded and all(r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0 for r in rewarded)
    assert (out / "checkpoints" / "step_2" / "critic").is_dir()  # each stage saves its part
