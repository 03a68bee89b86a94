"""The weight sync into SGLang's real engine, checked by reading the engine back.

Two Megatron actor processes (EP=2) and two colocated SGLang engines, set up exactly as
`python -m mcore_rl.train` does (`mcore_rl.rollout.launch`). A good sync passes the read-back and
SGLang's log-probs of its samples equal the trainer's; a sync that corrupts one tensor in flight,
or one that is skipped while the trainer's weights moved, fails the read-back naming the
parameter, and the skipped one also shows in the log-prob difference. The other transports (the
gloo stand-in for NCCL into engines on their own "GPUs", and disk) verify every sync of a 30-step
GRPO run, each on one of the other MoE families (GLM-4.5, Qwen3-MoE), which learns.

R3, rollout routing replay, on the same actors and engines (actor.routing_replay=true; a batch
without the engine's routes is routed live, as the sync checks' are), after the sync checks: the
trainer's expert bias is shifted after a sync, on the trainer only: its own top-k then differs from
the engine's, while the expert weights (sigmoid scores without the bias) do not. So with replay the
trainer must take the engine's experts for every (token, layer) and give the engine's log-probs;
without it, agreement falls below 1 and so does the log-prob match. Both sides are read: the
engine's routes as it returned them, the trainer's as its routers took them. The tiny GRPO job
learns with replay.
"""

from __future__ import annotations

import pytest
import torch

from mcore_rl.config import sections as C
from mcore_rl.config import checks as config_checks
from mcore_rl.loop import step_batch
from mcore_rl.models.routed_experts import ExpertLayout
from tests.support.sync_checks import (BROADCAST, DISK, GLM4_MOE_TINY, QWEN3_MOE_TINY, check_a_corrupted_tensor_fails,
                               check_a_skipped_sync_fails, check_verified_grpo_steps, grpo_steps, logp_gap,
                               perturb, started_run)
from tests.e2e.test_routing_replay import MISMATCH
from tests.e2e.test_train import reward_rises


# first, before the module's engine fixture starts: with its engines alive on the same 2 cores,
# these runs took 2-3x their time alone in CI
@pytest.mark.parametrize("overrides", [(*BROADCAST, *GLM4_MOE_TINY), (*DISK, *QWEN3_MOE_TINY)],
                         ids=["broadcast-glm4_moe", "disk-qwen3_moe"])
def test_other_transports_verify_every_sync_of_a_grpo_run_that_learns(tmp_path, overrides):
    """Also issue 27's GRPO run of each new family in SGLang's engine, learning."""
    check_verified_grpo_steps(str(tmp_path / "run"), *overrides, steps=30)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    with started_run(str(tmp_path_factory.mktemp("sync_run")), ("actor.routing_replay=true",)) as parts:
        yield parts


def test_readback_passes_and_logprobs_match_after_a_sync(run):
    cfg, group, engine, sync, source = run
    assert sync(0)["sync/verified"] == 1.0  # the first sync is always read back
    assert logp_gap(cfg, group, engine, source) < 1e-3


def test_a_corrupted_tensor_fails_the_readback(run):
    check_a_corrupted_tensor_fails(run, "kv_b_proj.weight differs")


def test_a_skipped_sync_fails_the_readback_and_the_logprob_match(run):
    check_a_skipped_sync_fails(run, "differs from the trainer's weights")


def test_the_sync_probe_compares_the_engines_model_with_the_trainers(run):
    """rollout.verify_sync_probe: after a good sync the engine's log-probs of the probe sequences
    are the trainer's; with the trainer moved and nothing synced, the probe sees the difference."""
    cfg, group, engine, sync, source = run
    sync(5, verify=True)
    gaps = sync._probe_gaps()
    rows, length = sync.probe.shape
    assert [g.shape for g in gaps] == [(rows, length - 1)] * len(engine.head_names)
    assert max(g.max().item() for g in gaps) < 1e-3
    group.call("run", perturb, 1.05)
    assert torch.cat(sync._probe_gaps()).max().item() > 1e-2
    sync(6, verify=True)
    assert logp_gap(cfg, group, engine, source) < 1e-3


@pytest.fixture(scope="module")
def shifted(run):
    """The module's run, synced, then the trainer's expert bias shifted (after the sync checks above)."""
    _, group, _, sync, _ = run
    sync(0)
    group.call("run", shift_expert_bias)
    return run


