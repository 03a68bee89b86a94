"""One SGLang engine over two Ray "nodes" (raylets of ray.cluster_utils.Cluster on this host), CPU.

Runs tests/support/multinode_scenario.py (its docstring says what it does): a TP=2 engine as nnodes=2
generates the greedy tokens of a one-node TP=2 engine, is read back from both nodes' ranks, and
trains GRPO colocated across the raylets (each node's trainer rank feeding its engine rank) and
with the engine on raylets of its own (fed over an update group spanning three raylets), every
sync read back. The same scenario runs on two GPUs with --device gpu (docs/performance.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mcore_rl.config import sections as C

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_engine_over_two_raylets_generates_and_trains(tmp_path):
    out = tmp_path / "result.json"
    p = subprocess.run([sys.executable, "tests/support/multinode_scenario.py", "--device", "cpu", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=1500,
                       env=dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"))
    assert out.exists(), (p.stdout + p.stderr)[-3000:]
    result = json.loads(out.read_text())
    assert result["checks"] == {"same_greedy_tokens": True, "engine_spans_both_raylets": True,
                                "both_tp_ranks_read_back": True, "train_colocated": True,
                                "train_separate": True}, json.dumps(result, indent=1)[-3000:]
    assert p.returncode == 0


def test_cpu_engine_widths_that_sglang_would_pad_are_refused():
    from mcore_rl.rollout.launch import _check_cpu_tp

    cfg = C.load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml"), ["rollout.tp_size=2"])
    with pytest.raises(C.ConfigError, match="moe_intermediate_size=32 to multiples of 64"):
        _check_cpu_tp(cfg)
    _check_cpu_tp(C.load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml"),
                                ["rollout.tp_size=2", "model.hf_config.moe_intermediate_size=64"]))
