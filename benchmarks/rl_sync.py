"""The weight-sync phase of rl_step_bench: updated live Megatron shards -> SGLang-layout receivers.

The production path: `mcore_rl.sync.sync_weights` assembles each bucket from the live shards
(`LiveShards`) and sends it through `CudaIpcTransport`, whose driver (trainer rank 0) hands each
engine rank's payload to that rank's receiver process (benchmarks/sglang_receivers.py), one per
GPU beside its trainer rank as in the colocated deployment (on CPU: shared memory). With rollout
tp < GPUs there are GPUs / rollout tp engines, each fed by its own plan.

The check after the first sync does not trust the gather under test: the trainer saves its
weights with megatron-core's own dist checkpointing, a host-only process rebuilds every engine
rank's SGLang-layout tensors from that checkpoint, and their digests must equal the receivers'.
"""

from __future__ import annotations

import os
import queue
import time

import torch
import torch.distributed as dist

from benchmarks.sglang_receivers import PipeEngine, expected_from_checkpoint, serve
from mcore_rl.parallel import Layout
from mcore_rl.sync import EngineLayout, LiveShards, SyncPlan, sync_weights
from mcore_rl.sync.bucket import Meta
from mcore_rl.sync.checksum import WeightMismatch, compare
from mcore_rl.sync.transports import CudaIpcTransport, torch_serializer


def engine_plan(dims: dict, args, engine: int) -> SyncPlan:
    """The plan feeding engine `engine` from trainer ranks engine*tp .. engine*tp + tp - 1 (its GPUs)."""
    from mcore_rl.models.config import HFModel

    tp = args.rollout_tp
    plan = SyncPlan.build(HFModel.from_dict(dims), Layout(tp=args.tp, ep=args.ep), args.gpus,
                          EngineLayout(tp, args.rollout_ep, 1, tp), {engine * tp + i: i for i in range(tp)},
                          bucket_bytes=int(args.bucket_mb * 2**20))
    plan.check_complete()
    return plan


def engines(args) -> int:
    return args.gpus // args.rollout_tp


def _receiver(gpu: int, dims: dict, args, conn) -> None:
    plan = engine_plan(dims, args, gpu // args.rollout_tp)
    if not args.cpu:
        torch.cuda.set_device(gpu)
    serve(conn, plan, gpu, "cpu" if args.cpu else f"cuda:{gpu}",
          corrupt=args.corrupt_receiver and gpu == args.gpus - 1)


def start_receivers(ctx, dims: dict, args) -> tuple[list, list]:
    """One receiver process per GPU; returns (processes, the driver's pipe ends in GPU order)."""
    procs, conns = [], []
    for gpu in range(args.gpus):
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=_receiver, args=(gpu, dims, args, theirs), daemon=True)
        p.start()
        theirs.close()
        procs.append(p)
        conns.append(ours)
    return procs, conns


class WeightSync:
    """A trainer rank's side: one plan and transport per engine; rank 0 drives the receivers."""

    def __init__(self, rank: int, args, dims: dict, conns: list):
        self.rank = rank
        self.plans = [engine_plan(dims, args, k) for k in range(engines(args))]
        tp = args.rollout_tp
        self.engines = [PipeEngine(conns[k * tp:(k + 1) * tp]) for k in range(len(self.plans))] if rank == 0 else []
        self.transports = [CudaIpcTransport(self.engines[k] if rank == 0 else None, plan.engine_rank_of,
                                            serializer=torch_serializer, meta_cls=Meta)
                           for k, plan in enumerate(self.plans)]

    def push(self, model) -> None:
        for plan, transport in zip(self.plans, self.transports):
            sync_weights(plan, LiveShards(model, plan), transport)

    def bytes_per_rank(self) -> list[int]:
        """Bytes each GPU's receiver takes in per sync."""
        return [sum(b.payload_bytes for plan in self.plans for b in plan.for_rank(r))
                for r in range(self.plans[0].world)]

    def verify(self, model, ckpt: str, results, verdicts) -> None:
        """Save the weights just synced (every rank); rank 0 sends the receivers' digests to the main
        process and waits for its verdict, so the check never overlaps a timed step."""
        from mcore_rl.checkpoint import save_model

        save_model(model, ckpt)
        verdict = [None]
        if self.rank == 0:
            results.put(("verify", [d for e in self.engines for d in e.digests()]))
            verdict = [verdicts.get()]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] != "ok":  # the main process reports it; every rank exits cleanly
            self.stop()
            raise SystemExit(1)

    def stop(self) -> None:
        for e in self.engines:
            e.stop()


def _expected(ckpt: str, dims: dict, args, out) -> None:
    out.put(expected_from_checkpoint(ckpt, engine_plan(dims, args, 0)))


def wait_for(q, procs: list, what: str):
    """q.get(), raising if any of `procs` (multiprocessing processes) died first."""
    while True:
        try:
            return q.get(timeout=2)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{what}: process {dead[0].name} exited with {dead[0].exitcode}")


def shutdown(procs: list, grace: float) -> None:
    """Join every process within `grace` seconds in all, then terminate the ones still running."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()


def check_receivers(ctx, ckpt: str, dims: dict, args, got: list[dict]) -> dict:
    """Compare each GPU's receiver digests with those rebuilt from the checkpoint; raise on any mismatch."""
    q = ctx.Queue()
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # host-only: no CUDA context on a busy GPU
    try:
        proc = ctx.Process(target=_expected, args=(ckpt, dims, args, q), daemon=True)
        proc.start()
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
    expected = wait_for(q, [proc], "building the expected weights")
    proc.join()
    mismatches = []
    for gpu, digests in enumerate(got):
        engine, tp_rank = divmod(gpu, args.rollout_tp)
        try:
            compare(expected[tp_rank], digests, where=f"GPU {gpu} (engine {engine}, tp rank {tp_rank})")
        except WeightMismatch as e:
            mismatches.append(str(e))
    if mismatches:
        raise WeightMismatch("\n".join(mismatches))
    return dict(passed=True, receivers=len(got), tensors=sum(len(d) for d in got),
                bytes_checked=sum(v[0] for d in got for v in d.values()),
                reference="megatron torch_dist checkpoint of the trainer after the first sync")
