"""The weight sync into SGLang's real engine, checked by reading the engine back.

Two Megatron actor processes (EP=2) and two colocated SGLang engines, set up exactly as
`python -m mcore_rl.train` does (`mcore_rl.rollout.launch`). A good sync passes the read-back and
SGLang's log-probs of its samples equal the trainer's; a sync that corrupts one tensor in flight,
or one that is skipped while the trainer's weights moved, fails the read-back naming the
parameter, and the skipped one also shows in the log-prob difference. The other transports (the
gloo stand-in for NCCL into engines on their own "GPUs", and disk) run whole GRPO steps.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mcore_rl import config as C
from mcore_rl.sync.checksum import WeightMismatch
from tests.test_train import by_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import ray

    from mcore_rl.data.prompts import load_prompt_sources
    from mcore_rl.ppo import stop_ids
    from mcore_rl.rollout.launch import launch
    from mcore_rl.train import ActorGroup, prepare_model

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    out = str(tmp_path_factory.mktemp("sync_run"))
    cfg = C.load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml"), [f"trainer.output_dir={out}"])
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
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


def logp_gap(cfg, group, engine, source) -> float:
    from mcore_rl import ppo

    idx = [i for i in range(8) for _ in range(cfg.rollout.n)]
    batch = ppo.rollout(engine, source, idx, ppo.sampling_params(cfg, source, seed=3))
    ours = torch.cat(group.call("log_probs", batch))
    mask = batch["response_mask"].bool()
    return (ours - batch["rollout_log_probs"])[mask].abs().mean().item()


def test_readback_passes_and_logprobs_match_after_a_sync(run):
    cfg, group, engine, sync, source = run
    assert sync(0)["sync/verified"] == 1.0  # the first sync is always read back
    assert logp_gap(cfg, group, engine, source) < 1e-3


def test_a_corrupted_tensor_fails_the_readback(run):
    cfg, group, engine, sync, source = run
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    group.call("run", corrupt_next_sync, name)
    with pytest.raises(WeightMismatch, match="kv_b_proj.weight differs"):
        sync(1, verify=True)
    sync(2, verify=True)  # a good sync heals it, and passes
    assert logp_gap(cfg, group, engine, source) < 1e-3


def test_a_skipped_sync_fails_the_readback_and_the_logprob_match(run):
    cfg, group, engine, sync, source = run
    group.call("run", perturb, 1.05)  # the trainer moved ...
    group.call("run", skip_next_sync)  # ... but nothing reached the engines
    with pytest.raises(WeightMismatch, match="differs from the trainer's weights"):
        sync(3, verify=True)
    assert logp_gap(cfg, group, engine, source) > 1e-2
    sync(4, verify=True)
    assert logp_gap(cfg, group, engine, source) < 1e-3


@pytest.mark.parametrize("overrides", [
    # engines on their own "GPU", fed over an update group (gloo stands in for NCCL)
    ("cluster.n_gpus_per_node=3", "cluster.colocate=false", "cluster.rollout_gpus=1"),
    ("rollout.sync_transport=disk",),  # the fallback: versions written to disk, loaded by the engine
], ids=["broadcast", "disk"])
def test_other_transports_run_verified_grpo_steps(tmp_path, overrides):
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "mcore_rl.train", "--config", "configs/tiny_cpu.yaml", f"trainer.output_dir={out}",
           "trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.val_before_train=false",
           "trainer.save_freq=-1", "rollout.verify_sync_every=1", *overrides]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"))
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    steps = by_step(out)
    assert sorted(steps) == [0, 1, 2, 3]
    assert all(steps[k]["sync/verified"] == 1.0 and steps[k]["rollout/logp_diff_abs_mean"] < 1e-3
               for k in (1, 2, 3)), steps
