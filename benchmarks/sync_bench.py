"""Weight-sync benchmark: colocated trainer ranks -> SGLang-layout receivers over CUDA IPC.

N trainer processes hold a Moonlight-16B-A3B-shaped model (random bf16) with EP=N, as the sync
plan (mcore_rl.sync.plan) lays it out. N receiver processes, one per GPU beside its trainer rank,
hold SGLang-layout parameter buffers for engine TP=N, EP=N (attention and dense MLP sliced by tp
rank, experts as w13 [local_E, 2I, H] / w2 [local_E, H, I], gate_up_proj fused). Per bucket a
trainer flattens its payload into one buffer (SGLang's flattened_bucket format), sends the CUDA
IPC handle, and the receiver copies each tensor into place as SGLang's weight loaders would
(benchmarks/sglang_receivers.py, shared with rl_step_bench's sync phase).
SGLang itself is not imported (the GPU machines do not have it); the bucket format is checked
against SGLang's class in tests/test_sglang_sync.py.

    python benchmarks/sync_bench.py --gpus 4 --out sync.json      # GPU
    python benchmarks/sync_bench.py --cpu --tiny --out sync.json  # CPU smoke test (shared memory)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import zlib

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mcore_rl.models.config import HFModel  # noqa: E402
from mcore_rl.parallel import Layout  # noqa: E402
from mcore_rl.sync.bucket import flatten  # noqa: E402
from mcore_rl.sync.checksum import compare, digests  # noqa: E402
from mcore_rl.sync.plan import EngineLayout, SyncPlan  # noqa: E402
from mcore_rl.sync.transports import torch_serializer  # noqa: E402
from benchmarks.sglang_receivers import engine_params, place, serve  # noqa: E402
from benchmarks.shapes import moonlight  # noqa: E402

MOONLIGHT = moonlight()
TINY = dict(MOONLIGHT, vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
            kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def source_tensors(plan: SyncPlan, rank: int, device) -> dict[str, torch.Tensor]:
    """This trainer rank's tensors, random but reproducible from their names."""
    out = {}
    for b in plan.for_rank(rank):
        for t in b.payload:
            g = torch.Generator(device=device).manual_seed(zlib.crc32(t.name.encode()))
            out[t.name] = torch.randn(t.shape, generator=g, device=device, dtype=torch.float32).to(t.dtype)
    return out


def make_plan(cfg: dict, n: int, bucket_bytes: int) -> SyncPlan:
    """Trainer EP = n, engine TP = EP = n, colocated rank r <-> engine rank r (rebuilt per process:
    HFModel does not pickle, and the plan is deterministic)."""
    plan = SyncPlan.build(HFModel.from_dict(cfg), Layout(ep=n), n, EngineLayout(n, n, 1, n),
                          {r: r for r in range(n)}, bucket_bytes=bucket_bytes)
    plan.check_complete()
    return plan


def _device(cpu: bool, rank: int):
    if cpu:
        return torch.device("cpu")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def trainer(rank, spec, ctl, peer, args):
    """`ctl`: go/done with the main process; `peer`: buckets and acks with this GPU's receiver."""
    plan = make_plan(*spec)
    device = _device(args.cpu, rank)
    src = source_tensors(plan, rank, device)
    parts = plan.for_rank(rank)
    cap = max(b.payload_bytes for b in parts)
    buffers = [torch.empty(cap, dtype=torch.uint8, device=device) for _ in range(2)]  # double buffering
    if args.cpu:
        for b in buffers:
            b.share_memory_()
    ctl.send(("ready", None))
    for _ in range(args.repeats + 1):
        assert ctl.recv() == "go"
        pending = 0
        for i, b in enumerate(parts):
            if pending == 2:  # the receiver is done with buffer i % 2
                assert peer.recv() == "ack"
                pending -= 1
            flat, metas = flatten([(t.name, src[t.name]) for t in b.payload], out=buffers[i % 2])
            if not args.cpu:
                torch.cuda.current_stream().synchronize()  # the receiver reads on another process
            peer.send(("bucket", torch_serializer({"flattened_tensor": flat, "metadata": metas})))
            pending += 1
        for _ in range(pending):
            assert peer.recv() == "ack"
        ctl.send(("done", None))
    # expected SGLang-layout contents, digested where they live
    expected = engine_params(plan, rank, device)
    place(expected, list(src.items()), rank, plan)
    ctl.send(("expected", digests(expected.items())))
    peer.send(("digest", None))
    ctl.send(("got", peer.recv()))
    peer.send(("stop", None))


