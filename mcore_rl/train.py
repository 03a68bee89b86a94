"""`python -m mcore_rl.train --config configs/NAME.yaml [dotted.key=value ...] [--dry-run]`: the RL loop.

Per step: rollout -> rewards -> advantages -> old log-probs -> policy update -> weight sync ->
checkpoint. Megatron actors are Ray actors, one per GPU (one gloo process per "GPU" on CPU); the
rollout engine (mcore_rl/rollout/: SGLang, vLLM, or the embedded engine) runs in actors of its own.
Colocated, each step also moves the GPUs between the two: the engine releases its weights and
KV cache, the trainer onloads and trains, offloads, and the engine resumes and is synced.
`--dry-run` validates everything and prints the placement and the memory plan, starting nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

from mcore_rl import config as C
from mcore_rl import config_checks
from mcore_rl import run_checkpoints as run_ckpt
from mcore_rl.run_checkpoints import Checkpointer
from mcore_rl.parallel import rendezvous_on
from mcore_rl.run_dir import RunLock

# where the run is, for the line a stop by signal prints (set by train and its loop)
PROGRESS: dict = {"step": None, "done": None, "total": None, "ckpt_root": None, "signal": None}


class Stopped(BaseException):
    """SIGTERM or SIGINT: the run stops at once, its engines and workers shut down on the way out.
    A BaseException, as KeyboardInterrupt, so that no `except Exception` takes it for an error."""


def _stop(signum, frame) -> None:
    import signal

    if PROGRESS["signal"] is not None:  # a second signal while shutting down: out now
        os._exit(128 + signum)
    PROGRESS["signal"] = signal.Signals(signum).name
    raise Stopped(PROGRESS["signal"])


def stop_on_signals() -> None:
    """SIGTERM and SIGINT raise Stopped in the main thread. Installed once Ray has started: its
    core worker's failure handler, chained before Python's, printed a native stack dump first."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _stop)


def resume_hint() -> str:
    """How a run that stopped now goes on: from its newest complete checkpoint, if any."""
    newest = run_ckpt.latest(PROGRESS["ckpt_root"], warn=lambda _: None) if PROGRESS["ckpt_root"] else None
    return (f"the newest complete checkpoint is {newest[1]} (step {newest[0]}): the same command resumes from it"
            if newest else "no checkpoint was saved yet: the same command starts the run again")


def stopped_line() -> str:
    """Where a stopped run stopped, and how to go on."""
    step, done, total = PROGRESS["step"], PROGRESS["done"], PROGRESS["total"]
    where = (f"during step {step} of {total}" if step else f"after step {done} of {total}" if done
             else "before its first step")
    return f"error: stopped by {PROGRESS['signal']} {where}; {resume_hint()}"

def prepare_model(cfg: C.Config, run_dir: str) -> str:
    """An HF directory for the policy: the given one, or the embedded config's, written once. The
    latter holds the config only: the trainer starts from megatron's seeded init, built on its
    device, and the engines build theirs without reading weights (a dummy load) and get the
    trainer's from the first sync. (A whole random model built on the host, as transformers'
    from_config does, took 2.5 minutes and 63 GB at Moonlight's size, for weights no one read.)"""
    if cfg.model.hf_path:
        return cfg.model.hf_path
    hf_dir = os.path.join(run_dir, "init_hf")
    if not os.path.exists(os.path.join(hf_dir, "config.json")):
        import shutil

        import transformers

        hcfg = transformers.AutoConfig.for_model(**cfg.model.hf_config)
        # what save_pretrained of the model would record: the engines pick their model class by it
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        from mcore_rl.rollout.model_files import DTYPE_NAMES

        hcfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hcfg.model_type]]
        hcfg.dtype = getattr(torch, DTYPE_NAMES[cfg.model.dtype])  # the weights' dtype, as the run has them
        shutil.rmtree(hf_dir + ".tmp", ignore_errors=True)
        hcfg.save_pretrained(hf_dir + ".tmp")
        os.replace(hf_dir + ".tmp", hf_dir)
    return hf_dir


