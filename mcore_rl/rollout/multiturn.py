"""Multi-turn rollouts: a sample is a conversation of model turns and environment replies.

An environment (`rollout.env: package.module:Class`, built once per conversation with
`rollout.env_args` as keyword arguments) has two coroutines:

    async def reset(self, sample: SampleInfo) -> list[int] | str | None
        # what the environment says before the first turn (None: nothing)
    async def step(self, model_turn: list[int]) -> StepResult
        # the model's turn as the token ids it sampled -> (observation, reward, done)

and optionally `stop_token_ids` (ids that end a model turn besides the tokenizer's EOS, e.g. a
tool-call closing tag) and `async def close()`. Observations are token ids, text (encoded once,
`add_special_tokens=False`) or a message ({"role": "tool" or "user", "content": text or ids}), which the
chat template wraps in its turn markers (mcore_rl/rollout/chat.py); the model's tokens are never decoded and re-encoded, so the trainer
sees exactly the ids the engine sampled. A conversation ends when the environment says done, after
`rollout.max_turns` model turns, or when `rollout.max_response_len` (model and environment tokens
together) is used up. Its score is the last reward the environment gave; with none, the data's rule
score of the last model turn.

A tool that raises, takes longer than `rollout.tool_timeout_s`, or answers with more than
`rollout.max_observation_tokens` tokens ends its own conversation with `rollout.tool_failure_reward`
(counted in `multiturn/tool_failures_*`); the others go on. Environment coroutines share one event
loop: a coroutine that blocks (no await) holds every conversation up, so blocking work belongs in a
subprocess or `asyncio.to_thread` (`mcore_rl/envs/code_exec.py` runs code in a subprocess). Plain
(not async) reset/step methods are run in threads of their own; one that hangs past the timeout
ends its conversation, and its thread is left to finish.

`rollout.generate_fn: package.module:function` replaces the whole per-sample rollout, as slime's
custom generate function: `async def fn(ctx: TurnContext, conv: Conversation) -> None`, which
samples turns with `await ctx.generate(conv)`, appends environment tokens with
`conv.add_observation(ids)`, calls tools with `await ctx.tool(conv, coroutine, what)` and sets
`conv.reward`. `env_conversation` below, the default, is written that way.

Conversations run as coroutines on an event loop of their own thread (`ConversationPool`); the
caller's thread drives the engines a round at a time: once every live conversation waits for the
engine, their requests go to `engine.generate_requests` as one batch (the engines batch and
prefix-cache them), the turns are handed back and the conversations run on to their next turn.
The batch keeps every response token in the context (attention_mask) and only the model's in
`response_mask` (the loss, KL, advantages and their normalisation); log-probs, token versions and
rollout-correction weights are the model's tokens' only, and R3 routes come from the last turn's
call, which ran the whole conversation.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from mcore_rl.rollout.base import Completion, Request, SamplingParams, new_group
# a request continuing a conversation samples with seed + stride * tokens so far, as a partial rollout's piece
from mcore_rl.rollout.buffer import PIECE_SEED_STRIDE, RolloutWorker
from mcore_rl.rollout.chat import is_message

FAILURES = ("raised", "timeout", "flood")


class ToolFailure(Exception):
    """A tool raised, hung past rollout.tool_timeout_s or flooded past rollout.max_observation_tokens."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class StepResult:
    observation: list[int] | str | None = None  # appended to the context before the next turn
    reward: float | None = None  # the conversation's score so far (the last one given counts)
    done: bool = False


@dataclass(frozen=True)
class SampleInfo:
    """What an environment's reset gets: the sample it starts."""

    prompt_index: int
    prompt: tuple[int, ...]
    seed: int | None  # the conversation's sampling seed: a seeded environment is reproducible with it
    tokenizer: Any = None


