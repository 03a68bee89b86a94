"""Routed experts beside the tokens: the engine's expert ids of every token in the batch's layout,
checked on arrival, and how often the trainer's own top-k sets agree with them.

A batch's `routes` is [B, P + R, MoE layers, top-k] int16, aligned with `tokens` (left-padded
prompts, then responses): column j holds the experts the engine sent the token at column j to, in
each MoE layer (dense layers are left out; `ExpertLayout.moe_layers` are the HF layer indices of
the ones kept). -1 where the engine routed nothing: padding, and each sample's last token, which
the engine sampled but never ran (SGLang returns prompt + output - 1 rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class RouteError(RuntimeError):
    """Routes an engine returned are not usable; the message names the engine and the sample."""


@dataclass(frozen=True)
class ExpertLayout:
    num_experts: int
    topk: int
    moe_layers: tuple[int, ...]  # HF layer indices (0-based) of the MoE layers

    @classmethod
    def of(cls, hf) -> "ExpertLayout | None":
        """From an HF config (dict or mcore_rl.models.config.HFModel); None for a dense model."""
        from mcore_rl.models.config import HFModel

        hf = hf if isinstance(hf, HFModel) else HFModel.from_dict(hf)
        if not hf.num_experts:
            return None
        return cls(hf.num_experts, hf.num_experts_per_tok,
                   tuple(i for i in range(hf.num_layers) if hf.is_moe_layer(i)))


def check(experts, sample: int, tokens: int, layout: ExpertLayout, engine: str) -> torch.Tensor:
    """One completion's engine routes [tokens - 1, all layers, top-k] -> its MoE layers' [tokens - 1,
    MoE layers, top-k], validated: one row per token the engine ran, ids in range, no expert twice."""
    if experts is None:
        raise RouteError(f"{engine} returned no routed experts for sample {sample}")
    # a copy: Ray hands numpy arrays over read-only (zero-copy from its object store), which
    # torch.as_tensor warns about on every batch
    r = experts if isinstance(experts, torch.Tensor) else torch.tensor(experts)
    if r.dim() != 3 or r.shape[0] != tokens - 1 or r.shape[2] != layout.topk or r.shape[1] <= max(layout.moe_layers):
        raise RouteError(f"{engine} returned routes of shape {tuple(r.shape)} for sample {sample}: expected "
                         f"[{tokens - 1} tokens, >{max(layout.moe_layers)} layers, top-{layout.topk}]")
    r = r[:, list(layout.moe_layers)]
    if r.numel() and (r.min() < 0 or r.max() >= layout.num_experts):
        raise RouteError(f"{engine} routed sample {sample} to experts outside 0..{layout.num_experts - 1} "
                         f"(ids {int(r.min())}..{int(r.max())})")
    ordered = r.sort(-1).values
    if (ordered[..., 1:] == ordered[..., :-1]).any():
        raise RouteError(f"{engine} routed a token of sample {sample} to one expert twice")
    return r


def batch_routes(completions: list, prompt_lens: list[int], width: int, layout: ExpertLayout,
                 engine: str) -> torch.Tensor:
    """[B, width, MoE layers, top-k] int16 in the batch's layout (module docstring); `width` =
    the padded prompt width P + response width R, prompts right-aligned at column P."""
    P = width - max(1, max(len(c.token_ids) for c in completions))
    out = torch.full((len(completions), width, len(layout.moe_layers), layout.topk), -1, dtype=torch.int16)
    for i, (c, p) in enumerate(zip(completions, prompt_lens)):
        r = check(c.routed_experts, i, p + len(c.token_ids), layout, engine)
        out[i, P - p:P - p + len(r)] = r.to(torch.int16)
    return out


def agreement_counts(trainer: torch.Tensor, engine: torch.Tensor) -> tuple[int, int]:
    """(matching, compared) (token, MoE layer) pairs where both routed the token: the same top-k set."""
    both = (trainer[..., 0] >= 0) & (engine[..., 0] >= 0)
    same = (trainer.sort(-1).values == engine.sort(-1).values).all(-1)
    return int((same & both).sum()), int(both.sum())
