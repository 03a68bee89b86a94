"""Advantages, losses and KL: hand-computed cases, then agreement with verl on random inputs."""

import math

import numpy as np
import pytest
import torch

from mcore_rl.algos import (AdaptiveKLController, FixedKLController, agg_loss, apply_kl_in_reward,
                            compute_advantage, entropy_from_logits, entropy_loss, gae_advantage,
                            grpo_advantage, kl_estimate, kl_loss, make_kl_controller, masked_mean,
                            masked_whiten, policy_loss, reinforce_plus_plus_advantage,
                            reinforce_plus_plus_baseline_advantage, rloo_advantage, value_loss)
from tests.support.verl_reference import verl_module

T = torch.tensor


def outcome(scores, length=3):
    """Token-level rewards with the whole score on the last token, as a reward manager makes them."""
    rewards = torch.zeros(len(scores), length)
    rewards[:, -1] = T(scores, dtype=torch.float32)
    return rewards, torch.ones(len(scores), length)


# ----------------------------------------------------------------------------- hand-computed
def test_masked_reductions_ignore_padding_even_nan():
    values = T([[1.0, 3.0, float("nan")], [5.0, float("inf"), 0.0]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(values, mask).item() == pytest.approx(3.0)
    assert masked_mean(values, mask, dim=-1).tolist() == pytest.approx([2.0, 5.0])
    w = masked_whiten(T([[1.0, 2.0, 3.0, 99.0]]), T([[1, 1, 1, 0]]))
    assert w[0, :3].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)  # unbiased std = 1


def test_grpo_group_normalisation_by_hand():
    rewards, mask = outcome([1.0, 0.0, 1.0, 1.0, 0.0])
    mask[1, 2] = 0  # padding must not change a response's advantage, only where it is written
    adv, ret = grpo_advantage(rewards, mask, index=["a", "a", "b", "b", "c"])
    s = 0.5 / math.sqrt(0.5)  # group a: mean .5, unbiased std sqrt(.5)
    assert adv[:, 0].tolist() == pytest.approx([s, -s, 0.0, 0.0, 0.0], abs=1e-5)
    assert adv[1, 2] == 0 and torch.equal(adv, ret)
    adv_dr, _ = grpo_advantage(rewards, mask, index=["a", "a", "b", "b", "c"], norm_adv_by_std_in_grpo=False)
    assert adv_dr[:, 0].tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0, 0.0])
    # a singleton group keeps its raw score (verl's convention: mean 0, std 1)
    single, _ = grpo_advantage(*outcome([2.0]), index=[7])
    assert single[0, 0].item() == pytest.approx(2.0, rel=1e-5)


def test_rloo_leave_one_out_by_hand():
    rewards, mask = outcome([1.0, 0.0, 0.0, 3.0])
    adv, _ = rloo_advantage(rewards, mask, index=np.array([0, 0, 0, 1]))
    # 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5; singleton keeps its score
    assert adv[:, 1].tolist() == pytest.approx([1.0, -0.5, -0.5, 3.0])


