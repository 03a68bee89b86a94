"""Token permutation for the all-gather MoE dispatcher by gathers alone, no atomic scatter-adds.

megatron-core's local permute is an index_select whose backward, like its unpermute, is a
scatter-add of top-k rows per token: bf16 atomics that took ~7 % of a Moonlight layer's fwd+bwd
on an H100. Here every token's rows are also listed token by token, so the sums run as one
`embedding_bag` per direction (fp32 accumulation, deterministic) and the other direction is a
plain gather. The permuted order (expert-major, tokens ascending) is megatron's, so experts,
probabilities and results are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher


def _sum_rows(rows: torch.Tensor, by_token: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """out[t] = sum of rows[by_token[starts[t]:starts[t+1]]]; tokens with no rows get zeros."""
    return F.embedding_bag(by_token, rows, starts, mode="sum")


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token_of_row, by_token, starts):
        ctx.save_for_backward(by_token, starts)
        return x.index_select(0, token_of_row)

    @staticmethod
    def backward(ctx, grad):
        by_token, starts = ctx.saved_tensors
        return _sum_rows(grad.contiguous(), by_token, starts), None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, token_of_row, by_token, starts):
        ctx.save_for_backward(token_of_row)
        return _sum_rows(y, by_token, starts)

    @staticmethod
    def backward(ctx, grad):
        (token_of_row,) = ctx.saved_tensors
        return grad.index_select(0, token_of_row), None, None, None


class GatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """megatron's all-gather dispatcher (same communication) with gather-only permutation."""

    def dispatch_postprocess(self, hidden_states, probs):
        if self.config.moe_permute_fusion:
            return super().dispatch_postprocess(hidden_states, probs)
        self.hidden_shape_before_permute = hidden_states.shape
        lo, hi = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        local_map = self.routing_map[:, lo:hi]
        expert_major = local_map.T.contiguous()
        token_of_row = expert_major.nonzero()[:, 1]  # permuted row -> its token
        # each token's permuted rows, token by token, and where each token's list starts
        self._lists = (token_of_row, torch.argsort(token_of_row, stable=True),
                       F.pad(local_map.sum(1).cumsum(0), (1, 0))[:-1])
        permuted = _Permute.apply(hidden_states, *self._lists)
        # counts stay on the device: the grouped experts need them there, and megatron's per-expert
        # fallback reads them with .tolist() (copying them to the host here would wait for the GPU)
        tokens_per_expert = expert_major.sum(1)
        self.local_probs = probs[:, lo:hi].T.contiguous().masked_select(expert_major)
        self.routing_map = None
        return permuted, tokens_per_expert, self.local_probs

    def combine_preprocess(self, hidden_states):
        if self.config.moe_permute_fusion:
            return super().combine_preprocess(hidden_states)
        out = _Unpermute.apply(hidden_states, *self._lists)
        self._lists = None
        return out


def use_gather_permutation(model) -> None:
    """Switch every MoE layer's all-gather dispatcher of `model` to gather-only permutation.

    Done on the built model rather than in the spec: megatron passes process groups only to the
    MoELayer class itself, not to subclasses. The dispatcher keeps its state; only methods change.
    """
    for m in model.modules():
        if isinstance(m, MoELayer) and type(m.token_dispatcher) is MoEAllGatherTokenDispatcher:
            m.token_dispatcher.__class__ = GatherTokenDispatcher
