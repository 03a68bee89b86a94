"""KL estimators (Schulman's k1/k2/k3), KL controllers and the KL-in-reward penalty."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_rl.algos.utils import masked_mean

# verl spellings map onto the same three estimators
_ALIASES = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "low_var_kl": "k3", "k3": "k3", "abs": "abs"}


def kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from the sampled tokens' log-probs.

    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) + log r - 1 (unbiased, low variance,
    always >= 0), with log r = log_prob - ref_log_prob. k3 is clamped to [-10, 10] like verl.
    """
    try:
        kind = _ALIASES[kind]
    except KeyError:
        raise ValueError(f"unknown KL estimator {kind!r}; known: {sorted(_ALIASES)}") from None
    log_ratio = log_prob - ref_log_prob
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "abs":
        return log_ratio.abs()
    neg = (-log_ratio).clamp(-20, 20)  # keeps exp() finite
    return (neg.exp() - neg - 1).clamp(-10, 10)


class FixedKLController:
    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Ziegler et al. 2019: move the coefficient towards `target_kl`, at most 20% error per horizon."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError(f"adaptive KL horizon must be > 0, got {horizon}")
        self.value, self.target, self.horizon = float(kl_coef), float(target_kl), horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(type: str = "fixed", kl_coef: float = 1e-3, target_kl: float = 0.1,
                       horizon: int = 10000, **_) -> FixedKLController | AdaptiveKLController:
    """Build from the `algorithm.kl_ctrl` config section (pass it as **section.model_dump())."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl_ctrl.type {type!r}; expected 'fixed' or 'adaptive'")


@dataclass
class KLPenaltyResult:
    token_level_rewards: torch.Tensor
    mean_kl: float  # mean over sequences of the per-sequence token-mean KL
    kl_coef: float  # the coefficient that was applied (before the controller update)


@torch.no_grad()
def apply_kl_in_reward(token_level_scores: torch.Tensor, old_log_prob: torch.Tensor,
                       ref_log_prob: torch.Tensor, response_mask: torch.Tensor,
                       controller: FixedKLController | AdaptiveKLController,
                       kind: str = "k1") -> KLPenaltyResult:
    """rewards = scores - beta * KL per token, then update the controller with the batch's KL."""
    mask = response_mask.to(token_level_scores.dtype)
    kl = kl_estimate(old_log_prob, ref_log_prob, kind) * mask
    beta = controller.value
    rewards = token_level_scores - beta * kl
    mean_kl = masked_mean(kl, mask, dim=-1).mean().item()
    controller.update(mean_kl, n_steps=token_level_scores.shape[0])
    return KLPenaltyResult(rewards, mean_kl, beta)
