"""Compatibility patches for megatron-core without TransformerEngine and on CPU.

Every patch is named, says in one line why it exists, and is applied only for the
megatron-core versions it was written against. `apply()` is idempotent and must run
before a model is built (`mcore_rl.models.build_model` calls it).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import logging
import os
import sys
import types
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger(__name__)

PATCHED_VERSIONS = ("0.16.",)


@dataclass(frozen=True)
class Patch:
    name: str
    why: str
    fn: Callable[[], None]
    cpu_only: bool = False


# Comma-separated patch names that apply() leaves out (benchmarks measure the unpatched path).
SKIP_ENV = "MCORE_RL_SKIP_PATCHES"


class _CpuCuda:
    """Stands in for `torch.cuda` inside a megatron module: current_device() is the CPU."""

    def __getattr__(self, item):
        return getattr(torch.cuda, item)

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def synchronize(*_, **__):
        return None  # nothing to wait for on the CPU


_FACTORIES = frozenset({"tensor", "zeros", "ones", "empty", "full", "arange"})


def _on_cpu(factory, *args, device=None, **kwargs):
    if device == "cuda" or getattr(device, "type", None) == "cuda":
        device = "cpu"
    return factory(*args, device=device, **kwargs)


class _CpuTorch(types.ModuleType):
    """`torch` as seen by a patched megatron module: `cuda` is the CPU and tensor factories given
    device='cuda' allocate on the CPU; everything else is the real torch."""

    cuda = _CpuCuda()

    def __getattr__(self, item):
        attr = getattr(torch, item)
        return functools.partial(_on_cpu, attr) if item in _FACTORIES else attr


def _redirect_cuda_device(*modules: str) -> Callable[[], None]:
    def fn():
        for name in modules:
            importlib.import_module(name).torch = _CpuTorch("torch")

    return fn


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


# those of them a model build runs (not the optimizer's or the checkpoint writer's, whose code a
# background save may be running in another thread of the same process)
BUILD_CUDA_CALLERS = tuple(m for m in CUDA_CALLERS if m.startswith(
    ("megatron.core.models.", "megatron.core.transformer.", "megatron.core.tensor_parallel.")))


@contextlib.contextmanager
def cuda_untouched(modules: tuple[str, ...] = BUILD_CUDA_CALLERS):
    """Within: flashinfer is not imported and `modules` see the CPU as their torch.cuda, so importing
    megatron and a meta-device build (the planner's and converter's skeleton) open no CUDA context on
    a GPU host. megatron's models import flashinfer, whose import asks the GPU; RoPE and the router ask
    torch.cuda.current_device() (MLA's RoPE ignores use_cpu_initialization). 0.6 GiB held all run
    otherwise."""
    with without_module("flashinfer"):
        apply()  # first: what is restored below must include the CPU patches a build inside would apply
        mods = [importlib.import_module(m) for m in modules]
        saved = [m.torch for m in mods]
        for m in mods:
            m.torch = _CpuTorch("torch")
        try:
            yield
        finally:
            for m, t in zip(mods, saved):
                m.torch = t


def _mla_no_te():
    from megatron.core.transformer import multi_latent_attention as mla

    from megatron.core.extensions import transformer_engine as te_ext  # noqa: F401

    if not _have_te():
        mla.HAVE_TE = False


def _moe_gemm_no_te():
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


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


# the config of the router that is routing now (None outside TopKRouter.routing): read by the
# routing patches below, which change megatron's functions for routers whose config asks for it
_ROUTER_CONFIG: contextvars.ContextVar = contextvars.ContextVar("router_config", default=None)


def _router_config_scope():
    """TopKRouter.routing sets _ROUTER_CONFIG to its config while it runs (installed once)."""
    from megatron.core.transformer.moe import router

    routing = router.TopKRouter.routing
    if getattr(routing, "_sets_router_config", False):
        return

    @functools.wraps(routing)
    def routing_in_scope(self, *args, **kwargs):
        token = _ROUTER_CONFIG.set(self.config)
        try:
            return routing(self, *args, **kwargs)
        finally:
            _ROUTER_CONFIG.reset(token)

    routing_in_scope._sets_router_config = True
    router.TopKRouter.routing = routing_in_scope


def _deepseek_group_routing():
    """Group-limited routing ranks each token's expert groups by the sum of a group's top-n scores:
    megatron-core takes n = topk / group_topk, DeepSeek-V3 n = 2 and DeepSeek-V2's
    group_limited_greedy n = 1 (the group's best expert), whatever the top-k. A router whose config
    carries `moe_router_group_score_topk` (mcore_rl.models.transformer_config sets it) ranks with that n."""
    from megatron.core.transformer.moe import moe_utils

    def group_limited_topk(scores, topk, num_tokens, num_experts, num_groups, group_topk):
        n = getattr(_ROUTER_CONFIG.get(), "moe_router_group_score_topk", None) or topk // group_topk
        grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
        group_scores = grouped.topk(n, dim=-1).values.sum(dim=-1)
        chosen = group_scores.topk(group_topk, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        masked = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)
        return torch.topk(masked, k=topk, dim=-1)

    moe_utils.group_limited_topk = group_limited_topk  # looked up by name when the top-k is taken
    _router_config_scope()


def _sigmoid_topk_without_norm():
    """DeepSeek-V3 and GLM-4.5 configs with norm_topk_prob=false weight each chosen expert by its
    sigmoid score times routed_scaling_factor; megatron-core always divides the top-k sigmoid
    scores by their sum. A router whose config carries `moe_router_sigmoid_norm_topk = False`
    (mcore_rl.models.transformer_config sets it) keeps megatron's choice of experts (groups,
    expert bias, router replay) and takes the unnormalised scores."""
    from megatron.core.transformer.moe import router

    topk_routing = router.topk_routing_with_score_function

    @functools.wraps(topk_routing)
    def routing_maybe_unnormalised(logits, topk, *args, **kwargs):
        probs, routing_map = topk_routing(logits, topk, *args, **kwargs)
        keep_norm = getattr(_ROUTER_CONFIG.get(), "moe_router_sigmoid_norm_topk", True) is not False
        if keep_norm or kwargs.get("score_function") != "sigmoid":
            return probs, routing_map
        # what megatron computes before it normalises: sigmoid in fp32, cast back, times the scale
        scores = torch.sigmoid(logits.float()).type_as(logits)
        scale = kwargs.get("scaling_factor")
        if scale:
            scores = scores * scale
        return torch.where(routing_map, scores, torch.zeros_like(scores)), routing_map

    router.topk_routing_with_score_function = routing_maybe_unnormalised  # router.py imported it by name
    _router_config_scope()


def _expert_bias_padding_mask():
    """Count only unpadded tokens for the expert-bias update: 0.16's TopKRouter ANDs its [tokens,
    experts] routing map with the [tokens] padding mask, which does not broadcast (megatron-core
    later fixed this the same way: the mask drops whole token rows)."""
    from megatron.core.transformer.moe.router import TopKRouter

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if self.enable_expert_bias and torch.is_grad_enabled():  # as megatron: not in eval or recompute
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    TopKRouter._apply_expert_bias = _apply_expert_bias


def _padding_mask_later_stages():
    """GPTModel splits the padding mask over sequence-parallel ranks on the first pipeline stage
    only; later stages' MoE layers got the whole sequence's mask beside their slice of tokens."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel

    preprocess = GPTModel._preprocess

    @functools.wraps(preprocess)
    def split_on_every_stage(self, *args, padding_mask=None, **kwargs):
        if padding_mask is not None and not self.pre_process and self.config.sequence_parallel:
            padding_mask = tensor_parallel.scatter_to_sequence_parallel_region(
                padding_mask.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()
        return preprocess(self, *args, padding_mask=padding_mask, **kwargs)

    GPTModel._preprocess = split_on_every_stage


def _rope_thd_without_sync():
    """Packed (THD) RoPE gathers each token's frequencies by its position in its sequence, computed
    on the device. megatron's version splits the tensor per sequence with `cu_seqlens.tolist()` and
    compares `freqs.size(0) == cu_seqlens[-1]`: two host syncs per call, four per MLA layer."""
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_thd

    def thd(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0,
            cp_group=None):
        if cp_group is None or cp_group.size() != 1:
            return original(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                            multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
        total = t.shape[0]  # == cu_seqlens[-1]: THD holds every sequence's tokens, no padding
        if freqs.dim() >= 1 and freqs.size(0) == total:  # megatron's offset mapping: packed positions
            packed = freqs[:total]
        else:  # each sequence from position 0
            starts = cu_seqlens[:-1].long()
            first = torch.repeat_interleave(starts, cu_seqlens[1:].long() - starts, output_size=total)
            packed = freqs[torch.arange(total, device=t.device) - first]
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), packed, rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention, mscale=mscale).squeeze(1)

    thd.__wrapped__ = original
    rope_utils._apply_rotary_pos_emb_thd = thd


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm's contract: ([total norm] on the device, None)."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale's contract: dst[i] = src[i] * scale."""
    src, dst = tensor_lists
    if src is dst:
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _grad_norm_without_sync():
    """Without apex or TE megatron falls back to local multi-tensor helpers; its l2 norm turns
    every grad's norm into a Python float (one host sync per tensor, ~1000 per optimizer step
    for a Moonlight layer stack) and its scale loops over tensors. Foreach kernels do both on
    the device."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _foreach_l2_norm
    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = _foreach_scale


