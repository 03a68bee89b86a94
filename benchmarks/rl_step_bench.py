"""RL steps on Megatron actors, timed per phase: embedded rollout, old log-probs, update, weight sync.

One process per GPU (NCCL), each holding a `MegatronActor` exactly as the trainer builds it, on a
model with real widths from a config (random weights, `--layers` to shorten it). After the update
each step pushes the updated live weights to SGLang-layout receivers, one process per GPU, for the
engine layout `--rollout-tp/--rollout-ep` (benchmarks/rl_sync.py); after the first sync the
receivers' contents are checked against a megatron checkpoint of the trainer (a mismatch fails the
run). Prints a table and writes JSON. Training TFLOP/s count 6 x active parameters per token plus
causal attention.

    python benchmarks/rl_step_bench.py --gpus 1 --layers 4 --out rl.json                        # 1 GPU
    python benchmarks/rl_step_bench.py --gpus 8 --ep 8 --rollout-tp 8 --out rl.json             # 8 GPUs
    python benchmarks/rl_step_bench.py --cpu --tiny --gpus 2 --ep 2 --rollout-tp 2 --out rl.json  # CPU, gloo
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import rl_sync  # noqa: E402
from benchmarks.flops import MATMUL_PEAK, flops_per_token  # noqa: E402
from mcore_rl.sync.checksum import WeightMismatch  # noqa: E402


def model_dims(args) -> dict:
    from benchmarks.shapes import hf_config

    return hf_config("tiny_cpu.yaml" if args.tiny else args.config, args.layers)


def worker(rank: int, args, hf_dir: str, cfg: dict, port: int, results, verdicts, conns):
    os.environ["LOCAL_RANK"] = str(rank)
    from mcore_rl.actor import MegatronActor
    from mcore_rl.rollout.embedded import sample_on_shards

    actor = MegatronActor(rank, args.gpus, port, hf_dir, cfg)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    vocab = actor.hf.vocab_size
    B, P, R = args.batch * actor.ps.get_data_parallel_world_size(), args.prompt, args.response
    gen = torch.Generator().manual_seed(0)
    flops_tok = flops_per_token(actor.model, actor.hf, P + R)
    weights = rl_sync.WeightSync(rank, args, model_dims(args), conns)
    times = {k: [] for k in ("rollout", "old_log_prob", "update", "sync", "step")}
    for step in range(args.steps + 1):  # step 0 warms up (and opens the IPC handles)
        prompts = torch.randint(0, vocab, (B, P), generator=gen)
        t0 = time.perf_counter()
        out = sample_on_shards(actor, prompts, torch.ones_like(prompts), step * B + torch.arange(B), R, 1.0, 1.0)
        sync()
        t1 = time.perf_counter()
        seqs = _share(out[0] if out else None, actor)
        batch = dict(tokens=seqs, attention_mask=torch.ones_like(seqs), response_mask=torch.ones(B, R))
        actor.log_probs(batch)
        sync()
        t2 = time.perf_counter()
        batch.update(advantages=torch.randn(B, 1).expand(B, R).contiguous(), old_log_probs=torch.zeros(B, R))
        actor.update(batch)
        sync()
        t3 = time.perf_counter()
        weights.push(actor.model)
        sync()
        t4 = time.perf_counter()
        if step:
            for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                times[k].append(v)
        elif args.verify:
            weights.verify(actor.model, os.path.join(hf_dir, "verify_ckpt"), results, verdicts)
    weights.stop()
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        tokens = B * (P + R)
        sync_bytes = weights.bytes_per_rank()
        results.put(("result", dict(
            gpus=args.gpus, tp=args.tp, ep=args.ep, pp=1, rollout_tp=args.rollout_tp, rollout_ep=args.rollout_ep,
            engines=len(weights.plans), layers=actor.hf.num_layers, batch_seqs=B,
            seq_len=P + R, response_len=R, median_s=med, all_s=times,
            update_tokens_per_s=tokens / med["update"], step_tokens_per_s=tokens / med["step"],
            update_tflops_per_gpu=flops_tok * tokens / med["update"] / args.gpus / 1e12,
            logprob_tflops_per_gpu=flops_tok / 3 * tokens / med["old_log_prob"] / args.gpus / 1e12,
            rollout_tokens_per_s=B * R / med["rollout"],
            sync_buckets=len(weights.plans[0].buckets), sync_bucket_mb=args.bucket_mb,
            sync_bytes_per_rank_max=max(sync_bytes), sync_bytes_total=sum(sync_bytes),
            sync_gb_per_s_per_gpu=max(sync_bytes) / med["sync"] / 1e9,
            peak_mem_gib=(torch.cuda.max_memory_allocated() / 2**30) if torch.cuda.is_available() else None,
            device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")))


def _share(seqs, actor):
    """Rollout results live on the reporting ranks; every rank needs the whole batch."""
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, seqs)
    return torch.cat([p for p in parts if p is not None])


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "moonlight_16b.yaml"),
                   help="a config holding model.hf_config (the model's real widths)")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: as configured)")
    p.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--response", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rollout-tp", type=int, default=0, help="engine tp size (0: --gpus); GPUs / this = engines")
    p.add_argument("--rollout-ep", type=int, default=0, help="engine ep size (0: --rollout-tp)")
    p.add_argument("--bucket-mb", type=float, default=512, help="weight-sync bucket size")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the weight check after the first sync (it saves a checkpoint)")
    p.add_argument("--corrupt-receiver", action="store_true",
                   help="flip a bit in the last GPU's receiver before the check (must fail)")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default="rl_step_bench.json")
    args = p.parse_args(argv)
    if not args.cpu and torch.cuda.device_count() < args.gpus:
        p.error(f"--gpus {args.gpus} but {torch.cuda.device_count()} visible")
    args.rollout_tp = args.rollout_tp or args.gpus
    args.rollout_ep = args.rollout_ep or args.rollout_tp
    if args.gpus % args.rollout_tp:
        p.error(f"--rollout-tp {args.rollout_tp} must divide --gpus {args.gpus} (one receiver per GPU)")
    if args.steps < 1:
        p.error("--steps must be at least 1 (step 0 only warms up)")
    if args.corrupt_receiver and not args.verify:
        p.error("--corrupt-receiver needs the weight check")
    from mcore_rl.sync import PlanError

    if args.tp > 1 and args.ep == 1 and model_dims(args).get("n_routed_experts"):
        # experts replicated over TP get only their rank's token slice's grads (the trainer's
        # config refuses this layout too: parallel.etp must then equal tp)
        p.error("--tp > 1 with --ep 1 is a layout the trainer refuses for MoE models; use --ep > 1")
    try:  # layouts the sync cannot serve fail here, before any process starts
        rl_sync.engine_plan(model_dims(args), args, 0)
    except PlanError as e:
        p.error(str(e))
    return args


def run(args) -> dict:
    """Start the receivers and the trainer ranks, check the weights once, return rank 0's report."""
    from mcore_rl import config as C
    from mcore_rl.parallel import free_port

    cfg = C.to_dict(C.Config())
    cfg["parallel"].update(tp=args.tp, ep=args.ep, pp=1, etp=1)
    cfg["model"]["dtype"] = "fp32" if args.cpu else "bf16"
    dims = model_dims(args)
    ctx = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as hf_dir:
        with open(os.path.join(hf_dir, "config.json"), "w") as f:
            json.dump(dims, f)
        results, verdicts = ctx.Queue(), ctx.Queue()
        receivers, conns = rl_sync.start_receivers(ctx, dims, args)
        trainers = torch.multiprocessing.start_processes(
            worker, args=(args, hf_dir, cfg, free_port(), results, verdicts, conns), nprocs=args.gpus,
            join=False, start_method="spawn")
        procs = receivers + trainers.processes
        grace = 0  # seconds the processes get to exit by themselves (megatron's savers leave helpers when killed)
        try:
            kind, res = rl_sync.wait_for(results, procs, "RL steps")
            check = None
            if kind == "verify":
                verdict = "the weight check did not finish"
                try:
                    check = rl_sync.check_receivers(ctx, os.path.join(hf_dir, "verify_ckpt"), dims, args, res)
                    verdict = "ok"
                finally:
                    verdicts.put(verdict)
                    grace = 60
                kind, res = rl_sync.wait_for(results, procs, "RL steps")
            trainers.join()
            grace = 60  # the receivers are stopping
        finally:
            rl_sync.shutdown(procs, grace)
    res["sync_check"] = check
    return res


def main(argv=None) -> int:
    args = parse(argv)
    try:
        res = run(args)
    except WeightMismatch as e:
        print(f"FAILED: the receivers do not hold the trainer's weights\n{e}", file=sys.stderr)
        return 1
    res["command"] = "python benchmarks/rl_step_bench.py " + " ".join(argv or sys.argv[1:])
    if res["device"] != "cpu":
        res["update_pct_of_matmul_peak"] = 100 * res["update_tflops_per_gpu"] * 1e12 / MATMUL_PEAK
    print(f"{'phase':<14}{'median s':>10}")
    for k, v in res["median_s"].items():
        print(f"{k:<14}{v:>10.3f}")
    for k in ("step_tokens_per_s", "update_tokens_per_s", "update_tflops_per_gpu", "update_pct_of_matmul_peak",
              "logprob_tflops_per_gpu", "rollout_tokens_per_s", "sync_gb_per_s_per_gpu", "peak_mem_gib"):
        if res.get(k) is not None:
            print(f"{k:<28}{res[k]:>12.2f}")
    check = res["sync_check"]
    print("weights after the first sync: " + (f"equal ({check['tensors']} tensors on {check['receivers']} "
                                              "receivers)" if check else "not checked (--no-verify)"))
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
