"""DeepSeek's and GLM-4.5's routing as a megatron TopKRouter subclass, given in the MoE layer
spec (`MoESubmodules.router`, megatron-core 0.16.1) of the models that need it.

megatron-core's TopKRouter routes these models differently in two steps:
- group-limited routing ranks each token's expert groups by the sum of a group's top-n scores:
  megatron takes n = topk / group_topk, DeepSeek-V3 n = 2 and DeepSeek-V2's group_limited_greedy
  n = 1 (the group's best expert), whatever the top-k;
- with sigmoid scores and norm_topk_prob=false (DeepSeek-V3, GLM-4.5) each chosen expert is
  weighted by its sigmoid score times routed_scaling_factor; megatron always divides the top-k
  sigmoid scores by their sum.
`ModelRouter` changes those two steps and keeps megatron's own for the rest (score function,
expert bias, z-loss, routing replay through megatron's top-k hook). The config fields it reads
are set by `mcore_rl.models.config.transformer_config`: `moe_router_group_score_topk` (n) and
`moe_router_sigmoid_norm_topk = False`.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
from megatron.core.transformer.moe.router import TopKRouter

from mcore_rl import patches
from mcore_rl.models.config import UnsupportedModelError


def wants_model_router(config) -> bool:
    """Whether a config's MoE layers route as DeepSeek/GLM do and megatron does not."""
    return (getattr(config, "moe_router_group_score_topk", None) is not None
            or getattr(config, "moe_router_sigmoid_norm_topk", None) is False)


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int, n: int):
    """(top-k values, indices) within the `group_topk` groups whose top-n scores sum highest."""
    num_tokens, num_experts = scores.shape
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(n, dim=-1).values.sum(dim=-1)
    chosen = group_scores.topk(group_topk, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    masked = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)
    return torch.topk(masked, k=topk, dim=-1)


class _GroupTopK:
    """megatron's top-k hook (topk_routing_with_score_function's `router_replay` argument): the
    model's group-limited selection, handed on to the router's routing replay when it has one."""

    def __init__(self, n: int, replay):
        self.n, self.replay = n, replay

    def compute(self, scores, topk, num_groups=None, group_topk=None):
        if group_topk:
            return group_limited_topk(scores, topk, num_groups, group_topk, self.n)
        return torch.topk(scores, k=topk, dim=1)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.replay is None:
            return self.compute(scores, topk, num_groups, group_topk)
        return self.replay.get_replay_topk(scores, topk, num_groups, group_topk, self.compute)


class ModelRouter(TopKRouter):
    def __init__(self, *args, **kwargs):
        if not patches.megatron_version().startswith(patches.PATCHED_VERSIONS):
            raise UnsupportedModelError(f"DeepSeek/GLM routing (mcore_rl.models.router) is written against megatron-core "
                                        f"{patches.PATCHED_VERSIONS}'s TopKRouter, not {patches.megatron_version()}")
        super().__init__(*args, **kwargs)
        c = self.config
        if self.routing_type != "none" or self.is_aux_loss_enabled() or c.moe_expert_capacity_factor is not None \
                or c.moe_router_fusion:
            raise UnsupportedModelError("DeepSeek/GLM routing (mcore_rl.models.router) takes no load-balancing "
                                        "loss, token dropping or fused router")
        self.group_score_topk = getattr(c, "moe_router_group_score_topk", None)
        self.normalise = getattr(c, "moe_router_sigmoid_norm_topk", True) is not False or self.score_function != "sigmoid"

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """TopKRouter.routing without its load-balancing branches (refused above), with the model's
        group ranking and sigmoid weights."""
        logits = logits.view(-1, self.config.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = self.apply_z_loss(logits, padding_mask=padding_mask)
        c = self.config
        hook = self.router_replay if self.group_score_topk is None else _GroupTopK(self.group_score_topk,
                                                                                      self.router_replay)
        probs, routing_map = topk_routing_with_score_function(
            logits, self.topk, use_pre_softmax=c.moe_router_pre_softmax, num_groups=c.moe_router_num_groups,
            group_topk=c.moe_router_group_topk, scaling_factor=c.moe_router_topk_scaling_factor,
            score_function=self.score_function, expert_bias=self.expert_bias, router_replay=hook)
        if not self.normalise:  # megatron's sigmoid in fp32, cast back, times the scale: before it normalises
            scores = torch.sigmoid(logits.float()).type_as(logits)
            if c.moe_router_topk_scaling_factor:
                scores = scores * c.moe_router_topk_scaling_factor
            probs = torch.where(routing_map, scores, torch.zeros_like(scores))
        self._apply_expert_bias(routing_map, padding_mask=padding_mask)
        return probs, routing_map
