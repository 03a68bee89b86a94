"""A step's sampled, scored batch (a StepBatch): one generation round, or DAPO's dynamic sampling
(algorithm.filter_groups), which drops groups whose rewards are all equal and refills from
further prompts until data.train_batch_size groups remain.

Refills come from the step's prompts followed by every other prompt in an order seeded by the
step, so the step's own prompts (and a resumed run) stay as without filtering; a prompt may then
be seen again in the same epoch as a refill. Each round generates data.gen_batch_size prompts.
trainer.mode=fully_async runs the same rounds on groups from its rollout buffer (`generate`).
"""

from __future__ import annotations

from typing import Callable

import torch

from mcore_rl.config import sections as C
from mcore_rl.config import checks as config_checks
from mcore_rl.algos.dapo import varied_groups
from mcore_rl.loop import step_batch
from mcore_rl.loop.step_batch import StepBatch
from mcore_rl.rollout.multiturn import MultiTurnRounds, is_multiturn
from mcore_rl.models.routed_experts import ExpertLayout

# [B, P + R, ...]: left-padded prompts, then responses (routes: each token's experts per MoE layer)
FULL_SEQUENCE_KEYS = ("tokens", "attention_mask", "routes")


class RefillsExhausted(RuntimeError):
    """Dynamic sampling ran out of generation rounds or prompts before the batch was full."""


def sample_step_batch(cfg: C.Config, engine, source, prompt_idx: list[int], seed: int,
                      generate: Callable[[list[int], int], tuple] | None = None) -> StepBatch:
    """The StepBatch of the prompts `prompt_idx`, sampled with `seed`.
    generate(prompts, seed) -> (batch, idx, score, reward) of one round; default: on `engine`."""
    if generate is None:
        generate = round_generator(cfg, engine, source)
    if cfg.algorithm.filter_groups.enable:
        batch, idx, score, reward, metrics = _filtered(cfg, generate, len(source.prompts), prompt_idx, seed)
    else:
        (batch, idx, score, reward), metrics = generate(prompt_idx, seed), {}
    if hasattr(generate, "metrics"):  # the rounds' prefix-cache hits; multi-turn: turns, tool calls, time in tools
        metrics.update(generate.metrics())
    if cfg.reward.overlong_buffer.enable:
        penalty = reward - score
        metrics.update({"reward/overlong_penalty_mean": penalty.mean().item(),
                        "reward/overlong_fraction": (penalty < 0).float().mean().item()})
    return StepBatch(batch, idx, score, reward, metrics)


def _filtered(cfg: C.Config, generate, num_prompts: int, prompt_idx: list[int], seed: int):
    fg, n, want = cfg.algorithm.filter_groups, cfg.rollout.n, len(prompt_idx)
    size = round_size(cfg, want)
    stream = refill_order(num_prompts, prompt_idx, seed)
    parts, kept, rounds = [], 0, 0
    while kept < want:
        start = rounds * size
        if start >= len(stream) or 0 < fg.max_num_gen_batches <= rounds:
            raise RefillsExhausted(
                f"dynamic sampling: {kept} of {want} prompt groups had unequal {fg.metric}s after {rounds} "
                f"generation rounds ({min(start, len(stream))} prompts); raise algorithm.filter_groups."
                "max_num_gen_batches or data.gen_batch_size, or use data the policy neither always passes nor fails")
        batch, idx, score, reward = generate(stream[start:start + size], seed + start * n)
        keep = varied_groups(reward if fg.metric == "reward" else score, n)
        rows = torch.repeat_interleave(keep, n).nonzero().squeeze(-1)
        parts.append(({k: v[rows] for k, v in batch.items()}, [idx[i] for i in rows.tolist()], score[rows],
                      reward[rows]))
        kept += int(keep.sum())
        rounds += 1
    batch = concat_batches([p[0] for p in parts])
    rows = slice(0, want * n)  # groups beyond the batch are dropped, as verl does
    metrics = {"train/num_gen_batches": rounds, "train/kept_group_fraction": kept / min(rounds * size, len(stream))}
    return ({k: v[rows] for k, v in batch.items()}, sum((p[1] for p in parts), [])[rows],
            torch.cat([p[2] for p in parts])[rows], torch.cat([p[3] for p in parts])[rows], metrics)


