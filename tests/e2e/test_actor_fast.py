"""The actor's throughput and memory switches change no gradient: the fused log-prob head, selective
and partial (block) recompute, and overlapped grad reduction over DP x EP give the grads of the
per-sequence reference in tests/e2e/test_train_algos.py; torch's fused AdamW steps as its multi-tensor
AdamW does."""

from __future__ import annotations

import os

import torch

from tests.support import distributed
from tests.e2e.test_train_algos import _assert_close, _grads_after_update, _reference_grads, actor_cfg, tiny  # noqa: F401


def _actor(rank, world, root, *overrides):
    """A fresh actor (one process builds several: megatron's groups are rebuilt for each)."""
    from megatron.core import parallel_state as ps

    from mcore_rl.actor import MegatronActor

    ps.destroy_model_parallel()
    return MegatronActor(rank, world, 0, os.path.join(root, "hf"), actor_cfg(*overrides),
                         init={"policy": os.path.join(root, "hf")})


def _one_rank(rank, root):
    batch = torch.load(os.path.join(root, "batch.pt"), weights_only=True)
    plain = _actor(0, 1, root, "actor.micro_batch_size=2")
    ref = _reference_grads(plain, batch)
    torch.save(ref, os.path.join(root, "fast_ref_grads.pt"))
    fused = _actor(0, 1, root, "actor.micro_batch_size=2", "actor.fused_logprobs=true")
    assert fused._fused_logprobs
    _assert_close(_grads_after_update(fused, batch), ref, "fused log-prob head")
    for mode in (["memory.recompute=selective", "memory.recompute_modules=[moe,mlp]"],
                 ["memory.recompute=full", "memory.recompute_layers=1"]):
        actor = _actor(0, 1, root, "actor.micro_batch_size=2", *mode)
        config = actor.model.module.config
        assert config.recompute_granularity == mode[0].split("=")[1]
        if config.recompute_granularity == "selective":  # the tiny model: a dense layer, then MoE layers
            dense, moe = actor.model.module.decoder.layers[:2]
            assert dense.recompute_mlp and moe.mlp.moe_layer_recompute
        _assert_close(_grads_after_update(actor, batch), ref, f"recompute {mode}")
    assert config.recompute_method == "block" and config.recompute_num_layers == 1


def _overlapped(rank, root):
    batch = torch.load(os.path.join(root, "batch.pt"), weights_only=True)
    actor = _actor(rank, 2, root, "parallel.ep=2", "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=10",
                   "actor.overlap_grad_reduce=true", "actor.grad_bucket_size=2000")
    assert actor.model.ddp_config.overlap_grad_reduce and len(actor.model.bucket_groups) > 1
    ref = torch.load(os.path.join(root, "fast_ref_grads.pt"), weights_only=True)
    for step in range(2):  # the first step learns the grad-ready counts, the second overlaps
        _assert_close(_grads_after_update(actor, batch), ref, f"overlapped grad reduce, step {step}")


def test_fast_paths_give_the_reference_grads(tiny):  # noqa: F811
    distributed.run(_one_rank, 1, str(tiny))
    distributed.run(_overlapped, 2, str(tiny))
