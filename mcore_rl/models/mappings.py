"""The declarative HF <-> Megatron mappings (`base`), one per architecture family (declared with the
family in `mcore_rl.models.families`); `mapping_for` picks it from an HF config."""

from mcore_rl.models.families import FAMILIES
from mcore_rl.models.families.mapping import Mapping, Param, Rule
from mcore_rl.models.config import HFModel, UnsupportedModelError

MAPPINGS = tuple(f.mapping for f in FAMILIES)


def mapping_for(m: HFModel) -> Mapping:
    for mapping in MAPPINGS:
        if m.model_type in mapping.model_types:
            return mapping
    raise UnsupportedModelError(f"no mapping for model_type {m.model_type!r}")


__all__ = ["Mapping", "Param", "Rule", "MAPPINGS", "mapping_for"]
