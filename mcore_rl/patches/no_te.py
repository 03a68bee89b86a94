"""megatron-core 0.16.1's fallbacks for running without TransformerEngine or Apex: what they get
wrong, and the host syncs their local multi-tensor helpers add."""

from __future__ import annotations

import torch

from mcore_rl.metrics.console import importable
from mcore_rl.patches.patch import Patch


def have_te() -> bool:
    return importable("transformer_engine")


def _mla_no_te():
    from megatron.core.transformer import multi_latent_attention as mla

    from megatron.core.extensions import transformer_engine as te_ext  # noqa: F401

    if not have_te():
        mla.HAVE_TE = False


def _moe_gemm_no_te():
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm's contract: ([total norm] on the device, None)."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale's contract: dst[i] = src[i] * scale."""
    src, dst = tensor_lists
    if src is dst:
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _grad_norm_without_sync():
    """Without apex or TE megatron falls back to local multi-tensor helpers; its l2 norm turns
    every grad's norm into a Python float (one host sync per tensor, ~1000 per optimizer step
    for a Moonlight layer stack) and its scale loops over tensors. Foreach kernels do both on
    the device."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale


def _rope_fp32():
    """Without TE's fused RoPE (apply_rope_fusion off) megatron rotates q and k in their own dtype: cos and
    sin rounded to bf16, each product and the sum rounded again. TE's kernel, and SGLang's on CUDA (an fp32
    cos/sin cache, flashinfer's kernel), compute in fp32 and round once; a bf16 trainer otherwise parts
    from its engine at every rotated element of every layer. The packed (THD) path calls this one too."""
    from megatron.core.models.common.embeddings import rope_utils

    megatron_rope = rope_utils._apply_rotary_pos_emb_bshd

    def rope_fp32(t, freqs, *args, **kwargs):
        return megatron_rope(t.float(), freqs, *args, **kwargs).to(t.dtype)

    rope_fp32.__wrapped__ = megatron_rope
    rope_utils._apply_rotary_pos_emb_bshd = rope_fp32


PATCHES = (
    Patch("mla_no_te", "MLA believes TE is present when TE's import was replaced by a MagicMock", _mla_no_te),
    Patch("moe_gemm_no_te", "moe_utils calls te_general_gemm, undefined when TE is absent", _moe_gemm_no_te),
    Patch("rope_fp32", "without TE megatron applies RoPE in bf16, rounding cos, sin, products and sum; TE and "
          "the engines compute it in fp32 and round once", _rope_fp32),
    Patch("grad_norm_no_sync", "the grad-norm fallback without apex/TE syncs with the host once per "
          "tensor", _grad_norm_without_sync),
)
