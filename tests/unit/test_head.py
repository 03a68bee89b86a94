"""mcore_rl.models.head (log-probs and entropies without fp32 [rows, vocab] copies kept for backward)
equals the autograd chain it replaces: values and gradients, chunked or not, with and without
entropy, in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore_rl.models import head


def _plain(rows, target, temperature):
    logp_all = F.log_softmax(rows.float() / temperature, dim=-1)
    return logp_all.gather(-1, target[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_rows", [1000, 3], ids=["one-chunk", "chunked"])
def test_values_and_grads_equal_the_autograd_chain(monkeypatch, dtype, tol, chunk_rows):
    vocab = 50
    monkeypatch.setattr(head, "CHUNK_BYTES", chunk_rows * 4 * vocab)
    torch.manual_seed(0)
    base = (torch.randn(11, vocab) * 3).to(dtype)
    target = torch.randint(0, vocab, (11,))
    g_logp, g_ent = torch.randn(11), torch.randn(11)
    results = []
    for fused in (True, False):
        rows = base.clone().requires_grad_()
        logp, ent = head.logprob_entropy(rows, target, 0.7, True) if fused else _plain(rows, target, 0.7)
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
        results.append((logp.detach(), ent.detach(), rows.grad.float()))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_without_entropy_or_its_gradient():
    torch.manual_seed(1)
    base, target = torch.randn(6, 20), torch.randint(0, 20, (6,))
    rows = base.clone().requires_grad_()
    logp, ent = head.logprob_entropy(rows, target, 1.0, False)
    assert torch.equal(ent, torch.zeros(6))
    logp.sum().backward()  # only logp reaches the loss (the entropy as a metric)
    ref = base.clone().requires_grad_()
    _plain(ref, target, 1.0)[0].sum().backward()
    torch.testing.assert_close(rows.grad, ref.grad, atol=1e-6, rtol=1e-6)
    empty = torch.zeros(0, 20, requires_grad=True)
    logp, ent = head.logprob_entropy(empty, target[:0], 1.0, True)
    (logp.sum() + ent.sum()).backward()
    assert logp.shape == (0,) and empty.grad.shape == (0, 20)


@pytest.mark.parametrize("chunk_rows", [1000, 2], ids=["one-chunk", "chunked"])
def test_token_logprobs_fused_equals_plain(monkeypatch, chunk_rows):
    """The actor's packed helper: log-probs and entropies at the response positions, both ways."""
    from mcore_rl.loop import micro_batches

    monkeypatch.setattr(head, "CHUNK_BYTES", chunk_rows * 4 * 30)
    from mcore_rl.actor import token_logprobs

    torch.manual_seed(2)
    tokens = torch.randint(1, 30, (3, 9))
    attn = torch.ones(3, 9, dtype=torch.long)
    attn[0, :2] = 0
    attn[2, -1] = 0  # a response that ended early
    packed = micro_batches.pack(tokens, attn, 3, [0, 1, 2])
    logits = torch.randn(packed.length, 30)
    a = token_logprobs(logits, packed, 0.9, with_entropy=True, fused=True)
    b = token_logprobs(logits, packed, 0.9, with_entropy=True, fused=False)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
    assert (a[0] == 0).sum() == 1  # the masked-out response token stays 0
    grads = []
    for fused in (True, False):  # the gradient lands in the logits' rows, zero elsewhere
        x = logits.clone().requires_grad_()
        logp, ent = token_logprobs(x, packed, 0.9, with_entropy=True, fused=fused)
        (logp.sum() + 0.5 * ent.sum()).backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-6)
    assert grads[0].abs().sum(-1).count_nonzero() == len(packed.response_rows)
