"""Multi-turn rollouts with a tool, end to end: `configs/tiny_multiturn_cpu.yaml` (the README's
command) on SGLang's CPU engine in sync mode. The tiny model learns a task it can only solve
through the tool (mcore_rl/envs/lookup.py: the answer is a letter only the tool's reply holds),
and in the same run the model's tokens keep the engine's log-probs across turns as a single-turn
run's do (a re-tokenized or shifted token would not), the trainer routes every token as the
engine did, and the engine reuses its prefix cache from turn to turn."""

from __future__ import annotations

from tests.e2e.test_train import _failure, _reward_rises, _train, by_step


def test_tiny_model_learns_a_task_only_its_tool_can_answer(tmp_path):
    out = str(tmp_path / "run")
    p = _train(out, "trainer.total_training_steps=30", "trainer.test_freq=30",
               config="configs/tiny_multiturn_cpu.yaml")
    log, _ = p.communicate(timeout=900)
    assert p.returncode == 0, _failure(log)
    assert len(_reward_rises(out)) == 30  # first 3 steps below 0.3 on average, last 3 above 0.7
    steps = by_step(out)
    assert steps[30]["val/reward"] > 0.7
    for k in range(1, 31):
        m = steps[k]
        assert m["rollout/logp_diff_abs_mean"] < 1e-5, (k, m)  # single-turn runs: about 1e-7
        assert m["rollout/route_agreement"] == 1.0, (k, m)
        assert m["multiturn/tool_failures"] == 0
        assert 0 < m["multiturn/prefix_cache_hit_rate"] < 1
        assert m["timing/rollout_generate"] > 0 and m["timing/rollout_tools"] >= 0
    # early on the model fumbles the call (an error reply, another turn); at the end it looks up and answers
    assert steps[1]["multiturn/turns_mean"] > 2.1
    assert 1.9 < steps[30]["multiturn/turns_mean"] < 2.2 and steps[30]["multiturn/observation_tokens_mean"] >= 2
