"""Qwen3-MoE: GQA with q/k norms, softmax-routed experts, no shared expert, dense layers anywhere
(mlp_only_layers, decoder_sparse_step), which SGLang's model class does not build."""

from __future__ import annotations

from mcore_rl.models.families.family import Family
from mcore_rl.models.families.rules import DENSE_DEFAULTS, DENSE_MLP, GQA_ATTENTION, MOE_MLP, NORMS, POST, PRE
from mcore_rl.models.families.mapping import Mapping


def sglang_problems(hf: dict) -> list[str]:
    # sglang/srt/models/qwen3_moe.py: "Qwen3MoE all layers are sparse" (0.5.20); it would build experts where
    # the checkpoint has a dense MLP
    if hf.get("mlp_only_layers") or (hf.get("decoder_sparse_step") or 1) != 1:
        return ["SGLang's Qwen3MoeForCausalLM makes every layer sparse; this model has dense layers "
                f"(mlp_only_layers={hf.get('mlp_only_layers')}, decoder_sparse_step={hf.get('decoder_sparse_step')}): "
                "use rollout.engine=embedded"]
    return []


FAMILY = Family(
    mapping=Mapping(name="qwen3_moe", model_types=("qwen3_moe",), pre=PRE,
                    layer=NORMS + GQA_ATTENTION + DENSE_MLP + MOE_MLP, post=POST),
    defaults={"qwen3_moe": dict(DENSE_DEFAULTS, num_experts=128, num_experts_per_tok=8, norm_topk_prob=False,
                                decoder_sparse_step=1, mlp_only_layers=[])},
    direct_load=("qwen3_moe",),
    sglang_problems=sglang_problems,
)
