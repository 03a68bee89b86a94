"""DeepSeek-V3 and V2 (Moonlight-16B-A3B is a DeepSeek-V3): MLA attention, routed + shared experts,
sigmoid (V3) or softmax (V2) routing. SGLang derives absorbed MLA weights after loading, so a sync
goes through its load_weights (no direct load)."""

from __future__ import annotations

from mcore_rl.models.families.family import Family
from mcore_rl.models.families.rules import (DENSE_DEFAULTS, DENSE_MLP, H, L, MOE_MLP, NORMS, POST, PRE, no_q_lora,
                                            q_lora)
from mcore_rl.models.families.mapping import Mapping, Rule

FAMILY = Family(
    mapping=Mapping(
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
    ),
    defaults={
        "deepseek_v3": dict(DENSE_DEFAULTS, n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3,
                            moe_layer_freq=1, norm_topk_prob=True, routed_scaling_factor=2.5, n_group=8, topk_group=4,
                            n_shared_experts=1, q_lora_rank=1536),
        "deepseek_v2": dict(DENSE_DEFAULTS, n_routed_experts=64, first_k_dense_replace=0, moe_layer_freq=1,
                            norm_topk_prob=False, routed_scaling_factor=1.0, topk_method="greedy", n_shared_experts=2,
                            q_lora_rank=1536),
    },
)
