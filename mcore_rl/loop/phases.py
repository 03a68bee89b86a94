"""Who holds the GPUs in each phase of a step: with an engine of its own weights, colocated, the
Colocation choreography (mcore_rl.memory.colocate) around each update; otherwise just the sync
after it. Each phase's memory peaks are measured (mcore_rl.memory.monitor)."""

from __future__ import annotations

from mcore_rl.config import sections as C
from mcore_rl.loop.groups import ActorGroup
from mcore_rl.memory.colocate import Colocation
from mcore_rl.memory.monitor import PhaseMonitor, local_pids
from mcore_rl.memory.planner import LARGEST_MICRO


class Phases:
    """to_train before the log-probs; after the update, to_rollout in two halves with the save
    between them: `offload` (colocated: the trainer's states to the host, around the sync) and
    `resume` (the sync, when not colocated; colocated, the engine's KV cache back)."""

    def __init__(self, cfg: C.Config, group: ActorGroup, engine, sync, plan=None):
        self.sync, self.colo, self.plan = sync, None, plan
        # per-phase peaks: this node's GPUs (NVML), host RSS of this node's trainer and engine
        # actors and their children (checkpoint writers); the embedded engine is the trainer itself
        engines = engine.actors if isinstance(getattr(engine, "actors", None), list) else []
        # on GPUs, every 50 ms and PSS too (forked checkpoint writers share their parent's pages,
        # which RSS counts twice); CPU runs, whose 2 cores the engines need, are sampled lightly
        gpu = cfg.cluster.device == "gpu"
        # and, on GPUs, each phase's peak split into the trainer's and the engines' processes
        roles = {**dict.fromkeys(local_pids(group.actors), "trainer"), **dict.fromkeys(local_pids(engines), "engine")}
        self.mon = PhaseMonitor(roles, interval_s=0.05 if gpu else 0.5, pss=gpu, roles=roles if gpu else None)
        self.mon.enter("rollout")
        if engine is not None and engine.owns_weights and cfg.cluster.colocate:
            trainer = _Trainer(group)
            # with a plan, each resume is checked against the least free memory of the trainer's GPUs
            guard = dict(free_bytes=lambda: min(group.call("gpu_free_bytes")),
                         resume_needs=plan.resume_needs()) if plan is not None else {}
            self.colo = Colocation(engine, trainer, sync, offload_train_states=cfg.memory.offload_train_states,
                                   **guard)

    def to_train(self) -> None:
        """The train phase starts once the engine has released its memory: readings during the
        release are the rollout's level, which an H200's larger engine put above the train phase's."""
        if self.colo is None:
            self.mon.enter("train")
        else:
            self.colo.to_train(after_release=lambda: self.mon.enter("train"))

    def offload(self, step: int) -> dict:
        """to_rollout's first half. Colocated: the trainer's states to the host and, between, the
        engine's weights back and synced (from the trainer's weights on the GPU), so that a save
        after this writes every state from its host copy. Otherwise nothing moves."""
        if self.colo is None:
            return {}
        # the offload of the states counts to the train phase, the sync to its own
        return self.colo.offload(before_sync=lambda: self.mon.enter("sync"), step=step) or {}

    def resume(self, step: int) -> dict:
        """to_rollout's second half: the engine gets the GPUs (colocated: its KV cache back) and,
        when not colocated, the new weights."""
        if self.colo is None:
            self.mon.enter("sync")
            out = self.sync(step) if self.sync is not None else {}
        else:
            self.colo.resume()
            out = {f"timing/{k}": v[-1] for k, v in self.colo.timings.items() if k != "sync"}
            probe = getattr(self.sync, "probe_if_due", None)  # with its KV cache back, the engine can score it
            if probe is not None:
                out.update(probe())
            # the most any one GPU's trainer moved to the host in each offload (its GB/s: over timing/<same>)
            out.update({f"memory/moved_gib_{k}": max(v) / 2**30 for k, v in self.colo.moved.items() if v})
        self.mon.enter("rollout")
        return out

    def planned(self, metrics: dict) -> dict:
        """The train phase's plan for the step just run (GiB): the plan's own model at the largest
        micro-batch the update ran (Plan.train_at); the start-up plan/gpu_gib_train, every
        micro-batch full, stays the bound the plan was checked against."""
        tokens, rows = (metrics.get(k) for k in LARGEST_MICRO[:2])
        if self.plan is None or not tokens:
            return {}
        return {"plan/gpu_gib_step_train": self.plan.train_at(int(tokens), int(rows)) / 2**30}


class _Trainer:
    def __init__(self, group):
        self.group = group

    def offload(self, weights: bool = True):
        return self.group.call("offload_states", weights)

    def onload(self):
        self.group.call("onload_states")

    def drop_grads(self):
        self.group.call("drop_grads")

    def restore_grads(self):
        self.group.call("restore_grads")