@dataclass(frozen=True)
class MultiTurnSettings:
    max_turns: int = 4
    max_turn_tokens: int | None = None  # one model turn's token cap (None: the remaining budget)
    budget: int = 1024  # rollout.max_response_len: model and environment tokens together
    tool_timeout_s: float = 30.0
    max_observation_tokens: int = 1024
    failure_reward: float = 0.0
    segment: int = 0  # partial rollout: a turn is sampled this many tokens a request (0: whole)
    template_kwargs: tuple = ()  # data.chat_template_kwargs' items, for message observations (chat.TurnFormat)

    @classmethod
    def of(cls, cfg, segment: int = 0) -> "MultiTurnSettings":
        r = cfg.rollout
        return cls(r.max_turns, r.max_turn_tokens, r.max_response_len, r.tool_timeout_s, r.max_observation_tokens,
                   r.tool_failure_reward, segment, tuple(sorted(cfg.data.chat_template_kwargs.items())))


@dataclass
class Conversation:
    """One sample in the making: the response tokens after the prompt, model's and environment's."""

    prompt_index: int
    prompt: list[int]
    seed: int | None
    group: int | None = None  # Request.group of its requests: one for a prompt's conversations (base.new_group)
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)  # 0 on environment tokens
    loss_mask: list[int] = field(default_factory=list)  # 1: the model sampled it
    versions: list[int] = field(default_factory=list)  # per token: the weights' version that sampled it
    routed_experts: object = None  # the last request's: it ran the whole conversation
    finish_reason: str = "length"
    reward: float | None = None
    failure: str | None = None  # one of FAILURES
    turns: int = 0
    tool_calls: int = 0
    observation_tokens: int = 0
    tool_seconds: float = 0.0
    requests: int = 0
    prompt_tokens_sent: int = 0
    cached_tokens: int | None = None  # summed over requests; None: the engine does not report them
    finished: bool = False

    def add_model(self, piece: Completion, version: int) -> None:
        self.tokens += piece.token_ids
        self.log_probs += piece.log_probs
        self.loss_mask += [1] * len(piece.token_ids)
        self.versions += [version] * len(piece.token_ids)
        self.routed_experts = piece.routed_experts
        self.finish_reason = piece.finish_reason

    def add_observation(self, ids: Sequence[int]) -> None:
        ids = [int(t) for t in ids]
        self.tokens += ids
        self.log_probs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else 0] * len(ids)
        self.observation_tokens += len(ids)

    def room(self, budget: int) -> int:
        return budget - len(self.tokens)

    def completion(self) -> Completion:
        return Completion(list(self.tokens), list(self.log_probs), self.finish_reason, self.routed_experts,
                          loss_mask=list(self.loss_mask))


@dataclass
class _Pending:
    conv: Conversation
    request: Request
    future: asyncio.Future


