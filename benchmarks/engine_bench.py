"""The rollout engine: its speed and its log-prob gap, bf16 against FP8 (SGLang alone, no trainer, one
GPU), and where its forward pass parts from the trainer's, layer by layer.

`speed`: how much faster does an FP8 engine decode than a bf16 one at a real depth? (issue 28)
No weight files:

    python benchmarks/engine_bench.py speed --config configs/moonlight_2gpu.yaml --out fp8_speed.json --layers 27

Each engine starts on dummy weights (the config alone, so any depth fits the disk), bf16 then FP8
(the same config with the FP8 checkpoint's quantization_config), CUDA graphs on and the decode batch
capped as in the loop (`--batch` requests, cuda_graph_max_bs = max_running_requests = batch); each
request decodes `--new-tokens` tokens past its EOS. Reported: the median generation tokens/s of
three timed batches after a warm-up, and each FP8 engine's ratio to bf16.

Routing. SGLang's dummy load gives every weight the same small uniform values (seeded per tensor
by its size alone), router and RMSNorm weights included: the router's bias then outweighs its
logits and every token of every request picks the same top-k experts in every layer (6 of 64 at
Moonlight's widths), so a decode step reads a tenth of the expert weights FP8 halves. Before timing,
`spread_routing` gives each engine trained-like routing by update_weights_from_tensor: RMSNorm
weights 1, router weights N(0, 1/hidden), no bias. `--routing dummy` keeps the degenerate one
(earlier measurements ran on it: docs/performance.md).

`--profile-steps N` adds each engine's GPU kernel time per decode step (torch profiler through
SGLang's own start_profile, N decode steps of the batch at a 256-token context), summed by kernel:
where the step's time goes, and what FP8 changed.

Kernels: `--deep-gemm` (DeepGEMM's JIT for the dense FP8 GEMMs; the loop's `rollout.fp8_kernels`)
and `--fp8-engine-arg KEY=VALUE` (e.g. `moe_runner_backend=...`) set every FP8 engine; a kind
`fp8:KEY=VALUE[+KEY=VALUE]` is one more FP8 engine with those arguments on top, so one run compares
several against one bf16 engine: `--kinds bf16,fp8,fp8:moe_runner_backend=cutlass`. The JSON is
rewritten after each engine, so a run cut by a time limit keeps the engines it finished.

`logprob-gap`: how much of FP8 rollout's log-prob gap is the quantization itself, and how much
SGLang's FP8 kernels? (issue 28)

    python benchmarks/engine_bench.py logprob-gap --config configs/moonlight_2gpu.yaml --out fp8_check.json

One random model at the config's widths (transformers' init, seeded), written three ways: its bf16
weights; an FP8 DeepSeek-V3 checkpoint of them (every `*_proj` weight as e4m3 with a 128 x 128
`weight_scale_inv`, quantized by `mcore_rl.sync.fp8`, the sync's own code); and bf16 weights equal to
that checkpoint dequantized. SGLang's own loader reads each into an engine, one after the other. The
bf16 engine samples responses; every engine then scores the same prompt + response tokens
(teacher-forced input log-probs). Mean |delta log-prob| over the response tokens, pairwise:
- fp8 vs bf16: all of FP8 rollout's gap (what the loop's `rollout/logp_diff_abs_mean` adds);
- dequantized vs bf16: the weights' rounding alone, in bf16 kernels;
- fp8 vs dequantized: the same weights, FP8 kernels (activations quantized per 128-group) against bf16;
- fp8 synced vs fp8: an FP8 engine started on dummy weights and given the checkpoint's tensors by
  update_weights_from_tensor (the loop's path) against SGLang's loader of the same files: 0 if the
  engine's post-load steps (MLA's w_kc/w_vc from kv_b_proj, the FP8 layers' own) follow an update.
Prints a table; writes JSON.

`hidden-gap`: where the engine's and the trainer's forward passes part, layer by layer, on the same weights and
the same tokens (issue 45, item 5: the loop's log-prob gap at 27 layers).

    python benchmarks/engine_bench.py hidden-gap --config configs/moonlight_4gpu.yaml --out gap.json [--tokens 256]
        [--replay] [key=value ...]

1. the trainer's model as the loop's trainer starts it (megatron-core, one process, TP=EP=PP=1, its seeded
   init at trainer.seed; or model.hf_path's weights), on the first GPU or the CPU, exported to HF with
   the converter (the weights the loop's first sync hands the engines; model.hf_path: those files);
2. one SGLang engine (rollout.tp_size / ep_size, on the next GPUs, or SGLang's CPU engine) loads that
   export with its own loader, in a process of its own;
3. both run one sequence of `--tokens` random tokens (one prefill each). Compared, per decoder layer:
   the residual stream after it (SGLang's layers return (hidden, residual), whose sum it is; megatron's
   layers return it), as ||engine - trainer|| / ||trainer||, the cosine and the largest difference; for
   MoE layers the share of tokens both sent to the same top-k experts; at the end the log-prob gap of
   every token after the first (mean and max |engine - trainer|, the loop's rollout/logp_diff_abs_mean).
   With --replay the trainer's routers take the engine's experts (R3, actor.routing_replay).
   --megatron-elementwise: once more (with R3 where --replay is given) with RoPE and SwiGLU as megatron-core
   computes them without TE, each step rounded to bf16 (mcore_rl computes both in fp32 and rounds once, as
   the engine's kernels do): an A/B of that change against the same engine capture.
Prints the table and the layers where the relative gap grows most and where routing first differs;
writes JSON. At the tiny size on CPU (configs/tiny_cpu.yaml, fp32) it runs in a few minutes.

`precision`: how far from exact is each side's bf16 forward? (issue 45, item 5) The trainer's model as hidden-gap
builds it and its HF export, against transformers' model of that export in fp64 (eager attention and experts): per
decoder layer the attention's, the MLP's and the residual stream's output as ||x - ref|| / ||ref||, and the mean
|log-prob difference|, for transformers in fp32 and in the config's dtype (its own routing), the trainer (the
reference's experts, R3-style) and the trainer with megatron's bf16 RoPE/SwiGLU. A few layers at real widths on CPU:

    python benchmarks/engine_bench.py precision --config CONFIG --out precision.json [--tokens 256] [key=value ...]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import config_only_model, run_command, table, timed_calls, write_json  # noqa: E402

# ----------------------------------------------------------------------------- log-prob gap (`logprob-gap`)
FP8_NAMES = ("_proj.weight", "_proj_with_mqa.weight")  # what DeepSeek-V3's FP8 checkpoints quantize


def write_models(hf_config: dict, work: str, seed: int) -> dict[str, str]:
    """{"bf16", "fp8", "dequantized"}: model directories SGLang can load."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from mcore_rl.rollout.model_files import engine_model_dir
    from mcore_rl.sync import fp8

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    with torch.device(dev):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config),
                                                              dtype=torch.bfloat16)
    raw = {k: os.path.join(work, "raw_" + k) for k in ("bf16", "fp8", "dequantized")}
    model.save_pretrained(raw["bf16"])
    del model
    for k in ("fp8", "dequantized"):
        os.makedirs(raw[k])
    for i, f in enumerate(sorted(glob.glob(os.path.join(raw["bf16"], "*.safetensors")))):
        q8, deq = {}, {}
        for name, t in load_file(f).items():
            if name.endswith(FP8_NAMES) and t.dim() == 2:
                q, s = fp8.quantize(t.to(dev))
                q8[name], q8[fp8.scale_name(name)] = q.cpu(), s.cpu()
                deq[name] = fp8.dequantize(q, s, dtype=t.dtype).cpu()
            else:
                q8[name] = deq[name] = t
        save_file(q8, os.path.join(raw["fp8"], f"model-{i:05d}.safetensors"))
        save_file(deq, os.path.join(raw["dequantized"], f"model-{i:05d}.safetensors"))
    for k in ("fp8", "dequantized"):
        for side in ("config.json", "generation_config.json"):
            if os.path.exists(os.path.join(raw["bf16"], side)):
                os.link(os.path.join(raw["bf16"], side), os.path.join(raw[k], side))
    eos = [hf_config.get("eos_token_id") or 1]
    return {k: engine_model_dir(d, os.path.join(work, k), eos,
                                quantization_config=fp8.QUANTIZATION_CONFIG if k == "fp8" else None)
            for k, d in raw.items()}


