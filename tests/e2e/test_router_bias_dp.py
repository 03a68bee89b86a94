"""The aux-loss-free expert-bias update counts real tokens only: at data parallel 2 the ranks' micro-
batches are padded with filler tokens to equal lengths, and a DeepSeek-V3 actor there must update
its router biases exactly as one process does on the same batch (which needs no filler)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.support import actor_pp_scenario as S
from tests.support import distributed
from tests.support.rl_batch import B

RATE = 1e-2  # expert-bias step: large enough to move routing in one update
FAM = "deepseek_v3"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("router_bias")
    S.prepare(str(root))
    return root


def _biases(model) -> list[torch.Tensor]:
    return [m.expert_bias.detach().clone() for m in model.modules() if getattr(m, "expert_bias", None) is not None]


def _update_once(rank, world, root, name):
    """log-probs, one PPO update with expert-bias updates on, log-probs again (DP = world)."""
    from mcore_rl.actor import MegatronActor

    cfg = S.actor_cfg(1, 1, 1)
    cfg["critic"]["enabled"] = False
    cfg["actor"]["router_bias_update_rate"] = RATE
    batch = torch.load(os.path.join(root, "batch.pt"), weights_only=True)
    actor = MegatronActor(rank, world, 0, os.path.join(root, FAM, "hf"), cfg,
                          init={"policy": os.path.join(root, FAM, "hf")})
    out = {"bias_before": _biases(actor.model), "log_probs": S.as_driver(actor.log_probs(batch))}
    batch.update(old_log_probs=out["log_probs"])
    S.as_driver(actor.update(batch))
    out.update(bias_after=_biases(actor.model), log_probs_after=S.as_driver(actor.log_probs(batch)))
    if rank == 0:
        torch.save(out, os.path.join(root, f"{name}.pt"))
    actor.ps.destroy_model_parallel()


def test_dp2_expert_bias_update_equals_one_process(tiny):
    from mcore_rl.loop import micro_batches as mb

    batch = torch.load(tiny / "batch.pt", weights_only=True)
    lengths = mb.sample_lengths(batch["attention_mask"])
    half = B // 2  # each DP rank's samples, in micro-batches of S.MICRO
    packed = [[sum(lengths[r * half + i] for i in m) for m in mb.fixed_micro_batches(half, S.MICRO)]
              for r in range(2)]
    assert packed[0] != packed[1], packed  # the DP=2 ranks pad some micro-batches with filler

    distributed.run(_update_once, 1, 1, str(tiny), "dp1")
    distributed.run(_update_once, 2, 2, str(tiny), "dp2")
    one, two = (torch.load(tiny / f"{n}.pt", weights_only=True) for n in ("dp1", "dp2"))
    moved = [(a - b).abs().max().item() for a, b in zip(one["bias_after"], one["bias_before"])]
    assert moved and min(moved) == pytest.approx(RATE), moved  # every MoE layer's bias took a step
    for got, want in zip(two["bias_after"], one["bias_after"]):
        assert torch.equal(got, want), f"expert biases differ: {(got - want).abs().max().item():.2e}"
    mask = batch["response_mask"].bool()
    assert (one["log_probs_after"] - one["log_probs"])[mask].abs().max() > 1e-3  # the update moved it
    diff = (two["log_probs_after"] - one["log_probs_after"])[mask].abs().max().item()
    assert diff < 5e-6, f"log-probs after the update: DP=2 vs one process differ by {diff:.2e}"
