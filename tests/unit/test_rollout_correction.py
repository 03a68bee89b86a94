"""Rollout correction (mcore_rl.algos.rollout_correction): hand cases, then agreement with verl's
rollout_corr_helper on random inputs for every IS level, threshold form and rejection option."""

import math

import pytest
import torch

from mcore_rl.algos.rollout_correction import RS_OPTIONS, compute_rollout_correction, parse_rs_thresholds
from tests.support.verl_reference import verl_module

T = torch.tensor


def log_ratios(*rows):
    """(old, rollout, mask) whose per-token ratios pi_train / pi_rollout are `rows` (0: padding)."""
    ratio = T(rows, dtype=torch.float64)
    mask = (ratio > 0).double()
    return torch.where(mask.bool(), ratio, torch.ones_like(ratio)).log(), torch.zeros_like(ratio), mask


def test_token_and_sequence_tis_by_hand():
    old, rollout, mask = log_ratios([4.0, 0.5, 1.0], [2.0, 2.0, 0.0])
    w, kept, m = compute_rollout_correction(old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0)
    torch.testing.assert_close(w, T([[2.0, 0.5, 1.0], [2.0, 2.0, 0.0]], dtype=torch.float64))
    assert torch.equal(kept, mask)  # IS alone rejects nothing
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)  # only 4 exceeds 2
    # sequence level: products 2 and 4, truncated at 3, one weight for all tokens of a sequence
    w, _, m = compute_rollout_correction(old, rollout, mask, rollout_is="sequence", rollout_is_threshold=3.0)
    torch.testing.assert_close(w, T([[2.0, 2.0, 2.0], [3.0, 3.0, 0.0]], dtype=torch.float64))
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 2)
    # batch normalisation: mean weight over sequences becomes 1
    w, _, _ = compute_rollout_correction(old, rollout, mask, rollout_is="sequence", rollout_is_threshold=3.0,
                                         rollout_is_batch_normalize=True)
    assert w[:, 0].tolist() == pytest.approx([0.8, 1.2])


def test_icepop_zeroes_out_of_band_tokens_but_keeps_the_mask():
    old, rollout, mask = log_ratios([4.0, 0.5, 1.0, 0.1])
    w, kept, m = compute_rollout_correction(old, rollout, mask, rollout_is="token", rollout_is_threshold="0.5_2.0")
    assert w[0].tolist() == pytest.approx([0.0, 0.5, 1.0, 0.0])
    assert torch.equal(kept, mask) and m["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(0.5)


def test_masked_is_and_geometric_mean_rejection_by_hand():
    # sequence 0: ratios 4 and 1/4 (product 1, geometric mean 1); sequence 1: 1.5, 1.5 (geo mean 1.5)
    old, rollout, mask = log_ratios([4.0, 0.25], [1.5, 1.5])
    # token_k1 bounds the token ratio pi_rollout / pi_train (k1 = -log r) to [1/2, 2]
    _, kept, m = compute_rollout_correction(old, rollout, mask, rollout_rs="token_k1", rollout_rs_threshold=2.0)
    assert kept.tolist() == [[0.0, 0.0], [1.0, 1.0]]
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.5)
    # seq_sum_k1: the sequence ratio (product: 1 and 2.25) within [0.4, 2.5]: both pass
    _, kept, _ = compute_rollout_correction(old, rollout, mask, rollout_rs="seq_sum_k1", rollout_rs_threshold="0.4_2.5")
    assert torch.equal(kept, mask)
    # seq_mean_k1: the geometric mean ratio within [0.8, 1.25]: sequence 1 (1.5) is rejected whole
    _, kept, m = compute_rollout_correction(old, rollout, mask, rollout_rs="seq_mean_k1",
                                            rollout_rs_threshold="0.8_1.25")
    assert kept.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)
    # options chain: every one must pass
    _, kept, _ = compute_rollout_correction(old, rollout, mask, rollout_rs="seq_mean_k1,token_k1",
                                            rollout_rs_threshold="0.8_1.25,2.0")
    assert kept.sum() == 0


