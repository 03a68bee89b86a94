"""Training throughput and memory of the Megatron actor on RL-shaped batches (issue 15).

One process per GPU (NCCL; gloo processes with --cpu) holds a `MegatronActor` exactly as the
trainer builds it (random weights of real widths, `--layers` of them, EP = GPUs) and runs
`MegatronActor.update` on an RL-like batch: prompts and responses of spread lengths (default
256-1024 prompt + 256-3072 response tokens), old log-probs from the policy itself, packed by the
actor into micro-batches up to `--budget` tokens (actor.use_dynamic_bsz), one optimizer step per
update through megatron's schedule, DDP and distributed optimizer.

Each named run (RUNS) is a set of config switches, in processes of its own: memory an earlier run
left behind in the same processes raised later runs' peaks by up to 55 GiB on 2 x H200. Per run:
median update time, TFLOP/s per GPU (benchmarks/harness.py: 6 x active parameters per real token +
causal attention per sequence; filler tokens not counted)
against 790 TFLOP/s and the GPU's measured matmul peak (--checks), peak memory per GPU split into
states, the forward/backward peak and the optimizer-step peak, each beside the planner's
prediction (mcore_rl.memory.planner) for the same layout and the largest micro-batch actually
packed; with --profile, a torch.profiler breakdown of one more update (the profile breakdown below).
Prints tables and writes JSON (--out); --trace keeps the chrome traces beside it.

    python benchmarks/actor_bench.py --gpus 2 --layers 8 --micro-batches 6 --steps 2 --checks --profile --out a.json
    python benchmarks/actor_bench.py --gpus 1 --layers 4 --budget 8192 --out actor1.json      # 1 GPU
    python benchmarks/actor_bench.py --cpu --tiny --gpus 2 --runs baseline,optimized --out a.json  # CPU, gloo

`layer`: forward+backward throughput of Moonlight-shaped decoder layers alone (issue 2, item 4).

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

    python benchmarks/actor_bench.py layer --layers 4 --seq 4096 --out layer.json           # 1 GPU
    python benchmarks/actor_bench.py layer --gpus 2 --ep 2 --layers 4 --out layer2.json     # EP over NCCL
    python benchmarks/actor_bench.py layer --cpu --tiny --steps 1 --out layer.json          # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.harness import GiB, write_json  # noqa: E402

FAST_OFF = ["actor.packed_attention=sdpa", "actor.fused_logprobs=false", "actor.fused_adam=false",
            "actor.overlap_grad_reduce=false"]
# name -> (config overrides, megatron patches left out, memory run: fewer steps, no profile).
# "{half}" stands for half the layers.
RUNS = {
    "baseline": (FAST_OFF, ("rope_thd_no_sync", "grad_norm_no_sync"), False),
    "optimized": ([], (), False),
    "sdpa": (["actor.packed_attention=sdpa"], (), False),  # optimized, but an SDPA call per sequence
    "recompute_full": (["memory.recompute=full"], (), True),
    "recompute_half": (["memory.recompute=full", "memory.recompute_layers={half}"], (), True),
    "recompute_moe": (["memory.recompute=selective", "memory.recompute_modules=[moe]"], (), True),
    "offload": (["memory.optimizer_offload_fraction=1.0"], (), True),
    "grad_bf16": (["memory.grad_fp32=false"], (), True),
}
DEFAULT_RUNS = "baseline,sdpa,optimized,recompute_full,recompute_half,recompute_moe,offload"


# ----------------------------------------------------------------------------- the batch
def rl_batch(args, n: int, vocab: int, seed: int = 0) -> dict:
    """`n` left-padded samples: prompt and response lengths uniform in the given ranges, response
    mask up to each response's end, GRPO-like advantages (one per response)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(args.prompt[0], args.prompt[1] + 1, (n,), generator=g)
    responses = torch.randint(args.response[0], args.response[1] + 1, (n,), generator=g)
    P, R = int(prompts.max()), int(responses.max())
    cols = torch.arange(P + R)
    attn = ((cols[None] >= P - prompts[:, None]) & (cols[None] < P + responses[:, None])).long()
    resp = (torch.arange(R)[None] < responses[:, None]).float()
    return dict(tokens=torch.randint(1, vocab, (n, P + R), generator=g) * attn, attention_mask=attn,
                response_mask=resp, advantages=torch.randn(n, 1, generator=g) * resp)