def trainer_placement(cfg: C.Config):
    """The trainer ranks' placement group (one GPU, or one CPU process, per rank), within
    cluster.placement_timeout_s."""
    from mcore_rl.placement_deadline import reserve

    n = config_checks.actor_gpus(cfg)
    bundle = {"CPU": 1} if cfg.cluster.device == "cpu" else {"GPU": 1, "CPU": 1}
    return reserve([bundle] * n, f"the {n} trainer rank(s)", cfg.cluster.placement_timeout_s)


class ActorGroup:
    """N Megatron actors on a Ray placement group; calls fan out and the results are gathered."""

    def __init__(self, cfg: C.Config, hf_dir: str, init: dict | None = None, pg=None, start=None):
        """start: a console.StartConsole that times the build and the load (as start-up phases)."""
        import ray

        from mcore_rl.actor import MegatronActor

        n = config_checks.actor_gpus(cfg)
        cpu = cfg.cluster.device == "cpu"
        self.pg = pg if pg is not None else trainer_placement(cfg)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        on = lambda i: PlacementGroupSchedulingStrategy(placement_group=self.pg,  # noqa: E731
                                                        placement_group_bundle_index=i)
        addr, port = rendezvous_on(self.pg, 0)  # rank 0's node hosts the rendezvous, not the driver's
        from mcore_rl.rollout.launch import TRAINER_GPU_SHARE

        share = 1 if cfg.rollout.engine == "embedded" or not cfg.cluster.colocate else TRAINER_GPU_SHARE
        remote = ray.remote(num_cpus=1, num_gpus=0 if cpu else share)(MegatronActor)
        d = C.to_dict(cfg)
        self.ray = ray
        phase = start.phase if start is not None else lambda name: contextlib.nullcontext()
        with phase(f"building the trainer's model ({n} ranks)"):
            self.actors = [remote.options(scheduling_strategy=on(i)).remote(i, n, port, hf_dir, d, addr,
                                                                             build_only=True)
                           for i in range(n)]
            where = ray.get([a.__ray_call__.remote(lambda self: (ray.get_runtime_context().get_node_id(), os.getpid()))
                             for a in self.actors])
        nodes, self.pids = [n for n, _ in where], [pid for _, pid in where]
        print(f"{n} actor ranks on {len(set(nodes))} node(s); rendezvous {addr}:{port}", flush=True)
        loads = "loading the initial weights and making the optimizer" if (init or {}).get("policy") \
            else "making the optimizer"
        with phase(loads):
            self.call("load_initial", init)

    def call(self, method: str, *args):
        """Run `method` on every rank; return the non-None results in rank order."""
        try:
            out = self.ray.get([getattr(a, method).remote(*args) for a in self.actors])
        except self.ray.exceptions.RayActorError as e:  # a rank's process died: say which, and why
            from mcore_rl.actor.deaths import trainer_died

            raise trainer_died(e, method, self.actors, self.pids) from e
        return [o for o in out if o is not None]


class Phases:
    """Who holds the GPUs: with an engine of its own weights, colocated, the Colocation choreography
    (mcore_rl.memory.colocate) around each update; otherwise just the sync after it."""

    def __init__(self, cfg: C.Config, group: ActorGroup, engine, sync, plan=None):
        from mcore_rl.memory.colocate import Colocation
        from mcore_rl.memory.monitor import PhaseMonitor, local_pids

        self.sync, self.colo = sync, None
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
        if engine.owns_weights and cfg.cluster.colocate:
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

    def to_rollout(self, step: int, save=None) -> dict:
        """The engine gets the GPUs and the new weights; save() (a checkpoint) runs once the
        trainer's states are offloaded, when colocated, so it writes their host copies."""
        enter_sync = lambda: self.mon.enter("sync")  # noqa: E731 - the offload counts to the train phase
        if self.colo is None:
            out = save() if save else {}
            enter_sync()
            out.update(self.sync(step) if self.sync is not None else {})
        else:
            out = self.colo.to_rollout(after_offload=save, before_sync=enter_sync, step=step)
            out.update({f"timing/{k}": v[-1] for k, v in self.colo.timings.items() if k != "sync"})
            # the most any one GPU's trainer moved to the host in each offload (its GB/s: over timing/<same>)
            out.update({f"memory/moved_gib_{k}": max(v) / 2**30 for k, v in self.colo.moved.items() if v})
        self.mon.enter("rollout")
        return out


