"""Megatron -> SGLang weight sync: plan once, then gather, exchange and send bucket by bucket."""

from __future__ import annotations

import time

import torch.distributed as dist

from mcore_rl.sync.gather import LiveShards, assemble
from mcore_rl.sync.engine_layout import EngineLayout, SyncPlanError
from mcore_rl.sync.plan import SyncPlan, single_source


def sync_weights(plan: SyncPlan, shards: LiveShards, transport, check=None, observe=None) -> dict:
    """Push every weight to the engine; `check(plan)` (e.g. a checksum comparison) runs after, and
    `observe(named)` sees each bucket this rank sends before it leaves (e.g. expected digests).

    Call on every trainer rank. Before the first transfer it asserts that the plan's view of this
    rank matches the model, so a wrong rank order or layout fails here, not as silent garbage.
    """
    rank = dist.get_rank()
    shards.check_holds(rank)
    t0 = time.perf_counter()
    parts = plan.for_rank(rank)
    sent, spent = 0, dict.fromkeys(("begin_end", "gather", "send"), 0.0)

    def timed(what, fn, *args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        spent[what] += time.perf_counter() - t
        return out

    timed("begin_end", transport.begin)
    for i, rb in enumerate(parts):
        named = timed("gather", assemble, rb, shards)
        sent += sum(t.numel() * t.element_size() for _, t in named)
        if observe is not None:
            observe(named)
        timed("send", transport.send, named, last=i == len(parts) - 1)
        del named
    timed("begin_end", transport.end)
    # where the seconds went (host clock; kernels still queued count where something waits for
    # them): this rank's gathers, its sends (for the pipelined IPC transport, the driver's wait
    # for engine calls beyond the overlap among them) and the engine calls themselves, issue to return
    stats = {"seconds": time.perf_counter() - t0, "bytes": sent, "buckets": len(parts),
             **{f"{k}_seconds": v for k, v in spent.items()},
             "engine_call_seconds": transport.engine_call_s, "engine_wait_seconds": transport.engine_wait_s}
    if check is not None:
        check(plan)
    return stats


__all__ = ["EngineLayout", "LiveShards", "SyncPlanError", "SyncPlan", "single_source", "sync_weights"]