def test_bad_thresholds_are_refused():
    with pytest.raises(ValueError, match="upper bound only"):
        parse_rs_thresholds(["token_k3"], "0.5_2")
    with pytest.raises(ValueError, match="2 rollout_rs options"):
        parse_rs_thresholds(["token_k1", "token_k3"], "1.5,2,3")
    old, rollout, mask = log_ratios([1.0])
    with pytest.raises(ValueError, match="lower <= upper"):
        compute_rollout_correction(old, rollout, mask, rollout_is="token", rollout_is_threshold="3_2")
    with pytest.raises(ValueError, match="unknown option"):
        compute_rollout_correction(old, rollout, mask, rollout_rs="seq_k1", rollout_rs_threshold=2)


# ----------------------------------------------------------------------------- verl reference
@pytest.fixture(scope="module")
def verl_corr():
    return verl_module("verl.trainer.ppo.rollout_corr_helper")


def random_logprobs(seed: int, batch: int = 16, length: int = 13):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    old = -torch.rand(batch, length, generator=g) * 4
    rollout = old + torch.randn(batch, length, generator=g) * 0.3  # a visible engine/trainer gap
    return old, rollout, mask


IS_CASES = [("token", 2.0), ("sequence", 5.0), ("token", "0.5_1.5"), ("sequence", "0.2_4.0")]
# thresholds that reject some but not all of random_logprobs' tokens
RS_THRESHOLDS = {"token_k1": "0.6_1.6", "seq_sum_k1": "0.6_1.6", "seq_mean_k1": "0.95_1.05", "seq_sum_k2": "0.5",
                 "seq_sum_k3": "0.5"}
RS_CASES = [(o, RS_THRESHOLDS.get(o, "0.05")) for o in RS_OPTIONS] + [("seq_mean_k1,token_k3", "0.9_1.1,0.1")]
# metrics whose definitions are verl's at both levels (its sequence-level max/min are of raw ratios)
SHARED = ("rollout_is_mean", "rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low",
          "rollout_is_eff_sample_size", "rollout_is_oob_ratio", "rollout_is_batch_norm_factor")


@pytest.mark.parametrize("level,threshold", IS_CASES)
@pytest.mark.parametrize("normalize", [False, True])
def test_is_weights_match_verl(verl_corr, level, threshold, normalize):
    old, rollout, mask = random_logprobs(0)
    ours, kept, m = compute_rollout_correction(old, rollout, mask, rollout_is=level, rollout_is_threshold=threshold,
                                               rollout_is_batch_normalize=normalize)
    theirs, their_mask, ref_m = verl_corr.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=normalize)
    torch.testing.assert_close(ours, theirs.batch["rollout_is_weights"])
    assert torch.equal(kept, their_mask)
    names = SHARED + (("rollout_is_max", "rollout_is_min") if level == "token" else ())
    for name in names:
        key = f"rollout_corr/{name}"
        assert (key in m) == (key in ref_m), key
        if key in m:
            assert m[key] == pytest.approx(ref_m[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("options,threshold", RS_CASES)
def test_rejection_matches_verl(verl_corr, options, threshold):
    old, rollout, mask = random_logprobs(1)
    _, kept, m = compute_rollout_correction(old, rollout, mask, rollout_rs=options, rollout_rs_threshold=threshold)
    _, theirs, ref_m = verl_corr.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is=None, rollout_rs=options, rollout_rs_threshold=threshold)
    assert torch.equal(kept, theirs)
    assert 0 < kept.sum() < mask.sum(), "a case that neither keeps nor rejects everything"
    rs_keys = {k for k in ref_m if k.startswith("rollout_corr/rollout_rs_") and k.endswith("masked_fraction")}
    assert rs_keys <= set(m)
    for key in rs_keys:
        assert m[key] == pytest.approx(ref_m[key], rel=1e-6, abs=1e-7), key


def test_k1_single_threshold_means_its_reciprocal_band():
    assert parse_rs_thresholds(["seq_mean_k1"], 2.0)["seq_mean_k1"].lower == pytest.approx(0.5)
    assert math.isclose(parse_rs_thresholds(["token_k2"], "0.3")["token_k2"].upper, 0.3)
