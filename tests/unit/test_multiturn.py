"""Multi-turn rollouts (mcore_rl.rollout.multiturn) on a scripted engine: the conversation loop,
the batch it builds and the tools' failures are under test, so the engine only has to answer
deterministically (seeded random ids from a 1000-id range, so no two conversations share a
prefix by chance). The batch is checked against a reference rebuilt from the engine's own
(request, output) pairs alone; the loss side against verl's core_algos."""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest
import torch

from mcore_rl.config import sections as C
from mcore_rl.loop import step_batch
from mcore_rl.data.tasks import make_task
from mcore_rl.rollout.base import Completion
from mcore_rl.rollout.multiturn import MultiTurnRounds, StepResult
from tests.support.verl_reference import verl_module

VOCAB, OBS_BASE, STOP = 1000, 2000, 999  # model ids < 1000, the environment's from 2000 on


class ScriptedEngine:
    """Seeded ids and log-probs per request; keeps every (prompt, completion) it answered, and each prompt's group."""

    label = "scripted engine"

    def __init__(self, stop_chance: float = 0.25, seconds: float = 0.0):
        self.answered: list[tuple[tuple[int, ...], Completion]] = []
        self.group_of: dict[tuple[int, ...], int | None] = {}  # Request.group
        self.stop_chance, self.seconds, self.calls = stop_chance, seconds, 0

    def generate_requests(self, requests):
        self.calls += 1
        time.sleep(self.seconds)
        out = []
        for r in requests:
            rng = random.Random(r.params.seed)
            ids = []
            for k in range(r.params.max_new_tokens):  # a turn opens with a non-stop id: no two alike by chance
                ids.append(STOP if k and rng.random() < self.stop_chance else rng.randrange(3, VOCAB - 1))
                if ids[-1] in r.params.stop_token_ids:
                    break
            c = Completion(ids, [-rng.random() for _ in ids], "stop" if ids[-1] in r.params.stop_token_ids else "length",
                           cached_tokens=len(r.prompt) // 2)
            self.answered.append((tuple(r.prompt), c))
            self.group_of[tuple(r.prompt)] = r.group
            out.append(c)
        return out


class EchoEnv:
    """Answers each turn with [OBS_BASE + len(turn), OBS_BASE + first id % 7]; done after 2 to 4 turns
    (from the seed; odd prompts: 3); reward = turns taken / 4. prompt 0 raises, prompt 1 hangs, prompt 2 floods,
    at their second step, when `misbehave` is set."""

    stop_token_ids = (STOP,)

    def __init__(self, misbehave: bool = False):
        self.misbehave, self.turns = misbehave, 0

    async def reset(self, sample):
        # odd prompts' conversations all take 3 turns: groups with one score, for dynamic sampling to drop
        self.sample, self.last = sample, 3 if sample.prompt_index % 2 else 2 + (sample.seed or 0) % 3
        return [OBS_BASE + 500 + sample.prompt_index]  # an opening observation

    async def step(self, turn):
        self.turns += 1
        if self.misbehave and self.turns == 2:
            which = self.sample.prompt_index
            if which == 0:
                raise RuntimeError("tool crashed")
            if which == 1:
                await asyncio.sleep(3600)
            if which == 2:
                return StepResult([OBS_BASE] * 50)
        if self.turns >= self.last:
            return StepResult(reward=self.turns / 4, done=True)
        return StepResult([OBS_BASE + len(turn), OBS_BASE + turn[0] % 7])


def settings(*overrides):
    return C.load_config("configs/tiny_multiturn_cpu.yaml", [
        "rollout.env=tests.unit.test_multiturn:EchoEnv", "rollout.max_turns=5", "rollout.max_turn_tokens=6",
        "rollout.max_response_len=40", "rollout.max_observation_tokens=8", "rollout.tool_timeout_s=0.5",
        "rollout.tool_failure_reward=-1.0", "rollout.n=4", "actor.micro_batch_size=8", *overrides])


def run_round(cfg, prompts=(0, 1, 2, 3, 4)):
    task, engine = make_task("copy_last", 16), ScriptedEngine()
    task = type(task)(task.name, [[1] + [3 + (7 * i + k) % 900 for k in range(4)] for i in range(16)], task.targets)
    rounds = MultiTurnRounds(cfg, engine, task)
    t = time.perf_counter()
    batch, idx, score, reward = rounds(list(prompts), seed=11)
    return task, engine, batch, idx, score, rounds.metrics(), time.perf_counter() - t


def reference(task, answered):
    """{full sequence: (response mask, log-probs)} of every conversation, from the engine's answers
    alone: a conversation's requests each extend the one before by its output (and what the
    environment said), so chaining them gives its tokens, and the outputs' places its mask."""
    by_prompt = {p: c for p, c in answered}
    out = {}
    for prompt, c in answered:
        full = prompt + tuple(c.token_ids)
        if any(len(p) > len(full) and p[:len(full)] == full for p in by_prompt):
            continue  # not the conversation's last request
        start = next(len(p) for p in task.prompts if tuple(p) == full[:len(p)])
        mask, logps = [0] * (len(full) - start), [0.0] * (len(full) - start)
        for p, pc in answered:
            if full[:len(p) + len(pc.token_ids)] == p + tuple(pc.token_ids):
                for k, lp in enumerate(pc.log_probs):
                    mask[len(p) - start + k], logps[len(p) - start + k] = 1, lp
        out[full] = (mask, logps)
    return out


def test_trained_tokens_and_masks_equal_the_engines_own_output():
    task, engine, batch, idx, score, metrics, _ = run_round(settings())
    ref = reference(task, engine.answered)
    assert len(ref) == len(idx) == batch["tokens"].shape[0] == 20
    R = batch["response_mask"].shape[1]
    for row in range(len(idx)):
        full = tuple(batch["tokens"][row][batch["attention_mask"][row].bool()].tolist())
        mask, logps = ref.pop(full)  # exactly one conversation ends in this row's sequence
        n = len(mask)
        assert batch["response_mask"][row, :n].tolist() == mask
        assert batch["response_mask"][row, n:].sum() == 0 and R >= n
        torch.testing.assert_close(batch["rollout_log_probs"][row, :n], torch.tensor(logps))
        # every environment token is context: attended, never in the loss
        env = [t for t, m in zip(full[-n:], mask) if not m]
        assert env and all(t >= OBS_BASE for t in env)
        assert all(t < VOCAB for t, m in zip(full[-n:], mask) if m)
    assert set(score.tolist()) <= {0.5, 0.75, 1.0}  # every conversation ended by its environment
    assert metrics["multiturn/tool_failures"] == 0
    assert 2 <= metrics["multiturn/turns_mean"] <= 4
    assert metrics["multiturn/observation_tokens_mean"] > 2
    assert 0 < metrics["multiturn/prefix_cache_hit_rate"] < 1


def test_a_prompts_conversations_and_all_their_turns_are_one_group():
    """Request.group, by which a DP-attention engine keeps a group on one rank's prefix cache
    (mcore_rl.rollout.dp_routing): one per prompt, on every turn of each of its conversations."""
    task, engine, _, idx, _, _, _ = run_round(settings())
    by_prompt: dict[int, set] = {}
    for p, group in engine.group_of.items():
        i = next(i for i in set(idx) if p[:len(task.prompts[i])] == tuple(task.prompts[i]))
        by_prompt.setdefault(i, set()).add(group)
    assert sorted(by_prompt) == [0, 1, 2, 3, 4] and all(len(g) == 1 and None not in g for g in by_prompt.values())
    assert len(set.union(*by_prompt.values())) == 5
    assert len(engine.group_of) > 20  # later turns too, not only each conversation's first request


def test_each_misbehaving_tool_ends_only_its_own_conversation():
    cfg = settings("rollout.env_args={misbehave: true}")
    _, _, batch, idx, score, metrics, seconds = run_round(cfg)
    _, _, base_batch, _, base_score, _, _ = run_round(settings())
    assert seconds < 10  # the hung tool cost its timeout (0.5 s), not the round
    assert metrics["multiturn/tool_failures_raised"] == 4  # the 4 conversations of prompt 0 ...
    assert metrics["multiturn/tool_failures_timeout"] == 4  # ... of prompt 1 ...
    assert metrics["multiturn/tool_failures_flood"] == 4  # ... of prompt 2 (50 > 8 observation tokens)
    for row, i in enumerate(idx):
        if i in (0, 1, 2):
            assert score[row] == -1.0  # rollout.tool_failure_reward
        else:  # untouched: the same conversation as without the misbehaving tools
            assert score[row] == base_score[row]
            assert torch.equal(batch["tokens"][row][batch["attention_mask"][row].bool()],
                               base_batch["tokens"][row][base_batch["attention_mask"][row].bool()])


def test_environment_tokens_stay_out_of_loss_kl_and_advantage_norm(tmp_path):
    """The batch's response_mask, through our advantages and losses, against verl's core_algos on the
    same mask; then garbage on the environment's tokens changes nothing."""
    algos = verl_module("verl.trainer.ppo.core_algos")
    from omegaconf import OmegaConf

    from mcore_rl.algos.losses import kl_loss, policy_loss

    cfg = settings("algorithm.adv_estimator=reinforce_plus_plus_baseline")
    _, _, batch, idx, score, _, _ = run_round(cfg)
    mask = batch["response_mask"]
    env = (batch["attention_mask"][:, -mask.shape[1]:].bool() & ~mask.bool())
    assert env.any()
    uids = np.array([f"p{i}" for i in idx], dtype=object)
    # the outcome on the last model token, whatever follows it
    step_batch.advantages(cfg, batch, score, idx)
    last = step_batch.last_token(mask)
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(len(mask)), last] = score
    theirs, _ = algos.compute_reinforce_plus_plus_baseline_outcome_advantage(token_rewards, mask, uids)
    torch.testing.assert_close(batch["advantages"], theirs * mask, rtol=1e-5, atol=1e-6)  # whitened over model tokens
    cfg.algorithm.adv_estimator = "grpo"
    step_batch.advantages(cfg, batch, score, idx)
    theirs, _ = algos.compute_grpo_outcome_advantage(token_rewards, mask, uids)
    torch.testing.assert_close(batch["advantages"], theirs, rtol=1e-5, atol=1e-6)

    g = torch.Generator().manual_seed(0)
    old = batch["rollout_log_probs"]
    new = old + torch.randn(mask.shape, generator=g) * 0.3
    ref = old + torch.randn(mask.shape, generator=g) * 0.3
    adv = batch["advantages"]
    clip = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    ours, _ = policy_loss(old, new, adv, mask, loss_agg_mode="token-mean", **clip)
    verl_cfg = OmegaConf.create({"clip_ratio": 0.2, **clip, "global_batch_info": {}})
    theirs, _ = algos.compute_policy_loss_vanilla(old, new, adv, mask, loss_agg_mode="token-mean", config=verl_cfg)
    torch.testing.assert_close(ours, theirs)
    ours_kl = kl_loss(new, ref, mask, "low_var_kl", "token-mean")
    theirs_kl = algos.agg_loss(algos.kl_penalty(new, ref, "low_var_kl"), mask, "token-mean")
    torch.testing.assert_close(ours_kl, theirs_kl)

    def junk(x):
        return torch.where(env, torch.full_like(x, 77.0), x)

    torch.testing.assert_close(policy_loss(junk(old), junk(new), junk(adv), mask, loss_agg_mode="token-mean",
                                           **clip)[0], ours)
    torch.testing.assert_close(kl_loss(junk(new), junk(ref), mask, "low_var_kl", "token-mean"), ours_kl)


