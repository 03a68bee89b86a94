"""Local (non-TE) layers that megatron-core 0.16.1 lacks: SDPA core attention, an SP-ready RMSNorm and a
SwiGLU rounded once."""

from __future__ import annotations

import functools
import inspect
import math
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from mcore_rl.models.fused import rms_norm, swiglu


class SDPACoreAttention(MegatronModule):
    """Core attention on torch SDPA.

    Unlike megatron's local DotProductAttention it accepts unequal q/k and v head dims
    (MLA) and packed THD sequences (remove-padding training) given cu_seqlens.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, **_):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("context parallelism needs TransformerEngine attention")
        k_channels = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(k_channels)
        self.attn_mask_type = attn_mask_type
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_):
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by SDPACoreAttention")
        dropout = self.dropout if self.training else 0.0
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, dropout)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        mask = None
        if attention_mask is not None and not causal:
            mask = ~attention_mask  # megatron masks are True where attention is forbidden
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal and mask is None,
            scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1])
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _packed(self, query, key, value, psp, dropout):
        # THD: [t, h, d] (or [t, 1, h, d]); one causal attention per sequence, so memory stays
        # linear in the packed length (a mask over the whole pack would be quadratic in it)
        squeeze = query.dim() == 4
        q, k, v = (t.squeeze(1).transpose(0, 1) if squeeze else t.transpose(0, 1) for t in (query, key, value))
        # the host copy the actor's packing attaches (mcore_rl.loop.micro_batches.Packed.seq_params); reading
        # cu_seqlens from the device would stall the host once per layer
        bounds = getattr(psp, "seq_bounds", None) or psp.cu_seqlens_q.tolist()
        out = torch.cat([F.scaled_dot_product_attention(
            q[:, a:b], k[:, a:b], v[:, a:b], dropout_p=dropout, is_causal=True, scale=self.softmax_scale,
            enable_gqa=k.shape[0] != q.shape[0]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a], dim=1)
        out = out.transpose(0, 1).reshape(q.shape[1], -1)
        return out.unsqueeze(1) if squeeze else out


@functools.cache
def _varlen_call():
    """torch's variable-length flash attention as f(q, k, v, cu, max_len, scale), or None where this
    torch lacks it (before 2.10) or lacks a scale argument. Causality is `is_causal` in 2.9's
    signature and a (-1, 0) window from 2.10 on."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "scale" not in params:
        return None
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return lambda q, k, v, cu, max_len, scale: varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, **causal)


class VarlenCoreAttention(SDPACoreAttention):
    """SDPACoreAttention whose packed path is one variable-length flash-attention call over the
    whole micro-batch instead of one SDPA call per sequence (CUDA, bf16/fp16). Flash needs one head
    dim for q, k and v: MLA's v (128) is zero-padded to the q/k dim (192) and the output cut back,
    which costs the PV product 1.5x. Elsewhere (CPU, fp32, dropout) the per-sequence path runs."""

    def _packed(self, query, key, value, psp, dropout):
        call = _varlen_call()
        if call is None or not query.is_cuda or query.dtype not in (torch.bfloat16, torch.float16) or dropout:
            return super()._packed(query, key, value, psp, dropout)
        squeeze = query.dim() == 4
        q, k, v = (t.squeeze(1) if squeeze else t for t in (query, key, value))  # [t, h, d]
        dv = v.shape[-1]
        if dv != q.shape[-1]:
            v = F.pad(v, (0, q.shape[-1] - dv))
        out = call(q, k, v, psp.cu_seqlens_q, psp.max_seqlen_q, self.softmax_scale)[..., :dv]
        out = out.reshape(q.shape[0], -1)
        return out.unsqueeze(1) if squeeze else out


CORE_ATTENTION = {"sdpa": SDPACoreAttention, "varlen": VarlenCoreAttention}


class RMSNorm(torch.nn.Module):
    """RMSNorm computed as the HF reference does, and accepted by megatron's sequence parallelism."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.config = config
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # with SP each TP rank sees part of the sequence, so the norm's grads are TP-all-reduced
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class SwiGLU(MegatronModule):
    """The MLPs' activation as a spec module (megatron builds it where `use_te_activation_func` is set,
    TE or not): silu(gate) * up in fp32, rounded once, as TE's and SGLang's kernels; megatron's local
    GLU rounds silu(gate) to bf16 first, a rounding the engine does not make. No parameters."""

    def __init__(self, config, **_):
        super().__init__(config=config)

    def forward(self, fc1_out):
        return swiglu(fc1_out)
