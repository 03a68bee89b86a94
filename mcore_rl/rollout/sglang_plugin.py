"""mcore_rl's SGLang plugin: loaded by SGLang itself (entry-point group `sglang.srt.plugins`) in
every engine process whose path holds `sglang_site/` (the engine actor puts it there), before the
model is built.

- `Scheduler.mcore_rl_weight_digests(path, derived)`: digests of every parameter of this TP rank, written
  atomically to `path.tp{rank}.json`. Reached through `Engine.collective_rpc`, which reports only
  success, hence the file. This is how a sync is read back and verified. `derived`: every other
  tensor the model holds too (buffers, and tensors kept as plain attributes, like MLA's `w_kc`), the
  state SGLang derives from the weights, which no read-back of the parameters covers.
- `Scheduler.mcore_rl_refresh_derived()`: state SGLang derives from the weights once and no sync
  rewrites, written again; the engine actor calls it after each resume and each weight update.
  - An FP8 model's attention layers hold their KV-cache scales as tensors in the weights region
    (`k_scale`/`v_scale`, 1.0 from SGLang's post-load step, no checkpoint weight) and divide every
    K they cache by `k_scale` (triton MLA). A weights release leaves garbage there: they are
    written back from the floats SGLang keeps beside them.
  - SGLang 0.5.17's GLM-4.5 router projects through an fp32 copy of its weight made at the first
    forward (`_weight_fp32`, "must be invalidated" if the weight changes, says its FIXME): a sync
    left the router on the first weights. The copy is rewritten in place (CUDA graphs hold its
    address).
- `Scheduler.mcore_rl_load_bucket(payloads, layout, hf)`: `rollout.sync_load: direct`, a flattened
  bucket copied straight into this rank's parameters by the read-back's own placement table
  (mcore_rl.sync.engine_layout.load_direct) instead of SGLang's `load_weights`, whose name matching
  costs tens of microseconds a tensor (384 tensors a layer of Qwen3-30B-A3B's experts).
- `Scheduler.mcore_rl_capture_hidden(path, tokens)`: each decoder layer's output in the next prefill of
  `tokens` tokens, to `path.tp{rank}.pt` (`benchmarks/engine_bench.py hidden-gap`: engine against trainer, layer by layer).
- `Scheduler.mcore_rl_check_idle()`: fails unless every TP rank of the engine is fully idle.
  SGLang asserts idleness inside the scheduler when asked to release memory, and a failed assert
  there kills the scheduler and then the engine's process (seen right after `generate` returned);
  a failed RPC is only an error reply, so the engine actor polls this before it releases.
- Seeded sampling (MCORE_RL_SEEDED_SAMPLING=1, `rollout.seeded`): SGLang samples a request with
  its own `sampling_seed` (a hash of seed, position and token: reproducible, independent of batch
  composition) only in deterministic-inference mode, which its CPU and most GPU attention backends
  refuse. The patch builds the per-request seed tensor for every batch (42 where a request has
  none, as SGLang does) so its pytorch sampler honours the seeds in any mode.
- On CPU, the MLA attention handler for `torch_native` and plain host buffers for the routed-experts
  capture (mcore_rl.rollout.sglang_cpu).
"""

from __future__ import annotations

import json
import os


def weight_digests(model, derived: bool = False) -> dict:
    """Digests of the model's weights; parameters SGLang itself leaves out of its weight checks
    (`_skip_weight_check`: an FP8 model's KV-cache k_scale/v_scale, no checkpoint weight) are left out.
    `derived`: also every buffer and tensor attribute of every module, as `derived:<module>.<name>`."""
    from mcore_rl.sync.checksum import digest

    def entry(t):
        return [str(t.dtype).removeprefix("torch."), list(t.shape), *digest(t.data)]

    out = {name: entry(p) for name, p in model.named_parameters() if not getattr(p, "_skip_weight_check", False)}
    if derived:
        import torch

        params = {id(p) for p in model.parameters()}
        for prefix, module in model.named_modules():
            held = {**module._buffers, **{k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}}
            out.update({f"derived:{prefix}.{k}": entry(t) for k, t in held.items()
                        if t is not None and id(t) not in params and t.numel() and t.device.type != "meta"})
    return out


def _scheduler_weight_digests(self, path: str, derived: bool = False) -> None:
    model = self.tp_worker.model_runner.model
    out = f"{path}.tp{_tp_rank(self)}.json"
    os.makedirs(os.path.dirname(out), exist_ok=True)  # on this rank's machine (nodes of one engine differ)
    with open(out + ".tmp", "w") as f:
        json.dump(weight_digests(model, derived), f)
    os.replace(out + ".tmp", out)


def restore_kv_scales(model) -> int:
    """Writes each attention layer's `k_scale`/`v_scale` tensor back from its `*_float` value (set by
    SGLang's post-load step); returns how many tensors were written."""
    import torch

    written = 0
    with torch.no_grad():
        for module in model.modules():
            for name in ("k_scale", "v_scale"):
                tensor, value = getattr(module, name, None), getattr(module, name + "_float", None)
                if isinstance(tensor, torch.Tensor) and value is not None:
                    tensor.fill_(value)
                    written += 1
    return written


def refresh_fp32_copies(model) -> int:
    """Rewrites each module's fp32 copy of its weight (`_weight_fp32`, SGLang 0.5.17's GLM-4.5
    router) from the weight; returns how many were written."""
    import torch

    written = 0
    with torch.no_grad():
        for module in model.modules():
            copy = getattr(module, "_weight_fp32", None)
            if isinstance(copy, torch.Tensor):
                copy.copy_(module.weight)
                written += 1
    return written


