"""Tune SGLang's fused-MoE triton tiles for one model's routed experts on this GPU (issue 28).

SGLang picks a tile (BLOCK_SIZE_M/N/K, GROUP_SIZE_M, warps, stages) per batch size from a JSON file
named by the expert shape, the GPU and the dtype; 0.5.17 ships none for Moonlight's experts (E=64,
N=1408) on an H100, in either dtype, and falls back to one generic tile per dtype. This times a
grid of tiles on the model's shapes (the engine's rank: E / ep, N / (tp / ep)) with uniform random
routing, for bf16 and for block FP8 (our quantizer, DeepSeek's 128 x 128 blocks), and writes SGLang's
own files into DIR/configs/triton_<version>/, beside a copy of the ones it ships. An engine started
with `rollout.moe_config_dir=DIR` (SGLANG_MOE_CONFIG_DIR) uses them. Prints a table (the default
tile's and the best tile's microseconds per batch size) and writes JSON. GPU only:

    python scripts/tune_fused_moe.py --config configs/moonlight_2gpu.yaml --dir /tmp/moe_configs \\
        --out tune.json --dtypes fp8,bf16 rollout.tp_size=1
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.harness import config_only_model, table, timed_calls, write_json  # noqa: E402

BATCHES = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
CALLS_PER_SAMPLE = 10  # one MoE call at a small batch is tens of microseconds: time ten at once


def expert_shape(hf_config: dict, rollout) -> dict:
    """The routed experts one engine rank runs: E, N (intermediate per rank), K (hidden), top-k."""
    from mcore_rl.models.config import HFModel

    m = HFModel.from_dict(hf_config)
    return {"E": m.num_experts // rollout.ep_size,
            "N": m.moe_intermediate_size // (rollout.tp_size // rollout.ep_size),
            "K": m.hidden_size, "topk": m.num_experts_per_tok}


def tiles(fp8: bool) -> list[dict]:
    """The grid. Block FP8 reads one scale per 128 x 128 block: BLOCK_SIZE_K 128, BLOCK_SIZE_N <= 128."""
    grid = itertools.product((16, 32, 64, 128), (64, 128), (128,) if fp8 else (64, 128), (1, 16), (4, 8), (3, 4))
    return [{"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k, "GROUP_SIZE_M": g, "num_warps": w,
             "num_stages": s} for m, n, k, g, w, s in grid]


def expert_weights(shape: dict, fp8: bool) -> dict:
    """w1 [E, 2N, K] and w2 [E, K, N], random, bf16 or block FP8 with their scales."""
    from mcore_rl.sync import fp8 as q8

    e, n, k = shape["E"], shape["N"], shape["K"]
    w1 = torch.randn(e, 2 * n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16) * 0.02
    if not fp8:
        return {"w1": w1, "w2": w2}
    out = {}
    for name, w in (("w1", w1), ("w2", w2)):
        pieces = [q8.quantize(w[i]) for i in range(e)]
        out[name] = torch.stack([p[0] for p in pieces])
        out[f"{name}_scale"] = torch.stack([p[1] for p in pieces])
    return {**out, "use_fp8_w8a8": True, "block_shape": list(q8.BLOCK)}


def moe_call(shape: dict, weights: dict, m: int):
    """One fused-MoE forward of m tokens, as SGLang's triton runner calls it."""
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_experts
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    x = torch.randn(m, shape["K"], device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(m, shape["E"], device="cuda", dtype=torch.float32)
    top_w, top_i = torch.softmax(logits, -1).topk(shape["topk"], dim=-1)
    routed = StandardTopKOutput(top_w, top_i.to(torch.int32), logits)
    runner = MoeRunnerConfig(inplace=False, gate_up_interleaved=False)
    args = {k: v for k, v in weights.items() if k not in ("w1", "w2")}
    return lambda: fused_experts(x, weights["w1"], weights["w2"], routed, runner, **args)


def publish_engine_settings(hf_config: dict, work: str) -> None:
    """SGLang's MoE kernels read process-wide settings (deterministic inference, ...) that only an
    engine's processes publish: publish those of an engine on this model (config only)."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    model = config_only_model(hf_config, os.path.join(work, "config_only"))
    publish(ServerArgs(model_path=model, skip_tokenizer_init=True, attention_backend="triton"), role="test")


def one_rank_group(backend: str = "nccl") -> None:
    """SGLang's fused-MoE call asks its tensor-parallel group about symmetric memory: a group of
    this one process, as an engine of TP 1 has."""
    from sglang.srt.distributed import parallel_state as ps

    from mcore_rl.parallel.groups import free_port

    if ps.model_parallel_is_initialized():
        return
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend=backend,
                                    distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    ps.initialize_model_parallel(tensor_model_parallel_size=1)


def micros(call, tile: dict | None) -> float:
    """Median microseconds of one call with this tile (None: SGLang's own choice)."""
    from sglang.srt.layers.moe.moe_runner.triton_utils import override_config

    def burst():
        with override_config(tile):
            for _ in range(CALLS_PER_SAMPLE):
                call()

    return statistics.median(timed_calls(burst, iters=5, warmup=1)) / CALLS_PER_SAMPLE * 1e6


def tune(shape: dict, fp8: bool, batches: list[int]) -> dict:
    """{batch: {"default_us", "best_us", "best"}}; a tile that fails to compile or launch is skipped."""
    weights = expert_weights(shape, fp8)
    out = {}
    for m in batches:
        call = moe_call(shape, weights, m)
        default_us, best = micros(call, None), (float("inf"), None)
        for tile in tiles(fp8):
            try:
                us = micros(call, tile)
            except Exception:  # noqa: BLE001 - a tile past the GPU's shared memory: not a candidate
                continue
            best = min(best, (us, tile), key=lambda b: b[0])
        out[m] = {"default_us": default_us, "best_us": best[0], "best": best[1]}
        print(f"{'fp8' if fp8 else 'bf16'} M={m}: default {default_us:.1f} us, best {best[0]:.1f} us {best[1]}",
              flush=True)
    return out


def write_sglang_configs(directory: str, shape: dict, results: dict) -> list[str]:
    """Our files for this shape under DIR/configs/triton_<version>/ (one per dtype, each replacing an
    earlier run's). SGLANG_MOE_CONFIG_DIR=DIR replaces SGLang's own directory, so the first run copies
    the files SGLang ships there too: the other shapes keep their tuned tiles."""
    import triton
    from sglang.srt.layers.moe.moe_runner import triton_utils
    from sglang.srt.layers.moe.moe_runner.triton_utils import get_config_file_name

    configs = os.path.join(directory, "configs")
    if not os.path.isdir(configs):
        shutil.rmtree(configs + ".tmp", ignore_errors=True)
        shutil.copytree(os.path.join(os.path.dirname(triton_utils.__file__), "configs"), configs + ".tmp")
        os.replace(configs + ".tmp", configs)
    version_dir = os.path.join(configs, f"triton_{triton.__version__.replace('.', '_')}")
    os.makedirs(version_dir, exist_ok=True)
    written = []
    for dtype, per_batch in results.items():
        fp8 = dtype == "fp8"
        name = get_config_file_name(shape["E"], shape["N"], "fp8_w8a8" if fp8 else None,
                                    [128, 128] if fp8 else None)
        path = os.path.join(version_dir, name)
        with open(path + ".tmp", "w") as f:
            json.dump({str(m): r["best"] for m, r in per_batch.items() if r["best"]}, f, indent=1)
        os.replace(path + ".tmp", path)
        written.append(name)
    return written


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--dir", required=True, help="SGLANG_MOE_CONFIG_DIR to write into")
    p.add_argument("--out", required=True, help="JSON written here")
    p.add_argument("--dtypes", default="fp8,bf16")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("overrides", nargs="*", help="key=value config overrides (the engine's tp/ep)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        p.error("tune_fused_moe times triton kernels: it needs a GPU")
    from mcore_rl.config import sections as C
    from mcore_rl.config import checks as config_checks

    cfg = C.load_config(a.config, a.overrides)
    hf_config = config_checks.hf_model_dims(cfg.model)
    shape, batches = expert_shape(hf_config, cfg.rollout), [int(b) for b in a.batches.split(",")]
    t0 = time.perf_counter()
    results, files = {}, []
    with tempfile.TemporaryDirectory(prefix="tune_fused_moe_") as work:  # the settings' model config
        publish_engine_settings(hf_config, work)
        one_rank_group()
        for dtype in a.dtypes.split(","):  # each dtype's file once it is tuned: a cut run keeps the first
            results[dtype] = tune(shape, dtype == "fp8", batches)
            files += write_sglang_configs(a.dir, shape, {dtype: results[dtype]})
    rows = [[d, m, r["default_us"], r["best_us"], r["default_us"] / r["best_us"]]
            for d, per_batch in results.items() for m, r in per_batch.items()]
    print(table(["dtype", "batch", "default us", "tuned us", "speedup"], rows))
    print("wrote", ", ".join(files), "under", os.path.join(a.dir, "configs"))
    write_json({"config": a.config, "overrides": a.overrides, "shape": shape, "device": torch.cuda.get_device_name(),
                "results": results, "files": files, "wall_s": time.perf_counter() - t0}, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
