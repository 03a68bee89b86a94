"""A run: start-up, then `_loop`, one RL step per iteration with its phases named in order.

Megatron actors are Ray actors, one per GPU (one gloo process per "GPU" on CPU); the rollout
engine (mcore_rl/rollout/: SGLang, vLLM, or the embedded engine) runs in actors of its own.
Colocated, each step also moves the GPUs between the two: the engine releases its weights and
KV cache, the trainer onloads and trains, offloads, and the engine resumes and is synced.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import torch

from mcore_rl.config import sections as C
from mcore_rl.config import checks as config_checks
from mcore_rl.checkpoint import steps as run_ckpt
from mcore_rl.metrics.console import StartConsole, StepConsole
from mcore_rl.loop.groups import ActorGroup, trainer_placement
from mcore_rl.loop.phases import Phases
from mcore_rl.loop.progress import PROGRESS, stop_on_signals
from mcore_rl.loop.sources import BatchSource, batch_source, total_steps
from mcore_rl.loop.startup import load_checkpoint, memory_plan, prepare_model, start_ray
from mcore_rl.loop.step import StepClock, advantages, generate, log_probs, update, validate
from mcore_rl.loop.step_batch import correction_line, kl_controller, stop_ids
from mcore_rl.metrics.logger import MetricsLogger
from mcore_rl.metrics.plot import plot_run
from mcore_rl.preflight.inputs import check_inputs
from mcore_rl.rollout.launch import Launching
from mcore_rl.checkpoint.steps import Checkpointer
from mcore_rl.preflight.run_dir import RunLock


def train(cfg: C.Config, inputs=None, replay: str | None = None, stop_on_signal: bool = False,
          start_console: StartConsole | None = None) -> dict:
    """The RL loop. inputs: preflight.check_inputs(cfg), where the caller has made it; replay: a
    rollout_dump_dir to train on instead of sampling (no engine, no prompts, no validation);
    stop_on_signal: SIGTERM and SIGINT raise Stopped (the command line's run); start_console: the
    caller's, which showed its checks."""
    start_console = start_console or StartConsole()  # a line per start-up phase, with its seconds
    inputs = inputs if inputs is not None else check_inputs(cfg, replay=replay, console=start_console)
    train_task, val_task = inputs.train, inputs.val
    run_dir = os.path.abspath(cfg.trainer.output_dir)
    plan = memory_plan(cfg)
    with start_console.phase("starting Ray, placing the trainer"):
        start_ray(cfg)
        if stop_on_signal:
            stop_on_signals()  # after Ray's start: its handler would print a native stack dump on SIGTERM
        pg = trainer_placement(cfg)  # a cluster too small for the trainer stops here, before anything is written
    os.makedirs(run_dir, exist_ok=True)
    with RunLock(run_dir):  # a second run in this directory is refused while this one lives
        return _train_in(cfg, run_dir, pg, plan, train_task, val_task, replay, start_console)


def _train_in(cfg: C.Config, run_dir: str, pg, plan, train_task, val_task, replay: str | None,
              start_console) -> dict:
    t = cfg.trainer
    ckpt_root = os.path.join(run_dir, "checkpoints")
    PROGRESS.update(ckpt_root=ckpt_root, step=None, done=None)
    written = contextlib.nullcontext() if cfg.model.hf_path else start_console.phase("writing the model's config")
    with written:
        hf_dir = prepare_model(cfg, run_dir)
    init = config_checks.initial_weights(cfg)  # checked before the start (preflight.inputs)
    engine = source = sync = phases = None
    # the engines' processes start and import SGLang or vLLM now, while the trainer builds
    launching = None if replay else Launching(cfg, hf_dir, run_dir, pg, list(stop_ids(cfg, train_task.tokenizer)),
                                              train_task.tokenizer.pad_token_id or 0, plan, start_console)
    try:
        group = ActorGroup(cfg, hf_dir, init, pg, start_console)
        ckpt = Checkpointer(ckpt_root, group, hf_dir, keep=t.max_checkpoints, background=t.async_save)
        start, state, resumed = 0, {}, run_ckpt.latest(ckpt_root) if t.resume == "auto" else None
        if resumed:
            start = resumed[0]
            with start_console.phase(f"loading checkpoint step_{start}"):
                load_checkpoint(group, resumed[1])
            state = run_ckpt.read_state(resumed[1])
            print(f"resumed from {resumed[1]} (step {start})", flush=True)
        ckpt.clear_after(start)
        _truncate_metrics(os.path.join(run_dir, "metrics.jsonl"), start)
        if launching is not None:
            _to_rollout_phase(cfg, group, start_console)  # where the engines' memory comes from
            with start_console.phase(f"starting the {cfg.rollout.engine} engines"):
                engine = launching.start(group)
            if cfg.rollout.engine != "embedded":
                with start_console.phase("setting up the weight sync"):
                    sync = launching.weight_sync(group)
        if correction_line(cfg):
            print(correction_line(cfg), flush=True)
        first = {}
        if sync is not None:  # the engine starts without the trainer's weights: give it them
            with start_console.phase("first weight sync"):
                first = sync(start)
            print("initial weight sync: " + json.dumps({k: round(v, 3) for k, v in first.items()}), flush=True)
        # sync, one step off, fully async (generation runs ahead of training), or a replay's dumps
        source = batch_source(cfg, engine, sync, train_task, replay, config_checks.hf_model_dims(cfg.model), start)
        phases = Phases(cfg, group, engine, source.sync, plan)
        if plan is not None:  # the budgets the plot draws each phase's measured peak against
            first.update(plan.metrics())
        start_console.done(f"ready for step {start + 1}")
        with _torch_threads(1):
            return _loop(cfg, group, source, phases, train_task, val_task, run_dir, ckpt, start, state, first)
    finally:
        if source is not None:
            source.shutdown()
        if phases is not None:
            phases.mon.close()
        if engine is not None:
            engine.shutdown()
        if launching is not None:  # engines that never got to start
            launching.shutdown()


def _to_rollout_phase(cfg: C.Config, group: ActorGroup, start_console) -> None:
    """Colocated, the engines are built on the trainer's GPUs in the memory plan's rollout phase:
    the trainer's states on the host, or (kept on the GPUs) its grads dropped, as each step's
    to_rollout leaves them (loop.phases)."""
    if cfg.rollout.engine == "embedded" or not cfg.cluster.colocate:
        return
    if cfg.memory.offload_train_states:
        with start_console.phase("offloading the trainer's states"):
            group.call("offload_states")
    else:
        with start_console.phase("dropping the trainer's grads"):
            group.call("drop_grads")


@contextlib.contextmanager
def _torch_threads(n: int):
    """The loop's own tensors are one batch's, small: an OpenMP team over every core of a GPU host
    would spin on cores the engines and the trainer hold (suspected of costing time each step:
    docs/performance.md). The caller's setting comes back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _loop(cfg, group: ActorGroup, source: BatchSource, phases: Phases, train_task, val_task, run_dir, ckpt,
          start: int, state: dict, first_sync: dict) -> dict:
    """Steps start+1..total, each phase in order: generate, to_train, log-probs, advantages,
    update, then to_rollout with the save between its halves, and the sync in them."""
    t, total = cfg.trainer, total_steps(cfg, train_task, source)
    log = RunLog(cfg, run_dir, total, start)
    log.before(first_sync, validate(cfg, source.validation_engine, val_task)
               if t.val_before_train and start == 0 and val_task else {})
    metrics, kl_ctrl = {}, kl_controller(cfg, state.get("kl_coef"))
    for step in range(start + 1, total + 1):
        PROGRESS["step"], clock = step, StepClock()
        with clock("rollout"):
            sb = generate(cfg, source, step)  # generate: the step's scored batch
        with clock("to_train"):
            phases.to_train()  # to_train: the GPUs to the trainer
        shared = group.share(sb.batch)  # the batch in Ray's object store, once; each rank takes its rows
        log_probs(cfg, group, sb, shared, clock)  # log-probs: old, reference, the critic's values
        sb.metrics.update(advantages(cfg, sb, kl_ctrl))  # advantages, then the rollout correction
        sb.metrics.update(update(cfg, group, shared, clock))  # update: the critic, then the actor
        metrics = {**sb.metrics, **clock.step_metrics(sb)}
        ckpt.finish()  # a background save of the step before is complete once this step has trained
        with clock("to_rollout"):  # the engine gets the GPUs and the updated weights for the next step
            after = phases.offload(step)  # to_rollout, 1st half: trainer states to host (colocated: the sync)
            if run_ckpt.saves_at(step, total, t.save_freq, t.save_last):  # save, from the states' host copies
                after.update(_timed_save(ckpt, phases.mon, step, {"kl_coef": kl_ctrl.value} if kl_ctrl else {}))
            after.update(phases.resume(step))  # to_rollout, 2nd half: the sync (not colocated), the KV cache
        if val_task and (t.test_freq > 0 and step % t.test_freq == 0 or step == total):
            with clock("validate"):
                after.update(validate(cfg, source.validation_engine, val_task))
        metrics.update({**after, **clock.times, **phases.mon.take()})  # the peaks: rollout, train, save, sync
        metrics.update(phases.planned(metrics))  # and the train phase's plan at the micro-batches it ran
        log.step(step, metrics, ckpt)
    ckpt.finish()
    log.close()
    return metrics


class RunLog:
    """The run's metrics (metrics.jsonl and the configured backends, one record a step), the short
    console's line a step, and the plots at the end."""

    def __init__(self, cfg: C.Config, run_dir: str, total: int, start: int):
        t = cfg.trainer
        self.short, self.run_dir = t.console == "short" and "console" in t.logger, run_dir
        # short: the logger keeps its files; one line a step comes from the console below
        backends = [b for b in t.logger if not (self.short and b == "console")]
        self.logger = MetricsLogger(run_dir, backends, project=t.project, experiment=t.experiment,
                                    config=C.to_dict(cfg))
        self.start, self.console = start, None
        PROGRESS["total"] = total
        self.total = total

    def before(self, first_sync: dict, validation: dict) -> None:
        """The first sync and validation, logged at the step the run starts from (a resumed run's
        add to the step it resumed from)."""
        before = {**first_sync, **validation}
        self.console = StepConsole(self.total, self.start) if self.short else None  # its clock starts now
        if self.console and "val/reward" in before:
            self.console.note(f"validation reward before training: {before['val/reward']:.3f}")
        if before:
            self.logger.log(before, step=self.start)

    def step(self, step: int, metrics: dict, ckpt: Checkpointer) -> None:
        self.logger.log(metrics, step=step)  # one record a step
        if not ckpt.background:  # the checkpoint completes after its step's record: a resumed run never lacks it
            ckpt.finish()
        PROGRESS.update(step=None, done=step)
        if self.console:
            self.console.show(step, metrics)

    def close(self) -> None:
        self.logger.close()
        if self.console:
            self.console.close()
        plot_run(self.run_dir)


def _timed_save(ckpt, mon, step: int, state: dict) -> dict:
    t0 = time.perf_counter()
    with mon.phase("save"):
        ckpt.begin(step, state)
    # the largest rank's whole training state (params, grad buffers, optimizer states)
    nbytes = max(ckpt.group.call("state_bytes"))
    return {"timing/save": time.perf_counter() - t0, "checkpoint/state_gib": nbytes / 2**30}


def _truncate_metrics(path: str, step: int) -> None:
    """Drop records of steps after the checkpoint: they are redone, and must not appear twice.
    A run that starts from step 0 starts its metrics afresh (a killed run's half line goes too)."""
    if not os.path.exists(path):
        return

    def step_of(line: str) -> int | None:
        try:
            return json.loads(line).get("step", 0)
        except ValueError:
            return None

    with open(path) as f:
        keep = [line for line in f if step > 0 and (s := step_of(line)) is not None and s <= step]
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)
