"""scripts/*.sh without a cluster: shellcheck, argument handling, safety refusals, runtime_env."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.cluster_tools import INSTALL_HINT, find_tool

REPO = Path(__file__).resolve().parents[2]
S = REPO / "scripts"
SHELL_FILES = sorted([*S.glob("*.sh"), *S.glob("lib/*.sh"), *S.glob("presets/*.env"), S / "slurm" / "mcore_rl.sbatch"])
PASS_THROUGH = ["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX",
                "TORCH_NCCL_AVOID_RECORD_STREAMS", "NUMEXPR_MAX_THREADS", "HF_HOME"]


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "NCCL_", "GLOO_", "MCORE_RL_", "HF_", "TORCH_NCCL", "NUMEXPR", "CUDA_"))}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env.update(extra)
    return env


def sh(script: str, *args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(S / script), *args], cwd=REPO, env=env or clean_env(),
                          capture_output=True, text=True, timeout=timeout)


def dry_run_submit(*args: str, env: dict | None = None) -> tuple[dict, list[str]]:
    r = sh("submit.sh", "--dry-run", *args, env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    runtime_env = json.loads(lines[0].removeprefix("runtime_env: "))
    return runtime_env, shlex.split(lines[1])


def test_shell_files_parse_and_are_shellcheck_clean():
    assert len(SHELL_FILES) >= 9, SHELL_FILES
    for f in SHELL_FILES:
        r = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
        assert r.returncode == 0, f"{f}: {r.stderr}"
    sc = find_tool("shellcheck")
    if sc is None:
        pytest.skip(f"shellcheck not installed ({INSTALL_HINT['shellcheck']})")
    r = subprocess.run([sc, "-x", *map(str, SHELL_FILES)], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dstack_task_file(tmp_path):
    task = yaml.safe_load((S / "dstack" / "mcore_rl.dstack.yml").read_text())
    assert task["type"] == "task" and task["nodes"] >= 2 and task["shell"] == "bash"
    env_names = {e.split("=", 1)[0] for e in task["env"]}
    assert {"RAY_AUTH_TOKEN", "MCORE_RL_CONFIG"} <= env_names
    body = task["commands"][0]
    for needle in ("scripts/ray_head.sh", "scripts/ray_worker.sh", "scripts/submit.sh", "jobs.sh wait-nodes",
                   '--head-address "$DSTACK_MASTER_NODE_IP:6379"', "--block"):
        assert needle in body, needle
    assert body.count("scripts/submit.sh") == 1
    sc = find_tool("shellcheck")
    if sc is None:
        pytest.skip(f"shellcheck not installed ({INSTALL_HINT['shellcheck']})")
    script = tmp_path / "dstack_commands.sh"
    script.write_text("#!/usr/bin/env bash\n" + body)
    r = subprocess.run([sc, "-e", "SC2154", str(script)], capture_output=True, text=True)  # DSTACK_* come from dstack
    assert r.returncode == 0, r.stdout


def test_submit_defaults_to_the_trainer_with_overrides():
    runtime_env, cmd = dry_run_submit("--config", "tiny_cpu", "trainer.steps=2", "rollout.n=4")
    i = cmd.index("--")
    assert cmd[:3] == ["ray", "job", "submit"]
    assert cmd[i + 1:] == ["python", "-m", "mcore_rl.train", "--config", "configs/tiny_cpu.yaml",
                           "trainer.steps=2", "rollout.n=4"]
    assert cmd[cmd.index("--address") + 1] == "http://127.0.0.1:8265"
    assert json.loads(cmd[cmd.index("--runtime-env-json") + 1]) == runtime_env
    assert runtime_env["working_dir"] == str(REPO)
    assert {".venv", ".git", "runs"} <= set(runtime_env["excludes"])
    _, cmd = dry_run_submit("--config", "configs/other.yaml")
    assert cmd[cmd.index("--") + 1:] == ["python", "-m", "mcore_rl.train", "--config", "configs/other.yaml"]


def test_submit_passes_env_only_when_set():
    runtime_env, _ = dry_run_submit("--", "python", "x.py", env=clean_env())
    assert runtime_env["env_vars"] == {}
    env = clean_env(GLOO_SOCKET_IFNAME="bond0", HF_HOME="/data/hf", NUMEXPR_MAX_THREADS="32",
                    UNRELATED_SECRET="nope", MY_FLAG="1", MCORE_RL_PASS_ENV="MY_FLAG")
    runtime_env, cmd = dry_run_submit("--env", "EXTRA=a=b", "--debug", "--no-wait", "--submission-id", "j1",
                                      "--", "python", "x.py", env=env)
    assert runtime_env["env_vars"] == {"GLOO_SOCKET_IFNAME": "bond0", "HF_HOME": "/data/hf",
                                       "NUMEXPR_MAX_THREADS": "32", "MY_FLAG": "1", "EXTRA": "a=b",
                                       "RAY_DEBUG": "1", "RAY_DEBUG_POST_MORTEM": "1"}
    assert "--no-wait" in cmd and cmd[cmd.index("--submission-id") + 1] == "j1"
    assert cmd[-2:] == ["python", "x.py"]


@pytest.mark.parametrize("preset", ["h20", "h800"])
def test_presets_fill_defaults_but_the_environment_wins(preset):
    runtime_env, _ = dry_run_submit("--preset", preset, "--", "true", env=clean_env(NCCL_IB_HCA="mlx5_4"))
    env_vars = runtime_env["env_vars"]
    assert env_vars["NCCL_IB_HCA"] == "mlx5_4"
    assert env_vars["TORCH_NCCL_AVOID_RECORD_STREAMS"] == "1" and env_vars["NCCL_NVLS_ENABLE"] == "0"
    assert ("NCCL_IB_GID_INDEX" in env_vars) == (preset == "h20")  # RoCE v2 on H20 by default
    assert set(env_vars) <= set(PASS_THROUGH) | {"NCCL_NVLS_ENABLE", "CUDA_DEVICE_MAX_CONNECTIONS",
                                                  "NCCL_IB_QPS_PER_CONNECTION"}


@pytest.mark.parametrize("args, message", [
    ([], "--config NAME is required"),
    (["--config", "x", "a=1", "--", "python", "y.py"], "overrides only apply"),
    (["--preset", "nope", "--config", "x"], "have: h20 h800"),
    (["--env", "not-a-pair", "--config", "x"], "KEY=VALUE"),
])
def test_submit_rejects_bad_arguments(args, message):
    r = sh("submit.sh", "--dry-run", *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_head_binds_dashboard_to_loopback_and_creates_a_private_token(tmp_path):
    token = tmp_path / "sub" / "token"
    r = sh("ray_head.sh", "--node-ip-address", "10.1.2.3", "--token-file", str(token), "--dry-run", "--", "--foo")
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(r.stdout)
    assert cmd[:3] == ["ray", "start", "--head"] and cmd[-1] == "--foo"
    assert "--node-ip-address=10.1.2.3" in cmd and "--dashboard-host=127.0.0.1" in cmd
    assert re.fullmatch(r"[0-9a-f]{64}", token.read_text())
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    r2 = sh("ray_head.sh", "--node-ip-address", "10.1.2.3", "--token-file", str(token), "--dry-run")
    assert r2.returncode == 0 and token.read_text() == re.sub(r"\s", "", token.read_text())  # reused, not rewritten

    loud = sh("ray_head.sh", "--node-ip-address", "10.1.2.3", "--token-file", str(token), "--dry-run",
              "--dashboard-all-interfaces")
    assert "--dashboard-host=0.0.0.0" in shlex.split(loud.stdout) and "ALL interfaces" in loud.stderr


@pytest.mark.parametrize("args, message", [
    ([], "--node-ip-address IP (or --ifname IFACE) is required"),
    (["--node-ip-address", "0.0.0.0"], "concrete address"),
    (["--node-ip-address", "10.1.2.3", "--dashboard-host", "0.0.0.0"], "--dashboard-all-interfaces"),
    (["--node-ip-address", "10.1.2.3", "--dashboard-host", "::"], "--dashboard-all-interfaces"),
    (["--ifname", "no-such-nic0"], "cannot find an IPv4 address"),
])
def test_head_refuses_unsafe_or_implicit_addresses(tmp_path, args, message):
    r = sh("ray_head.sh", *args, "--token-file", str(tmp_path / "t"), "--dry-run")
    assert r.returncode != 0 and message in r.stderr, r.stderr


def test_worker_needs_the_token_and_an_explicit_address(tmp_path):
    r = sh("ray_worker.sh", "--head-address", "127.0.0.1:6379", "--node-ip-address", "route",
           "--token-file", str(tmp_path / "missing"), "--dry-run")
    assert r.returncode == 2 and "no token was found" in r.stderr
    token = tmp_path / "token"
    token.write_text("ab" * 32)
    token.chmod(0o600)
    r = sh("ray_worker.sh", "--head-address", "127.0.0.1:6379", "--node-ip-address", "route",
           "--token-file", str(token), "--dry-run", "--", "--resources={\"x\": 1}")
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(r.stdout)
    assert cmd[:2] == ["ray", "start"] and "--head" not in cmd
    assert "--address=127.0.0.1:6379" in cmd and "--node-ip-address=127.0.0.1" in cmd
    assert cmd[-1] == '--resources={"x": 1}'
    r = sh("ray_worker.sh", "--head-address", "127.0.0.1:6379", "--token-file", str(token), "--dry-run")
    assert r.returncode == 2 and "Ray must not guess the NIC" in r.stderr


def test_worker_gives_up_on_an_unreachable_head(tmp_path):
    token = tmp_path / "token"
    token.write_text("ab" * 32)
    token.chmod(0o600)
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = sh("ray_worker.sh", "--head-address", f"127.0.0.1:{port}", "--node-ip-address", "127.0.0.1",
           "--token-file", str(token), "--wait-for-head", "1", env=clean_env(RAY_BIN="false"))
    assert r.returncode == 2 and "not reachable" in r.stderr, r.stderr


def test_node_ip_helper():
    r = subprocess.run(["bash", str(S / "node_ip.sh"), "--ifname", "lo"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "127.0.0.1"
    r = subprocess.run(["bash", str(S / "node_ip.sh"), "--route-to", "127.0.0.1"], capture_output=True, text=True)
    assert r.stdout.strip() == "127.0.0.1"


def test_jobs_sh_argument_errors(tmp_path):
    token = tmp_path / "token"
    token.write_text("ab" * 32)
    token.chmod(0o600)
    env = clean_env(RAY_AUTH_TOKEN_PATH=str(token))
    assert sh("jobs.sh", env=env).returncode == 2
    r = sh("jobs.sh", "frobnicate", env=env)
    assert r.returncode == 2 and "unknown command" in r.stderr
    r = sh("jobs.sh", "logs", env=env)
    assert r.returncode == 2 and "needs a JOB_ID" in r.stderr
    r = sh("jobs.sh", "status", "x", env=clean_env(RAY_AUTH_TOKEN_PATH=str(tmp_path / "none")))
    assert r.returncode == 2 and "no token was found" in r.stderr