def round_generator(cfg: C.Config, engine, source) -> Callable[[list[int], int], tuple]:
    """generate(prompts, seed) -> (batch, idx, score, reward) of one round on `engine`: single
    responses, or conversations (rollout.env / rollout.generate_fn, mcore_rl.rollout.multiturn)."""
    experts = expert_layout(cfg)  # once: every round's routes have it
    return (MultiTurnRounds if is_multiturn(cfg) else SingleTurnRounds)(cfg, engine, source, experts)


def expert_layout(cfg: C.Config):
    """The layout of the routes the engines return (routing replay), or None when they return none."""
    return ExpertLayout.of(config_checks.hf_model_dims(cfg.model)) if config_checks.returns_routes(cfg) else None


class SingleTurnRounds:
    """generate(prompts, seed) of one response a sample; metrics() drains the rounds' prefix-cache
    hits: the share of the samples' prompt tokens their engine took from its prefix cache (the
    engines report it: SGLang's cached_tokens, vLLM's num_cached_tokens). rollout.n samples of a
    prompt go to one engine and rank, which prefills the prompt once (mcore_rl.rollout.dp_routing), so the
    share is near 1 - 1 / prompt length when that works."""

    def __init__(self, cfg: C.Config, engine, source, experts=None):
        self.cfg, self.engine, self.source, self.experts = cfg, engine, source, experts
        self.cached = self.prompt_tokens = 0

    def __call__(self, prompts: list[int], seed: int):
        idx = [i for i in prompts for _ in range(self.cfg.rollout.n)]
        done = step_batch.sample(self.engine, self.source, idx, step_batch.sampling_params(self.cfg, self.source, seed))
        for c, i in zip(done, idx):
            if c.cached_tokens is not None:
                self.cached += c.cached_tokens
                self.prompt_tokens += len(self.source.prompts[i])
        batch = step_batch.completions_batch(self.source, idx, done, self.experts,
                                             getattr(self.engine, "label", "the rollout engine"))
        return step_batch.scored(self.cfg, self.source, idx, batch)

    def metrics(self) -> dict:
        out = {"rollout/prefix_cache_hit_rate": self.cached / self.prompt_tokens} if self.prompt_tokens else {}
        self.cached = self.prompt_tokens = 0
        return out


def round_size(cfg: C.Config, step_prompts: int) -> int:
    """Prompts per generation round of dynamic sampling."""
    return cfg.data.gen_batch_size or step_prompts


def refill_order(num_prompts: int, first: list[int], seed: int) -> list[int]:
    """The prompts a step's rounds take, in order: its own, then every other one, shuffled by `seed`."""
    taken = set(first)
    rest = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed)).tolist()
    return list(first) + [i for i in rest if i not in taken]


def concat_batches(batches: list[dict]) -> dict:
    """Rollout batches of different prompt and response widths as one: prompts left-padded,
    responses right-padded to the widest."""
    widths = [(b["tokens"].shape[1] - b["response_mask"].shape[1], b["response_mask"].shape[1]) for b in batches]
    P, R = max(p for p, _ in widths), max(r for _, r in widths)
    out = {}
    for key in batches[0]:
        padded = []
        for b, (p, r) in zip(batches, widths):
            v = b[key]
            if key in FULL_SEQUENCE_KEYS:
                v = torch.cat([_pad(v[:, :p], P, left=True), _pad(v[:, p:], R, left=False)], 1)
            elif v.dim() >= 2 and v.shape[1] == r:  # response-aligned
                v = _pad(v, R, left=False)
            else:
                raise ValueError(f"dynamic sampling cannot merge batch key {key!r} of shape {tuple(v.shape)}")
            padded.append(v)
        out[key] = torch.cat(padded)
    return out


def _pad(v: torch.Tensor, width: int, left: bool) -> torch.Tensor:
    pad = v.new_zeros((v.shape[0], width - v.shape[1], *v.shape[2:]))
    return torch.cat([pad, v] if left else [v, pad], 1)
