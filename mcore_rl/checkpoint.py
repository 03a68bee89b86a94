"""Distributed model checkpoints through megatron-core's own dist_checkpointing (torch_dist).

Saves go to `<dir>.tmp` and are renamed by rank 0 after every rank has finished, so a
directory named like a checkpoint is always complete.
"""

from __future__ import annotations

import os
import shutil

import torch.distributed as dist

from mcore_rl.models.builder import sharded_state_dict


def _unwrap(model):
    """The GPTModel inside wrappers (megatron's DDP would prefix every key with 'module.')."""
    while hasattr(model, "module"):
        model = model.module
    return model


def load_model(model, ckpt_dir: str, strict: bool = True) -> None:
    """Load a torch_dist checkpoint written at any layout into `model` (resharding as needed)."""
    from megatron.core import dist_checkpointing

    if not os.path.exists(os.path.join(ckpt_dir, "metadata.json")):
        raise FileNotFoundError(f"{ckpt_dir}: not a torch_dist checkpoint (no metadata.json)")
    model = _unwrap(model)
    sharded = sharded_state_dict(model)
    state = dist_checkpointing.load(sharded, ckpt_dir)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if strict and (missing or unexpected):
        raise KeyError(f"checkpoint/model mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")


def save_model(model, ckpt_dir: str, side_files_from: str | None = None) -> None:
    """Save `model` (all ranks call this) as a torch_dist checkpoint at `ckpt_dir`, atomically."""
    from megatron.core import dist_checkpointing

    tmp = ckpt_dir.rstrip("/") + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    sharded = sharded_state_dict(_unwrap(model))
    dist_checkpointing.save(sharded, tmp)
    if dist.get_rank() == 0:
        if side_files_from:
            shutil.copytree(side_files_from, os.path.join(tmp, "hf"))
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        os.rename(tmp, ckpt_dir)
    dist.barrier()
