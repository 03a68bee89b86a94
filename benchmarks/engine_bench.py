"""SGLang alone, no trainer, on one GPU: the rollout engine's speed and its log-prob gap, bf16 against FP8.

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
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

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

    from mcore_rl.rollout.sglang import adapt_args, server_arg_names

    args = dict(model_path=model_dir, skip_tokenizer_init=True, trust_remote_code=False, dtype="bfloat16",
                attention_backend=attention_backend, disable_cuda_graph=True, mem_fraction_static=0.5,
                disable_shared_experts_fusion=True, random_seed=1, log_level="error")
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
    from mcore_rl import config as C
    from mcore_rl import config_checks

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
    """"bf16" | "fp8" | "fp8:KEY=VALUE[+KEY=VALUE...]" -> (bf16 or fp8, that engine's own arguments)."""
    base, _, rest = kind.partition(":")
    if base not in ("bf16", "fp8") or (rest and base != "fp8"):
        raise ValueError(f"kind {kind!r}: bf16, fp8 or fp8:KEY=VALUE[+KEY=VALUE]")
    try:
        return base, engine_arguments(filter(None, rest.split("+")))
    except ValueError as e:
        raise ValueError(f"kind {kind!r}: {e}") from None


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


def profile_decode(eng, hf_config: dict, batch: int, steps: int, trace_dir: str, activities=("GPU",)) -> dict:
    prompts = random_prompts(hf_config["vocab_size"], batch, PROFILE_CONTEXT, seed=2)
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

    from mcore_rl.rollout.model_files import engine_model_dir
    from mcore_rl.sync import fp8

    raw = config_only_model(hf_config, os.path.join(work, "config_only"))
    eos = [hf_config.get("eos_token_id") or 1]
    prompts = random_prompts(hf_config["vocab_size"], batch, prompt_len, seed=1)
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    for i, kind in enumerate(kinds):
        base, own = parse_kind(kind)
        model_dir = engine_model_dir(raw, os.path.join(work, f"{base}{i}"), eos,
                                     quantization_config=fp8.QUANTIZATION_CONFIG if base == "fp8" else None)
        extra = {**(fp8_args or {}), **own} if base == "fp8" else {}
        t0 = time.perf_counter()
        eng = engine(model_dir, backend, load_format="dummy", disable_cuda_graph=False, mem_fraction_static=0.8,
                     cuda_graph_max_bs=batch, max_running_requests=batch, **extra)
        start_s = time.perf_counter() - t0
        try:
            if spread:
                spread_routing(eng, hf_config, device)
            seconds = timed_calls(lambda: eng.generate(input_ids=prompts, sampling_params=params), iters=3)
            rates = [batch * new_tokens / s for s in seconds]
            out[kind] = {"tokens_per_s": statistics.median(rates), "runs": rates, "start_s": round(start_s, 1)}
            if profile_steps:
                out[kind]["kernels"] = profile_decode(eng, hf_config, batch, profile_steps,
                                                      os.path.join(work, f"trace{i}"))
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
        "which engines, in order: bf16, fp8, fp8:KEY=VALUE[+KEY=VALUE] (an FP8 engine with those arguments)"))
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
    from mcore_rl import config as C
    from mcore_rl import config_checks

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


COMMANDS = {"speed": speed_main, "logprob-gap": logprob_gap_main}


def main(argv: list[str] | None = None) -> int:
    return run_command("engine_bench.py", COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
