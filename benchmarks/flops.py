"""FLOP counts and peaks the GPU benchmarks report against."""

from __future__ import annotations

import torch

SPEC_PEAK = 989e12  # dense bf16, H100/H200 SXM spec sheet
MATMUL_PEAK = 790e12  # 8192^3 bf16 matmul measured on the lent machines (device KINDS.md)


def active_params(model, hf) -> float:
    """Non-embedding parameters a token passes through: dense + routed x topk/E, summed over the
    model-parallel ranks (the output layer counts where the model has one)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dense = sum(p.numel() for n, p in model.named_parameters() if "embedding" not in n and "local_experts" not in n)
    routed = sum(p.numel() for n, p in model.named_parameters() if "local_experts" in n)
    dev = next(model.parameters()).device
    d = torch.tensor(float(dense), device=dev)
    r = torch.tensor(float(routed), device=dev)
    dist.all_reduce(d, group=ps.get_model_parallel_group())
    dist.all_reduce(r, group=ps.get_expert_tensor_model_pipeline_parallel_group())
    return d.item() + (r.item() * hf.get("num_experts_per_tok") / hf.num_experts if hf.num_experts else 0)


def attention_flops_per_token(hf, seq: int) -> float:
    """fwd+bwd FLOPs of causal attention per token of a `seq`-token sequence."""
    qk = hf.get("qk_nope_head_dim", 0) + hf.get("qk_rope_head_dim", 0) if hf.is_mla else hf.head_dim
    v = hf.get("v_head_dim") if hf.is_mla else hf.head_dim
    return 6 * hf.num_layers * hf.num_attention_heads * (qk + v) * seq * 0.5


def flops_per_token(model, hf, seq: int) -> float:
    """fwd+bwd FLOPs per token of a `seq`-token sequence: 6 x active parameters + causal attention."""
    return 6 * active_params(model, hf) + attention_flops_per_token(hf, seq)


def sequences_flops(active: float, hf, lengths) -> float:
    """fwd+bwd FLOPs of training on sequences of these lengths (each attends only to itself)."""
    return sum(n * (6 * active + attention_flops_per_token(hf, n)) for n in lengths)
