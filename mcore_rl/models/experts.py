"""Routed experts as grouped GEMMs over megatron's SequentialMLP parameters.

megatron-core 0.16.1 offers grouped expert GEMMs only through TransformerEngine (TEGroupedMLP) or
the `grouped_gemm` extension (GroupedMLP); neither installs here. `torch._grouped_mm` does the same
work in one kernel per projection (CUTLASS on sm90, a loop of matmuls on CPU). The parameters stay
SequentialMLP's (one linear_fc1/linear_fc2 per local expert), so checkpoints, converters and the
weight sync see exactly the same names and shapes whichever forward runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from mcore_rl.models.fused import swiglu_probs


class _GroupedLinear(torch.autograd.Function):
    """y[rows of expert e] = x[rows of expert e] @ W_e^T, with W_e the experts' own parameters.

    The stacked [E, N, K] weight is rebuilt in backward rather than saved: activation memory then
    holds only the inputs, as with per-expert matmuls (saving the stack would add a copy of every
    local expert's weights per layer).
    """

    @staticmethod
    def forward(ctx, x, offs, *weights):
        ctx.save_for_backward(x, offs, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, dy):
        x, offs, *weights = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch._grouped_mm(dy, torch.stack(weights), offs=offs) if ctx.needs_input_grad[0] else None
        dws = [None] * len(weights)
        if any(ctx.needs_input_grad[2:]):
            # offsets along K: [N, T] x [T, K] -> [E, N, K]; an expert with no tokens gets zeros
            dws = list(torch._grouped_mm(dy.t(), x, offs=offs).unbind(0))
        return (dx, None, *dws)


def _aligned(n: int, dtype: torch.dtype) -> bool:
    return n * dtype.itemsize % 16 == 0  # _grouped_mm's stride rule


class GroupedGemmExperts(SequentialMLP):
    """SequentialMLP whose forward runs all local experts as two grouped GEMMs.

    Falls back to the per-expert loop for what the grouped path does not model (biases, FP8,
    non-SwiGLU activations, clamped GLUs, probabilities applied on the input).
    """

    def _grouped(self) -> bool:
        c = self.config
        fc1 = self.local_experts[0].linear_fc1.weight
        return (hasattr(torch, "_grouped_mm") and self.num_local_experts > 1
                and c.gated_linear_unit and c.activation_func is F.silu and not c.add_bias_linear
                and not (c.fp8 or c.fp4) and not c.moe_apply_probs_on_input
                and c.activation_func_clamp_value is None and not c.glu_linear_offset
                and all(_aligned(n, fc1.dtype) for n in fc1.shape))

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if not self._grouped():
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        offs = torch.cumsum(tokens_per_expert.to(x.device), 0, dtype=torch.int32)
        fc1 = [e.linear_fc1.weight for e in self.local_experts]
        fc2 = [e.linear_fc2.weight for e in self.local_experts]
        h = swiglu_probs(_GroupedLinear.apply(x.contiguous(), offs, *fc1), permuted_probs)
        return _GroupedLinear.apply(h, offs, *fc2), None
