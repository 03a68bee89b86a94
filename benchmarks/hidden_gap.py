"""Where the engine's and the trainer's forward passes part, layer by layer, on the same weights and
the same tokens (issue 45, item 5: the loop's log-prob gap at 27 layers).

    python benchmarks/hidden_gap.py --config configs/moonlight_4gpu.yaml --out gap.json [--tokens 256]
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
Prints the table and the layers where the relative gap grows most and where routing first differs;
writes JSON. At the tiny size on CPU (configs/tiny_cpu.yaml, fp32) it runs in a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import table, write_json  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def trainer_model(cfg, gpu: bool):
    """The policy as the trainer builds it (seeded init, or model.hf_path converted), one process."""
    from mcore_rl import compat

    compat.quiet_fallback_warnings()
    print(compat.accelerators_line(), flush=True)
    from mcore_rl.models import HFModel, build_model, transformer_config
    from mcore_rl.parallel import Layout, free_port, init_distributed

    if gpu:
        torch.cuda.set_device(0)
    init_distributed(Layout(), rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}",
                     seed=cfg.trainer.seed)
    from mcore_rl import config as C

    hf = HFModel.from_dict(C.hf_model_dims(cfg.model))
    model = build_model(hf, transformer_config(hf, dtype=DTYPES[cfg.model.dtype])).eval()
    return hf, model


def export(cfg, model, work: str) -> str:
    """An HF directory of `model`'s weights (the converter's export), or model.hf_path loaded into it."""
    from converters.convert import hf_to_mcore, mcore_to_hf
    from mcore_rl.checkpoint import load_model, save_model

    if cfg.model.hf_path:
        load_model(model, hf_to_mcore(cfg.model.hf_path, os.path.join(work, "mcore"), dtype=cfg.model.dtype))
        return cfg.model.hf_path
    import transformers

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    side = os.path.join(work, "hf_config")
    hcfg = transformers.AutoConfig.for_model(**cfg.model.hf_config)
    hcfg.architectures = hcfg.architectures or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hcfg.model_type]]  # engines read it
    hcfg.save_pretrained(side)
    save_model(model, os.path.join(work, "mcore"), side_files_from=side)
    return mcore_to_hf(os.path.join(work, "mcore"), os.path.join(work, "hf"), dtype=cfg.model.dtype)


def engine_side(config: str, overrides: list[str], model_dir: str, tokens: list[int], out: str) -> None:
    """In a process of its own (SGLang kills the process that made an engine when it fails): one engine,
    each layer's output in the prefill of `tokens`, the log-prob of each token, the routed experts."""
    from mcore_rl import config as C
    from mcore_rl.rollout import jit_cache
    from mcore_rl.rollout import sglang as S
    from mcore_rl.sync.plan import EngineLayout

    cfg = C.load_config(config, overrides)
    gpu = cfg.cluster.device == "gpu"
    tp, ep = cfg.rollout.tp_size, cfg.rollout.ep_size
    layout = EngineLayout(tp, ep, 1, tp)
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
    server = S.SGLangServer(args, cfg.cluster.device, gpus, env)
    try:
        path = os.path.join(os.path.dirname(out), "engine_hidden", "h")
        server.engine.collective_rpc("mcore_rl_capture_hidden", path=path, tokens=len(tokens))
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
    from mcore_rl.routing import ExpertLayout

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=256, help="length of the random token sequence")
    ap.add_argument("--replay", action="store_true", help="also the trainer with the engine's experts (R3)")
    ap.add_argument("--engine-side", nargs=3, metavar=("MODEL_DIR", "TOKENS_JSON", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.engine_side:
        model_dir, tokens_json, out = a.engine_side
        engine_side(a.config, a.overrides, model_dir, json.load(open(tokens_json)), out)
        return 0
    from mcore_rl import config as C
    from mcore_rl.rollout.sglang import engine_model_dir

    cfg = C.load_config(a.config, a.overrides)
    gpu = cfg.cluster.device == "gpu"
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    work = tempfile.mkdtemp(prefix="hidden_gap_")
    hf, model = trainer_model(cfg, gpu)
    engine_dir = engine_model_dir(export(cfg, model, work), os.path.join(work, "engine_hf"), [], cfg.cluster.device)
    n = min(a.tokens, (hf.get("max_position_embeddings") or 2 * a.tokens) // 2)  # well inside the engine's context
    tokens = torch.randint(0, hf.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    with open(os.path.join(work, "tokens.json"), "w") as f:
        json.dump(tokens, f)
    engine_out = os.path.join(work, "engine.pt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    subprocess.run([sys.executable, __file__, "--config", a.config, "--out", a.out, "--engine-side", engine_dir,
                    os.path.join(work, "tokens.json"), engine_out, *a.overrides], check=True, env=env, cwd=REPO)
    engine = torch.load(engine_out, weights_only=True)
    runs = {"live": trainer_side(hf, model, tokens, device)}
    if a.replay and engine["routes"] is not None:
        runs["replay"] = trainer_side(hf, model, tokens, device, routes=engine["routes"])
    result = {"config": a.config, "overrides": a.overrides, "tokens": n, "layers": hf.num_layers,
              "engine": f"SGLang {engine['version']} TP={cfg.rollout.tp_size} EP={cfg.rollout.ep_size}",
              "device": torch.cuda.get_device_name() if gpu else "cpu", "dtype": cfg.model.dtype}
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


if __name__ == "__main__":
    sys.exit(main())
