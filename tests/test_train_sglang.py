"""The weight sync into SGLang's real engine, checked by reading the engine back.

Two Megatron actor processes (EP=2) and two colocated SGLang engines, set up exactly as
`python -m mcore_rl.train` does (`mcore_rl.rollout.launch`). A good sync passes the read-back and
SGLang's log-probs of its samples equal the trainer's; a sync that corrupts one tensor in flight,
or one that is skipped while the trainer's weights moved, fails the read-back naming the
parameter, and the skipped one also shows in the log-prob difference. The other transports (the
gloo stand-in for NCCL into engines on their own "GPUs", and disk) verify every sync of a 30-step
GRPO run, each on one of the other MoE families (GLM-4.5, Qwen3-MoE), which learns.
"""

from __future__ import annotations

import pytest

from tests.sync_checks import (BROADCAST, DISK, GLM4_MOE_TINY, QWEN3_MOE_TINY, check_a_corrupted_tensor_fails,
                               check_a_skipped_sync_fails, check_verified_grpo_steps, logp_gap, started_run)


# first, before the module's engine fixture starts: with its engines alive on the same 2 cores,
# these runs took 2-3x their time alone in CI
@pytest.mark.parametrize("overrides", [(*BROADCAST, *GLM4_MOE_TINY), (*DISK, *QWEN3_MOE_TINY)],
                         ids=["broadcast-glm4_moe", "disk-qwen3_moe"])
def test_other_transports_verify_every_sync_of_a_grpo_run_that_learns(tmp_path, overrides):
    """Also issue 27's GRPO run of each new family in SGLang's engine, learning."""
    check_verified_grpo_steps(str(tmp_path / "run"), *overrides, steps=30)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    with started_run(str(tmp_path_factory.mktemp("sync_run"))) as parts:
        yield parts


def test_readback_passes_and_logprobs_match_after_a_sync(run):
    cfg, group, engine, sync, source = run
    assert sync(0)["sync/verified"] == 1.0  # the first sync is always read back
    assert logp_gap(cfg, group, engine, source) < 1e-3


def test_a_corrupted_tensor_fails_the_readback(run):
    check_a_corrupted_tensor_fails(run, "kv_b_proj.weight differs")


def test_a_skipped_sync_fails_the_readback_and_the_logprob_match(run):
    check_a_skipped_sync_fails(run, "differs from the trainer's weights")
