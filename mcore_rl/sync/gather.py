"""Assemble full HF tensors from a live megatron model's shards, bucket by bucket, per the plan.

TP-split parameters are all-gathered in their TP group (the expert-TP group for experts) and
turned into HF tensors by the mapping's own Transform, the same code the checkpoint converters
use; experts come whole from their owning EP rank. Tensors then move point-to-point to the
ranks whose engine rank needs them, so each GPU only ever holds the current bucket. Weights the
engine runs in FP8 are quantized as they are assembled (`mcore_rl.sync.fp8`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_rl.models.builder import global_names
from mcore_rl.models.mappings import Param
from mcore_rl.sync import fp8
from mcore_rl.sync.plan import RankBucket, SyncPlan


class LiveShards:
    """Global megatron names -> this rank's shard (parameters and the router's expert-bias buffer)."""

    def __init__(self, model, plan: SyncPlan, read=None):
        """`read(t)`: where t's values are now (offloaded trainer states: their host copy)."""
        from megatron.core import parallel_state as ps

        while hasattr(model, "module"):  # DDP / Float16Module wrappers
            model = model.module
        self.plan, self.read = plan, read or (lambda t: t)
        global_name = global_names(model, plan.hf.num_experts)
        self.local: dict[str, torch.Tensor] = {global_name(n): t for n, t in model.state_dict(keep_vars=True).items()
                                               if not n.endswith("_extra_state")}
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.etp_group = ps.get_expert_tensor_parallel_group()

    def check_holds(self, rank: int) -> None:
        """The plan's idea of what this rank holds matches the model (asserted before any transfer)."""
        want = {p for p, ranks in self.plan.holders.items() if rank in ranks}
        missing = sorted(want - set(self.local))
        if missing:
            raise RuntimeError(f"rank {rank}: the plan expects {missing[:3]} here but the model has no such "
                               "parameter (trainer layout or rank order differs from the plan)")

    def full(self, p: Param) -> dict[str, torch.Tensor]:
        """HF tensors of megatron parameter p (a collective over its TP group when TP-split)."""
        src = self.local[p.mcore]  # megatron's TP attributes live on the Parameter, not on .detach()
        t = self.read(src.detach()).to(_device(), non_blocking=True)
        if getattr(src, "tensor_model_parallel", False):
            group = self.tp_group if p.expert is None else self.etp_group  # routed experts: expert-TP
            n = dist.get_world_size(group)
            if n > 1:
                parts = [torch.empty_like(t) for _ in range(n)]
                dist.all_gather(parts, t.contiguous(), group=group)
                dim = src.partition_dim
                if p.transform.name == "glu":  # each shard is [gate_i; up_i]
                    halves = [x.chunk(2, dim=0) for x in parts]
                    t = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
                else:
                    t = torch.cat(parts, dim=dim)
        out = {}
        for h, x in p.to_hf(self.plan.hf, t).items():
            if self.plan.tensors[h].dtype == fp8.E4M3:  # quantized here, on the trainer's device
                out[h], out[fp8.scale_name(h)] = fp8.quantize(x)
            else:
                out[h] = x.to(self.plan.tensors[h].dtype)
        for h, x in out.items():
            if tuple(x.shape) != self.plan.tensors[h].shape:
                raise RuntimeError(f"{h}: assembled shape {tuple(x.shape)} but the plan says "
                                   f"{self.plan.tensors[h].shape}")
        return out


def assemble(rb: RankBucket, shards: LiveShards) -> list[tuple[str, torch.Tensor]]:
    """This rank's payload for one bucket: gather what it holds, then exchange with its peers."""
    have: dict[str, torch.Tensor] = {}
    for p in rb.gather:
        have.update(shards.full(p))
    ops = [dist.P2POp(dist.isend, _as_bytes(have[h]), dst) for h, dst in rb.sends]
    for h, src in rb.recvs:
        t = shards.plan.tensors[h]
        have[h] = torch.empty(t.shape, dtype=t.dtype, device=_device())
        ops.append(dist.P2POp(dist.irecv, _as_bytes(have[h]), src))
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return [(t.name, have[t.name]) for t in rb.payload]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """FP8 travels as its bytes (a view: receiving into it fills the FP8 tensor), so the move does not
    depend on the backend knowing float8 (older NCCL builds do not; gloo in torch 2.13 does)."""
    return t.view(torch.uint8) if t.dtype == fp8.E4M3 else t


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
