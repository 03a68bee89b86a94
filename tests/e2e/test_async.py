"""The async modes (mcore_rl/loop/async_sources.py) with SGLang's real engine on a "GPU" of its own, fed over
the gloo update group. one_step_off: the tiny task still learns, every step after the first trains
on samples exactly one version old (from metrics.jsonl), and the engine really lags the trainer.
fully_async: the tiny task learns within the staleness bound, a killed engine is a one-line error
and the run resumes from its checkpoint training each step's own prompts once, an engine killed
during a weight sync fails the sync within seconds; a partial rollout
that a weight sync splits keeps tokens, log-probs, mask and versions aligned token for token, no
sample past trainer.max_staleness is trained on, and dynamic sampling takes its rounds from the
buffer. Staleness is per sample, from its oldest token."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.loop.async_sources import staleness_metrics
from tests.support.sync_checks import BROADCAST, train


def test_staleness_is_per_sample_from_its_oldest_token():
    versions = torch.tensor([[5, 5, 5, 0], [3, 4, 5, 5], [4, 4, 9, 9]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])  # the 9s are padding
    m = staleness_metrics(versions, mask, trainer_version=5)
    # staleness 0, 2 (oldest token 3), 1; only the second spans versions
    assert m["async/staleness_max"] == 2 and abs(m["async/staleness_mean"] - 1.0) < 1e-9
    assert abs(m["async/partial_fraction"] - 1 / 3) < 1e-6


def test_one_step_off_learns_one_version_behind(tmp_path):
    from tests.e2e.test_train import _reward_rises, by_step

    out = str(tmp_path / "run")
    p = train(out, *BROADCAST, "trainer.mode=one_step_off", "trainer.test_freq=-1", "trainer.save_freq=-1",
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


def test_fully_async_learns_and_a_killed_engine_resumes_training_each_steps_prompts_once(tmp_path):
    """fully_async on the tiny task, responses a token a piece (a sync lands between two): the engine
    is killed mid-run after the step-10 checkpoint; the run stops within a minute with one error
    line naming the engine, nonzero. The same command resumes from step 10 and ends. Over the 30
    steps (30 x 128 samples, as the sync run of tests/e2e/test_train.py) the reward rises past that
    run's thresholds, and no trained sample is more than trainer.max_staleness (1) versions old at
    any step (metrics.jsonl). Every step, before and after the kill, trained exactly its own
    prompts, in order (the dumped prompt indices): the groups in the buffer at the kill were
    regenerated, none lost, none trained twice."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from mcore_rl.config import sections as C
    from mcore_rl.data.prompts import load_prompt_sources
    from mcore_rl.loop.sources import step_prompts
    from tests.support.sync_checks import ROOT
    from tests.e2e.test_train import _reward_rises, by_step

    out, dump = str(tmp_path / "run"), tmp_path / "dump"
    overrides = (*BROADCAST, "trainer.mode=fully_async", "trainer.partial_rollout_tokens=1", "trainer.test_freq=-1",
                 "trainer.val_before_train=false", "trainer.save_freq=10", f"trainer.rollout_dump_dir={dump}")
    cmd = [sys.executable, "-m", "mcore_rl.train", "--config", "configs/tiny_cpu.yaml", f"trainer.output_dir={out}",
           *overrides]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env=dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"))
    try:
        deadline = time.time() + 600
        while not os.path.exists(os.path.join(out, "checkpoints", "step_10")) and time.time() < deadline:
            assert p.poll() is None, p.communicate()[1][-3000:]
            time.sleep(0.2)
        engines = [c for c in psutil.Process(p.pid).children(recursive=True) if c.name().startswith("ray::SGLang")]
        assert engines, "no engine process found"
        for e in engines:
            for c in [e, *e.children(recursive=True)]:
                c.kill()
        t0 = time.time()
        _, err = p.communicate(timeout=120)  # never a hang
        assert time.time() - t0 < 60
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    last = err.strip().splitlines()[-1]
    assert p.returncode == 1 and last.startswith("error: SGLang engine 0 node 0 died during "), err[-3000:]
    assert "resumes from the last checkpoint" in last
    again = train(out, *overrides)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "resumed from" in again.stdout and "step_10" in again.stdout.split("resumed from")[1].splitlines()[0]
    steps = by_step(out)
    assert sorted(k for k, s in steps.items() if "reward/mean" in s) == list(range(1, 31))
    _reward_rises(out)
    trained = [steps[k] for k in range(1, 31)]
    assert all(s["async/staleness_max"] <= 1 for s in trained), [s["async/staleness_max"] for s in trained]
    assert max(s["async/partial_fraction"] for s in trained) > 0  # syncs did split responses
    cfg = C.load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml"), [f"trainer.output_dir={out}", *overrides])
    source, _ = load_prompt_sources(cfg)
    for k in range(1, 31):
        dumped = torch.load(dump / f"step_{k}.pt", weights_only=True)["index"]
        assert dumped.tolist() == [i for i in step_prompts(cfg, source, k) for _ in range(8)], k