class _Trainer:
    def __init__(self, group):
        self.group = group

    def offload(self, weights: bool = True):
        return self.group.call("offload_states", weights)

    def onload(self):
        self.group.call("onload_states")


def rl_step(cfg: C.Config, group: ActorGroup, engine, phases: Phases, source, prompt_idx: list[int], step: int,
            kl_ctrl=None) -> dict:
    """Rollout -> rewards -> advantages -> log-probs -> updates; ends with the trainer holding the
    GPUs (the caller checkpoints, then hands them back with `phases.to_rollout`)."""
    from mcore_rl import ppo
    from mcore_rl.dynamic_sampling import sample_step_batch
    from mcore_rl.rollout_dump import dump_rollout

    t0, times = time.perf_counter(), {}

    def timed(name, method, *args):
        t = time.perf_counter()
        out = group.call(method, *args)
        times[f"timing/{name}"] = times.get(f"timing/{name}", 0.0) + time.perf_counter() - t
        return out

    if hasattr(engine, "step_batch"):  # a replay's dumped rollout, or one generated ahead (async_loop)
        batch, idx, score, reward, metrics = engine.step_batch(step)
    else:  # generation and rule scores (several rounds with dynamic sampling)
        batch, idx, score, reward, metrics = sample_step_batch(cfg, engine, source, prompt_idx,
                                                               cfg.trainer.seed * 100003 + step)
    if cfg.trainer.rollout_dump_dir:
        dump_rollout(cfg.trainer.rollout_dump_dir, step, batch, idx, score, reward, config_checks.hf_model_dims(cfg.model))
    times["timing/rollout"] = time.perf_counter() - t0
    t = time.perf_counter()
    phases.to_train()
    times["timing/to_train"] = time.perf_counter() - t
    batch["old_log_probs"] = torch.cat(timed("old_log_prob", "log_probs", batch))
    agreement = group.call("route_agreement") if "routes" in batch else []
    if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        batch["ref_log_probs"] = torch.cat(timed("ref", "ref_log_probs", batch))
    if cfg.critic.enabled:
        batch["values"] = torch.cat(timed("values", "values", batch))
    metrics.update(ppo.advantages(cfg, batch, reward, idx, kl_ctrl))
    if agreement and agreement[0] is not None:  # the trainer's top-k sets vs the engine's, old-log-prob pass
        metrics["rollout/route_agreement"] = agreement[0]
    mask = batch["response_mask"]  # every sampled token, for the metrics below
    metrics.update(ppo.correct_rollout(cfg, batch))  # may take rejected tokens out of the updates' mask
    if cfg.critic.enabled:  # the critic learns from this batch's returns before the actor moves
        metrics.update(_mean(timed("update_critic", "update_critic", batch)))
    metrics.update(_mean(timed("update_actor", "update", batch)))
    times["timing/step"] = time.perf_counter() - t0  # the sync that follows is timed on its own
    metrics.update({"reward/mean": score.mean().item(), "response/length": mask.sum(1).mean().item(),
                    "perf/tokens_per_s": mask.sum().item() / times["timing/step"],
                    "perf/rollout_tokens_per_s": mask.sum().item() / times["timing/rollout"], **times})
    return metrics


def _mean(stats: list[dict]) -> dict:
    return {k: sum(s[k] for s in stats) / len(stats) for k in stats[0]}


def validate(cfg, engine, source) -> dict:
    from mcore_rl import ppo
    from mcore_rl.rollout.multiturn import validation_scores

    idx = list(range(len(source.prompts)))
    size = cfg.data.val_batch_size or len(idx)
    n = cfg.rollout.val_n
    scores = []
    for s in range(0, len(idx), size):
        chunk = [i for i in idx[s:s + size] for _ in range(n)]
        params = ppo.sampling_params(cfg, source, 0, validation=True)
        scores.append(validation_scores(cfg, engine, source, chunk, params))
    return {"val/reward": torch.cat(scores).mean().item()}


