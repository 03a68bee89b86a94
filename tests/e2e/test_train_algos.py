"""The RL algorithms wired into the loop: micro-batching and packing equal one big batch (also
over DP x EP ranks), the reference policy stays frozen, the critic checkpoints round-trip, PPO
with a critic learns, and verl parquet data runs end to end with KL in loss and reward, TIS and
RLOO. The trainer's SIGKILL resume path itself is tested in test_train.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mcore_rl.config import sections as C
from mcore_rl.algos.rollout_correction import compute_rollout_correction
from tests.support import distributed
from tests.support.rl_batch import B, R, rl_batch
from tests.support.tiny_models import make_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny DeepSeek-V3 HF model and a fixed RL batch."""
    root = tmp_path_factory.mktemp("algos")
    make_hf_model("deepseek_v3", str(root / "hf"))
    batch = rl_batch()
    # token-level TIS weights, as the driver makes them (mcore_rl.loop.step_batch.correct_rollout)
    batch["rollout_is_weights"], _, _ = compute_rollout_correction(
        batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], rollout_is="token",
        rollout_is_threshold=2.0)
    torch.save(batch, root / "batch.pt")
    return root


def actor_cfg(*overrides) -> dict:
    cfg = C.config_from_dict(C.apply_overrides({}, [
        "model.dtype=fp32", "rollout.n=1", "actor.ppo_mini_batch_size=6", "actor.grad_clip=1e9",
        # grads all-reduced, so every rank holds whole reduced grads to compare (the sharded
        # optimizer's reduce-scatter is tested in test_optim.py)
        "actor.use_distributed_optimizer=false",
        "actor.use_kl_loss=true", "actor.kl_loss_coef=0.5", "actor.entropy_coeff=0.01",
        "actor.clip_ratio_c=1.5", *overrides]))
    d = C.to_dict(cfg)
    d["actor"]["lr"] = 0.0  # the update leaves the weights as they were: the grads are compared
    return d


def _reference_grads(actor, batch) -> dict:
    """The loss of the whole batch from one forward per unpadded sequence, written out here."""
    from mcore_rl.algos.losses import agg_loss, kl_loss, policy_loss

    a = actor.cfg["actor"]
    model = actor.model
    model.train()
    logp, ent = torch.zeros(B, R), torch.zeros(B, R)
    for i in range(B):
        seq = batch["tokens"][i][batch["attention_mask"][i].bool()]
        r = int(batch["response_mask"][i].sum())
        logits = model(seq[None], torch.arange(len(seq))[None], None)[0, len(seq) - r - 1:-1]
        lp = torch.log_softmax(logits.float(), -1)
        logp = logp.index_put((torch.tensor([i]), torch.arange(r)), lp.gather(-1, seq[-r:, None])[:, 0])
        ent = ent.index_put((torch.tensor([i]), torch.arange(r)), -(lp.exp() * lp).sum(-1))
    mask, mode = batch["response_mask"], a["loss_agg_mode"]
    agg = dict(loss_scale_factor=actor.cfg["rollout"]["max_response_len"])
    loss, _ = policy_loss(batch["old_log_probs"], logp, batch["advantages"], mask, clip_ratio_c=a["clip_ratio_c"],
                          loss_mode=a["policy_loss"]["loss_mode"], loss_agg_mode=mode,
                          rollout_is_weights=batch["rollout_is_weights"], **agg)
    loss = loss - a["entropy_coeff"] * agg_loss(ent, mask, mode, **agg) + a["kl_loss_coef"] * kl_loss(
        logp, batch["ref_log_probs"], mask, a["kl_loss_type"], mode, **agg)
    model.zero_grad_buffer()  # megatron's DDP accumulates grads in .main_grad buffers
    loss.backward()
    return {n: p.main_grad.clone() for n, p in model.named_parameters()}


def _global_name(name: str, ep_rank: int, local_experts: int) -> str:
    key = ".local_experts."
    if key not in name:
        return name
    head, tail = name.split(key)
    idx, rest = tail.split(".", 1)
    return f"{head}{key}{ep_rank * local_experts + int(idx)}.{rest}"


