"""What every rollout engine offers the RL loop, whichever engine it is.

A `Rollout` is a group of data-parallel engines behind one call:

    completions = rollout.generate(prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=512,
                                                           stop_token_ids=(eos,), seed=step))

returns, for each prompt in order, `n` Completions (response ids and the engine's log-prob of
each sampled token). Engines that hold their own copy of the weights (SGLang, vLLM) also take
weight updates from `mcore_rl.sync` through `weight_target()`, and release/resume their memory
around training; the embedded engine runs on the trainer's own shards and needs neither.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import Protocol, Sequence

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class EngineError(RuntimeError):
    """An engine failed, died or did not answer in time; the message names the engine."""


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()  # generation ends after emitting one of these (it is kept)
    ignore_eos: bool = False  # nor does the engine's own EOS (its config's) end it: max_new_tokens each
    seed: int | None = 0  # completion k of the batch samples with seed + k (reproducible); None: engine's RNG

    def __post_init__(self):
        problems = [f"{k} = {v!r}" for k, v, ok in (
            ("n", self.n, self.n >= 1), ("temperature", self.temperature, self.temperature >= 0),
            ("top_p", self.top_p, 0 < self.top_p <= 1), ("max_new_tokens", self.max_new_tokens, self.max_new_tokens >= 1))
            if not ok]
        if problems:
            raise ValueError("invalid sampling parameters: " + ", ".join(problems))

    def with_(self, **changes) -> "SamplingParams":
        return replace(self, **changes)


@dataclass
class Completion:
    token_ids: list[int]
    log_probs: list[float]  # the engine's log-prob of each sampled token (after temperature)
    finish_reason: str = "length"  # "stop": ended with a stop id (the last token), "length": max_new_tokens
    # [prompt + response - 1 tokens, layers, top-k] int32: the experts each token was routed to
    # (every token but the last sampled one, which the engine never ran); None: the engine returns none
    routed_experts: object = None
    # multi-turn (mcore_rl.rollout.multiturn): 1 on the tokens the model sampled, 0 on the environment's
    # (context, not trained on); None: every token is the model's
    loss_mask: list[int] | None = None
    cached_tokens: int | None = None  # prompt tokens the engine took from its prefix cache; None: not reported

    def __post_init__(self):
        if len(self.token_ids) != len(self.log_probs):
            raise EngineError(f"engine returned {len(self.token_ids)} tokens but {len(self.log_probs)} log-probs")
        if self.loss_mask is not None and len(self.loss_mask) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} tokens but a loss mask of {len(self.loss_mask)}")


@dataclass(frozen=True)
class Request:
    """One completion to sample: what a single engine is asked, after the batch is flattened."""

    prompt: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)  # n == 1, seed already per completion
    # requests of one group share a prefix across calls (a prompt's multi-turn conversations, all their
    # turns; `new_group`): an engine with several prefix caches serves a group from one
    # (mcore_rl.rollout.dp_routing). None: the group is the requests of this call with the same prompt
    group: int | None = None


def new_group() -> int:
    """A Request.group id no other group has (random 64 bits: the engines may be driven from several processes)."""
    return uuid.uuid4().int >> 64


def flatten(prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Request]:
    """prompt-major, completion-minor: request i * n + j is completion j of prompt i, seed + i * n + j."""
    one = params.with_(n=1)
    seed = (lambda k: None) if params.seed is None else (lambda k: params.seed + k)  # noqa: E731
    return [Request(tuple(p), one.with_(seed=seed(i * params.n + j)))
            for i, p in enumerate(prompts) for j in range(params.n)]


def unflatten(done: list[Completion], n: int) -> list[list[Completion]]:
    return [done[i:i + n] for i in range(0, len(done), n)]


def truncate_at_stop(tokens: list[int], log_probs: list[float], stop: Sequence[int]) -> Completion:
    """A completion cut after its first stop id (engines that always sample max_new_tokens)."""
    stops = set(stop)
    for k, t in enumerate(tokens):
        if t in stops:
            return Completion(tokens[:k + 1], log_probs[:k + 1], "stop")
    return Completion(list(tokens), list(log_probs), "length")


class WeightTarget(Protocol):
    """The engines as `mcore_rl.sync`'s transports drive them (on the trainer's driver rank).

    Payload lists hold one entry per engine rank of every engine, engine after engine."""

    def begin_weight_update(self) -> None: ...
    def end_weight_update(self) -> None: ...
    def update_weights_from_tensor(self, payloads: list, load_format: str | None, flush_cache: bool) -> None: ...
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str) -> None: ...
    def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str,
                                        load_format: str | None, flush_cache: bool) -> None: ...
    def update_weights_from_disk(self, model_path: str) -> None: ...


class Rollout(Protocol):
    owns_weights: bool  # False: the engine runs on the trainer's shards (no sync, no release)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]: ...
    def release(self, tags: Sequence[str] = MEMORY_TAGS) -> None: ...
    def resume(self, tags: Sequence[str] = MEMORY_TAGS) -> None: ...
    def health(self) -> list[dict]: ...
    def shutdown(self) -> None: ...


def check_tags(tags: Sequence[str]) -> list[str]:
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"unknown memory tags {bad}; engines know {MEMORY_TAGS}")
    return list(tags)
