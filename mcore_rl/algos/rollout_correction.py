"""Rollout correction: the engine's log-probs are the behaviour policy, the trainer's (same
weights, other kernels, other MoE routing) the target. verl's `algorithm.rollout_correction`
names and threshold formats, so a verl recipe carries over:

- importance sampling (`rollout_is`): per-token ("token") or per-sequence ("sequence", the
  product of its token ratios) weights pi_train / pi_rollout; `rollout_is_threshold` a number
  truncates them at it (TIS), "lower_upper" zeroes those outside [lower, upper] (IcePop);
  `rollout_is_batch_normalize` rescales them to mean 1.
- rejection (`rollout_rs`, comma-separated options, all must pass): tokens or whole sequences
  whose divergence statistic is out of bounds leave the loss (masked IS). Options are
  `token_k{1,2,3}`, `seq_sum_k{1,2,3}`, `seq_mean_k{1,2,3}`, `seq_max_k{2,3}`; k1 = -log r
  bounded by ratios "lower_upper" (a single number u means 1/u_u), k2 = (log r)^2 / 2 and
  k3 = r - 1 - log r bounded above. `seq_mean_k1` is the geometric-mean sequence ratio.

All on padded [batch, response_len] tensors; weights carry no gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mcore_rl.algos.utils import masked_mean, masked_sum

SAFETY_BOUND = 20.0  # log-ratios are clamped here before exp: exp(20) ~ 5e8
IS_LEVELS = ("token", "sequence")
_DIVERGENCES = {
    "k1": lambda lr: -lr,
    "k2": lambda lr: 0.5 * lr ** 2,
    "k3": lambda lr: torch.exp(lr) - 1.0 - lr,
}
_REDUCTIONS = ("token", "seq_sum", "seq_mean", "seq_max")
RS_OPTIONS = tuple(f"{r}_{k}" for r in _REDUCTIONS for k in _DIVERGENCES if (r, k) != ("seq_max", "k1"))


@dataclass(frozen=True)
class Bounds:
    upper: float
    lower: float | None = None  # None: no lower bound (TIS), or 1 / upper for a k1 rejection


def parse_is_threshold(spec: float | str) -> Bounds:
    """rollout_is_threshold: a number (TIS cap) or "lower_upper" (IcePop band)."""
    lower, upper = _split(spec, "rollout_is_threshold")
    return Bounds(upper, lower)


def parse_rs_thresholds(options: list[str], spec: float | str | None) -> dict[str, Bounds]:
    """One threshold per rejection option (comma-separated), or one shared by all."""
    if spec is None:
        raise ValueError("rollout_rs_threshold must be set when rollout_rs is")
    parts = [p.strip() for p in str(spec).split(",") if p.strip()] if isinstance(spec, str) else [spec]
    if len(parts) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold has {len(parts)} entries for {len(options)} rollout_rs options")
    out = {}
    for option, part in zip(options, parts * len(options) if len(parts) == 1 else parts):
        lower, upper = _split(part, f"rollout_rs_threshold of {option}")
        if option.endswith("k1"):
            out[option] = Bounds(upper, 1.0 / upper if lower is None else lower)
        elif lower is not None:
            raise ValueError(f"rollout_rs_threshold of {option} takes an upper bound only, got {part!r}")
        else:
            out[option] = Bounds(upper)
    return out


def parse_rs_options(rollout_rs: str) -> list[str]:
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    bad = [o for o in options if o not in RS_OPTIONS]
    if bad or not options:
        raise ValueError(f"rollout_rs: unknown option(s) {bad or [rollout_rs]}; known: {list(RS_OPTIONS)}")
    return options


def _split(spec, what: str) -> tuple[float | None, float]:
    if isinstance(spec, bool):
        raise ValueError(f"{what} must be a number or 'lower_upper', got {spec!r}")
    text = str(spec).strip()
    try:
        lower, upper = (float(x) for x in text.split("_", 1)) if "_" in text else (None, float(text))
    except ValueError:
        raise ValueError(f"{what} must be a number or 'lower_upper', got {spec!r}") from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"{what} needs 0 < lower <= upper, got {spec!r}")
    return lower, upper


# ----------------------------------------------------------------------------- importance weights
def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, bounds: Bounds,
               batch_normalize: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """Weights [B, R] (0 on padding) from log(pi_train / pi_rollout) and their metrics."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {IS_LEVELS} or null, got {level!r}")
    mask = mask.to(log_ratio.dtype)
    if level == "token":
        raw = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp() * mask
    else:
        seq = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1)
        raw = seq.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().expand_as(log_ratio) * mask
    if bounds.lower is None:  # TIS
        weights = raw.clamp(max=bounds.upper)
    else:  # IcePop: out-of-band tokens keep their place in the mask but weigh nothing
        weights = torch.where((raw >= bounds.lower) & (raw <= bounds.upper), raw, torch.zeros_like(raw))
    metrics = _is_metrics(raw, weights, mask, level, bounds)
    if batch_normalize:
        mean = masked_mean(weights, mask) if level == "token" else \
            masked_mean(masked_mean(weights, mask, dim=-1), (mask.sum(-1) > 0).to(mask.dtype))
        if mean > 1e-8:
            weights = weights / mean
        metrics["rollout_is_batch_norm_factor"] = mean.item() if mean > 1e-8 else 1.0
    return weights.detach(), metrics


