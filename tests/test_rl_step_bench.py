"""benchmarks/rl_step_bench.py at tiny size on CPU: RL steps on Megatron actors whose timed step ends
with the production weight sync (LiveShards -> sync_weights -> CudaIpcTransport, shared memory here)
into SGLang-layout receivers, checked against a megatron checkpoint of the trainer."""

from __future__ import annotations

import json

import pytest

from benchmarks import rl_step_bench
from benchmarks.sglang_receivers import engine_params
from benchmarks.shapes import moonlight
from mcore_rl.models.config import HFModel
from mcore_rl.parallel import Layout
from mcore_rl.sync import EngineLayout, SyncPlan
from mcore_rl.sync.checksum import WeightMismatch

SMALL = ["--cpu", "--tiny", "--gpus", "2", "--prompt", "16", "--response", "2", "--batch", "2",
         "--bucket-mb", "0.02"]


def test_step_includes_a_verified_sync(tmp_path):
    out = tmp_path / "rl.json"
    assert rl_step_bench.main(SMALL + ["--ep", "2", "--rollout-tp", "2", "--steps", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert list(r["median_s"]) == ["rollout", "old_log_prob", "update", "sync", "step"]
    assert len(r["all_s"]["sync"]) == 2 and r["median_s"]["sync"] > 0
    assert r["median_s"]["step"] >= r["median_s"]["update"] + r["median_s"]["sync"]
    assert r["sync_check"]["passed"] and r["sync_check"]["receivers"] == 2 and r["sync_check"]["tensors"] > 40
    assert r["sync_buckets"] > 3 and r["sync_gb_per_s_per_gpu"] > 0 and r["step_tokens_per_s"] > 0
    assert (r["rollout_tp"], r["rollout_ep"], r["engines"]) == (2, 2, 1)


def test_two_engines_of_tp1():
    """Engine TP=1 beside trainer EP=2: two engines, each fed by its own plan, both checked."""
    args = rl_step_bench.parse(SMALL + ["--ep", "2", "--rollout-tp", "1", "--steps", "1", "--out", "/dev/null"])
    r = rl_step_bench.run(args)
    assert r["engines"] == 2 and r["sync_check"]["passed"] and r["sync_check"]["receivers"] == 2


def test_corrupted_receiver_is_caught():
    """One flipped bit in GPU 1's receiver fails the run, naming that tensor only: every other tensor
    matched, here with trainer TP=2 x EP=2 and engine TP=2, EP=1 (experts sliced over moe_tp=2)."""
    args = rl_step_bench.parse(SMALL + ["--tp", "2", "--ep", "2", "--rollout-tp", "2", "--rollout-ep", "1",
                                        "--steps", "1", "--corrupt-receiver", "--out", "/dev/null"])
    with pytest.raises(WeightMismatch) as e:
        rl_step_bench.run(args)
    msg = str(e.value)
    assert "GPU 1" in msg and "GPU 0" not in msg and "1 differ" in msg and "0 missing" in msg


def test_moe_tp_layout_for_moonlight():
    """Engine TP=4, EP=2: SGLang slices each expert over moe_tp = 2 ranks."""
    hf = HFModel.from_dict(moonlight(4))
    plan = SyncPlan.build(hf, Layout(ep=4), 4, EngineLayout(4, 2, 1, 4), {r: r for r in range(4)})
    params = engine_params(plan, 3, "meta")
    assert tuple(params["model.layers.3.mlp.experts.w13_weight"].shape) == (32, 2 * 1408 // 2, 2048)
    assert tuple(params["model.layers.3.mlp.experts.w2_weight"].shape) == (32, 2048, 1408 // 2)


def test_bad_engine_layout_is_refused_before_work():
    with pytest.raises(SystemExit):
        rl_step_bench.parse(SMALL + ["--rollout-tp", "3"])
    with pytest.raises(SystemExit):  # 4 experts over engine EP 3 cannot work
        rl_step_bench.parse(["--cpu", "--tiny", "--gpus", "3", "--rollout-tp", "3"])
