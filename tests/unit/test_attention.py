"""SDPACoreAttention: packed THD sequences (remove-padding training) equal per-sequence attention,
and unequal q/k vs v head dims (MLA) work."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from mcore_rl.models.layers import SDPACoreAttention


def _attn(q, k, v, scale):
    """Reference causal attention for one sequence, [s, h, d] inputs."""
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = q.shape[0]
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _layer(dk):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, kv_channels=dk)
    return SDPACoreAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal).eval()


def test_packed_thd_matches_per_sequence_attention():
    torch.manual_seed(0)
    lens, h, dk, dv = [5, 3, 7], 4, 24, 16  # MLA-like: q/k head dim != v head dim
    t = sum(lens)
    q, k, v = torch.randn(t, h, dk), torch.randn(t, h, dk), torch.randn(t, h, dv)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    out = _layer(dk)(q, k, v, None, packed_seq_params=SimpleNamespace(cu_seqlens_q=cu))
    ref = torch.cat([_attn(q[a:b], k[a:b], v[a:b], 1 / math.sqrt(dk)).reshape(b - a, -1)
                     for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    assert out.shape == (t, h * dv)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_padded_batch_matches_reference():
    torch.manual_seed(1)
    s, b, h, dk, dv = 6, 2, 2, 8, 4
    q, k, v = torch.randn(s, b, h, dk), torch.randn(s, b, h, dk), torch.randn(s, b, h, dv)
    out = _layer(dk)(q, k, v, None)
    for i in range(b):
        ref = _attn(q[:, i], k[:, i], v[:, i], 1 / math.sqrt(dk)).reshape(s, -1)
        torch.testing.assert_close(out[:, i], ref, atol=1e-5, rtol=1e-5)


def test_packed_attention_splits_by_the_host_bounds():
    """With the host copy of cu_seqlens that mcore_rl.loop.micro_batches attaches, the packed path never
    reads cu_seqlens (here on the meta device, which cannot be read) and gives the same result."""
    torch.manual_seed(2)
    lens, h, dk, dv = [4, 6], 2, 24, 16
    t = sum(lens)
    q, k, v = torch.randn(t, h, dk), torch.randn(t, h, dk), torch.randn(t, h, dv)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    layer = _layer(dk)
    want = layer(q, k, v, None, packed_seq_params=SimpleNamespace(cu_seqlens_q=cu))
    unreadable = SimpleNamespace(cu_seqlens_q=cu.to("meta"), seq_bounds=(0, 4, 10))
    torch.testing.assert_close(layer(q, k, v, None, packed_seq_params=unreadable), want, atol=0, rtol=0)


def test_varlen_attention_falls_back_to_per_sequence_sdpa_off_gpu():
    """The varlen class runs torch's flash varlen kernel on CUDA only (its equality with the
    per-sequence path and an fp32 reference on GPU: tests/gpu/gpu_checks.py, run by actor_bench --checks;
    on 2 x H200 both were 3.7e-2 from fp32 in logits); on CPU it is the per-sequence path."""
    from megatron.core.transformer.enums import AttnMaskType

    from mcore_rl.models.layers import VarlenCoreAttention

    torch.manual_seed(3)
    q, k, v = torch.randn(9, 2, 24), torch.randn(9, 2, 24), torch.randn(9, 2, 16)
    psp = SimpleNamespace(cu_seqlens_q=torch.tensor([0, 5, 9], dtype=torch.int32), max_seqlen_q=5)
    varlen = VarlenCoreAttention(_layer(24).config, layer_number=1, attn_mask_type=AttnMaskType.causal).eval()
    torch.testing.assert_close(varlen(q, k, v, None, packed_seq_params=psp),
                               _layer(24)(q, k, v, None, packed_seq_params=psp), atol=0, rtol=0)
