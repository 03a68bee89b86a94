"""Megatron-core models built from HuggingFace configs."""

from mcore_rl.models.config import HFModel, UnsupportedModelError, transformer_config

__all__ = ["HFModel", "UnsupportedModelError", "transformer_config", "build_model"]


def build_model(*args, **kwargs):
    from mcore_rl.models.builder import build_model as _build

    return _build(*args, **kwargs)
