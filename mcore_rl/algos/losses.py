"""PPO-family losses on padded [batch, response_len] tensors, with verl's aggregation modes."""

from __future__ import annotations

import torch

from mcore_rl.algos.kl import kl_estimate
from mcore_rl.algos.utils import masked_mean, masked_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str = "token-mean", *,
             global_num_tokens: float | None = None, global_num_seqs: float | None = None,
             dp_size: int = 1) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    token-mean: sum over all valid tokens / number of valid tokens.
    seq-mean-token-sum: mean over sequences of each sequence's token sum.
    seq-mean-token-mean: mean over sequences of each sequence's token mean.
    When a global batch is split into micro-batches and data-parallel ranks, pass the global
    token / sequence counts so that the summed-then-dp-averaged gradients equal the global
    mean (the result is multiplied by dp_size because DP all-reduce averages).
    """
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        denom = mask.sum() if global_num_tokens is None else global_num_tokens
        return masked_sum(loss_mat, mask) / denom * dp_size
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {LOSS_AGG_MODES}")
    tokens_per_seq = mask.sum(dim=-1)
    seq_loss = masked_sum(loss_mat, mask, dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_loss = seq_loss / (tokens_per_seq + 1e-8)
    has_tokens = (tokens_per_seq > 0).to(loss_mat.dtype)  # fully masked rows do not count
    denom = has_tokens.sum() if global_num_seqs is None else global_num_seqs
    return (seq_loss * has_tokens).sum() / denom * dp_size


def tis_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling: min(pi_old / pi_rollout, cap), to correct the mismatch
    between the rollout engine's and the trainer's probabilities. No gradient flows through it."""
    return torch.exp(old_log_prob - rollout_log_prob).clamp(max=cap).detach()


def policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                clip_ratio_c: float = 3.0, loss_agg_mode: str = "token-mean",
                rollout_log_prob: torch.Tensor | None = None, tis_imp_ratio_cap: float | None = None,
                **agg_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate with asymmetric clip range and dual clip (Ye et al. 2019).

    For A < 0 the loss is additionally bounded by -A * clip_ratio_c so that one very large
    ratio cannot dominate. With `rollout_log_prob` and a positive `tis_imp_ratio_cap`, each
    token's loss is weighted by tis_weights(). Returns (loss, metrics); metrics are detached.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    ppo = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    losses = torch.where(advantages < 0, torch.minimum(ppo, dual_bound), ppo)
    metrics = {
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
        "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask).detach(),
        "actor/pg_clipfrac_lower": masked_mean(((ppo > dual_bound) & (advantages < 0)).float(),
                                               response_mask).detach(),
    }
    if rollout_log_prob is not None and tis_imp_ratio_cap:
        weights = tis_weights(old_log_prob, rollout_log_prob, tis_imp_ratio_cap)
        losses = losses * weights
        metrics["actor/tis_weight_mean"] = masked_mean(weights, response_mask)
    loss = agg_loss(losses, response_mask, loss_agg_mode, **agg_kwargs)
    return loss, metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits) over the last dim: logsumexp(z) - sum(p * z)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def entropy_loss(logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean",
                 **agg_kwargs) -> torch.Tensor:
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode, **agg_kwargs)


def kl_loss(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, response_mask: torch.Tensor,
            kl_loss_type: str = "low_var_kl", loss_agg_mode: str = "token-mean", **agg_kwargs) -> torch.Tensor:
    """KL(actor || reference) as a loss term (actor.use_kl_loss), GRPO style."""
    return agg_loss(kl_estimate(log_prob, ref_log_prob, kl_loss_type), response_mask, loss_agg_mode,
                    **agg_kwargs)


def value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor,
               response_mask: torch.Tensor, cliprange_value: float = 0.5,
               loss_agg_mode: str = "token-mean", **agg_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 * max((v - R)^2, (clip(v, v_old +- eps) - R)^2); returns (loss, clip fraction)."""
    vclipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vclipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(loss_unclipped, loss_clipped), response_mask, loss_agg_mode,
                          **agg_kwargs)
    clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask).detach()
    return loss, clipfrac
