"""The async modes (mcore_rl/async_loop.py) with SGLang's real engine on a "GPU" of its own, fed over
the gloo update group. one_step_off: the tiny task still learns, every step after the first trains
on samples exactly one version old (from metrics.jsonl), and the engine really lags the trainer.
fully_async: a partial rollout that a weight sync splits keeps tokens, log-probs, mask and versions
aligned token for token, and no sample past trainer.max_staleness is trained on. Staleness is per
sample, from its oldest token."""

from __future__ import annotations

import torch

from mcore_rl.async_loop import staleness_metrics


def test_staleness_is_per_sample_from_its_oldest_token():
    versions = torch.tensor([[5, 5, 5, 0], [3, 4, 5, 5], [4, 4, 9, 9]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])  # the 9s are padding
    m = staleness_metrics(versions, mask, trainer_version=5)
    # staleness 0, 2 (oldest token 3), 1; only the second spans versions
    assert m["async/staleness_max"] == 2 and abs(m["async/staleness_mean"] - 1.0) < 1e-9
    assert abs(m["async/partial_fraction"] - 1 / 3) < 1e-6


def test_one_step_off_learns_one_version_behind(tmp_path):
    """On Qwen3-MoE: also issue 27's GRPO run of that family in SGLang's engine, learning."""
    from tests.sync_checks import BROADCAST, QWEN3_MOE_TINY, train
    from tests.test_train import _reward_rises, by_step

    out = str(tmp_path / "run")
    p = train(out, *BROADCAST, *QWEN3_MOE_TINY, "trainer.mode=one_step_off", "trainer.test_freq=-1", "trainer.save_freq=-1",
              "trainer.val_before_train=false")
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    _reward_rises(out)
    steps = by_step(out)
    trained = [k for k in sorted(steps) if k >= 1]
    assert [steps[k]["async/staleness_max"] for k in trained] == [0.0] + [1.0] * (len(trained) - 1)
    assert all(steps[k]["async/staleness_mean"] == steps[k]["async/staleness_max"] for k in trained)
    assert all(steps[k]["async/partial_fraction"] == 0.0 for k in trained)
    for k in trained:
        assert 0 <= steps[k]["async/engine_idle_fraction"] <= 1 and 0 <= steps[k]["async/trainer_idle_fraction"] <= 1
        assert steps[k]["perf/samples_per_s"] > 0
    # step 1 samples on the trainer's own weights; later ones on the weights one update back: the
    # engine's log-probs then differ from the trainer's, and decoupled PPO's behaviour weights act
    gaps = [steps[k]["rollout/logp_diff_abs_mean"] for k in trained]
    assert gaps[0] < 1e-3 and min(gaps[1:]) > 1e-3, gaps
    assert all("rollout_corr/rollout_is_mean" in steps[k] for k in trained), sorted(steps[2])


def test_partial_rollout_stays_aligned_token_for_token_and_stale_groups_are_regenerated(tmp_path):
    """Responses generated a token at a time; the trainer's weights move and are synced while they
    are in flight. The engine's log-prob of each token equals the trainer's exactly where the token
    records the trainer's version: tokens, log-probs, mask and versions line up token for token."""
    from mcore_rl.async_loop import FullyAsync
    from mcore_rl.train import step_prompts
    from tests.sync_checks import BROADCAST, perturb, started_run

    overrides = (*BROADCAST, "trainer.mode=fully_async", "trainer.partial_rollout_tokens=1", "trainer.max_staleness=2",
                 "rollout.max_response_len=4", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                 "actor.micro_batch_size=16")
    with started_run(str(tmp_path), overrides) as (cfg, group, engine, sync, source):
        sync(0)
        run = FullyAsync(cfg, engine, sync, source, lambda k: step_prompts(cfg, source, k), start=0)
        try:
            w = run.worker
            with w.cond:  # the first piece is in: every response in flight has a token of version 0
                while not any(s.tokens and not s.finished for g in w.in_flight.values() for s in g):
                    w.raise_if_failed()
                    w.cond.wait(timeout=1.0)
            group.call("run", perturb, 1.05)
            run.sync(1)  # version 1 continues them
            batch, _, _, _, metrics = run.step_batch(2)  # trains version 1
            ours = torch.cat(group.call("log_probs", batch))
            # no sync: trains version 3, where groups with a version-0 token are 3 versions old
            later = run.step_batch(4)
        finally:
            run.shutdown()
    mask, versions = batch["response_mask"].bool(), batch["token_versions"]
    gap = (ours - batch["rollout_log_probs"]).abs()
    assert mask.any(1).all() and (mask.long().cummin(1).values == mask.long()).all()  # responses are prefixes
    assert (versions[~mask] == 0).all() and (batch["rollout_log_probs"][~mask] == 0).all()
    assert (versions.diff(dim=1)[mask[:, 1:]] >= 0).all()  # a response's versions never go back
    assert metrics["async/partial_fraction"] > 0 and metrics["async/staleness_max"] == 1
    assert (gap[mask & (versions == 1)] < 1e-3).all(), gap[mask & (versions == 1)].max()
    assert gap[mask & (versions == 0)].mean() > 1e-2
    batch3, metrics3 = later[0], later[4]
    assert metrics3["async/regenerated_groups"] > 0 and metrics3["async/staleness_max"] == 2
    assert (batch3["token_versions"][batch3["response_mask"].bool()] == 1).all()