def engine(model_dir: str, attention_backend: str, **extra):
    import sglang
    import torch

    from mcore_rl.rollout.sglang import GPU_DEFAULTS, adapt_args, server_arg_names

    args = dict(model_path=model_dir, skip_tokenizer_init=True, trust_remote_code=False, dtype="bfloat16",
                attention_backend=attention_backend, disable_cuda_graph=True, mem_fraction_static=0.5,
                disable_shared_experts_fusion=True, random_seed=1, log_level="error",
                # the loop's own defaults: without them a TP > 1 engine sat in flashinfer's all-reduce JIT
                # for the whole of a 5-minute call (4 x H200, TP 4 / EP 4, 2026-11-28)
                **(GPU_DEFAULTS if torch.cuda.is_available() else {}))
    return sglang.Engine(**adapt_args({**args, **extra}, server_arg_names()))


def random_prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` token ids drawn uniformly from [100, vocab_size), seeded."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(count)]


def update_from_files(eng, model_dir: str, bucket_bytes: int = 512 << 20) -> None:
    """The loop's path into an FP8 engine: started on dummy weights, then every tensor (e4m3 weights
    and their scales) by update_weights_from_tensor, bucket by bucket, from GPU memory."""
    from safetensors.torch import load_file

    bucket, size = [], 0
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        for name, t in load_file(f, device="cuda").items():
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                eng.update_weights_from_tensor(bucket)
                bucket, size = [], 0
    if bucket:
        eng.update_weights_from_tensor(bucket)


def scores(eng, seqs: list[list[int]]) -> list[list[float]]:
    """Teacher-forced log-probs of tokens 1..n-1 of each sequence."""
    out = eng.generate(input_ids=seqs, sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                       return_logprob=True, logprob_start_len=0)
    got = [[e[0] for e in o["meta_info"]["input_token_logprobs"]] for o in out]
    return [lps[1:] if lps and lps[0] is None else lps for lps in got]  # token 0 has none


def logprob_gap_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="engine_bench.py logprob-gap", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=None, help="num_hidden_layers (default: the config's)")
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    os.environ["SGLANG_ENABLE_JIT_DEEPGEMM"] = "0"  # the loop's FP8 engines' default (rollout.fp8_kernels)
    from mcore_rl.config import sections as C
    from mcore_rl.config import checks as config_checks

    try:
        cfg = C.load_config(a.config, [f"model.hf_config.num_hidden_layers={a.layers}"] * bool(a.layers))
    except C.ConfigError as e:
        ap.error(str(e))
    hf_config = config_checks.hf_model_dims(cfg.model)
    backend = cfg.rollout.attention_backend or "triton"
    work = tempfile.mkdtemp(prefix="fp8_check_")
    t0 = time.perf_counter()
    dirs = write_models(hf_config, work, a.seed)
    prompts = random_prompts(hf_config["vocab_size"], a.seqs, a.prompt_len, a.seed)
    logps, seqs = {}, None
    for kind in ("bf16", "fp8", "dequantized", "fp8 synced"):
        eng = engine(dirs[kind.split()[0]], backend, **({"load_format": "dummy"} if kind == "fp8 synced" else {}))
        try:
            if kind == "fp8 synced":
                update_from_files(eng, dirs["fp8"])
            if seqs is None:  # responses sampled by the bf16 engine, as a rollout's are by its policy
                out = eng.generate(input_ids=prompts, sampling_params={
                    "max_new_tokens": a.new_tokens, "temperature": 1.0, "ignore_eos": True})
                seqs = [p + o["output_ids"] for p, o in zip(prompts, out)]
            logps[kind] = scores(eng, seqs)
        finally:
            eng.shutdown()
    resp = slice(a.prompt_len - 1, None)  # log-probs of the response tokens

    def gap(x: str, y: str) -> dict:
        d = [abs(u - v) for s, t in zip(logps[x], logps[y]) for u, v in zip(s[resp], t[resp])]
        return {"mean": statistics.fmean(d), "median": statistics.median(d), "max": max(d)}

    pairs = {"fp8 vs bf16": gap("fp8", "bf16"), "dequantized vs bf16": gap("dequantized", "bf16"),
             "fp8 vs dequantized": gap("fp8", "dequantized"), "fp8 synced vs fp8": gap("fp8 synced", "fp8")}
    mean_logp = statistics.fmean(v for s in logps["bf16"] for v in s[resp])
    write_json({"config": a.config, "hf_config": hf_config, "seqs": a.seqs, "new_tokens": a.new_tokens,
                "attention_backend": backend, "bf16_mean_response_logp": mean_logp, "gaps": pairs,
                "wall_s": round(time.perf_counter() - t0, 1)}, a.out)
    print(table(["pair", "mean |dlogp|", "median", "max"],
                [[k, v["mean"], v["median"], v["max"]] for k, v in pairs.items()], digits=4))
    print(f"mean response log-prob (bf16 engine): {mean_logp:.3f}")
    return 0


# ----------------------------------------------------------------------------- speed (`speed`)
PROFILE_CONTEXT = 256  # prompt tokens of the profiled batch: a mid-response KV length


def engine_arguments(items) -> dict:
    """["KEY=VALUE", ...] -> {KEY: VALUE parsed as YAML}."""
    args = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"{item!r} is not KEY=VALUE")
        args[key] = yaml.safe_load(value)
    return args


def parse_kind(kind: str) -> tuple[str, dict]:
    """"bf16" | "fp8", then optionally ":KEY=VALUE[+KEY=VALUE...]" -> (bf16 or fp8, that engine's own
    arguments), e.g. bf16:attention_backend=flashinfer or bf16:tp_size=4+ep_size=4. dp_attention=true
    stands for the loop's DP attention over the engine's tp_size ranks (rollout.dp_attention,
    `mcore_rl.rollout.sglang.dp_attention_args`)."""
    from mcore_rl.rollout.sglang import dp_attention_args

    base, _, rest = kind.partition(":")
    if base not in ("bf16", "fp8"):
        raise ValueError(f"kind {kind!r}: bf16 or fp8, optionally with :KEY=VALUE[+KEY=VALUE]")
    try:
        args = engine_arguments(filter(None, rest.split("+")))
    except ValueError as e:
        raise ValueError(f"kind {kind!r}: {e}") from None
    if args.pop("dp_attention", False):
        if args.get("tp_size", 1) < 2:
            raise ValueError(f"kind {kind!r}: dp_attention needs tp_size > 1")
        args.update(dp_attention_args(args["tp_size"]))
    return base, args


def routing_weights(hf_config: dict, seed: int = 0) -> list:
    """The tensors `spread_routing` sends: every RMSNorm weight 1, every router N(0, 1/hidden)
    (unit-RMS inputs give logits of unit spread, as a trained router's), no score-correction bias."""
    import torch

    kind = hf_config["model_type"]
    if kind not in ("deepseek_v2", "deepseek_v3", "qwen3_moe"):
        raise ValueError(f"spread routing knows deepseek_v2/v3 and qwen3_moe names, not {kind!r}")
    h, experts = hf_config["hidden_size"], hf_config.get("n_routed_experts") or hf_config["num_experts"]
    gen = torch.Generator().manual_seed(seed)
    ones = {"input_layernorm": h, "post_attention_layernorm": h}
    if kind == "qwen3_moe":
        head = hf_config.get("head_dim") or h // hf_config["num_attention_heads"]
        ones.update({"self_attn.q_norm": head, "self_attn.k_norm": head})
    else:
        ones["self_attn.kv_a_layernorm"] = hf_config["kv_lora_rank"]
        if hf_config.get("q_lora_rank"):
            ones["self_attn.q_a_layernorm"] = hf_config["q_lora_rank"]
    out = [("model.norm.weight", torch.ones(h))]
    dense = (range(hf_config.get("first_k_dense_replace", 0)) if kind != "qwen3_moe"
             else hf_config.get("mlp_only_layers") or ())
    for i in range(hf_config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(f"{p}{name}.weight", torch.ones(n)) for name, n in ones.items()]
        if i not in dense:
            out.append((f"{p}mlp.gate.weight", torch.randn(experts, h, generator=gen) * h ** -0.5))
            if hf_config.get("topk_method") == "noaux_tc":
                out.append((f"{p}mlp.gate.e_score_correction_bias", torch.zeros(experts)))
    return out


def spread_routing(eng, hf_config: dict, device: str) -> None:
    """Trained-like routing for an engine on dummy weights (see the module doc)."""
    import torch

    eng.update_weights_from_tensor([(n, t.to(device, torch.bfloat16 if "bias" not in n else torch.float32))
                                    for n, t in routing_weights(hf_config)])


def kernel_times(trace_dir: str, steps: int, top: int = 12) -> dict:
    """GPU time per decode step from the profiler's decode trace: in total and by kernel, the
    `top` largest by name (names cut at 90 characters)."""
    paths = glob.glob(os.path.join(trace_dir, "*DECODE*.trace.json.gz")) or glob.glob(
        os.path.join(trace_dir, "*.trace.json.gz"))
    if not paths:
        return {"error": f"no trace in {trace_dir}"}
    with gzip.open(max(paths, key=os.path.getmtime), "rt") as f:
        events = json.load(f)["traceEvents"]
    by_name = collections.Counter()
    for e in events:
        if e.get("cat") == "kernel":
            by_name[e["name"][:90]] += e.get("dur", 0)
    if not by_name:  # kernels inside CUDA graphs are not always traced
        return {"error": "the trace holds no kernel events"}
    return {"us_per_step": sum(by_name.values()) / steps,
            "top_us_per_step": {k: v / steps for k, v in by_name.most_common(top)}}


def profile_decode(eng, hf_config: dict, batch: int, steps: int, trace_dir: str, activities=("GPU",),
                   context: int = PROFILE_CONTEXT) -> dict:
    prompts = random_prompts(hf_config["vocab_size"], batch, context, seed=2)
    eng.start_profile(output_dir=trace_dir, num_steps=steps, activities=list(activities), profile_by_stage=True,
                      with_stack=False, record_shapes=False)
    eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": steps + 4, "temperature": 1.0,
                                                     "ignore_eos": True})
    time.sleep(2)  # the trace is written by the scheduler after the step that ends it
    return kernel_times(trace_dir, steps)


def speed(hf_config: dict, work: str, backend: str, batch: int, prompt_len: int, new_tokens: int,
          kinds=("bf16", "fp8"), fp8_args: dict | None = None, spread: bool = True, profile_steps: int = 0,
          done=None) -> dict:
    """{kind: {tokens_per_s (median), runs, start_s[, kernels]}} of each engine; `fp8_args`:
    engine arguments of every FP8 engine, a kind's own on top (`parse_kind`); `done(out)` after each."""
    import torch

    from mcore_rl.models.config import HFModel
    from mcore_rl.rollout.model_files import engine_model_dir
    from mcore_rl.sync.engine_layout import EngineLayout, fp8_quantization_config

    raw = config_only_model(hf_config, os.path.join(work, "config_only"))
    eos = [hf_config.get("eos_token_id") or 1]
    prompts = random_prompts(hf_config["vocab_size"], batch, prompt_len, seed=1)
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    for i, kind in enumerate(kinds):
        base, own = parse_kind(kind)
        extra = {**(fp8_args or {}), **own} if base == "fp8" else own
        dp = extra.get("dp_size", 1) if extra.get("enable_dp_attention") else 1  # attention-DP ranks
        # at this engine's layout, as the loop's engines: layers not whole FP8 blocks per rank stay bf16
        quantization = fp8_quantization_config(HFModel.from_dict(hf_config), EngineLayout(
            extra.get("tp_size", 1), extra.get("ep_size", 1), attn_dp_size=dp)) if base == "fp8" else None
        model_dir = engine_model_dir(raw, os.path.join(work, f"{base}{i}"), eos, quantization_config=quantization)
        attention = extra.pop("attention_backend", backend)  # a kind's own backend replaces the config's
        t0 = time.perf_counter()
        # under DP attention a rank decodes its share of the batch (SGLang divides max_running_requests)
        per_rank = -(-batch // dp)
        eng = engine(model_dir, attention, load_format="dummy", disable_cuda_graph=False, mem_fraction_static=0.8,
                     **{"cuda_graph_max_bs": per_rank, "max_running_requests": batch, **extra})
        start_s = time.perf_counter() - t0
        try:
            if spread:
                spread_routing(eng, hf_config, device)
            seconds = timed_calls(lambda: eng.generate(input_ids=prompts, sampling_params=params), iters=3)
            rates = [batch * new_tokens / s for s in seconds]
            out[kind] = {"tokens_per_s": statistics.median(rates), "runs": rates, "start_s": round(start_s, 1)}
            if profile_steps:
                out[kind]["kernels"] = profile_decode(eng, hf_config, batch, profile_steps,  # at the run's KV length
                                                      os.path.join(work, f"trace{i}"),
                                                      context=max(PROFILE_CONTEXT, prompt_len))
            print(f"{kind}: started in {start_s:.0f} s, {out[kind]['tokens_per_s']:.0f} tokens/s", flush=True)
        finally:
            eng.shutdown()
        if done is not None:
            done(out)
    return out


def kernel_table(rates: dict) -> str:
    """Each engine's GPU time per decode step by kernel, the largest first (µs)."""
    rows = []
    for kind, r in rates.items():
        k = r.get("kernels") or {}
        if "error" in k:
            rows.append([kind, k["error"], None])
            continue
        if k:
            rows.append([kind, "all kernels", k["us_per_step"]])
            rows += [["", name, us] for name, us in k["top_us_per_step"].items()]
    return table(["engine", "kernel", "us a decode step"], rows, digits=1)


def speed_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="engine_bench.py speed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=None, help="num_hidden_layers (default: the config's)")
    ap.add_argument("--batch", type=int, default=128, help="requests decoded together")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--routing", choices=("spread", "dummy"), default="spread",
                    help="trained-like routing (default) or the dummy load's, every token on the same experts")
    ap.add_argument("--profile-steps", type=int, default=0, help="kernel time of this many decode steps (0: none)")
    ap.add_argument("--moe-config-dir", help="SGLang's fused-MoE tiles from scripts/tune_fused_moe.py "
                    "(rollout.moe_config_dir); default: the ones it ships")
    ap.add_argument("--kinds", default="bf16,fp8", help=(
        "which engines, in order: bf16, fp8, or either with :KEY=VALUE[+KEY=VALUE] (an engine with those "
        "arguments: bf16:attention_backend=flashinfer, bf16:tp_size=4+ep_size=4; dp_attention=true: the loop's "
        "DP attention over tp_size ranks, bf16:tp_size=4+ep_size=4+dp_attention=true)"))
    ap.add_argument("--fp8-engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an SGLang engine argument of every FP8 engine, e.g. moe_runner_backend=triton "
                    "(repeatable; values parsed as YAML)")
    ap.add_argument("--deep-gemm", action="store_true", help=(
        "DeepGEMM's JIT on (rollout.fp8_kernels=deep_gemm); off, FP8's dense GEMMs run on triton"))
    a = ap.parse_args(argv)
    kinds = tuple(k for k in a.kinds.split(",") if k)
    try:
        if not kinds or len(set(kinds)) < len(kinds):
            raise ValueError("name each engine once")
        for kind in kinds:
            parse_kind(kind)
    except ValueError as e:
        ap.error(f"--kinds {a.kinds!r}: {e}")
    try:
        fp8_args = engine_arguments(a.fp8_engine_arg)
    except ValueError as e:
        ap.error(f"--fp8-engine-arg: {e}")
    os.environ["SGLANG_ENABLE_JIT_DEEPGEMM"] = "1" if a.deep_gemm else "0"
    # SGLang's pre-compile covers every batch size up to 16k tokens ("10-20 mins", its own log);
    # compiled on first use instead, within the engine's start (start_s) and the warm-up call
    os.environ["SGLANG_JIT_DEEPGEMM_PRECOMPILE"] = "0"
    from mcore_rl.config import sections as C
    from mcore_rl.config import checks as config_checks

    # the tile folder goes through the config: a folder without tiles is refused as in the loop
    try:
        cfg = C.load_config(a.config, [f"model.hf_config.num_hidden_layers={a.layers}"] * bool(a.layers)
                            + [f"rollout.moe_config_dir={a.moe_config_dir}"] * bool(a.moe_config_dir))
        hf_config = config_checks.hf_model_dims(cfg.model)
        if a.routing == "spread":
            routing_weights({**hf_config, "num_hidden_layers": 0})  # an unknown family, before any engine
    except (C.ConfigError, ValueError) as e:
        ap.error(str(e))
    if a.moe_config_dir:  # the engines' schedulers inherit it
        os.environ["SGLANG_MOE_CONFIG_DIR"] = os.path.abspath(a.moe_config_dir)
    backend = cfg.rollout.attention_backend or "triton"
    work = tempfile.mkdtemp(prefix="fp8_speed_")
    t0 = time.perf_counter()

    def report(rates: dict) -> dict:  # each FP8 engine against bf16, where both ran
        bf16 = rates.get("bf16", {}).get("tokens_per_s")
        ratios = {k: v["tokens_per_s"] / bf16 for k, v in rates.items() if bf16 and k != "bf16"}
        write_json({"config": a.config, "hf_config": hf_config, "batch": a.batch, "prompt_len": a.prompt_len,
                    "new_tokens": a.new_tokens, "routing": a.routing, "attention_backend": backend,
                    "moe_config_dir": a.moe_config_dir, "fp8_engine_args": fp8_args, "deep_gemm": a.deep_gemm,
                    "kinds": list(kinds), "speed": rates, "fp8_over_bf16": ratios.get("fp8"), "over_bf16": ratios,
                    "complete": len(rates) == len(kinds), "wall_s": round(time.perf_counter() - t0, 1)}, a.out)
        return ratios

    rates = speed(hf_config, work, backend, a.batch, a.prompt_len, a.new_tokens, kinds, fp8_args,
                  spread=a.routing == "spread", profile_steps=a.profile_steps, done=report)
    ratios = report(rates)
    print(table(["engine", "tokens/s (median of 3)", "/ bf16"],
                [[k, v["tokens_per_s"], f"{ratios[k]:.3f}x" if k in ratios else "-"] for k, v in rates.items()],
                digits=0))
    if a.profile_steps:
        print(kernel_table(rates))
    print(f"{hf_config['num_hidden_layers']} layers, batch {a.batch}, {a.routing} routing")
    return 0


# ----------------------------------------------------------------------------- layer by layer (`hidden-gap`)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def trainer_model(cfg, gpu: bool):
    """The policy as the trainer builds it (seeded init, or model.hf_path's weights read in), one process."""
    from mcore_rl.metrics import console

    console.quiet_fallback_warnings()
    print(console.accelerators_line(), flush=True)
    from mcore_rl.models.config import HFModel, transformer_config
    from mcore_rl.models.builder import build_model
    from mcore_rl.parallel.groups import Layout, free_port, init_distributed

    if gpu:
        torch.cuda.set_device(0)
    init_distributed(Layout(), rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}",
                     seed=cfg.trainer.seed)
    from mcore_rl.config import sections as C
    from mcore_rl.config import checks as config_checks

    hf = HFModel.from_dict(config_checks.hf_model_dims(cfg.model))
    model = build_model(hf, transformer_config(hf, dtype=DTYPES[cfg.model.dtype])).eval()
    return hf, model


def export(cfg, model, work: str) -> str:
    """An HF directory of `model`'s weights (the converter's export), or model.hf_path loaded into it."""
    from mcore_rl.convert.hf_mcore import mcore_to_hf
    from mcore_rl.checkpoint.model import save_model

    if cfg.model.hf_path:
        from mcore_rl.checkpoint.hf_init import load_hf
        from mcore_rl.models.config import HFModel

        load_hf(model, cfg.model.hf_path, HFModel.from_dir(cfg.model.hf_path))  # as the loop's trainer starts
        return cfg.model.hf_path
    import transformers

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    side = os.path.join(work, "hf_config")
    hcfg = transformers.AutoConfig.for_model(**cfg.model.hf_config)
    hcfg.architectures = hcfg.architectures or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hcfg.model_type]]  # engines read it
    hcfg.save_pretrained(side)
    save_model(model, os.path.join(work, "mcore"), side_files_from=side)
    return mcore_to_hf(os.path.join(work, "mcore"), os.path.join(work, "hf"), dtype=cfg.model.dtype)


def export_checkpoint(model, step_dir: str, out: str) -> dict:
    """The trainer's model from a run's checkpoint, and its HF export by the converter's command line (what a
    user runs), with the export's seconds and the converter process's peak host memory."""
    import resource

    from mcore_rl.checkpoint.model import load_model

    ckpt = os.path.join(step_dir, "model")
    load_model(model, ckpt)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mcore_rl.convert", "mcore-to-hf", "--ckpt", ckpt, "--out", out], check=True, cwd=REPO)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest child so far: the converter
    size = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out) if n.endswith(".safetensors"))
    print(f"export: {size / 2**30:.2f} GiB of safetensors in {seconds:.1f} s, converter peak RSS {peak / 2**30:.2f} GiB",
          flush=True)
    return {"seconds": round(seconds, 1), "gib": round(size / 2**30, 2), "peak_rss_gib": round(peak / 2**30, 2)}


def engine_side(config: str, overrides: list[str], model_dir: str, tokens: list[int], out: str) -> None:
    """In a process of its own (SGLang kills the process that made an engine when it fails): one engine,
    each layer's output in the prefill of `tokens`, the log-prob of each token, the routed experts."""
    from mcore_rl.config import sections as C
    from mcore_rl.config.checks import attention_dp
    from mcore_rl.rollout import jit_cache
    from mcore_rl.rollout import sglang as S
    from mcore_rl.sync.engine_layout import EngineLayout

    cfg = C.load_config(config, overrides)
    gpu = cfg.cluster.device == "gpu"
    tp, ep = cfg.rollout.tp_size, cfg.rollout.ep_size
    layout = EngineLayout(tp, ep, 1, tp, attention_dp(cfg))
    args = S.engine_args(cfg, model_dir, layout, 0, None, 0.6 if gpu else cfg.rollout.mem_fraction_static)
    args.update(enable_memory_saver=False)  # alone on its GPUs: nothing to release for
    args.pop("max_running_requests", None)
    if gpu and "disable_prefill_cuda_graph" in S.server_arg_names():  # 0.5.17+ replays prefills in CUDA graphs
        args["disable_prefill_cuda_graph"] = True  # by default: the layer hooks need the Python forward
    # the last tp GPUs: beside the trainer's (GPU 0) where there are more than tp, else sharing it
    gpus = ",".join(str(g) for g in range(torch.cuda.device_count() - tp, torch.cuda.device_count())) if gpu else None
    env = S.engine_env(cfg, layout)
    if cfg.cluster.jit_cache_dir:
        env[jit_cache.DIR_ENV] = cfg.cluster.jit_cache_dir
    server = S.SGLangServer(cfg.cluster.device, gpus, env)
    server.start(args)
    try:
        path = os.path.join(os.path.dirname(out), "engine_hidden", "h")
        server.capture_hidden(path, len(tokens))
        extra = {"return_routed_experts": True} if server.route_shape else {}
        got = server.engine.generate(input_ids=[tokens], sampling_params={"max_new_tokens": 1, "temperature": 1.0},
                                     return_logprob=True, logprob_start_len=0, **extra)[0]
        meta = got["meta_info"]
        routes = None
        if server.route_shape:
            routes = torch.from_numpy(S.decode_routes(meta, len(tokens), *server.route_shape, "engine"))
        logprobs = [lp[0] for lp in meta["input_token_logprobs"][1:]]  # the first token has none
        if not os.path.exists(f"{path}.tp0.pt"):
            raise RuntimeError("the engine kept no layer outputs: its prefill ran no forward of "
                               f"{len(tokens)} tokens in Python (a CUDA graph, a chunked prefill?)")
        hidden = torch.load(f"{path}.tp0.pt", weights_only=True)  # rank 0's: the stream is whole on every rank
        torch.save({"hidden": hidden, "logprobs": torch.tensor(logprobs, dtype=torch.float64), "routes": routes,
                    "version": server.version}, out)
    finally:
        server.shutdown()


def trainer_side(hf, model, tokens: list[int], device, routes=None) -> dict:
    """Each decoder layer's output, the log-prob of each token after the first, and (MoE) the experts each
    layer's router took; `routes` [tokens, layers, top-k]: the routers take those instead (R3)."""
    from mcore_rl.models import replay
    from mcore_rl.models.forward import full_logits
    from mcore_rl.models.routed_experts import ExpertLayout

    kept = []

    def keep(module, args, output):
        kept.append((output[0] if isinstance(output, tuple) else output)[:, 0].detach().float().cpu())

    hooks = [layer.register_forward_hook(keep) for layer in model.decoder.layers]
    layout = ExpertLayout.of(hf)
    replays = replay.install(model, layout.moe_layers) if layout else []
    replay.start(replays, replay=routes is not None, record=True)
    if routes is not None:
        replay.set_targets(replays, routes[:, list(layout.moe_layers)].to(device), 0, 1)
    ids = torch.tensor([tokens], device=device)
    with torch.no_grad():
        logits = full_logits(model, ids)[0].float()
    for h in hooks:
        h.remove()
    logprobs = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0].double().cpu()
    taken = {layout.moe_layers[r.column]: r.taken[0].long().cpu() for r in replays} if layout else {}
    return {"hidden": torch.stack(kept), "logprobs": logprobs, "routes": taken}


@contextlib.contextmanager
def megatron_elementwise(model):
    """Within: `model`'s RoPE and SwiGLU as megatron-core computes them without TE, in bf16 (the rope_fp32
    patch undone; every MLP back on megatron's own GLU, which it applies where use_te_activation_func is off)."""
    from megatron.core.models.common.embeddings import rope_utils

    rope = rope_utils._apply_rotary_pos_emb_bshd
    configs = {id(m.config): m.config for m in model.modules() if getattr(m, "config", None) is not None}
    saved = [(c, c.use_te_activation_func) for c in configs.values()]
    rope_utils._apply_rotary_pos_emb_bshd = getattr(rope, "__wrapped__", rope)
    for c, _ in saved:
        c.use_te_activation_func = False
    try:
        yield
    finally:
        rope_utils._apply_rotary_pos_emb_bshd = rope
        for c, v in saved:
            c.use_te_activation_func = v


def compare(trainer: dict, engine: dict) -> tuple[list[dict], dict]:
    rows = []
    for i, (t, e) in enumerate(zip(trainer["hidden"], engine["hidden"])):
        d = e.double() - t.double()
        row = {"layer": i, "rel": (d.norm() / t.double().norm()).item(),
               "cos": torch.nn.functional.cosine_similarity(e.double().flatten(), t.double().flatten(), 0).item(),
               "max_abs": d.abs().max().item(), "route_agreement": None}
        if i in trainer["routes"] and engine["routes"] is not None:
            same = (trainer["routes"][i].sort(-1).values == engine["routes"][:, i].long().sort(-1).values).all(-1)
            row["route_agreement"] = same.double().mean().item()
        rows.append(row)
    gap = (engine["logprobs"] - trainer["logprobs"]).abs()
    return rows, {"logp_diff_abs_mean": gap.mean().item(), "logp_diff_abs_max": gap.max().item()}


def findings(rows: list[dict]) -> dict:
    """The layers where the relative gap grows most (ratio to the layer before) and where routing first differs."""
    growth = [(r["rel"] / max(p["rel"], 1e-30), r["layer"]) for p, r in zip(rows, rows[1:])]
    split = next((r["layer"] for r in rows if r["route_agreement"] is not None and r["route_agreement"] < 1), None)
    return {"largest_growth": [{"layer": k, "times_previous": round(g, 2)} for g, k in sorted(growth, reverse=True)[:3]],
            "first_layer_routing_differs": split}


def hidden_gap_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="engine_bench.py hidden-gap", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=256, help="length of the random token sequence")
    ap.add_argument("--replay", action="store_true", help="also the trainer with the engine's experts (R3)")
    ap.add_argument("--megatron-elementwise", action="store_true",
                    help="also the trainer with megatron's bf16 RoPE and SwiGLU (an A/B of mcore_rl's fp32 ones)")
    ap.add_argument("--checkpoint", help="a run's checkpoint (checkpoints/step_N): the trainer loads its model, and the "
                                         "engine loads the export that `python -m mcore_rl.convert mcore-to-hf` makes of it")
    ap.add_argument("--engine-side", nargs=3, metavar=("MODEL_DIR", "TOKENS_JSON", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    if a.engine_side:
        model_dir, tokens_json, out = a.engine_side
        engine_side(a.config, a.overrides, model_dir, json.load(open(tokens_json)), out)
        return 0
    from mcore_rl.config import sections as C
    from mcore_rl.rollout.sglang import engine_model_dir

    cfg = C.load_config(a.config, a.overrides)
    gpu = cfg.cluster.device == "gpu"
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    work = tempfile.mkdtemp(prefix="hidden_gap_")
    hf, model = trainer_model(cfg, gpu)
    exported = {}
    if a.checkpoint:
        model_dir = os.path.join(work, "hf")
        exported = export_checkpoint(model, a.checkpoint, model_dir)
    else:
        model_dir = export(cfg, model, work)
    engine_dir = engine_model_dir(model_dir, os.path.join(work, "engine_hf"), [], cfg.cluster.device)
    n = min(a.tokens, (hf.get("max_position_embeddings") or 2 * a.tokens) // 2)  # well inside the engine's context
    tokens = torch.randint(0, hf.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    with open(os.path.join(work, "tokens.json"), "w") as f:
        json.dump(tokens, f)
    engine_out = os.path.join(work, "engine.pt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    subprocess.run([sys.executable, __file__, "hidden-gap", "--config", a.config, "--out", a.out, "--engine-side", engine_dir,
                    os.path.join(work, "tokens.json"), engine_out, *a.overrides], check=True, env=env, cwd=REPO)
    engine = torch.load(engine_out, weights_only=True)
    runs = {"live": trainer_side(hf, model, tokens, device)}
    routes = engine["routes"] if a.replay else None
    if routes is not None:
        runs["replay"] = trainer_side(hf, model, tokens, device, routes=routes)
    if a.megatron_elementwise:
        with megatron_elementwise(model):
            runs[("replay" if routes is not None else "live") + "_megatron_elementwise"] = trainer_side(
                hf, model, tokens, device, routes=routes)
    result = {"config": a.config, "overrides": a.overrides, "tokens": n, "layers": hf.num_layers,
              "engine": f"SGLang {engine['version']} TP={cfg.rollout.tp_size} EP={cfg.rollout.ep_size}",
              "device": torch.cuda.get_device_name() if gpu else "cpu", "dtype": cfg.model.dtype,
              "checkpoint": a.checkpoint, "export": exported or None}
    for name, trainer in runs.items():
        rows, logp = compare(trainer, engine)
        result[name] = {"layers": rows, **logp, **findings(rows)}
        print(f"\n{name} routing: log-prob gap mean {logp['logp_diff_abs_mean']:.4g}, max {logp['logp_diff_abs_max']:.4g}")
        print(table(["layer", "rel. gap", "cosine", "max |diff|", "same experts"],
                    [[r["layer"], r["rel"], r["cos"], r["max_abs"], r["route_agreement"]] for r in rows], digits=4))
        print("gap grows most after layers", result[name]["largest_growth"], "; routing first differs at layer",
              result[name]["first_layer_routing_differs"])
    write_json(result, a.out)
    return 0


# ----------------------------------------------------------------------------- against fp64 (`precision`)
def _keep_outputs(kept: dict, named_modules, seq_first: bool) -> list:
    """Forward hooks keeping each module's (first) output as fp64 [tokens, hidden] under its name."""
    def hook(name):
        def keep(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            kept[name] = (out[:, 0] if seq_first else out[0]).detach().double().cpu()
        return keep
    return [m.register_forward_hook(hook(name)) for name, m in named_modules]


def transformers_points(model_dir: str, dtype, tokens: list[int]) -> tuple[dict, torch.Tensor]:
    """transformers' model of `model_dir` in `dtype` (eager attention and experts): each layer's attention, MLP and
    residual stream outputs and each token's log-prob, and the experts its routers chose [tokens, layers, top-k]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager",
                                                              experts_implementation="eager").eval()
    layers, kept, routes = model.model.layers, {}, {}
    named = [(f"{k}{i}", getattr(layer, attr)) for i, layer in enumerate(layers)
             for k, attr in (("attn", "self_attn"), ("mlp", "mlp"))] + [(f"out{i}", l) for i, l in enumerate(layers)]
    hooks = _keep_outputs(kept, named, seq_first=False)
    for i, layer in enumerate(layers):
        if hasattr(layer.mlp, "gate"):  # DeepSeek's router returns (logits, weights, indices)
            hooks.append(layer.mlp.gate.register_forward_hook(lambda m, a, o, i=i: routes.__setitem__(i, o[2])))
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    for h in hooks:
        h.remove()
    kept["logprobs"] = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    k = model.config.num_experts_per_tok
    taken = torch.zeros(len(tokens), len(layers), k, dtype=torch.long)
    for i, r in routes.items():
        taken[:, i] = r.reshape(len(tokens), k)
    return kept, taken


def trainer_points(hf, model, tokens: list[int], device, routes) -> dict:
    """The same points of the trainer's model, its routers taking `routes` (the reference's experts)."""
    kept = {}
    layers = model.decoder.layers
    hooks = _keep_outputs(kept, [(f"{k}{i}", getattr(layer, attr)) for i, layer in enumerate(layers)
                                 for k, attr in (("attn", "self_attention"), ("mlp", "mlp"))], seq_first=True)
    got = trainer_side(hf, model, tokens, device, routes=routes)
    for h in hooks:
        h.remove()
    kept.update({f"out{i}": h.double() for i, h in enumerate(got["hidden"])}, logprobs=got["logprobs"])
    return kept


def precision_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="engine_bench.py precision", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=256, help="length of the random token sequence")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    from mcore_rl.config import sections as C

    cfg = C.load_config(a.config, a.overrides)
    gpu = cfg.cluster.device == "gpu"
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    hf, model = trainer_model(cfg, gpu)
    model_dir = export(cfg, model, tempfile.mkdtemp(prefix="precision_"))
    tokens = torch.randint(0, hf.vocab_size, (a.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    ref, routes = transformers_points(model_dir, torch.float64, tokens)
    runs = {"transformers fp32": transformers_points(model_dir, torch.float32, tokens)[0],
            f"transformers {cfg.model.dtype}": transformers_points(model_dir, DTYPES[cfg.model.dtype], tokens)[0],
            f"trainer {cfg.model.dtype}": trainer_points(hf, model, tokens, device, routes)}
    with megatron_elementwise(model):
        runs[f"trainer {cfg.model.dtype}, megatron's RoPE/SwiGLU"] = trainer_points(hf, model, tokens, device, routes)
    points = [k for k in ref if k != "logprobs"]
    rel = {name: {k: ((r[k] - ref[k]).norm() / ref[k].norm()).item() for k in points} for name, r in runs.items()}
    logp = {name: (r["logprobs"] - ref["logprobs"]).abs().mean().item() for name, r in runs.items()}
    print(table(["point", *runs], [[k, *(rel[n][k] for n in runs)] for k in points]
                + [["log-prob |diff|", *(logp[n] for n in runs)]], digits=5))
    write_json({"config": a.config, "overrides": a.overrides, "tokens": a.tokens, "layers": hf.num_layers,
                "dtype": cfg.model.dtype, "reference": "transformers fp64 on the same weights",
                "relative_error": rel, "logp_abs_diff_mean": logp}, a.out)
    return 0


COMMANDS = {"speed": speed_main, "logprob-gap": logprob_gap_main, "hidden-gap": hidden_gap_main,
            "precision": precision_main}


def main(argv: list[str] | None = None) -> int:
    return run_command("engine_bench.py", COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