def _grads_after_update(actor, batch) -> dict:
    from megatron.core import parallel_state as ps

    actor.update(batch)
    local = actor.hf.num_experts // ps.get_expert_model_parallel_world_size()
    return {_global_name(n, ps.get_expert_model_parallel_rank(), local): p.main_grad.clone()
            for n, p in actor.model.named_parameters()}


def _assert_close(got: dict, ref: dict, what: str):
    assert set(got) <= set(ref), set(got) - set(ref)
    for n, g in got.items():
        assert torch.allclose(g, ref[n], rtol=1e-4, atol=1e-7), \
            f"{what}: {n} differs by {(g - ref[n]).abs().max().item():.3g}"


def _single_rank(rank, root):
    from mcore_rl.actor import MegatronActor

    batch = torch.load(os.path.join(root, "batch.pt"), weights_only=True)
    init = {"policy": os.path.join(root, "hf")}
    actor = MegatronActor(0, 1, 0, os.path.join(root, "hf"), actor_cfg("actor.micro_batch_size=2"), init=init)
    ref = _reference_grads(actor, batch)
    torch.save(ref, os.path.join(root, "ref_grads.pt"))
    _assert_close(_grads_after_update(actor, batch), ref, "micro_batch_size=2")
    actor.cfg["actor"].update(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=12)  # 3+ micro-batches
    _assert_close(_grads_after_update(actor, batch), ref, "dynamic bsz")
    actor.cfg["actor"].update(use_dynamic_bsz=False, micro_batch_size=6)  # one micro-batch
    _assert_close(_grads_after_update(actor, batch), ref, "one micro-batch")
    # the sequence-level GSPO ratio and Dr.GRPO's aggregation reach the loss, over micro-batches too
    actor.cfg["actor"].update(micro_batch_size=2, loss_agg_mode="seq-mean-token-sum-norm",
                              policy_loss={"loss_mode": "gspo"})
    _assert_close(_grads_after_update(actor, batch), _reference_grads(actor, batch), "gspo, seq-mean-token-sum-norm")


def _recomputed(rank, root):
    from mcore_rl.actor import MegatronActor

    batch = torch.load(os.path.join(root, "batch.pt"), weights_only=True)
    cfg = actor_cfg("actor.micro_batch_size=2", "memory.recompute_activations=true")
    actor = MegatronActor(0, 1, 0, os.path.join(root, "hf"), cfg, init={"policy": os.path.join(root, "hf")})
    assert actor.model.module.config.recompute_granularity == "full"
    _assert_close(_grads_after_update(actor, batch),
                  torch.load(os.path.join(root, "ref_grads.pt"), weights_only=True), "full recompute")


def _two_ranks(rank, root, *overrides):
    from mcore_rl.actor import MegatronActor

    batch = torch.load(os.path.join(root, "batch.pt"), weights_only=True)
    cfg = actor_cfg("parallel.ep=2", *overrides)
    actor = MegatronActor(rank, 2, 0, os.path.join(root, "hf"), cfg, init={"policy": os.path.join(root, "hf")})
    _assert_close(_grads_after_update(actor, batch),
                  torch.load(os.path.join(root, "ref_grads.pt"), weights_only=True), f"dp2 ep2 {overrides}")


def test_micro_batches_and_dynamic_bsz_match_one_big_batch(tiny):
    distributed.run(_single_rank, 1, str(tiny))
    # DP=2 x EP=2: unequal token counts per rank, so the ranks also pad to a common packed length
    distributed.run(_two_ranks, 2, str(tiny), "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=10")
    # memory.recompute_activations (which the planner counts) recomputes, and changes no gradient
    distributed.run(_recomputed, 1, str(tiny))


