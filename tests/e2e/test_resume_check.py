"""tests/gpu/resume_check.py on the tiny CPU model: the resumed run's step, trained on the
uninterrupted run's dumped batch (`--replay`), equals the uninterrupted one bit for bit, metrics and
optimizer states (the GPU run of the same script compares at Moonlight widths)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_resumed_step_equals_the_uninterrupted_one(tmp_path):
    out = tmp_path / "resume.json"
    p = subprocess.run([sys.executable, "tests/gpu/resume_check.py", "--config", "configs/tiny_cpu.yaml",
                        "--out", str(out), "--work", str(tmp_path / "work"), "rollout.engine=embedded"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["resumed_from"].endswith("step_2") and r["steps"] == 3
    assert "actor/grad_norm" in r["step_metrics"] and "actor/pg_loss" in r["step_metrics"]
    assert r["metrics_bit_equal"], r["step_metrics"]
    states = r["optimizer_states_after_step"]
    assert states["tensors"] > 50 and states["bit_equal"] == states["tensors"], states
