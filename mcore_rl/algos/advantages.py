"""Advantage estimators on padded [batch, response_len] tensors (verl-compatible semantics).

Every estimator returns (advantages, returns), both zero outside `response_mask`.
Outcome estimators (GRPO, RLOO, REINFORCE++-baseline) use the sum of token-level rewards
of each response as its score and compare responses that share a group label `index`
(the prompt uid): one rollout group = the `rollout.n` samples of one prompt.
"""

from __future__ import annotations

from typing import Callable

import torch

from mcore_rl.algos.utils import group_ids, group_stats, masked_whiten, reverse_discounted_scan

ESTIMATORS: dict[str, Callable] = {}


def _register(name: str):
    def wrap(fn):
        ESTIMATORS[name] = fn
        return fn
    return wrap


def _outcome_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index):
    scores = token_level_rewards.sum(dim=-1)
    ids, num_groups = group_ids(index, device=scores.device)
    if ids.numel() != scores.numel():
        raise ValueError(f"index has {ids.numel()} labels for a batch of {scores.numel()} responses")
    return scores, group_stats(scores, ids, num_groups)


def _broadcast(per_seq: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return per_seq.unsqueeze(-1) * response_mask.to(per_seq.dtype)


@_register("grpo")
@torch.no_grad()
def grpo_advantage(token_level_rewards, response_mask, index, *, norm_adv_by_std_in_grpo: bool = True,
                   epsilon: float = 1e-6, **_):
    """(score - group mean) [/ (group std + eps)]; a singleton group keeps its raw score (mean 0, std 1)."""
    scores, (n, mean, std) = _outcome_scores(token_level_rewards, response_mask, index)
    singleton = n == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    adv = scores - mean
    if norm_adv_by_std_in_grpo:  # False gives Dr.GRPO
        adv = adv / (torch.where(singleton, torch.ones_like(std), std) + epsilon)
    adv = _broadcast(adv, response_mask)
    return adv, adv


@_register("rloo")
@torch.no_grad()
def rloo_advantage(token_level_rewards, response_mask, index, **_):
    """score minus the mean score of the *other* samples of the group: n/(n-1) * (score - group mean)."""
    scores, (n, mean, _std) = _outcome_scores(token_level_rewards, response_mask, index)
    adv = torch.where(n > 1, (scores - mean) * n / (n - 1).clamp(min=1), scores)
    adv = _broadcast(adv, response_mask)
    return adv, adv


@_register("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline_advantage(token_level_rewards, response_mask, index, **_):
    """REINFORCE++ with a group-mean baseline, whitened over the whole batch's response tokens."""
    scores, (n, mean, _std) = _outcome_scores(token_level_rewards, response_mask, index)
    centred = _broadcast(scores - torch.where(n > 1, mean, torch.zeros_like(mean)), response_mask)
    adv = masked_whiten(centred, response_mask) * response_mask
    return adv, adv


@_register("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus_advantage(token_level_rewards, response_mask, *, gamma: float = 1.0, **_):
    """Discounted token returns (no baseline), whitened over the batch's response tokens."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = reverse_discounted_scan(token_level_rewards, mask, gamma) * mask
    adv = masked_whiten(returns, mask) * mask
    return adv, returns


def _next_masked_values(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """For each t, the value at the first masked position after t (0 past the last one)."""
    batch, length = values.shape
    pos = torch.arange(length, device=values.device).expand(batch, length)
    masked_pos = torch.where(mask.bool(), pos, torch.full_like(pos, length))
    # reverse running minimum gives the first masked position at or after t; shift to "after t"
    first_at_or_after = masked_pos.flip(-1).cummin(-1).values.flip(-1)
    first_after = torch.cat([first_at_or_after[:, 1:], torch.full_like(pos[:, :1], length)], dim=1)
    padded = torch.cat([values, torch.zeros_like(values[:, :1])], dim=1)
    return padded.gather(1, first_after)


@_register("gae")
@torch.no_grad()
def gae_advantage(token_level_rewards, response_mask, *, values, gamma: float = 1.0, lam: float = 1.0,
                  **_):
    """GAE(gamma, lambda) with a critic's `values`; advantages whitened, returns = raw adv + values.

    Positions with mask 0 inside a response (e.g. tool observations) are skipped: TD errors
    bridge them using the value of the next masked token.
    """
    mask = response_mask.to(values.dtype)
    deltas = token_level_rewards + gamma * _next_masked_values(values, mask) - values
    raw_adv = reverse_discounted_scan(deltas, mask, gamma * lam)
    returns = (raw_adv + values) * mask
    adv = masked_whiten(raw_adv, mask) * mask
    return adv, returns


def compute_advantage(adv_estimator: str, token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                      **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch by `algorithm.adv_estimator`. kwargs: index, values, gamma, lam, norm_adv_by_std_in_grpo."""
    try:
        fn = ESTIMATORS[adv_estimator]
    except KeyError:
        raise ValueError(f"unknown adv_estimator {adv_estimator!r}; known: {sorted(ESTIMATORS)}") from None
    return fn(token_level_rewards, response_mask, **kwargs)
