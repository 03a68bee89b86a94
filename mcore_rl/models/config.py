"""HuggingFace `config.json` -> megatron-core TransformerConfig, one function per family."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from mcore_rl.preflight.bad_input import BadInput, hf_config
from mcore_rl.models.checks import hf_config_problems, num_experts, unknown_type
from mcore_rl.models.families import FAMILY_DEFAULTS


class UnsupportedModelError(BadInput):
    pass


@dataclass(frozen=True)
class HFModel:
    """The facts about an HF model that the model builder and the mappings need."""

    model_type: str
    cfg: dict[str, Any] = field(repr=False)

    @classmethod
    def from_dir(cls, path: str) -> "HFModel":
        return cls.from_dict(hf_config(path))

    @classmethod
    def checked_dir(cls, path: str) -> "HFModel":
        """from_dir for a model given by the user (the converters): a config.json lacking a size,
        or one the builder cannot take, is refused with one line naming the file."""
        cfg = hf_config(path)
        problems = hf_config_problems(cfg, complete=True)
        if problems:
            raise UnsupportedModelError(f"{path}/config.json: " + "; ".join(problems))
        return cls.from_dict(cfg)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "HFModel":
        model_type = cfg.get("model_type")
        if unknown_type(model_type):
            raise UnsupportedModelError(unknown_type(model_type))
        return cls(model_type, dict(cfg))

    def __getattr__(self, item):
        if item == "cfg":  # not set yet (unpickling): looking it up in itself would recurse forever
            raise AttributeError(item)
        if item in self.cfg:
            return self.cfg[item]
        if item in FAMILY_DEFAULTS[self.model_type]:
            return FAMILY_DEFAULTS[self.model_type][item]
        raise AttributeError(item)

    def get(self, key, default=None):
        """The config's value, else the family's default (mcore_rl.models.families), else `default`."""
        if key in self.cfg:
            return self.cfg[key]
        return FAMILY_DEFAULTS[self.model_type].get(key, default)

    # ---- structure -----------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        return self.model_type in ("deepseek_v3", "deepseek_v2")

    @property
    def num_layers(self) -> int:
        return self.cfg["num_hidden_layers"]

    @property
    def num_experts(self) -> int:
        return num_experts({**self.cfg, "model_type": self.model_type})

    @property
    def num_shared_experts(self) -> int:
        """Shared experts per MoE layer (Qwen3-MoE has none, whatever its config carries)."""
        return 0 if self.model_type == "qwen3_moe" else int(self.get("n_shared_experts") or 0)

    @property
    def sigmoid_routing(self) -> bool:
        """DeepSeek-V3's router (GLM-4.5's too): sigmoid scores, the e_score_correction_bias
        choosing, groups ranked by their top-2 sums (transformers ignores scoring_func)."""
        return self.model_type in ("deepseek_v3", "glm4_moe")

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2" or bool(self.get("attention_bias", False))

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm of q and k before RoPE: always in Qwen3, optional in GLM-4.5."""
        return self.model_type in ("qwen3", "qwen3_moe") or bool(self.get("use_qk_norm", False))

    @property
    def rotary_fraction(self) -> float:
        """The share of each head's dims that RoPE rotates (GLM-4.5: the first half)."""
        rp = self.cfg.get("rope_parameters") or {}
        return float(self.cfg.get("partial_rotary_factor") or rp.get("partial_rotary_factor")
                     or self.get("partial_rotary_factor"))

    @property
    def q_lora(self) -> bool:
        return self.is_mla and self.get("q_lora_rank") is not None

    @property
    def tied(self) -> bool:
        return bool(self.get("tie_word_embeddings", False))

    def is_moe_layer(self, layer: int) -> bool:
        if not self.num_experts:
            return False
        if self.model_type == "qwen3_moe":  # dense layers anywhere, as transformers' Qwen3MoeDecoderLayer
            return (layer not in (self.get("mlp_only_layers") or [])
                    and (layer + 1) % (self.get("decoder_sparse_step") or 1) == 0)
        k = self.get("first_k_dense_replace", 0)
        freq = self.get("moe_layer_freq", 1)
        return layer >= k and layer % freq == 0

    @property
    def num_kv_heads(self) -> int:
        return self.get("num_key_value_heads") or self.cfg["num_attention_heads"]

    @property
    def head_dim(self) -> int:
        return self.get("head_dim") or self.cfg["hidden_size"] // self.cfg["num_attention_heads"]


def _rope_scaling(m: HFModel) -> dict[str, Any] | None:
    rs = m.get("rope_scaling") or m.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    return None if kind in (None, "default") else {**rs, "rope_type": kind}


def _rope_theta(m: HFModel) -> float:
    rp = m.get("rope_parameters") or {}
    return float(m.cfg.get("rope_theta") or rp.get("rope_theta") or m.get("rope_theta"))


