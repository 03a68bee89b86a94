"""Where each step's batch comes from: one protocol, four sources.

    SyncSource    trainer.mode=sync: generated when the step asks for it (loop.sampling)
    OneStepOff    trainer.mode=one_step_off: generated one step ahead (loop.async_sources)
    FullyAsync    trainer.mode=fully_async: groups from a rollout worker's buffer (loop.async_sources)
    ReplaySource  --replay DIR: the rollout dumped for each step, no engine (loop.rollout_dump)

Each step's prompts follow from its number (`step_prompts`), in every mode, so a resumed run
trains the prompts it would have trained.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from mcore_rl.config import sections as C
from mcore_rl.loop.async_sources import FullyAsync, OneStepOff
from mcore_rl.loop.rollout_dump import ReplaySource
from mcore_rl.loop.sampling import sample_step_batch
from mcore_rl.loop.step_batch import StepBatch, step_seed


class BatchSource(Protocol):
    # the weight sync after step k's update (None: no engine to sync); an async source's waits for
    # its engines to be between batches
    sync: Callable[..., dict] | None
    # what validation generates on (None: no engine)
    validation_engine: object

    def next_batch(self, step: int) -> StepBatch: ...

    def shutdown(self) -> None: ...


class SyncSource:
    """trainer.mode=sync: the step's batch generated (several rounds with dynamic sampling) when the
    step asks for it, on the engine the loop then hands the updated weights to."""

    def __init__(self, cfg: C.Config, engine, sync, source, prompts_of: Callable[[int], list[int]]):
        self.cfg, self.engine, self.sync, self.source, self.prompts_of = cfg, engine, sync, source, prompts_of
        self.validation_engine = engine

    def next_batch(self, step: int) -> StepBatch:
        return sample_step_batch(self.cfg, self.engine, self.source, self.prompts_of(step),
                                 step_seed(self.cfg.trainer.seed, step))

    def shutdown(self) -> None:
        pass  # the engine is the run's: it shuts it down


def batch_source(cfg: C.Config, engine, sync, train_task, replay: str | None, model: dict | None,
                 start: int) -> BatchSource:
    """The source trainer.mode (or --replay DIR) asks for; `engine` and its weight `sync` as started."""
    if replay:
        return ReplaySource(replay, model)
    prompts_of = lambda step: step_prompts(cfg, train_task, step)  # noqa: E731
    if cfg.trainer.mode == "sync":
        return SyncSource(cfg, engine, sync, train_task, prompts_of)
    if cfg.trainer.mode == "fully_async":
        return FullyAsync(cfg, engine, sync, train_task, prompts_of, start)
    return OneStepOff(engine, sync, lambda prompts, seed: sample_step_batch(cfg, engine, train_task, prompts, seed),
                      prompts_of, total_steps(cfg, train_task), start_version=start, seed=cfg.trainer.seed)


def total_steps(cfg: C.Config, train_task, replay: ReplaySource | None = None) -> int:
    """trainer.total_training_steps, or its epochs' steps; a replay's: up to its last dump."""
    t = cfg.trainer
    if t.total_training_steps:
        return t.total_training_steps
    return t.total_epochs * (len(train_task.prompts) // cfg.data.train_batch_size) if train_task else max(replay.steps)


def step_prompts(cfg: C.Config, train_task, step: int) -> list[int]:
    """Step `step`'s prompt indices: a seeded shuffle per epoch, data.train_batch_size at a time."""
    B = cfg.data.train_batch_size
    per_epoch = len(train_task.prompts) // B
    order = torch.randperm(len(train_task.prompts),
                           generator=torch.Generator().manual_seed(cfg.trainer.seed + (step - 1) // per_epoch))
    k = (step - 1) % per_epoch
    return order[k * B:(k + 1) * B].tolist()
