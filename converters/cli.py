"""Command line for the converters."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from converters.hf_io import CheckpointError
from mcore_rl.models.config import LayoutError, UnsupportedModelError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m converters", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF safetensors -> megatron-core torch_dist checkpoint")
    a.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    a.add_argument("--out", required=True, help="output checkpoint directory (must not exist)")
    for flag in ("tp", "pp", "ep", "etp"):
        a.add_argument(f"--{flag}", type=int, default=1, help=f"target {flag.upper()} size")
    a.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    b = sub.add_parser("mcore-to-hf", help="megatron-core torch_dist checkpoint -> HF safetensors")
    b.add_argument("--ckpt", required=True, help="torch_dist checkpoint directory")
    b.add_argument("--out", required=True, help="output HF directory (must not exist)")
    b.add_argument("--hf-config", help="directory with config.json/tokenizer (default: CKPT/hf)")
    b.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast on export")
    b.add_argument("--max-shard-size", type=float, default=5.0, help="GiB per safetensors shard")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from converters import convert

    t0 = time.perf_counter()
    try:
        if args.cmd == "hf-to-mcore":
            convert.hf_to_mcore(args.hf, args.out, args.tp, args.pp, args.ep, args.etp, args.dtype)
        else:
            convert.mcore_to_hf(args.ckpt, args.out, args.hf_config, args.dtype,
                                int(args.max_shard_size * 2**30))
    except (CheckpointError, LayoutError, UnsupportedModelError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} in {time.perf_counter() - t0:.1f}s")
    return 0
