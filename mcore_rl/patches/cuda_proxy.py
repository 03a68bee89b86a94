"""`CpuTorch`, the `torch` a megatron module sees where CUDA must stay untouched: its `torch.cuda`
is the CPU. The CPU patches give it to megatron's CUDA callers for a whole CPU run; on a GPU host,
`mcore_rl.patches.cuda_untouched` gives it to them while the planner or the converter builds a
meta-device skeleton on the driver, which must hold no CUDA context."""

from __future__ import annotations

import contextlib
import functools
import sys
import types

import torch


class CpuCuda:
    """Stands in for `torch.cuda` inside a megatron module: current_device() is the CPU."""

    def __getattr__(self, item):
        return getattr(torch.cuda, item)

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def synchronize(*_, **__):
        return None  # nothing to wait for on the CPU


FACTORIES = frozenset({"tensor", "zeros", "ones", "empty", "full", "arange"})


def on_cpu(factory, *args, device=None, **kwargs):
    if device == "cuda" or getattr(device, "type", None) == "cuda":
        device = "cpu"
    return factory(*args, device=device, **kwargs)


class CpuTorch(types.ModuleType):
    """`torch` as seen by a patched megatron module: `cuda` is the CPU and tensor factories given
    device='cuda' allocate on the CPU; everything else is the real torch."""

    cuda = CpuCuda()

    def __getattr__(self, item):
        attr = getattr(torch, item)
        return functools.partial(on_cpu, attr) if item in FACTORIES else attr


# megatron modules that call torch.cuda (current_device, synchronize) or allocate on "cuda" even with
# use_cpu_initialization
CUDA_CALLERS = tuple(f"megatron.core.{m}" for m in (
    "models.common.embeddings.rotary_pos_embedding",
    "models.common.embeddings.yarn_rotary_pos_embedding",
    "models.gpt.gpt_model",
    "tensor_parallel.mappings", "tensor_parallel.layers", "tensor_parallel.utils",
    "tensor_parallel.data", "utils",
    "transformer.module", "transformer.transformer_layer", "transformer.attention",
    "transformer.moe.router", "transformer.moe.moe_layer", "transformer.moe.experts",
    "transformer.moe.token_dispatcher", "transformer.moe.moe_utils",
    "pipeline_parallel.p2p_communication",
    "distributed.distributed_data_parallel", "distributed.param_and_grad_buffer",
    "optimizer.optimizer", "optimizer.distrib_optimizer", "optimizer.clip_grads",
    "pipeline_parallel.schedules",
    "dist_checkpointing.strategies.filesystem_async",
    "dist_checkpointing.strategies.state_dict_saver",
))


@contextlib.contextmanager
def without_module(name: str):
    """Within: `import name` raises ImportError unless it is imported already. megatron's models
    import flashinfer when present, and flashinfer's import opens a CUDA context (it asks the device's
    compute capability): a process that only plans (the driver) must not import it."""
    if name in sys.modules:
        yield
        return
    sys.modules[name] = None
    try:
        yield
    finally:
        if sys.modules.get(name, 0) is None:
            del sys.modules[name]
