"""`benchmarks/actor_bench.py layer` runs at tiny size on CPU and reports both expert paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_layer_bench_cpu_smoke(tmp_path):
    out = tmp_path / "layer.json"
    cmd = [sys.executable, "benchmarks/actor_bench.py", "layer", "--cpu", "--tiny", "--seq", "64", "--batch", "2",
           "--steps", "1", "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [r["experts"] for r in res["rows"]] == ["grouped", "loop"]
    assert all(r["median_s"] > 0 and r["tflops_per_gpu"] > 0 for r in res["rows"])
    assert res["moe_layers"] > 0 and res["flops_per_token"] > 0 and "grouped / loop" in p.stdout
