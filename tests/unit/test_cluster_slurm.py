"""scripts/slurm/mcore_rl.sbatch: syntax, shellcheck, and a run against stand-in Slurm commands.

The stand-ins (`srun`, `scontrol` on PATH) record every command the batch script issues, with
the pid of the process that issued it: pids are handed out in fork order, so sorting by pid
gives the order in which the script launched its steps even for background steps.
"""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

from tests.support.cluster_tools import INSTALL_HINT, find_tool

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "scripts" / "slurm" / "mcore_rl.sbatch"
HOSTS = ["gpu-a01", "gpu-a02", "gpu-b07"]
IPS = {"gpu-a01": "10.8.0.11", "gpu-a02": "10.8.0.12", "gpu-b07": "10.8.1.7"}

SRUN = r"""#!/usr/bin/env bash
printf '%s\t%s\n' "$$" "srun $(printf '%q ' "$@")" >> "$FAKE_SLURM_LOG"
case " $* " in
    *node_ip.sh*)
        host="" prev=""
        for a in "$@"; do [[ "$prev" == -w ]] && host="$a"; prev="$a"; done
        for m in $FAKE_IPS; do if [[ "${m%%=*}" == "$host" ]]; then echo "${m#*=}"; fi; done
        ;;
    *ray_head.sh* | *ray_worker.sh*)
        sleep 120 &
        child=$!
        trap 'kill $child; printf "%s\tTERM\n" "$$" >> "$FAKE_SLURM_LOG"; exit 0' TERM
        printf '%s\tUP\n' "$$" >> "$FAKE_SLURM_LOG"
        wait $child
        ;;
    *wait-nodes*)  # as the real one: return once the head (and worker) steps are up, their traps set
        prev="" n=1
        for a in "$@"; do [[ "$prev" == wait-nodes ]] && n="$a"; prev="$a"; done
        steps=$(( n > 1 ? 2 : 1 ))
        for _ in $(seq 300); do [[ $(grep -c $'\tUP$' "$FAKE_SLURM_LOG") -ge $steps ]] && break; sleep 0.1; done
        ;;
    *submit.sh*) exit "${FAKE_SUBMIT_RC:-0}" ;;
esac
"""
SCONTROL = r"""#!/usr/bin/env bash
printf '%s\t%s\n' "$$" "scontrol $*" >> "$FAKE_SLURM_LOG"
if [[ "$1 $2" == "show hostnames" ]]; then printf '%s\n' $FAKE_HOSTS; fi
"""