def test_a_turn_cut_by_a_sync_goes_on_under_the_new_weights():
    """fully_async's conversation worker with partial rollout: turns of 6 tokens sampled 2 at a time;
    a sync after the second round lands in the middle of every first turn, whose last piece then
    comes from the new weights; the conversations still equal their engine-answer chains."""
    import itertools

    from mcore_rl.loop.async_sources import BusyClock
    from mcore_rl.rollout.base import SamplingParams
    from mcore_rl.rollout.multiturn import ConversationWorker, MultiTurnSettings, env_conversation

    engine = ScriptedEngine(stop_chance=0.0, seconds=0.3)
    prompts = [[1, 3 + i, 40 + i, 500 + i] for i in range(3)]
    keys = itertools.chain((((1, slot), i) for slot, i in enumerate(range(3))), (((2, k), 0) for k in itertools.count()))
    params = SamplingParams(n=2, max_new_tokens=40, stop_token_ids=(2,), seed=5)
    settings = MultiTurnSettings(max_turns=4, max_turn_tokens=6, budget=40, tool_timeout_s=2.0, max_observation_tokens=8,
                                 segment=2)
    worker = ConversationWorker(engine, lambda i: prompts[i], keys, params, settings, env_conversation, None, EchoEnv,
                                lambda key, version: key[0] == 1, 0, BusyClock(), BusyClock())
    try:
        deadline = time.monotonic() + 30
        while engine.calls < 2 and time.monotonic() < deadline:  # the second round is running
            time.sleep(0.01)
        with worker.paused():
            worker.version = 1
        groups = worker.take([(1, 0), (1, 1), (1, 2)])
    finally:
        worker.stop()
    convs = [c for g in groups for c in g]
    task = type(make_task("copy_last", 1))("t", prompts, [3, 3, 3])
    ref = reference(task, engine.answered)
    for c in convs:
        assert ref.pop(tuple(c.prompt + c.tokens))[0] == c.loss_mask
        first_turn = [v for v, m in zip(c.versions, c.loss_mask) if m][:6]
        assert first_turn == [0, 0, 0, 0, 1, 1]  # cut after two pieces, finished under the new weights
        assert c.reward == c.turns / 4 and c.turns >= 2  # ended by its environment


