"""Model shapes the benchmarks share: read from the configs, so each model is written down once."""

from __future__ import annotations

import os

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hf_config(config: str, layers: int | None = None) -> dict:
    """`model.hf_config` of a config (a path, or a name in configs/), optionally with fewer layers."""
    path = config if os.path.exists(config) else os.path.join(ROOT, "configs", config)
    with open(path) as f:
        cfg = dict(yaml.safe_load(f)["model"]["hf_config"])
    if layers:
        cfg["num_hidden_layers"] = layers
    return cfg


def moonlight(layers: int | None = None) -> dict:
    """Moonlight-16B-A3B's config.json (configs/moonlight_16b.yaml)."""
    return hf_config("moonlight_16b.yaml", layers)
