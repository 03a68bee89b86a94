"""Data-parallel rollout engines as Ray actors: placement, batching, weight targets, failures.

Each engine spans `tp_size` GPUs over `nnodes` nodes and runs as one Ray actor per node (only
node 0 takes requests). Colocated, engine k sits on the trainer's GPUs k*tp .. (k+1)*tp - 1
(the trainer's placement group, same bundles); otherwise engines get a placement group of their
own. A batch goes to the engines by prefix (`dp_routing`: a prompt's samples and a conversation's
turns to one engine, balanced by requests, then tokens) and is gathered back in order.

Every call to an engine has a deadline: an engine that dies or hangs becomes an EngineError on
the driver naming the engine, its node and what it was doing, never a silent hang.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

from mcore_rl.rollout import dp_routing
from mcore_rl.rollout.base import MEMORY_TAGS, Completion, EngineError, Request, SamplingParams, flatten, unflatten


def _wait(refs: list, what: str, names: list[str], timeout_s: float, logs: list[list] | None = None,
          started: bool = False) -> list:
    """ray.get with a deadline; failures name the engine (`names[i]` for refs[i]). `logs` (refs[i]'s
    engine log files): meanwhile the console says what the engines are doing (`_watch`); `started`:
    the engines' start-up, every phase of it shown, and a last line once they are up."""
    if not refs:
        return []
    import ray

    deadline = time.monotonic() + timeout_s
    if logs is not None:
        _watch(refs, what, names, logs, deadline, started)
    out = []
    for ref, name in zip(refs, names):
        try:
            out.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
        except ray.exceptions.GetTimeoutError:
            raise EngineError(f"{name} did not finish {what} within {timeout_s:.0f}s (hung?)") from None
        except ray.exceptions.RayActorError as e:
            cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise EngineError(f"{name} died during {what}: {cause}") from None
        except ray.exceptions.RayTaskError as e:
            raise EngineError(f"{name} failed {what}: {e.cause if hasattr(e, 'cause') else e}") from None
    return out


def _watch(refs: list, what: str, names: list[str], logs: list[list], deadline: float, started: bool,
           wait: Callable | None = None) -> None:
    """Until `refs` are done (one that fails raises at once) or the deadline: from PROGRESS_S seconds
    on, a console line for the engines still busy, for how long and doing what (the newest phase in
    their logs: `engine_start.latest_phase`), when that changes (at most every PROGRESS_S) and
    otherwise every HEARTBEAT_S. Past the start-up only while they compile kernels: a JIT compile on
    first use (flashinfer's prefill kernels, at the first request) is otherwise minutes of silence.
    `wait`: ray.wait's stand-in (tests)."""
    from mcore_rl.rollout.engine_start import COMPILING, HEARTBEAT_S, POLL_S, PROGRESS_S, latest_phase

    if wait is None:
        import ray

        wait = ray.wait
    t0 = time.monotonic()
    pending, shown, shown_at = list(range(len(refs))), None, t0
    while pending and (left := deadline - time.monotonic()) > 0:
        ready, _ = wait([refs[i] for i in pending], num_returns=len(pending), timeout=min(POLL_S, left))
        done = [i for i in pending if refs[i] in set(ready)]
        _wait([refs[i] for i in done], what, [names[i] for i in done], left)  # raises if one failed
        pending = [i for i in pending if i not in done]
        now = time.monotonic()
        by_phase: dict = {}  # engines doing the same share a line
        for i in pending:
            phases = [p for p in map(latest_phase, logs[i]) if p]
            compiling = next((p for p in phases if p.startswith(COMPILING)), None)
            phase = (phases[0] if phases else None) if started else compiling
            if started or phase:
                by_phase.setdefault(phase, []).append(names[i])
        changed = sorted(by_phase.items(), key=str) != shown
        if by_phase and now - t0 >= PROGRESS_S and now - shown_at >= (PROGRESS_S if changed else HEARTBEAT_S):
            for phase, who in by_phase.items():
                who = who[0] if len(who) == 1 else f"{len(who)} engine nodes ({', '.join(who)})"
                print(f"{who}: {'starting' if started else what} ({now - t0:.0f} s){': ' + phase if phase else ''}",
                      flush=True)
            shown, shown_at = sorted(by_phase.items(), key=str), now
    if started and shown is not None and not pending:  # the lines above said they were starting: say they are up
        print(f"{len(refs)} engine node(s) started in {time.monotonic() - t0:.0f} s", flush=True)