async def two_turns(ctx, conv):
    """A custom per-sample rollout (rollout.generate_fn): a 3-token turn, a note, a free turn."""
    first = await ctx.generate(conv, max_new_tokens=3)
    conv.add_observation([OBS_BASE + 1, OBS_BASE + len(first)])
    second = await ctx.generate(conv)
    conv.reward = float(len(second))


def test_a_custom_generate_function_replaces_the_environment_loop():
    task, engine, batch, idx, score, metrics, _ = run_round(settings("rollout.generate_fn=tests.unit.test_multiturn:"
                                                                     "two_turns", "rollout.env=null"))
    ref = reference(task, engine.answered)
    for row in range(len(idx)):
        full = tuple(batch["tokens"][row][batch["attention_mask"][row].bool()].tolist())
        mask, _ = ref.pop(full)
        assert batch["response_mask"][row, :len(mask)].tolist() == mask
        first = mask.index(0)  # the first turn's length, then the function's 2-token note, then the second turn
        assert 1 <= first <= 3 and mask[first:first + 2] == [0, 0] and all(mask[first + 2:])
        assert score[row] == len(mask) - first - 2  # the reward the function set: the second turn's length
    assert metrics["multiturn/turns_mean"] == 2 and metrics["multiturn/observation_tokens_mean"] == 2


