"""The trainer's ranks as one group: N Megatron actors on a Ray placement group, every call fanned
out to all of them and gathered; a step's batch reaches them through Ray's object store."""

from __future__ import annotations

import contextlib
import os

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mcore_rl.config import sections as C
from mcore_rl.config import checks as config_checks
from mcore_rl.loop.placement_deadline import reserve
from mcore_rl.parallel.groups import rendezvous_on
from mcore_rl.rollout.launch import TRAINER_GPU_SHARE

SETTLE_S = 30.0  # after a rank's failure, how long the others get to finish before the error is raised


def trainer_placement(cfg: C.Config):
    """The trainer ranks' placement group (one GPU, or one CPU process, per rank), within
    cluster.placement_timeout_s."""
    n = config_checks.actor_gpus(cfg)
    bundle = {"CPU": 1} if cfg.cluster.device == "cpu" else {"GPU": 1, "CPU": 1}
    return reserve([bundle] * n, f"the {n} trainer rank(s)", cfg.cluster.placement_timeout_s)


class SharedBatch:
    """A step's batch in Ray's object store, put there once, as one object per data-parallel slice:
    a rank fetches only its slice's (the ranks of one slice, TP/PP/CP, share it). A call sends each
    rank that reference and, put once per call, only its rows of the tensors the driver added or
    replaced since (old log-probs, advantages, ...). The driver used to send every rank the whole
    batch on every call."""

    def __init__(self, batch: dict, dp: int):
        self.batch, self.sent = batch, dict(batch)
        n = len(batch["tokens"])
        per = -(-n // dp)  # as the ranks slice (actor.lockstep._dp_slice)
        self.rows = [(min(n, r * per), min(n, (r + 1) * per), n) for r in range(dp)]
        self.refs = [ray.put(self._rows(batch, rows)) for rows in self.rows]

    @staticmethod
    def _rows(batch: dict, rows: tuple) -> dict:
        start, stop, n = rows
        out = {k: v[start:stop] if isinstance(v, torch.Tensor) and v.dim() and len(v) == n else v
               for k, v in batch.items()}
        out["dp_rows"] = rows  # the rank checks they are its own
        return out

    def args(self) -> list[tuple]:
        """Each data-parallel slice's call arguments: its reference, and its rows of the tensors new
        since the put (if any)."""
        new = {k: v for k, v in self.batch.items() if self.sent.get(k) is not v}
        if not new:
            return [(ref,) for ref in self.refs]
        return [(ref, ray.put(self._rows(new, rows))) for ref, rows in zip(self.refs, self.rows)]


class ActorGroup:
    """N Megatron actors on a Ray placement group; calls fan out and the results are gathered."""

    def __init__(self, cfg: C.Config, hf_dir: str, init: dict | None = None, pg=None, start=None):
        """start: a console.StartConsole that times the build and the load (as start-up phases)."""
        from mcore_rl.actor import MegatronActor  # lazy: megatron, for a run, not for the CLI's checks

        n = config_checks.actor_gpus(cfg)
        cpu = cfg.cluster.device == "cpu"
        self.pg = pg if pg is not None else trainer_placement(cfg)

        on = lambda i: PlacementGroupSchedulingStrategy(placement_group=self.pg,  # noqa: E731
                                                        placement_group_bundle_index=i)
        addr, port = rendezvous_on(self.pg, 0)  # rank 0's node hosts the rendezvous, not the driver's
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
        init = init or {}
        if init.get("policy"):
            with phase(f"reading the initial weights, each rank its shard of {init['policy']}"):
                read = self.call("read_initial", init)
            print(read_line(read), flush=True)
        with phase("reading the critic's initial weights and making the optimizer" if init.get("critic")
                   else "making the optimizer"):
            self.call("load_initial", init)
        ranks = self.call("run", _data_parallel_rank)
        self.dp_ranks, self.dp = [r for r, _ in ranks], ranks[0][1]  # which slice of a step's batch each trains on

    def call(self, method: str, *args):
        """Run `method` on every rank; return the non-None results in rank order."""
        return self._gathered(method, [getattr(a, method).remote(*args) for a in self.actors])

    def _gathered(self, method: str, refs: list) -> list:
        try:
            out = self.ray.get(refs)
        except self.ray.exceptions.RayActorError as e:  # a rank's process died: say which, and why
            from mcore_rl.actor.deaths import trainer_died  # lazy: mcore_rl.actor imports the models

            raise trainer_died(e, method, self.actors, self.pids) from e
        except self.ray.exceptions.RayTaskError:
            # ray.get raises at the first rank's error while the others may still run the method: let
            # them stop first (bounded: one may wait in a collective for the failed rank), so that what
            # the caller does about it sees them done (a failed save's directory, removed while another
            # rank still wrote into it, stayed behind: step_6.tmp in a fresh-clone CI run)
            self.ray.wait(refs, num_returns=len(refs), timeout=SETTLE_S)
            raise
        return [o for o in out if o is not None]

    def share(self, batch: dict) -> SharedBatch:
        """`batch` in the object store, for `call_on`."""
        return SharedBatch(batch, self.dp)

    def call_on(self, method: str, shared: SharedBatch):
        """`method` of every rank on its rows of the shared batch as the driver holds it now."""
        args = shared.args()
        return self._gathered(method, [getattr(a, method).remote(*args[d]) for a, d in zip(self.actors, self.dp_ranks)])


def read_line(read: list[dict]) -> str:
    """What the ranks read of the initial weights (MegatronActor.read_initial's results)."""
    gib = [r["bytes"] / 2**30 for r in read]
    slowest = max(r["seconds"] for r in read)
    return (f"initial weights: {len(read)} ranks read {sum(gib):.2f} GiB ({min(gib):.2f}-{max(gib):.2f} GiB a rank) "
            f"in {slowest:.1f} s, {sum(gib) / max(slowest, 1e-9):.2f} GiB/s")


def _data_parallel_rank(actor) -> tuple[int, int]:
    """(a rank's data-parallel rank, their number): which slice of a step's batch it trains on."""
    return actor.ps.get_data_parallel_rank(), actor.ps.get_data_parallel_world_size()