@pytest.fixture(scope="module")
def fully_async_run(tmp_path_factory):
    """A run's pieces (tests.support.sync_checks.started_run) for fully_async into an engine of its own,
    responses a token a piece. The last test here kills its engine."""
    from tests.support.sync_checks import started_run

    overrides = (*BROADCAST, "trainer.mode=fully_async", "trainer.partial_rollout_tokens=1", "trainer.max_staleness=2",
                 "rollout.max_response_len=4", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                 "actor.micro_batch_size=16")
    with started_run(str(tmp_path_factory.mktemp("fully_async")), overrides) as parts:
        yield parts


def test_partial_rollout_stays_aligned_token_for_token_and_stale_groups_are_regenerated(fully_async_run):
    """Responses generated a token at a time; the trainer's weights move and are synced while they
    are in flight. The engine's log-prob of each token equals the trainer's exactly where the token
    records the trainer's version: tokens, log-probs, mask and versions line up token for token."""
    import copy

    from mcore_rl.loop.async_sources import FullyAsync
    from mcore_rl.loop.sampling import refill_order
    from mcore_rl.loop.sources import step_prompts
    from tests.support.sync_checks import perturb

    cfg, group, engine, sync, source = fully_async_run
    sync(0)
    group.call("run", perturb, 1.05)  # the trainer's version 1, before the worker races ahead
    run = FullyAsync(cfg, engine, sync, source, lambda k: step_prompts(cfg, source, k), start=0)
    try:
        w = run.worker
        with w.cond:  # the first piece is in: step 1's responses in flight have a token of version 0
            while not any(s.tokens and not s.finished for (step, _), g in w.in_flight.items() if step == 1
                          for s in g):
                w.raise_if_failed()
                w.cond.wait(timeout=1.0)
            # max_staleness 2: steps 1-3 start on version 0 (step 3 trains with version 2), step 4 waits
            assert {step for step, _ in [*w.in_flight, *w.ready]} == {1, 2, 3}
        run.sync(1)  # version 1 continues them
        got = run.next_batch(2)  # step 1's groups, trained by version 1
        batch, metrics = got.batch, got.metrics
        ours = torch.cat(group.call("log_probs", batch))
        # step 2's groups, no sync: trained by version 3, where a group with a version-0 token is 3 versions old
        later = run.next_batch(4)
    finally:
        run.shutdown()
    # DAPO's dynamic sampling through the same buffer: refill rounds requested as the step needs them
    dynamic = copy.deepcopy(cfg)
    dynamic.algorithm.filter_groups.enable = True
    run = FullyAsync(dynamic, engine, sync, source, lambda k: step_prompts(cfg, source, k), start=4)
    try:
        filtered = run.next_batch(5)
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
    batch3, metrics3 = later.batch, later.metrics
    assert metrics3["async/regenerated_groups"] > 0 and metrics3["async/staleness_max"] == 2
    assert (batch3["token_versions"][batch3["response_mask"].bool()] == 1).all()
    # 4 groups whose rewards vary, the first ones of step 5's prompts and refills in their order
    idx, reward, metrics = filtered.idx, filtered.reward, filtered.metrics
    order = refill_order(len(source.prompts), step_prompts(cfg, source, 5), cfg.trainer.seed * 100003 + 5)
    places = [order.index(i) for i in idx[::8]]
    assert len(idx) == 32 and (reward.reshape(4, 8).amax(1) > reward.reshape(4, 8).amin(1)).all()
    assert places == sorted(set(places)) and places[-1] < 4 * metrics["train/num_gen_batches"], places
    assert 0 < metrics["train/kept_group_fraction"] <= 1


