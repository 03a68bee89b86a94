"""Local (non-TE) layers that megatron-core 0.16.1 lacks: SDPA core attention and an SP-ready RMSNorm."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from mcore_rl.models.fused import rms_norm


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
        bounds = psp.cu_seqlens_q.tolist()
        out = torch.cat([F.scaled_dot_product_attention(
            q[:, a:b], k[:, a:b], v[:, a:b], dropout_p=dropout, is_causal=True, scale=self.softmax_scale,
            enable_gqa=k.shape[0] != q.shape[0]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a], dim=1)
        out = out.transpose(0, 1).reshape(q.shape[1], -1)
        return out.unsqueeze(1) if squeeze else out


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
