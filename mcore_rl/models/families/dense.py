"""The dense families: Llama, Qwen2, Qwen3 (GQA, optional q/k/v bias and q/k norms, a gated MLP)."""

from __future__ import annotations

from mcore_rl.models.families.family import Family
from mcore_rl.models.families.rules import DENSE_DEFAULTS, DENSE_MLP, GQA_ATTENTION, NORMS, POST, PRE
from mcore_rl.models.families.mapping import Mapping

FAMILY = Family(
    mapping=Mapping(name="dense", model_types=("llama", "qwen2", "qwen3"), pre=PRE,
                    layer=NORMS + GQA_ATTENTION + DENSE_MLP, post=POST),
    defaults={"llama": dict(DENSE_DEFAULTS), "qwen2": dict(DENSE_DEFAULTS), "qwen3": dict(DENSE_DEFAULTS, head_dim=128)},
    direct_load=("qwen2",),
)
