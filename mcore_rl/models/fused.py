"""Elementwise chains fused into one kernel per direction by torch.compile, on GPU only.

Without TransformerEngine, SwiGLU x routing probability and RMSNorm run as chains of eager
kernels over [tokens, width] tensors, each a round trip through HBM; on an H100 they took ~20 %
of a Moonlight layer's fwd+bwd. torch.compile fuses each chain (forward and backward). On CPU the
eager chain is kept: compiling costs more there than it saves. TORCHDYNAMO_DISABLE=1 turns the
compiled path off everywhere (torch.compile then runs the function eagerly).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def gpu_compiled(varying):
    """Compile on CUDA inputs; `varying(*args)` lists the (tensor, dim) pairs whose size changes
    between calls (token counts). Widths stay static: fully dynamic shapes gave 4x slower kernels."""

    def wrap(fn):
        compiled = None

        @functools.wraps(fn)
        def call(x, *args):
            nonlocal compiled
            if not x.is_cuda:
                return fn(x, *args)
            if compiled is None:
                compiled = torch.compile(fn)
            for t, dim in varying(x, *args):
                torch._dynamo.maybe_mark_dynamic(t, dim)  # no error when a call has 0 or 1 tokens
            return compiled(x, *args)

        return call

    return wrap


@gpu_compiled(lambda x, probs: [(x, 0), (probs, 0)])
def swiglu_probs(fc1_out: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, scaled per token by its routing probability, as megatron's expert MLP; in fp32,
    rounded once (what the compiled kernel does anyway: the eager path now rounds where it does)."""
    gate, up = fc1_out.float().chunk(2, dim=-1)
    return (F.silu(gate) * up * probs.unsqueeze(-1)).to(fc1_out.dtype)


@gpu_compiled(lambda x: [(x, 0)])
def _swiglu_rows(fc1_out: torch.Tensor) -> torch.Tensor:
    gate, up = fc1_out.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(fc1_out.dtype)


def swiglu(fc1_out: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of an MLP's fc1 output [..., gate | up], in fp32 and rounded once to its dtype, as
    TE's and SGLang's kernels compute it (megatron's local GLU rounds silu(gate) before the product)."""
    return _swiglu_rows(fc1_out.reshape(-1, fc1_out.shape[-1])).view(*fc1_out.shape[:-1], fc1_out.shape[-1] // 2)


@gpu_compiled(lambda x, weight, eps: [(x, 0)])
def _rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, as the HF reference computes it, over the rows of the last dim: one compiled
    graph per width, whatever the input's rank. Compiled on the inputs' own ranks (hidden states
    3-D, Qwen3's per-head q/k norms 4-D), it recompiled past dynamo's limit of 8 and ran eager."""
    return _rms_norm_rows(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
