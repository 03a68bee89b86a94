"""Log-probabilities of the target tokens and entropies from vocabulary-wide logits, without the
fp32 [rows, vocab] tensors autograd would keep.

The plain chain (`.float() / T`, log_softmax, gather, exp * logp) saves three or four fp32 copies of
the selected logits for backward: at Moonlight's 163840-token vocabulary that is ~2.6 MB per
response token, tens of GB per packed micro-batch, and as many HBM round trips. Here forward keeps
only the bf16 rows it selects plus two floats per row (log-sum-exp and entropy), and backward
rebuilds the softmax from them, writing each chunk's gradient into the logits' gradient:

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
    def forward(ctx, logits, index, target, temperature, with_entropy):
        n, vocab = len(target), logits.shape[-1]
        step = max(1, CHUNK_BYTES // (4 * vocab))
        keep = ctx.needs_input_grad[0]
        # backward needs the selected rows (a bf16 copy when they are a subset); without a gradient
        # each chunk is gathered on its own and nothing [rows, vocab] is made
        rows = logits if index is None else (logits[index] if keep else None)
        chunk = (lambda i: rows[i:i + step]) if rows is not None else (lambda i: logits[index[i:i + step]])
        if n:
            parts = [_forward_chunk(chunk(i), target[i:i + step], temperature, with_entropy) for i in range(0, n, step)]
            logp, lse, ent = (torch.cat(p) for p in zip(*parts))
        else:
            logp = lse = ent = logits.new_zeros(0, dtype=torch.float32)
        if keep:
            ctx.save_for_backward(rows, index, target, lse, ent)
        ctx.shape, ctx.temperature, ctx.step = logits.shape, temperature, step
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        rows, index, target, lse, ent = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None, None, None
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float()
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float()
        # each chunk's gradient is written straight into the logits' gradient: no [rows, vocab]
        # gradient and its concatenation beside it (the peak is the rows kept plus this tensor)
        grad = rows.new_empty(ctx.shape) if index is None else rows.new_zeros(ctx.shape)
        step = ctx.step
        for i in range(0, len(target), step):
            at = slice(i, i + step) if index is None else index[i:i + step]
            grad[at] = _backward_chunk(rows[i:i + step], target[i:i + step], lse[i:i + step], ent[i:i + step],
                                       g_logp[i:i + step], g_ent[i:i + step], ctx.temperature)
        return grad, None, None, None, None


def logprob_entropy(logits: torch.Tensor, target: torch.Tensor, temperature: float, with_entropy: bool,
                    index: torch.Tensor | None = None):
    """(log p(target), entropy) in fp32 for the rows `index` of `logits` [T, vocab] (any float dtype),
    or for every row when index is None; the entropy is zeros when with_entropy is False.
    Differentiable in `logits`; its gradient is zero outside the selected rows."""
    return _LogProbEntropy.apply(logits, index, target, float(temperature), bool(with_entropy))
