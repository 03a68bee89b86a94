"""Logit parity on GPUs in bf16: transformers vs our megatron-core models loaded through the converter.

For each tiny family of tests/support/tiny_models.py: the fp32 HF model's logits are the reference; the
HF model in bf16 on one GPU and our megatron model in bf16 (converted checkpoint) at TP=1 on one
GPU and at TP2 / EP2 / PP2 over NCCL are compared with it by relative error ||x - ref|| / ||ref||.
bf16 lands between 1e-3 and 1e-2; the HF-bf16 row says what bf16 alone costs. Prints a table,
writes JSON.

    python tests/gpu/gpu_parity.py --gpus 2 --out gpu_parity.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.harness import table, write_json  # noqa: E402
LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 1, 1), "ep2": (1, 1, 2), "pp2": (1, 2, 1)}
MOE = ("deepseek_v3", "deepseek_v2", "qwen3_moe", "glm4_moe")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def prepare(root: str) -> dict:
    """HF models, their fp32/bf16 reference logits, and converted bf16 checkpoints."""
    from mcore_rl.convert import hf_mcore as convert
    from tests.support.tiny_models import FAMILIES, make_hf_model

    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(7))
    out = {}
    for fam in FAMILIES:
        d = os.path.join(root, fam)
        model = make_hf_model(fam, os.path.join(d, "hf"))
        with torch.no_grad():
            ref = model(ids).logits
            hf_bf16 = model.to("cuda", torch.bfloat16)(ids.cuda()).logits.cpu()
        torch.save({"ids": ids, "ref": ref}, os.path.join(d, "ref.pt"))
        convert.hf_to_mcore(os.path.join(d, "hf"), os.path.join(d, "ckpt"), dtype="bf16")
        out[fam] = {"hf_bf16": rel(hf_bf16, ref)}
        del model
    return out


def worker(rank: int, world: int, port: int, root: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), TORCHDYNAMO_DISABLE="1")
    from megatron.core import parallel_state as ps

    from mcore_rl.checkpoint.model import load_model
    from mcore_rl.models.config import HFModel, transformer_config
    from mcore_rl.models.builder import build_model
    from mcore_rl.models.forward import full_logits
    from mcore_rl.parallel.groups import Layout, init_distributed
    from tests.support.tiny_models import FAMILIES

    results = {}
    for name, (tp, pp, ep) in LAYOUTS.items():
        if tp * pp * ep > world:
            continue
        init_distributed(Layout(tp=tp, pp=pp, ep=ep, etp=tp if ep == 1 else 1))
        for fam in FAMILIES:
            if ep > 1 and fam not in MOE:
                continue
            hf = HFModel.from_dir(os.path.join(root, fam, "hf"))
            etp = tp if (ep == 1 and hf.num_experts) else 1
            model = build_model(hf, transformer_config(hf, tp=tp, pp=pp, ep=ep, etp=etp,
                                                       dtype=torch.bfloat16)).eval()
            load_model(model, os.path.join(root, fam, "ckpt"))
            ref = torch.load(os.path.join(root, fam, "ref.pt"), weights_only=True)
            with torch.no_grad():
                logits = full_logits(model, ref["ids"].cuda())
            if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
                results[f"{name}/{fam}"] = rel(logits.cpu(), ref["ref"])
        ps.destroy_model_parallel()
    queue.put(results)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=min(2, torch.cuda.device_count()))
    p.add_argument("--out", default="gpu_parity.json")
    a = p.parse_args(argv)
    from mcore_rl.parallel.groups import free_port

    with tempfile.TemporaryDirectory() as root:
        res = {"hf_bf16": prepare(root), "megatron_bf16": {}}
        ctx = torch.multiprocessing.get_context("spawn")
        queue = ctx.SimpleQueue()
        torch.multiprocessing.start_processes(worker, args=(a.gpus, free_port(), root, queue), nprocs=a.gpus,
                                              start_method="spawn")
        while not queue.empty():
            res["megatron_bf16"].update(queue.get())
    res["device"] = torch.cuda.get_device_name()
    rows = [("hf_bf16/" + fam, r["hf_bf16"]) for fam, r in res["hf_bf16"].items()]
    print(table(["case", "rel. error vs fp32 HF"], rows + sorted(res["megatron_bf16"].items()), 2))
    write_json(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
