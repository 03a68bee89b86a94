"""Colocated train/rollout cycles on real GPU memory: Megatron actor + a memory-saver rollout region.

Each worker (one per GPU; N > 1 uses NCCL with EP = N for both sides) decides the memory-saver
mode first, builds a Moonlight-shaped Megatron model (fewer layers, real widths, random init)
and a mixed-precision Adam (bf16 params and grads, fp32 master weights and moments), then holds
a rollout region under torch_memory_saver: the SGLang-layout weights of the same model
(tag weights; routed experts in bounded chunk tags) and a KV pool sized by the planner (tag
kv_cache). Sync buffers are allocated outside the regions. Every cycle runs the choreography of
`mcore_rl.memory.colocate`: release rollout -> onload trainer -> train step -> offload trainer ->
resume weights -> sync (bucketed) -> resume KV; it measures free memory after each release
against the planner, used memory per cycle, phase times, and checks the rollout weights against
the trainer's bit for bit. Finally an oversized plan is refused (planner) and a resume that
cannot fit is refused by the guard (no exit(1)).

GPU:  python benchmarks/colocate_cycle.py --out results.json [--gpus 4] [--layers 4]
CPU:  python benchmarks/colocate_cycle.py --cpu --tiny --out results.json   (no-op saver, gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.shapes import moonlight  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
MOONLIGHT = moonlight()
TINY = dict(MOONLIGHT, vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


# ----------------------------------------------------------------------------- parent: the plan
def plan_for(args, hf_cfg: dict, capacity: int, **overrides):
    from mcore_rl.memory.planner import PlanInputs, make_plan
    from mcore_rl.models.config import HFModel

    kw = dict(capacity=capacity, world=args.gpus, ep=args.gpus, rollout_tp=args.gpus,
              rollout_ep=args.gpus, micro_tokens=args.batch * args.seq, seq_len=args.seq,
              distributed_optimizer=False, reserved=int(args.reserved_gb * GiB),
              sync_bucket=args.bucket_mb * MiB, hook_mode=args.saver_mode,
              cuda_graph_bytes=0, cuda_graph_max_bs=1, chunked_prefill_size=1,
              mem_fraction_static=args.mem_fraction)
    i = PlanInputs(**{**kw, **overrides})
    return make_plan(HFModel.from_dict(hf_cfg), i)


def parent(args) -> int:
    from mcore_rl.memory.layout import engine_tensors, inventory
    from mcore_rl.memory.planner import PlanError
    from mcore_rl.models.config import HFModel

    hf_cfg = dict(TINY if args.tiny else MOONLIGHT, num_hidden_layers=args.layers)
    if args.cpu:
        capacity = 64 * MiB if args.tiny else 24 * GiB  # nominal: no GPU to read
    else:
        from mcore_rl.memory.gpus import GpuSelectionError, plan_capacity
        try:
            capacity = plan_capacity(None)[0]
        except GpuSelectionError:  # no NVML: ask CUDA from a child, keeping this process context-free
            import subprocess
            capacity = int(subprocess.check_output(
                [sys.executable, "-c", "import torch; print(torch.cuda.mem_get_info()[0])"]).decode())
    plan = plan_for(args, hf_cfg, capacity)
    print(plan.table(), flush=True)
    hf = HFModel.from_dict(hf_cfg)
    import torch
    layouts = [engine_tensors(hf, inventory(hf), tp=args.gpus, ep=args.gpus, rank=r, dtype=torch.bfloat16)
               for r in range(args.gpus)]
    # a plan that cannot fit is refused here, before any worker allocates anything
    refused = None
    try:
        plan_for(args, dict(MOONLIGHT), capacity, micro_tokens=8 * 8192)
    except PlanError as e:
        refused = {"phase": e.phase, "shortfall": e.shortfall, "message": str(e)}
    print(f"\noversized plan (full Moonlight, {args.gpus} GPU(s)): "
          f"{refused['message'] if refused else 'NOT refused'}", flush=True)

    import torch.multiprocessing as mp
    from mcore_rl.parallel import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args, hf_cfg, plan.as_dict(), layouts[r], port, queue))
             for r in range(args.gpus)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    results.sort(key=lambda x: x.get("rank", -1))
    report = {"args": {k: v for k, v in vars(args).items() if k != "hf_rows"}, "plan": plan.as_dict(), "oversized_plan_refused": refused,
              "ranks": results}
    ok = refused is not None and all(r.get("ok") for r in results)
    print_report(results)
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            json.dump(report, f, indent=2)
        os.replace(args.out + ".tmp", args.out)
    print(f"\n{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


# ----------------------------------------------------------------------------- worker
class Trainer:
    """Megatron model + mixed-precision Adam; offload/onload = the trainer's release/resume."""

    def __init__(self, model, device, lr=1e-4):
        import torch
        from mcore_rl.memory.offload import StateOffloader

        self.model, self.device = model, device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone() for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, foreach=False)
        self.offloader = StateOffloader(self.params + self.master, [self.opt])
        self.free_after_release: list[int] = []

    def step(self, tokens):
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from mcore_rl.models.forward import full_logits

        logits = full_logits(self.model, tokens)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        del logits
        world = dist.get_world_size()
        for p, m in zip(self.params, self.master):
            if world > 1 and getattr(p, "allreduce", True):  # dense weights are data-parallel replicas
                dist.all_reduce(p.grad)
                p.grad /= world
            m.grad = p.grad.float()  # one fp32 gradient at a time: no model-sized transient
            self.opt.step()
            m.grad = None
            p.data.copy_(m)
        for p in self.params:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()  # persistent grad buffer
        return loss.item()

    def offload(self):
        import torch

        moved = self.offloader.offload()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give activations' cached blocks back too
            self.free_after_release.append(torch.cuda.mem_get_info()[0])
        return moved

    def onload(self):
        self.offloader.onload(self.device)


