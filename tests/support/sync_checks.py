"""A GRPO run's pieces (Megatron actors, engines, weight sync) set up as `python -m mcore_rl.train`
does, and the ways the engine tests break a sync to see it caught (tests/e2e/test_train_sglang.py,
tests/e2e/test_train_vllm.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from mcore_rl.config import sections as C

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# configs/tiny_cpu.yaml with vLLM generating (README): the MLA dims vLLM's CPU kernels take, the latent
# trained as the 16-wide one (mcore_rl/models/latent_width.py), and a task that model learns in 30 steps
# (with a 512-wide latent, copy_last crawled: 0.06 -> 0.23, any engine, before mla_base_rank)
VLLM_TINY = ("rollout.engine=vllm", "model.hf_config.kv_lora_rank=512", "model.hf_config.qk_rope_head_dim=64",
             "model.mla_base_rank=16", "data.task=constant")
# configs/tiny_cpu.yaml as the other MoE families (README, "Model families"): Qwen3-MoE (GQA with a
# head_dim of its own, q/k norms, softmax routing, no shared expert) and GLM-4.5 (q/k/v bias, q/k
# norms, half the head rotated, DeepSeek-V3's sigmoid routing with bias and scaled weights)
QWEN3_MOE_TINY = ("model.hf_config.model_type=qwen3_moe", "model.hf_config.num_experts=4",
                  "model.hf_config.num_key_value_heads=2", "model.hf_config.norm_topk_prob=true")
GLM4_MOE_TINY = ("model.hf_config.model_type=glm4_moe", "model.hf_config.num_key_value_heads=2",
                 "model.hf_config.attention_bias=true", "model.hf_config.use_qk_norm=true",
                 "model.hf_config.partial_rotary_factor=0.5", "model.hf_config.routed_scaling_factor=2.5")


@contextlib.contextmanager
def started_run(out: str, overrides=()):
    """(cfg, actor group, engines, weight sync, prompt source) of configs/tiny_cpu.yaml + overrides."""
    import ray

    from mcore_rl.data.prompts import load_prompt_sources
    from mcore_rl.loop.step_batch import stop_ids
    from mcore_rl.rollout.launch import launch
    from mcore_rl.loop.groups import ActorGroup
    from mcore_rl.loop.startup import prepare_model

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    cfg = C.load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml"), [f"trainer.output_dir={out}", *overrides])
    ray.init(address="local", num_cpus=max(2, cfg.cluster.nnodes * cfg.cluster.n_gpus_per_node),  # as train's
             include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    engine = None
    try:
        hf_dir = prepare_model(cfg, out)
        source, _ = load_prompt_sources(cfg)
        group = ActorGroup(cfg, hf_dir)
        engine, sync = launch(cfg, hf_dir, out, group, list(stop_ids(cfg, source.tokenizer)))
        yield cfg, group, engine, sync, source
    finally:
        if engine is not None:
            engine.shutdown()
        ray.shutdown()


def train(out: str, *overrides, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mcore_rl.train", "--config", "configs/tiny_cpu.yaml", f"trainer.output_dir={out}",
           *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"))


# GRPO steps with every sync verified, for the transports' tests
VERIFIED = ("trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1", "rollout.verify_sync_every=1")
# engines on their own "GPU", fed over an update group (gloo stands in for NCCL)
BROADCAST = ("cluster.n_gpus_per_node=3", "cluster.colocate=false", "cluster.rollout_gpus=1")
DISK = ("rollout.sync_transport=disk",)  # the fallback: versions written to disk, loaded by the engine


def check_verified_grpo_steps(out: str, *overrides, steps: int = 3) -> None:
    """A `steps`-step run with `overrides` ends well, every sync verified and the engine's log-probs
    the trainer's; a 30-step run's reward also rises as the sync run's of tests/e2e/test_train.py."""
    from tests.e2e.test_train import _reward_rises, by_step

    p = train(out, f"trainer.total_training_steps={steps}", *VERIFIED, *overrides)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    by = by_step(out)
    assert sorted(by) == list(range(steps + 1))
    assert all(by[k]["sync/verified"] == 1.0 and by[k]["rollout/logp_diff_abs_mean"] < 1e-3
               for k in range(1, steps + 1)), by
    if steps >= 30:
        _reward_rises(out)