PATCHES = (
    Patch("expert_bias_padding_mask", "the expert-bias token count ANDs a [tokens, experts] map "
          "with a [tokens] padding mask (a shape error)", _expert_bias_padding_mask),
    Patch("padding_mask_later_stages", "the padding mask is split over sequence-parallel ranks on "
          "the first pipeline stage only", _padding_mask_later_stages),
    Patch("deepseek_group_routing", "megatron ranks expert groups by top-(topk/group_topk) sums, "
          "DeepSeek-V3 by top-2 sums and DeepSeek-V2 by the group's best score",
          _deepseek_group_routing),
    Patch("sigmoid_topk_without_norm", "megatron renormalises sigmoid top-k weights; DeepSeek-V3 and "
          "GLM-4.5 with norm_topk_prob=false do not", _sigmoid_topk_without_norm),
    Patch("mla_no_te", "MLA believes TE is present when TE's import was replaced by a MagicMock",
          _mla_no_te),
    Patch("moe_gemm_no_te", "moe_utils calls te_general_gemm, undefined when TE is absent",
          _moe_gemm_no_te),
    Patch("cpu_device", "rope, router, GPT buffers and the checkpoint writer call torch.cuda "
          "(current_device, synchronize) even with use_cpu_initialization", _redirect_cuda_device(*CUDA_CALLERS),
          cpu_only=True),
    Patch("cpu_rng", "model_parallel_cuda_manual_seed asserts CUDA", _rng_tracker_cpu,
          cpu_only=True),
    Patch("cpu_tied_embeddings", "tied embeddings are moved to CUDA to be all-reduced between the "
          "first and last pipeline stage", _tied_embeddings_cpu, cpu_only=True),
    Patch("cpu_recompute_rng", "activation recompute saves and restores the CUDA RNG state",
          _recompute_rng_cpu, cpu_only=True),
    Patch("cpu_optimizer_param_types", "megatron's (distributed) optimizer accepts only parameters "
          "whose .type() names a CUDA tensor", _optimizer_param_types_cpu, cpu_only=True),
    Patch("rope_thd_no_sync", "packed-sequence RoPE syncs with the host twice per call",
          _rope_thd_without_sync),
    Patch("grad_norm_no_sync", "the grad-norm fallback without apex/TE syncs with the host once per "
          "tensor", _grad_norm_without_sync),
)

