"""Forward+backward throughput of Moonlight-shaped decoder layers (issue 2, item 4).

Real widths from a config (hidden 2048, MLA, 64 experts top-6), a few layers, random bf16
weights, `--seq` tokens per sequence; the decoder layers alone, or with the 163840-vocab output
layer and megatron's cross-entropy (`--head`). The MoE runs either our fast path ("grouped":
grouped-GEMM experts and gather-only token permutation, mcore_rl.models.experts/dispatch) or
megatron's own ("loop": per-expert matmuls, scatter-add permutation); one run compares both.
On GPU the fused elementwise chains (mcore_rl.models.fused) are compiled unless
TORCHDYNAMO_DISABLE=1.
TFLOP/s count 6 x active parameters per token (embedding excluded) plus
causal attention; percentages are against the dense bf16 peak (989 TFLOP/s on the H100/H200 spec
sheet, 790 measured for an 8192^3 matmul on the lent machines).

    python benchmarks/layer_bench.py --layers 4 --seq 4096 --out layer.json           # 1 GPU
    python benchmarks/layer_bench.py --gpus 2 --ep 2 --layers 4 --out layer2.json     # EP over NCCL
    python benchmarks/layer_bench.py --cpu --tiny --steps 1 --out layer.json          # CPU smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
def _time(model, ids, steps: int) -> list[float]:
    from benchmarks.harness import timed_calls

    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    labels = torch.roll(ids, -1, 1) if model.post_process else None
    grad = []

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        out = model(ids, pos, None, labels=labels)
        if labels is not None:
            out.float().mean().backward()
        else:  # the decoder's hidden states: backward from a fixed random gradient
            grad[:] = grad or [torch.randn_like(out)]
            out.backward(grad[0])

    return timed_calls(fwd_bwd, steps, warmup=2)


def _profile(model, ids, top: int) -> list[dict]:
    """The `top` ops that take the most device time in one fwd+bwd."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts, record_shapes=True) as prof:
        _time(model, ids, 1)
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    ops = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: getattr(e, key), reverse=True)[:top]
    return [dict(op=f"{e.key} {e.input_shapes}" if e.input_shapes else e.key, ms=getattr(e, key) / 1e3 / 3,
                 calls=e.count // 3) for e in ops]  # per iteration


def worker(rank: int, args, port: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.gpus), LOCAL_RANK=str(rank))
    sys.path.insert(0, ROOT)
    from benchmarks.flops import MATMUL_PEAK, SPEC_PEAK, flops_per_token
    from benchmarks.shapes import hf_config
    from mcore_rl.models import HFModel, build_model, transformer_config
    from mcore_rl.parallel import Layout, init_distributed

    init_distributed(Layout(tp=args.tp, ep=args.ep))
    cfg = hf_config("tiny_cpu.yaml" if args.tiny else args.config, args.layers)
    if args.moe_only:
        cfg["first_k_dense_replace"] = 0
    hf = HFModel.from_dict(cfg)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    extra = {"moe_token_dispatcher_type": args.dispatcher} if args.dispatcher and hf.num_experts else {}
    tcfg = transformer_config(hf, tp=args.tp, ep=args.ep, dtype=dtype, cpu=args.cpu, **extra)
    dev = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(1234)  # the same tokens on every rank (one DP replica)
    ids = torch.randint(0, hf.vocab_size, (args.batch, args.seq)).to(dev)
    flops = None
    rows = []
    for grouped in ([True, False] if args.experts == "both" else [args.experts == "grouped"]):
        model = build_model(hf, tcfg, fast_moe=grouped, post_process=args.head)
        flops = flops or flops_per_token(model, hf, args.seq)
        if not args.cpu:
            torch.cuda.reset_peak_memory_stats()
        times = _time(model, ids, args.steps)
        med = statistics.median(times)
        # every data-parallel rank (gpus / tp of them; EP ranks are DP ranks for the dense part)
        # runs its own batch; the TP ranks of one replica share its work
        tokens = args.batch * args.seq * (args.gpus // args.tp)
        tflops = flops * args.batch * args.seq / med / args.tp / 1e12
        row = dict(experts="grouped" if grouped else "loop", median_s=med, times_s=times,
                   tokens_per_s=tokens / med, tflops_per_gpu=tflops,
                   pct_of_spec_peak=100 * tflops * 1e12 / SPEC_PEAK,
                   pct_of_matmul_peak=100 * tflops * 1e12 / MATMUL_PEAK,
                   peak_mem_gib=None if args.cpu else torch.cuda.max_memory_allocated() / 2**30)
        if args.profile:
            row["top_ops"] = _profile(model, ids, args.profile)
        rows.append(row)
        del model
        if not args.cpu:
            torch.cuda.empty_cache()
    if rank == 0:
        results.put(dict(rows=rows, layers=hf.num_layers, head=args.head, moe_layers=sum(map(hf.is_moe_layer, range(hf.num_layers))),
                         seq=args.seq, batch=args.batch, gpus=args.gpus, tp=args.tp, ep=args.ep,
                         dispatcher=tcfg.moe_token_dispatcher_type if hf.num_experts else None,
                         flops_per_token=flops, device="cpu" if args.cpu else torch.cuda.get_device_name(),
                         torch=torch.__version__))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "moonlight_16b.yaml"))
    p.add_argument("--layers", type=int, default=4, help="decoder layers (Moonlight: the first is dense)")
    p.add_argument("--moe-only", action="store_true", help="make every layer MoE")
    p.add_argument("--head", action="store_true", help="include the output layer and megatron's cross-entropy "
                   "(by default the decoder layers alone are timed)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--experts", choices=["grouped", "loop", "both"], default="both")
    p.add_argument("--dispatcher", choices=["allgather", "alltoall"], default=None)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="add the N top device ops of one iteration")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default="layer_bench.json")
    args = p.parse_args(argv)
    if args.gpus % (args.tp * args.ep):
        p.error("--gpus must be a multiple of --tp x --ep")
    if not args.cpu and torch.cuda.device_count() < args.gpus:
        p.error(f"--gpus {args.gpus} but {torch.cuda.device_count()} visible")
    sys.path.insert(0, ROOT)
    from benchmarks.harness import write_json
    from mcore_rl.parallel import free_port

    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.SimpleQueue()
    torch.multiprocessing.start_processes(worker, args=(args, free_port(), results), nprocs=args.gpus,
                                          start_method="spawn")
    res = results.get()
    res["command"] = "python benchmarks/layer_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"{res['device']}: {res['layers']} layers ({res['moe_layers']} MoE), batch {res['batch']} x seq "
          f"{res['seq']}, tp {res['tp']} ep {res['ep']}")
    print(f"{'experts':<9}{'median s':>10}{'tokens/s':>11}{'TFLOP/s/GPU':>13}{'% spec':>8}{'% matmul':>10}{'peak GiB':>10}")
    for r in res["rows"]:
        mem = f"{r['peak_mem_gib']:>10.1f}" if r["peak_mem_gib"] is not None else f"{'-':>10}"
        print(f"{r['experts']:<9}{r['median_s']:>10.4f}{r['tokens_per_s']:>11.0f}{r['tflops_per_gpu']:>13.1f}"
              f"{r['pct_of_spec_peak']:>8.1f}{r['pct_of_matmul_peak']:>10.1f}{mem}")
        for op in r.get("top_ops", []):
            print(f"    {op['ms']:>8.2f} ms  x{op['calls']:<5} {op['op'][:150]}")
    if len(res["rows"]) == 2:
        res["grouped_speedup"] = res["rows"][1]["median_s"] / res["rows"][0]["median_s"]
        print(f"grouped / loop speed-up: {res['grouped_speedup']:.2f}x")
    write_json(res, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