def samples_per_rank(args, memory_run: bool = False) -> int:
    """Enough samples for about --micro-batches full micro-batches (--memory-micro-batches in
    memory runs: their peak needs one full micro-batch, not many)."""
    if args.samples:
        return args.samples
    mean = (sum(args.prompt) + sum(args.response)) / 2
    return max(1, round((args.memory_micro_batches if memory_run else args.micro_batches) * args.budget / mean))


# ----------------------------------------------------------------------------- one run, one rank
def run_config(args, name: str) -> dict:
    """The run's full config (as the trainer validates it): the actor's DP slice of the batch is one
    mini-batch, packed up to --budget tokens per micro-batch."""
    from mcore_rl.config import sections as C
    from mcore_rl.config import checks as config_checks

    mini = samples_per_rank(args, RUNS[name][2]) * args.gpus
    cfg = C.config_from_dict(C.apply_overrides({"model": {"hf_config": args.hf_cfg}}, [
        f"model.dtype={'fp32' if args.cpu else 'bf16'}", f"parallel.ep={args.gpus}",
        f"cluster.n_gpus_per_node={args.gpus}", f"cluster.device={'cpu' if args.cpu else 'gpu'}",
        "rollout.engine=embedded", "rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus",
        "data.task=copy_last", f"data.train_batch_size={mini}", f"actor.ppo_mini_batch_size={mini}",
        "actor.use_dynamic_bsz=true", f"actor.ppo_max_token_len_per_gpu={args.budget}",
        f"data.max_prompt_length={args.prompt[1]}", f"rollout.max_response_len={args.response[1]}",
        *_overrides_of(args, name)]))
    return C.to_dict(config_checks.validate_config(cfg))


