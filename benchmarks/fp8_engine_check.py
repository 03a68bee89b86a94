"""How much of FP8 rollout's log-prob gap is the quantization itself, and how much SGLang's FP8 kernels?
(issue 28) SGLang alone, no trainer, on one GPU:

    python benchmarks/fp8_engine_check.py --config configs/moonlight_2gpu.yaml --out fp8_check.json

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

Speed is `benchmarks/fp8_speed.py`.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import table, write_json  # noqa: E402

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=None, help="num_hidden_layers (default: the config's)")
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
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


if __name__ == "__main__":
    sys.exit(main())
