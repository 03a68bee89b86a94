"""How much faster does an FP8 engine decode than a bf16 one at a real depth? (issue 28) SGLang
alone, no trainer, on one GPU, no weight files:

    python benchmarks/fp8_speed.py --config configs/moonlight_2gpu.yaml --out fp8_speed.json --layers 27

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
(the ninth to eleventh passes of benchmarks/RESULTS.md measured that).

`--profile-steps N` adds each engine's GPU kernel time per decode step (torch profiler through
SGLang's own start_profile, N decode steps of the batch at a 256-token context), summed by kernel:
where the step's time goes, and what FP8 changed.

Kernels: `--deep-gemm` (DeepGEMM's JIT for the dense FP8 GEMMs; the loop's `rollout.fp8_kernels`)
and `--fp8-engine-arg KEY=VALUE` (e.g. `moe_runner_backend=...`) set every FP8 engine; a kind
`fp8:KEY=VALUE[+KEY=VALUE]` is one more FP8 engine with those arguments on top, so one run compares
several against one bf16 engine: `--kinds bf16,fp8,fp8:moe_runner_backend=cutlass`. The JSON is
rewritten after each engine, so a run cut by a time limit keeps the engines it finished.
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

from benchmarks.fp8_engine_check import engine, random_prompts  # noqa: E402
from benchmarks.harness import config_only_model, table, timed_calls, write_json  # noqa: E402

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=None, help="num_hidden_layers (default: the config's)")
    ap.add_argument("--batch", type=int, default=128, help="requests decoded together")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--routing", choices=("spread", "dummy"), default="spread",
                    help="trained-like routing (default) or the dummy load's, every token on the same experts")
    ap.add_argument("--profile-steps", type=int, default=0, help="kernel time of this many decode steps (0: none)")
    ap.add_argument("--moe-config-dir", help="SGLang's fused-MoE tiles from benchmarks/tune_fused_moe.py "
                    "(rollout.moe_config_dir); default: the ones it ships")
    ap.add_argument("--kinds", default="bf16,fp8", help=(
        "which engines, in order: bf16, fp8, fp8:KEY=VALUE[+KEY=VALUE] (an FP8 engine with those arguments)"))
    ap.add_argument("--fp8-engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an SGLang engine argument of every FP8 engine, e.g. moe_runner_backend=triton "
                    "(repeatable; values parsed as YAML)")
    ap.add_argument("--deep-gemm", action="store_true", help=(
        "DeepGEMM's JIT on (rollout.fp8_kernels=deep_gemm); off, FP8's dense GEMMs run on triton"))
    a = ap.parse_args()
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


if __name__ == "__main__":
    sys.exit(main())