@dataclass
class EngineTarget:
    """The engines as the weight sync drives them, from trainer rank 0 (picklable: Ray handles).

    Payload lists hold `tp_size` entries per engine, engine after engine; an update group spans
    trainer rank 0 and every rank of every engine (engine k's ranks from 1 + k * tp_size)."""

    actors: list  # node 0 of each engine
    tp_size: int
    timeout_s: float
    names: list[str]

    def _all(self, method: str, per_engine: Callable[[int], tuple] = lambda k: (), **kwargs):
        refs = [getattr(a, method).remote(*per_engine(k), **kwargs) for k, a in enumerate(self.actors)]
        return _wait(refs, method, self.names, self.timeout_s)

    def begin_weight_update(self):
        self._all("begin_weight_update")

    def end_weight_update(self):
        self._all("end_weight_update")

    def update_weights_from_tensor(self, payloads, load_format=None, flush_cache=True):
        tp = self.tp_size
        self._all("update_weights_from_tensor", lambda k: (payloads[k * tp:(k + 1) * tp],),
                  load_format=load_format, flush_cache=flush_cache)

    def load_weights_direct(self, payloads, layout, hf, flush_cache=True):
        tp = self.tp_size
        self._all("load_weights_direct", lambda k: (payloads[k * tp:(k + 1) * tp],), layout=layout, hf=hf,
                  flush_cache=flush_cache)

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name="weight_update_group", backend="nccl"):
        self._all("init_weights_update_group",
                  lambda k: (master_address, master_port, rank_offset + k * self.tp_size, world_size),
                  group_name=group_name, backend=backend)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        load_format=None, flush_cache=True):
        self._all("update_weights_from_distributed", lambda k: (names, dtypes, shapes), group_name=group_name,
                  load_format=load_format, flush_cache=flush_cache)

    def update_weights_from_disk(self, model_path):
        self._all("update_weights_from_disk", lambda k: (model_path,))


@dataclass(frozen=True)
class EngineSlot:
    """Where one node of one engine runs: a placement-group bundle and, on GPUs, its devices."""

    engine: int
    node_rank: int
    pg: object  # the placement group (the trainer's when colocated, the engine's own otherwise)
    bundle: int
    gpus: str | None  # CUDA_VISIBLE_DEVICES for the engine's processes (physical ids); None: Ray's
    owns_pg: bool = False  # the group was made for the engine: removed with it