def transformer_config(m: HFModel, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1,
                       dtype: torch.dtype = torch.float32, cpu: bool | None = None,
                       sequence_parallel: bool | None = None, recompute: bool | str = False,
                       recompute_layers: int | None = None, recompute_modules: tuple[str, ...] = ("moe",),
                       pp_first_layers: int | None = None, pp_last_layers: int | None = None,
                       **overrides):
    """Build the megatron-core (MLA)TransformerConfig for `m` at a parallel layout.

    recompute: False/"none", True/"full" (each layer's input kept; recompute_layers: only the first
    N layers of a stage) or "selective" (megatron's recompute_modules)."""
    from megatron.core.transformer.transformer_config import (MLATransformerConfig,
                                                              TransformerConfig)

    cpu = (not torch.cuda.is_available()) if cpu is None else cpu
    moe = m.num_experts > 0
    if sequence_parallel is None:
        sequence_parallel = tp > 1 and moe  # MoE + TP in training mode requires it
    if pp > 1 and m.num_layers % pp and pp_first_layers is None and pp_last_layers is None:
        # uneven split (e.g. DeepSeek-V3's 61 layers): the remainder goes to the last stage
        pp_first_layers = m.num_layers // pp
        pp_last_layers = m.num_layers - (pp - 1) * pp_first_layers
    common: dict[str, Any] = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=m.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        # the MLPs' SwiGLU is the spec's module (mcore_rl.models.layers.SwiGLU: fp32, rounded once, as the
        # engines' kernels), which megatron applies under this name with or without TE
        use_te_activation_func=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp if moe else None,
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        use_cpu_initialization=cpu,
        perform_initialization=True,
        init_method_std=m.get("initializer_range", 0.02),
        attention_softmax_in_fp32=True,
        num_layers_in_first_pipeline_stage=pp_first_layers,
        num_layers_in_last_pipeline_stage=pp_last_layers,
    )
    common.update(_recompute_config({True: "full", False: "none"}.get(recompute, recompute),
                                    recompute_layers, recompute_modules))
    if moe:
        common.update(_moe_config(m))
    if m.is_mla:
        common.update(_mla_config(m))
        cls = MLATransformerConfig
    else:
        common.update(_gqa_config(m))
        cls = TransformerConfig
    common.update(overrides)
    config = cls(**common)
    groups = group_routing(m) if moe else None
    if groups and config.moe_router_num_groups:
        # not a megatron field: read by mcore_rl.models.router.ModelRouter, given in the layer spec
        config.moe_router_group_score_topk = groups[2]
    if moe and m.sigmoid_routing and not m.get("norm_topk_prob", True) and m.num_experts_per_tok > 1:
        # not a megatron field (megatron always renormalises sigmoid top-k weights): read by
        # mcore_rl.models.router.ModelRouter
        config.moe_router_sigmoid_norm_topk = False
    return config


def _recompute_config(mode: str, layers: int | None, modules: tuple[str, ...]) -> dict[str, Any]:
    if mode == "none":
        return {}
    if mode == "full":
        if layers:
            return dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=layers)
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if mode == "selective":
        return dict(recompute_granularity="selective", recompute_modules=list(modules))
    raise ValueError(f"recompute {mode!r}: expected none, full or selective")


def _gqa_config(m: HFModel) -> dict[str, Any]:
    out = dict(
        num_query_groups=m.num_kv_heads,
        kv_channels=m.head_dim,
        add_qkv_bias=m.qkv_bias,
        qk_layernorm=m.qk_norm,
    )
    if m.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=True is not supported")
    if m.get("use_sliding_window") and m.get("sliding_window"):
        raise UnsupportedModelError(f"{m.model_type} with use_sliding_window=true (sliding_window="
                                    f"{m.get('sliding_window')}) is not supported: attention here is full causal")
    return out


def _mla_config(m: HFModel) -> dict[str, Any]:
    rs = _rope_scaling(m)
    out: dict[str, Any] = dict(
        q_lora_rank=m.get("q_lora_rank"),
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_nope_head_dim,
        qk_pos_emb_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rotary_base=_rope_theta(m),
        qk_layernorm=True,  # the local MLA spec creates q/kv latent norms only when this is set
        num_query_groups=m.num_attention_heads,
        kv_channels=m.v_head_dim,
    )
    if rs is None:
        out.update(rope_type="rope", rotary_scaling_factor=1.0)
    elif rs["rope_type"] == "yarn":
        out.update(rope_type="yarn", rotary_scaling_factor=float(rs["factor"]),
                   original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                   beta_fast=float(rs.get("beta_fast", 32)), beta_slow=float(rs.get("beta_slow", 1)),
                   mscale=float(rs.get("mscale", 1.0)),
                   mscale_all_dim=float(rs.get("mscale_all_dim", 0.0)))
    else:
        raise UnsupportedModelError(f"rope_scaling type {rs['rope_type']!r} is not supported for MLA")
    return out


