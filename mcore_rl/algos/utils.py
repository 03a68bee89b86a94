"""Masked reductions over padded [batch, seq] tensors and group-id helpers."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    # torch.where first so that NaN/inf in padding cannot leak into the sum
    valid = torch.where(mask.bool(), values, torch.zeros_like(values))
    return valid.sum() if dim is None else valid.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n < 2:
            raise ValueError(f"unbiased masked variance needs at least 2 unmasked elements, got {int(n)}")
        var = var * n / (n - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / std with the statistics taken over the masked elements only."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def group_ids(index: Sequence | np.ndarray | torch.Tensor, device=None) -> tuple[torch.Tensor, int]:
    """Map arbitrary per-sample group labels (uids, prompt ids) to contiguous ids 0..G-1."""
    if isinstance(index, torch.Tensor):
        _, inverse = torch.unique(index, return_inverse=True)
        inverse = inverse.to(device or index.device)
    else:
        _, inverse_np = np.unique(np.asarray(index), return_inverse=True)
        inverse = torch.as_tensor(inverse_np.reshape(-1), dtype=torch.long, device=device)
    return inverse, int(inverse.max().item()) + 1 if inverse.numel() else 0


def group_stats(scores: torch.Tensor, ids: torch.Tensor, num_groups: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group size, group mean, unbiased group std) of 1-D `scores`, vectorised."""
    count = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, ids, torch.ones_like(scores))
    total = torch.zeros_like(count).index_add_(0, ids, scores)
    mean = (total / count)[ids]
    sq_dev = torch.zeros_like(count).index_add_(0, ids, (scores - mean) ** 2)
    n = count[ids]
    std = torch.sqrt(sq_dev[ids] / (n - 1).clamp(min=1))
    return n, mean, std


def reverse_discounted_scan(values: torch.Tensor, mask: torch.Tensor, decay: float) -> torch.Tensor:
    """out[t] = values[t] + decay * out[next masked t'], skipping (carrying through) mask==0 positions.

    Vectorised over the batch; the only loop is over time, which a recurrence needs.
    Positions with mask==0 get the carried value of the next masked token, as verl does.
    """
    mask = mask.to(values.dtype)
    out = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in range(values.shape[1] - 1, -1, -1):
        m = mask[:, t]
        running = m * (values[:, t] + decay * running) + (1 - m) * running
        out[:, t] = running
    return out