def initial_checkpoints(cfg: C.Config, hf_dir: str, run_dir: str, start=None) -> dict:
    """torch_dist copies of the HF weights the policy (and a critic from another model) start
    from, converted once per run; none for an embedded config (megatron's seeded init). start: a
    console.StartConsole that shows each conversion as a start-up phase."""
    if not cfg.model.hf_path:
        return {}
    from converters.convert import hf_to_mcore

    def converted(src: str, name: str) -> str:
        out = os.path.join(run_dir, "init_mcore", name)
        if not os.path.exists(os.path.join(out, "metadata.json")):
            with start.phase(f"converting {src} to torch_dist") if start else contextlib.nullcontext():
                hf_to_mcore(src, out, dtype=cfg.model.dtype)
        return out

    init = {"policy": converted(hf_dir, "policy")}
    critic = cfg.critic.hf_path
    if cfg.critic.enabled and critic and os.path.abspath(critic) != os.path.abspath(hf_dir):
        init["critic"] = converted(critic, "critic")
    return init


def memory_plan(cfg: C.Config):
    """The memory plan of a GPU run (None on CPU), made before anything takes GPU memory, so that
    its capacity is the GPUs' free memory; a plan that cannot fit raises MemoryPlanError here. The
    config's "auto" budget and recompute become the plan's picks (on CPU, their defaults)."""
    from mcore_rl.plan import apply_choice, plan_for_config, settle_without_plan

    if cfg.cluster.device != "gpu":
        settle_without_plan(cfg)
        return None
    plan, source = plan_for_config(cfg)
    apply_choice(cfg, plan)  # the micro-batch budget and recompute the plan picked, where the config says auto
    print(f"memory plan per GPU (capacity from {source}):\n{plan.table()}", flush=True)
    return plan


def _not_ray_auth_notice(record) -> bool:
    """Ray logs at WARNING level that a new local cluster uses token authentication, its default and
    nothing to act on; the opposite notice (authentication off) still shows."""
    return "Token authentication is enabled" not in record.getMessage()


def _quiet_ray_auth_notice() -> None:
    import logging

    # addFilter keeps one copy of a filter however often a process starts Ray
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(_not_ray_auth_notice)


def _start_ray(cfg: C.Config) -> None:
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):  # a submitted job: join the cluster as it is
        ray.init(log_to_driver=True)
    else:  # a local run: a private Ray on loopback ("local": never the cluster of a stale address file)
        _quiet_ray_auth_notice()
        ray.init(address="local", num_cpus=max(2, cfg.cluster.nnodes * cfg.cluster.n_gpus_per_node),
                 include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=True)


