"""The embedded engine: sampling on the Megatron actors' own shards (no KV cache), for laptops and CI.

It holds no weights of its own, so there is nothing to sync and nothing to release. Each decode
step is one forward of the whole (packed) batch through megatron's schedule; the last pipeline
stage samples and every rank appends the token. Sampling is a Gumbel-max over counter-based
noise keyed by (completion seed, step, token id), so completion k of a batch depends only on its
prompt and seed + k: the same at any data-parallel size and batch composition.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from mcore_rl.rollout.base import (MEMORY_TAGS, Completion, Request, SamplingParams, flatten, truncate_at_stop,
                                   unflatten)


class EmbeddedRollout:
    owns_weights = False

    def __init__(self, actors, pad_id: int = 0):
        self.actors, self.pad_id = actors, pad_id

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        return unflatten(self._sample(flatten(prompts, params), params), params.n)

    def generate_requests(self, requests: list[Request]) -> list[Completion]:
        """Requests as they are (a multi-turn round): those sampled alike but for the seed run as one batch."""
        alike: dict[SamplingParams, list[int]] = {}
        for k, r in enumerate(requests):
            alike.setdefault(r.params.with_(seed=None), []).append(k)
        out: list[Completion | None] = [None] * len(requests)
        for params, ks in alike.items():
            for k, c in zip(ks, self._sample([requests[k] for k in ks], params)):
                out[k] = c
        return out

    def _sample(self, requests: list[Request], params: SamplingParams) -> list[Completion]:
        from mcore_rl.loop.step_batch import pad_prompts

        ids, mask = pad_prompts([list(r.prompt) for r in requests], self.pad_id)
        seeds = torch.tensor([r.params.seed or 0 for r in requests], dtype=torch.long)  # always seeded here
        outs = self.actors.call("run", sample_on_shards, ids, mask, seeds, params.max_new_tokens,
                                params.temperature, params.top_p)
        tokens, logps = torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
        return [truncate_at_stop(t, lp, params.stop_token_ids)
                for t, lp in zip(tokens[:, ids.shape[1]:].tolist(), logps.tolist())]

    def release(self, tags=MEMORY_TAGS) -> None:
        pass  # the trainer's own weights: nothing to give back

    def resume(self, tags=MEMORY_TAGS) -> None:
        pass

    def health(self) -> list[dict]:
        return [{"engine": "embedded", "alive": True}]

    def shutdown(self) -> None:
        pass


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_MIX = [(30, _signed(0xBF58476D1CE4E5B9)), (27, _signed(0x94D049BB133111EB)), (31, 1)]  # splitmix64's finalizer


def uniform_noise(seeds: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """U(0,1) [B, vocab] from a counter-based hash of (seed, step, token): no generator state."""
    idx = torch.arange(vocab, dtype=torch.long, device=seeds.device)
    step_t = torch.tensor(step, dtype=torch.long, device=seeds.device)  # int64 arithmetic wraps; Python's would not
    x = (seeds[:, None] * _signed(0x9E3779B97F4A7C15) + step_t * _signed(0xD1B54A32D192ED03)
         + idx[None, :] * _signed(0xABC98388FB8FAC03))
    for shift, mul in _MIX:  # logical shifts on int64: mask off the sign bits arithmetic shift copies
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * mul
    return (((x >> 11) & ((1 << 53) - 1)).double() + 0.5) / float(1 << 53)


def sample_tokens(logits: torch.Tensor, seeds: torch.Tensor, step: int, temperature: float, top_p: float):
    """(token [B, 1], its log-prob after temperature [B, 1]) from logits [B, V]; temperature 0 is greedy."""
    if temperature == 0:
        logp = F.log_softmax(logits.float(), -1)
        tok = logp.argmax(-1, keepdim=True)
        return tok, logp.gather(-1, tok)
    logp = F.log_softmax(logits.float() / temperature, -1)
    keep = logp
    if top_p < 1.0:  # nucleus: drop tokens outside the smallest set whose mass reaches top_p
        sorted_logp, order = logp.sort(-1, descending=True)
        outside = sorted_logp.exp().cumsum(-1) - sorted_logp.exp() >= top_p
        keep = logp.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), float("-inf"))
    gumbel = -torch.log(-torch.log(uniform_noise(seeds.to(logp.device), step, logp.shape[-1])))
    tok = (keep.double() + gumbel).argmax(-1, keepdim=True)
    return tok, logp.gather(-1, tok)


@torch.no_grad()
def sample_on_shards(actor, prompts: torch.Tensor, prompt_mask: torch.Tensor, seeds: torch.Tensor, max_new: int,
                     temperature: float, top_p: float):
    """Inside a MegatronActor (via `actor.run`): this rank's data-parallel slice of left-padded
    `prompts` [B, P] extended by `max_new` sampled tokens. Returns (tokens [b, P + max_new],
    log-probs of the sampled tokens [b, max_new]) on the reporting rank, else None."""
    from mcore_rl.loop import schedule

    actor.model.eval()
    sl = actor._dp_slice(len(prompts))
    tokens, attn, seeds = prompts[sl], prompt_mask[sl], seeds[sl]
    rows, logps, tp = list(range(len(tokens))), [], actor.layout.tp
    for step in range(max_new):
        pad_to = actor._max_over_ranks([int(attn.sum())])[0]
        packed = actor._pack({"tokens": tokens, "attention_mask": attn}, 0, rows, -(-pad_to // tp) * tp)
        last = schedule.forward(actor.model, [packed], lambda y, k: y[packed.last].float(), tp_gather=True)
        nxt = torch.zeros(len(rows), 1, dtype=torch.long, device=actor.device)
        if last and rows:  # the last stage samples; every rank must append its token
            nxt, logp = sample_tokens(last[0], seeds, step, temperature, top_p)
            logps.append(logp.cpu())
        actor._from_last_stage(nxt)
        nxt = nxt.cpu()
        tokens, attn = torch.cat([tokens, nxt], 1), torch.cat([attn, torch.ones_like(nxt)], 1)
    if not actor._is_reporter():
        return None
    return tokens, torch.cat(logps, 1) if logps else torch.zeros(len(rows), max_new)
