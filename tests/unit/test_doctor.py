"""python -m mcore_rl.preflight.doctor: the real report on this machine, blockers, and each check's rules."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from mcore_rl.preflight import doctor
from mcore_rl.preflight.doctor import ERROR, OK, WARN, Context

NOISY = ("CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX",
         "MKL_THREADING_LAYER", "MKL_SERVICE_FORCE_INTEL", "NUMEXPR_MAX_THREADS", "RAY_ADDRESS")


def run_doctor(*args: str, **env_overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in NOISY}
    env.update(env_overrides)
    return subprocess.run([sys.executable, "-m", "mcore_rl.preflight.doctor", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def by_check(findings: list[dict]) -> dict[str, dict]:
    return {f["check"]: f for f in findings}


def test_report_on_this_machine_is_readable_and_has_no_blockers():
    r = run_doctor()
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[2].split() == ["STATUS", "CHECK", "DETAIL"]
    for check in ("python", "pkg:torch", "pkg:megatron-core", "pkg:transformers", "pkg:ray", "pip", "gpu",
                  "cuda_visible_devices", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "ulimit_nofile", "shm",
                  "mkl", "numexpr", "ray"):
        assert any(line.split()[1:2] == [check] for line in lines if line.startswith(("ok", "WARN", "ERROR"))), check
    assert lines[-1].endswith("0 error: no blockers"), lines[-1]
    # every non-ok row is followed by its fix
    for i, line in enumerate(lines):
        if line.startswith(("WARN", "ERROR")):
            assert lines[i + 1].lstrip().startswith("fix: "), line


def test_json_output():
    r = run_doctor("--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["blocked"] is False
    checks = by_check(out["findings"])
    assert {f["severity"] for f in out["findings"]} <= {OK, WARN, ERROR}
    assert checks["pkg:megatron-core"]["severity"] == OK and "0.16.1" in checks["pkg:megatron-core"]["detail"]
    assert checks["ray"]["detail"].startswith("RAY_ADDRESS unset")
    if checks["gpu"]["severity"] == WARN:  # this CPU machine: no driver is a warning, not a blocker
        assert "CPU-only" in checks["gpu"]["detail"]
    assert all(f["fix"] for f in out["findings"] if f["severity"] != OK)


def test_duplicated_visible_devices_is_a_blocker():
    r = run_doctor("--json", CUDA_VISIBLE_DEVICES="0,1,0,1")
    assert r.returncode == 1
    f = by_check(json.loads(r.stdout)["findings"])["cuda_visible_devices"]
    assert f["severity"] == ERROR and "repeats 0,1" in f["detail"]
    assert f["fix"] == "export CUDA_VISIBLE_DEVICES=0,1"
    text = run_doctor(CUDA_VISIBLE_DEVICES="0,1,0,1")
    assert text.returncode == 1 and "BLOCKED" in text.stdout.splitlines()[-1]


def test_unknown_gloo_interface_is_a_blocker():
    r = run_doctor("--json", GLOO_SOCKET_IFNAME="no-such-nic0")
    assert r.returncode == 1
    f = by_check(json.loads(r.stdout)["findings"])["GLOO_SOCKET_IFNAME"]
    assert f["severity"] == ERROR and "no-such-nic0" in f["detail"]


# ------------------------------------------------------------------ individual rules
MULTI_NIC = {"lo": ["127.0.0.1"], "eth0": ["10.0.0.5"], "bond0": ["192.168.7.5"], "docker0": ["172.17.0.1"],
             "ib0": []}


def sev(findings, check=None):
    return {f.check: f.severity for f in findings}[check] if check else findings[0].severity


def test_interfaces_multi_nic_rules():
    ctx = Context(env={}, interfaces=MULTI_NIC)
    out = doctor.check_ifnames(ctx)
    assert sev(out, "GLOO_SOCKET_IFNAME") == WARN and "bond0, eth0" in out[0].detail  # docker0 / lo ignored
    assert sev(out, "NCCL_SOCKET_IFNAME") == WARN
    out = doctor.check_ifnames(Context(env={"GLOO_SOCKET_IFNAME": "bond0", "NCCL_SOCKET_IFNAME": "^lo,docker"},
                                       interfaces=MULTI_NIC))
    assert sev(out, "GLOO_SOCKET_IFNAME") == OK and sev(out, "NCCL_SOCKET_IFNAME") == OK
    out = doctor.check_ifnames(Context(env={"NCCL_SOCKET_IFNAME": "ib"}, interfaces=MULTI_NIC))
    assert sev(out, "NCCL_SOCKET_IFNAME") == ERROR  # ib0 has no IPv4 address
    single = doctor.check_ifnames(Context(env={}, interfaces={"lo": ["127.0.0.1"], "eth0": ["10.0.0.5"]}))
    assert {f.severity for f in single} == {OK}


def test_nccl_ifname_semantics():
    names = ["bond0", "docker0", "eth0", "eth1", "lo"]
    assert doctor.nccl_ifname_matches("eth", names) == ["eth0", "eth1"]
    assert doctor.nccl_ifname_matches("=eth", names) == []
    assert doctor.nccl_ifname_matches("=eth1", names) == ["eth1"]
    assert doctor.nccl_ifname_matches("^lo,docker", names) == ["bond0", "eth0", "eth1"]


def test_visible_devices_against_present_gpus():
    gpus = [{"index": i, "uuid": f"GPU-{i}aaaa-bbbb", "name": "H800", "total": 80, "used": 0} for i in range(2)]
    check = doctor.check_visible_devices
    assert sev(check(Context(env={"CUDA_VISIBLE_DEVICES": "1,0"}, gpus=gpus))) == OK
    assert sev(check(Context(env={"CUDA_VISIBLE_DEVICES": "GPU-1aaaa-bbbb"}, gpus=gpus))) == OK
    assert sev(check(Context(env={"CUDA_VISIBLE_DEVICES": "GPU-1aaaa"}, gpus=gpus))) == OK  # unique prefix
    assert sev(check(Context(env={"CUDA_VISIBLE_DEVICES": "0,5"}, gpus=gpus))) == ERROR
    assert sev(check(Context(env={"CUDA_VISIBLE_DEVICES": ""}, gpus=gpus))) == WARN
    assert sev(check(Context(env={}, gpus=gpus))) == OK


def _fake_sysfs(tmp_path, dev="mlx5_0", gid_index=3, gid="0000:0000:0000:0000:0000:ffff:0a00:0005"):
    gids = tmp_path / dev / "ports" / "1" / "gids"
    gids.mkdir(parents=True)
    (gids / str(gid_index)).write_text(gid + "\n")
    (gids / "0").write_text("fe80:0000:0000:0000:0000:0000:0000:0000\n")
    return str(tmp_path)


def test_nccl_ib_rules(tmp_path):
    root = _fake_sysfs(tmp_path)
    check = doctor.check_nccl_ib
    assert sev(check(Context(env={}, ib_root=root))) == OK
    assert sev(check(Context(env={"NCCL_IB_HCA": "mlx5", "NCCL_IB_GID_INDEX": "3"}, ib_root=root))) == OK
    assert sev(check(Context(env={"NCCL_IB_HCA": "=mlx5_0:1"}, ib_root=root))) == OK
    assert sev(check(Context(env={"NCCL_IB_HCA": "mlx4"}, ib_root=root))) == ERROR  # typo: silent TCP fallback
    assert sev(check(Context(env={"NCCL_IB_HCA": "mlx5", "NCCL_IB_GID_INDEX": "5"}, ib_root=root))) == WARN
    assert sev(check(Context(env={"NCCL_IB_GID_INDEX": "three"}, ib_root=root))) == ERROR
    no_rdma = check(Context(env={"NCCL_IB_HCA": "mlx5"}, ib_root=str(tmp_path / "absent")))
    assert sev(no_rdma) == WARN and "falls back to TCP" in no_rdma[0].detail


def test_mkl_and_numexpr_rules():
    assert sev(doctor.check_mkl(Context(env={"MKL_THREADING_LAYER": "INTEL"}))) == WARN
    assert sev(doctor.check_mkl(Context(env={"MKL_THREADING_LAYER": "bogus"}))) == WARN
    assert sev(doctor.check_mkl(Context(env={"MKL_THREADING_LAYER": "GNU"}))) == OK
    assert sev(doctor.check_mkl(Context(env={"MKL_THREADING_LAYER": "INTEL", "MKL_SERVICE_FORCE_INTEL": "1"}))) == OK
    assert sev(doctor.check_numexpr(Context(env={"NUMEXPR_MAX_THREADS": "lots"}))) == WARN
    assert sev(doctor.check_numexpr(Context(env={"NUMEXPR_MAX_THREADS": "64"}))) == OK
    expected = WARN if (os.cpu_count() or 1) > 64 else OK
    assert sev(doctor.check_numexpr(Context(env={}))) == expected


def test_shm_rules(tmp_path):
    assert sev(doctor.check_shm(Context(shm_path=str(tmp_path / "absent")))) == WARN
    assert sev(doctor.check_shm(Context(shm_path=str(tmp_path / "absent"), gpus=[{}]))) == ERROR


def test_ray_rules():
    check = doctor.check_ray
    assert sev(check(Context(env={}))) == OK
    assert sev(check(Context(env={"RAY_ADDRESS": "auto"}))) == OK
    no_token = check(Context(env={"RAY_ADDRESS": "127.0.0.1:6379", "HOME": "/nonexistent"}))
    assert sev(no_token) == ERROR and "RAY_AUTH_MODE=token" in no_token[0].detail
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    down = check(Context(env={"RAY_ADDRESS": closed, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "ab" * 32}))
    assert sev(down) == ERROR and "cannot reach" in down[0].detail


def test_a_crashing_check_does_not_hide_the_others():
    def broken(ctx):
        raise RuntimeError("boom")

    out = doctor.run_checks(Context(env={}), [("broken", broken), ("python", doctor.check_python)])
    assert [(f.check, f.severity) for f in out] == [("broken", WARN), ("python", OK)]
    assert "boom" in out[0].detail


@pytest.mark.parametrize("dist", ["megatron-core", "torch", "ray"])
def test_package_specifiers_come_from_pyproject(dist):
    declared = doctor._declared_specifiers()
    if not declared:
        pytest.skip("mcore_rl is not installed (pip install -e .)")
    fallback = {d: spec for d, _, spec, _ in doctor.PACKAGES}
    assert declared[dist] == fallback[dist], "keep doctor.PACKAGES' fallbacks in step with pyproject.toml"