class EngineGroup:
    """N data-parallel engines of one kind behind the Rollout interface."""

    owns_weights = True

    def __init__(self, server_cls, slots: list[EngineSlot], args_of: Callable[[EngineSlot], dict], *,
                 device: str, tp_size: int, timeout_s: float, start_timeout_s: float, gpu_share: float,
                 label: str, env: dict | None = None, log_dir: str | None = None, start: bool = True):
        """An actor per slot, whose process starts and imports its engine at once (its constructor);
        the engines themselves are built by `start` and `wait_started` (start: both, here).
        args_of(slot): that engine node's arguments, asked for as it starts. log_dir: each engine
        node's output goes to a file there (`engine_logs`), not to the console."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from mcore_rl.rollout.engine_logs import LOG_ENV, log_file

        self.ray, self.tp_size, self.timeout_s, self.label = ray, tp_size, timeout_s, label
        self.start_timeout_s, self.args_of, self.log_dir = start_timeout_s, args_of, log_dir
        self.readback = server_cls.READBACK  # how a weight sync into these engines is verified
        self.slots = slots
        remote = ray.remote(server_cls)
        self.actors = []
        for s in slots:
            opts = dict(num_cpus=0, num_gpus=gpu_share if device == "gpu" else 0, max_restarts=0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=s.pg,
                                                                             placement_group_bundle_index=s.bundle))
            log = {LOG_ENV: log_file(log_dir, s.engine, s.node_rank)} if log_dir else {}
            self.actors.append(remote.options(**opts).remote(device, s.gpus, {**(env or {}), **log}))
        self.names = [f"{label} engine {s.engine} node {s.node_rank}" for s in slots]
        self.logs = [log_file(log_dir, s.engine, s.node_rank) if log_dir else None for s in slots]
        self.heads = [a for a, s in zip(self.actors, slots) if s.node_rank == 0]
        self.head_names = [n for n, s in zip(self.names, slots) if s.node_rank == 0]
        self.affinity = dp_routing.RankAffinity(len(self.heads))  # which engine serves a request group
        # each engine's log files, all its nodes' (a node's compiles are in its own)
        self.engine_logs = [[log for log, s in zip(self.logs, slots) if s.engine == h.engine and log]
                            for h in slots if h.node_rank == 0]
        self._imported = [a.__ray_ready__.remote() for a in self.actors]  # done once its constructor is
        self._starting = None
        if start:
            self.start()
            self.wait_started()

    def imported(self, timeout_s: float) -> None:
        """Wait until every engine's process has imported its engine (an EngineError naming one that failed)."""
        _wait(self._imported, "start-up (importing its engine)", self.names, timeout_s)

    def start(self) -> None:
        """Have every engine built (its weights, KV cache, CUDA graphs): after its imports, without
        waiting (`wait_started` waits); once only."""
        if self._starting is None:
            self._starting = [a.start.remote(self.args_of(s)) for a, s in zip(self.actors, self.slots)]

    def wait_started(self) -> None:
        """Wait for `start`, within start_timeout_s: an engine that fails or hangs, in its imports
        too, is an EngineError naming it (the engines are shut down)."""
        try:
            self.info = _wait(self._starting, "start-up", self.names, self.start_timeout_s,
                              logs=[[log] for log in self.logs], started=True)
        except EngineError as e:
            self.shutdown()
            if self.log_dir:  # what the engine said is in its log, not on the console
                raise EngineError(f"{e} (engine logs: {self.log_dir})") from None
            raise

    @property
    def engines(self) -> int:
        return len(self.heads)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        return unflatten(self.generate_requests(flatten(prompts, params)), params.n)

    def generate_requests(self, requests: list[Request]) -> list[Completion]:
        """Requests as they are (each with its own seed) over the engines, gathered in order: a prompt's
        samples, and a Request.group's (a conversation's later turns too), on one engine, whose prefix
        cache holds them (dp_routing, as SGLang's DP-attention ranks within an engine)."""
        per_engine = dp_routing.by_rank(self.affinity.assign(requests))
        busy = list(per_engine)
        outs = _wait([self.heads[k].generate.remote([requests[i] for i in per_engine[k]]) for k in busy], "generate",
                     [self.head_names[k] for k in busy], self.timeout_s, logs=[self.engine_logs[k] for k in busy])
        done: list = [None] * len(requests)
        for k, out in zip(busy, outs):
            if len(out) != len(per_engine[k]):
                raise EngineError(f"{self.head_names[k]} returned {len(out)} completions for {len(per_engine[k])} requests")
            for i, c in zip(per_engine[k], out):
                done[i] = c
        return done

    def weight_target(self) -> EngineTarget:
        return EngineTarget(self.heads, self.tp_size, self.timeout_s, self.head_names)

    def weight_digests(self, derived: bool = False) -> dict[int, dict[int, dict]]:
        """{engine: {tp rank: {parameter: digest}}}: node 0 of each engine has all its ranks write
        theirs, then every node reads those of its own ranks (their files are on its machine).
        `derived` (SGLang): every other tensor of the engines' models too (sglang_plugin)."""
        # one file name per engine: data-parallel engines share a machine, and their rank 0s would collide
        path = os.path.join(tempfile.gettempdir(), "mcore_rl_digests", uuid.uuid4().hex, "engine")
        heads = [s.engine for s in self.slots if s.node_rank == 0]
        _wait([a.write_weight_digests.remote(f"{path}{e}", derived) for a, e in zip(self.heads, heads)],
              "weight read-back", self.head_names, self.timeout_s)
        got = _wait([a.read_weight_digests.remote(f"{path}{s.engine}") for a, s in zip(self.actors, self.slots)],
                    "weight read-back", self.names, self.timeout_s)
        out: dict[int, dict[int, dict]] = {}
        for s, ranks in zip(self.slots, got):
            out.setdefault(s.engine, {}).update({int(r): d for r, d in ranks.items()})
        return out

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[list[float]]]:
        """Each engine's log-probs of every token of `sequences` after its prefix (engine after engine)."""
        return _wait([a.prompt_logprobs.remote(sequences) for a in self.heads], "log-prob check", self.head_names,
                     self.timeout_s, logs=self.engine_logs)

    def release(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        _wait([a.release.remote(list(tags)) for a in self.heads], f"release {list(tags)}", self.head_names,
              self.timeout_s)

    def resume(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        _wait([a.resume.remote(list(tags)) for a in self.heads], f"resume {list(tags)}", self.head_names,
              self.timeout_s)

    def health(self) -> list[dict]:
        return _wait([a.health.remote() for a in self.actors], "health check", self.names, self.timeout_s)

    def shutdown(self) -> None:
        """Stop every engine (its own shutdown first, so SGLang reaps its schedulers), then the actors
        (at once where no engine was started: their processes may still be importing it)."""
        refs = [a.shutdown.remote() for a in self.actors] if self._starting is not None else []
        for ref in refs:
            try:
                self.ray.get(ref, timeout=30)
            except Exception:  # noqa: BLE001 - dead or hung: killed below either way
                pass
        for a in self.actors:
            self.ray.kill(a, no_restart=True)
        self.actors, self.heads = [], []
        for pg in {id(s.pg): s.pg for s in self.slots if s.owns_pg}.values():  # engines' own groups
            self.ray.util.remove_placement_group(pg)
        self.slots = []  # a second shutdown finds nothing left to stop