def train(cfg: C.Config, inputs=None, replay: str | None = None, stop_on_signal: bool = False) -> dict:
    """The RL loop. inputs: preflight.check_inputs(cfg), where the caller has made it; replay: a
    rollout_dump_dir to train on instead of sampling (no engine, no prompts, no validation);
    stop_on_signal: SIGTERM and SIGINT raise Stopped (the command line's run)."""
    from mcore_rl.preflight import check_inputs

    inputs = inputs if inputs is not None else check_inputs(cfg, replay=replay)
    train_task, val_task = inputs.train, inputs.val
    run_dir = os.path.abspath(cfg.trainer.output_dir)
    plan = memory_plan(cfg)
    from mcore_rl.console import StartConsole

    start_console = StartConsole()  # a line per start-up phase, with its seconds
    with start_console.phase("starting Ray, placing the trainer"):
        _start_ray(cfg)
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
    init = initial_checkpoints(cfg, hf_dir, run_dir, start_console)
    group = ActorGroup(cfg, hf_dir, init, pg, start_console)
    ckpt = Checkpointer(ckpt_root, group, hf_dir, keep=t.max_checkpoints, background=t.async_save)
    engine = rollout = sync = phases = None
    try:
        start, state, resumed = 0, {}, run_ckpt.latest(ckpt_root) if t.resume == "auto" else None
        if resumed:
            start = resumed[0]
            with start_console.phase(f"loading checkpoint step_{start}"):
                _load(group, resumed[1])
            state = run_ckpt.read_state(resumed[1])
            print(f"resumed from {resumed[1]} (step {start})", flush=True)
        ckpt.clear_after(start)
        _truncate_metrics(os.path.join(run_dir, "metrics.jsonl"), start)
        from mcore_rl.ppo import correction_line, stop_ids
        from mcore_rl.rollout.launch import launch
        from mcore_rl.rollout_dump import RolloutReplay

        if replay:
            engine = RolloutReplay(replay, config_checks.hf_model_dims(cfg.model))
        else:
            if cfg.rollout.engine != "embedded" and cfg.cluster.colocate and cfg.memory.offload_train_states:
                with start_console.phase("offloading the trainer's states"):
                    group.call("offload_states")  # the engines start in the plan's rollout phase: trainer states on the host
            with start_console.phase(f"starting the {cfg.rollout.engine} engines"):
                engine, sync = launch(cfg, hf_dir, run_dir, group, list(stop_ids(cfg, train_task.tokenizer)),
                                      train_task.tokenizer.pad_token_id or 0, plan)
        if correction_line(cfg):
            print(correction_line(cfg), flush=True)
        first = {}
        if sync is not None:  # the engine starts without the trainer's weights: give it them
            with start_console.phase("first weight sync"):
                first = sync(start)
            print("initial weight sync: " + json.dumps({k: round(v, 3) for k, v in first.items()}), flush=True)
        rollout = engine
        if t.mode != "sync" and not replay:  # generation runs ahead of training (mcore_rl/async_loop.py)
            from mcore_rl import async_loop

            rollout = async_loop.wrap(cfg, engine, sync, train_task, lambda k: step_prompts(cfg, train_task, k),
                                      total_steps(cfg, train_task, engine), start)
            sync = rollout.sync
        phases = Phases(cfg, group, engine, sync, plan)
        if plan is not None:  # the budgets the plot draws each phase's measured peak against
            first.update(plan.metrics())
        start_console.done(f"ready for step {start + 1}")
        with _torch_threads(1):
            return _loop(cfg, group, rollout, phases, train_task, val_task, run_dir, ckpt, start, state, first)
    finally:
        if rollout is not None and rollout is not engine:
            rollout.shutdown()
        if phases is not None:
            phases.mon.close()
        if engine is not None:
            engine.shutdown()


def _load(group: ActorGroup, step_dir: str) -> None:
    """Every rank's models and optimizer states from `step_dir` (saved at any layout)."""
    try:
        group.call("load", step_dir)
    except Exception as e:  # noqa: BLE001 - a Ray error wrapping the rank's: one line naming the checkpoint
        cause = getattr(e, "cause", None) or e
        first = str(cause).splitlines()[0] if str(cause) else ""
        raise run_ckpt.CheckpointError(f"{step_dir}: cannot resume from this checkpoint: "
                                       f"{type(cause).__name__}: {first}") from None


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


