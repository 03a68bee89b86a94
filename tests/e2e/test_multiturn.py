"""Multi-turn rollouts with a tool, end to end: `configs/tiny_multiturn_cpu.yaml` (the README's
command) on SGLang's CPU engine in sync mode. The tiny model learns a task it can only solve
through the tool (mcore_rl/envs/lookup.py: the answer is a letter only the tool's reply holds),
and in the same run the model's tokens keep the engine's log-probs across turns as a single-turn
run's do (a re-tokenized or shifted token would not), the trainer routes every token as the
engine did, and the engine reuses its prefix cache from turn to turn. A fully_async run of
conversations learns the task too, across a SIGKILL mid-conversation and a resume from its
checkpoint that trains each step's conversations once."""

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


def test_fully_async_conversations_learn_and_a_run_killed_mid_conversation_resumes_each_step_once(tmp_path):
    """fully_async conversations (engine on a "GPU" of its own) learn the task within the issue's
    bound, across a kill: the whole run SIGKILLed after its step-10 checkpoint at a moment when
    conversations are open (the environment's trace says so: tests/support/traced_env.py, its tool
    taking 0.2 s), then the same command resumes (its tool without the delay) and ends at step 30;
    the mean reward of steps 1-3 is below 0.3 and of steps 28-30 above 0.7.

    Exact equality with an uninterrupted run cannot hold for fully_async by design: which weights
    sample a step's conversations depends on timing (a step's groups start ahead, under the version
    the engines hold then), a resumed run's buffer starts empty, so its first step samples fresh,
    and the worker seeds its groups in the order it starts them. What is exact and checked here: the
    run resumes from the step-10 checkpoint; each of steps 1-30 is trained once, on exactly its own
    prompts' conversations, in order (the dumped prompt indices), so the conversations in flight at
    the kill were regenerated whole, none lost, none trained twice, none half-kept; metrics.jsonl
    holds each step once; the resumed run's first step samples on the restored weights only, and
    its engine's log-probs are the restored trainer's to 1e-5 (a single-turn run's gap: ~1e-7)."""
    import json
    import os
    import signal
    import time

    from mcore_rl.config import sections as C
    from mcore_rl.data.prompts import load_prompt_sources
    from mcore_rl.loop.sources import step_prompts
    from tests.support.sync_checks import BROADCAST, ROOT
    from tests.support.traced_env import open_conversations

    t0 = time.time()
    steps_n, kill_after = 30, 10
    out, dump, trace = str(tmp_path / "run"), tmp_path / "dump", str(tmp_path / "trace")
    overrides = (*BROADCAST, "trainer.mode=fully_async", f"trainer.total_training_steps={steps_n}",
                 f"trainer.save_freq={kill_after}", "trainer.test_freq=-1", "trainer.val_before_train=false",
                 f"trainer.rollout_dump_dir={dump}", "rollout.env=tests.support.traced_env:TracedLookupEnv",
                 f"rollout.env_args.trace={trace}", "rollout.env_args.delay_s=0.2")
    config = "configs/tiny_multiturn_cpu.yaml"
    p = _train(out, *overrides, config=config, start_new_session=True)
    try:
        deadline = time.time() + 600
        checkpoint = os.path.join(out, "checkpoints", f"step_{kill_after}")
        while time.time() < deadline and p.poll() is None and not (
                os.path.exists(checkpoint) and open_conversations(trace) > 0):
            time.sleep(0.02)
        running, in_flight = p.poll() is None, open_conversations(trace)
        if running:
            os.killpg(p.pid, signal.SIGKILL)
        log, _ = p.communicate(timeout=60)
        assert running, f"the run ended before it could be killed:\n{_failure(log)}"
        assert in_flight > 0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    killed_at = time.time() - t0
    again = _train(out, *overrides, "rollout.env_args.delay_s=0", config=config)  # the delay served the kill only
    log, _ = again.communicate(timeout=900)
    assert again.returncode == 0, _failure(log)
    print("\n".join(ln for ln in log.splitlines() if ln.startswith("start:")))
    resumed = log.split("resumed from")[1].split()[0] if "resumed from" in log else ""
    assert resumed.endswith(f"step_{kill_after}"), _failure(log)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        updates = [r["step"] for r in map(json.loads, f) if "reward/mean" in r]
    assert updates == list(range(1, steps_n + 1)), updates  # the killed run's later steps were dropped, none repeated
    rewards = [r["reward/mean"] for r in _reward_rises(out)]  # first 3 steps below 0.3 on average, last 3 above 0.7
    steps = by_step(out)
    for k in range(1, steps_n + 1):
        assert steps[k]["multiturn/tool_failures"] == 0 and steps[k]["multiturn/turns_mean"] >= 1, (k, steps[k])
        assert steps[k]["async/staleness_max"] <= 1, (k, steps[k])
    first = kill_after + 1  # the resumed run's first step: sampled on the restored weights only
    assert steps[first]["async/staleness_max"] == 0, steps[first]
    assert steps[first]["rollout/logp_diff_abs_mean"] < 1e-5, steps[first]
    cfg = C.load_config(os.path.join(ROOT, config), [f"trainer.output_dir={out}", *overrides])
    source, _ = load_prompt_sources(cfg)
    n = cfg.rollout.n
    for k in range(1, steps_n + 1):
        d = torch.load(dump / f"step_{k}.pt", weights_only=True)
        assert d["index"].tolist() == [i for i in step_prompts(cfg, source, k) for _ in range(n)], k
        mask, versions = d["batch"]["response_mask"].bool(), d["batch"]["token_versions"]
        # each conversation opens with a model turn; its tokens within the staleness bound of step k
        assert mask[:, 0].all(), k
        assert (versions[mask] <= k - 1).all() and (versions[mask] >= k - 2).all(), k
        if k == first:
            assert (versions[mask] == kill_after).all()
    print(f"killed at {killed_at:.0f} s with {in_flight} conversations open, whole test {time.time() - t0:.0f} s; "
          f"reward {' '.join(f'{r:.2f}' for r in rewards)}")