def test_a_round_of_pieces_holds_one_wave_of_the_engines_oldest_step_first(fully_async_run):
    """More responses in flight than the engines decode at once (max_live): each round of pieces takes
    the oldest steps' unfinished responses up to that capacity, so a long response's next piece never
    waits behind a second wave of the next step's fresh ones; every group still finishes."""
    import itertools

    from mcore_rl.loop import step_batch
    from mcore_rl.loop.async_sources import BusyClock
    from mcore_rl.rollout.buffer import RolloutWorker

    cfg, group, engine, sync, source = fully_async_run
    rounds: list[list[int]] = []  # per round, each piece's prompt (its first token - 3)

    class Recording:  # SGLang's engine; the rounds' requests noted on the way
        def generate_requests(self, requests):
            rounds.append([r.prompt[0] - 3 for r in requests])
            return engine.generate_requests(requests)

    params = step_batch.sampling_params(cfg, source, seed=5)
    groups = [((1, 0), 0), ((1, 1), 1), ((2, 0), 2)]  # then step 3, never admitted
    stream = itertools.chain(groups, (((3, k), 3) for k in itertools.count()))
    worker = RolloutWorker(Recording(), lambda i: [i + 3] * 4, stream, params, max_len=4, segment=1,
                           may_start=lambda key, version: key[0] <= 2, version=0, engine_clock=BusyClock(),
                           wait_clock=BusyClock(), max_live=12)
    try:
        done = worker.take([key for key, _ in groups])
    finally:
        worker.stop()
    n = params.n
    assert [len(g) for g in done] == [n] * 3 and all(s.finished for g in done for s in g)
    assert all(len(r) <= 12 for r in rounds) and len(rounds[0]) == 12, [len(r) for r in rounds]
    assert rounds[0] == [0] * n + [1] * (12 - n)  # step 1's two groups before step 2's
    assert all(r == sorted(r) for r in rounds)
    assert any(2 in r for r in rounds[1:])  # step 2 comes in as step 1's responses finish


def test_stale_groups_dropped_leave_the_step_its_fresh_groups(fully_async_run):
    """trainer.stale_groups=drop with rounds of one group (rollout.max_running_requests = rollout.n):
    step 1's first group gets its first token from version 0, its last group starts after the sync,
    on version 1. Trained as step 4 (version 3, bound 2), the groups with a version-0 token are left
    out, none regenerated, and the step trains on the rest, in its prompts' order."""
    import copy

    from mcore_rl.loop.async_sources import FullyAsync
    from mcore_rl.loop.sources import step_prompts

    cfg, group, engine, sync, source = fully_async_run
    drop = copy.deepcopy(cfg)
    drop.trainer.stale_groups = "drop"
    drop.rollout.max_running_requests = drop.rollout.n
    sync(0)
    run = FullyAsync(drop, engine, sync, source, lambda k: step_prompts(cfg, source, k), start=0)
    try:
        w = run.worker
        with w.cond:  # the first round of pieces is in: group (1, 0) holds version-0 tokens
            while not any(s.tokens for s in w.in_flight.get((1, 0)) or w.ready.get((1, 0)) or []):
                w.raise_if_failed()
                w.cond.wait(timeout=1.0)
        run.sync(1)
        got = run.next_batch(4)
        batch, idx, metrics = got.batch, got.idx, got.metrics
    finally:
        run.shutdown()
    n, prompts = cfg.rollout.n, step_prompts(cfg, source, 1)
    dropped = int(metrics["async/dropped_groups"])
    assert 1 <= dropped < len(prompts) and metrics["async/regenerated_groups"] == 0, metrics
    assert idx == [i for i in prompts[dropped:] for _ in range(n)]  # oldest first: the first groups went
    mask = batch["response_mask"].bool()
    assert (batch["token_versions"][mask] == 1).all() and metrics["async/staleness_max"] == 2


def test_an_engine_killed_during_a_weight_sync_is_an_error_long_before_the_deadline(fully_async_run):
    """The engine's scheduler is stopped and a weight sync starts: the trainer's broadcast waits on
    it. The scheduler is then killed: the sync fails within seconds naming the engine and the call
    it died in (SGLang's watchdog ends the engine, the broadcast gives up on the failed engine
    call), far inside rollout.timeout_s; nothing hangs. Last in the module: it ends the engine."""
    import signal
    import threading
    import time

    from tests.support.rollout_checks import engine_processes

    cfg, group, engine, sync, source = fully_async_run
    procs = engine_processes(engine)
    schedulers = [p for p in procs if "scheduler" in " ".join([p.name(), *p.cmdline()])]
    assert schedulers, [p.cmdline() for p in procs]
    outcome: list[str] = []

    def run():
        try:
            sync(7)
            outcome.append("no error")
        except Exception as e:  # noqa: BLE001 - Ray wraps the trainer's EngineError
            outcome.append(str(e))

    for p in schedulers:
        p.send_signal(signal.SIGSTOP)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(2.0)
    assert thread.is_alive() and not outcome, outcome  # waiting on the stopped engine, mid-sync
    t0 = time.monotonic()
    for p in schedulers:
        p.kill()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the weight sync hung on a dead engine"
    assert time.monotonic() - t0 < 30 < cfg.rollout.timeout_s
    assert "SGLang engine 0 node 0 died during update_weights_from_distributed" in outcome[0], outcome
