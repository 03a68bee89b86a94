"""PPO-family losses on padded [batch, response_len] tensors, with verl's aggregation modes."""

from __future__ import annotations

import torch

from mcore_rl.algos.kl import kl_estimate
from mcore_rl.algos.utils import masked_mean, masked_sum

# seq-mean-token-sum-norm: Dr.GRPO's token sum over a constant (loss_scale_factor), not the length
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSS_MODES = ("vanilla", "gspo", "cispo")  # verl's actor.policy_loss.loss_mode names


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str = "token-mean", *,
             global_num_tokens: float | None = None, global_num_seqs: float | None = None,
             dp_size: int = 1, loss_scale_factor: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    token-mean: sum over all valid tokens / number of valid tokens.
    seq-mean-token-sum: mean over sequences of each sequence's token sum.
    seq-mean-token-mean: mean over sequences of each sequence's token mean.
    seq-mean-token-sum-norm: seq-mean-token-sum / loss_scale_factor (Dr.GRPO; None: the padded
    response width, as verl, which varies with the batch: pass a constant such as max_response_len).
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
    loss = (seq_loss * has_tokens).sum() / denom * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def _vanilla_losses(old_log_prob, log_prob, advantages, mask, low, high, clip_ratio_c):
    """Clipped PPO surrogate with asymmetric clip range (DAPO's clip-higher) and dual clip
    (Ye et al. 2019): for A < 0 the loss is also bounded by -A * clip_ratio_c, so one very large
    ratio cannot dominate."""
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - low, 1 + high)
    ppo = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    losses = torch.where(advantages < 0, torch.minimum(ppo, dual_bound), ppo)
    return losses, {"actor/ppo_kl": masked_mean(-log_ratio, mask),
                    "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), mask),
                    "actor/pg_clipfrac_lower": masked_mean(((ppo > dual_bound) & (advantages < 0)).float(), mask)}


def _gspo_losses(old_log_prob, log_prob, advantages, mask, low, high, _clip_ratio_c):
    """GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its token ratios,
    clipped as a whole. Each token's ratio is sg[s_i] * pi / sg[pi], so its value is the
    sequence's while its gradient still flows through that token's log-prob."""
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / mask.sum(dim=-1).clamp(min=1)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = token_log_ratio.clamp(max=10.0).exp()  # the clamp is for overflow only, as verl
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - low, 1 + high)
    return torch.maximum(unclipped, clipped), {
        "actor/ppo_kl": masked_mean(-log_ratio, mask),
        "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), mask),
        "actor/pg_clipfrac_lower": torch.zeros((), device=log_prob.device)}


def _cispo_losses(old_log_prob, log_prob, advantages, mask, low, high, _clip_ratio_c):
    """CISPO (MiniMax-M1): REINFORCE on log pi weighted by the clipped, stop-gradient ratio, so
    clipped tokens still get a gradient (PPO's clip zeroes it)."""
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1 - low, 1 + high)
    return -clipped.detach() * advantages * log_prob, {
        "actor/ppo_kl": masked_mean(-log_ratio, mask),
        "actor/pg_clipfrac": masked_mean((ratio != clipped).float(), mask),
        "actor/pg_clipfrac_lower": torch.zeros((), device=log_prob.device)}


_POLICY_LOSSES = {"vanilla": _vanilla_losses, "gspo": _gspo_losses, "cispo": _cispo_losses}


def policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, *, loss_mode: str = "vanilla", clip_ratio_low: float = 0.2,
                clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0, loss_agg_mode: str = "token-mean",
                rollout_is_weights: torch.Tensor | None = None,
                **agg_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy-gradient loss of `loss_mode` (POLICY_LOSS_MODES), aggregated by loss_agg_mode.

    rollout_is_weights (mcore_rl.algos.rollout_correction): per-token weights for the mismatch
    between the rollout engine and the trainer, multiplied into each token's loss; no gradient
    flows through them. Returns (loss, metrics); metrics are detached.
    """
    try:
        per_token = _POLICY_LOSSES[loss_mode]
    except KeyError:
        raise ValueError(f"unknown policy loss_mode {loss_mode!r}; expected one of {POLICY_LOSS_MODES}") from None
    losses, metrics = per_token(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low,
                                clip_ratio_high, clip_ratio_c)
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights.detach()
    loss = agg_loss(losses, response_mask, loss_agg_mode, **agg_kwargs)
    return loss, {k: v.detach() for k, v in metrics.items()}


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
