"""The phases of one RL step that the loop (mcore_rl.loop.run) names in order: generate,
log-probs, advantages, update, and validation; each phase's seconds on a `StepClock`."""

from __future__ import annotations

import contextlib
import time

import torch

from mcore_rl.config import sections as C
from mcore_rl.config import checks as config_checks
from mcore_rl.loop import step_batch
from mcore_rl.loop.groups import ActorGroup, SharedBatch
from mcore_rl.loop.rollout_dump import dump_rollout
from mcore_rl.loop.step_batch import StepBatch
from mcore_rl.rollout.multiturn import validation_scores


class StepClock:
    """timing/<phase> of one step, in seconds (a phase timed twice adds up); timing/step from the
    clock's start to `step_metrics`."""

    def __init__(self):
        self.start, self.times = time.perf_counter(), {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing/{phase}"
            self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - t

    def step_metrics(self, sb: StepBatch) -> dict:
        """The step's rewards, response lengths and throughput, once it has trained (the sync after
        is timed on its own)."""
        mask = sb.sampled_mask  # every sampled token
        self.times["timing/step"] = time.perf_counter() - self.start
        return {"reward/mean": sb.score.mean().item(), "response/length": mask.sum(1).mean().item(),
                "perf/tokens_per_s": mask.sum().item() / self.times["timing/step"],
                "perf/rollout_tokens_per_s": mask.sum().item() / self.times["timing/rollout"], **self.times}


def generate(cfg: C.Config, source, step: int) -> StepBatch:
    """The step's scored batch from its source; dumped (trainer.rollout_dump_dir) as it came."""
    sb = source.next_batch(step)
    if cfg.trainer.rollout_dump_dir:
        dump_rollout(cfg.trainer.rollout_dump_dir, step, sb.batch, sb.idx, sb.score, sb.reward,
                     config_checks.hf_model_dims(cfg.model))
    return sb


def log_probs(cfg: C.Config, group: ActorGroup, sb: StepBatch, shared: SharedBatch, clock: StepClock) -> None:
    """The trainer's old log-probs (and the routers' agreement with the engine's), the reference's
    and the critic's values, into the batch."""
    with clock("old_log_prob"):
        sb.batch["old_log_probs"] = torch.cat(group.call_on("log_probs", shared))
    agreement = group.call("route_agreement") if "routes" in sb.batch else []
    if agreement and agreement[0] is not None:  # the trainer's top-k sets vs the engine's, old-log-prob pass
        sb.metrics["rollout/route_agreement"] = agreement[0]
    if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        with clock("ref"):
            sb.batch["ref_log_probs"] = torch.cat(group.call_on("ref_log_probs", shared))
    if cfg.critic.enabled:
        with clock("values"):
            sb.batch["values"] = torch.cat(group.call_on("values", shared))


def advantages(cfg: C.Config, sb: StepBatch, kl_ctrl=None) -> dict:
    """Advantages and returns into the batch, then the rollout correction (which may take rejected
    tokens out of the updates' mask); their metrics."""
    metrics = step_batch.advantages(cfg, sb.batch, sb.reward, sb.idx, kl_ctrl)
    return {**metrics, **step_batch.correct_rollout(cfg, sb.batch)}


def update(cfg: C.Config, group: ActorGroup, shared: SharedBatch, clock: StepClock) -> dict:
    """The critic learns from this batch's returns before the actor moves; their metrics."""
    metrics = {}
    if cfg.critic.enabled:
        with clock("update_critic"):
            metrics.update(_mean(group.call_on("update_critic", shared)))
    with clock("update_actor"):
        metrics.update(_mean(group.call_on("update", shared)))
    return metrics


def _mean(stats: list[dict]) -> dict:
    return {k: sum(s[k] for s in stats) / len(stats) for k in stats[0]}


def validate(cfg: C.Config, engine, source) -> dict:
    """val/reward: the mean score over the validation prompts, rollout.val_n samples each."""
    idx = list(range(len(source.prompts)))
    size = cfg.data.val_batch_size or len(idx)
    n = cfg.rollout.val_n
    scores = []
    for s in range(0, len(idx), size):
        chunk = [i for i in idx[s:s + size] for _ in range(n)]
        params = step_batch.sampling_params(cfg, source, 0, validation=True)
        scores.append(validation_scores(cfg, engine, source, chunk, params))
    return {"val/reward": torch.cat(scores).mean().item()}
