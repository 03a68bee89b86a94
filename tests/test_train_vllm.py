"""GRPO with vLLM's real engine generating (`rollout.engine=vllm`), on CPU, and its weight sync.

The README's run with vLLM (configs/tiny_cpu.yaml with the MLA dims vLLM's CPU kernels need,
`sync_checks.VLLM_TINY`) learns, and after every sync vLLM's log-probs of its own samples equal
the Megatron actor's. vLLM repacks its weights past reading back, so a sync is verified by the
engines' log-probs of fixed sequences against the trainer's: a sync that corrupts one tensor in
flight, or one skipped while the trainer's weights moved, fails that check. The other transports
(gloo standing in for NCCL into engines on their own "GPUs", and disk) run verified GRPO steps.
"""

from __future__ import annotations

import pytest

from tests.sync_checks import (BROADCAST, DISK, VLLM_TINY, check_a_corrupted_tensor_fails, check_a_skipped_sync_fails,
                               check_verified_grpo_steps, logp_gap, started_run, train)
from tests.test_train import _reward_rises, by_step

PROBE_FAILED = "log-probs of the probe sequences differ from the trainer's"


def test_tiny_grpo_learns_with_vllm(tmp_path):
    out = str(tmp_path / "run")
    p = train(out, *VLLM_TINY, "trainer.save_freq=-1", "rollout.verify_sync_every=1")
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert len(_reward_rises(out)) == 30
    steps = by_step(out)
    diffs = [steps[k]["rollout/logp_diff_abs_mean"] for k in range(1, 31)]  # after every sync: same weights
    assert max(diffs) < 1e-3, diffs
    assert all(steps[k]["sync/verified"] == 1.0 for k in range(0, 31))


# first, before the module's engine fixture starts: its engines, alive on the same 2 cores, slowed
# these runs (CI: 152 s for the two; 123 s with the fixture not yet started)
@pytest.mark.parametrize("overrides", [BROADCAST, DISK], ids=["broadcast", "disk"])
def test_other_transports_run_verified_grpo_steps(tmp_path, overrides):
    check_verified_grpo_steps(str(tmp_path / "run"), *VLLM_TINY, *overrides)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    with started_run(str(tmp_path_factory.mktemp("sync_run")), VLLM_TINY) as parts:
        yield parts


def test_the_check_passes_and_logprobs_match_after_a_sync(run):
    cfg, group, engine, sync, source = run
    assert sync(0)["sync/verified"] == 1.0  # the first sync is always checked
    assert logp_gap(cfg, group, engine, source) < 1e-3


def test_a_corrupted_tensor_fails_the_check(run):
    check_a_corrupted_tensor_fails(run, PROBE_FAILED)


def test_a_skipped_sync_fails_the_check_and_the_logprob_match(run):
    check_a_skipped_sync_fails(run, PROBE_FAILED)
