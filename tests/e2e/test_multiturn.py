"""Multi-turn rollouts with a tool, end to end: `configs/tiny_multiturn_cpu.yaml` (the README's
command) on SGLang's CPU engine in sync mode. The tiny model learns a task it can only solve
through the tool (mcore_rl/envs/lookup.py: the answer is a letter only the tool's reply holds),
and in the same run the model's tokens keep the engine's log-probs across turns as a single-turn
run's do (a re-tokenized or shifted token would not), the trainer routes every token as the
engine did, and the engine reuses its prefix cache from turn to turn. A fully_async run of
conversations killed mid-run resumes from its checkpoint, training each step's conversations once."""

from __future__ import annotations

import torch

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


def test_fully_async_conversations_killed_mid_run_resume_each_step_once(tmp_path):
    """fully_async conversations (engine on a "GPU" of its own), the whole run SIGKILLed just after
    its step-3 checkpoint, while the worker is generating the conversations of steps 4 and 5 (the
    staleness bound lets it run up to two steps ahead), then the same command resumes.

    Exact equality with an uninterrupted run cannot hold for fully_async by design: which weights
    sample a step's conversations depends on timing (a step's groups start ahead, under the version
    the engines hold then), a resumed run's buffer starts empty, so its first step samples fresh,
    and the worker seeds its groups in the order it starts them. What is exact and checked here: the
    run resumes from the step-3 checkpoint; each of steps 1-6 is trained once, on exactly its own
    prompts' conversations, in order (the dumped prompt indices), so the conversations in flight at
    the kill were regenerated whole, none lost, none trained twice, none half-kept; metrics.jsonl
    holds each step once; the resumed run's first step samples on the restored weights only, and
    its engine's log-probs are the restored trainer's to 1e-5 (a single-turn run's gap: ~1e-7)."""
    import json
    import os
    import signal
    import time

    from mcore_rl import config as C
    from mcore_rl.data.prompts import load_prompt_sources
    from mcore_rl.train import step_prompts
    from tests.support.sync_checks import BROADCAST, ROOT

    t0 = time.time()
    out, dump = str(tmp_path / "run"), tmp_path / "dump"
    overrides = (*BROADCAST, "trainer.mode=fully_async", "trainer.total_training_steps=6", "trainer.save_freq=3",
                 "trainer.test_freq=-1", "trainer.val_before_train=false", f"trainer.rollout_dump_dir={dump}")
    config = "configs/tiny_multiturn_cpu.yaml"
    p = _train(out, *overrides, config=config, start_new_session=True)
    try:
        deadline = time.time() + 600
        while not os.path.exists(os.path.join(out, "checkpoints", "step_3")) and time.time() < deadline:
            if p.poll() is not None:
                break
            time.sleep(0.1)
        running = p.poll() is None
        if running:
            os.killpg(p.pid, signal.SIGKILL)
        log, _ = p.communicate(timeout=60)
        assert running, f"the run ended before it could be killed:\n{_failure(log)}"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    killed_at = time.time() - t0
    again = _train(out, *overrides, config=config)
    log, _ = again.communicate(timeout=900)
    assert again.returncode == 0, _failure(log)
    assert "resumed from" in log and log.split("resumed from")[1].split()[0].endswith("step_3"), _failure(log)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        updates = [r["step"] for r in map(json.loads, f) if "reward/mean" in r]
    assert updates == [1, 2, 3, 4, 5, 6], updates  # the killed run's later steps were dropped, none repeated
    steps = by_step(out)
    for k in range(1, 7):
        assert steps[k]["multiturn/tool_failures"] == 0 and steps[k]["multiturn/turns_mean"] >= 1, (k, steps[k])
        assert steps[k]["async/staleness_max"] <= 1, (k, steps[k])
    assert steps[4]["async/staleness_max"] == 0, steps[4]  # sampled on the restored step-3 weights only
    assert steps[4]["rollout/logp_diff_abs_mean"] < 1e-5, steps[4]
    cfg = C.load_config(os.path.join(ROOT, config), [f"trainer.output_dir={out}", *overrides])
    source, _ = load_prompt_sources(cfg)
    n = cfg.rollout.n
    for k in range(1, 7):
        d = torch.load(dump / f"step_{k}.pt", weights_only=True)
        assert d["index"].tolist() == [i for i in step_prompts(cfg, source, k) for _ in range(n)], k
        mask, versions = d["batch"]["response_mask"].bool(), d["batch"]["token_versions"]
        # each conversation opens with a model turn; its tokens within the staleness bound of step k
        assert mask[:, 0].all(), k
        assert (versions[mask] <= k - 1).all() and (versions[mask] >= k - 2).all(), k
        if k == 4:
            assert (versions[mask] == 3).all()
    print(f"killed at {killed_at:.0f} s, whole test {time.time() - t0:.0f} s")
