"""The reference policy offloaded between its forwards (memory.offload_ref), on one GPU.

Builds a MegatronActor with a KL loss (so it holds a frozen reference) from a config's model
widths (random weights), with and without `memory.offload_ref`, and reports the device memory
the reference holds, the time of one `ref_log_probs` (onload + forward + offload), and how far
the reference's log-probs are from the policy's (the same weights: they must agree to bf16
kernel noise, offloaded or not).

    python tests/gpu/ref_offload_check.py --layers 4 --out ref_offload.json   # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(offload: bool, hf_dir: str, args, port: int) -> dict:
    sys.path.insert(0, ROOT)
    from mcore_rl.config import sections as C
    from mcore_rl.actor import MegatronActor

    cfg = C.to_dict(C.Config())
    cfg["model"]["dtype"] = "bf16"
    cfg["actor"]["use_kl_loss"] = True
    cfg["memory"]["offload_ref"] = offload
    before = torch.cuda.memory_allocated()
    actor = MegatronActor(0, 1, port, hf_dir, cfg)
    held = torch.cuda.memory_allocated() - before
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, actor.hf.vocab_size, (args.batch, args.seq), generator=g)
    batch = dict(tokens=tokens, attention_mask=torch.ones_like(tokens), response_mask=torch.ones(args.batch, 16))
    actor.ref_log_probs(batch)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logp = actor.ref_log_probs(batch)
    torch.cuda.synchronize()
    out = dict(offload=offload, model_and_ref_gib=held / 2**30, ref_log_probs_s=time.perf_counter() - t0,
               after_gib=torch.cuda.memory_allocated() / 2**30,
               ref_vs_policy_max_abs=(logp - actor.log_probs(batch)).abs().max().item(),
               ref_repeat_max_abs=(logp - actor.ref_log_probs(batch)).abs().max().item())
    actor.ps.destroy_model_parallel()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="moonlight_16b.yaml")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--out", default="ref_offload.json")
    args = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    from benchmarks.harness import table, write_json
    from benchmarks.harness import hf_config
    from mcore_rl.parallel.groups import free_port

    with tempfile.TemporaryDirectory() as hf_dir:
        with open(os.path.join(hf_dir, "config.json"), "w") as f:
            json.dump(hf_config(args.config, args.layers), f)
        port = free_port()
        rows = [measure(False, hf_dir, args, port), measure(True, hf_dir, args, port)]
    res = dict(rows=rows, device=torch.cuda.get_device_name(),
               saved_gib=rows[0]["model_and_ref_gib"] - rows[1]["model_and_ref_gib"],
               command="python tests/gpu/ref_offload_check.py " + " ".join(argv or sys.argv[1:]))
    print(table(["offload_ref", "policy+ref GiB", "ref_log_probs s", "|ref - policy|", "|ref - ref|"],
                [(str(r["offload"]), r["model_and_ref_gib"], r["ref_log_probs_s"], r["ref_vs_policy_max_abs"],
                  r["ref_repeat_max_abs"]) for r in rows]))
    print(f"device memory saved: {res['saved_gib']:.2f} GiB")
    write_json(res, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
