"""The engine end of a weight sync, as the benchmarks stand it in for SGLang (absent on the GPU machines).

One receiver process per GPU holds SGLang-layout parameter buffers for its engine tp rank
(attention and dense/shared MLPs sliced by tp rank, gate/up fused into gate_up_proj, routed
experts as w13 [local_E, 2I/moe_tp, H] / w2 [local_E, H, I/moe_tp]) and copies each received
flattened bucket into place as SGLang's weight loaders would. Messages on its pipe:
("bucket", serialized {"flattened_tensor", "metadata"}) -> "ack"; ("digest", None) -> digests of
its buffers; ("stop", None) ends it. `PipeEngine` is the driver-side engine handle that
`mcore_rl.sync.transports.CudaIpcTransport` talks to; `expected_from_checkpoint` builds what the
receivers must hold from a megatron torch_dist checkpoint (independent of the live gather).
"""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler

import torch

from mcore_rl.sync.bucket import unflatten
from mcore_rl.sync.checksum import digests
from mcore_rl.sync.plan import EngineLayout, SyncPlan

ROW_SPLIT = ("embed_tokens", "lm_head", "q_proj", "q_b_proj", "kv_b_proj")  # split over tp by output rows
COL_SPLIT = ("o_proj",)


def sglang_target(name: str, t: torch.Tensor, engine: EngineLayout, tp_rank: int, expert_base: int):
    """(param name, index into it, source view) as SGLang's weight loaders place HF tensor `name`
    on engine tp rank `tp_rank`: experts into w13/w2 sliced over moe_tp, gate/up into gate_up_proj."""
    parts = name.split(".")
    leaf = parts[-2]
    tp = engine.tp_size
    if ".mlp.experts." in name:
        e = int(parts[5]) - expert_base
        base = ".".join(parts[:5])
        moe_tp, moe_rank = engine.moe_tp, tp_rank % engine.moe_tp  # SGLang: moe_tp_rank = tp_rank % moe_tp
        if leaf == "down_proj":
            return f"{base}.w2_weight", (e,), t.chunk(moe_tp, dim=1)[moe_rank]
        rows = t.chunk(moe_tp, dim=0)[moe_rank]
        n = rows.shape[0]
        return f"{base}.w13_weight", (e, slice(0, n) if leaf == "gate_proj" else slice(n, 2 * n)), rows
    if leaf in ("gate_proj", "up_proj", "down_proj"):  # dense and shared MLPs: split over tp, fused gate_up
        if leaf == "down_proj":
            return name, (), t.chunk(tp, dim=1)[tp_rank]
        rows = t.chunk(tp, dim=0)[tp_rank]
        n = rows.shape[0]
        fused = name.replace(f"{leaf}.weight", "gate_up_proj.weight")
        return fused, (slice(0, n) if leaf == "gate_proj" else slice(n, 2 * n),), rows
    if leaf in ROW_SPLIT:
        return name, (), t.chunk(tp, dim=0)[tp_rank]
    if leaf in COL_SPLIT:
        return name, (), t.chunk(tp, dim=1)[tp_rank]
    return name, (), t  # norms, router, kv_a_proj_with_mqa: replicated


def _targets(plan: SyncPlan, rank: int, named):
    """sglang_target for each (name, tensor) that trainer rank `rank` feeds to its engine rank."""
    tp_rank = plan.engine_rank_of[rank]
    base = plan.engine.experts_of(tp_rank, plan.hf.num_experts).start if plan.hf.num_experts else 0
    for name, t in named:
        yield sglang_target(name, t, plan.engine, tp_rank, base)


def engine_params(plan: SyncPlan, rank: int, device) -> dict[str, torch.Tensor]:
    """Empty SGLang-layout buffers of the engine rank that trainer rank `rank` feeds, shaped by
    placing every tensor it receives (each buffer keeps its source tensors' dtype)."""
    shapes: dict[str, tuple] = {}
    dtypes: dict[str, torch.dtype] = {}
    E_local = plan.hf.num_experts // plan.engine.ep_size if plan.hf.num_experts else 0
    probes = [(n, torch.empty(plan.tensors[n].shape, dtype=plan.tensors[n].dtype, device="meta"))
              for n in plan.payload_names(rank)]
    for (_, probe), (target, _, src) in zip(probes, _targets(plan, rank, probes)):
        if target.endswith("w13_weight"):
            shapes[target] = (E_local, 2 * src.shape[0], src.shape[1])
        elif target.endswith("w2_weight"):
            shapes[target] = (E_local, *src.shape)
        elif target.endswith("gate_up_proj.weight"):
            shapes[target] = (2 * src.shape[0], src.shape[1])
        else:
            shapes[target] = tuple(src.shape)
        dtypes[target] = probe.dtype
    return {k: torch.empty(v, dtype=dtypes[k], device=device) for k, v in shapes.items()}