class TurnContext:
    """What a conversation coroutine drives the engine and its tools with."""

    def __init__(self, pool: "ConversationPool", params: SamplingParams, settings: MultiTurnSettings, tokenizer=None,
                 make_env: Callable[[], Any] | None = None):
        self.pool, self.params, self.settings, self.tokenizer = pool, params, settings, tokenizer
        self.make_env = make_env
        self.turns, self.turns_error = None, None  # the chat template's turn boundaries (chat.TurnFormat)
        if getattr(tokenizer, "chat_template", None):
            from mcore_rl.rollout.chat import TurnFormat

            try:
                self.turns = TurnFormat(tokenizer, dict(settings.template_kwargs))
            except Exception as e:  # noqa: BLE001 - a template that cannot render a tool turn (its own checks
                # raise what they like): raised where a message observation needs it, harmless elsewhere
                self.turns_error = ValueError(f"the chat template cannot wrap an observation: {type(e).__name__}: {e}")

    async def generate(self, conv: Conversation, max_new_tokens: int | None = None,
                       stop_token_ids: Sequence[int] = ()) -> list[int]:
        """One model turn continuing `conv` (appended to it); returns the turn's token ids. With
        partial rollout the turn is sampled in pieces, each under the weights the engines then hold."""
        s = self.settings
        cap = min(x for x in (max_new_tokens, s.max_turn_tokens, conv.room(s.budget)) if x is not None)
        if cap < 1:
            return []
        ends = self.turns.stop_token_ids if self.turns else ()  # the template's end-of-turn markers
        stop = tuple(dict.fromkeys((*self.params.stop_token_ids, *ends, *stop_token_ids)))
        start = len(conv.tokens)
        while True:
            left = cap - (len(conv.tokens) - start)
            seed = None if conv.seed is None else conv.seed + PIECE_SEED_STRIDE * len(conv.tokens)
            request = Request(tuple(conv.prompt + conv.tokens),
                              self.params.with_(n=1, seed=seed, stop_token_ids=stop,
                                                max_new_tokens=min(left, s.segment) if s.segment else left),
                              conv.group)
            piece, version = await self.pool.submit(conv, request)
            conv.add_model(piece, version)
            conv.requests += 1
            conv.prompt_tokens_sent += len(request.prompt)
            if piece.cached_tokens is not None:
                conv.cached_tokens = (conv.cached_tokens or 0) + piece.cached_tokens
            if piece.finish_reason == "stop" or len(conv.tokens) - start >= cap or not piece.token_ids:
                break
        conv.turns += 1
        return conv.tokens[start:]

    async def tool(self, conv: Conversation, call: Awaitable, what: str = "tool"):
        """`call`'s result, within rollout.tool_timeout_s; a raise or a timeout is a ToolFailure."""
        t = time.perf_counter()
        try:
            return await asyncio.wait_for(call, self.settings.tool_timeout_s)
        except asyncio.TimeoutError:
            raise ToolFailure("timeout", f"{what} took longer than {self.settings.tool_timeout_s}s") from None
        except ToolFailure:
            raise
        except Exception as e:  # noqa: BLE001 - the tool's own error ends its conversation, nothing else
            raise ToolFailure("raised", f"{what} raised {type(e).__name__}: {e}") from None
        finally:
            conv.tool_seconds += time.perf_counter() - t

    def observation_ids(self, observation, model_turn: Sequence[int] | None = None) -> list[int] | None:
        """An observation as token ids (text encoded once, without special tokens; a message
        {"role", "content"} after `model_turn` wrapped by the chat template, chat.TurnFormat: None when
        the model's turn ended the conversation); a flood past rollout.max_observation_tokens is a ToolFailure."""
        if observation is None:
            return []
        if is_message(observation):
            if model_turn is None:
                raise ValueError("env.reset returns token ids, text or None; a message follows a model turn")
            if self.turns is None:
                raise self.turns_error or ValueError(
                    "a message observation needs a chat template: set data.chat_template, or use a tokenizer "
                    "that has one")
            content = observation["content"]
            observation = self.turns.observation_ids(
                model_turn, {**observation, "content": content if isinstance(content, str) else ""},
                None if isinstance(content, str) else content)
            if observation is None:
                return None
        elif isinstance(observation, str):
            if self.tokenizer is None:
                raise ToolFailure("raised", "a text observation needs a tokenizer")
            observation = self.tokenizer.encode(observation, add_special_tokens=False)
        ids = [int(t) for t in observation]
        if len(ids) > self.settings.max_observation_tokens:
            raise ToolFailure("flood", f"observation of {len(ids)} tokens > rollout.max_observation_tokens = "
                                       f"{self.settings.max_observation_tokens}")
        return ids


def _call(method, *args) -> Awaitable:
    """An environment method's coroutine; a plain (blocking) method runs in a thread of its own (not a
    pool's: a hung call would hold a worker the others wait for), so that it holds up no other
    conversation and its timeout still ends its own."""
    return method(*args) if inspect.iscoroutinefunction(method) else _in_thread(method, *args)


async def _in_thread(fn, *args):
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error):
        if not future.done():  # not cancelled by its timeout meanwhile
            future.set_exception(error) if error is not None else future.set_result(result)

    def run():
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting conversation
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the pool's loop is closed: nobody waits any more
            pass

    threading.Thread(target=run, name="env-call", daemon=True).start()
    return await future


