"""Two-node Ray cluster on loopback, driven only through scripts/*.sh.

Used by tests/e2e/test_cluster_ray.py; also runnable by hand:

    python tests/support/cluster_scenario.py --out /tmp/result.json            # in this network namespace
    unshare -rn python tests/support/cluster_scenario.py --netns --out r.json  # in a private one

Steps: scripts/ray_head.sh (--block) -> scripts/ray_worker.sh (--block, second raylet with its
own temp dir and ports) -> scripts/jobs.sh wait-nodes 2 -> scripts/submit.sh (runtime_env with
working_dir, excludes, passed-through env): a probe job, then the tiny training ->
scripts/jobs.sh wait / status / logs for each -> stop both
`ray start --block` processes and every process they started, by pid.

With --netns the caller has put us in a fresh network namespace (only `lo`): every Ray port is
then reachable from loopback only, even the ones Ray binds to 0.0.0.0, and nothing can collide
with other Ray instances on the machine. Without it the nodes use 127.0.0.2/127.0.0.3 (Ray
rewrites 127.0.0.1 to the machine's address) and the dashboard stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
# (name, scripts/submit.sh arguments, strings the job's log must contain), submitted in order
JOBS = [
    ("probe", ["--", "python", "tests/support/cluster_probe.py", "--expect-nodes", "2",
               "--print-env", "NCCL_SOCKET_IFNAME", "MCORE_RL_PROBE"],
     ["PROBE-OK nodes=2", "NCCL_SOCKET_IFNAME=lo", "MCORE_RL_PROBE=hello"]),
    # the README's tiny training through submit.sh's default entrypoint, one actor rank per node
    ("train", ["--config", "configs/tiny_cpu.yaml", "trainer.total_training_steps=2",
               "trainer.output_dir=outputs/cluster_test", "data.task_val_size=8"],
     ["2 actor ranks on 2 node(s)", "done in"]),
]


class ScenarioError(RuntimeError):
    pass


def bring_up_loopback() -> None:
    """`ip link set lo up` without iproute2 (a new network namespace starts with lo down)."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s.fileno(), siocgifflags, ifr)[:18])[1]
        fcntl.ioctl(s.fileno(), siocsifflags, struct.pack("16sH", b"lo", flags | iff_up))


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "<no log>"