def _is_metrics(raw, weights, mask, level, bounds) -> dict[str, float]:
    lower = 1.0 / bounds.upper if bounds.lower is None else bounds.lower
    valid = mask.bool()
    # fractions of tokens (token level) or of sequences (sequence level) beyond the bounds
    units, unit_mask = (raw, mask) if level == "token" else (raw[:, :1], (mask.sum(-1, keepdim=True) > 0).to(mask.dtype))
    capped = weights.clamp(0.0, bounds.upper)
    normalised = capped / (masked_mean(capped, mask) + 1e-8)
    out = {
        "rollout_is_mean": masked_mean(weights, mask).item(),
        "rollout_is_max": weights[valid].max().item(),
        "rollout_is_min": weights[valid].min().item(),
        "rollout_is_ratio_fraction_high": masked_mean((units > bounds.upper).float(), unit_mask).item(),
        "rollout_is_ratio_fraction_low": masked_mean((units < lower).float(), unit_mask).item(),
        "rollout_is_eff_sample_size": 1.0 / masked_mean(normalised ** 2, mask).item(),
    }
    if bounds.lower is not None:
        out["rollout_is_oob_ratio"] = masked_mean(((raw < bounds.lower) | (raw > bounds.upper)).float(), mask).item()
    return out


# ----------------------------------------------------------------------------- rejection
def _seq_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    top = values.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(torch.isinf(top), torch.zeros_like(top), top)


def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, options: list[str],
                   thresholds: dict[str, Bounds]) -> tuple[torch.Tensor, dict[str, float]]:
    """The response mask with rejected tokens (or whole sequences) zeroed, and rejection rates."""
    valid = mask.bool()
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    keep_all = torch.ones_like(valid)
    has_tokens = valid.any(dim=-1).float()
    metrics = {}
    for option in options:
        reduction, kind = option.rsplit("_", 1)
        stat = _DIVERGENCES[kind](lr)
        if reduction != "token":
            reduce = {"seq_sum": lambda v: masked_sum(v, mask, dim=-1), "seq_mean": lambda v: masked_mean(v, mask, dim=-1),
                      "seq_max": lambda v: _seq_max(v, mask)}[reduction]
            stat = reduce(stat).unsqueeze(-1).expand_as(lr)
        b = thresholds[option]
        if kind == "k1":  # bounds on the ratio: compare in log space
            keep = (stat >= math.log(b.lower)) & (stat <= math.log(b.upper))
        else:
            keep = stat <= b.upper
        keep_all &= keep
        rejected = ~keep & valid
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(rejected.float(), mask).item()
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = \
            masked_mean(rejected.any(dim=-1).float(), has_tokens).item()
    rejected = ~keep_all & valid
    metrics["rollout_rs_masked_fraction"] = masked_mean(rejected.float(), mask).item()
    metrics["rollout_rs_seq_masked_fraction"] = rejected.any(dim=-1).float().mean().item()
    return mask * keep_all.to(mask.dtype), metrics


# ----------------------------------------------------------------------------- both
def compute_rollout_correction(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, *,
                       rollout_is: str | None = None, rollout_is_threshold: float | str = 2.0,
                       rollout_is_batch_normalize: bool = False, rollout_rs: str | None = None,
                       rollout_rs_threshold: float | str | None = None
                       ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """(IS weights or None, the response mask after rejection, metrics named rollout_corr/*).

    old_log_prob: the trainer's log-probs of the sampled tokens before the update; rollout_log_prob:
    the engine's. Weights and rejection both use the original mask: rejection does not change
    which tokens a sequence-level weight multiplies.
    """
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(f"log-prob shapes {tuple(old_log_prob.shape)} and {tuple(rollout_log_prob.shape)} "
                         f"must equal the response mask's {tuple(response_mask.shape)}")
    log_ratio = old_log_prob - rollout_log_prob
    weights, metrics, mask = None, {}, response_mask
    if response_mask.any():
        if rollout_is is not None:
            weights, metrics = is_weights(log_ratio, response_mask, rollout_is,
                                          parse_is_threshold(rollout_is_threshold), rollout_is_batch_normalize)
        if rollout_rs is not None:
            options = parse_rs_options(rollout_rs)
            mask, rs_metrics = rejection_mask(log_ratio, response_mask, options,
                                              parse_rs_thresholds(options, rollout_rs_threshold))
            metrics.update(rs_metrics)
    return weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}
