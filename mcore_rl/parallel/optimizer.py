"""Megatron's DistributedDataParallel and distributed optimizer around a policy or a critic.

Grads accumulate in fp32 buffers. At the step they are reduce-scattered over the data-parallel
ranks (dense params over DP, routed experts over expert-DP); each rank updates only its shard of
the fp32 main params and Adam moments, then the new params are all-gathered. So optimizer memory
per GPU falls with DP, and bf16 training keeps fp32 master weights. `finalize_model_grads` also
all-reduces the sequence-parallel grads (norms, router) over TP and applies MoE expert-bias updates.
Runs on CPU/gloo (with mcore_rl.patches) and on GPU/NCCL alike.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function


def wrap(model, tcfg, section: dict, grad_fp32: bool = True, *, fused_adam: bool = False,
         overlap_grad_reduce: bool = False, bucket_size: int | None = None, offload_fraction: float = 0.0,
         lr_scale: dict[str, float] | None = None):
    """(DDP-wrapped model, megatron optimizer) for `model`; `section` holds lr, weight_decay,
    grad_clip and optionally use_distributed_optimizer (the actor or critic config). Without the
    distributed optimizer grads are all-reduced and every DP rank keeps the whole state.

    fused_adam: torch's fused AdamW kernel (one pass over params, grads and moments) instead of its
    multi-tensor ops, which also allocate a temporary as large as the moments. overlap_grad_reduce:
    each grad bucket is reduce-scattered as soon as the last micro-batch's backward has filled it
    (mcore_rl.loop.schedule skips the sync on the other micro-batches); bucket_size in elements.
    offload_fraction: megatron's hybrid optimizer keeps that share of the Adam moments (and steps
    them) on the host. lr_scale: {parameter-name glob: factor}, params stepped with lr x factor (their
    own param groups, megatron's config_overrides; each group's lr is its `max_lr`)."""
    distributed = section.get("use_distributed_optimizer", True)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, ParamKey, get_megatron_optimizer

    ddp = DistributedDataParallel(tcfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_fp32, overlap_grad_reduce=overlap_grad_reduce, bucket_size=bucket_size,
        use_distributed_optimizer=distributed), model)
    offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=offload_fraction,
                   overlap_cpu_optimizer_d2h_h2d=True) if offload_fraction > 0 else {}
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=section["lr"], weight_decay=section["weight_decay"],
        adam_beta1=0.9, adam_beta2=0.999, adam_eps=section.get("adam_eps", 1e-8),
        clip_grad=section["grad_clip"], bf16=tcfg.params_dtype == torch.bfloat16,
        fp16=tcfg.params_dtype == torch.float16, params_dtype=tcfg.params_dtype,
        use_distributed_optimizer=distributed, **offload), [ddp],
        config_overrides={ParamKey(name=glob): {"max_lr": section["lr"] * f} for glob, f in (lr_scale or {}).items()}
        or None)
    for group in opt.param_groups:  # megatron's own scheduler would set them; the updates here scale max_lr
        group["lr"] = group["max_lr"]
    if fused_adam:
        use_fused_adam(opt)
    return ddp, opt


def use_fused_adam(opt) -> None:
    """Switch megatron's torch AdamW (no apex/TE here) to torch's fused kernel. The flag is read
    at every step; steps kept as host tensors (a state loaded from a non-fused run) move to the
    device, as the fused kernel wants them."""
    for sub in _subs(opt):
        inner = getattr(sub, "optimizer", None)
        if not isinstance(inner, torch.optim.AdamW):  # none on this rank, or the hybrid offload one
            continue
        for group in inner.param_groups:
            group["fused"], group["foreach"] = True, False
        for p, st in inner.state.items():
            if torch.is_tensor(st.get("step")) and st["step"].device != p.device:
                st["step"] = st["step"].to(p.device, torch.float32)


def zero_grad(ddp, opt) -> None:
    ddp.zero_grad_buffer()
    opt.zero_grad()


def step(ddp, opt) -> tuple[bool, float]:
    """Finish the grad reductions and step; returns (stepped, grad norm before clipping)."""
    from megatron.core.distributed import finalize_model_grads

    with record_function("optim/finalize_grads"):
        finalize_model_grads([ddp])
    with record_function("optim/step"):
        ok, grad_norm, _ = opt.step()
    # with bf16 grads the step made fp32 copies of this rank's shard of them (4 B an element):
    # drop them now, not at the next update's zero_grad, so they do not sit through the rollout
    opt.zero_grad()
    return bool(ok), float(grad_norm or 0.0)


def _subs(opt) -> list:
    return list(getattr(opt, "chained_optimizers", [opt]))
