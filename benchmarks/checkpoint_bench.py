"""Checkpoint conversion on the CPU machine, at Moonlight-16B-A3B shape.

`convert`: HF -> Megatron -> HF at Moonlight-16B-A3B shape: wall time and peak RSS.

Writes an HF checkpoint of the real shapes (`configs/moonlight_16b.yaml`'s model, random bf16
values seeded by each tensor's name, streamed tensor by tensor), converts it with
`python -m mcore_rl.convert hf-to-mcore` at TP2/PP2/EP4 and back with `mcore-to-hf`, each in a child
process whose peak RSS comes from wait4(). The input is deleted before the way back (disk), so
the output is checked bit-exact against the values regenerated from their seeds. Prints a table,
writes JSON, deletes the data.

    python benchmarks/checkpoint_bench.py convert --work /tmp/convert_bench --json convert_bench.json [--layers 4]

`merge`: a Moonlight-16B-A3B-shaped verl FSDP2 checkpoint merged into HF safetensors: wall time, peak RSS.

Writes `--ranks` rank files (DTensor Shard(0) over a 1-D mesh, verl's names and layout) split
over `--nodes` directories, one rank file at a time (one rank's shard in memory, not the model),
runs `python -m mcore_rl.convert merge` in a child process and reads its peak RSS from wait4(), checks
sampled output tensors against the fill pattern, prints a table, writes JSON, deletes the data.

    python benchmarks/checkpoint_bench.py merge --work /tmp/merge_bench --json merge_bench.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shutil
import sys
import time
import zlib

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.harness import moonlight, run_child, run_command, table, write_json  # noqa: E402


# ----------------------------------------------------------------------------- HF <-> Megatron (`convert`)
def model_config(layers: int | None) -> dict:
    return {**moonlight(layers), "torch_dtype": "bfloat16"}


def value(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


def planned(cfg: dict):
    from mcore_rl.convert.planned_writer import Planned
    from mcore_rl.memory.layout import inventory
    from mcore_rl.models.config import HFModel

    return [Planned(name, shape, torch.float32 if w.split == "buffer" else torch.bfloat16)
            for w in inventory(HFModel.from_dict(cfg)) for name, shape in w.hf]


def write_hf(out: str, cfg: dict) -> int:
    from mcore_rl.convert.planned_writer import PlannedWriter

    os.makedirs(out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    plan = planned(cfg)
    writer = PlannedWriter(out, plan)
    for e in plan:
        writer.write(e.name, value(e.name, e.shape, e.dtype))
    writer.close()
    return sum(e.nbytes for e in plan)


def verify(out: str, cfg: dict) -> tuple[int, list[str]]:
    from safetensors import safe_open

    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        where = json.load(f)["weight_map"]
    bad, checked = [], 0
    for e in planned(cfg):
        with safe_open(os.path.join(out, where[e.name]), "pt") as f:
            got = f.get_tensor(e.name)
        if got.dtype != e.dtype or not torch.equal(got, value(e.name, e.shape, e.dtype)):
            bad.append(e.name)
        checked += 1
    return checked, bad


def convert_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="checkpoint_bench.py convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/convert_bench")
    p.add_argument("--json", default="convert_bench.json")
    p.add_argument("--layers", type=int, default=0, help="fewer layers (0: all 27)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--ep", type=int, default=4)
    a = p.parse_args(argv)
    cfg = model_config(a.layers)
    hf, mc, back = (os.path.join(a.work, d) for d in ("hf", "mcore", "hf_back"))
    shutil.rmtree(a.work, ignore_errors=True)
    try:
        t0 = time.perf_counter()
        nbytes = write_hf(hf, cfg)
        gen_s = time.perf_counter() - t0
        py = [sys.executable, "-m", "mcore_rl.convert"]
        to_mcore = run_child([*py, "hf-to-mcore", "--hf", hf, "--out", mc, "--tp", str(a.tp), "--pp", str(a.pp),
                              "--ep", str(a.ep)], cwd=ROOT)
        shutil.copy(os.path.join(hf, "config.json"), os.path.join(a.work, "config.json"))
        shutil.rmtree(hf)  # disk: the check below regenerates the input from its seeds
        to_hf = run_child([*py, "mcore-to-hf", "--ckpt", mc, "--out", back], cwd=ROOT)
        checked, bad = verify(back, cfg)
    finally:
        shutil.rmtree(a.work, ignore_errors=True)
    res = {"layers": cfg["num_hidden_layers"], "layout": f"tp{a.tp} pp{a.pp} ep{a.ep}",
           "gib": nbytes / 2**30, "generate_s": gen_s, "hf_to_mcore": to_mcore, "mcore_to_hf": to_hf,
           "tensors_checked": checked, "mismatched": bad, "bit_exact": not bad,
           "command": "python benchmarks/checkpoint_bench.py convert " + " ".join(argv)}
    print(f"{res['gib']:.2f} GiB bf16, {res['layers']} layers")
    print(table(["step", "wall s", "peak RSS GiB"], [(k, res[k]["wall_s"], res[k]["peak_rss_gib"])
                                                      for k in ("hf_to_mcore", "mcore_to_hf")], 2))
    print(f"bit-exact: {res['bit_exact']} ({checked} tensors)")
    write_json(res, a.json)
    return 0 if res["bit_exact"] else 1


# ----------------------------------------------------------------------------- verl FSDP merge (`merge`)
MOONLIGHT = {**moonlight(), "dtype": "bfloat16"}  # moonshotai/Moonlight-16B-A3B (DeepSeek-V3 architecture)


def fill(i: int, rank: int) -> float:
    """Shard `rank` of in-memory tensor `i` is this constant (exact in bf16): checks placement."""
    return ((i * 8 + rank) % 251) / 8


def model_tensors(layers: int):
    """(name, shape, dtype, is_parameter) of the in-memory model, from transformers itself."""
    import transformers

    cfg = transformers.DeepseekV3Config(**{**MOONLIGHT, "num_hidden_layers": layers})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    params = {n for n, _ in model.named_parameters()}
    return cfg, [(n, tuple(t.shape), t.dtype, n in params) for n, t in model.state_dict().items()]


def write_checkpoint(work: str, layers: int, ranks: int, nodes: int) -> tuple[list[str], int]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    if not dist.is_initialized():  # a DeviceMesh object needs a process group to exist
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = DeviceMesh("cpu", torch.arange(ranks), mesh_dim_names=("fsdp",), _init_backend=False)
    cfg, tensors = model_tensors(layers)
    dirs = [os.path.join(work, f"node{n}") for n in range(nodes)]
    for d in dirs:
        os.makedirs(d)
    cfg.save_pretrained(os.path.join(dirs[0], "huggingface"))
    with open(os.path.join(dirs[0], "fsdp_config.json"), "w") as f:
        json.dump({"FSDP_version": 2, "world_size": ranks}, f)
    total = 0
    for r in range(ranks):
        state = {}
        for i, (name, shape, dtype, is_param) in enumerate(tensors):
            if not is_param:  # buffers are not sharded by FSDP2
                state[name] = torch.full(shape, fill(i, 0), dtype=dtype)
                continue
            full = torch.empty(shape, dtype=dtype, device="meta")
            chunks = full.chunk(ranks, 0)
            local_shape = chunks[r].shape if r < len(chunks) else (0, *shape[1:])
            local = torch.full(local_shape, fill(i, r), dtype=dtype)
            state[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                             shape=full.shape, stride=full.stride())
        path = os.path.join(dirs[r * nodes // ranks], f"model_world_size_{ranks}_rank_{r}.pt")
        torch.save(state, path)
        total += os.path.getsize(path)
        del state
        print(f"  wrote {path} ({os.path.getsize(path) / 2**30:.2f} GiB)", flush=True)
    return dirs, total


def check_samples(out: str, layers: int, ranks: int) -> int:
    """Sampled output tensors hold the fill of the rank that owned each row block."""
    from safetensors import safe_open

    _, tensors = model_tensors(layers)
    index = {n: i for i, (n, *_rest) in enumerate(tensors)}
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    experts = MOONLIGHT["n_routed_experts"]
    last = layers - 1
    samples = ["model.embed_tokens.weight", "lm_head.weight", f"model.layers.{last}.self_attn.q_proj.weight",
               f"model.layers.{last}.mlp.experts.0.gate_proj.weight",
               f"model.layers.{last}.mlp.experts.{experts - 1}.down_proj.weight"]
    for name in samples:
        with safe_open(os.path.join(out, weight_map[name]), "pt") as f:
            t = f.get_tensor(name)
        m = re.match(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m:  # fused in memory: [E, ...] sharded by expert
            fused = f"{m.group(1)}.{'down_proj' if m.group(3) == 'down' else 'gate_up_proj'}"
            want = torch.full_like(t, fill(index[fused], int(m.group(2)) * ranks // experts))
        else:
            bounds = [c.shape[0] for c in torch.empty(t.shape, device="meta").chunk(ranks, 0)]
            want = torch.cat([torch.full((b, *t.shape[1:]), fill(index[name], r), dtype=t.dtype)
                              for r, b in enumerate(bounds)])
        if not torch.equal(t, want):
            raise SystemExit(f"merged {name} does not match the rank shards it came from")
    return len(samples)


def timed_merge(dirs: list[str], out: str) -> dict:
    cmd = [sys.executable, "-m", "mcore_rl.convert", "merge", "--backend", "fsdp", "--local-dir", *dirs,
           "--target-dir", out]
    env = dict(os.environ, MCORE_RL_NO_PROGRESS="1")
    res = run_child(cmd, env=env, cwd=ROOT)
    return {"command": " ".join(cmd), "wall_s": round(res["wall_s"], 1), "peak_rss_gib": round(res["peak_rss_gib"], 2)}


def merge_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="checkpoint_bench.py merge", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/merge_bench", help="scratch directory (deleted afterwards)")
    p.add_argument("--layers", type=int, default=MOONLIGHT["num_hidden_layers"])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--keep", action="store_true", help="keep the generated data")
    a = p.parse_args(argv)
    if os.path.exists(a.work):
        raise SystemExit(f"{a.work} exists; pass a new --work directory")
    os.makedirs(a.work)
    try:
        t0 = time.perf_counter()
        # generate in a child: the merge's peak RSS from wait4() also counts the parent's peak
        # (it is recorded at exec), so this process must stay small
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            dirs, size = pool.apply(write_checkpoint, (a.work, a.layers, a.ranks, a.nodes))
        gen_s = time.perf_counter() - t0
        free = shutil.disk_usage(a.work).free
        if free < size * 1.05:
            raise SystemExit(f"not enough disk for the output: {free / 2**30:.1f} GiB free, "
                             f"{size / 2**30:.1f} GiB needed")
        out = os.path.join(a.work, "merged")
        res = timed_merge(dirs, out)
        samples = check_samples(out, a.layers, a.ranks)
    finally:
        if not a.keep:
            shutil.rmtree(a.work, ignore_errors=True)
    res.update(model=f"Moonlight-16B-A3B shape, {a.layers} layers, bf16", ranks=a.ranks, nodes=a.nodes,
               checkpoint_gib=round(size / 2**30, 2), generate_s=round(gen_s, 1),
               read_gib_per_s=round(size / 2**30 / res["wall_s"], 2), checked_tensors=samples,
               cpus=os.cpu_count(), torch=torch.__version__)
    width = max(map(len, res))
    for k, v in res.items():
        print(f"{k:<{width}}  {v}")
    if a.json:
        write_json(res, a.json)
    return 0


COMMANDS = {"convert": convert_main, "merge": merge_main}


def main(argv: list[str] | None = None) -> int:
    return run_command("checkpoint_bench.py", COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