def test_discounted_returns_and_gae_by_hand():
    rewards = T([[0.0, 0.0, 1.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    _, returns = reinforce_plus_plus_advantage(rewards, mask, gamma=0.5)
    assert returns[0].tolist() == pytest.approx([0.25, 0.5, 1.0, 0.0])
    # with lambda = 1 GAE telescopes to the Monte-Carlo return whatever the values are
    values = T([[0.3, -0.2, 0.7, 5.0]])
    _, returns = gae_advantage(rewards, mask, values=values, gamma=0.5, lam=1.0)
    assert returns[0].tolist() == pytest.approx([0.25, 0.5, 1.0, 0.0])
    # with lambda = 0 the advantage is the one-step TD error: r + gamma * V(next) - V
    adv0 = compute_advantage("gae", rewards, mask, values=values, gamma=0.5, lam=0.0)[1] - values * mask
    assert adv0[0, :3].tolist() == pytest.approx([0.0 + 0.5 * -0.2 - 0.3, 0.5 * 0.7 + 0.2, 1.0 - 0.7])
    # a masked gap (e.g. a tool observation) is bridged without discounting
    gap_mask = T([[1.0, 0.0, 1.0, 0.0]])
    _, returns = reinforce_plus_plus_advantage(rewards, gap_mask, gamma=0.5)
    assert returns[0].tolist() == pytest.approx([0.5, 0.0, 1.0, 0.0])


def test_reinforce_baseline_whitens_group_centred_scores():
    rewards, mask = outcome([1.0, 0.0, 2.0, 2.0])
    adv, _ = reinforce_plus_plus_baseline_advantage(rewards, mask, index=[0, 0, 1, 1])
    # centred scores .5, -.5, 0, 0 on 3 tokens each -> whitened over 12 tokens
    std = math.sqrt((6 * 0.25) / 11)
    assert adv[:, 0].tolist() == pytest.approx([0.5 / std, -0.5 / std, 0.0, 0.0], rel=1e-5)


def test_agg_modes_by_hand():
    loss = T([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0], [9.0, 9.0, 9.0]])
    mask = T([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    # global normalisation: 2 micro-batches of a 8-token batch on 2 DP ranks
    assert agg_loss(loss, mask, "token-mean", global_num_tokens=8, dp_size=2).item() == pytest.approx(2.5)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(loss, mask, "token-sum-mean")


def test_policy_loss_branches_by_hand():
    adv = T([[1.0, 1.0, -1.0, -1.0, -1.0]])
    ratio = T([[1.5, 0.5, 1.5, 0.5, 10.0]])
    old = torch.zeros_like(ratio)
    mask = torch.ones_like(ratio)
    loss, m = policy_loss(old, ratio.log(), adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                          clip_ratio_c=3.0)
    # A>0: max(-1.5, -1.28) = -1.28 (clipped); max(-.5, -.8) = -.5
    # A<0: max(1.5, 1.28) = 1.5; max(.5, .8) = .8 (clipped); max(10, 1.28) = 10 -> dual clip 3
    expected = [-1.28, -0.5, 1.5, 0.8, 3.0]
    assert loss.item() == pytest.approx(sum(expected) / 5, rel=1e-6)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(2 / 5)
    assert m["actor/pg_clipfrac_lower"].item() == pytest.approx(1 / 5)
    # rollout IS weights multiply each token's loss
    w = T([[1.0, 0.5, 2.0, 1.0, 1.0]])
    loss_tis, _ = policy_loss(old, ratio.log(), adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                              rollout_is_weights=w)
    assert loss_tis.item() == pytest.approx((-1.28 - 0.25 + 3.0 + 0.8 + 3.0) / 5, rel=1e-6)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(old, old, adv, mask, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="loss_mode"):
        policy_loss(old, old, adv, mask, loss_mode="ppo")


def test_gspo_and_cispo_by_hand():
    # one sequence of 2 tokens with ratios 4 and 1/4 (geometric mean 1) and one of ratio 2, 2
    old = torch.zeros(2, 2)
    new = T([[math.log(4.0), -math.log(4.0)], [math.log(2.0), math.log(2.0)]]).requires_grad_(True)
    adv, mask = T([[1.0, 1.0], [1.0, 1.0]]), torch.ones(2, 2)
    loss, m = policy_loss(old, new, adv, mask, loss_mode="gspo", clip_ratio_low=0.2, clip_ratio_high=0.2)
    # GSPO: sequence ratio 1 (unclipped, -1 per token) and 2 (clipped to 1.2, -1.2 per token)
    assert loss.item() == pytest.approx((-1 - 1 - 1.2 - 1.2) / 4)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(0.5)
    grad, = torch.autograd.grad(loss, new)
    # the unclipped sequence's tokens get d(-s)/dlogp = -s / 4 each; the clipped one none
    torch.testing.assert_close(grad, T([[-0.25, -0.25], [0.0, 0.0]]))
    # CISPO: -sg(clip(r)) * A * log pi: clipped tokens keep a gradient of -clip(r) * A / 4
    loss, m = policy_loss(old, new, adv, mask, loss_mode="cispo", clip_ratio_low=0.2, clip_ratio_high=0.2)
    grad, = torch.autograd.grad(loss, new)
    torch.testing.assert_close(grad, T([[-0.3, -0.2], [-0.3, -0.3]]))
    assert m["actor/pg_clipfrac"].item() == pytest.approx(1.0)


def test_dr_grpo_aggregation_by_hand():
    loss = T([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0]])
    mask = T([[1, 1, 1], [1, 0, 0]])
    # sequence token sums 6 and 4, mean over sequences 5, divided by a constant (not the lengths)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=10).item() == pytest.approx(0.5)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(5 / 3)  # verl: the width


def test_policy_gradient_sign_and_clip_cut():
    log_prob = torch.zeros(1, 2, requires_grad=True)
    loss, _ = policy_loss(torch.zeros(1, 2), log_prob, T([[1.0, -1.0]]), torch.ones(1, 2))
    loss.backward()
    assert log_prob.grad[0].tolist() == pytest.approx([-0.5, 0.5])  # raise good, lower bad
    log_prob = torch.full((1, 1), math.log(1.5), requires_grad=True)
    policy_loss(torch.zeros(1, 1), log_prob, T([[1.0]]), torch.ones(1, 1))[0].backward()
    assert log_prob.grad.item() == 0.0  # beyond 1 + eps with A > 0: no more push


def test_kl_estimators_and_controllers_by_hand():
    lp, ref = T([math.log(0.5)]), T([math.log(0.25)])
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_estimate(lp, ref, "low_var_kl").item() == pytest.approx(0.5 + math.log(2) - 1)
    assert kl_estimate(T([30.0]), T([0.0]), "k3").item() == 10.0  # clamped like verl
    with pytest.raises(ValueError, match="unknown KL"):
        kl_estimate(lp, ref, "k4")
    ctrl = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=0.5, n_steps=10)  # error clipped to +0.2
    assert ctrl.value == pytest.approx(0.1 * 1.02)
    fixed = make_kl_controller(type="fixed", kl_coef=0.3)
    fixed.update(5.0, 10)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.3


def test_kl_in_reward_by_hand():
    scores = T([[0.0, 1.0], [0.0, 0.0]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    old, ref = T([[0.2, 0.4], [0.6, 9.0]]), torch.zeros(2, 2)
    ctrl = AdaptiveKLController(0.5, target_kl=1.0, horizon=2)
    res = apply_kl_in_reward(scores, old, ref, mask, ctrl, kind="k1")
    torch.testing.assert_close(res.token_level_rewards, T([[-0.1, 0.8], [-0.3, 0.0]]))
    assert res.mean_kl == pytest.approx((0.3 + 0.6) / 2) and res.kl_coef == 0.5
    assert ctrl.value == pytest.approx(0.5 * (1 - 0.2 * 2 / 2))


def test_entropy_value_and_kl_losses_by_hand():
    logits = torch.zeros(1, 2, 4)
    logits[0, 1] = T([100.0, 0.0, 0.0, 0.0])
    assert entropy_from_logits(logits)[0].tolist() == pytest.approx([math.log(4), 0.0], abs=1e-6)
    assert entropy_loss(logits, T([[1, 0]])).item() == pytest.approx(math.log(4))
    loss, frac = value_loss(vpreds=T([[1.0, 0.0]]), returns=T([[2.0, 0.0]]), values=T([[0.0, 0.0]]),
                            response_mask=T([[1, 1]]), cliprange_value=0.5)
    # token 0: max((1-2)^2, (0.5-2)^2) = 2.25; token 1: 0
    assert loss.item() == pytest.approx(0.5 * 2.25 / 2) and frac.item() == pytest.approx(0.5)
    assert kl_loss(T([[0.0, 1.0]]), T([[0.0, 0.0]]), T([[1, 0]]), "k1").item() == 0.0


def test_unknown_estimator_names_the_known_ones():
    with pytest.raises(ValueError, match="grpo"):
        compute_advantage("ppo", *outcome([1.0]))


# ----------------------------------------------------------------------------- verl reference
@pytest.fixture(scope="module")
def verl_algos():
    return verl_module("verl.trainer.ppo.core_algos")


def random_batch(seed, batch=24, length=17, group=4):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    mask[0, 2:4] = 0  # an observation span inside a response
    scores = torch.randint(0, 3, (batch,), generator=g).float() * 0.5
    rewards = torch.zeros(batch, length)
    rewards[torch.arange(batch), lengths - 1] = scores  # outcome reward on the last token
    dense = torch.randn(batch, length, generator=g) * mask  # process rewards for GAE / RF++
    index = np.array([f"uid{i // group}" for i in range(batch)], dtype=object)
    index[-1] = "lonely"  # a singleton group
    return g, rewards, dense, mask, index


def on_mask(x, mask):
    return x[mask.bool()]


@pytest.mark.parametrize("seed", [0, 1])
def test_outcome_estimators_match_verl(verl_algos, seed):
    _, rewards, _, mask, index = random_batch(seed)
    cases = {
        "grpo": (verl_algos.compute_grpo_outcome_advantage, {}),
        "rloo": (verl_algos.compute_rloo_outcome_advantage, {}),
        "reinforce_plus_plus_baseline": (verl_algos.compute_reinforce_plus_plus_baseline_outcome_advantage,
                                         {}),
    }
    for name, (ref_fn, extra) in cases.items():
        ours, _ = compute_advantage(name, rewards, mask, index=index, **extra)
        theirs, _ = ref_fn(rewards.clone(), mask, index)
        torch.testing.assert_close(ours, theirs * mask, rtol=1e-5, atol=1e-6, msg=name)
    for norm in (True, False):
        ours, _ = grpo_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
        theirs, _ = verl_algos.compute_grpo_outcome_advantage(rewards.clone(), mask, index,
                                                              norm_adv_by_std_in_grpo=norm)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.7, 0.0)])
def test_gae_and_reinforce_match_verl(verl_algos, gamma, lam):
    g, _, dense, mask, _ = random_batch(3)
    values = torch.randn(dense.shape, generator=g)
    ours_adv, ours_ret = gae_advantage(dense, mask, values=values, gamma=gamma, lam=lam)
    ref_adv, ref_ret = verl_algos.compute_gae_advantage_return(dense, values, mask, gamma, lam)
    torch.testing.assert_close(on_mask(ours_adv, mask), on_mask(ref_adv, mask), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(on_mask(ours_ret, mask), on_mask(ref_ret, mask), rtol=1e-4, atol=1e-5)
    from omegaconf import OmegaConf
    ours_adv, ours_ret = reinforce_plus_plus_advantage(dense, mask, gamma=gamma)
    ref_adv, ref_ret = verl_algos.compute_reinforce_plus_plus_outcome_advantage(
        dense, mask, config=OmegaConf.create({"gamma": gamma}))
    torch.testing.assert_close(ours_adv, ref_adv, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours_ret, ref_ret, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_policy_value_entropy_losses_match_verl(verl_algos, mode):
    from omegaconf import OmegaConf
    g, _, _, mask, _ = random_batch(5)
    old = -torch.rand(mask.shape, generator=g) * 3
    new = (old + torch.randn(mask.shape, generator=g) * 0.4).requires_grad_(True)
    rollout = old + torch.randn(mask.shape, generator=g) * 0.3
    adv = torch.randn(mask.shape, generator=g)
    clip = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    cfg = OmegaConf.create({"clip_ratio": 0.2, **clip, "global_batch_info": {}})
    weights = torch.exp(old - rollout).clamp(max=2.0)
    ours, m = policy_loss(old, new, adv, mask, loss_agg_mode=mode, rollout_is_weights=weights, **clip)
    theirs, ref_m = verl_algos.compute_policy_loss_vanilla(old, new, adv, mask, loss_agg_mode=mode,
                                                           config=cfg, rollout_is_weights=weights)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    grad_ours, = torch.autograd.grad(ours, new)
    grad_ref, = torch.autograd.grad(theirs, new)
    torch.testing.assert_close(grad_ours, grad_ref)
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert m[key].item() == pytest.approx(ref_m[key], rel=1e-5, abs=1e-7), key

    vpreds, values = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    returns = torch.randn(mask.shape, generator=g)
    ours_v, ours_frac = value_loss(vpreds, returns, values, mask, 0.3, loss_agg_mode=mode)
    ref_v, ref_frac = verl_algos.compute_value_loss(vpreds, returns, values, mask, 0.3, loss_agg_mode=mode)
    torch.testing.assert_close(ours_v, ref_v)
    torch.testing.assert_close(ours_frac, ref_frac)

    logits = torch.randn(*mask.shape, 11, generator=g) * 3
    torch.testing.assert_close(entropy_loss(logits, mask, mode),
                               verl_algos.compute_entropy_loss(logits, mask, loss_agg_mode=mode))


def test_kl_estimators_and_controller_match_verl(verl_algos):
    g = torch.Generator().manual_seed(9)
    lp, ref = -torch.rand(6, 9, generator=g) * 8, -torch.rand(6, 9, generator=g) * 8
    ref[0, 0] = lp[0, 0] + 25  # exercises the k3 clamps
    for ours_name, verl_name in [("k1", "kl"), ("k2", "mse"), ("low_var_kl", "low_var_kl"), ("abs", "abs")]:
        torch.testing.assert_close(kl_estimate(lp, ref, ours_name), verl_algos.kl_penalty(lp, ref, verl_name))
    ours, theirs = AdaptiveKLController(0.05, 0.02, 50), verl_algos.AdaptiveKLController(0.05, 0.02, 50)
    for kl in (0.001, 0.019, 0.5, 0.03):
        ours.update(kl, 8)
        theirs.update(kl, 8)
        assert ours.value == pytest.approx(theirs.value, rel=1e-12)


def verl_actor_config(**clip):
    """verl's ActorConfig, which its GSPO and CISPO losses insist on."""
    return verl_module("verl.workers.config.actor").ActorConfig(
        strategy="megatron", ppo_micro_batch_size_per_gpu=1, rollout_n=1, clip_ratio=0.2, **clip)


@pytest.mark.parametrize("loss_mode", ["gspo", "cispo"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_gspo_cispo_match_verl(verl_algos, loss_mode, mode):
    g, _, _, mask, _ = random_batch(11)
    old = -torch.rand(mask.shape, generator=g) * 3
    new = (old + torch.randn(mask.shape, generator=g) * 0.3).requires_grad_(True)
    adv = torch.randn(mask.shape, generator=g)
    weights = torch.rand(mask.shape, generator=g) * 2
    clip = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)
    ours, m = policy_loss(old, new, adv, mask, loss_mode=loss_mode, loss_agg_mode=mode, rollout_is_weights=weights,
                          **clip)
    theirs, ref_m = verl_algos.get_policy_loss_fn(loss_mode)(old, new, adv, mask, loss_agg_mode=mode,
                                                             config=verl_actor_config(**clip),
                                                             rollout_is_weights=weights)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(ours, new)[0], torch.autograd.grad(theirs, new)[0])
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert m[key].item() == pytest.approx(ref_m[key], rel=1e-5, abs=1e-7), key


def test_dr_grpo_aggregation_matches_verl(verl_algos):
    g, _, _, mask, _ = random_batch(12)
    loss_mat = torch.randn(mask.shape, generator=g)
    for factor in (None, 64):
        torch.testing.assert_close(agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=factor),
                                   verl_algos.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm",
                                                       loss_scale_factor=factor))
