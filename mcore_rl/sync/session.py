"""The trainer's side of syncing into rollout engines, set up once per run on every trainer rank.

    session = SyncSession(model, spec)           # plan, live shards, transport: built once
    out = session.run(verify=True)               # every rank, in lockstep, after each update

`SyncSpec` is what the driver decides (picklable, shipped to every rank): the plan, the engines'
weight target, the transport ("ipc" colocated, "broadcast" for engines on other GPUs over NCCL,
gloo on CPU, "disk" as the fallback), which engine slot each trainer rank feeds, and where the
update group meets. With verify, each rank returns the digests the engine ranks it fed must
now hold, accumulated from what it sent (`mcore_rl.sync.engine_layout.ExpectedDigests`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mcore_rl.sync import LiveShards, SyncPlan, sync_weights
from mcore_rl.sync.engine_layout import ExpectedDigests

TRANSPORTS = ("ipc", "broadcast", "disk")
# MCORE_RL_PROFILE_SYNC=N: the N-th sync of trainer rank 0 runs under cProfile, its top functions
# (by own time) printed to the actor's log: where a sync's host seconds go, on any machine
PROFILE_SYNC = int(os.environ.get("MCORE_RL_PROFILE_SYNC", "0"))


@dataclass
class SyncSpec:
    plan: SyncPlan
    target: object  # the engines' WeightTarget (mcore_rl.rollout.group.EngineTarget)
    transport: str
    engines: int  # data-parallel engines, tp_size ranks each
    slot_of: dict[int, int] = field(default_factory=dict)  # ipc: trainer rank -> engine * tp + tp rank
    master: tuple[str, int] | None = None  # broadcast: where the update group meets (trainer rank 0)
    disk_dir: str | None = None  # disk: where versions are written
    hf_dir: str | None = None  # disk: side files (config, tokenizer) copied beside the weights
    timeout_s: float = 600.0  # broadcast: an engine that never receives is an error after this long
    direct_load: bool = False  # ipc: the engine copies buckets straight into its parameters (rollout.sync_load)

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown sync transport {self.transport!r}; one of {TRANSPORTS}")


class SyncSession:
    def __init__(self, model, spec: SyncSpec, read=None):
        from mcore_rl.sync import transports as T

        self.spec, self.rank, self.syncs = spec, dist.get_rank(), 0
        self.shards = LiveShards(model, spec.plan, read=read)
        spec.plan.check_complete()
        cuda = torch.cuda.is_available()
        if spec.transport == "ipc":
            serializer, meta_cls = T.sglang_wire() if cuda else T.by_value()
            largest = max((rb.payload_bytes for rb in spec.plan.for_rank(self.rank)), default=0)
            self.transport = T.CudaIpcTransport(spec.target, spec.slot_of, serializer=serializer, meta_cls=meta_cls,
                                                direct=(spec.plan.engine, spec.plan.hf) if spec.direct_load else None,
                                                capacity=largest)
        elif spec.transport == "broadcast":
            group = None
            if self.rank == 0:
                addr, port = spec.master
                group = T.open_update_group(spec.target, addr, port, spec.engines * spec.plan.engine.tp_size,
                                            backend="nccl" if cuda else "gloo")
            self.transport = T.NcclBroadcastTransport(spec.target, group, timeout_s=spec.timeout_s)
        else:
            self.transport = T.DiskTransport(spec.target, spec.disk_dir, spec.hf_dir)

    def _fed(self) -> dict[int, list[int]]:
        """{engine: [tp ranks]} this rank's payloads reach."""
        tp = self.spec.plan.engine.tp_size
        if self.spec.transport == "ipc":
            slot = self.spec.slot_of.get(self.rank)
            return {} if slot is None else {slot // tp: [slot % tp]}
        return {k: list(range(tp)) for k in range(self.spec.engines)} if self.rank == 0 else {}

    def run(self, verify: bool = False) -> dict:
        """Sync every weight; with verify, also {"expected": {engine: {tp rank: digests}}}."""
        fed = self._fed() if verify else {}
        plan = self.spec.plan
        acc = ExpectedDigests(plan.engine, plan.hf, sorted({r for ranks in fed.values() for r in ranks}))
        self.syncs += 1
        with _profiled(self.syncs == PROFILE_SYNC and self.rank == 0, f"sync {self.syncs}, trainer rank 0"):
            stats = sync_weights(plan, self.shards, self.transport, observe=acc.add if fed else None)
        if torch.cuda.is_available():
            # the buckets and gathered shards are free now; cached, they would stay on the GPU all
            # rollout (measured: 2.5 GiB of the trainer's while the engine generated, at Moonlight widths)
            torch.cuda.empty_cache()
        if fed:  # every engine fed from here holds the same weights
            stats["expected"] = {k: {r: acc.digests[r] for r in ranks} for k, ranks in fed.items()}
        return stats


def merge_expected(results: list[dict]) -> dict[int, dict[int, dict]]:
    """The per-rank `run(verify=True)` results -> {engine: {tp rank: digests}}."""
    out: dict[int, dict[int, dict]] = {}
    for r in results:
        for k, ranks in r.get("expected", {}).items():
            out.setdefault(k, {}).update(ranks)
    return out


def disk_root(run_dir: str) -> str:
    return os.path.join(run_dir, "sync_disk")


@contextlib.contextmanager
def _profiled(on: bool, what: str, top: int = 30):
    if not on:
        yield
        return
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
        print(f"[profile of {what}; engine calls run in a thread and are not in it]\n{text.getvalue()}", flush=True)
