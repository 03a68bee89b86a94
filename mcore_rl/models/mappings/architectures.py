"""The mappings, one per architecture family. Names only; shapes come from the configs."""

from __future__ import annotations

from mcore_rl.models.mappings.base import GLU_, QKV_, Mapping, Rule

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

DEEPSEEK = Mapping(
    name="deepseek",
    model_types=("deepseek_v3", "deepseek_v2"),
    pre=PRE,
    layer=NORMS + (
        Rule(L + "self_attention.linear_q_down_proj.weight", H + "self_attn.q_a_proj.weight", when=q_lora),
        Rule(L + "self_attention.q_layernorm.weight", H + "self_attn.q_a_layernorm.weight", when=q_lora),
        Rule(L + "self_attention.linear_q_up_proj.weight", H + "self_attn.q_b_proj.weight", when=q_lora),
        Rule(L + "self_attention.linear_q_proj.weight", H + "self_attn.q_proj.weight", when=no_q_lora),
        Rule(L + "self_attention.linear_kv_down_proj.weight", H + "self_attn.kv_a_proj_with_mqa.weight"),
        Rule(L + "self_attention.kv_layernorm.weight", H + "self_attn.kv_a_layernorm.weight"),
        Rule(L + "self_attention.linear_kv_up_proj.weight", H + "self_attn.kv_b_proj.weight"),
        Rule(L + "self_attention.linear_proj.weight", H + "self_attn.o_proj.weight"),
    ) + DENSE_MLP + MOE_MLP,
    post=POST,
)

# Qwen3-MoE: GQA with q/k norms, softmax-routed experts, no shared expert, dense layers anywhere
QWEN3_MOE = Mapping(name="qwen3_moe", model_types=("qwen3_moe",), pre=PRE,
                    layer=NORMS + GQA_ATTENTION + DENSE_MLP + MOE_MLP, post=POST)

# GLM-4.5: GQA with q/k/v bias (and optional q/k norms), DeepSeek-V3's routed + shared experts
GLM4_MOE = Mapping(name="glm4_moe", model_types=("glm4_moe",), pre=PRE,
                   layer=NORMS + GQA_ATTENTION + DENSE_MLP + MOE_MLP, post=POST)

DENSE = Mapping(name="dense", model_types=("llama", "qwen2", "qwen3"), pre=PRE,
                layer=NORMS + GQA_ATTENTION + DENSE_MLP, post=POST)
