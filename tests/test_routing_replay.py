"""R3, rollout routing replay, against SGLang's real CPU engine: two Megatron ranks (EP=2) and two
colocated engines of configs/tiny_cpu.yaml with actor.routing_replay=true.

The trainer's expert bias is shifted after the sync, on the trainer only: its own top-k then
differs from the engine's, while the expert weights (sigmoid scores without the bias) do not. So
with replay the trainer must take the engine's experts for every (token, layer) and give the
engine's log-probs; without it, agreement falls below 1 and so does the log-prob match. Both sides
are read: the engine's routes as it returned them, the trainer's as its routers took them.
"""

from __future__ import annotations

import os

import pytest
import torch

from mcore_rl import config as C
from mcore_rl import ppo
from mcore_rl.routing import ExpertLayout, RouteError, batch_routes
from mcore_rl.rollout.base import Completion
from tests.sync_checks import started_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    with started_run(str(tmp_path_factory.mktemp("r3_run")), ("actor.routing_replay=true",)) as parts:
        cfg, group, engine, sync, source = parts
        sync(0)
        group.call("run", shift_expert_bias)
        yield parts


def shift_expert_bias(actor):
    """Trainer only: a bias that reorders each token's experts, not their weights."""
    g = torch.Generator().manual_seed(actor.rank)
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
    experts = ExpertLayout.of(C.hf_model_dims(cfg.model))
    return idx, ppo.rollout(engine, source, idx, ppo.sampling_params(cfg, source, seed=seed), experts)


def test_replayed_routes_are_the_engines_and_so_are_the_log_probs(run):
    cfg, group, engine, _, source = run
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


def test_router_learns_under_replay(run):
    """Replayed experts, live weights: the update's gradient reaches the router."""
    cfg, group, engine, _, source = run
    idx, batch = rollout(cfg, engine, source, seed=4)
    group.call("run", set_replay, True)
    batch["old_log_probs"] = torch.cat(group.call("log_probs", batch))
    ppo.advantages(cfg, batch, torch.rand(len(idx)), idx)
    before = group.call("run", router_weights)
    group.call("update", batch)
    after = group.call("run", router_weights)
    assert all((a - b).abs().max() > 0 for a, b in zip(after, before))


MISMATCH = ("rollout/logp_diff_abs_mean", "rollout/logp_diff_abs_max", "rollout/token_mult_prob_error",
            "rollout/kl_k3", "rollout/route_agreement")


def test_grpo_learns_with_replay(run):
    """The README's tiny GRPO job, on these actors and engines, with replay: the reward rises from
    about 0.1 to above 0.7 in 30 steps, every step replays the engine's experts exactly and logs
    the mismatch metrics."""
    from mcore_rl.train import Phases, rl_step

    cfg, group, engine, sync, source = run
    phases = Phases(cfg, group, engine, sync)
    order = torch.randperm(len(source.prompts), generator=torch.Generator().manual_seed(0))
    B, steps = cfg.data.train_batch_size, []
    try:
        for step in range(1, 31):
            steps.append(rl_step(cfg, group, engine, phases, source, order[step * B:(step + 1) * B].tolist(), step))
            phases.to_rollout(step)
    finally:
        phases.mon.close()
    assert all(set(MISMATCH) <= set(m) and m["rollout/route_agreement"] == 1.0 for m in steps), steps[-1]
    assert max(m["rollout/logp_diff_abs_max"] for m in steps[1:]) < 1e-3
    first, last = (sum(m["reward/mean"] for m in part) / 3 for part in (steps[:3], steps[-3:]))
    print("reward with replay:", [round(m["reward/mean"], 2) for m in steps])
    assert first < 0.3 and last > 0.7, f"reward did not rise: first {first:.2f}, last {last:.2f}"


def router_weights(actor) -> torch.Tensor:
    from megatron.core.transformer.moe.router import TopKRouter

    return torch.cat([m.weight.detach().flatten().clone() for m in actor.model.modules() if isinstance(m, TopKRouter)])


LAYOUT = ExpertLayout(num_experts=4, topk=2, moe_layers=(1,))


def completion(routes, tokens=2):
    return Completion(list(range(tokens)), [0.0] * tokens, routed_experts=routes)


@pytest.mark.parametrize("routes, match", [
    (None, "SGLang returned no routed experts for sample 0"),
    (torch.zeros(3, 2, 2, dtype=torch.int32), r"shape \(3, 2, 2\) for sample 0: expected \[4 tokens"),
    (torch.tensor([[[0, 0], [0, 4]]] * 4, dtype=torch.int32), "outside 0..3"),
    (torch.tensor([[[0, 0], [2, 2]]] * 4, dtype=torch.int32), "to one expert twice"),
])
def test_bad_routes_are_one_clear_error(routes, match):
    with pytest.raises(RouteError, match=match):
        batch_routes([completion(routes)], [3], 6, LAYOUT, "SGLang")


