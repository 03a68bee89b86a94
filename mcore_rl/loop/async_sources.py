"""The async batch sources: generation overlaps training (engines on resources of their own).

`OneStepOff` (trainer.mode=one_step_off), below; `FullyAsync` (fully_async): a rollout worker
(mcore_rl.rollout.buffer) keeps the engines busy, the trainer takes each step's finished groups, weights
are synced every trainer.sync_every updates between two pieces of a partial rollout, and groups
past trainer.max_staleness are regenerated (or left out: trainer.stale_groups).

one_step_off, generation one policy version behind:

The engines sit on resources of their own (cluster.colocate: false). Step k's batch is handed
over and step k+1's generation starts on a rollout thread at once, with the weights the engines
hold (step k-1's), while the trainer trains on step k's batch; the weight sync after step k waits
for that generation to end, so the engines switch weights only between batches:

    engine:  [gen 1 (v0)]  [gen 2 (v0) ......]  [gen 3 (v1) ......]  [gen 4 (v2) ...
    trainer:              [train 1 -> v1] sync  [train 2 -> v2] sync  [train 3 -> v3] sync

so every step after the first trains on samples one version old (step 1, and the first step after
a resume, on fresh ones). Every response token records the version of the weights that sampled it
(batch["token_versions"]); staleness is per sample, counted from its oldest token.

Both are batch sources (mcore_rl.loop.sources): `next_batch(step)` gives the loop a step's
StepBatch, and they wrap the weight sync (`sync`); nothing else of the loop changes. A killed run resumes from its checkpoint and
regenerates what was in flight: each step's prompts follow from its number, in both modes (a
fully_async step waits for its own prompts' groups), so none is lost or trained twice.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from mcore_rl.config import sections as C
from mcore_rl.config import checks as config_checks
from mcore_rl.loop import step_batch
from mcore_rl.loop.sampling import expert_layout, refill_order, round_size, sample_step_batch
from mcore_rl.loop.step_batch import StepBatch, step_seed
from mcore_rl.rollout import multiturn
from mcore_rl.rollout.buffer import RolloutWorker


def staleness_metrics(token_versions: torch.Tensor, response_mask: torch.Tensor, trainer_version: int) -> dict:
    """async/* of one batch: per sample, staleness = trainer_version - the version of its oldest
    token; a sample is partial when its tokens come from more than one version."""
    mask = response_mask.bool()
    big = torch.iinfo(token_versions.dtype).max
    oldest = torch.where(mask, token_versions, big).min(1).values
    newest = torch.where(mask, token_versions, -1).max(1).values
    has = mask.any(1)
    stale = (trainer_version - oldest[has]).float()
    if stale.numel() == 0:
        return {}
    return {"async/staleness_mean": stale.mean().item(), "async/staleness_max": stale.max().item(),
            "async/partial_fraction": (newest[has] > oldest[has]).float().mean().item()}


class BusyClock:
    """When a resource was busy, to report the idle share of a window."""

    def __init__(self):
        self.spans: list[tuple[float, float | None]] = []  # (start, end or None while busy)
        self.lock = threading.Lock()

    def start(self) -> None:
        with self.lock:
            self.spans.append((time.monotonic(), None))

    def stop(self) -> None:
        with self.lock:
            self.spans[-1] = (self.spans[-1][0], time.monotonic())

    def busy_in(self, t0: float, t1: float) -> float:
        with self.lock:
            spans = list(self.spans)
            self.spans = [s for s in spans if s[1] is None or s[1] > t1]  # older spans are counted
        return sum(max(0.0, min(end if end is not None else t1, t1) - max(start, t0)) for start, end in spans)


class StepClocks:
    """The engines' generation and the trainer's waits, reported per step over the time since the
    step before handed over its batch."""

    def __init__(self):
        self.engine, self.trainer_waits = BusyClock(), BusyClock()
        self.window_start = time.monotonic()

    def step_metrics(self, batch: dict, step: int) -> dict:
        t0, t1 = self.window_start, time.monotonic()
        window = max(t1 - t0, 1e-9)
        self.window_start = t1
        # step k trains weights with k - 1 updates in them
        out = staleness_metrics(batch["token_versions"], batch["response_mask"], trainer_version=step - 1)
        out.update({"async/engine_idle_fraction": 1 - self.engine.busy_in(t0, t1) / window,
                    "async/trainer_idle_fraction": self.trainer_waits.busy_in(t0, t1) / window,
                    "perf/samples_per_s": len(batch["response_mask"]) / window})
        return out


class OneStepOff:
    """The rollout of the next step generated ahead, on one thread driving the engines.

    sample(prompts, seed) -> StepBatch generates a step's batch (loop.sampling.sample_step_batch);
    prompts_of(step) gives a step's prompt indices."""

    def __init__(self, engine, sync: Callable[[int], dict], sample: Callable, prompts_of: Callable[[int], list[int]],
                 last_step: int, start_version: int, seed: int):
        self.engine, self._sync, self.sample, self.prompts_of = engine, sync, sample, prompts_of
        self.last_step, self.seed = last_step, seed
        self.version = start_version  # the weights the engines hold: the number of updates they include
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollout")
        self.pending: dict[int, Future] = {}
        self.clocks = StepClocks()

    # ---- the rollout side -------------------------------------------------------------------------
    def _launch(self, step: int) -> None:
        version = self.version

        def generate():
            self.clocks.engine.start()
            t = time.perf_counter()
            try:
                out = self.sample(self.prompts_of(step), step_seed(self.seed, step))
            finally:
                self.clocks.engine.stop()
            out.batch["token_versions"] = torch.full(out.sampled_mask.shape, version, dtype=torch.long)
            out.metrics["timing/generate"] = time.perf_counter() - t
            return out

        self.pending[step] = self.pool.submit(generate)

    def _wait(self, future: Future):
        self.clocks.trainer_waits.start()
        try:
            return future.result()
        finally:
            self.clocks.trainer_waits.stop()

    def _wait_idle(self) -> None:
        """Until the generation in flight has ended (its batch stays pending for its step)."""
        for future in list(self.pending.values()):
            if not future.done():
                self._wait(future)

    # ---- what the loop calls ----------------------------------------------------------------------
    @property
    def validation_engine(self):
        return self  # generate and generate_requests below wait for the engines to be between batches

    def next_batch(self, step: int) -> StepBatch:
        """Step `step`'s scored batch (generated ahead, or now for the first step of a run); starts
        the next step's generation before returning it."""
        if step not in self.pending:
            self._launch(step)
        out = self._wait(self.pending.pop(step))
        if step + 1 <= self.last_step:
            self._launch(step + 1)
        out.metrics.update(self.clocks.step_metrics(out.batch, step))
        return out

    def sync(self, step: int, verify: bool | None = None) -> dict:
        """The weight sync after step `step`'s update, once the engines are between batches."""
        self._wait_idle()
        out = self._sync(step, verify)
        self.version = step
        return out

    def generate(self, prompts, params):
        """Validation: on the engines once they are between batches."""
        self._wait_idle()
        return self.engine.generate(prompts, params)

    def generate_requests(self, requests):
        """A round of multi-turn validation, once the engines are between batches."""
        self._wait_idle()
        return self.engine.generate_requests(requests)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def samples_batch(source, samples: list, experts=None, engine_label: str = "the rollout engine") -> dict:
    """The batch of finished rollout.buffer Samples, as step_batch.rollout makes it, plus token_versions
    [B, R] (0 past each response) aligned with the response tokens, mask and log-probs."""
    batch = step_batch.completions_batch(source, [s.prompt_index for s in samples], [s.completion() for s in samples],
                                  experts, engine_label)
    versions = torch.zeros(batch["response_mask"].shape, dtype=torch.long)
    for row, s in enumerate(samples):
        versions[row, :len(s.versions)] = torch.as_tensor(s.versions, dtype=torch.long)
    batch["token_versions"] = versions
    return batch


class FullyAsync:
    """trainer.mode=fully_async: a rollout worker (mcore_rl.rollout.buffer) keeps the engines
    generating the groups of the steps ahead; each step takes its own prompts' groups, regenerating
    (or, trainer.stale_groups=drop, leaving out) any with a token more than trainer.max_staleness
    versions older than the trainer's weights. The
    weights go to the engines every trainer.sync_every updates, between two pieces of the responses
    in flight (partial rollout: trainer.partial_rollout_tokens).

    A step trains exactly the prompts it would in sync mode (its groups wait in the buffer until
    it comes), so a resumed run, whose buffer starts empty at the step after its checkpoint, trains
    each step's prompts once: what was in flight is regenerated, nothing lost or repeated. Dynamic
    sampling (algorithm.filter_groups) takes its rounds from the buffer too: the first round of each
    step is generated ahead, refill rounds when the step finds too few groups with varied rewards."""

    def __init__(self, cfg: C.Config, engine, sync: Callable, source, prompts_of: Callable[[int], list[int]],
                 start: int):
        t = cfg.trainer
        self.cfg, self.engine, self._sync, self.source = cfg, engine, sync, source
        self.sync_every, self.max_staleness = t.sync_every, t.max_staleness
        self.drop_stale = t.stale_groups == "drop"
        self.experts = expert_layout(cfg)
        self.clocks = StepClocks()
        self.next_step = start + 1  # the step whose groups the next step_batch takes
        filtered = cfg.algorithm.filter_groups.enable

        def step_order(step: int) -> list[int]:  # a step's prompts as its generation rounds take them
            mine = prompts_of(step)
            return refill_order(len(source.prompts), mine, step_seed(t.seed, step)) if filtered else mine

        self.prompts_of, self.step_order = prompts_of, step_order
        self.first_round = round_size(cfg, cfg.data.train_batch_size) if filtered else cfg.data.train_batch_size

        def prompt_stream():  # (key, prompt) of each step's first round, from the step after `start` on
            step = start + 1
            while True:
                yield from (((step, slot), i) for slot, i in enumerate(step_order(step)[:self.first_round]))
                step += 1

        params = step_batch.sampling_params(cfg, source, step_seed(t.seed, start))

        def may_start(key: tuple, version: int) -> bool:
            # step k trains with version k - 1: a group started on `version` is within the bound at
            # its step, so every step up to max_staleness + 1 ahead of the engines' weights generates
            # at once (the next step's groups fill the engines while this one's longest finish)
            return key[0] - 1 - version <= self.max_staleness

        # the engines' decode batch (SGLang's max_running_requests); the CPU engine takes any unless it is set
        per_engine = cfg.rollout.max_running_requests if cfg.cluster.device == "cpu" else config_checks.max_running_requests(cfg)
        capacity = per_engine and per_engine * getattr(engine, "engines", 1)
        self.multiturn = multiturn.is_multiturn(cfg)
        if self.multiturn:  # conversations (rollout.env / generate_fn) instead of single responses
            self.worker = multiturn.ConversationWorker(
                engine, lambda i: source.prompts[i], prompt_stream(), params,
                multiturn.MultiTurnSettings.of(cfg, t.partial_rollout_tokens), multiturn.conversation_fn(cfg),
                source.tokenizer, multiturn.env_factory(cfg), may_start, start, self.clocks.engine,
                self.clocks.trainer_waits, max_live=capacity)
        else:
            self.worker = RolloutWorker(engine, lambda i: source.prompts[i], prompt_stream(), params,
                                        cfg.rollout.max_response_len, t.partial_rollout_tokens, may_start, start,
                                        self.clocks.engine, self.clocks.trainer_waits, max_live=capacity)

    @property
    def validation_engine(self):
        return self  # generate and generate_requests below pause the worker

    def next_batch(self, step: int) -> StepBatch:
        own = self.next_step  # == step in a run (a test may train a step's groups under a later step)
        self.next_step += 1
        slot_of = {i: slot for slot, i in enumerate(self.step_order(own))}
        regenerated = dropped = 0
        taken = []  # the step's conversations, for multiturn/* metrics

        def generate(prompts: list[int], seed: int):  # a round's groups from the buffer (the worker seeds them)
            nonlocal regenerated, dropped
            keys = [(own, slot_of[i]) for i in prompts]
            self.worker.request([(k, i) for k, i in zip(keys, prompts) if k[1] >= self.first_round])  # refills
            groups = dict(zip(keys, self.worker.take(keys)))
            while stale := [k for k, g in groups.items()
                            if step - 1 - min(v for s in g for v in s.versions) > self.max_staleness]:
                if self.drop_stale and len(stale) < len(groups):
                    dropped += len(stale)
                    keys = [k for k in keys if k not in stale]
                    break
                self.worker.request([(k, groups[k][0].prompt_index) for k in stale])
                regenerated += len(stale)
                groups.update(zip(stale, self.worker.take(stale)))
            samples = [s for k in keys for s in groups[k]]
            batch = samples_batch(self.source, samples, self.experts,
                                  getattr(self.engine, "label", "the rollout engine"))
            if not self.multiturn:
                return step_batch.scored(self.cfg, self.source, [s.prompt_index for s in samples], batch)
            taken.extend(samples)
            return step_batch.scored(self.cfg, self.source, [s.prompt_index for s in samples], batch,
                                     torch.tensor(multiturn.scores(self.source, samples)))

        out = sample_step_batch(self.cfg, self.engine, self.source, self.prompts_of(own),
                                step_seed(self.cfg.trainer.seed, own), generate)
        out.metrics.update({"async/regenerated_groups": float(regenerated), "async/dropped_groups": float(dropped),
                            **self.clocks.step_metrics(out.batch, step)})
        if taken:
            out.metrics.update(multiturn.conversation_metrics(taken))
        return out

    def sync(self, step: int, verify: bool | None = None) -> dict:
        """After every sync_every-th update: the weights, between two pieces of the responses in flight."""
        if step % self.sync_every:
            return {}
        with self.worker.paused():
            out = self._sync(step, verify)
            self.worker.version = step
        return out

    def generate(self, prompts, params):
        """Validation, with the worker paused."""
        with self.worker.paused():
            return self.engine.generate(prompts, params)

    def generate_requests(self, requests):
        """A round of multi-turn validation, with the worker paused."""
        with self.worker.paused():
            return self.engine.generate_requests(requests)

    def shutdown(self) -> None:
        self.worker.stop()

