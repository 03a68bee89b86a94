"""R3, rollout routing replay: the routes' layout next to their tokens, their errors, replay through
activation recompute and at pipeline and tensor parallel layouts. R3 against SGLang's real CPU
engine (replayed routes are the engine's and so are the log-probs; GRPO learns with replay) runs in
tests/e2e/test_train_sglang.py, on the engines and actors of its sync checks: one start for both.
"""

from __future__ import annotations

import os

import pytest
import torch

from mcore_rl.models.routed_experts import ExpertLayout, RouteError, batch_routes
from mcore_rl.rollout.base import Completion

# the engine-trainer mismatch metrics a step logs (tests/e2e/test_train.py, tests/e2e/test_train_sglang.py)
MISMATCH = ("rollout/logp_diff_abs_mean", "rollout/logp_diff_abs_max", "rollout/token_mult_prob_error",
            "rollout/kl_k3", "rollout/route_agreement")


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

    from mcore_rl import patches
    from mcore_rl.models.replay import RouteReplay, start

    patches.apply(cpu=True)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    replay = RouteReplay(0)
    start([replay], replay=True, record=False)
    taken, own = [], replay.get_replay_topk

    def spy(*args, **kwargs):
        probs, ids = own(*args, **kwargs)
        taken.append(ids[0].tolist())
        return probs, ids

    replay.get_replay_topk = spy
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(5, 8, generator=gen, requires_grad=True) for _ in range(2)]
    outs = []
    for x, experts in zip(logits, ([0, 1], [6, 7])):
        replay.set_target_indices(torch.tensor([experts] * 5))
        route = lambda x: topk_routing_with_score_function(x, 2, score_function="sigmoid", router_replay=replay)[0]  # noqa: E731
        outs.append(tensor_parallel.checkpoint(route, False, x))
    weight = torch.arange(1.0, 9.0)  # the top-k probs are normalized: their plain sum has no gradient
    for out in outs:
        (out * weight).sum().backward()
    assert taken == [[0, 1], [6, 7], [0, 1], [6, 7]]  # two forwards, then their recomputes in order
    assert [x.grad.abs().sum(0).nonzero().squeeze(1).tolist() for x in logits] == [[0, 1], [6, 7]]


def _replay_at_layout(rank, world, root, tp, pp, ep):
    """At TP=tp x PP=pp x EP=ep (no engine): record the trainer's live routes, shift its expert
    bias, replay the recorded routes. Rank 0 saves the log-probs of the three passes."""
    import torch.distributed as dist
    from megatron.core.transformer.moe.router import TopKRouter

    from mcore_rl.actor import MegatronActor
    from tests.support.actor_pp_scenario import actor_cfg, as_driver
    from tests.support.rl_batch import rl_batch

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
    from tests.support import distributed
    from tests.support.tiny_models import make_hf_model

    make_hf_model("deepseek_v3", str(tmp_path / "hf"))
    distributed.run(_replay_at_layout, 2, 2, str(tmp_path), tp, pp, 1)
    got = torch.load(tmp_path / f"tp{tp}pp{pp}.pt", weights_only=True)
    real = got["mask"].bool()[..., None]
    assert ((got["recorded"][..., 0] >= 0) == real).all()  # every real token in every MoE layer, once
    assert got["agreement"] == 1.0
    assert (got["replayed"] - got["live"]).abs().max() < 1e-5
    assert (got["shifted"] - got["live"]).abs().max() > 1e-3  # the shift does change routing