def test_routes_sit_beside_their_tokens():
    """Prompt of 3 in a width-4 prompt column, 2 response tokens: 4 routed rows from column 1; the
    last token and the padding get -1, and the dense layer 0 is left out."""
    r = torch.tensor([[[0, 0], [k % 4, (k + 1) % 4]] for k in range(4)], dtype=torch.int32)
    out = batch_routes([completion(r)], [3], 6, LAYOUT, "SGLang")
    assert out.shape == (1, 6, 1, 2)
    assert out[0, :, 0, 0].tolist() == [-1, 0, 1, 2, 3, -1]


def test_replay_survives_activation_recompute():
    """megatron's checkpoint reruns the router inside backward: each micro-batch gets its own
    experts back (not the last one set), and the gradient reaches exactly those experts' logits."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from mcore_rl import compat
    from mcore_rl.models.replay import RouteReplay, start

    compat.apply(cpu=True)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    replay = RouteReplay(0)
    start([replay], replay=True, record=False)
    taken, own = [], replay.get_replay_topk

    def spy(*args, **kwargs):
        probs, ids = own(*args, **kwargs)
        taken.append(ids[0].tolist())
        return probs, ids

    replay.get_replay_topk = spy
    logits = [torch.randn(5, 8, requires_grad=True) for _ in range(2)]
    outs = []
    for x, experts in zip(logits, ([0, 1], [6, 7])):
        replay.set_target_indices(torch.tensor([experts] * 5))
        route = lambda x: topk_routing_with_score_function(x, 2, score_function="sigmoid", router_replay=replay)[0]  # noqa: E731
        outs.append(tensor_parallel.checkpoint(route, False, x))
    for out in outs:
        out.sum().backward()
    assert taken == [[0, 1], [6, 7], [0, 1], [6, 7]]  # two forwards, then their recomputes in order
    assert [x.grad.abs().sum(0).nonzero().squeeze(1).tolist() for x in logits] == [[0, 1], [6, 7]]


def _replay_at_layout(rank, world, root, tp, pp, ep):
    """At TP=tp x PP=pp x EP=ep (no engine): record the trainer's live routes, shift its expert
    bias, replay the recorded routes. Rank 0 saves the log-probs of the three passes."""
    import torch.distributed as dist
    from megatron.core.transformer.moe.router import TopKRouter

    from mcore_rl.actor import MegatronActor
    from tests.actor_pp_scenario import actor_cfg, as_driver
    from tests.rl_batch import rl_batch

    cfg = actor_cfg(tp, pp, ep)
    cfg["actor"].update(routing_replay=True, use_kl_loss=False)
    cfg["critic"]["enabled"] = False
    actor = MegatronActor(rank, world, 0, os.path.join(root, "hf"), cfg)
    batch, layout = rl_batch(), ExpertLayout.of(actor.hf)
    unrouted = torch.full((*batch["tokens"].shape, len(layout.moe_layers), layout.topk), -1, dtype=torch.int16)
    live = as_driver(actor.log_probs({**batch, "routes": unrouted}))  # no routes to replay: the router's own
    recorded = unrouted.int()
    recorded[actor._dp_slice(len(recorded))] = actor.trainer_routes.int()
    dist.all_reduce(recorded, op=dist.ReduceOp.MAX)  # each rank routed its own tokens (TP) and layers (PP)
    for m in actor.model.modules():
        if isinstance(m, TopKRouter):
            m.expert_bias.add_(torch.randn(m.expert_bias.shape, generator=torch.Generator().manual_seed(m.layer_number)))
    replayed = as_driver(actor.log_probs({**batch, "routes": recorded.short()}))
    agreement = actor._route_agreement
    shifted = as_driver(actor.log_probs({**batch, "routes": unrouted}))
    if rank == 0:
        torch.save(dict(live=live, replayed=replayed, shifted=shifted, agreement=agreement, recorded=recorded,
                        mask=batch["attention_mask"]), os.path.join(root, f"tp{tp}pp{pp}.pt"))
    actor.ps.destroy_model_parallel()


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 1)], ids=["pp2", "tp2_sequence_parallel"])
def test_replay_at_pipeline_and_tensor_parallel_layouts(tmp_path, tp, pp):
    """Routes reach the right router (PP: each stage its layers) and the right tokens (TP: each
    rank its sequence-parallel slice): replaying the recorded routes under a shifted bias gives
    the unshifted log-probs back."""
    from tests import distributed
    from tests.tiny_models import make_hf_model

    make_hf_model("deepseek_v3", str(tmp_path / "hf"))
    distributed.run(_replay_at_layout, 2, 2, str(tmp_path), tp, pp, 1)
    got = torch.load(tmp_path / f"tp{tp}pp{pp}.pt", weights_only=True)
    real = got["mask"].bool()[..., None]
    assert ((got["recorded"][..., 0] >= 0) == real).all()  # every real token in every MoE layer, once
    assert got["agreement"] == 1.0
    assert (got["replayed"] - got["live"]).abs().max() < 1e-5
    assert (got["shifted"] - got["live"]).abs().max() > 1e-3  # the shift does change routing
