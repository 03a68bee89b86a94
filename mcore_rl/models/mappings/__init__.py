"""One declarative mapping per architecture; `mapping_for` picks it from an HF config."""

from mcore_rl.models.mappings.architectures import DEEPSEEK, DENSE, GLM4_MOE, QWEN3_MOE
from mcore_rl.models.mappings.base import Mapping, Param, Rule
from mcore_rl.models.config import HFModel, UnsupportedModelError

MAPPINGS = (DEEPSEEK, QWEN3_MOE, GLM4_MOE, DENSE)


def mapping_for(m: HFModel) -> Mapping:
    for mapping in MAPPINGS:
        if m.model_type in mapping.model_types:
            return mapping
    raise UnsupportedModelError(f"no mapping for model_type {m.model_type!r}")


__all__ = ["Mapping", "Param", "Rule", "MAPPINGS", "mapping_for"]