def megatron_to_hf(model, hf, ep_rank: int, experts_per_rank: int):
    """(hf name, tensor view) for every local megatron parameter, through the mapping."""
    from converters.mappings import mapping_for

    by_mcore = mapping_for(hf).by_mcore(hf)
    for name, p in model.named_parameters():
        name = name.removeprefix("module.")
        if ".local_experts." in name:
            head, tail = name.split(".local_experts.")
            local, rest = tail.split(".", 1)
            name = f"{head}.local_experts.{ep_rank * experts_per_rank + int(local)}.{rest}"
        yield from by_mcore[name].to_hf(hf, p.data).items()
    for name, b in model.named_buffers():
        if name.endswith("expert_bias"):
            yield from by_mcore[name.removeprefix("module.")].to_hf(hf, b).items()


class Rollout:
    """SGLang-layout weights and a KV pool in memory-saver regions, plus bucketed sync."""

    def __init__(self, saver, layout, hf_rows, kv_bytes, device, bucket_bytes, expert_chunk_bytes):
        import torch
        from mcore_rl.memory.saver import chunk_tags

        self.layout, self.device = layout, device
        self.tensors: dict = {}
        experts = [t for t in layout.values() if t.name.endswith(("w13_weight", "w2_weight"))]
        chunk = dict(zip([t.name for t in experts], chunk_tags("weights/experts",
                                                                [t.nbytes for t in experts],
                                                                expert_chunk_bytes)))
        self.saver_tags = {"weights": ["weights"] + sorted(set(chunk.values()), key=lambda s: int(s.rsplit("/", 1)[1])),
                           "kv_cache": ["kv_cache"], "cuda_graph": []}
        for t in layout.values():
            with saver.region(chunk.get(t.name, "weights")):
                self.tensors[t.name] = torch.empty(t.shape, dtype=t.dtype, device=device)
        with saver.region("kv_cache"):
            self.kv = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
        # sync buffers stay outside the regions (IPC handles cannot point into saver memory)
        self.buckets = [torch.empty(bucket_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.dest = {}  # hf name -> [(engine tensor, dim, parts, index, slot, row offset)]
        for t in layout.values():
            if t.derived_from:
                continue
            rows: dict[int, int] = {}
            for hf_name, dim, parts, index, slot in t.pieces:
                self.dest.setdefault(hf_name, []).append((t.name, dim, parts, index, slot, rows.get(slot, 0)))
                rows[slot] = rows.get(slot, 0) + hf_rows[hf_name] // (parts if dim == 0 else 1)

    def sync(self, sources):
        """Copy trainer tensors into the rollout layout through the two bounded buckets."""
        import torch

        written, pending, used, which = 0, [], 0, 0
        bucket = self.buckets[which]

        def flush():
            nonlocal pending, used, which, bucket
            for flat, n, dst in pending:
                dst.copy_(flat[:n].view(dst.dtype).view(dst.shape))
            pending, used = [], 0
            which = 1 - which
            bucket = self.buckets[which]

        for hf_name, src in sources:
            for name, dim, parts, index, slot, row in self.dest.get(hf_name, []):
                shard = src if dim is None else src.chunk(parts, dim)[index]
                target = self.tensors[name] if slot < 0 else self.tensors[name][slot]
                dst = target.narrow(0, row, shard.shape[0])
                n = shard.numel() * shard.element_size()
                if n > bucket.numel():
                    dst.copy_(shard)  # larger than a bucket: direct
                else:
                    if used + n > bucket.numel():
                        flush()
                    view = bucket[used:used + n].view(shard.dtype).view(shard.shape)
                    view.copy_(shard)
                    pending.append((bucket[used:used + n], n, dst))
                    used += n
                written += n
        flush()
        for t in self.layout.values():
            if t.derived_from:  # SGLang derives w_kc/w_vc from kv_b_proj after loading
                self.tensors[t.name].copy_(self.tensors[t.derived_from])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return written


def check_identical(rollout, model, hf, rank, world) -> list[str]:
    """Rollout tensors against the trainer's own parameters, by megatron name (independent of sync)."""
    import torch

    params = {n.removeprefix("module."): p.data for n, p in model.named_parameters()}
    T = rollout.tensors
    bad = []

    def same(engine_name, want):
        got = T[engine_name]
        if got.shape != want.shape or not torch.equal(got.to(want.device), want):  # trainer may be offloaded
            bad.append(engine_name)

    V = hf["vocab_size"] // world
    same("model.embed_tokens.weight", params["embedding.word_embeddings.weight"][rank * V:(rank + 1) * V])
    same("lm_head.weight", params["output_layer.weight"][rank * V:(rank + 1) * V])
    same("model.norm.weight", params["decoder.final_layernorm.weight"])
    for L in range(hf["num_hidden_layers"]):
        m, h = f"decoder.layers.{L}.", f"model.layers.{L}."
        heads = hf["num_attention_heads"] // world
        kvb = params[m + "self_attention.linear_kv_up_proj.weight"]
        per = kvb.shape[0] // hf["num_attention_heads"]
        same(h + "self_attn.kv_b_proj.weight", kvb[rank * heads * per:(rank + 1) * heads * per])
        o = params[m + "self_attention.linear_proj.weight"]
        same(h + "self_attn.o_proj.weight", o.chunk(world, 1)[rank])
        same(h + "input_layernorm.weight", params[m + "input_layernorm.weight"])
        if L >= hf["first_k_dense_replace"]:  # moe_tp = 1: w13/w2 are megatron's fc1/fc2, stacked
            local = range(hf["n_routed_experts"] // world)
            for engine, mc in (("w13_weight", "linear_fc1"), ("w2_weight", "linear_fc2")):
                same(h + "mlp.experts." + engine,
                     torch.stack([params[m + f"mlp.experts.local_experts.{j}.{mc}.weight"] for j in local]))
    return bad


def worker(rank, args, hf_cfg, plan, layout, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.gpus), LOCAL_RANK=str(rank), TORCHDYNAMO_DISABLE="1",
                      NCCL_NVLS_ENABLE="0")
    try:
        queue.put(run_worker(rank, args, hf_cfg, plan, layout))
    except BaseException as e:  # report instead of leaving the parent waiting
        import traceback
        queue.put({"rank": rank, "ok": False, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()})


def run_worker(rank, args, hf_cfg, plan, layout):
    # the memory-saver mode is decided before megatron-core is imported
    from mcore_rl.memory.saver import ResumeRefused, decide
    saver = decide(enabled=not args.cpu, hook_mode=args.saver_mode)

    import torch
    from mcore_rl.memory.colocate import Colocation, SaverEngine
    from mcore_rl.models import HFModel, build_model, transformer_config
    from mcore_rl.parallel import Layout, init_distributed

    cuda = not args.cpu
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    torch.set_num_threads(1 if args.cpu else 4)
    init_distributed(Layout(ep=args.gpus), seed=1234)
    total = torch.cuda.mem_get_info()[1] if cuda else 0
    free = (lambda: torch.cuda.mem_get_info()[0]) if cuda else (lambda: 0)
    base_used = total - free()  # CUDA context + NCCL, before any tensor

    hf = HFModel.from_dict(hf_cfg)
    model = build_model(hf, transformer_config(hf, ep=args.gpus, dtype=torch.bfloat16, cpu=not cuda))
    trainer = Trainer(model, device)
    for p in trainer.params:
        p.grad = torch.zeros_like(p)  # megatron keeps a persistent grad buffer; so do we
    trainer.offload()  # the engine starts while the trainer is released

    phases = plan["phases"]
    kv_bytes = phases["rollout"]["engine kv cache"]
    rollout = Rollout(saver, layout, args.hf_rows, kv_bytes, device, args.bucket_mb * MiB,
                      args.expert_chunk_mb * MiB)
    per_rank = hf.num_experts // args.gpus
    sources = lambda: megatron_to_hf(model, hf, rank, per_rank)  # noqa: E731
    engine = SaverEngine(saver, rollout.saver_tags)
    co = Colocation(engine, trainer, lambda: rollout.sync(sources()), offload_train_states=True,
                    free_bytes=free if cuda else None,
                    resume_needs={"weights": phases["sync"]["engine weights"]})
    resident = 2 * args.bucket_mb * MiB  # sync buckets; the trainer is offloaded between phases
    predicted_free = total - base_used - resident
    gen = torch.Generator(device=device).manual_seed(rank)
    cycles, bad_total = [], []
    for c in range(args.cycles):
        co.to_train()
        free_after_engine_release = free()
        trainer_resident = trainer.offloader.nbytes()  # onloaded by to_train(), on the GPU now
        tokens = torch.randint(0, hf.vocab_size, (args.batch, args.seq), device=device, generator=gen)
        t0 = time.perf_counter()
        loss = trainer.step(tokens)
        step_s = time.perf_counter() - t0
        co.to_rollout()
        bad = check_identical(rollout, model, hf_cfg, rank, args.gpus)
        bad_total += bad
        if cuda:
            torch.cuda.empty_cache()  # the check's temporaries are not part of either side
        cycles.append(dict(
            cycle=c, loss=loss, step_s=step_s, mismatched=bad,
            free_after_engine_release=free_after_engine_release, trainer_resident=trainer_resident,
            free_after_trainer_release=trainer.free_after_release[-1] if cuda else 0,
            used_end=total - free() if cuda else 0,
            reserved_end=torch.cuda.memory_reserved() if cuda else 0,
            **{k: v[-1] for k, v in co.timings.items()}))
    out = {"rank": rank, "device": torch.cuda.get_device_name(rank) if cuda else "cpu",
           "saver": saver.hook_mode or f"no-op ({saver.reason})", "total": total, "base_used": base_used,
           "predicted_free_after_release": predicted_free, "cycles": cycles,
           "engine_bytes": sum(t.nbytes for t in layout.values()), "kv_bytes": kv_bytes,
           "trainer_state_bytes": trainer.offloader.nbytes(), "bit_identical": not bad_total}
    checks = {"bit_identical": not bad_total}
    if cuda:
        # after the engine's release the trainer's states are back on the GPU; after the trainer's
        # release nothing but contexts and the sync buckets is
        errs = [abs(x["free_after_engine_release"] - (predicted_free - x["trainer_resident"])) / predicted_free
                for x in cycles] + [abs(x["free_after_trainer_release"] - predicted_free) / predicted_free
                                    for x in cycles]
        out["max_free_error"] = max(errs)
        used = [x["used_end"] for x in cycles[1:]]
        out["used_growth"] = used[-1] - used[0] if used else 0
        checks["free_within_5pct"] = out["max_free_error"] <= 0.05
        checks["no_growth"] = out["used_growth"] <= 64 * MiB
        out["refused_resume"] = refuse_resume(saver, engine, ResumeRefused, free, device)
        checks["resume_refused"] = out["refused_resume"] is not None
    out["checks"], out["ok"] = checks, all(checks.values())
    return out


def refuse_resume(saver, engine, ResumeRefused, free, device):
    """Fill the GPU so the weights cannot come back; the guard must raise, not exit(1)."""
    import torch

    engine.release(["kv_cache", "weights"])
    need = saver.need("weights")
    filler = torch.empty(max(0, free() - need // 2), dtype=torch.uint8, device=device)
    try:
        engine.resume(["weights"])
        msg = None
    except ResumeRefused as e:
        msg = str(e)
    del filler
    torch.cuda.empty_cache()
    for tag in engine.tags["weights"]:  # whatever was not resumed comes back now that there is room
        if saver.tags[tag].paused:
            saver.resume(tag)
    engine.resume(["kv_cache"])
    return msg


def print_report(results):
    for r in results:
        if not r.get("cycles"):
            print(f"rank {r.get('rank')}: {r.get('error')}\n{r.get('traceback', '')}")
            continue
        print(f"\nrank {r['rank']} ({r['device']}, saver {r['saver']}): predicted free after a release "
              f"{r['predicted_free_after_release'] / GiB:.2f} GiB; engine {r['engine_bytes'] / GiB:.2f} GiB, "
              f"KV {r['kv_bytes'] / GiB:.2f} GiB, trainer states {r['trainer_state_bytes'] / GiB:.2f} GiB")
        cols = ("cycle", "free_after_engine_release", "free_after_trainer_release", "used_end", "release_rollout",
                "onload_trainer", "step_s", "offload_trainer", "resume_weights", "sync", "resume_kv_cache")
        print(" ".join(f"{c[:14]:>14}" for c in cols))
        for x in r["cycles"]:
            vals = [f"{x[c] / GiB:.3f}G" if c.startswith(("free", "used")) else
                    (f"{x[c]:.4f}s" if isinstance(x[c], float) else str(x[c])) for c in cols]
            print(" ".join(f"{v:>14}" for v in vals))
        print(f"checks: {r['checks']}" + (f"; max free error {r['max_free_error']:.2%}, used growth "
                                           f"{r['used_growth'] / MiB:.1f} MiB" if "max_free_error" in r else ""))
        if r.get("refused_resume"):
            print(f"guarded resume: {r['refused_resume']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="gloo processes, no-op memory saver")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (CPU test)")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mem-fraction", type=float, default=None, help="default: the planner picks")
    ap.add_argument("--reserved-gb", type=float, default=2.0)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--expert-chunk-mb", type=int, default=1024)
    ap.add_argument("--saver-mode", choices=("torch", "preload"), default="torch")
    ap.add_argument("--out", default=None, help="JSON results path")
    args = ap.parse_args(argv)
    if args.tiny:
        args.seq, args.bucket_mb, args.expert_chunk_mb = min(args.seq, 32), 1, 1
        args.reserved_gb = 0.0
    if args.saver_mode == "preload" and not args.cpu and "torch_memory_saver" not in os.environ.get("LD_PRELOAD", ""):
        from mcore_rl.memory.saver import preload_env
        os.execve(sys.executable, [sys.executable, *sys.argv], preload_env())
    from mcore_rl.memory.layout import inventory
    from mcore_rl.models.config import HFModel
    hf = HFModel.from_dict(dict(TINY if args.tiny else MOONLIGHT, num_hidden_layers=args.layers))
    args.hf_rows = {name: shape[0] for w in inventory(hf) for name, shape in w.hf}
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