def test_dynamic_sampling_keeps_or_drops_whole_conversations():
    """DAPO's filter on conversation scores: a group whose conversations all scored alike is dropped
    whole and refilled; the step still holds train_batch_size groups of whole conversations."""
    from mcore_rl.loop.sampling import sample_step_batch

    cfg = settings("algorithm.filter_groups.enable=true", "data.train_batch_size=4", "data.gen_batch_size=4",
                   "actor.ppo_mini_batch_size=4", "rollout.return_routed_experts=false")
    task = type(make_task("copy_last", 1))("t", [[1, 3 + i, 40 + i, 500 + i] for i in range(16)], [3] * 16)
    engine = ScriptedEngine()
    got = sample_step_batch(cfg, engine, task, [0, 1, 2, 3], seed=7)
    batch, idx, score, reward, metrics = got.batch, got.idx, got.score, got.reward, got.metrics
    assert len(idx) == 16 and "multiturn/turns_mean" in metrics
    assert metrics["train/num_gen_batches"] >= 2  # odd prompts' groups dropped, refilled from further prompts
    assert {0, 2} <= set(idx) and all(i % 2 == 0 for i in idx)
    for g in range(4):
        assert len(set(score[4 * g:4 * g + 4].tolist())) > 1  # every kept group varies
    ref = reference(task, engine.answered)
    for row in range(len(idx)):  # each row a whole conversation of the engine's
        full = tuple(batch["tokens"][row][batch["attention_mask"][row].bool()].tolist())
        assert batch["response_mask"][row, :len(ref[full][0])].tolist() == ref[full][0]


class BlockingEnv(EchoEnv):
    """EchoEnv with plain (blocking) methods; prompt 1's second step sleeps past the timeout."""

    def reset(self, sample):
        return asyncio.run(super().reset(sample))

    def step(self, turn):
        if self.turns == 1 and self.sample.prompt_index == 1:
            time.sleep(3)
        return asyncio.run(super().step(turn))


def test_a_blocking_plain_method_holds_up_only_its_own_conversation():
    # a timeout of 1.5 s: at 0.5 s a quick step that a loaded machine (load 13) held up was cut too
    slow = ("rollout.env=tests.unit.test_multiturn:BlockingEnv", "rollout.tool_timeout_s=1.5")
    _, _, batch, idx, score, metrics, seconds = run_round(settings(*slow))
    _, _, _, _, base_score, _, _ = run_round(settings())
    assert metrics["multiturn/tool_failures_timeout"] == 4 and metrics["multiturn/tool_failures"] == 4
    assert seconds < 4.5  # the 4 sleeping steps ran side by side, in threads, cut at 1.5 s (one after another: 6 s)
    assert [s for s, i in zip(score.tolist(), idx) if i != 1] == [s for s, i in zip(base_score.tolist(), idx) if i != 1]
    assert all(s == -1.0 for s, i in zip(score.tolist(), idx) if i == 1)
