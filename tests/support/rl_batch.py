"""A fixed RL batch for actor tests: left-padded samples of different prompt and response lengths."""

from __future__ import annotations

import torch

PROMPT_LENS, RESPONSE_LENS = (3, 7, 1, 5, 2, 6), (5, 2, 4, 1, 5, 3)
B, P, R = len(PROMPT_LENS), max(PROMPT_LENS), max(RESPONSE_LENS)  # samples, prompt and response columns


def rl_batch(seed: int = 0, vocab: int = 256) -> dict:
    """tokens [B, P + R] (pads, prompt, response), their masks, and random advantages, old /
    reference / rollout log-probs and returns."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab, (B, P + R), generator=g)
    attn = torch.zeros(B, P + R, dtype=torch.long)
    resp_mask = torch.zeros(B, R)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        tokens[i, :P - p] = 0
        attn[i, P - p:P + r] = 1
        resp_mask[i, :r] = 1
    return dict(tokens=tokens, attention_mask=attn, response_mask=resp_mask,
                advantages=torch.randn(B, R, generator=g) * resp_mask,
                old_log_probs=-torch.rand(B, R, generator=g) * 6,
                ref_log_probs=-torch.rand(B, R, generator=g) * 6,
                rollout_log_probs=-torch.rand(B, R, generator=g) * 6,
                returns=torch.randn(B, R, generator=g) * resp_mask)