def _colocated_models(rank, root):
    from mcore_rl.parallel import optimizer as optim
    from mcore_rl.actor import MegatronActor

    batch = torch.load(os.path.join(root, "batch.pt"), weights_only=True)
    # the critic takes its own mini-batches: 2 optimizer steps per update where the actor takes 1
    cfg = actor_cfg("actor.micro_batch_size=3", "critic.enabled=true", "critic.micro_batch_size=2",
                    "critic.ppo_mini_batch_size=3")
    cfg["actor"]["lr"] = 1e-2
    steps = {}
    real_step = optim.step

    def counted_step(model, opt):
        steps[id(opt)] = steps.get(id(opt), 0) + 1
        return real_step(model, opt)

    optim.step = counted_step
    hf, init = os.path.join(root, "hf"), {"policy": os.path.join(root, "hf")}
    actor = MegatronActor(0, 1, 0, hf, cfg, init=init)
    mask = batch["response_mask"].bool()
    initial = actor.log_probs(batch)
    assert torch.allclose(actor.ref_log_probs(batch), initial)
    assert torch.equal(actor.values(batch), torch.zeros(B, R))  # zero-initialised value head
    critic_batch = {**batch, "values": actor.values(batch), "returns": batch["advantages"]}
    for _ in range(2):
        stats = actor.update({**batch, "old_log_probs": actor.log_probs(batch)})
        assert stats["actor/kl_coef"] == 0.5 and "actor/kl_loss" in stats
        cstats = actor.update_critic(critic_batch)
        assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm"} <= set(cstats)
    assert (steps[id(actor.opt)], steps[id(actor.critic_opt)]) == (2, 4)
    optim.step = real_step
    assert torch.equal(actor.ref_log_probs(batch), initial), "the reference policy moved"
    assert (actor.log_probs(batch) - initial)[mask].abs().max() > 1e-3, "the policy did not move"
    # policy and critic (with their optimizers) come back from a checkpoint into fresh models
    actor.save(os.path.join(root, "step"))
    actor.ps.destroy_model_parallel()  # one actor per process in the trainer: make room for a second
    again = MegatronActor(0, 1, 0, hf, cfg, init=init)
    again.load(os.path.join(root, "step"))
    assert torch.equal(again.values(batch), actor.values(batch))
    assert torch.equal(again.log_probs(batch), actor.log_probs(batch))
    assert torch.equal(again.ref_log_probs(batch), initial)
    assert again.updates == actor.updates == 2
    for opt in ("opt", "critic_opt"):
        got, want = _states(getattr(again, opt)), _states(getattr(actor, opt))
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            assert all(torch.equal(a, b) for a, b in zip(g, w))


def _states(opt):
    """(main param, Adam moments, step) of every param the optimizer steps."""
    from mcore_rl.checkpoint.optimizer import _owned

    return [(main, inner.state[main]["exp_avg"], inner.state[main]["exp_avg_sq"], inner.state[main]["step"])
            for _, _, _, main, inner in _owned(opt)]


def test_reference_frozen_and_critic_checkpoint_roundtrip(tiny):
    distributed.run(_colocated_models, 1, str(tiny))


# ---------------------------------------------------------------------------- end-to-end runs
def _train(out, config, *overrides, timeout=600):
    cmd = [sys.executable, "-m", "mcore_rl.train", "--config", config, f"trainer.output_dir={out}", *overrides]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"))
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], p.stdout + p.stderr


