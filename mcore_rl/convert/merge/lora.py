"""LoRA adapters inside a PEFT-wrapped state dict: split them out and write a PEFT adapter dir.

PEFT names the wrapped model `base_model.model.<name>`, a wrapped linear's own weight
`<module>.base_layer.weight` and the adapter `<module>.lora_A.<adapter>.weight`; a saved adapter
(`adapter_model.safetensors`) keeps the prefix and drops the adapter name.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import save_file

from mcore_rl.convert.hf_io import CheckpointError

PEFT_PREFIX = "base_model.model."
_LORA = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")
ADAPTER_DIR = "lora_adapter"
TRAIN_META = "lora_train_meta.json"  # verl writes r / lora_alpha / task_type here


def is_lora(name: str) -> bool:
    return bool(_LORA.search(name))


def base_name(name: str) -> str:
    """The plain model's name for a (possibly PEFT-wrapped) base tensor."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def adapter_name(name: str) -> str:
    """`...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight` as PEFT saves it."""
    return re.sub(r"(\.lora_(?:A|B|embedding_A|embedding_B|magnitude_vector))\.[^.]+(\.weight|\.bias)?$",
                  r"\1\2", name)


def adapter_config(shapes: dict[str, tuple[int, ...]], meta: dict | None, lora_alpha: float | None,
                   base_model: str) -> dict:
    """PEFT's adapter_config.json; rank from the weights, alpha from verl's meta or the caller."""
    ranks = {s[0] for n, s in shapes.items() if ".lora_A." in n}
    if len(ranks) != 1:
        raise CheckpointError(f"LoRA: expected one rank for all lora_A tensors, found {sorted(ranks)}")
    r = ranks.pop()
    meta = meta or {}
    alpha = lora_alpha if lora_alpha is not None else meta.get("lora_alpha")
    if alpha is None:
        raise CheckpointError(f"LoRA: lora_alpha is not stored in the weights; pass --lora-alpha "
                              f"or keep verl's {TRAIN_META} beside the rank files")
    if meta.get("r") not in (None, r):
        raise CheckpointError(f"LoRA: {TRAIN_META} says r={meta['r']}, the weights have r={r}")
    targets = sorted({_LORA.split(n)[0].rsplit(".", 1)[-1] for n in shapes})
    return {"peft_type": "LORA", "task_type": meta.get("task_type", "CAUSAL_LM"), "r": r,
            "lora_alpha": alpha, "target_modules": targets, "base_model_name_or_path": base_model,
            "bias": "none", "lora_dropout": 0.0, "inference_mode": True}


def write_adapter(out_dir: str, tensors: dict[str, torch.Tensor], config: dict) -> str:
    path = os.path.join(out_dir, ADAPTER_DIR)
    os.makedirs(path)
    save_file({adapter_name(k): v.contiguous() for k, v in tensors.items()},
              os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path