def _loop(cfg, group, engine, phases, train_task, val_task, run_dir, ckpt, start, state,
          first_sync: dict) -> dict:
    from mcore_rl.console import StepConsole
    from mcore_rl.metrics import MetricsLogger
    from mcore_rl.ppo import kl_controller

    t = cfg.trainer
    short = t.console == "short" and "console" in t.logger
    # short: the logger keeps its files; one line a step comes from the console below
    backends = [b for b in t.logger if not (short and b == "console")]
    logger = MetricsLogger(run_dir, backends, project=t.project, experiment=t.experiment,
                           config=C.to_dict(cfg))
    total = total_steps(cfg, train_task, engine)
    before = dict(first_sync)  # logged at the step the run starts from
    if t.val_before_train and start == 0 and val_task:
        before.update(validate(cfg, engine, val_task))
    console = StepConsole(total, start) if short else None  # its clock starts with the first step
    if console and "val/reward" in before:
        console.note(f"validation reward before training: {before['val/reward']:.3f}")
    if before:  # the first sync (and validation): a resumed run's adds to the step it resumed from
        logger.log(before, step=start)
    metrics, kl_ctrl = {}, kl_controller(cfg, state.get("kl_coef"))
    PROGRESS["total"] = total
    for step in range(start + 1, total + 1):
        PROGRESS["step"] = step
        prompts = step_prompts(cfg, train_task, step) if train_task else []  # a replay trains on dumped batches
        metrics = rl_step(cfg, group, engine, phases, train_task, prompts, step, kl_ctrl)
        ckpt.finish()  # a background save of the step before is complete once this step has trained
        save = None
        if run_ckpt.saves_at(step, total, t.save_freq, t.save_last):
            saved = {"kl_coef": kl_ctrl.value} if kl_ctrl else {}
            save = lambda s=step, st=saved: _timed_save(ckpt, phases.mon, s, st)  # noqa: E731
        t0 = time.perf_counter()
        # the engine gets the updated weights for the next step; a save runs once the trainer's
        # states are offloaded, written from their pinned host copies
        after = phases.to_rollout(step, save)
        after["timing/to_rollout"] = time.perf_counter() - t0
        if val_task and (t.test_freq > 0 and step % t.test_freq == 0 or step == total):
            t0 = time.perf_counter()
            after.update(validate(cfg, engine, val_task))
            after["timing/validate"] = time.perf_counter() - t0
        after.update(phases.mon.take())  # this step's peaks: rollout, train, save, sync
        metrics.update(after)
        logger.log(metrics, step=step)  # one record a step
        if not ckpt.background:  # the checkpoint completes after its step's record: a resumed run never lacks it
            ckpt.finish()
        PROGRESS.update(step=None, done=step)
        if console:
            console.show(step, metrics)
    ckpt.finish()
    logger.close()
    if console:
        console.close()
    from mcore_rl.plot import plot_run

    plot_run(run_dir)
    return metrics


