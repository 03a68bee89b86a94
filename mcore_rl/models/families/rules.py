"""The rule pieces the families' mappings share (names only; shapes come from the configs), the
predicates that pick a rule per layer, and the dense families' defaults every family starts from."""

from __future__ import annotations

from mcore_rl.models.families.mapping import GLU_, QKV_, Rule

L = "decoder.layers.{L}."
H = "model.layers.{L}."


def untied(m, _):
    return not m.tied


def q_lora(m, _):
    return m.q_lora


def no_q_lora(m, _):
    return not m.q_lora


def dense(m, layer):
    return not m.is_moe_layer(layer)


def moe(m, layer):
    return m.is_moe_layer(layer)


def shared(m, layer):
    return m.is_moe_layer(layer) and m.num_shared_experts > 0


def expert_bias(m, layer):
    return m.is_moe_layer(layer) and m.sigmoid_routing


def qkv_bias(m, _):
    return m.qkv_bias


def qk_norm(m, _):
    return m.qk_norm


PRE = (Rule("embedding.word_embeddings.weight", "model.embed_tokens.weight"),)
POST = (Rule("decoder.final_layernorm.weight", "model.norm.weight"),
        Rule("output_layer.weight", "lm_head.weight", when=untied))

DENSE_MLP = (
    Rule(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), GLU_,
         when=dense),
    Rule(L + "mlp.linear_fc2.weight", H + "mlp.down_proj.weight", when=dense),
)

NORMS = (
    Rule(L + "input_layernorm.weight", H + "input_layernorm.weight"),
    Rule(L + "pre_mlp_layernorm.weight", H + "post_attention_layernorm.weight"),
)

# routed experts (per expert), their router, and shared experts where the config has them
MOE_MLP = (
    Rule(L + "mlp.router.weight", H + "mlp.gate.weight", when=moe),
    Rule(L + "mlp.router.expert_bias", H + "mlp.gate.e_score_correction_bias", when=expert_bias),
    Rule(L + "mlp.experts.local_experts.{E}.linear_fc1.weight",
         (H + "mlp.experts.{E}.gate_proj.weight", H + "mlp.experts.{E}.up_proj.weight"), GLU_,
         when=moe, per_expert=True),
    Rule(L + "mlp.experts.local_experts.{E}.linear_fc2.weight", H + "mlp.experts.{E}.down_proj.weight",
         when=moe, per_expert=True),
    Rule(L + "mlp.shared_experts.linear_fc1.weight",
         (H + "mlp.shared_experts.gate_proj.weight", H + "mlp.shared_experts.up_proj.weight"), GLU_,
         when=shared),
    Rule(L + "mlp.shared_experts.linear_fc2.weight", H + "mlp.shared_experts.down_proj.weight",
         when=shared),
)

# grouped-query attention: q/k/v fused per KV group, optional q/k/v bias and per-head q/k norms
GQA_ATTENTION = (
    Rule(L + "self_attention.linear_qkv.weight",
         tuple(H + f"self_attn.{x}_proj.weight" for x in "qkv"), QKV_),
    Rule(L + "self_attention.linear_qkv.bias",
         tuple(H + f"self_attn.{x}_proj.bias" for x in "qkv"), QKV_, when=qkv_bias),
    Rule(L + "self_attention.q_layernorm.weight", H + "self_attn.q_norm.weight", when=qk_norm),
    Rule(L + "self_attention.k_layernorm.weight", H + "self_attn.k_norm.weight", when=qk_norm),
    Rule(L + "self_attention.linear_proj.weight", H + "self_attn.o_proj.weight"),
)


# What a config.json may leave out, per family (transformers' config class for the model_type, which
# SGLang and vLLM load too, else the engine's own getattr default); each family adds its own. The model
# builder, checks and mappings read every such key through these (HFModel.get, with_defaults), so the
# trainer and the engines build one model from one file; tests/unit/test_model_defaults.py checks
# every entry against transformers' classes and SGLang's model code.
DENSE_DEFAULTS = dict(rms_norm_eps=1e-6, rope_theta=10000.0, partial_rotary_factor=1.0, attention_bias=False,
                      tie_word_embeddings=False, initializer_range=0.02)
