"""Bugs and host syncs of megatron-core itself, each named with the release it works around."""

from __future__ import annotations

import functools

import torch

from mcore_rl.patches.patch import Patch


def _expert_bias_padding_mask():
    """Count only unpadded tokens for the expert-bias update: 0.16's TopKRouter ANDs its [tokens,
    experts] routing map with the [tokens] padding mask, which does not broadcast (megatron-core
    later fixed this the same way: the mask drops whole token rows)."""
    from megatron.core.transformer.moe.router import TopKRouter

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if self.enable_expert_bias and torch.is_grad_enabled():  # as megatron: not in eval or recompute
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    TopKRouter._apply_expert_bias = _apply_expert_bias


def _padding_mask_later_stages():
    """GPTModel splits the padding mask over sequence-parallel ranks on the first pipeline stage
    only; later stages' MoE layers got the whole sequence's mask beside their slice of tokens."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel

    preprocess = GPTModel._preprocess

    @functools.wraps(preprocess)
    def split_on_every_stage(self, *args, padding_mask=None, **kwargs):
        if padding_mask is not None and not self.pre_process and self.config.sequence_parallel:
            padding_mask = tensor_parallel.scatter_to_sequence_parallel_region(
                padding_mask.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()
        return preprocess(self, *args, padding_mask=padding_mask, **kwargs)

    GPTModel._preprocess = split_on_every_stage


def _rope_thd_without_sync():
    """Packed (THD) RoPE gathers each token's frequencies by its position in its sequence, computed
    on the device. megatron's version splits the tensor per sequence with `cu_seqlens.tolist()` and
    compares `freqs.size(0) == cu_seqlens[-1]`: two host syncs per call, four per MLA layer."""
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_thd

    def thd(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0,
            cp_group=None):
        if cp_group is None or cp_group.size() != 1:
            return original(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                            multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
        total = t.shape[0]  # == cu_seqlens[-1]: THD holds every sequence's tokens, no padding
        if freqs.dim() >= 1 and freqs.size(0) == total:  # megatron's offset mapping: packed positions
            packed = freqs[:total]
        else:  # each sequence from position 0
            starts = cu_seqlens[:-1].long()
            first = torch.repeat_interleave(starts, cu_seqlens[1:].long() - starts, output_size=total)
            packed = freqs[torch.arange(total, device=t.device) - first]
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), packed, rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention, mscale=mscale).squeeze(1)

    thd.__wrapped__ = original
    rope_utils._apply_rotary_pos_emb_thd = thd


PATCHES = (
    Patch("expert_bias_padding_mask", "the expert-bias token count ANDs a [tokens, experts] map "
          "with a [tokens] padding mask (a shape error)", _expert_bias_padding_mask, "megatron-core 0.16.1"),
    Patch("padding_mask_later_stages", "the padding mask is split over sequence-parallel ranks on "
          "the first pipeline stage only", _padding_mask_later_stages, "megatron-core 0.16.1"),
    Patch("rope_thd_no_sync", "packed-sequence RoPE syncs with the host twice per call", _rope_thd_without_sync,
          "megatron-core 0.16.1"),
)
