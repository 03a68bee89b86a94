"""Tiny random HF models of every supported family, saved with transformers' own save_pretrained."""

from __future__ import annotations

import torch

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, max_position_embeddings=512)
MOE = dict(moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
           kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)

FAMILIES = {
    # DeepSeek-V3 / Moonlight shape: q_lora, YaRN, sigmoid + expert bias, groups, dense first layer
    "deepseek_v3": ("DeepseekV3Config", dict(
        COMMON, **MOE, num_hidden_layers=4, n_shared_experts=1, num_experts_per_tok=4, n_group=2,
        topk_group=2, first_k_dense_replace=1, q_lora_rank=32, routed_scaling_factor=2.5,
        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=128,
                          beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0))),
    # DeepSeek-V2-Lite shape: no q_lora, softmax greedy routing, 2 shared experts
    "deepseek_v2": ("DeepseekV2Config", dict(
        COMMON, **MOE, num_hidden_layers=3, n_shared_experts=2, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=None, topk_method="greedy",
        routed_scaling_factor=1.0)),
    # Qwen3-MoE shape: GQA with head_dim independent of hidden/heads, q/k norms, softmax top-k
    # renormalised, no shared expert; every layer sparse (SGLang 0.5.20's Qwen3MoeForCausalLM
    # builds no dense layer, so the model the engine tests run has none)
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    # GLM-4.5 shape: GQA with q/k/v bias and q/k norms, half the head dims rotated, sigmoid routing
    # with expert bias and groups, a shared expert, a dense first layer, scaled weights
    "glm4_moe": ("Glm4MoeConfig", dict(
        COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True)),
    "qwen2": ("Qwen2Config", dict(COMMON, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", dict(COMMON, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32)),
    "llama": ("LlamaConfig", dict(COMMON, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, tie_word_embeddings=True)),
}

# routing where megatron-core's own is not the model's: group-limited routing (megatron ranks groups
# by top k/topk_group sums; V3 by top-2 sums (here megatron would take top-1), V2's
# group_limited_greedy by the group's best score (here megatron would take top-2 sums), V2's greedy
# ignores the groups); sigmoid top-k weights left unnormalised (norm_topk_prob=false; megatron
# always normalises them); Qwen3-MoE's dense layers anywhere with softmax weights not renormalised
ROUTING_VARIANTS = {
    "deepseek_v3_no_norm": ("DeepseekV3Config", dict(FAMILIES["deepseek_v3"][1], norm_topk_prob=False)),
    "qwen3_moe_dense_layers": ("Qwen3MoeConfig", dict(
        FAMILIES["qwen3_moe"][1], num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2,
        norm_topk_prob=False)),
    "deepseek_v3_groups": ("DeepseekV3Config", dict(
        FAMILIES["deepseek_v3"][1], n_routed_experts=12, n_group=4, topk_group=2, num_experts_per_tok=3)),
    "deepseek_v2_groups": ("DeepseekV2Config", dict(
        FAMILIES["deepseek_v2"][1], n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=4,
        topk_method="group_limited_greedy")),
    "deepseek_v2_greedy_groups": ("DeepseekV2Config", dict(
        FAMILIES["deepseek_v2"][1], n_routed_experts=8, n_group=4, topk_group=1, num_experts_per_tok=2)),
}


# the shapes vLLM's CPU kernels take (mcore_rl.config.checks._check_vllm): MLA with its real latent and
# rope dims; dense attention with a head size it has a kernel for (64 / 4 heads = 16 it has not)
VLLM_CPU = {
    "deepseek_v3_vllm": ("DeepseekV3Config", dict(FAMILIES["deepseek_v3"][1], kv_lora_rank=512, qk_rope_head_dim=64)),
    "qwen2_vllm": ("Qwen2Config", dict(FAMILIES["qwen2"][1], hidden_size=128, intermediate_size=256)),
}


# fewer KV heads than engine TP ranks: SGLang replicates them (Qwen3-30B-A3B: 4 heads over TP 8)
SYNC_VARIANTS = {
    "qwen3_moe_one_kv_head": ("Qwen3MoeConfig", dict(FAMILIES["qwen3_moe"][1], num_key_value_heads=1)),
}


# FP8 engine weights: every width SGLang splits or fuses over TP=2 is a whole number of 128-row
# blocks per rank (its Fp8LinearMethod refuses others), hidden_size 64 stays a partial block
FP8 = {
    "deepseek_v3_fp8": ("DeepseekV3Config", dict(
        FAMILIES["deepseek_v3"][1], num_hidden_layers=2, intermediate_size=256, moe_intermediate_size=256,
        q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64)),
}
# ... but its shared experts: 3 x 128 rows, 192 a rank at TP=2, which an FP8 engine keeps in the
# model's dtype; routed experts of 128 rows, whole on each rank of an EP=2 engine
FP8["deepseek_v3_fp8_bf16_shared"] = ("DeepseekV3Config", dict(
    FP8["deepseek_v3_fp8"][1], moe_intermediate_size=128, n_shared_experts=3))


def make_hf_model(family: str, out_dir: str, seed: int = 0):
    """Save a random fp32 model of `family` to `out_dir`; return the model (eval mode)."""
    import transformers

    cls_name, kwargs = {**FAMILIES, **ROUTING_VARIANTS, **VLLM_CPU, **SYNC_VARIANTS, **FP8}[family]
    cfg = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # norms, biases and expert bias away from their trivial init values
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 0.1)
    model.save_pretrained(out_dir)
    return model


FP8_WEIGHT = "model.layers.1.self_attn.q_b_proj.weight"


def make_fp8_variant(hf_dir, block: int = 16) -> None:
    """Turn the DeepSeek-V3 checkpoint in `hf_dir` (modified in place) into DeepSeek-V3's FP8 release
    format for one weight, FP8_WEIGHT: e4m3 with a `_scale_inv` per block x block block, the config's
    quantization_config saying so, plus a multi-token-prediction layer's tensor (index = num layers)."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block]}
    cfg["num_nextn_predict_layers"] = 1
    with open(path, "w") as f:
        json.dump(cfg, f)
    t = load_file(os.path.join(hf_dir, "model.safetensors"))
    w = t[FP8_WEIGHT]
    scale = torch.rand(-(-w.shape[0] // block), -(-w.shape[1] // block)) + 0.5
    t[FP8_WEIGHT] = (w / scale.repeat_interleave(block, 0)[: w.shape[0]].repeat_interleave(block, 1)[:, : w.shape[1]]
                     ).to(torch.float8_e4m3fn)
    t[FP8_WEIGHT + "_scale_inv"] = scale
    t[f"model.layers.{cfg['num_hidden_layers']}.eh_proj.weight"] = torch.zeros(8, 8)
    save_file(t, os.path.join(hf_dir, "model.safetensors"))
