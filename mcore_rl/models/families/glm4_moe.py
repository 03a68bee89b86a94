"""GLM-4.5 (and -Air): GQA with q/k/v bias and optional q/k norms, partial RoPE, DeepSeek-V3's routed +
shared experts with sigmoid routing; SGLang may hold its router weight in fp32 (Glm4MoeGate)."""

from __future__ import annotations

from mcore_rl.models.families.family import Family
from mcore_rl.models.families.rules import DENSE_DEFAULTS, DENSE_MLP, GQA_ATTENTION, MOE_MLP, NORMS, POST, PRE
from mcore_rl.models.families.mapping import Mapping

FAMILY = Family(
    mapping=Mapping(name="glm4_moe", model_types=("glm4_moe",), pre=PRE,
                    layer=NORMS + GQA_ATTENTION + DENSE_MLP + MOE_MLP, post=POST),
    defaults={"glm4_moe": dict(DENSE_DEFAULTS, rms_norm_eps=1e-5, partial_rotary_factor=0.5, n_routed_experts=128,
                               num_experts_per_tok=8, first_k_dense_replace=1, norm_topk_prob=True,
                               routed_scaling_factor=1.0, n_group=1, topk_group=1, n_shared_experts=1,
                               use_qk_norm=False)},
    direct_load=("glm4_moe",),
    fp32_router=True,
)
