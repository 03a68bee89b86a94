"""What the model builder, the converters and the engines accept of an HF config, checked before
anything runs (no torch import: the config CLI uses it too).

`hf_config_problems(cfg)` lists what is wrong, one phrase per problem; callers prefix where the
config came from (model.hf_config, a config.json path). `unread_keys(cfg)` lists the keys nothing
here reads: the model is built without them, so they are named in a warning, never dropped silently.
"""

from __future__ import annotations

from mcore_rl.models.families import FAMILY_DEFAULTS

SUPPORTED = tuple(FAMILY_DEFAULTS)  # every model_type a family declares (mcore_rl.models.families)
MLA = ("deepseek_v3", "deepseek_v2")

# every model needs these; a config.json must carry them (an embedded hf_config may leave them to
# transformers' defaults, which prepare_model writes out with the random model)
COMMON_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
MOE_KEYS = ("moe_intermediate_size", "num_experts_per_tok")
# integer sizes that must be >= 1 where present (None allowed for the optional ones)
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")  # DeepSeek/GLM, Qwen3-MoE, transformers 5
POSITIVE = (*COMMON_KEYS, *MLA_KEYS, *MOE_KEYS, "num_key_value_heads", "head_dim", "q_lora_rank",
            *EXPERT_COUNT_KEYS)

# keys the builder, converters, planner or engines read
READ_KEYS = {
    "model_type", *COMMON_KEYS, *MLA_KEYS, *MOE_KEYS, "num_key_value_heads", "head_dim", "q_lora_rank",
    "rms_norm_eps", "initializer_range", "attention_bias", "mlp_bias", "hidden_act", "rope_scaling",
    "rope_parameters", "rope_theta", "max_position_embeddings", "tie_word_embeddings", "n_routed_experts",
    "n_shared_experts", "first_k_dense_replace", "moe_layer_freq", "n_group", "topk_group", "topk_method",
    "norm_topk_prob", "scoring_func", "routed_scaling_factor", "quantization_config", "dtype", "torch_dtype",
    "num_nextn_predict_layers",  # MTP layers: skipped with a message by the converter
    "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",  # checked below
    "qk_head_dim", "rope_interleave",  # checked below: what the builder assumes
    "num_experts", "num_local_experts", "decoder_sparse_step", "mlp_only_layers",  # qwen3_moe
    "partial_rotary_factor", "use_qk_norm",  # glm4_moe
}
# keys that do not change the model's function (metadata, inference-time or training-loss settings)
INERT_KEYS = {
    "architectures", "auto_map", "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id",
    "use_cache", "attention_dropout", "pretraining_tp", "aux_loss_alpha", "seq_aux", "ep_size",
    "output_router_logits", "router_aux_loss_coef", "_name_or_path", "model_name", "name_or_path",
    "use_flash_attention", "_attn_implementation", "_attn_implementation_autoset", "hidden_dropout",
    "output_attentions", "output_hidden_states", "return_dict", "use_return_dict", "tokenizer_class",
}


# What each family takes for a key its config.json leaves out: declared with the family
# (mcore_rl.models.families), read here through with_defaults and by HFModel.get.


# another name for the same key (transformers 5 writes Qwen3-MoE's num_experts as num_local_experts)
ALIASES = {"num_experts": "num_local_experts"}


def with_defaults(cfg: dict) -> dict:
    """`cfg` with its family's defaults where it leaves a key out (an explicit null stays null)."""
    defaults = FAMILY_DEFAULTS.get(cfg.get("model_type"), {})
    return {**{k: v for k, v in defaults.items() if ALIASES.get(k) not in cfg}, **cfg}


def num_experts(cfg: dict) -> int:
    """Routed experts per MoE layer under the family's own key, as its transformers model reads it
    (a stray key of another family's is ignored there too); 0 for a dense model. Qwen3-MoE hub
    configs say num_experts, transformers 5 writes num_local_experts; DeepSeek and GLM say
    n_routed_experts."""
    keys = ("num_experts", "num_local_experts") if cfg.get("model_type") == "qwen3_moe" else ("n_routed_experts",)
    if not any(k in cfg for k in keys):  # the file leaves it out: the family's default, as transformers'
        cfg = with_defaults(cfg)
    return int(next((cfg[k] for k in keys if cfg.get(k)), 0))


def unknown_type(model_type) -> str | None:
    if model_type in SUPPORTED:
        return None
    return f"unknown model_type {model_type!r}: supported are {', '.join(SUPPORTED)}"


def hf_config_problems(cfg: dict, *, complete: bool) -> list[str]:
    """Problems of an HF config for this project; complete: a config.json, which must name every
    size the model is built from (an embedded one may rely on transformers' defaults)."""
    model_type = cfg.get("model_type")
    if unknown_type(model_type):
        return [unknown_type(model_type)]
    experts = num_experts(cfg)
    mla, moe = model_type in MLA, bool(experts)
    needed = [*COMMON_KEYS, *(MLA_KEYS if mla else ()), *(MOE_KEYS if moe else ())]
    absent = [k for k in needed if cfg.get(k) is None]
    problems = [f"lacks {', '.join(absent)}"] if complete and absent else []
    for key in POSITIVE:
        value = cfg.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            problems.append(f"{key} must be an integer >= 1, got {value!r}")
    if problems:
        return problems  # the checks below divide by these sizes
    cfg = with_defaults(cfg)  # as transformers and the engines read what the file leaves out
    heads, hidden, kv = cfg.get("num_attention_heads"), cfg.get("hidden_size"), cfg.get("num_key_value_heads")
    if not mla and heads and hidden and cfg.get("head_dim") is None and hidden % heads:
        problems.append(f"num_attention_heads = {heads} does not divide hidden_size = {hidden} "
                        "(give head_dim, or change either)")
    if not mla and heads and kv and heads % kv:
        problems.append(f"num_key_value_heads = {kv} does not divide num_attention_heads = {heads}")
    k = cfg.get("num_experts_per_tok")
    if experts and k and k > experts:
        problems.append(f"num_experts_per_tok = {k} exceeds the {experts} routed experts")
    if mla and cfg.get("qk_head_dim") is not None and None not in (nope := cfg.get("qk_nope_head_dim"),
                                                                   rope := cfg.get("qk_rope_head_dim")) \
            and cfg["qk_head_dim"] != nope + rope:
        problems.append(f"qk_head_dim = {cfg['qk_head_dim']} is not qk_nope_head_dim + qk_rope_head_dim = {nope + rope}")
    if mla and cfg.get("rope_interleave") is False:
        problems.append("rope_interleave: false is not supported (MLA's rotary dims are interleaved, as DeepSeek's)")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        problems.append(f"hidden_act {act!r} is not supported (the model is built with SwiGLU: silu)")
    if cfg.get("use_sliding_window"):
        problems.append("use_sliding_window: true is not supported (attention is over the whole sequence)")
    kinds = set(cfg.get("layer_types") or ())
    if kinds - {"full_attention"}:
        problems.append(f"layer_types {sorted(kinds)}: only full_attention layers are supported")
    return problems


def unread_keys(cfg: dict) -> list[str]:
    """Keys of an HF config that nothing in this project reads and that may change the model."""
    return sorted(k for k in cfg if k not in READ_KEYS and k not in INERT_KEYS)


def unread_keys_warning(cfg: dict, where: str) -> str | None:
    keys = unread_keys(cfg)
    if not keys:
        return None
    return (f"warning: {where}: key(s) {', '.join(keys)} are not read by mcore_rl; the model is built "
            "without them")
