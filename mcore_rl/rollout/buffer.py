"""trainer.mode=fully_async's rollout side: a worker thread that keeps the engines generating, and
the buffer of finished groups the trainer takes its batches from.

Partial rollout: with `segment` > 0 a response is generated `segment` tokens at a time, and an
unfinished one is resubmitted with its tokens so far; a weight sync (`paused()`) lands between
two pieces, so the rest of the response comes from the new weights. Each token keeps, beside its
log-prob, the version of the weights that sampled it. The engines' own KV cache is flushed by the
sync, so a resubmitted prefix is prefilled again with the weights that continue it.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

from mcore_rl.rollout.base import Completion, Request, SamplingParams, new_group

PIECE_SEED_STRIDE = 1_000_003  # a resubmitted piece samples with seed + stride * tokens so far


@dataclass
class Sample:
    """One response in the making."""

    prompt_index: int
    prompt: list[int]
    seed: int | None
    group: int | None = None  # Request.group of its pieces: one for a prompt's samples (base.new_group)
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per token: the weights' version that sampled it
    finish_reason: str = "length"
    routed_experts: object = None  # the last piece's: its prefill routes the whole prefix again
    finished: bool = False

    def request(self, params: SamplingParams, max_len: int, segment: int) -> Request:
        left = max_len - len(self.tokens)
        seed = None if self.seed is None else self.seed + PIECE_SEED_STRIDE * len(self.tokens)
        return Request(tuple(self.prompt + self.tokens),
                       params.with_(n=1, max_new_tokens=min(segment, left) if segment else left, seed=seed), self.group)

    def extend(self, piece: Completion, version: int, max_len: int) -> None:
        self.tokens += piece.token_ids
        self.log_probs += piece.log_probs
        self.versions += [version] * len(piece.token_ids)
        self.routed_experts = piece.routed_experts
        self.finish_reason = piece.finish_reason
        self.finished = piece.finish_reason == "stop" or len(self.tokens) >= max_len

    def completion(self) -> Completion:
        return Completion(list(self.tokens), list(self.log_probs), self.finish_reason, self.routed_experts)


class RolloutWorker:
    """Generates groups of `params.n` responses, each under a key (a step's and its place in the
    step's prompts): first the (key, prompt index) pairs `request`ed, then those of `prompts`, each
    as soon as `may_start(key, version)` allows it with the weights the engines hold (the caller's
    staleness rule); `take` hands the finished groups of given keys over.
    A round of pieces holds at most `max_live` responses (the engines' decode capacity), oldest step
    first: past it, the engines would run the round in two waves and a long response's next piece
    would wait for the second one, the next step's fresh responses.
    `engine.generate_requests` runs on the worker's thread only; `engine_clock` and `wait_clock`
    (BusyClocks) time the engines' generation and the trainer's waits.
    A failure on the worker's thread is raised on the trainer's by its next `take` or `paused`."""

    caps_whole_responses = False

    def __init__(self, engine, prompt_tokens, prompts: Iterator[tuple[tuple, int]], params: SamplingParams,
                 max_len: int, segment: int, may_start: Callable[[tuple, int], bool], version: int, engine_clock,
                 wait_clock, max_live: int | None = None):
        self.engine, self.prompt_tokens, self.prompts = engine, prompt_tokens, prompts
        self.params, self.max_len, self.segment, self.may_start = params, max_len, segment, may_start
        # whole responses: SGLang's own batching fills the engines
        self.max_live = max_live if segment or self.caps_whole_responses else None
        self.next_prompt: tuple[tuple, int] | None = None  # drawn from `prompts`, waiting for may_start
        self.version = version  # of the weights the engines hold; changed only while paused
        self.engine_clock, self.wait_clock = engine_clock, wait_clock
        self.requested: collections.deque[tuple[tuple, int]] = collections.deque()
        self.in_flight: dict[tuple, list[Sample]] = {}
        self.ready: dict[tuple, list[Sample]] = {}
        self.groups_started = 0
        self.cond = threading.Condition()
        # idle: the worker waits between two pieces, no generation running (a pause holds it there)
        self.pause_requests, self.idle, self.stopped, self.error = 0, False, False, None
        self.thread = threading.Thread(target=self._run, name="rollout-worker", daemon=True)
        self.thread.start()

    # ---- the worker's thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    while self.pause_requests and not self.stopped:  # between two pieces: a sync may run
                        self.idle = True
                        self.cond.notify_all()
                        self.cond.wait()
                    self.idle = False
                    if self.stopped:
                        return
                    self._fill()
                    version = self.version
                if not self._round(version):  # nothing may start yet: wait for a sync or the trainer's next request
                    with self.cond:
                        self.cond.wait(timeout=0.5)
        except BaseException as e:  # noqa: BLE001 - handed to the trainer's thread, raised there
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _round(self, version: int) -> bool:
        """One piece of every live response (at most max_live), oldest step first; False: none live."""
        with self.cond:
            live = [s for _, g in sorted(self.in_flight.items(), key=lambda kg: kg[0])
                    for s in g if not s.finished][:self.max_live]
        if not live:
            return False
        pieces = self._generate([s.request(self.params, self.max_len, self.segment) for s in live])
        with self.cond:
            for s, piece in zip(live, pieces):
                s.extend(piece, version, self.max_len)
            self._move_finished()
        return True

    def _generate(self, requests: list[Request]) -> list[Completion]:
        self.engine_clock.start()
        try:
            return self.engine.generate_requests(requests)
        finally:
            self.engine_clock.stop()

    def _move_finished(self) -> None:
        """Groups whose every response is finished go to the buffer (under self.cond)."""
        done = [k for k, g in self.in_flight.items() if all(s.finished for s in g)]
        self.ready.update((k, self.in_flight.pop(k)) for k in done)
        self.cond.notify_all()

    def _fill(self) -> None:
        # requested groups start at once: the trainer waits for them, whatever the buffer holds
        while self.requested:
            self._start(*self.requested.popleft())
        while True:
            self.next_prompt = self.next_prompt or next(self.prompts)
            if not self.may_start(self.next_prompt[0], self.version):
                return
            self._start(*self.next_prompt)
            self.next_prompt = None

    def _start(self, key: tuple, i: int) -> None:
        group = new_group()
        self.in_flight[key] = [Sample(i, list(self.prompt_tokens(i)), seed, group) for seed in self._group_seeds()]

    def _group_seeds(self) -> list[int | None]:
        """The seeds of the next group's responses (one per params.n)."""
        n, seed = self.params.n, self.params.seed
        base = None if seed is None else seed + self.groups_started * n
        self.groups_started += 1
        return [None if base is None else base + j for j in range(n)]

    # ---- the trainer's thread -------------------------------------------------------------------
    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error
        if not self.thread.is_alive() and not self.stopped:
            raise RuntimeError("the rollout worker stopped")

    def take(self, keys: list[tuple]) -> list[list[Sample]]:
        """The finished groups of `keys` (in their order), waiting for them."""
        self.wait_clock.start()
        try:
            with self.cond:
                while not all(k in self.ready for k in keys):
                    self.raise_if_failed()
                    self.cond.wait(timeout=1.0)
                out = [self.ready.pop(k) for k in keys]
                self.cond.notify_all()
                return out
        finally:
            self.wait_clock.stop()

    def request(self, groups: list[tuple[tuple, int]]) -> None:
        """Generate these (key, prompt index) groups next: a refill, or a group gone stale in the buffer."""
        with self.cond:
            self.requested.extend(groups)
            self.cond.notify_all()

    @contextlib.contextmanager
    def paused(self):
        """The engines between two pieces, with no generation running, until the block ends."""
        self.wait_clock.start()
        try:
            with self.cond:
                self.pause_requests += 1
                self.cond.notify_all()
                while not self.idle:
                    self.raise_if_failed()
                    self.cond.wait(timeout=1.0)
        finally:
            self.wait_clock.stop()
        try:
            yield
        finally:
            with self.cond:
                self.pause_requests -= 1
                self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