def load_bucket_direct(model, payload: bytes, layout, hf, tp_rank: int) -> None:
    """One rank's flattened bucket (SGLang's wire format: CUDA IPC handles, or shared CPU memory)
    straight into the model's parameters (mcore_rl.sync.engine_layout.load_direct)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    from mcore_rl.sync.engine_layout import load_direct

    monkey_patch_torch_reductions()  # CUDA handles carry GPU UUIDs, as SGLang's own weight updates read them
    bucket = MultiprocessingSerializer.deserialize(payload)
    load_direct(dict(model.named_parameters()), bucket["flattened_tensor"], bucket["metadata"], layout, tp_rank, hf)


def _scheduler_load_bucket(self, payloads: list, layout, hf) -> None:
    error = None
    try:
        load_bucket_direct(self.tp_worker.model_runner.model, payloads[_tp_rank(self)], layout, hf, _tp_rank(self))
    except Exception as e:  # noqa: BLE001 - every rank must hear of it: the RPC reports rank 0's outcome only
        error = e
    every_rank_ok = _on_every_rank(self, error is None)
    if error is not None:
        raise error
    if not every_rank_ok:
        raise RuntimeError("the direct weight load failed on another tp rank of this engine")


def _on_every_rank(scheduler, ok: bool) -> bool:
    """Whether `ok` holds on every TP rank of the engine (each rank runs an RPC; all must agree)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(ok)])
    group = scheduler.tp_group.cpu_group
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _tp_rank(scheduler) -> int:
    return scheduler.ps.tp_rank if hasattr(scheduler, "ps") else scheduler.tp_rank  # 0.5.17+: a parallel-state view


def _scheduler_refresh_derived(self) -> None:
    model = self.tp_worker.model_runner.model
    restore_kv_scales(model)
    refresh_fp32_copies(model)


def capture_hidden(model, out: str, tokens: int) -> list:
    """Forward hooks that keep, from the next forward of `tokens` tokens (a prefill), the residual
    stream after each decoder layer (SGLang's layers return (hidden, residual, ...), added by the next
    layer's fused norm: their sum is the stream) and write them, stacked [layers, tokens, hidden] fp32,
    to `out` atomically; the hooks remove themselves. Returns the handles."""
    import torch

    layers = model.model.layers
    kept, handles = {}, []

    def keep(i):
        def hook(module, args, output):
            parts = output if isinstance(output, tuple) else (output,)  # 0.5.20's DeepSeek layers add topk ids
            hidden = parts[0]
            residual = parts[1] if len(parts) > 1 and isinstance(parts[1], torch.Tensor) else None
            if hidden.shape[0] != tokens or i in kept:  # another batch (a warm-up, a decode step)
                return
            stream = hidden if residual is None else hidden + residual  # before the next layer adds in place
            kept[i] = stream.detach().float().cpu()
            if len(kept) == len(layers):
                for h in handles:
                    h.remove()
                torch.save(torch.stack([kept[k] for k in range(len(layers))]), out + ".tmp")
                os.replace(out + ".tmp", out)
        return hook

    handles += [layer.register_forward_hook(keep(i)) for i, layer in enumerate(layers)]
    return handles


def _scheduler_capture_hidden(self, path: str, tokens: int) -> None:
    out = f"{path}.tp{_tp_rank(self)}.pt"
    os.makedirs(os.path.dirname(out), exist_ok=True)
    capture_hidden(self.tp_worker.model_runner.model, out, tokens)


def _scheduler_check_idle(self) -> None:
    if not _on_every_rank(self, self.is_fully_idle()):  # all must be idle for the release
        raise RuntimeError("not idle")


def _seeded_sampling() -> None:
    import torch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    if "sampling_seed" not in getattr(SamplingBatchInfo, "__dataclass_fields__", {}):
        raise RuntimeError("this SGLang has no per-request sampling_seed: rollout.seeded cannot be honoured")
    original = SamplingBatchInfo.from_schedule_batch.__func__

    def from_schedule_batch(cls, batch, vocab_size):
        info = original(cls, batch, vocab_size)
        if info.sampling_seed is None:
            seeds = [r.sampling_params.sampling_seed for r in batch.reqs]
            info.sampling_seed = torch.tensor([42 if s is None else s for s in seeds], dtype=torch.int64,
                                              device=info.temperatures.device)
        return info

    SamplingBatchInfo.from_schedule_batch = classmethod(from_schedule_batch)


def register() -> None:
    from sglang.srt.managers.scheduler import Scheduler

    Scheduler.mcore_rl_weight_digests = _scheduler_weight_digests
    Scheduler.mcore_rl_check_idle = _scheduler_check_idle
    Scheduler.mcore_rl_refresh_derived = _scheduler_refresh_derived
    Scheduler.mcore_rl_load_bucket = _scheduler_load_bucket
    Scheduler.mcore_rl_capture_hidden = _scheduler_capture_hidden
    if os.environ.get("MCORE_RL_SEEDED_SAMPLING") == "1":
        _seeded_sampling()
    if os.environ.get("MCORE_RL_SGLANG_CPU") == "1":
        from mcore_rl.rollout.sglang_cpu import (register_dp_attention, register_expert_parallel,
                                                 register_host_buffers, register_mla_handler)

        register_mla_handler()
        register_host_buffers()
        register_expert_parallel()
        register_dp_attention()