def test_ppo_with_critic_learns(tmp_path):
    out = str(tmp_path / "ppo")
    recs, _ = _train(out, "configs/tiny_ppo_cpu.yaml", "trainer.total_training_steps=14", "trainer.save_freq=-1",
                     "trainer.test_freq=-1", "trainer.val_before_train=false")
    steps = [r for r in recs if "critic/vf_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 15))
    vf = [r["critic/vf_loss"] for r in steps]
    # returns grow with the reward, so the value loss first rises; the critic then catches up
    assert vf[-1] < 0.5 * max(vf), f"value loss did not fall from its peak: {vf}"
    first, last = (sum(r["reward/mean"] for r in rs) / len(rs) for rs in (steps[:3], steps[-3:]))
    assert first < 0.3 and last > 0.7, f"reward did not rise: {first:.2f} -> {last:.2f}"
    assert os.path.isdir(os.path.join(out, "checkpoints", "step_14", "critic"))


def test_parquet_data_with_kl_tis_and_rloo(tmp_path):
    from mcore_rl.data import make_row, make_task, write_rows

    rows = make_task("copy_last", 64, seed=3).rows()
    long = make_row("mcore_rl/copy_last", "abcdefgh" * 3, "h")  # longer than max_prompt_length: filtered
    write_rows(str(tmp_path / "train.parquet"), rows[:48] + [long])
    write_rows(str(tmp_path / "val.parquet"), rows[48:])
    out = str(tmp_path / "run")
    recs, log = _train(out, "configs/tiny_ppo_cpu.yaml", "critic.enabled=false", "data.task=null",
                       f"data.train_files=[{tmp_path}/train.parquet]", f"data.val_files=[{tmp_path}/val.parquet]",
                       "data.train_batch_size=8",
                       "actor.ppo_mini_batch_size=4", "rollout.n=4", "algorithm.adv_estimator=rloo",
                       "actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                       "algorithm.kl_ctrl.horizon=10", "actor.tis_imp_ratio_cap=2.0", "actor.use_dynamic_bsz=true",
                       "actor.ppo_max_token_len_per_gpu=32", "trainer.total_training_steps=3", "trainer.test_freq=-1",
                       "trainer.save_freq=-1")
    assert "filtered 1 prompts" in log
    steps = [r for r in recs if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for key in ("actor/kl_loss", "actor/kl_coef", "critic/kl", "critic/kl_coeff", "rollout_corr/rollout_is_mean",
                "critic/advantages/mean"):
        assert all(key in r for r in steps), key
    assert steps[0]["critic/kl"] == 0.0  # the policy starts as the reference
    assert steps[1]["critic/kl_coeff"] != steps[0]["critic/kl_coeff"]  # adaptive controller moved
    by_step = {r["step"]: r for r in recs}  # one record a step: its sync and validation in it too
    assert len(by_step) == len(recs) == 4  # step 0: the first sync and the validation before training
    assert "val/reward" in by_step[0] and "val/reward" in by_step[3]
    assert by_step[3]["timing/validate"] > 0  # benchmarks take it out of their steps' wall time


def test_critic_free_options_wire_through(tmp_path):
    """GSPO with clip-higher and Dr.GRPO (no std, seq-mean-token-sum-norm), sequence-level TIS with
    geometric-mean rejection, the overlong penalty and dynamic sampling in two steps of the tiny
    embedded run: every option's metrics every step, the shaped reward in the advantages, each
    step's rollout dumped."""
    recs, _ = _train(str(tmp_path / "run"), "configs/tiny_ppo_cpu.yaml", "critic.enabled=false",
                     "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=false", "rollout.n=8",
                     "data.train_batch_size=4", "data.gen_batch_size=8", "actor.ppo_mini_batch_size=2",
                     "actor.policy_loss.loss_mode=gspo", "actor.loss_agg_mode=seq-mean-token-sum-norm",
                     "actor.clip_ratio_high=0.28", "algorithm.rollout_correction.rollout_is=sequence",
                     "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
                     "algorithm.rollout_correction.rollout_rs_threshold=0.999_1.001",
                     "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=1",
                     "reward.overlong_buffer.penalty_factor=0.5", "algorithm.filter_groups.enable=true",
                     "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
                     "trainer.save_freq=-1", f"trainer.rollout_dump_dir={tmp_path / 'dump'}")
    steps = [r for r in recs if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert sorted(os.listdir(tmp_path / "dump")) == ["step_1.pt", "step_2.pt"]
    dumped = torch.load(tmp_path / "dump" / "step_2.pt", weights_only=True)
    # dynamic sampling filled exactly the batch: 4 prompts x 8 samples, each group's rewards unequal
    assert dumped["batch"]["rollout_log_probs"].shape[0] == len(dumped["index"]) == 32
    assert (dumped["reward"].reshape(4, 8).amax(1) > dumped["reward"].reshape(4, 8).amin(1)).all()
    for r in steps:
        for key in ("rollout_corr/rollout_rs_masked_fraction", "train/kept_group_fraction", "actor/pg_clipfrac"):
            assert key in r, key
        # the embedded engine samples with the trainer's own shards: nothing to correct
        assert r["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
        assert r["train/num_gen_batches"] >= 1 and r["critic/advantages/max"] > 0  # only groups that vary
        # the advantages see the score plus the overlong penalty; reward/mean is the score alone
        assert r["critic/score/mean"] == pytest.approx(r["reward/mean"] + r["reward/overlong_penalty_mean"], abs=1e-6)