def grpo_steps(run, steps: int, verify: bool | None = None, prompts=None) -> list[dict]:
    """Steps 1..`steps` of GRPO on a started_run's pieces, as `python -m mcore_rl.train`'s loop takes
    them: each step's metrics with those of the sync after it (every sync read back when `verify`);
    `prompts(step)`: a step's prompt indices (default: the trainer's own, `step_prompts`)."""
    import functools

    from mcore_rl.loop.phases import Phases
    from mcore_rl.loop.sources import SyncSource, step_prompts
    from mcore_rl.loop.step import StepClock, advantages, generate, log_probs, update

    cfg, group, engine, sync, source = run
    batches = SyncSource(cfg, engine, functools.partial(sync, verify=verify), source,
                         prompts or (lambda step: step_prompts(cfg, source, step)))
    phases = Phases(cfg, group, engine, batches.sync)
    done = []
    try:
        for step in range(1, steps + 1):  # the phases of mcore_rl.loop.run._loop, without saves or validation
            clock = StepClock()
            with clock("rollout"):
                sb = generate(cfg, batches, step)
            with clock("to_train"):
                phases.to_train()
            shared = group.share(sb.batch)
            log_probs(cfg, group, sb, shared, clock)
            sb.metrics.update(advantages(cfg, sb))
            sb.metrics.update(update(cfg, group, shared, clock))
            done.append({**sb.metrics, **clock.step_metrics(sb), **phases.offload(step), **phases.resume(step)})
    finally:
        phases.mon.close()
    return done


def check_a_corrupted_tensor_fails(run, match: str) -> None:
    """kv_b_proj of layer 1 sent slightly off: the sync's check fails (`match`); a good sync heals it."""
    from mcore_rl.sync.checksum import WeightMismatch

    cfg, group, engine, sync, source = run
    group.call("run", corrupt_next_sync, "model.layers.1.self_attn.kv_b_proj.weight")
    with pytest.raises(WeightMismatch, match=match):
        sync(1, verify=True)
    sync(2, verify=True)
    assert logp_gap(cfg, group, engine, source) < 1e-3


def check_a_skipped_sync_fails(run, match: str) -> None:
    """The trainer moved but nothing reached the engines: the check fails (`match`) and so does the
    engines' log-prob match; the next sync passes both."""
    from mcore_rl.sync.checksum import WeightMismatch

    cfg, group, engine, sync, source = run
    group.call("run", perturb, 1.05)
    group.call("run", skip_next_sync)
    with pytest.raises(WeightMismatch, match=match):
        sync(3, verify=True)
    assert logp_gap(cfg, group, engine, source) > 1e-2
    sync(4, verify=True)
    assert logp_gap(cfg, group, engine, source) < 1e-3


def corrupt_next_sync(actor, suffix: str):
    """Inside a trainer rank: the next sync sends `suffix`'s tensor slightly off (after the
    expected digests saw the true one), then the transport is itself again."""
    transport = actor.sync_session.transport
    send = transport.send

    def corrupted(named, last):
        transport.send = send if last else corrupted
        return send([(n, t + 0.01 if n.endswith(suffix) else t) for n, t in named], last)

    transport.send = corrupted


def skip_next_sync(actor):
    transport = actor.sync_session.transport
    send = transport.send

    def skipped(named, last):
        if last:
            transport.send = send

    transport.send = skipped


def perturb(actor, scale: float):
    with torch.no_grad():
        for p in actor.model.parameters():
            p.mul_(scale)


def logp_gap(cfg, group, engine, source) -> float:
    """Mean |engine - trainer| log-prob of the engine's own samples of 8 prompts."""
    from mcore_rl.loop import step_batch

    idx = [i for i in range(8) for _ in range(cfg.rollout.n)]
    batch = step_batch.rollout(engine, source, idx, step_batch.sampling_params(cfg, source, seed=3))
    ours = torch.cat(group.call("log_probs", batch))
    mask = batch["response_mask"].bool()
    return (ours - batch["rollout_log_probs"])[mask].abs().mean().item()
