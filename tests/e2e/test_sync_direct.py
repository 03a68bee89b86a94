"""rollout.sync_load=direct in SGLang's own engine: each bucket reaches the schedulers through their
RPC (mcore_rl.rollout.sglang_plugin) and is copied into their parameters by the read-back's placement
table, not by SGLang's load_weights. Checked by the engine itself after the trainer moved: the
weights it holds (read back) and its log-probs of its own samples against the trainer's. That the
placement equals SGLang's own loader, bit for bit, in three families: tests/e2e/test_sglang_sync.py."""

from __future__ import annotations

import pytest

from tests.support.sync_checks import QWEN3_MOE_TINY, check_a_skipped_sync_fails, logp_gap, started_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    with started_run(str(tmp_path_factory.mktemp("direct")), (*QWEN3_MOE_TINY, "rollout.sync_load=direct")) as parts:
        yield parts


def loads_direct(actor) -> bool:
    """Inside a trainer rank: its transport hands buckets to the engines' direct load."""
    return actor.sync_session.transport.direct is not None


def test_direct_syncs_are_read_back_and_the_engine_follows_the_trainer(run):
    cfg, group, engine, sync, source = run
    assert group.call("run", loads_direct) == [True, True]
    assert sync(0)["sync/verified"] == 1.0
    assert logp_gap(cfg, group, engine, source) < 1e-3
    # the trainer moves and a sync is skipped: read-back and log-probs both fail; a direct sync heals both
    check_a_skipped_sync_fails(run, "differs from the trainer's weights")