def shift_expert_bias(actor):
    """Trainer only: a bias that reorders each token's experts, not their weights. The same on every
    rank, as megatron keeps the replicated router: seeded by rank, the ranks' routers differed, and
    so did the ranks of a DP-attention engine they synced (each routing the batch its own way: the
    0.56 gap that had R3 refused under DP attention)."""
    g = torch.Generator().manual_seed(0)
    for m in actor.model.modules():
        if getattr(m, "expert_bias", None) is not None:
            m.expert_bias.add_(torch.randn(m.expert_bias.shape, generator=g) * 0.5)


def set_replay(actor, on: bool):
    actor.cfg["actor"]["routing_replay"] = on


def old_log_probs(group, batch, replay: bool):
    """(log-probs, the trainer's routes in the batch's layout, route agreement) of one pass."""
    group.call("run", set_replay, replay)
    logp = torch.cat(group.call("log_probs", batch))
    routes = torch.cat(group.call("run", lambda a: a.trainer_routes))  # each rank's data-parallel slice
    return logp, routes, group.call("route_agreement")[0]


def rollout(cfg, engine, source, seed=3):
    idx = [i for i in range(8) for _ in range(cfg.rollout.n)]
    experts = ExpertLayout.of(config_checks.hf_model_dims(cfg.model))
    return idx, step_batch.rollout(engine, source, idx, step_batch.sampling_params(cfg, source, seed=seed), experts)


def test_replayed_routes_are_the_engines_and_so_are_the_log_probs(shifted):
    cfg, group, engine, _, source = shifted
    _, batch = rollout(cfg, engine, source)
    engine_routes, mask = batch["routes"], batch["response_mask"].bool()
    assert (engine_routes >= 0).any(-1).any(-1).sum() > 0
    logp, trainer_routes, agreement = old_log_probs(group, batch, replay=True)
    routed = engine_routes[..., 0] >= 0  # every real token but each sample's last
    real = batch["attention_mask"].bool()[..., None].expand_as(routed)
    assert ((trainer_routes[..., 0] >= 0) == real).all(), "the trainer did not route exactly the real tokens"
    same = (trainer_routes.sort(-1).values == engine_routes.sort(-1).values).all(-1)
    assert same[routed].all() and agreement == 1.0
    gap = (logp - batch["rollout_log_probs"])[mask].abs()
    assert gap.max() < 1e-4, gap.max()  # weights come from the live router's dense scores

    logp_off, trainer_off, agreement_off = old_log_probs(group, batch, replay=False)
    same_off = (trainer_off.sort(-1).values == engine_routes.sort(-1).values).all(-1)[routed]
    assert 0.0 < agreement_off < 1.0 and agreement_off == pytest.approx(same_off.double().mean().item())
    assert (logp_off - batch["rollout_log_probs"])[mask].abs().mean() > 10 * gap.mean()
    print(f"route agreement, trainer expert bias shifted: replay {agreement}, live {agreement_off:.3f}")


def test_router_learns_under_replay(shifted):
    """Replayed experts, live weights: the update's gradient reaches the router."""
    cfg, group, engine, _, source = shifted
    idx, batch = rollout(cfg, engine, source, seed=4)
    group.call("run", set_replay, True)
    batch["old_log_probs"] = torch.cat(group.call("log_probs", batch))
    step_batch.advantages(cfg, batch, torch.rand(len(idx)), idx)
    before = group.call("run", router_weights)
    group.call("update", batch)
    after = group.call("run", router_weights)
    assert all((a - b).abs().max() > 0 for a, b in zip(after, before))


def test_grpo_learns_with_replay(shifted):
    """The README's tiny GRPO job, on these actors and engines, with replay: the reward rises from
    about 0.1 to above 0.7 in 30 steps, every step replays the engine's experts exactly and logs
    the mismatch metrics."""
    cfg, _, _, _, source = shifted
    order = torch.randperm(len(source.prompts), generator=torch.Generator().manual_seed(0))
    B = cfg.data.train_batch_size
    steps = grpo_steps(shifted, 30, prompts=lambda step: order[step * B:(step + 1) * B].tolist())
    assert all(set(MISMATCH) <= set(m) and m["rollout/route_agreement"] == 1.0 for m in steps), steps[-1]
    assert max(m["rollout/logp_diff_abs_max"] for m in steps[1:]) < 1e-3
    print("reward with replay:", [round(m["reward/mean"], 2) for m in steps])
    reward_rises(steps)


def router_weights(actor) -> torch.Tensor:
    from megatron.core.transformer.moe.router import TopKRouter

    return torch.cat([m.weight.detach().flatten().clone() for m in actor.model.modules() if isinstance(m, TopKRouter)])
