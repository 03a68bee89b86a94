"""Issue #8 item 2: with two Ray nodes on one machine and an engine of nnodes=2, every trainer
rank's tensors reach the intended engine rank.

The scenario (tests/support/sync_ray_scenario.py) runs in its own process, so Ray is imported there with
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (nodes stay on loopback) and nothing of it outlives the test.
What each engine rank must hold is derived here independently of the plan: every tensor of the
HF checkpoint, except routed experts outside the rank's SGLang EP block
(moe_ep_rank = tp_rank // (tp/ep), a contiguous block of E/ep experts), equal to the HF file's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.convert import hf_mcore as convert
from tests.support import sync_ray_scenario as scenario
from tests.support.tiny_models import make_hf_model

REPO = Path(__file__).resolve().parents[2]
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray_sync")
    make_hf_model("deepseek_v3", str(root / "hf"))
    convert.hf_to_mcore(str(root / "hf"), str(root / "ckpt"), dtype="fp32")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # never join another cluster
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="1")
    out = root / "result.json"
    proc = subprocess.run([sys.executable, "-m", "tests.support.sync_ray_scenario", "--hf", str(root / "hf"),
                           "--ckpt", str(root / "ckpt"), "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_two_raylets_and_an_engine_over_both(result):
    head, worker = result["head"], result["worker"]
    assert head != worker and result["cluster_nodes"] == sorted([head, worker])
    assert result["placement"]["layout"] == dict(tp_size=scenario.ENGINE_TP, ep_size=scenario.ENGINE_EP,
                                                 nnodes=2, gpus_per_node=scenario.NODE_GPUS,
                                                 attn_dp_size=1)
    assert result["placement"]["engine_nodes"] == [head, worker]
    for e in result["engine_ranks"]:  # node_rank 1's ranks really run on the second raylet
        assert e["node_id"] == (head, worker)[e["node_rank"]], e
    assert {e["node_rank"] for e in result["engine_ranks"]} == {0, 1}
    # trainer ranks were numbered against the engine's order, so the mapping had work to do
    mapping = {int(k): v for k, v in result["placement"]["trainer_to_engine"].items()}
    assert sorted(mapping.values()) == list(range(scenario.ENGINE_TP)) and mapping != {r: r for r in mapping}
    assert result["cross_node_sends"] > 0  # tensors moved between trainer ranks on different raylets
    assert result["leftover"] == []


def test_each_engine_rank_is_fed_by_the_trainer_rank_on_its_gpu(result):
    per_node = scenario.ENGINE_TP // 2
    for e in result["engine_ranks"]:
        trainer = result["trainers"][e["trainer_rank"]]
        assert (trainer["node_id"], trainer["gpu_uuid"]) == (e["node_id"], e["gpu_uuid"])
        local = scenario.ENGINE_VISIBLE[e["node_rank"]].index(e["gpu_index"])
        assert e["tp_rank"] == e["node_rank"] * per_node + local
        assert e["sources"] == [e["gpu_uuid"]] * result["buckets"], e["sources"]  # every bucket, only its GPU
        assert e["loads_outside_update"] == 0
    assert result["buckets"] > 3


def test_each_engine_rank_holds_exactly_what_sglang_loads_there(result):
    E, ep = result["num_experts"], scenario.ENGINE_EP
    moe_tp = scenario.ENGINE_TP // ep
    for e in result["engine_ranks"]:
        block = range(e["tp_rank"] // moe_tp * E // ep, (e["tp_rank"] // moe_tp + 1) * E // ep)
        want = sorted(n for n in result["reference"] if not (m := _EXPERT.search(n)) or int(m.group(1)) in block)
        assert e["received"] == want, (e["tp_rank"], sorted(set(want) ^ set(e["received"]))[:5])
        assert e["received"] == e["planned"]
        assert e["experts"] == list(block)
        assert e["differ"] == [], e["differ"][:5]
