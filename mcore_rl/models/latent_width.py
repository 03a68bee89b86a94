"""`model.mla_base_rank`: an MLA latent widened for an engine's kernels (vLLM's CPU MLA takes
kv_lora_rank 512 only) trained as one of the base rank. Megatron initialises every weight with
the same std and Adam moves every element by about the learning rate, whatever the fan-in, so the
latent's up-projection (kv_b: kv_lora_rank inputs) starts and moves sqrt(rank / base) and
rank / base times as much in its outputs as at the base rank: at 512 over 16, the attention's
values swamp the tiny model's token embeddings from the start and at every step. muP's rule for a
hidden weight undoes both: init std x sqrt(base / rank), Adam lr x base / rank."""

from __future__ import annotations

import fnmatch

import torch

KV_UP = "*self_attention.linear_kv_up_proj.weight"  # megatron's name of HF's kv_b_proj


def latent_scales(hf: dict, base: int | None) -> tuple[float, float]:
    """(init std factor, lr factor) of the latent's up-projection; (1, 1) where none applies."""
    rank = hf.get("kv_lora_rank")
    if base is None or rank is None or rank == base:
        return 1.0, 1.0
    return (base / rank) ** 0.5, base / rank


@torch.no_grad()
def scale_latent_init(model: torch.nn.Module, factor: float) -> None:
    """Scale the freshly initialised up-projections of this rank's layers (every TP shard alike)."""
    for name, p in model.named_parameters():
        if fnmatch.fnmatch(name, KV_UP):
            p.mul_(factor)
