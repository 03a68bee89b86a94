"""The policy's HF directory as a rollout engine should read it (SGLang and vLLM alike)."""

from __future__ import annotations

import fnmatch
import glob
import json
import os
import shutil

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # the model dtype as the engines name it

# fields DeepSeek hub checkpoints carry that transformers' configs no longer write; the engines read them
HUB_DEFAULTS = {"deepseek_v3": dict(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid"),
                "deepseek_v2": dict(moe_layer_freq=1, topk_method="greedy", scoring_func="softmax")}


def engine_model_dir(hf_dir: str, out_dir: str, stop_token_ids: list[int], plain_rope_as_yarn: bool = False,
                     quantization_config: dict | None = None, weights: bool = True) -> str:
    """The same weights and tokenizer files as `hf_dir` (linked, not copied) under a config.json
    that carries the hub fields DeepSeek configs need, and whose eos ids are the rollout's stop
    ids (so the engine stops exactly where the trainer's tokenizer ends a response).
    `plain_rope_as_yarn`: a DeepSeek model without rope scaling gets a `yarn` entry of factor 1,
    which is plain rope (for engines whose CPU path knows only yarn). `quantization_config`: the
    engine builds its layers in that format (an FP8 checkpoint's); its weights come from the first
    sync, not from these files. `weights=False`: the weight files are left out, so the engine builds
    its layers with a dummy load (a first sync brings the weights; reading 30 GB of files it then
    overwrites would only slow its start). Rewritten atomically."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    for k, v in HUB_DEFAULTS.get(cfg.get("model_type"), {}).items():
        cfg.setdefault(k, v)
    cfg["eos_token_id"] = list(stop_token_ids) if len(stop_token_ids) != 1 else stop_token_ids[0]
    if plain_rope_as_yarn and cfg.get("model_type", "").startswith("deepseek") and not _has_scaling(cfg):
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
        yarn = dict(type="yarn", rope_type="yarn", factor=1.0, rope_theta=theta, beta_fast=32, beta_slow=1,
                    mscale=1.0, mscale_all_dim=1.0,
                    original_max_position_embeddings=cfg["max_position_embeddings"])
        cfg["rope_scaling"], cfg["rope_parameters"] = yarn, dict(yarn)
    if quantization_config:
        cfg["quantization_config"] = dict(quantization_config)
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for path in glob.glob(os.path.join(os.path.abspath(hf_dir), "*")):
        name = os.path.basename(path)
        if name in ("config.json", "generation_config.json") or (not weights and _is_weights(name)):
            continue
        os.symlink(path, os.path.join(tmp, name))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": cfg["eos_token_id"]}, f)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _is_weights(name: str) -> bool:
    return name in WEIGHT_INDEXES or any(fnmatch.fnmatch(name, pattern) for pattern in WEIGHT_FILES)


def has_weights(model_dir: str) -> bool:
    """Whether `model_dir` holds weight files. Without them (an embedded config's init_hf) an engine
    builds its layers with a dummy load and gets its weights from the first sync."""
    return any(glob.glob(os.path.join(model_dir, pattern)) for pattern in WEIGHT_FILES)


def _has_scaling(cfg: dict) -> bool:
    kinds = [(cfg.get(k) or {}).get("rope_type") or (cfg.get(k) or {}).get("type")
             for k in ("rope_scaling", "rope_parameters")]
    return any(k not in (None, "default") for k in kinds)
