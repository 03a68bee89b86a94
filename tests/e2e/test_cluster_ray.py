"""A real two-node Ray cluster on loopback, started, used and stopped through scripts/*.sh.

The scenario lives in tests/support/cluster_scenario.py. It runs in a private network namespace
(`unshare -rn`, or `unshare -n` as root) when the kernel allows one: only `lo` exists there, so
every Ray port is loopback-only and cannot collide with other Ray instances on the machine.
Otherwise it runs here with node addresses 127.0.0.2/127.0.0.3.

Two jobs go through scripts/submit.sh: a probe that sees both nodes and the passed-through
environment, then the README's tiny training with one actor rank on each node.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCENARIO = REPO / "tests" / "support" / "cluster_scenario.py"
VENV_BIN = str(Path(sys.executable).parent)
RAY_CLI = shutil.which("ray", path=f"{VENV_BIN}:{os.environ.get('PATH', '')}")

pytestmark = pytest.mark.skipif(RAY_CLI is None, reason="`ray` CLI not installed (pip install 'ray[default]')")


def netns_prefix() -> list[str] | None:
    if shutil.which("unshare") is None:
        return None
    for prefix in (["unshare", "-rn"], ["unshare", "-n"]):
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    return None


def test_two_node_cluster_submit_wait_logs_stop(tmp_path):
    out = tmp_path / "result.json"
    prefix = netns_prefix()
    cmd = [sys.executable, str(SCENARIO), "--out", str(out)]
    if prefix:
        cmd = [*prefix, *cmd, "--netns"]
    else:
        warnings.warn("no network namespace available: Ray's GCS/raylet listen on all interfaces during this test")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=720)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    ctx = json.dumps({k: v for k, v in r.items() if k != "jobs"}, indent=1)[-6000:]

    assert not r.get("error"), r["error"]
    assert r["nodes"] == 2, ctx
    assert set(r["jobs"]) == {"probe", "train"}, ctx
    for name, job in r["jobs"].items():
        assert job["wait_rc"] == 0, f"{name} job did not succeed:\n{job['status']}\n{job['logs'][-6000:]}"
        assert "succeeded" in job["status"].lower(), job["status"]
        assert job["missing_in_logs"] == [], f"{name}: missing {job['missing_in_logs']} in:\n{job['logs'][-6000:]}"
    # the doctor's Ray check connects to the live cluster with the token
    assert r["doctor_ray"] and r["doctor_ray"][0]["severity"] == "ok", r["doctor_ray"]
    # everything we started is gone, and needed no SIGKILL
    assert r["leftover"] == [], ctx
    assert r["killed_after_grace"] == [], ctx
    if r["netns"]:
        assert {ip.removeprefix("::ffff:") for ip in r["listening"]} <= {"127.0.0.1"}, r["listening"]