def group_routing(m: HFModel) -> tuple[int, int, int] | None:
    """(n_group, topk_group, n): each token picks its top-k experts within the topk_group of the
    n_group expert groups whose top-n scores sum highest, as DeepSeek routes; None: no group limit.

    DeepSeek-V3 ranks a group by its top-2 scores (with the expert bias), DeepSeek-V2's
    group_limited_greedy by its best one; V2's greedy ignores the groups. megatron-core ranks by
    the top k / topk_group: mcore_rl.models.router.ModelRouter takes n.
    """
    E, k = m.num_experts, m.num_experts_per_tok
    n_group, topk_group = m.get("n_group") or 1, m.get("topk_group") or 1
    if m.sigmoid_routing:
        n = 2
    elif m.get("topk_method", "greedy") == "group_limited_greedy":
        n = 1
    else:
        return None
    if n_group == 1:
        return None  # one group, always chosen: no limit
    problems = []
    if E % n_group:
        problems.append(f"n_group={n_group} does not divide n_routed_experts={E}")
    elif E // n_group < n:
        problems.append(f"groups of {E // n_group} expert(s) cannot be ranked by their top-{n} scores")
    if not 1 <= topk_group <= n_group:
        problems.append(f"topk_group={topk_group} must be within 1..n_group={n_group}")
    elif topk_group * (E // n_group) < k:
        problems.append(f"top-{k} cannot be chosen from {topk_group} group(s) of {E // n_group} experts")
    if problems:
        raise UnsupportedModelError("group-limited routing: " + "; ".join(problems))
    return n_group, topk_group, n


def _moe_config(m: HFModel) -> dict[str, Any]:
    E, k = m.num_experts, m.num_experts_per_tok
    if m.sigmoid_routing:
        routing = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                       moe_router_pre_softmax=False)
    else:
        if m.get("scoring_func", "softmax") != "softmax":
            raise UnsupportedModelError(f"{m.model_type} routes with softmax scores; scoring_func="
                                        f"{m.get('scoring_func')!r} is not supported")
        pre_softmax = not m.get("norm_topk_prob", False)
        routing = dict(moe_router_score_function="softmax", moe_router_pre_softmax=pre_softmax)
    groups = group_routing(m)
    scaling = float(m.get("routed_scaling_factor", 1.0) or 1.0)
    freq = [1 if m.is_moe_layer(i) else 0 for i in range(m.num_layers)]
    shared = m.num_shared_experts
    return dict(
        num_moe_experts=E,
        moe_router_topk=k,
        moe_ffn_hidden_size=m.moe_intermediate_size,
        moe_shared_expert_intermediate_size=(shared * m.moe_intermediate_size) or None,
        moe_layer_freq=freq,
        moe_router_num_groups=groups[0] if groups else None,
        moe_router_group_topk=groups[1] if groups else None,
        moe_router_topk_scaling_factor=scaling if scaling != 1.0 else None,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        **routing,
    )


class LayoutError(BadInput):
    pass


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Layers of each pipeline stage as megatron splits them (transformer_config sets no custom
    split): an uneven remainder goes to the last stage."""
    first = num_layers // pp
    starts = [i * first for i in range(pp)]
    return [range(s, starts[i + 1] if i + 1 < pp else num_layers) for i, s in enumerate(starts)]


def validate_layout(m: HFModel, tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1) -> None:
    """Refuse a parallel layout the model cannot be split into, naming the reason."""
    problems = []
    for name, v in (("tp", tp), ("pp", pp), ("ep", ep), ("etp", etp)):
        if not isinstance(v, int) or v < 1:
            problems.append(f"{name}={v!r} must be a positive integer")
    if problems:
        raise LayoutError("; ".join(problems))
    heads = m.num_attention_heads
    if heads % tp:
        problems.append(f"tp={tp} does not divide num_attention_heads={heads}")
    if not m.is_mla and m.num_kv_heads % tp:
        problems.append(f"tp={tp} does not divide num_key_value_heads={m.num_kv_heads}")
    if m.vocab_size % tp:
        problems.append(f"tp={tp} does not divide vocab_size={m.vocab_size}")
    if pp > m.num_layers:
        problems.append(f"pp={pp} is larger than num_hidden_layers={m.num_layers}")
    if m.num_experts:
        if m.num_experts % ep:
            problems.append(f"ep={ep} does not divide n_routed_experts={m.num_experts}")
        if m.moe_intermediate_size % etp:
            problems.append(f"etp={etp} does not divide moe_intermediate_size={m.moe_intermediate_size}")
    elif ep != 1 or etp != 1:
        problems.append(f"ep={ep}/etp={etp} need a MoE model; {m.model_type} has no experts")
    if m.intermediate_size % tp:
        problems.append(f"tp={tp} does not divide intermediate_size={m.intermediate_size}")
    if problems:
        raise LayoutError("invalid parallel layout: " + "; ".join(problems))
