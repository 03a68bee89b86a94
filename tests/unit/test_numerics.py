"""The trainer's bf16 elementwise steps round once, as the engines' kernels do (SGLang on CUDA: RoPE from an
fp32 cos/sin cache in flashinfer's kernel, silu_and_mul in fp32): RoPE and SwiGLU are computed in fp32 from
their bf16 inputs and rounded once. Checked element by element, in a bf16 DeepSeek-V3 model as the builder
makes it (MLA with a dense first layer and shared experts), against fp64 references: transformers' own
DeepSeek-V3 RoPE, silu(gate) * up. Megatron's no-TE path (cos and sin in bf16, each product and the sum
rounded; silu rounded before the product) misses this bound on many elements: a bf16 trainer then parts from
its engine at every layer (issue 45, item 5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# one rounding to bf16 (8 significant bits) moves a value by at most 2**-8 of it; fp32 arithmetic before it
# adds ~1e-7 of the operands (where a difference cancels), covered by the absolute slack
ONE_ROUNDING = 2.0 ** -8
HF = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
          num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
          n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
          q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16,
          rope_theta=50000.0, rope_scaling=None, max_position_embeddings=512, routed_scaling_factor=2.5)
TOKENS = 96


def _beyond_one_rounding(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> float:
    """Share of elements of `got` (bf16) farther from `ref` (fp64) than one rounding allows."""
    err = (got.double() - ref).abs()
    return (err > ONE_ROUNDING * ref.abs() + 1e-6 * scale).double().mean().item()


def _capture(rank: int, out: str) -> None:
    """A bf16 model as the builder makes it, one forward: each layer's pre-RoPE q and k, the query and key
    its core attention receives, and each MLP's fc1 output and fc2 input (the dense one, the shared experts)."""
    from mcore_rl.models.builder import build_model
    from mcore_rl.models.config import HFModel, transformer_config
    from mcore_rl.models.forward import full_logits
    from mcore_rl.parallel.groups import Layout, init_distributed

    init_distributed(Layout(), seed=3)
    hf = HFModel.from_dict(HF)
    model = build_model(hf, transformer_config(hf, dtype=torch.bfloat16, cpu=True)).eval()
    kept = {}

    def keep(name, pick):
        def hook(module, args, output):
            kept.setdefault(name, pick(args, output).detach().clone())  # returns None: the output stays
        return hook

    for i, layer in enumerate(model.decoder.layers):
        attn = layer.self_attention
        attn.linear_q_proj.register_forward_hook(keep(f"q{i}", lambda a, o: o[0]))
        attn.linear_kv_down_proj.register_forward_hook(keep(f"kv_down{i}", lambda a, o: o[0]))
        attn.core_attention.register_forward_hook(keep(f"query{i}", lambda a, o: a[0]))
        attn.core_attention.register_forward_hook(keep(f"key{i}", lambda a, o: a[1]))
        mlp = layer.mlp.shared_experts if hasattr(layer.mlp, "shared_experts") else layer.mlp
        mlp.linear_fc1.register_forward_hook(keep(f"fc1_{i}", lambda a, o: o[0]))
        mlp.linear_fc2.register_forward_hook(keep(f"fc2_in{i}", lambda a, o: a[0]))
    ids = torch.randint(0, HF["vocab_size"], (1, TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full_logits(model, ids)
    torch.save(kept, out)


def test_rope_and_swiglu_round_once_in_a_bf16_model(tmp_path):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3RotaryEmbedding,
                                                                       apply_rotary_pos_emb_interleave)

    from tests.support.distributed import run

    out = str(tmp_path / "kept.pt")
    run(_capture, 1, out)
    kept = torch.load(out, weights_only=True)
    nope, rope, kv = HF["qk_nope_head_dim"], HF["qk_rope_head_dim"], HF["kv_lora_rank"]
    heads = HF["num_attention_heads"]
    cfg = DeepseekV3Config(**{k: v for k, v in HF.items() if k != "model_type"})
    positions = torch.arange(TOKENS)[None]
    cos, sin = (t.double() for t in DeepseekV3RotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions))
    beyond = {}
    for i in range(HF["num_hidden_layers"]):
        # [s, b=1, ...] -> transformers' [b, heads, s, rope] (the key's rope part is one head, shared)
        q_pe = kept[f"q{i}"].view(TOKENS, heads, nope + rope)[..., nope:].permute(1, 0, 2)[None].double()
        k_pe = kept[f"kv_down{i}"][:, 0, kv:][None, None].double()
        q_ref, k_ref = apply_rotary_pos_emb_interleave(q_pe, k_pe, cos, sin)
        query = kept[f"query{i}"][:, 0, :, nope:].permute(1, 0, 2)[None]
        key = kept[f"key{i}"][:, 0, :1, nope:].permute(1, 0, 2)[None]
        beyond[f"rope q, layer {i}"] = _beyond_one_rounding(query, q_ref, q_pe.abs().amax())
        beyond[f"rope k, layer {i}"] = _beyond_one_rounding(key, k_ref, k_pe.abs().amax())
        gate, up = kept[f"fc1_{i}"].double().chunk(2, dim=-1)
        beyond[f"swiglu, layer {i}"] = _beyond_one_rounding(kept[f"fc2_in{i}"], F.silu(gate) * up, gate.abs().amax())
    assert all(v == 0 for v in beyond.values()), beyond


def test_expert_swiglu_with_probabilities_rounds_once():
    """The routed experts' SwiGLU x routing probability (the grouped path's), eager as off the GPU."""
    from mcore_rl.models.fused import swiglu_probs

    g = torch.Generator().manual_seed(0)
    fc1 = torch.randn(512, 64, generator=g).to(torch.bfloat16)
    probs = torch.rand(512, generator=g)  # fp32, as megatron's router gives them
    gate, up = fc1.double().chunk(2, dim=-1)
    ref = F.silu(gate) * up * probs.double()[:, None]
    assert _beyond_one_rounding(swiglu_probs(fc1, probs), ref, gate.abs().amax()) == 0
