"""Run a command against several Ray "nodes" on this one host: raylets of `ray.cluster_utils.Cluster`
on loopback, each with GPUs of its own, the command joining them through RAY_ADDRESS (as a job
submitted to a cluster does), the raylets stopped when it ends, fails or is cut (SIGTERM, passed on).

    python scripts/gpu/raylets.py --nodes 2 --gpus-per-node 2 -- python benchmarks/rl_loop_bench.py ... \
        cluster.nnodes=2 cluster.n_gpus_per_node=2 rollout.tp_size=4

is issue 45's TP 4 engine over two nodes of 2 GPUs on one 4-GPU machine (tests/support/multinode_scenario.py
does the same at the tiny size, one GPU or CPU a raylet).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--gpus-per-node", type=int, default=2)
    ap.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--object-store-mb", type=int, default=4096)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command to run")
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no command (give it after --)")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keeps the raylets on loopback
    from tests.support.multinode_scenario import start_cluster

    cluster, _ = start_cluster(a.device, tempfile.mkdtemp(prefix="mrl-raylets-", dir="/tmp"), a.nodes,
                               gpus=a.gpus_per_node, cpus=4 * a.gpus_per_node, object_store_mb=a.object_store_mb)
    p = None

    def stop(signum, frame):  # `timeout` signals this process only: pass it on, then unwind
        if p is not None and p.poll() is None:
            p.send_signal(signum)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        print(f"{a.nodes} raylets of {a.gpus_per_node} {a.device.upper()}(s) at {cluster.address}", flush=True)
        p = subprocess.Popen(cmd, env=dict(os.environ, RAY_ADDRESS=cluster.address))
        return p.wait()
    finally:
        if p is not None and p.poll() is None:
            try:
                p.wait(timeout=90)
            except subprocess.TimeoutExpired:
                p.kill()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