async def env_conversation(ctx: TurnContext, conv: Conversation) -> None:
    """The default conversation: reset, then model turn / environment step until done."""
    s = ctx.settings
    env = ctx.make_env()
    stop = tuple(getattr(env, "stop_token_ids", ()) or ())
    try:
        first = await ctx.tool(conv, _call(env.reset, SampleInfo(conv.prompt_index, tuple(conv.prompt), conv.seed,
                                                                ctx.tokenizer)), "env.reset")
        first = ctx.observation_ids(first)
        if conv.room(s.budget) - len(first) < 1:  # no room left for a model turn
            return
        conv.add_observation(first)
        for turn in range(s.max_turns):
            model_turn = await ctx.generate(conv, stop_token_ids=stop)
            if not model_turn:
                break
            result = await ctx.tool(conv, _call(env.step, list(model_turn)), "env.step")
            result = result if isinstance(result, StepResult) else StepResult(*result)
            if result.reward is not None:
                conv.reward = float(result.reward)
            if result.done or turn == s.max_turns - 1:
                break
            conv.tool_calls += 1
            ids = ctx.observation_ids(result.observation, model_turn)
            if ids is None:  # the model closed the conversation with another message's marker (chat.TurnFormat)
                break
            if conv.room(s.budget) - len(ids) < 1:  # no room left for the model to answer it
                conv.finish_reason = "length"
                break
            conv.add_observation(ids)
    finally:
        close = getattr(env, "close", None)
        if close is not None:
            try:
                await asyncio.wait_for(close(), s.tool_timeout_s)
            except Exception:  # noqa: BLE001 - a failing close loses nothing of the conversation
                pass


async def _run(fn, ctx: TurnContext, conv: Conversation) -> None:
    try:
        await fn(ctx, conv)
    except ToolFailure as e:
        conv.failure, conv.reward = e.kind, ctx.settings.failure_reward
    finally:
        conv.finished = True


class ConversationPool:
    """Conversation coroutines on an event loop of their own thread, driven round by round from the
    caller's: `next_round()` waits until every live conversation waits for the engine and returns
    their requests; `resolve()` hands the engine's answers back."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.cond = threading.Condition()
        self.live, self.waiting, self.error, self.closed = 0, [], None, False
        self.thread = threading.Thread(target=self.loop.run_forever, name="conversations", daemon=True)
        self.thread.start()

    # ---- the loop's side ----------------------------------------------------------------------------
    async def submit(self, conv: Conversation, request: Request) -> tuple[Completion, int]:
        future = self.loop.create_future()
        with self.cond:
            self.waiting.append(_Pending(conv, request, future))
            self.cond.notify_all()
        return await future

    def _done(self, task: asyncio.Task) -> None:
        with self.cond:
            self.live -= 1
            if not task.cancelled() and task.exception() is not None and self.error is None:
                self.error = task.exception()
            self.cond.notify_all()

    # ---- the caller's side --------------------------------------------------------------------------
    def start(self, fn, ctx: TurnContext, convs: list[Conversation]) -> None:
        with self.cond:
            self.live += len(convs)

        def create():
            for c in convs:
                self.loop.create_task(_run(fn, ctx, c)).add_done_callback(self._done)

        self.loop.call_soon_threadsafe(create)

    def next_round(self) -> list[_Pending]:
        """The requests of every live conversation, once all of them wait for the engine ([]: none live)."""
        with self.cond:
            while self.error is None and not self.closed and len(self.waiting) < self.live:
                self.cond.wait(timeout=1.0)
            if self.error is not None:
                raise self.error
            out, self.waiting = ([], []) if self.closed else (self.waiting, [])
            return out

    def requeue(self, pending: list[_Pending]) -> None:
        """Requests taken by next_round but not sent: the next round's."""
        with self.cond:
            self.waiting = pending + self.waiting

    def resolve(self, pending: list[_Pending], pieces: list[Completion], version: int) -> None:
        def hand_back():
            for p, piece in zip(pending, pieces, strict=True):
                p.future.set_result((piece, version))

        self.loop.call_soon_threadsafe(hand_back)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

        def cancel_all():
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.stop()

        self.loop.call_soon_threadsafe(cancel_all)
        self.thread.join(timeout=10)