def total_steps(cfg: C.Config, train_task, engine) -> int:
    t = cfg.trainer
    if t.total_training_steps:
        return t.total_training_steps
    return t.total_epochs * (len(train_task.prompts) // cfg.data.train_batch_size) if train_task else max(engine.steps)


def step_prompts(cfg: C.Config, train_task, step: int) -> list[int]:
    """Step `step`'s prompt indices: a seeded shuffle per epoch, data.train_batch_size at a time."""
    B = cfg.data.train_batch_size
    per_epoch = len(train_task.prompts) // B
    order = torch.randperm(len(train_task.prompts),
                           generator=torch.Generator().manual_seed(cfg.trainer.seed + (step - 1) // per_epoch))
    k = (step - 1) % per_epoch
    return order[k * B:(k + 1) * B].tolist()


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


PLAN_REFUSED = "memory plan REFUSED"


def dry_run(cfg: C.Config) -> list[str]:
    """What a run of `cfg` would start, as lines: trainer ranks, engines, sync, memory plan."""
    from mcore_rl.rollout.placement import plan_placement

    c, p = cfg.cluster, cfg.parallel
    world = config_checks.actor_gpus(cfg)
    units = "GPUs" if c.device == "gpu" else "processes"  # on CPU a gloo process stands in for a GPU
    model = cfg.model.hf_path or "embedded hf_config (random init)"
    if cfg.model.hf_path and not os.path.isdir(cfg.model.hf_path):
        model += " (not on this machine; needed at run time)"
    lines = [f"model: {model}", f"cluster: {c.nnodes} node(s) x {c.n_gpus_per_node} {units}, device {c.device}",
             f"trainer: {world} Megatron ranks on {units} 0..{world - 1}: TP={p.tp} PP={p.pp} EP={p.ep} "
             f"ETP={p.etp} DP={world // (p.tp * p.pp)}, {cfg.model.dtype}"]
    if cfg.rollout.engine == "embedded":
        lines.append("rollout: embedded engine on the trainer's own shards (no sync)")
    else:
        lines += plan_placement(cfg).describe(units)
        check = "a log-prob check" if cfg.rollout.engine == "vllm" else "read-back"
        lines.append(f"weight sync: {config_checks.transport_for(cfg)}, verified by {check} after the first sync"
                     + (f" and every {cfg.rollout.verify_sync_every} steps" if cfg.rollout.verify_sync_every else ""))
    if c.device == "gpu":
        from mcore_rl.memory.gpus import GpuSelectionError
        from mcore_rl.memory.planner import MemoryPlanError
        from mcore_rl.plan import plan_for_config

        try:
            plan, source = plan_for_config(cfg)
            lines += ["memory plan per GPU (capacity from " + source + "):", *plan.table().splitlines()]
        except MemoryPlanError as e:
            lines += [*(e.plan.table().splitlines() if e.plan else []), f"{PLAN_REFUSED}: {e}"]
        except GpuSelectionError as e:
            lines.append(f"memory plan: not made here ({e})")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mcore_rl.train", description=__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--dry-run", action="store_true", help="validate and print the placement and memory plan")
    p.add_argument("--replay", metavar="DIR", help="train on the rollouts dumped to DIR (trainer.rollout_dump_dir), "
                                                   "without an engine")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    a = p.parse_intermixed_args(argv)  # options may follow the overrides
    from mcore_rl.cli_errors import BAD_INPUT, report
    from mcore_rl.console import quiet_fallback_warnings

    quiet_fallback_warnings()  # the driver imports megatron too (plans, sync layout)
    from mcore_rl.placement_deadline import PlacementTimeout
    from mcore_rl.preflight import check_inputs

    try:
        cfg = C.load_config(a.config, a.overrides)
        # the same checks for both; a dry run plans for the cluster it names: its model files
        # need not be on this machine
        inputs = check_inputs(cfg, dry_run=a.dry_run, replay=a.replay)
        if a.dry_run:
            lines = dry_run(cfg)
            print("\n".join(lines))
            # as the run would end: a refused memory plan stops it (exit 1, as python -m mcore_rl.plan)
            return 1 if any(line.startswith(PLAN_REFUSED) for line in lines) else 0
    except BAD_INPUT as e:
        return report(e)
    from mcore_rl.memory.gpus import GpuSelectionError
    from mcore_rl.dynamic_sampling import RefillsExhausted
    from mcore_rl.cli_errors import BadInput, message
    from mcore_rl.memory.planner import MemoryPlanError
    from mcore_rl.rollout.base import EngineError

    t0 = time.perf_counter()
    try:
        m = train(cfg, inputs, replay=a.replay, stop_on_signal=True)
    except run_ckpt.SaveFailed as e:  # a full disk, a read-only directory: the checkpoint before is whole
        report(e)
        return 1
    except (GpuSelectionError, BadInput, RefillsExhausted, PlacementTimeout) as e:
        return report(e)  # BadInput: checkpoints, dumps, a second run that took the lock first, ...
    except OSError as e:  # a file the run writes (metrics, dumps) on a full or read-only disk
        print(f"error: {message(e)}; {resume_hint()}", file=sys.stderr, flush=True)
        return 1
    except EngineError as e:  # an engine died or hung mid-run (its message names it): rerunning resumes
        cause = getattr(e, "cause", None) or e  # met by a trainer rank in a weight sync: Ray wraps it
        print(f"error: {cause}; the same command resumes from the last checkpoint", file=sys.stderr)
        return 1
    except MemoryPlanError as e:  # from memory_plan, before anything started
        if e.plan is not None:
            print(e.plan.table())
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - last: a stop by signal, whatever it interrupted: one line
        if PROGRESS["signal"] is None:
            raise
        print(stopped_line(), file=sys.stderr, flush=True)
        return 128 + getattr(__import__("signal"), PROGRESS["signal"])
    print(f"done in {time.perf_counter() - t0:.0f}s: " + json.dumps({k: round(v, 4) for k, v in m.items()
                                                                    if k.startswith(("reward", "val"))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
