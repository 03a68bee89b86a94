"""Log-probabilities of the target tokens and entropies from vocabulary-wide logits, without the
fp32 [rows, vocab] tensors autograd would keep.

The plain chain (`.float() / T`, log_softmax, gather, exp * logp) saves three or four fp32 copies of
the selected logits for backward: at Moonlight's 163840-token vocabulary that is ~2.6 MB per
response token, tens of GB per packed micro-batch, and as many HBM round trips. Here forward keeps
only the bf16 rows it was given plus two floats per row (log-sum-exp and entropy), and backward
rebuilds the softmax from them:

    d logp_t / d z   = onehot(t) - p
    d H / d z        = -p * (log p + H)          (H = -sum p log p)

Rows are processed in chunks so fp32 temporaries stay bounded; on GPU each chunk's forward and
backward are compiled into a few fused kernels (mcore_rl.models.fused.gpu_compiled).
"""

from __future__ import annotations

import torch

from mcore_rl.models.fused import gpu_compiled

CHUNK_BYTES = 1 << 29  # fp32 bytes of one chunk of rows


@gpu_compiled(lambda x, target, temperature, with_entropy: [(x, 0), (target, 0)])
def _forward_chunk(x, target, temperature: float, with_entropy: bool):
    z = x.float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, target[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logp, lse, torch.zeros_like(lse)
    logp_all = z - lse[:, None]  # as log_softmax: lse - sum(p * z) would cancel for peaked rows
    return logp, lse, -(logp_all.exp() * logp_all).sum(-1)


@gpu_compiled(lambda x, target, lse, ent, g_logp, g_ent, temperature: [(x, 0), (target, 0), (lse, 0),
                                                                        (ent, 0), (g_logp, 0), (g_ent, 0)])
def _backward_chunk(x, target, lse, ent, g_logp, g_ent, temperature: float):
    logp = x.float() / temperature - lse[:, None]
    p = logp.exp()
    dz = -(g_logp[:, None] + g_ent[:, None] * (logp + ent[:, None])) * p
    dz = dz.scatter_add(-1, target[:, None], g_logp[:, None])
    return (dz / temperature).to(x.dtype)


class _LogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, target, temperature, with_entropy):
        n, vocab = rows.shape
        step = max(1, CHUNK_BYTES // (4 * vocab))
        if n:
            parts = [_forward_chunk(rows[i:i + step], target[i:i + step], temperature, with_entropy)
                     for i in range(0, n, step)]
            logp, lse, ent = (torch.cat(p) for p in zip(*parts))
        else:
            logp = lse = ent = rows.new_zeros(0, dtype=torch.float32)
        ctx.save_for_backward(rows, target, lse, ent)
        ctx.temperature, ctx.step = temperature, step
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        rows, target, lse, ent = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None, None
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float()
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float()
        if not len(rows):
            return torch.zeros_like(rows), None, None, None
        step = ctx.step
        grad = torch.cat([_backward_chunk(rows[i:i + step], target[i:i + step], lse[i:i + step], ent[i:i + step],
                                          g_logp[i:i + step], g_ent[i:i + step], ctx.temperature)
                          for i in range(0, len(rows), step)])
        return grad, None, None, None


def logprob_entropy(rows: torch.Tensor, target: torch.Tensor, temperature: float, with_entropy: bool):
    """(log p(target), entropy) per row of `rows` [n, vocab] (any float dtype) in fp32; the entropy
    is zeros when with_entropy is False. Differentiable in `rows`."""
    return _LogProbEntropy.apply(rows, target, float(temperature), bool(with_entropy))
