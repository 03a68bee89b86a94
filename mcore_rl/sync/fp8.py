"""Block-wise FP8 weights in DeepSeek-V3's checkpoint format, for rollout engines that run them.

One fp32 scale per 128 x 128 block (the edge blocks of shapes that are not multiples of 128 are
partial), e4m3 values, and `weight_scale_inv` = the multiplier that dequantizes: w ~ q * s.
The quantization is DeepSeek's reference (`weight_quant` in DeepSeek-V3's inference/kernel.py):
s = amax(|block|) / 448 in fp32, q = (x / s) cast to e4m3 with round-to-nearest-even. One
deliberate difference: an all-zero block, where the reference divides 0 by 0 and stores NaN, gets
s = 1 and q = 0 (it still dequantizes to zeros).
Dequantizing is the converter's (`mcore_rl.convert.hf_io.dequantize_fp8`) and SGLang's
(`block_quant_dequant`): q in fp32 times the block's scale.
"""

from __future__ import annotations

import math

import torch

BLOCK = (128, 128)
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
SCALE_SUFFIX = "_scale_inv"  # "x.weight" -> "x.weight_scale_inv", DeepSeek's checkpoint name

# what an FP8 DeepSeek-V3 checkpoint's config.json carries (the engine reads it to build FP8 layers)
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": list(BLOCK)}


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """[ceil(rows / 128), ceil(cols / 128)]: one scale per (possibly partial) block."""
    rows, cols = shape
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def quantize(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight of w's shape, fp32 weight_scale_inv [ceil(m/bm), ceil(n/bn)]) on w's device."""
    if w.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights; got shape {tuple(w.shape)}")
    (m, n), (bm, bn) = w.shape, block
    sm, sn = scale_shape((m, n), block)
    x = w.float()
    if (m, n) != (sm * bm, sn * bn):  # zero padding leaves every block's amax unchanged
        x = torch.nn.functional.pad(x, (0, sn * bn - n, 0, sm * bm - m))
    blocks = x.view(sm, bm, sn, bn)
    s = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
    s = torch.where(s == 0, torch.ones_like(s), s)  # the reference's 0/0 would store NaN
    q = (blocks / s[:, None, :, None]).to(E4M3).view(sm * bm, sn * bn)[:m, :n].contiguous()
    return q, s


def dequantize(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int] = BLOCK,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * its block's scale, computed in fp32, returned as `dtype`."""
    m, n = q.shape
    full = s.float().repeat_interleave(block[0], 0)[:m].repeat_interleave(block[1], 1)[:, :n]
    return (q.float() * full).to(dtype)