# ---- vLLM (the rollout engine of `rollout.engine=vllm`), patched where it is used -----------------
VLLM_REPACK_VERSIONS = ("0.32.",)


def vllm_repack_reloaded_experts(model, names: list[str]) -> list[str]:
    """vllm_moe_reload_prepack: vLLM 0.32's in-place reload leaves MoE experts in checkpoint layout.
    `UnquantizedFusedMoEMethod._setup_kernel` runs `moe_kernel.fused_experts.process_weights_after_loading`
    (on CPU: the prepack into its grouped-GEMM layout) only when the kernel is first built, and a reload
    finds it built; the experts then compute garbage, even after reloading identical weights. Run it
    for the MoE layers whose experts `names` (HF names, one reload) contained. Only the prepack is
    re-run, never twice for a load, so it must not run on a vLLM that fixed this: gated on version.
    Returns the modules repacked."""
    import vllm

    if not vllm.__version__.startswith(VLLM_REPACK_VERSIONS):
        log.warning("vLLM %s is not one vllm_moe_reload_prepack was written for (%s); not applied",
                    vllm.__version__, VLLM_REPACK_VERSIONS)
        return []
    layers = {n.partition(".mlp.experts.")[0] for n in names if ".mlp.experts." in n}
    done = []
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and hasattr(module, "w13_weight") and name.partition(".mlp.")[0] in layers:
            kernel.fused_experts.process_weights_after_loading(module)
            done.append(name)
    return done


