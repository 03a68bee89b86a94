"""DAPO's (Yu et al. 2025) reward-side pieces: the soft overlong penalty and the group filter of
dynamic sampling. (Its clip-higher is policy_loss's clip_ratio_high; its token-mean
aggregation is agg_loss's default.)"""

from __future__ import annotations

import torch


def overlong_penalty(response_lengths: torch.Tensor, max_response_len: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """Per-response reward shaping: 0 up to max_response_len - buffer_len tokens, then falling
    linearly to -penalty_factor at max_response_len (verl's DAPO reward manager)."""
    if not 0 < buffer_len <= max_response_len:
        raise ValueError(f"overlong buffer length must be in (0, max_response_len = {max_response_len}], "
                         f"got {buffer_len}")
    exceed = response_lengths.float() - (max_response_len - buffer_len)
    return (-exceed / buffer_len * penalty_factor).clamp(max=0.0)


def varied_groups(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which consecutive groups of `group_size` samples have values that are not all equal
    (bool [groups]). A group of equal rewards has zero GRPO advantage: no gradient, only noise
    in the batch's normalisation."""
    if values.numel() % group_size:
        raise ValueError(f"{values.numel()} samples do not split into groups of {group_size}")
    grouped = values.reshape(-1, group_size)
    # max != min rather than std > 0: a float mean of equal values need not equal them exactly
    return (grouped.amax(dim=-1) != grouped.amin(dim=-1)) | (group_size == 1)
