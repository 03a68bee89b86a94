"""HF -> Megatron -> HF at Moonlight-16B-A3B shape on the CPU machine: wall time and peak RSS.

Writes an HF checkpoint of the real shapes (`configs/moonlight_16b.yaml`'s model, random bf16
values seeded by each tensor's name, streamed tensor by tensor), converts it with
`python -m converters hf-to-mcore` at TP2/PP2/EP4 and back with `mcore-to-hf`, each in a child
process whose peak RSS comes from wait4(). The input is deleted before the way back (disk), so
the output is checked bit-exact against the values regenerated from their seeds. Prints a table,
writes JSON, deletes the data.

    python benchmarks/convert_bench.py --work /tmp/convert_bench --json convert_bench.json [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import zlib

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.harness import run_child, table, write_json  # noqa: E402


def model_config(layers: int | None) -> dict:
    from benchmarks.shapes import moonlight

    return {**moonlight(layers), "torch_dtype": "bfloat16"}


def value(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


def planned(cfg: dict):
    from converters.planned_writer import Planned
    from mcore_rl.memory.layout import inventory
    from mcore_rl.models import HFModel

    return [Planned(name, shape, torch.float32 if w.split == "buffer" else torch.bfloat16)
            for w in inventory(HFModel.from_dict(cfg)) for name, shape in w.hf]


def write_hf(out: str, cfg: dict) -> int:
    from converters.planned_writer import PlannedWriter

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        py = [sys.executable, "-m", "converters"]
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
           "command": "python benchmarks/convert_bench.py " + " ".join(argv or sys.argv[1:])}
    print(f"{res['gib']:.2f} GiB bf16, {res['layers']} layers")
    print(table(["step", "wall s", "peak RSS GiB"], [(k, res[k]["wall_s"], res[k]["peak_rss_gib"])
                                                      for k in ("hf_to_mcore", "mcore_to_hf")], 2))
    print(f"bit-exact: {res['bit_exact']} ({checked} tensors)")
    write_json(res, a.json)
    return 0 if res["bit_exact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
