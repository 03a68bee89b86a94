"""transformers' own save rules, applied one layer at a time.

An FSDP state dict holds the names of the model *in memory*; transformers >= 5 fuses some tensors
there (e.g. routed experts as `mlp.experts.gate_up_proj [E, 2I, H]`) and `save_pretrained` undoes
that (`revert_weight_conversion`) and drops tied aliases. We run the same functions on a
meta-device model: first on meta tensors to plan the output, then on real tensors layer by layer.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch

from mcore_rl.convert.hf_io import CheckpointError

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


class HFSaveRules:
    def __init__(self, config_dir: str):
        import transformers
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        try:
            cfg = transformers.AutoConfig.from_pretrained(config_dir)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{config_dir}: cannot read the HF config: {e}") from None
        with torch.device("meta"):
            self.model = transformers.AutoModelForCausalLM.from_config(cfg)
        full = self.model.state_dict()
        kept = remove_tied_weights_from_state_dict(dict(full), self.model)
        ignored = set(self.model._keys_to_ignore_on_save or ())
        self.shapes = {k: tuple(v.shape) for k, v in full.items()}
        self.saved = [k for k in kept if k not in ignored]  # what save_pretrained would write
        self.config_dir = config_dir

    def check(self, shapes: dict[str, tuple[int, ...]], source: str) -> None:
        """The checkpoint's tensors are exactly the model's (tied aliases may be absent)."""
        unknown = sorted(set(shapes) - set(self.shapes))
        if unknown:
            raise CheckpointError(f"{source}: {len(unknown)} tensor(s) that the model of "
                                  f"{self.config_dir}/config.json does not have, e.g. {unknown[:3]}")
        missing = sorted(set(self.saved) - set(shapes))
        if missing:
            raise CheckpointError(f"{source}: {len(missing)} tensor(s) of the model missing, "
                                  f"e.g. {missing[:3]}")
        bad = [(k, s, self.shapes[k]) for k, s in shapes.items() if s != self.shapes[k]]
        if bad:
            k, got, want = bad[0]
            raise CheckpointError(f"{source}: {k} has shape {got}, the model of "
                                  f"{self.config_dir}/config.json needs {want}")

    def groups(self, names: Iterable[str], meta) -> list[list[str]]:
        """Saved names in file order, grouped so that each group converts on its own: one name
        per group where converting names one at a time gives what converting their layer does
        (planned on meta tensors from `meta(names)`), else the whole layer (conversions never
        cross layers). Small groups keep peak memory at one tensor, not one layer."""
        from transformers.core_model_loading import dot_natural_key

        layers: dict[str, list[str]] = {}
        saved = set(self.saved)
        for n in sorted((n for n in names if n in saved), key=dot_natural_key):
            m = _LAYER.match(n)
            layers.setdefault(m.group(1) if m else n, []).append(n)
        out = []
        for group in layers.values():
            together = _signature(self.to_disk(meta(group)))
            alone: dict = {}
            for n in group:
                alone.update(_signature(self.to_disk(meta([n]))))
            out += [[n] for n in group] if alone == together else [group]
        return out

    def to_disk(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """In-memory names and tensors -> the names and tensors `save_pretrained` writes."""
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(self.model, tensors)


def _signature(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
