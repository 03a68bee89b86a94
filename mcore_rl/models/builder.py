"""Build a megatron-core GPTModel for an HF architecture at the current parallel layout."""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import torch

from mcore_rl import patches
from mcore_rl.metrics import console
from mcore_rl.patches import no_te
from mcore_rl.models.config import HFModel, UnsupportedModelError, _rope_scaling, _rope_theta



def sharded_state_dict(model) -> dict:
    """The model's sharded state dict as every save and load in mcore_rl uses it.

    One key per layer and per expert, and gate/up halves of GLU weights as their own keys:
    checkpoint keys stay 1:1 with whole tensors, so converters can stream them without
    knowing the writer's layout. Extra state (empty without TE) is left out.
    """
    # megatron adds process groups to the metadata dict, so each call gets a fresh one
    metadata = {"non_homogeneous_layers": True, "singleton_local_shards": True}
    return {k: v for k, v in model.sharded_state_dict(metadata=metadata).items()
            if not k.endswith("_extra_state")}


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def global_names(model, num_experts: int) -> Callable[[str], str]:
    """Local state-dict name -> the name in the unsharded model (TP=PP=EP=1), as the mappings name
    parameters: this stage's layers and this EP rank's experts by their global numbers."""
    from megatron.core import parallel_state as ps

    layer_of = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    local = num_experts // ps.get_expert_model_parallel_world_size() if num_experts else 0
    base = ps.get_expert_model_parallel_rank() * local

    def global_name(name: str) -> str:
        name = _LAYER.sub(lambda m: f"decoder.layers.{layer_of[int(m.group(1))]}.", name)
        return _EXPERT.sub(lambda m: f".local_experts.{base + int(m.group(1))}.", name)

    return global_name


def _rewrite_spec(spec, norm, core_attention, moe: dict | None = None, activation=None):
    """Swap megatron's local norms and core attention (and MoE classes, `moe`) for ours in a spec tree;
    `activation`: the module every MLP (dense, shared and routed experts) applies to its fc1 output."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    norms = {WrappedTorchNorm}
    try:
        from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
        norms.add(FusedLayerNorm)
    except ImportError:  # pragma: no cover
        pass

    def fix(x):
        if isinstance(x, type):
            if x in norms:
                return norm
            if x is DotProductAttention:
                return core_attention
            return (moe or {}).get(x, x)
        if isinstance(x, ModuleSpec):
            x.module = fix(x.module)
            if x.submodules is not None:
                x.submodules = fix(x.submodules)
            return x
        if isinstance(x, (list, tuple)):
            return type(x)(fix(v) for v in x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                setattr(x, f.name, fix(getattr(x, f.name)))
            if isinstance(x, MLPSubmodules) and activation is not None and x.activation_func is None:
                x.activation_func = activation
            return x
        return x

    return fix(spec)


def use_te() -> bool:
    return no_te.have_te() and torch.cuda.is_available()


def layer_spec(config, vp_stage=None, fast_moe: bool = True, attention: str = "sdpa"):
    """megatron's local decoder spec with our norm and attention; with fast_moe, grouped-GEMM
    experts (same parameters, same results). attention: packed sequences as one SDPA call per
    sequence ("sdpa") or one variable-length flash call per micro-batch ("varlen", CUDA)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.router import TopKRouter

    from mcore_rl.models.experts import GroupedGemmExperts
    from mcore_rl.models.layers import CORE_ATTENTION, RMSNorm, SwiGLU
    from mcore_rl.models.router import ModelRouter, wants_model_router

    if attention not in CORE_ATTENTION:
        raise ValueError(f"attention {attention!r}: expected one of {sorted(CORE_ATTENTION)}")
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                      normalization="RMSNorm", vp_stage=vp_stage)
    moe = {SequentialMLP: GroupedGemmExperts} if fast_moe else {}
    if wants_model_router(config):  # DeepSeek's group ranking, unnormalised sigmoid weights
        moe[TopKRouter] = ModelRouter
    # megatron applies a spec's activation module only with use_te_activation_func (TE or not), else its GLU
    activation = SwiGLU if config.use_te_activation_func else None
    return _rewrite_spec(spec, RMSNorm, CORE_ATTENTION[attention], moe, activation)


def build_model(hf: HFModel, config, *, vp_stage=None, pre_process=None, post_process=None,
                fast_moe: bool = True, attention: str = "sdpa"):
    """A GPTModel for `hf` on this rank's pipeline stage (parallel_state must be initialised).

    fast_moe=False keeps megatron's per-expert loop and scatter-add permutation (for comparisons).
    """
    console.quiet_fallback_warnings()  # before the imports below pull in megatron's model modules
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    patches.apply()
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    rope = dict(position_embedding_type="rope", rotary_base=_rope_theta(hf), rotary_percent=hf.rotary_fraction)
    rs = _rope_scaling(hf)
    if rs and not hf.is_mla:
        if rs["rope_type"] != "llama3" or (rs.get("low_freq_factor", 1), rs.get("high_freq_factor", 4),
                                           rs.get("original_max_position_embeddings", 8192)) != (1, 4, 8192):
            raise UnsupportedModelError(f"rope_scaling {rs} is not supported")
        rope.update(rope_scaling=True, rope_scaling_factor=float(rs["factor"]))
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, vp_stage, fast_moe, attention),
        vocab_size=hf.vocab_size,
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=hf.tied,
        parallel_output=True,
        vp_stage=vp_stage,
        **rope,
    )
    if fast_moe:
        from mcore_rl.models.dispatch import use_gather_permutation

        use_gather_permutation(model)
    if not config.use_cpu_initialization and torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