def load_object(spec: str, key: str):
    """`package.module:name` -> the object (a clear ValueError naming `key` otherwise)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{key}: {spec!r} must be package.module:name")
    try:
        obj = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - whatever the import raised, in one line
        raise ValueError(f"{key}: cannot import {module!r} ({type(e).__name__}: {e})") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: {module!r} has no {name!r}")
        obj = getattr(obj, part)
    return obj


def conversation_fn(cfg) -> Callable:
    """rollout.generate_fn, or the environment loop."""
    return load_object(cfg.rollout.generate_fn, "rollout.generate_fn") if cfg.rollout.generate_fn else env_conversation


def env_factory(cfg) -> Callable[[], Any] | None:
    if not cfg.rollout.env:
        return None
    cls, kwargs = load_object(cfg.rollout.env, "rollout.env"), dict(cfg.rollout.env_args)
    return lambda: cls(**kwargs)


def is_multiturn(cfg) -> bool:
    return bool(cfg.rollout.env or cfg.rollout.generate_fn)


def new_conversations(source, idx: list[int], params: SamplingParams) -> list[Conversation]:
    """One conversation per entry of idx (prompt indices in runs of params.n), seeded as flatten() seeds;
    a run is a group (Request.group)."""
    groups = [new_group() for _ in range(0, len(idx), params.n)]
    return [Conversation(i, list(source.prompts[i]), None if params.seed is None else params.seed + k,
                         groups[k // params.n]) for k, i in enumerate(idx)]


def run(engine, fn, ctx_args: dict, convs: list[Conversation], version: int = 0) -> dict:
    """Every conversation to its end on `engine` (its generate_requests), round by round; returns
    the time spent generating and waiting for the conversations (their tools)."""
    pool = ConversationPool()
    times = {"generate": 0.0, "tools": 0.0}
    try:
        pool.start(fn, TurnContext(pool, **ctx_args), convs)
        while True:
            t = time.perf_counter()
            pending = pool.next_round()
            times["tools"] += time.perf_counter() - t
            if not pending:
                return times
            t = time.perf_counter()
            pieces = engine.generate_requests([p.request for p in pending])
            times["generate"] += time.perf_counter() - t
            pool.resolve(pending, pieces, version)
    finally:
        pool.close()


def conversation_metrics(convs: list[Conversation], times: dict | None = None) -> dict:
    n = max(len(convs), 1)
    out = {"multiturn/turns_mean": sum(c.turns for c in convs) / n,
           "multiturn/tool_calls_mean": sum(c.tool_calls for c in convs) / n,
           "multiturn/observation_tokens_mean": sum(c.observation_tokens for c in convs) / n,
           "multiturn/tool_seconds_mean": sum(c.tool_seconds for c in convs) / n,
           "multiturn/tool_failures": float(sum(c.failure is not None for c in convs))}
    out.update({f"multiturn/tool_failures_{k}": float(sum(c.failure == k for c in convs)) for k in FAILURES})
    reported = [c for c in convs if c.cached_tokens is not None]
    if reported:  # SGLang's meta_info cached_tokens, vLLM's num_cached_tokens
        out["multiturn/prefix_cache_hit_rate"] = (sum(c.cached_tokens for c in reported)
                                                  / max(1, sum(c.prompt_tokens_sent for c in reported)))
    if times:
        out.update({"timing/rollout_generate": times["generate"], "timing/rollout_tools": times["tools"]})
    return out


def scores(source, convs: list[Conversation]) -> list[float]:
    """The environment's reward, else the data's rule score of the last model turn."""
    out = []
    for c in convs:
        if c.reward is not None:
            out.append(c.reward)
            continue
        last, k = [], len(c.tokens)
        while k > 0 and not c.loss_mask[k - 1]:
            k -= 1
        while k > 0 and c.loss_mask[k - 1]:
            last.insert(0, c.tokens[k - 1])
            k -= 1
        out.append(float(source.rewards([c.prompt_index], [last])[0]))
    return out


class MultiTurnRounds:
    """mcore_rl.loop.sampling's generate(prompts, seed) for conversations; metrics() drains what the rounds logged."""

    def __init__(self, cfg, engine, source, experts=None):
        from mcore_rl.loop import step_batch

        self.cfg, self.engine, self.source, self.experts = cfg, engine, source, experts
        self.fn, self.make_env = conversation_fn(cfg), env_factory(cfg)
        self.step_batch, self.convs, self.times = step_batch, [], {"generate": 0.0, "tools": 0.0}

    def ctx_args(self, params: SamplingParams) -> dict:
        return dict(params=params.with_(n=1), settings=MultiTurnSettings.of(self.cfg),
                    tokenizer=self.source.tokenizer, make_env=self.make_env)

    def __call__(self, prompts: list[int], seed: int):
        import torch

        params = self.step_batch.sampling_params(self.cfg, self.source, seed)
        idx = [i for i in prompts for _ in range(params.n)]
        convs = new_conversations(self.source, idx, params)
        times = run(self.engine, self.fn, self.ctx_args(params), convs)
        self.convs += convs
        for k in times:
            self.times[k] += times[k]
        batch = self.step_batch.completions_batch(self.source, idx, [c.completion() for c in convs], self.experts,
                                           getattr(self.engine, "label", "the rollout engine"))
        return self.step_batch.scored(self.cfg, self.source, idx, batch, torch.tensor(scores(self.source, convs)))

    def metrics(self) -> dict:
        out = conversation_metrics(self.convs, self.times)
        self.convs, self.times = [], {"generate": 0.0, "tools": 0.0}
        return out


