"""One module per architecture family, each declaring in one `Family` record its HF <-> Megatron
mapping, the defaults its config.json may leave out, and what the engines do with it; everything
else (the converters, the weight sync, the memory plan, the config checks) reads these."""

from __future__ import annotations

from mcore_rl.models.families import deepseek, dense, glm4_moe, qwen3_moe
from mcore_rl.models.families.family import Family

FAMILIES = (deepseek.FAMILY, qwen3_moe.FAMILY, glm4_moe.FAMILY, dense.FAMILY)
BY_TYPE = {t: f for f in FAMILIES for t in f.mapping.model_types}
FAMILY_DEFAULTS = {t: d for f in FAMILIES for t, d in f.defaults.items()}
DIRECT_LOAD_TYPES = tuple(t for f in FAMILIES for t in f.direct_load)


def family_of(model_type: str | None) -> Family | None:
    return BY_TYPE.get(model_type)


__all__ = ["Family", "FAMILIES", "FAMILY_DEFAULTS", "DIRECT_LOAD_TYPES", "family_of"]
