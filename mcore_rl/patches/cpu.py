"""Stand-ins for the CUDA calls megatron-core 0.16.1 makes even when it builds on the CPU
(use_cpu_initialization, gloo): imported by `mcore_rl.patches.apply` on a CPU only, never on a GPU."""

from __future__ import annotations

import functools
import importlib
from typing import Callable

import torch

from mcore_rl.patches.cuda_proxy import CUDA_CALLERS, CpuTorch
from mcore_rl.patches.patch import Patch


def _redirect_cuda_device(*modules: str) -> Callable[[], None]:
    def fn():
        for name in modules:
            importlib.import_module(name).torch = CpuTorch("torch")

    return fn


def _rng_tracker_cpu():
    from megatron.core import tensor_parallel

    def seed(seed: int, *args, **kwargs):
        from megatron.core.tensor_parallel.random import initialize_rng_tracker

        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        torch.manual_seed(seed)

    tensor_parallel.model_parallel_cuda_manual_seed = seed
    tensor_parallel.random.model_parallel_cuda_manual_seed = seed


def _recompute_rng_cpu():
    from megatron.core.tensor_parallel import random

    # the CPU generator is saved and restored beside it already: the "CUDA" state is a stand-in
    random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    random._set_cuda_rng_state = lambda *args, **kwargs: None


def _optimizer_param_types_cpu():
    """megatron's optimizers sort parameters (and check grads) by `.type()` names of CUDA tensors
    ('torch.cuda.FloatTensor'); inside those calls, CPU tensors answer with those names."""
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    real = torch.Tensor.type

    def cuda_named(t, *args, **kwargs):
        if args or kwargs or t.is_cuda:
            return real(t, *args, **kwargs)
        return real(t).replace("torch.", "torch.cuda.", 1)

    def with_cuda_names(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            before, torch.Tensor.type = torch.Tensor.type, cuda_named
            try:
                return fn(*args, **kwargs)
            finally:
                torch.Tensor.type = before

        return wrapped

    for cls in (distrib_optimizer.DistributedOptimizer, optimizer.Float16OptimizerWithFloat16Params):
        cls.__init__ = with_cuda_names(cls.__init__)
    for module in (clip_grads, optimizer):  # optimizer.py imported the function by name
        module.clip_grad_by_total_norm_fp32 = with_cuda_names(clip_grads.clip_grad_by_total_norm_fp32)


def _tied_embeddings_cpu():
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup = LanguageModule.setup_embeddings_and_output_layer

    def cpu_setup(self):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t
        try:
            setup(self)
        finally:
            torch.Tensor.cuda = cuda

    LanguageModule.setup_embeddings_and_output_layer = cpu_setup


PATCHES = (
    Patch("cpu_device", "rope, router, GPT buffers and the checkpoint writer call torch.cuda "
          "(current_device, synchronize) even with use_cpu_initialization", _redirect_cuda_device(*CUDA_CALLERS)),
    Patch("cpu_rng", "model_parallel_cuda_manual_seed asserts CUDA", _rng_tracker_cpu),
    Patch("cpu_tied_embeddings", "tied embeddings are moved to CUDA to be all-reduced between the "
          "first and last pipeline stage", _tied_embeddings_cpu),
    Patch("cpu_recompute_rng", "activation recompute saves and restores the CUDA RNG state", _recompute_rng_cpu),
    Patch("cpu_optimizer_param_types", "megatron's (distributed) optimizer accepts only parameters "
          "whose .type() names a CUDA tensor", _optimizer_param_types_cpu),
)
