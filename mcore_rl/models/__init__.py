"""Megatron-core models built from HuggingFace configs."""

from mcore_rl.models.config import (HFModel, LayoutError, UnsupportedModelError,
                                    transformer_config, validate_layout)

__all__ = ["HFModel", "LayoutError", "UnsupportedModelError", "transformer_config",
           "validate_layout", "build_model"]


def build_model(*args, **kwargs):
    from mcore_rl.models.builder import build_model as _build

    return _build(*args, **kwargs)
