"""Ray job entrypoint used by tests/e2e/test_cluster_ray.py: proves the job sees every node.

Run as `python tests/support/cluster_probe.py --expect-nodes N` inside a Ray job. Places one task on
each alive node (node affinity, hard), prints what it saw and exits non-zero on any mismatch.
"""

import argparse
import os
import socket
import sys

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@ray.remote(num_cpus=1)
def where() -> str:
    return ray.get_runtime_context().get_node_id()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--expect-nodes", type=int, required=True)
    ap.add_argument("--print-env", nargs="*", default=[])
    args = ap.parse_args()

    ray.init()  # inside a job: connects to the cluster that runs it
    alive = [n for n in ray.nodes() if n["Alive"]]
    print(f"probe: host={socket.gethostname()} alive_nodes={len(alive)}", flush=True)
    for n in alive:
        print(f"probe: node {n['NodeID'][:12]} ip={n['NodeManagerAddress']} cpus={n['Resources'].get('CPU')}")
    for name in args.print_env:
        print(f"probe: env {name}={os.environ.get(name, '<unset>')}")

    refs = [
        where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in alive
    ]
    ran_on = set(ray.get(refs, timeout=120))
    expected = {n["NodeID"] for n in alive}
    if len(alive) != args.expect_nodes or ran_on != expected:
        print(f"PROBE-FAILED expected {args.expect_nodes} nodes, alive {len(alive)}, tasks ran on {len(ran_on)}")
        return 1
    print(f"PROBE-OK nodes={len(alive)} tasks_on_distinct_nodes={len(ran_on)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