def test_sbatch_syntax():
    r = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_sbatch_shellcheck():
    sc = find_tool("shellcheck")
    if sc is None:
        pytest.skip(f"shellcheck not installed ({INSTALL_HINT['shellcheck']})")
    r = subprocess.run([sc, "-x", str(SBATCH)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr


def run_sbatch(tmp_path: Path, hosts: list[str], args: list[str], extra_env: dict | None = None):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name, body in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bindir / name).write_text(body)
        (bindir / name).chmod(0o755)
    log = tmp_path / "slurm.log"
    log.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_", "CONTAINER_", "MCORE_RL_"))}
    env.update(
        PATH=f"{bindir}:{env['PATH']}",
        FAKE_SLURM_LOG=str(log),
        FAKE_HOSTS=" ".join(hosts),
        FAKE_IPS=" ".join(f"{h}={IPS[h]}" for h in hosts),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu-a[01-02],gpu-b07",
        SLURM_NNODES=str(len(hosts)),
        SLURM_SUBMIT_DIR=str(REPO),
        SLURM_GPUS_ON_NODE="8",
        MCORE_RL_RUN_DIR=str(tmp_path / "run"),
        **(extra_env or {}),
    )
    r = subprocess.run(["bash", str(SBATCH), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=60)
    calls, terms = [], set()
    for line in log.read_text().splitlines():
        pid, cmd = line.split("\t", 1)
        if cmd == "TERM":
            terms.add(int(pid))
        elif cmd != "UP":
            calls.append((int(pid), shlex.split(cmd)))
    calls.sort(key=lambda c: c[0])
    return r, calls, terms


def _find(calls, script):
    return [(pid, argv) for pid, argv in calls if any(a.endswith(script) for a in argv)]


def _opt(argv, name):
    """Value of `name VALUE` or `name=VALUE` in argv."""
    for i, a in enumerate(argv):
        if a == name:
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def test_sbatch_launch_order_with_stand_ins(tmp_path):
    r, calls, terms = run_sbatch(tmp_path, HOSTS, ["--preset", "h800", "--config", "tiny", "trainer.steps=3"])
    assert r.returncode == 0, r.stdout + r.stderr
    head_host, head_ip = HOSTS[0], IPS[HOSTS[0]]

    # node list comes from scontrol, and drives everything else
    assert calls[0][1] == ["scontrol", "show", "hostnames", "gpu-a[01-02],gpu-b07"]
    kinds = []
    for _, argv in calls[1:]:
        tail = next((a for a in argv if a.endswith(".sh")), "?")
        kinds.append(Path(tail).name + (":" + argv[argv.index(tail) + 1] if tail.endswith("jobs.sh") else ""))
    assert kinds == ["node_ip.sh", "ray_head.sh", "ray_worker.sh", "jobs.sh:--address", "submit.sh"], kinds

    (_, lookup), = _find(calls, "node_ip.sh")
    assert _opt(lookup, "-w") == head_host

    (head_pid, head), = _find(calls, "ray_head.sh")
    assert _opt(head, "-w") == head_host and _opt(head, "--nodes") == "1"
    assert _opt(head, "--node-ip-address") == head_ip
    assert _opt(head, "--port") == "6379" and "--block" in head
    assert _opt(head, "--num-gpus") == "8"

    (worker_pid, worker), = _find(calls, "ray_worker.sh")
    assert worker_pid > head_pid
    assert _opt(worker, "--head-address") == f"{head_ip}:6379"
    assert _opt(worker, "--nodes") == "2" and _opt(worker, "--ntasks-per-node") == "1"
    assert _opt(worker, "--exclude") == head_host
    assert "--block" in worker

    (_, waiter), = _find(calls, "jobs.sh")
    assert waiter[waiter.index("wait-nodes") + 1] == "3"

    submits = _find(calls, "submit.sh")
    assert len(submits) == 1, "training must be launched exactly once"
    (_, submit), = submits
    assert _opt(submit, "-w") == head_host and "--overlap" in submit
    assert _opt(submit, "--address") == "http://127.0.0.1:8265"
    assert submit[-5:] == ["--preset", "h800", "--config", "tiny", "trainer.steps=3"]

    # both long-running steps were stopped when the batch script ended
    assert terms == {head_pid, worker_pid}
    token = tmp_path / "run" / "ray_auth_token"
    assert token.stat().st_size == 64 and stat.S_IMODE(token.stat().st_mode) == 0o600
    assert _opt(head, "--token-file") == str(token) == _opt(worker, "--token-file") == _opt(submit, "--token-file")


def test_sbatch_container_single_node_and_exit_code(tmp_path):
    r, calls, terms = run_sbatch(
        tmp_path, HOSTS[:1], ["--", "python", "probe.py"],
        {"CONTAINER_IMAGE": "registry.example/mcore_rl:gpu", "MCORE_RL_IFNAME": "bond0", "FAKE_SUBMIT_RC": "3"})
    assert r.returncode == 3, r.stdout + r.stderr  # the training's exit code is the job's
    sruns = [argv for _, argv in calls if argv[0] == "srun"]
    assert sruns and all(_opt(a, "--container-image") == "registry.example/mcore_rl:gpu" for a in sruns)
    assert all(_opt(a, "--container-mounts").startswith(f"{REPO}:{REPO}") for a in sruns)
    assert not _find(calls, "ray_worker.sh"), "a one-node job has no worker step"
    (_, lookup), = _find(calls, "node_ip.sh")
    assert _opt(lookup, "--ifname") == "bond0"
    (_, waiter), = _find(calls, "jobs.sh")
    assert waiter[waiter.index("wait-nodes") + 1] == "1"
    (_, submit), = _find(calls, "submit.sh")
    assert submit[-3:] == ["--", "python", "probe.py"]
    assert len(terms) == 1
