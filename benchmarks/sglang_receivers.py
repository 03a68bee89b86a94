"""The engine end of a weight sync, as the benchmarks stand it in for SGLang (absent on the GPU machines).

One receiver process per GPU holds SGLang-layout parameter buffers for its engine tp rank
(attention and dense/shared MLPs sliced by tp rank, gate/up fused into gate_up_proj, routed
experts as w13 [local_E, 2I/moe_tp, H] / w2 [local_E, H, I/moe_tp]) and copies each received
flattened bucket into place as SGLang's weight loaders would, by the sync's own table
(`mcore_rl.sync.engine_layout`, checked by read-back against real SGLang engines in CI).
Messages on its pipe: ("bucket", serialized {"flattened_tensor", "metadata"}) -> "ack";
("digest", None) -> digests of its buffers; ("stop", None) ends it. `PipeEngine` is the
driver-side engine handle that `mcore_rl.sync.transports.CudaIpcTransport` talks to;
`expected_from_checkpoint` builds what the receivers must hold from a megatron torch_dist
checkpoint (independent of the live gather).
"""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler

import torch

from mcore_rl.sync.bucket import unflatten
from mcore_rl.sync.checksum import digests
from mcore_rl.sync.engine_layout import engine_param, padded_vocab
from mcore_rl.sync.engine_layout import place as place_pieces
from mcore_rl.sync.plan import SyncPlan


def _pieces(plan: SyncPlan, rank: int, named):
    """Where each (name, tensor) that trainer rank `rank` feeds to its engine rank lands, as the sync's
    own table places it (`mcore_rl.sync.engine_layout`): (SGLang parameter, element offset, source)."""
    tp_rank = plan.engine_rank_of[rank]
    for name, t in named:
        yield from place_pieces(name, t, plan.engine, tp_rank, plan.hf)


def engine_params(plan: SyncPlan, rank: int, device) -> dict[str, torch.Tensor]:
    """Zeroed SGLang-shaped buffers (`mcore_rl.memory.layout.engine_tensors`, vocab rows padded as
    SGLang pads them) of the parameters that trainer rank `rank` fills on its engine rank, each in
    its source tensors' dtype."""
    from mcore_rl.memory.layout import engine_tensors, inventory

    tp, tp_rank = plan.engine.tp_size, plan.engine_rank_of[rank]
    shapes = engine_tensors(plan.hf, inventory(plan.hf), tp=tp, ep=plan.engine.ep_size, rank=tp_rank)
    params: dict[str, torch.Tensor] = {}
    for name in plan.payload_names(rank):
        probe = torch.empty(plan.tensors[name].shape, dtype=plan.tensors[name].dtype, device="meta")
        for piece in _pieces(plan, rank, [(name, probe)]):
            if piece.param in params:
                continue
            shape = list(shapes[piece.param].shape)
            if engine_param(name, plan.hf)[1].split == "vocab":
                shape[0] = padded_vocab(probe.shape[0], tp) // tp
            params[piece.param] = torch.zeros(shape, dtype=piece.src.dtype, device=device)
    return params


def place(params: dict[str, torch.Tensor], named, rank: int, plan: SyncPlan) -> None:
    """Copy HF tensors into the SGLang-layout buffers of trainer rank `rank`'s engine rank."""
    for piece in _pieces(plan, rank, named):
        params[piece.param].view(-1)[piece.offset:piece.offset + piece.src.numel()].copy_(piece.src.reshape(-1))


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
