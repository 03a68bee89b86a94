"""The train phase planned for what a step ran (issue 45 item 6): the plan's own model at the
step's largest micro-batch (`Plan.train_at`), beside the start-up bound at a full budget. The
micro-batches come from the trainer's own packing of the tiny config's task and of the 64 x 8K
Moonlight step (all 27 layers, 4 x H200); the bytes are checked against the planner docstring's
estimate written out here."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import torch

from mcore_rl.config import sections as C
from mcore_rl.data.tasks import make_task
from mcore_rl.loop import micro_batches as mb
from mcore_rl.loop.phases import Phases
from mcore_rl.memory.plan import plan_for_config
from mcore_rl.memory.planner import LARGEST_MICRO, GiB
from mcore_rl.models.head import CHUNK_BYTES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H200 = int(139.8 * GiB)  # the free memory NVML reported on the 4 x H200 runs
LONG_STEP = ("data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.max_response_len=8176",
             "cluster.host_memory_gb=480",
             # what the plan picked for that run (its "auto"s: tests/unit/test_micro_batch_plan.py searches)
             "actor.ppo_max_token_len_per_gpu=11264", "memory.recompute=none", "memory.offload_train_states=false")


def left_padded(prompts: list[list[int]], responses: list[int], R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rollout batch as the trainer gets it: pads, prompt, then R response columns of which the
    first `responses[i]` are real (up to and including the EOS)."""
    P = max(map(len, prompts))
    tokens = torch.zeros(len(prompts), P + R, dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        tokens[i, P - len(p):P] = torch.tensor(p)
        tokens[i, P:P + r] = 3
        mask[i, P - len(p):P + r] = 1
    return tokens, mask


def test_largest_micro_batch_of_the_tiny_configs_packing():
    """mb.largest over the packs the trainer makes equals the counts read off the batch's masks."""
    cfg = C.load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), ["rollout.max_response_len=12"])
    R, rng = cfg.rollout.max_response_len, random.Random(0)
    prompts = [p for p in make_task(cfg.data.task, 16).prompts for _ in range(cfg.rollout.n)][:64]
    responses = [rng.randint(1, R) for _ in prompts]  # EOS anywhere
    tokens, mask = left_padded(prompts, responses, R)
    bins = mb.balanced_micro_batches(mb.sample_lengths(mask), 100)
    packs = [mb.pack(tokens, mask, R, rows) for rows in bins]
    lengths = [len(p) + r for p, r in zip(prompts, responses)]
    assert len(bins) > 1
    assert mb.largest(packs) == [max(sum(lengths[i] for i in b) for b in bins),
                                 max(sum(responses[i] for i in b) for b in bins), max(lengths)]


def documented_activations(c: dict, T: int, n: int, ep: int) -> int:
    """The planner docstring's stored activations at tp = pp = 1, varlen attention, no recompute,
    the fused log-prob head: 21 T h a layer; each MoE layer's routed copies and, at ep > 1, its
    dispatch's two hidden-state copies; the head's bf16 logits and rows and one fp32 chunk."""
    h, V, k = c["hidden_size"], c["vocab_size"], c["num_experts_per_tok"]
    moe_layers = c["num_hidden_layers"] - c["first_k_dense_replace"]
    routed = T * k * (2 * h + 3 * c["moe_intermediate_size"]) * 2 + T * k * 2 * h * 2 * (ep > 1)
    return c["num_hidden_layers"] * 21 * T * h + moe_layers * routed + 2 * T * V + 2 * n * V + min(CHUNK_BYTES, 4 * n * V)


def test_the_steps_plan_is_the_plans_model_at_its_largest_micro_batch():
    """64 x 8K on 4 x H200 (docs/performance.md): one sequence of up to 8,192 tokens a micro-batch of the
    11,264 the plan budgets. The step's figure is the bound less the activations of the tokens the
    micro-batch did not hold; at the budget it is the bound itself; the logged keys reach it."""
    cfg = C.load_config(os.path.join(ROOT, "configs", "moonlight_4gpu.yaml"), list(LONG_STEP))
    plan, _ = plan_for_config(cfg, capacity=H200)
    i, c = plan.inputs, cfg.model.hf_config
    assert (i.packed_attention, i.fused_logprobs) == ("varlen", True)
    assert round(plan.total("train") / GiB, 2) == 139.64  # the run's own plan/gpu_gib_train
    assert plan.train_at(i.micro_tokens, i.response_tokens) == plan.total("train")

    R = cfg.rollout.max_response_len
    prompts = make_task(cfg.data.task, 2, seed=cfg.trainer.seed).prompts
    tokens, mask = left_padded(prompts, [R, R], R)
    packs = [mb.pack(tokens, mask, R, rows) for rows in mb.balanced_micro_batches(mb.sample_lengths(mask), i.micro_tokens)]
    T, n, longest = mb.largest(packs)
    assert len(packs) == 2 and T == longest == max(map(len, prompts)) + R and n == R

    states = plan.total("train") - plan.phases["train"]["megatron activations"]
    expected = states + documented_activations(c, T, n, ep=4)
    assert plan.train_at(T, n) == expected
    assert plan.total("train") - expected == documented_activations(c, i.micro_tokens, i.response_tokens, 4) \
        - documented_activations(c, T, n, 4)
    assert 122.0 < expected / GiB < 124.0  # measured on that step: 122.03 GiB (the bound: 139.64)
    logged = Phases.planned(SimpleNamespace(plan=plan), dict(zip(LARGEST_MICRO, (float(T), float(n), float(T)))))
    assert logged == {"plan/gpu_gib_step_train": expected / GiB}
    assert Phases.planned(SimpleNamespace(plan=None), dict(zip(LARGEST_MICRO, (T, n, T)))) == {}