def _wait_for_line(proc: subprocess.Popen, log: Path, needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise ScenarioError(f"{log.name}: exited with {proc.returncode} before '{needle}':\n{_tail(log)}")
        time.sleep(0.5)
    raise ScenarioError(f"{log.name}: no '{needle}' after {timeout}s:\n{_tail(log)}")


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _pids_mentioning(path: str) -> list[int]:
    """Processes whose command line contains `path` (our private temp dir): they are ours."""
    import psutil

    me = os.getpid()
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.info["pid"] != me and any(path in a for a in (p.info["cmdline"] or [])):
                found.append(p.info["pid"])
        except psutil.Error:
            continue
    return found


def stop_started(procs: list[subprocess.Popen], marker: str, grace: float = 20.0) -> list[int]:
    """SIGTERM each `ray start --block` we started (it tears its own children down), then
    SIGKILL, by pid, whatever of theirs is still alive. Returns pids that had to be killed."""
    import psutil

    tracked: set[int] = set()
    for p in procs:
        tracked.add(p.pid)
        tracked.update(_descendants(p.pid))
    tracked.update(_pids_mentioning(marker))
    for p in reversed(procs):  # worker first, head last
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
    tracked.update(_pids_mentioning(marker))
    killed = []
    deadline = time.monotonic() + 10
    for pid in sorted(tracked):
        try:
            proc = psutil.Process(pid)
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except psutil.TimeoutExpired:
            try:
                proc.kill()
                killed.append(pid)
            except psutil.Error:
                pass
        except psutil.Error:
            pass
    return killed


def run(cmd: list[str], env: dict, timeout: float, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise ScenarioError(f"{' '.join(cmd)} -> rc {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}")
    return r


def run_scenario(netns: bool, jobs=JOBS, job_timeout: float = 240.0) -> dict:
    if netns:
        bring_up_loopback()
        head_ip = worker_ip = "127.0.0.1"
    else:
        head_ip, worker_ip = "127.0.0.2", "127.0.0.3"
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="mrl-", dir="/tmp"))  # short: Ray's unix sockets live here
    token = work / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)

    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "NCCL_", "GLOO_"))}
    env.update(
        PATH=f"{venv_bin}:{env.get('PATH', '/usr/bin:/bin')}",
        PYTHON=sys.executable,
        RAY_AUTH_TOKEN_PATH=str(token),
        RAY_USAGE_STATS_ENABLED="0",
        NCCL_SOCKET_IFNAME="lo",  # must reach the job through submit.sh's pass-through list
    )
    gcs, dash, client_h, agent_h, agent_w = free_ports(5)
    dash_url = f"http://127.0.0.1:{dash}"
    small = ["--object-store-memory=100000000"]
    result: dict = {"netns": netns, "head_ip": head_ip, "worker_ip": worker_ip, "workdir": str(work)}
    procs: list[subprocess.Popen] = []
    try:
        head_log = work / "head.log"
        with open(head_log, "w") as f:
            procs.append(subprocess.Popen(
                ["bash", str(SCRIPTS / "ray_head.sh"), "--node-ip-address", head_ip, "--port", str(gcs),
                 "--dashboard-port", str(dash), "--num-cpus", "1", "--temp-dir", str(work / "h"),
                 "--token-file", str(token), "--block", "--",
                 f"--ray-client-server-port={client_h}", f"--dashboard-agent-listen-port={agent_h}", *small],
                cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
        _wait_for_line(procs[0], head_log, "Ray runtime started", 90)
        result["head_started_s"] = round(time.monotonic() - t0, 1)

        worker_log = work / "worker.log"
        with open(worker_log, "w") as f:
            procs.append(subprocess.Popen(
                ["bash", str(SCRIPTS / "ray_worker.sh"), "--head-address", f"{head_ip}:{gcs}",
                 "--node-ip-address", worker_ip, "--num-cpus", "1", "--temp-dir", str(work / "w"),
                 "--token-file", str(token), "--wait-for-head", "30", "--block", "--",
                 f"--dashboard-agent-listen-port={agent_w}", *small],
                cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
        _wait_for_line(procs[1], worker_log, "Ray runtime started", 90)
        result["worker_started_s"] = round(time.monotonic() - t0, 1)

        jobctl = ["bash", str(SCRIPTS / "jobs.sh"), "--address", dash_url, "--token-file", str(token)]
        run(jobctl + ["wait-nodes", "2", "--timeout", "60"], env, 90)
        result["nodes"] = int(run(jobctl + ["nodes"], env, 60).stdout.strip())

        result["jobs"] = {}
        for name, submit_args, expect in jobs:
            job_id = f"mrl-test-{name}-{secrets.token_hex(4)}"
            sub = run(["bash", str(SCRIPTS / "submit.sh"), "--address", dash_url, "--token-file", str(token),
                       "--submission-id", job_id, "--no-wait", "--env", "MCORE_RL_PROBE=hello",
                       *submit_args], env, 120)
            waited = run(jobctl + ["wait", job_id, "--timeout", str(int(job_timeout))], env, job_timeout + 30,
                         check=False)
            logs = run(jobctl + ["logs", job_id], env, 60, check=False).stdout
            result["jobs"][name] = dict(
                job_id=job_id, submit_stdout=sub.stdout[-2000:], wait_rc=waited.returncode,
                status=run(jobctl + ["status", job_id], env, 60, check=False).stdout, logs=logs,
                missing_in_logs=[e for e in expect if e not in logs])

        doctor = run([sys.executable, "-m", "mcore_rl.preflight.doctor", "--json"],
                     {**env, "RAY_ADDRESS": f"{head_ip}:{gcs}", "RAY_AUTH_MODE": "token"}, 120, check=False)
        result["doctor_rc"] = doctor.returncode
        try:
            result["doctor_ray"] = [f for f in json.loads(doctor.stdout)["findings"] if f["check"] == "ray"]
        except (ValueError, KeyError):
            result["doctor_ray"] = doctor.stdout[-2000:] + doctor.stderr[-2000:]
        if netns:
            import psutil

            result["listening"] = sorted({
                c.laddr.ip for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN})
    except ScenarioError as e:
        result["error"] = str(e)
    finally:
        result["killed_after_grace"] = stop_started(procs, str(work))
        result["leftover"] = _pids_mentioning(str(work))
        result["elapsed_s"] = round(time.monotonic() - t0, 1)
        if not result.get("error"):
            shutil.rmtree(work, ignore_errors=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--netns", action="store_true", help="we run in a private network namespace")
    ap.add_argument("--out", required=True, help="write the result JSON here")
    args = ap.parse_args()
    res = run_scenario(args.netns)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