def _overrides_of(args, name: str) -> list[str]:
    overrides, _, _ = RUNS[name]
    return [*args.set, *(o.replace("{half}", str(max(1, args.layers // 2))) for o in overrides)]


class MemoryProbe:
    """Peaks before and during the optimizer step (mcore_rl.parallel.optimizer.step, as the actor calls it)."""

    def __init__(self):
        from mcore_rl.parallel import optimizer as optim

        self.real, self.before, self.during = optim.step, 0, 0
        optim.step = self.step

    def step(self, model, opt):
        if torch.cuda.is_available():
            self.before = max(self.before, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        out = self.real(model, opt)
        if torch.cuda.is_available():
            self.during = max(self.during, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()  # the next forward/backward starts clean
        return out

    def reset(self):
        self.before = self.during = 0
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()


def plan_inputs(actor, cfg: dict, tokens: int, responses: int) -> dict:
    """PlanInputs for this run, at the largest micro-batch the actor packed (its tokens and its
    response tokens): the planner runs in the parent, which can build megatron's unsharded skeleton."""
    from mcore_rl.config.checks import recompute_choice

    mode, layers, modules = recompute_choice(cfg["memory"])
    opts = actor._optim_options()
    return dict(capacity=0, world=torch.distributed.get_world_size(), ep=actor.layout.ep, dtype=cfg["model"]["dtype"],
                micro_tokens=tokens, response_tokens=responses, recompute=mode, recompute_layers=layers,
                recompute_modules=modules, optimizer_offload_fraction=opts["offload_fraction"],
                fused_logprobs=actor._fused_logprobs, fused_adam=opts["fused_adam"], grad_fp32=opts["grad_fp32"],
                packed_attention=actor.packed_attention,
                distributed_optimizer=cfg["actor"]["use_distributed_optimizer"])


def planner(hf_cfg: dict, inputs: dict) -> dict:
    """The planner's per-GPU prediction: states, activations, optimizer-step temporaries, peak."""
    from mcore_rl.memory.planner import PlanInputs, activation_bytes, step_temporary_bytes, trainer_bytes
    from mcore_rl.models.config import HFModel

    hf, i = HFModel.from_dict(hf_cfg), PlanInputs(**inputs)
    parts = trainer_bytes(hf, i, 0)
    states = sum(v for k, v in parts.items() if k != "megatron activations")
    return dict(states_gib=states / GiB, activations_gib=activation_bytes(hf, i, 0) / GiB,
                step_temporaries_gib=step_temporary_bytes(hf, i, 0) / GiB,
                peak_gib=sum(parts.values()) / GiB, parts_gib={k: v / GiB for k, v in parts.items()})


def _profiled_update(actor, batch, rank: int, path: str, sync) -> dict | None:
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        with record_function("bench/step"):
            actor.update(batch)
            sync()
    if rank:
        return None
    prof.export_chrome_trace(path)
    return breakdown_from_file(path)


def one_run(rank: int, args, name: str, port: int, hf_dir: str, probe: MemoryProbe) -> dict:
    from megatron.core import parallel_state as ps

    from benchmarks.harness import active_params, sequences_flops
    from mcore_rl.actor import MegatronActor

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    cfg = run_config(args, name)
    gpu = torch.cuda.is_available()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    t0 = time.perf_counter()
    actor = MegatronActor(rank, args.gpus, port, hf_dir, cfg)
    build_s = time.perf_counter() - t0
    dp = actor.ps.get_data_parallel_world_size()
    memory_run = RUNS[name][2]
    batch = rl_batch(args, samples_per_rank(args, memory_run) * dp, actor.hf.vocab_size)
    sl = actor._dp_slice(len(batch["tokens"]))
    old = torch.zeros_like(batch["response_mask"])
    old[sl] = actor.log_probs(batch)  # the policy's own: PPO ratios near 1, as in RL
    batch["old_log_probs"] = old
    local = {k: v[sl] for k, v in batch.items()}
    lengths = local["attention_mask"].sum(1).tolist()
    responses = local["response_mask"].sum(1)
    flops = sequences_flops(active_params(actor.model, actor.hf), actor.hf, lengths)

    plans = []
    real_plan = actor._micro_plan
    actor._micro_plan = lambda lens, sizes: plans.append(real_plan(lens, sizes)) or plans[-1]
    steps, warmup = (args.memory_steps, 1) if memory_run else (args.steps, args.warmup)
    times, states = [], 0
    for step in range(warmup + steps):
        if step == warmup:
            sync()
            states = torch.cuda.memory_allocated() if gpu else 0
            probe.reset()
        t = time.perf_counter()
        stats = actor.update(batch)
        sync()
        if step >= warmup:
            times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() if gpu else 0
    plan = plans[-1]
    tokens_max = max(pad for _, pad in plan)
    responses_max = max(int(responses[rows].sum()) for rows, _ in plan)
    res = dict(build_s=build_s, times_s=times, median_s=statistics.median(times), flops=flops,
               tokens=sum(lengths), samples=len(lengths), micro_batches=len(plan),
               micro_tokens_max=tokens_max, micro_tokens_mean=sum(lengths) / len(plan),
               response_tokens_max=responses_max, grad_norm=(stats or {}).get("actor/grad_norm"),
               plan_inputs=plan_inputs(actor, cfg, tokens_max, responses_max))
    if gpu:
        res.update(states_gib=states / GiB, fwd_bwd_peak_gib=probe.before / GiB, step_peak_gib=probe.during / GiB,
                   peak_gib=max(peak, probe.before, probe.during) / GiB)
    if args.profile and not memory_run:
        os.makedirs(args.trace_dir, exist_ok=True)
        path = os.path.join(args.trace_dir, f"{name}_rank{rank}.trace.json")
        res["profile"] = _profiled_update(actor, batch, rank, path, sync)
        if rank == 0 and not args.trace:
            os.remove(path)
    del actor._micro_plan, actor, real_plan  # the next run measures its own memory
    gc.collect()  # megatron's DDP hooks hold the model in reference cycles
    if gpu:
        torch.cuda.empty_cache()
    return res


def worker(rank: int, args, names: list[str], skip: tuple, port: int, hf_dir: str, results):
    os.environ["LOCAL_RANK"] = str(rank)
    from mcore_rl import patches

    if skip:
        os.environ[patches.SKIP_ENV] = ",".join(skip)
    probe = MemoryProbe()
    for name in names:
        try:
            res = one_run(rank, args, name, port, hf_dir, probe)
        except Exception as e:  # e.g. out of memory (on every rank alike): report it, go on
            import traceback

            traceback.print_exc()
            res = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        results.put((rank, name, res))


def checks_worker(rank: int, hf_cfg: dict, port: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from tests.gpu import gpu_checks
    from mcore_rl.parallel.groups import Layout, init_distributed

    init_distributed(Layout())
    results.put(gpu_checks.run_all(hf_cfg))


# ----------------------------------------------------------------------------- the parent
def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "moonlight_16b.yaml"),
                   help="a config holding model.hf_config (the model's real widths)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (Moonlight: the first is dense)")
    p.add_argument("--gpus", type=int, default=1, help="processes; EP = this")
    p.add_argument("--runs", default=DEFAULT_RUNS, help=f"comma-separated, of: {', '.join(RUNS)}")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every run")
    p.add_argument("--budget", type=int, default=16384, help="packed tokens per micro-batch (ppo_max_token_len_per_gpu)")
    p.add_argument("--micro-batches", type=int, default=8, help="about this many micro-batches per update")
    p.add_argument("--samples", type=int, default=0, help="samples per rank (0: from --micro-batches)")
    p.add_argument("--prompt", type=int, nargs=2, default=[256, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--response", type=int, nargs=2, default=[256, 3072], metavar=("MIN", "MAX"))
    p.add_argument("--steps", type=int, default=3, help="timed updates per throughput run")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--memory-steps", type=int, default=1, help="timed updates per memory run (after one warm-up)")
    p.add_argument("--memory-micro-batches", type=int, default=2, help="about this many micro-batches per memory run")
    p.add_argument("--profile", action="store_true", help="profile one more update of each throughput run")
    p.add_argument("--trace", action="store_true", help="keep rank 0's chrome traces (beside --out)")
    p.add_argument("--checks", action="store_true", help="first run tests/gpu/gpu_checks.py on one GPU")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--tiny", action="store_true", help="configs/tiny_cpu.yaml's model")
    p.add_argument("--out", default="actor_bench.json")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown or not names:
        p.error(f"--runs: unknown {unknown}; known: {', '.join(RUNS)}")
    args.names = names
    if not args.cpu and torch.cuda.device_count() < args.gpus:
        p.error(f"--gpus {args.gpus} but {torch.cuda.device_count()} visible")
    if args.checks and args.cpu:
        p.error("--checks needs a GPU")
    if min(args.prompt + args.response) < 1 or args.prompt[0] > args.prompt[1] or args.response[0] > args.response[1]:
        p.error("--prompt/--response: 1 <= MIN <= MAX")
    if args.prompt[1] + args.response[1] > args.budget:
        p.error(f"--budget {args.budget} is below the longest sample ({args.prompt[1] + args.response[1]} tokens)")
    if args.steps < 1 or args.memory_steps < 1:
        p.error("--steps and --memory-steps must be at least 1")
    args.trace_dir = os.path.join(os.path.dirname(os.path.abspath(args.out)), "traces")
    from benchmarks.harness import hf_config

    args.hf_cfg = hf_config("tiny_cpu.yaml" if args.tiny else args.config, args.layers)
    if args.layers != args.hf_cfg["num_hidden_layers"]:
        args.layers = args.hf_cfg["num_hidden_layers"]
    from mcore_rl.config import sections as C
    from mcore_rl.config import checks as config_checks

    try:  # every run's config, checked before any process starts
        for n in names:
            run_config(args, n)
    except C.ConfigError as e:
        p.error(str(e))
    return args


def _spawned(target, nprocs: int, extra: tuple, count: int, on_result=None) -> list:
    """Start `nprocs` processes of `target` and collect `count` results, each passed to on_result as
    it arrives (raising if a process dies first)."""
    from benchmarks.harness import shutdown, wait_for

    results = torch.multiprocessing.get_context("spawn").Queue()
    ctx = torch.multiprocessing.start_processes(target, args=(*extra, results), nprocs=nprocs, join=False,
                                                start_method="spawn")
    try:
        got = []
        for _ in range(count):
            got.append(wait_for(results, ctx.processes, target.__name__))
            if on_result:
                on_result(*got[-1])
        ctx.join()
        return got
    finally:
        shutdown(ctx.processes, 30)


def run(args) -> dict:
    from benchmarks.harness import MATMUL_PEAK
    from mcore_rl.parallel.groups import free_port

    report = dict(device="cpu" if args.cpu else torch.cuda.get_device_name(), torch=torch.__version__,
                  gpus=args.gpus, ep=args.gpus, layers=args.layers, hf_cfg=args.hf_cfg, budget=args.budget,
                  prompt=args.prompt, response=args.response, samples_per_rank=samples_per_rank(args),
                  samples_per_rank_memory_runs=samples_per_rank(args, True),
                  command="python benchmarks/actor_bench.py " + " ".join(sys.argv[1:]), runs={})
    if args.checks:
        report["checks"] = _spawned(checks_worker, 1, (args.hf_cfg, free_port()), 1)[0]
    peak = report.get("checks", {}).get("matmul_peak_tflops", 0) * 1e12 or None
    with tempfile.TemporaryDirectory() as hf_dir:
        with open(os.path.join(hf_dir, "config.json"), "w") as f:
            json.dump(args.hf_cfg, f)
        for name in args.names:
            skip, names, per_run = RUNS[name][1], [name], {}

            def collect(rank, name, res):
                if "plan_inputs" in res:
                    res["planner"] = planner(args.hf_cfg, res["plan_inputs"])
                per_run.setdefault(name, {})[rank] = res
                if len(per_run[name]) == args.gpus:  # a run is complete: keep what is known so far
                    ranks = [per_run[name][r] for r in range(args.gpus)]
                    report["runs"][name] = summarize(name, ranks, args, peak or MATMUL_PEAK, skip)
                    write_json(report, args.out)

            _spawned(worker, args.gpus, (args, names, skip, free_port(), hf_dir), args.gpus * len(names), collect)
    report["runs"] = {n: report["runs"][n] for n in args.names if n in report["runs"]}  # in the order asked for
    return report


def summarize(name: str, ranks: list[dict], args, peak: float, skip) -> dict:
    from benchmarks.harness import MATMUL_PEAK

    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return dict(overrides=_overrides_of(args, name), patches_skipped=list(skip), error=errors[0])
    r0 = ranks[0]
    median = r0["median_s"]
    tflops = sum(r["flops"] for r in ranks) / len(ranks) / median / 1e12
    out = dict(overrides=_overrides_of(args, name), patches_skipped=list(skip), median_s=median,
               times_s=r0["times_s"], build_s=r0["build_s"], tflops_per_gpu=tflops,
               pct_of_790=100 * tflops * 1e12 / MATMUL_PEAK, pct_of_measured_peak=100 * tflops * 1e12 / peak,
               tokens_per_gpu=sum(r["tokens"] for r in ranks) / len(ranks),
               tokens_per_s_per_gpu=sum(r["tokens"] for r in ranks) / len(ranks) / median,
               micro_batches=r0["micro_batches"], micro_tokens_max=max(r["micro_tokens_max"] for r in ranks),
               response_tokens_max=max(r["response_tokens_max"] for r in ranks), grad_norm=r0["grad_norm"],
               ranks=ranks)
    if "peak_gib" in r0:
        worst = max(ranks, key=lambda r: r["peak_gib"])
        out.update(peak_gib=worst["peak_gib"], planner_gib=worst["planner"]["peak_gib"],
                   planner_err_pct=100 * (worst["planner"]["peak_gib"] - worst["peak_gib"]) / worst["peak_gib"])
    if r0.get("profile"):
        out["profile"] = r0["profile"]
    return out


def print_tables(report: dict) -> None:
    print(f"\n{report['device']} x {report['gpus']} (EP {report['ep']}), {report['layers']} layers, "
          f"{report['samples_per_rank']} samples/GPU of {report['prompt'][0]}-{report['prompt'][1]} + "
          f"{report['response'][0]}-{report['response'][1]} tokens, micro-batches <= {report['budget']} tokens")
    checks = report.get("checks")
    if checks:
        att, head = checks["attention"], checks["head"]
        print(f"matmul peak {checks['matmul_peak_tflops']:.0f} TFLOP/s; varlen attention "
              + (f"{'ok' if att['ok'] else 'MISMATCH'} (logits err vs fp32: sdpa {att['sdpa_logits_err']:.2e}, "
                 f"varlen {att['varlen_logits_err']:.2e}; grads max {att['sdpa_grads_err_max']:.2e} / "
                 f"{att['varlen_grads_err_max']:.2e}; fwd+bwd {att['sdpa_attention_fwd_bwd_ms']:.2f} vs "
                 f"{att['varlen_attention_fwd_bwd_ms']:.2f} ms)" if att["available"] else "unavailable"))
        print("head bytes per T*V / n*V: " + ", ".join(
            f"{k} {head[k]['bytes_per_TV']:.2f} / {head[k]['bytes_per_nV']:.2f} ({head[k]['ms_half']:.1f} ms at n=T/2)"
            for k in ("plain", "fused")))
    head = (f"{'run':<16}{'step s':>8}{'tok/s/GPU':>11}{'TFLOP/s':>9}{'%790':>6}{'%meas':>7}{'mb':>4}{'T max':>7}"
            f"{'peak GiB':>10}{'plan GiB':>10}{'err %':>7}{'states':>8}{'fwd/bwd':>9}{'step':>7}")
    print(head)
    print("-" * len(head))
    for name, r in report["runs"].items():
        if "error" in r:
            print(f"{name:<16}FAILED: {r['error'][:120]}")
            continue
        mem = (f"{r['peak_gib']:>10.1f}{r['planner_gib']:>10.1f}{r['planner_err_pct']:>7.1f}"
               f"{r['ranks'][0]['states_gib']:>8.1f}{r['ranks'][0]['fwd_bwd_peak_gib']:>9.1f}"
               f"{r['ranks'][0]['step_peak_gib']:>7.1f}") if "peak_gib" in r else f"{'-':>10}{r['ranks'][0]['planner']['peak_gib']:>10.3f}"
        print(f"{name:<16}{r['median_s']:>8.3f}{r['tokens_per_s_per_gpu']:>11.0f}{r['tflops_per_gpu']:>9.1f}"
              f"{r['pct_of_790']:>6.1f}{r['pct_of_measured_peak']:>7.1f}{r['micro_batches']:>4}"
              f"{r['micro_tokens_max']:>7}{mem}")
    for name, r in report["runs"].items():
        if r.get("profile"):
            print(f"\nprofile of one update, {name} (rank 0):")
            print(breakdown_table(r["profile"]))


# ----------------------------------------------------------------------------- profile breakdown
# Where one training step's time goes, from a torch.profiler chrome trace.
#
# Three views of one step (the `step` user annotation's window):
# - phases: GPU time of the kernels launched inside each of the code's record_function ranges
#   (PHASES: packing, forward, loss head, optimizer) and inside autograd's backward nodes (backward,
#   with recompute; the DDP hooks' fp32 grad accumulation apart), on every stream;
# - kernels: GPU time by kernel kind (attention, grouped and dense GEMMs, NCCL collectives by type,
#   compiled Triton kernels, copies, the rest);
# - timeline: the step's wall time, the time some kernel ran (busy), idle gaps, and how much of the
#   NCCL time no compute kernel hid (exposed communication);
# plus host synchronisations: CUDA sync calls and blocking copies (count and host time), and the ops
# that read device values on the host (.item(), .tolist(), nonzero).
# On a CPU-only trace there are no kernels: phases then report host time.

# record_function ranges in mcore_rl (actor, pipeline, optim) -> phase
PHASES = {"actor/pack": "pack + unpack", "model/forward": "forward", "model/loss": "loss head",
          "optim/finalize_grads": "grad reduce (finalize)", "optim/step": "optimizer step"}
BACKWARD = "autograd::engine::evaluate_function"
ACCUMULATE = "AccumulateGrad"
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
HOST_READS = ("aten::_local_scalar_dense", "aten::nonzero")
NCCL_KINDS = (("allgather", "NCCL all-gather"), ("reducescatter", "NCCL reduce-scatter"),
              ("allreduce", "NCCL all-reduce"), ("alltoall", "NCCL all-to-all"),
              ("sendrecv", "NCCL send/recv"), ("broadcast", "NCCL broadcast"))


def kernel_kind(name: str, cat: str) -> str:
    n = name.lower()
    if cat == "gpu_memcpy":
        return "memcpy " + ("D2H" if "dtoh" in n else "H2D" if "htod" in n else "D2D")
    if cat == "gpu_memset":
        return "memset"
    if "nccl" in n:
        return next((label for key, label in NCCL_KINDS if key in n), "NCCL other")
    if any(k in n for k in ("flash", "fmha", "sdpa", "attention", "attn")):
        return "attention"
    if any(k in n for k in ("grouped", "groupproblemshape", "ptr_array")):
        return "grouped GEMM (experts)"
    if any(k in n for k in ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "sm90_", "sm80_")):
        return "dense GEMM"
    if n.startswith("triton") or "triton_" in n:
        return "compiled (Triton)"
    return "other kernels"


def _union(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _clip(intervals, lo, hi):
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _launch_phases(ranges, launches) -> dict:
    """correlation id -> the phase of the innermost labelled host range around its launch. Host
    ranges of one thread nest (they follow the call stack), so one sweep with a stack does it."""
    items: dict = {}
    for e in ranges:
        items.setdefault((e["pid"], e["tid"]), []).append((e["ts"], 0, e["ts"] + e["dur"], _phase_of(e["name"])))
    for corr, e in launches.items():
        items.setdefault((e["pid"], e["tid"]), []).append((e["ts"], 1, corr, None))
    out = {}
    for thread_items in items.values():
        stack: list[tuple[float, str]] = []  # (end, phase), innermost last
        for ts, is_launch, x, phase in sorted(thread_items, key=lambda t: (t[0], t[1])):
            while stack and stack[-1][0] < ts:
                stack.pop()
            if is_launch:
                out[x] = stack[-1][1] if stack else "other"
            else:
                stack.append((x, phase))
    return out


def _phase_of(name: str) -> str | None:
    if name in PHASES:
        return PHASES[name]
    if name.startswith(BACKWARD):
        return "backward: fp32 grad accumulation (DDP hooks)" if ACCUMULATE in name else "backward"
    return None


def breakdown(trace: dict, step: str = "bench/step") -> dict:
    """The breakdown of the `step` annotation's window in a chrome trace (torch.profiler's export)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    windows = [e for e in events if e.get("name") == step and e.get("cat") == "user_annotation"]
    if not windows:
        raise ValueError(f"no {step!r} range in the trace")
    lo, hi = windows[0]["ts"], windows[0]["ts"] + windows[0]["dur"]
    inside = [e for e in events if lo <= e["ts"] <= hi]
    gpu = [e for e in inside if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launches = {e["args"]["correlation"]: e for e in inside
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ranges = [e for e in inside if e.get("cat") in ("user_annotation", "cpu_op")
              and _phase_of(e["name"]) is not None]
    phase_of_launch = _launch_phases(ranges, launches)

    phases: dict[str, float] = {}
    kinds: dict[str, float] = {}
    for k in gpu:
        kind = kernel_kind(k["name"], k["cat"])
        kinds[kind] = kinds.get(kind, 0.0) + k["dur"]
        phase = phase_of_launch.get(k.get("args", {}).get("correlation"), "other")
        phases[phase] = phases.get(phase, 0.0) + k["dur"]
    host_phases: dict[str, float] = {}
    for e in ranges:  # host time (the CPU view; the only one on a CPU-only trace)
        label = _phase_of(e["name"])
        host_phases[label] = host_phases.get(label, 0.0) + e["dur"]

    busy = _union(_clip([(k["ts"], k["ts"] + k["dur"]) for k in gpu], lo, hi))
    compute = _union(_clip([(k["ts"], k["ts"] + k["dur"]) for k in gpu if "nccl" not in k["name"].lower()], lo, hi))
    nccl = _union(_clip([(k["ts"], k["ts"] + k["dur"]) for k in gpu if "nccl" in k["name"].lower()], lo, hi))
    wall = hi - lo
    syncs = {n: dict(count=0, host_ms=0.0) for n in SYNC_CALLS}
    for e in inside:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in syncs:
            syncs[e["name"]]["count"] += 1
            syncs[e["name"]]["host_ms"] += e["dur"] / 1e3
    reads = {n: sum(1 for e in inside if e.get("cat") == "cpu_op" and e["name"] == n) for n in HOST_READS}
    ms = lambda d: {k: v / 1e3 for k, v in sorted(d.items(), key=lambda kv: -kv[1])}  # noqa: E731
    return dict(
        wall_ms=wall / 1e3, gpu_busy_ms=_length(busy) / 1e3, gpu_idle_ms=(wall - _length(busy)) / 1e3,
        compute_busy_ms=_length(compute) / 1e3, nccl_ms=_length(nccl) / 1e3,
        nccl_exposed_ms=(_length(busy) - _length(compute)) / 1e3, kernels=len(gpu),
        phases_gpu_ms=ms(phases), phases_host_ms=ms(host_phases), kernel_kinds_ms=ms(kinds),
        host_syncs=syncs, host_sync_calls=sum(v["count"] for v in syncs.values()),
        host_sync_ms=sum(v["host_ms"] for v in syncs.values()), host_reads=reads)


def breakdown_from_file(path: str, step: str = "bench/step") -> dict:
    with open(path) as f:
        return breakdown(json.load(f), step)


def breakdown_table(b: dict) -> str:
    """A compact text breakdown_table of one breakdown."""
    lines = [f"step {b['wall_ms']:.1f} ms: GPU busy {b['gpu_busy_ms']:.1f}, idle {b['gpu_idle_ms']:.1f}, "
             f"NCCL {b['nccl_ms']:.1f} (exposed {b['nccl_exposed_ms']:.1f}), {b['kernels']} kernels; "
             f"host syncs {b['host_sync_calls']} ({b['host_sync_ms']:.1f} ms blocked), host reads "
             + ", ".join(f"{k.split('::')[1]} {v}" for k, v in b["host_reads"].items())]
    view = "phases_gpu_ms" if b["kernels"] else "phases_host_ms"
    lines.append(f"  {'phase (' + ('GPU' if b['kernels'] else 'host') + ' ms)':<48}" + "".join(
        f"\n    {k:<46}{v:>10.1f}" for k, v in b[view].items()))
    if b["kernels"]:
        lines.append(f"  {'kernel kind (GPU ms, all streams)':<48}" + "".join(
            f"\n    {k:<46}{v:>10.1f}" for k, v in b["kernel_kinds_ms"].items()))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- layer bench (`layer`)
def _layer_time(model, ids, steps: int) -> list[float]:
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


def _layer_profile(model, ids, top: int) -> list[dict]:
    """The `top` ops that take the most device time in one fwd+bwd."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts, record_shapes=True) as prof:
        _layer_time(model, ids, 1)
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    ops = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: getattr(e, key), reverse=True)[:top]
    return [dict(op=f"{e.key} {e.input_shapes}" if e.input_shapes else e.key, ms=getattr(e, key) / 1e3 / 3,
                 calls=e.count // 3) for e in ops]  # per iteration


def layer_worker(rank: int, args, port: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.gpus), LOCAL_RANK=str(rank))
    sys.path.insert(0, ROOT)
    from benchmarks.harness import MATMUL_PEAK, SPEC_PEAK, flops_per_token
    from benchmarks.harness import hf_config
    from mcore_rl.models.config import HFModel, transformer_config
    from mcore_rl.models.builder import build_model
    from mcore_rl.parallel.groups import Layout, init_distributed

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
        times = _layer_time(model, ids, args.steps)
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
            row["top_ops"] = _layer_profile(model, ids, args.profile)
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


def layer_main(argv=None) -> int:
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
    from mcore_rl.parallel.groups import free_port

    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.SimpleQueue()
    torch.multiprocessing.start_processes(layer_worker, args=(args, free_port(), results), nprocs=args.gpus,
                                          start_method="spawn")
    res = results.get()
    res["command"] = "python benchmarks/actor_bench.py layer " + " ".join(argv)
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["layer"]:  # the decoder layers alone (LAYER_DOC)
        return layer_main(argv[1:])
    args = parse(argv)
    report = run(args)
    print_tables(report)
    write_json(report, args.out)
    return 1 if any("error" in r for r in report["runs"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