_applied: set[str] = set()

# optional accelerators megatron-core falls back from: (name, module)
ACCELERATORS = (("TransformerEngine", "transformer_engine"), ("Apex", "apex"))

# what megatron-core (and torch beneath it) warns about in every process, at import or first use,
# none of it the user's to act on: (message regex, module regex)
_NOT_ACTIONABLE = (
    (r"(Transformer Engine and Apex are|Apex is) not installed", r"megatron\."),
    (r"full scope is deprecated", r"megatron\."),  # megatron's own cuda_graph_scope default
    (r"The \.grad attribute of a Tensor that is not a leaf", r"megatron\."),
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", r"torch\."),
)


def quiet_fallback_warnings() -> None:
    """Silence the warnings above in this process (idempotent); call before megatron is imported.
    A run names the missing accelerators once instead (`accelerators_line`)."""
    for message, module in _NOT_ACTIONABLE:  # filterwarnings replaces an identical filter
        warnings.filterwarnings("ignore", message=message, module=module)


def missing_accelerators() -> list[str]:
    return [name for name, module in ACCELERATORS if not _importable(module)]


def accelerators_line() -> str:
    missing = missing_accelerators()
    if not missing:
        return "optional accelerators: " + ", ".join(name for name, _ in ACCELERATORS) + " present"
    return (f"optional accelerators not installed: {', '.join(missing)} "
            "(megatron-core uses its local PyTorch fallbacks)")


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # absent, or present but unusable: megatron falls back either way
        return False
    return True


def _have_te() -> bool:
    return _importable("transformer_engine")


def megatron_version() -> str:
    from megatron.core.package_info import __version__

    return __version__


def apply(cpu: bool | None = None) -> list[str]:
    """Apply the patches that this megatron-core version and device need; return their names."""
    version = megatron_version()
    if not version.startswith(PATCHED_VERSIONS):
        log.warning("megatron-core %s is not one the compat patches were written for (%s); "
                    "applying none", version, PATCHED_VERSIONS)
        return []
    cpu = (not torch.cuda.is_available()) if cpu is None else cpu
    skip = {n.strip() for n in os.environ.get(SKIP_ENV, "").split(",") if n.strip()}
    unknown = skip - {p.name for p in PATCHES}
    if unknown:
        raise ValueError(f"{SKIP_ENV} names unknown patches: {sorted(unknown)}")
    for patch in PATCHES:
        if patch.name in _applied or patch.name in skip or (patch.cpu_only and not cpu):
            continue
        patch.fn()
        _applied.add(patch.name)
        log.debug("compat patch %s: %s", patch.name, patch.why)
    return sorted(_applied)