def conversations_batch(source, idx: list[int], convs: list[Conversation], experts=None,
                        engine_label: str = "the rollout engine") -> dict:
    """step_batch.completions_batch of the conversations, plus token_versions [B, R]."""
    import torch

    from mcore_rl.loop import step_batch

    batch = step_batch.completions_batch(source, idx, [c.completion() for c in convs], experts, engine_label)
    versions = torch.zeros(batch["response_mask"].shape, dtype=torch.long)
    for row, c in enumerate(convs):
        versions[row, :len(c.versions)] = torch.as_tensor(c.versions, dtype=torch.long)
    batch["token_versions"] = versions
    return batch


def validation_scores(cfg, engine, source, idx: list[int], params: SamplingParams):
    """One score per entry of idx: conversations when multi-turn is configured, else single responses."""
    import torch

    from mcore_rl.loop import step_batch

    if not is_multiturn(cfg):
        return step_batch.scores(source, idx, step_batch.rollout(engine, source, idx, params))
    convs = new_conversations(source, idx, params)
    run(engine, conversation_fn(cfg), dict(params=params.with_(n=1), settings=MultiTurnSettings.of(cfg),
                                           tokenizer=source.tokenizer, make_env=env_factory(cfg)), convs)
    return torch.tensor(scores(source, convs), dtype=torch.float32)


class ConversationWorker(RolloutWorker):
    """fully_async's rollout worker (mcore_rl.rollout.buffer) with conversations for responses: a
    round sends the engine the next request of every conversation waiting for it (at most max_live,
    oldest step first) once the others' tools have answered; a sync lands between two rounds, so a
    turn cut by partial rollout (its `segment`) goes on under the new weights. Tools keep running
    while a sync holds the engines."""

    caps_whole_responses = True  # a round's requests are turns: a conversation's next one must not wait a wave

    def __init__(self, engine, prompt_tokens, prompts, params: SamplingParams, settings: MultiTurnSettings, fn,
                 tokenizer, make_env, may_start, version: int, engine_clock, wait_clock, max_live: int | None = None):
        self.pool = ConversationPool()
        self.ctx = TurnContext(self.pool, params.with_(n=1), settings, tokenizer, make_env)
        self.fn, self.key_of = fn, {}
        super().__init__(engine, prompt_tokens, prompts, params, settings.budget, settings.segment, may_start, version,
                         engine_clock, wait_clock, max_live)

    def _start(self, key: tuple, i: int) -> None:
        group = new_group()
        convs = [Conversation(i, list(self.prompt_tokens(i)), seed, group) for seed in self._group_seeds()]
        self.key_of.update((id(c), key) for c in convs)
        self.in_flight[key] = convs
        self.pool.start(self.fn, self.ctx, convs)

    def _round(self, version: int) -> bool:
        pending = self.pool.next_round()  # every live conversation waits for the engine, or has ended
        with self.cond:
            for c in (c for g in self.in_flight.values() for c in g if c.finished):
                self.key_of.pop(id(c), None)
            self._move_finished()
        if not pending:
            return False
        pending.sort(key=lambda p: self.key_of[id(p.conv)])
        send = pending[:self.max_live] if self.max_live else pending
        self.pool.requeue(pending[len(send):])
        self.pool.resolve(send, self._generate([p.request for p in send]), version)
        return True

    def stop(self) -> None:
        super().stop()
        self.pool.close()