def receiver(rank, spec, conn, args):
    serve(conn, make_plan(*spec), rank, _device(args.cpu, rank))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=None, help="GPUs (= trainer ranks = engine TP = EP)")
    ap.add_argument("--cpu", action="store_true", help="CPU tensors over shared memory instead of CUDA IPC")
    ap.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test)")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--copy-bw", type=float, default=4.0e12,
                    help="device copy bandwidth, bytes/s read+write (4.0e12 measured on 4 x H200)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    n = args.gpus or (2 if args.cpu else torch.cuda.device_count())
    cfg = dict(TINY if args.tiny else MOONLIGHT)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    spec = (cfg, n, int(args.bucket_mb * 2**20))
    plan = make_plan(*spec)
    hf = plan.hf
    ctx = mp.get_context("spawn")
    links, procs = [], []
    for r in range(n):
        ctl_main, ctl_trainer = ctx.Pipe()
        peer_trainer, peer_receiver = ctx.Pipe()
        links.append(ctl_main)
        procs.append(ctx.Process(target=trainer, args=(r, spec, ctl_trainer, peer_trainer, args)))
        procs.append(ctx.Process(target=receiver, args=(r, spec, peer_receiver, args)))
    for p in procs:
        p.start()
    for c in links:
        assert c.recv()[0] == "ready"
    times = []
    for i in range(args.repeats + 1):
        t0 = time.perf_counter()
        for c in links:
            c.send("go")
        for c in links:
            assert c.recv()[0] == "done"
        if i:  # the first round opens the IPC handles
            times.append(time.perf_counter() - t0)
    expected = [c.recv()[1] for c in links]
    got = [c.recv()[1] for c in links]
    for p in procs:
        p.join(timeout=120)
    mismatches = []
    for r in range(n):
        try:
            compare(expected[r], got[r], where=f"rank {r}")
        except AssertionError as e:
            mismatches.append(str(e))
    rank_bytes = [sum(b.payload_bytes for b in plan.for_rank(r)) for r in range(n)]
    sec = statistics.median(times)
    bound = 2 * 2 * max(rank_bytes) / args.copy_bw  # two copies (flatten, place), each read + write
    result = dict(device="cpu" if args.cpu else torch.cuda.get_device_name(0), gpus=n,
                  model="tiny" if args.tiny else "moonlight-16b-a3b", layers=hf.num_layers,
                  params=sum(math.prod(t.shape) for t in plan.tensors.values()),
                  buckets=len(plan.buckets), bucket_mb=args.bucket_mb, seconds_median=sec, seconds_all=times,
                  bytes_per_rank_max=max(rank_bytes), bytes_total=sum(rank_bytes),
                  gb_per_s_total=sum(rank_bytes) / sec / 1e9, gb_per_s_per_gpu=max(rank_bytes) / sec / 1e9,
                  copy_bound_seconds=bound, ratio_to_bound=sec / bound, weights_equal=not mismatches,
                  mismatches=mismatches)
    print(f"{'gpus':>4} {'GB/rank':>8} {'buckets':>7} {'sync s':>8} {'GB/s/gpu':>9} {'bound s':>8} "
          f"{'x bound':>7} equal")
    print(f"{n:>4} {max(rank_bytes) / 1e9:>8.2f} {len(plan.buckets):>7} {sec:>8.3f} "
          f"{result['gb_per_s_per_gpu']:>9.1f} {bound:>8.4f} {sec / bound:>7.1f} {not mismatches}")
    if args.out:
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=2)
        os.replace(tmp, args.out)
    if mismatches:
        sys.exit("weight check failed:\n" + "\n".join(mismatches))
    return result


if __name__ == "__main__":
    main()
