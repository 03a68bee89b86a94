"""Host <-> GPU copy bandwidth on this node: the bound the trainer's offload and onload are held to.

For each GPU alone, then all GPUs at once (one thread each), time device-to-host and host-to-device
copies of one large buffer into page-locked host memory registered the way the offloader registers
it (mcore_rl.memory.offload.PinnedBuffer). Prints a table and writes JSON.

    python scripts/gpu/host_bandwidth.py --gib 8 --out bw.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from mcore_rl.memory.offload import PinnedBuffer


def _time_copies(dev: int, nbytes: int, reps: int, out: dict, barrier: threading.Barrier | None) -> None:
    torch.cuda.set_device(dev)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dev}")
    host = PinnedBuffer(nbytes)
    host.tensor.fill_(1)  # touch every page first: the VM's memory grows on first use
    res = {"d2h": [], "h2d": []}
    for _ in range(reps + 1):  # the first of each is a warm-up
        for kind in ("d2h", "h2d"):
            if barrier is not None:
                barrier.wait()
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            if kind == "d2h":
                host.tensor.copy_(gpu, non_blocking=True)
            else:
                gpu.copy_(host.tensor, non_blocking=True)
            torch.cuda.synchronize(dev)
            res[kind].append(nbytes / (time.perf_counter() - t0) / 1e9)
    out[dev] = {k: round(statistics.median(v[1:]), 2) for k, v in res.items()}
    host.free()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    n = torch.cuda.device_count()
    nbytes = int(a.gib * (1 << 30))
    alone: dict = {}
    for d in range(n):
        _time_copies(d, nbytes, a.reps, alone, None)
    together: dict = {}
    barrier = threading.Barrier(n)
    threads = [threading.Thread(target=_time_copies, args=(d, nbytes, a.reps, together, barrier)) for d in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"{'GPU':>4} {'alone d2h':>10} {'alone h2d':>10} {'all d2h':>10} {'all h2d':>10}   GB/s, {a.gib} GiB copies")
    for d in range(n):
        print(f"{d:>4} {alone[d]['d2h']:>10} {alone[d]['h2d']:>10} {together[d]['d2h']:>10} {together[d]['h2d']:>10}")
    res = {"gpus": [torch.cuda.get_device_name(d) for d in range(n)], "gib": a.gib, "alone_gbs": alone,
           "all_at_once_gbs": together, "date": time.strftime("%Y-%m-%d")}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