def place(params: dict[str, torch.Tensor], named, rank: int, plan: SyncPlan) -> None:
    """Copy HF tensors into the SGLang-layout buffers of trainer rank `rank`'s engine rank."""
    for target, index, src in _targets(plan, rank, named):
        params[target][index].copy_(src)


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def serve(conn, plan: SyncPlan, rank: int, device, corrupt: bool = False) -> None:
    """A receiver's loop (see the module doc). `corrupt` flips one bit of one buffer before the first
    digest, standing in for a receiver that holds a wrong weight (negative test of the check)."""
    device = torch.device(device)
    params = engine_params(plan, rank, device)
    while True:
        kind, data = conn.recv()
        if kind == "bucket":
            bucket = ForkingPickler.loads(data)
            place(params, unflatten(bucket["flattened_tensor"], bucket["metadata"]), rank, plan)
            _sync_device(device)  # the sender may free or reuse its buffer after the ack
            del bucket
            conn.send("ack")
        elif kind == "digest":
            if corrupt:
                victim = params[sorted(params)[0]]
                victim.view(-1)[:1].view(torch.uint8)[:1].bitwise_xor_(1)
                corrupt = False
            conn.send(digests(params.items()))
        elif kind == "stop":
            return
        else:
            raise ValueError(f"receiver {rank}: unknown message {kind!r}")


class PipeEngine:
    """The driver's handle on one engine's receivers, with the calls CudaIpcTransport makes on SGLang:
    each tp rank gets its own payload and the call returns once every rank has placed it."""

    def __init__(self, conns: list):
        self.conns = conns

    def begin_weight_update(self) -> None:
        pass

    def end_weight_update(self) -> None:
        pass

    def update_weights_from_tensor(self, payloads: list, load_format: str | None = None,
                                   flush_cache: bool = True) -> None:
        if load_format != "flattened_bucket" or len(payloads) != len(self.conns):
            raise ValueError(f"expected {len(self.conns)} flattened_bucket payloads, got {len(payloads)} "
                             f"with load_format={load_format!r}")
        for conn, payload in zip(self.conns, payloads):
            conn.send(("bucket", payload))
        for tp_rank, conn in enumerate(self.conns):
            reply = conn.recv()
            if reply != "ack":
                raise RuntimeError(f"engine rank {tp_rank} answered {reply!r} to a bucket")

    def digests(self) -> list[dict]:
        for conn in self.conns:
            conn.send(("digest", None))
        return [conn.recv() for conn in self.conns]

    def stop(self) -> None:
        for conn in self.conns:
            conn.send(("stop", None))


def expected_from_checkpoint(ckpt: str, plan: SyncPlan) -> dict[int, dict]:
    """Digests of what each engine rank must hold, built from a torch_dist checkpoint of the trainer
    (megatron-core's own resharding, not the live gather under test) -> {engine tp rank: digests}.

    Runs in a single process (TorchDistReader builds a world-size-1 skeleton). Every engine rank's
    buffers are filled on the host while the checkpoint streams by once.
    """
    from converters.mcore_ckpt import TorchDistReader

    feeders = {r: t for t, r in plan.engine_rank_of.items()}
    params = {r: engine_params(plan, t, "cpu") for r, t in feeders.items()}
    wants = {r: set(plan.payload_names(t)) for r, t in feeders.items()}
    for p, full in TorchDistReader(ckpt, plan.hf).params():
        for h, x in p.to_hf(plan.hf, full).items():
            x = x.to(plan.tensors[h].dtype)  # as the sync converts before sending
            for r, t in feeders.items():
                if h in wants[r]:
                    place(params[r], [(h, x)], t, plan)
    return {r: digests(ps.items()) for r, ps in params.items()}
