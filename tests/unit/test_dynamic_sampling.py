"""DAPO's reward-side pieces by hand (overlong penalty, group filter), and dynamic sampling's
refill loop (mcore_rl.loop.sampling) on a scripted engine: the loop is under test, so the
engine only has to answer deterministically, and the prompts' rewards are set by the test."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mcore_rl.config import sections as C
from mcore_rl.algos.dapo import overlong_penalty, varied_groups
from mcore_rl.loop.sampling import RefillsExhausted, concat_batches, sample_step_batch
from mcore_rl.rollout.base import Completion

T = torch.tensor


def test_overlong_penalty_by_hand():
    # max 10 tokens, buffer 4: free up to 6, then -factor * (len - 6) / 4
    got = overlong_penalty(T([3, 6, 7, 8, 10]), max_response_len=10, buffer_len=4, penalty_factor=2.0)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -2.0])
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(T([1]), max_response_len=4, buffer_len=5, penalty_factor=1.0)


def test_varied_groups_by_hand():
    # 0.1 three times: a float mean need not equal the values; the group must still count as equal
    rewards = T([1.0, 1.0, 0.0, 1.0, 0.1, 0.1, 0.1, 0.1, 0.0, 0.0, 0.0, 0.5], dtype=torch.float64)
    assert varied_groups(rewards[:8], 2).tolist() == [False, True, False, False]
    assert varied_groups(rewards, 4).tolist() == [True, False, True]
    with pytest.raises(ValueError, match="groups of 5"):
        varied_groups(rewards, 5)


def test_concat_batches_repads_prompts_left_and_responses_right():
    a = {"tokens": T([[7, 8, 1]]), "attention_mask": T([[1, 1, 1]]), "response_mask": T([[1.0]])}
    b = {"tokens": T([[9, 2, 3]]), "attention_mask": T([[1, 1, 1]]), "response_mask": T([[1.0, 1.0]])}
    out = concat_batches([a, b])
    assert out["tokens"].tolist() == [[7, 8, 1, 0], [0, 9, 2, 3]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0], [0, 1, 1, 1]]
    assert out["response_mask"].tolist() == [[1.0, 0.0], [1.0, 1.0]]
    with pytest.raises(ValueError, match="'odd'"):
        concat_batches([{**a, "odd": T([[1, 2, 3, 4]])}])


class ScriptedEngine:
    """Completion j of prompt p: tokens [p[0]] + [j] * (j % 2), log-probs -0.5 each."""

    def __init__(self):
        self.rounds = []

    def generate(self, prompts, params):
        self.rounds.append([p[0] for p in prompts])
        return [[Completion([p[0]] + [j] * (j % 2), [-0.5] * (1 + j % 2)) for j in range(params.n)]
                for p in prompts]


class Prompts:
    """Prompt i is the token [i]; its samples all score 1 when i is in `solved`, else j % 2."""

    def __init__(self, count: int, solved: set[int]):
        self.prompts, self.solved = [[i] for i in range(count)], solved
        self.tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=None)

    def rewards(self, indices, responses):
        return [1.0 if i in self.solved else float(len(r) - 1) for i, r in zip(indices, responses)]


def cfg_for(*overrides):
    return C.config_from_dict(C.apply_overrides({}, ["rollout.n=2", "rollout.max_response_len=2",
                                                     "algorithm.filter_groups.enable=true", *overrides]))


def test_dynamic_sampling_refills_from_further_prompts():
    engine, source = ScriptedEngine(), Prompts(8, solved={0, 1, 2, 5})
    got = sample_step_batch(cfg_for("data.gen_batch_size=3"), engine, source, [0, 1, 3], 0)
    batch, idx, score, reward, m = got.batch, got.idx, got.score, got.reward, got.metrics
    # round 1: the step's prompts 0, 1, 3 (only 3 varies), then refills in a seeded order of the rest
    assert engine.rounds[0] == [0, 1, 3] and len(engine.rounds) == m["train/num_gen_batches"] >= 2
    kept = list(dict.fromkeys(idx))
    assert len(kept) == 3 and kept[0] == 3 and not set(kept) & source.solved
    assert len(set(sum(engine.rounds, []))) == len(sum(engine.rounds, [])), "a prompt was generated twice"
    assert batch["tokens"].shape[0] == len(idx) == 6 and torch.equal(score, reward)
    assert score.tolist() == [0.0, 1.0] * 3
    # each sample's tokens and mask are its own after the re-padding
    for row, i in enumerate(idx):
        r = int(batch["response_mask"][row].sum())
        assert batch["tokens"][row, -batch["response_mask"].shape[1]:][:r].tolist()[0] == i


def test_dynamic_sampling_error_when_refills_run_out():
    engine, source = ScriptedEngine(), Prompts(6, solved={0, 1, 2, 3, 4})
    with pytest.raises(RefillsExhausted, match=r"1 of 2 prompt groups .* after 3 generation rounds \(6 prompts\)"):
        sample_step_batch(cfg_for(), engine, source, [0, 1], 0)
    with pytest.raises(RefillsExhausted, match="after 1 generation rounds"):
        sample_step_batch(cfg_for("algorithm.filter_groups.max_num_gen_batches=1"), ScriptedEngine(), source, [0, 1], 0)


def test_overlong_penalty_shapes_the_reward_and_the_filter():
    # max_response_len 2, buffer 1: two-token responses lose 0.5, so solved prompts' groups vary
    cfg = cfg_for("reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=1",
                  "reward.overlong_buffer.penalty_factor=0.5")
    engine, source = ScriptedEngine(), Prompts(4, solved={0, 1, 2, 3})
    got = sample_step_batch(cfg, engine, source, [0, 1], 0)
    idx, score, reward, m = got.idx, got.score, got.reward, got.metrics
    assert idx == [0, 0, 1, 1] and score.tolist() == [1.0] * 4 and reward.tolist() == [1.0, 0.5, 1.0, 0.5]
    assert m["reward/overlong_fraction"] == 0.5 and m["reward/overlong_penalty_mean"] == pytest.approx(-0.25)
    cfg.algorithm.filter_groups.metric = "score"  # on the rule score alone every group is equal
    with pytest.raises(RefillsExhausted):
        sample_step_batch(cfg, ScriptedEngine(), source, [0, 1], 0)
