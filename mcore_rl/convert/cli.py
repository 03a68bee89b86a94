"""Command line for the converters."""

from __future__ import annotations

import argparse
import ctypes
import logging
import sys
import time

from mcore_rl.convert.hf_io import CheckpointError
from mcore_rl.convert.merge.validate import ValidationFailed
from mcore_rl.preflight.bad_input import BAD_INPUT, report


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mcore_rl.convert", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF safetensors -> megatron-core torch_dist checkpoint")
    a.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    a.add_argument("--out", required=True, help="output checkpoint directory (must not exist)")
    for flag in ("tp", "pp", "ep", "etp"):
        a.add_argument(f"--{flag}", type=int, default=1, help=f"target {flag.upper()} size")
    a.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                   help="cast the parameters (default: keep the checkpoint's own dtypes)")
    b = sub.add_parser("mcore-to-hf", help="megatron-core torch_dist checkpoint -> HF safetensors")
    b.add_argument("--ckpt", required=True, help="torch_dist checkpoint directory")
    b.add_argument("--out", required=True, help="output HF directory (must not exist)")
    b.add_argument("--hf-config", help="directory with config.json/tokenizer (default: CKPT/hf)")
    b.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                   help="cast on export (default: keep the checkpoint's own dtypes)")
    b.add_argument("--max-shard-size", type=float, default=5.0, help="GiB per safetensors shard")
    r = sub.add_parser("random-hf", help="an HF checkpoint of seeded random weights at a config's full size")
    r.add_argument("--hf-config", required=True, help="directory with the config.json")
    r.add_argument("--out", required=True, help="output HF directory (must not exist)")
    r.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--max-shard-size", type=float, default=5.0, help="GiB per safetensors shard")
    _merge_parser(sub)
    return p


def _merge_parser(sub):
    m = sub.add_parser("merge", help="sharded training checkpoint (verl FSDP / megatron) -> HF")
    m.add_argument("--backend", required=True, choices=["fsdp", "megatron"])
    m.add_argument("--local-dir", "--local_dir", dest="local_dir", nargs="+", default=[],
                   metavar="DIR", help="checkpoint directories, one per node")
    m.add_argument("--manifest", help="fsdp: JSON {\"ranks\": {\"0\": \"path\", ...}} instead of --local-dir")
    m.add_argument("--target-dir", "--target_dir", dest="target_dir", required=True,
                   help="output HF directory (must not exist)")
    m.add_argument("--hf-config", help="config/tokenizer dir (default: huggingface/ or hf/ in a local dir)")
    m.add_argument("--validate", metavar="REF_DIR", help="compare every tensor with this HF model")
    m.add_argument("--atol", type=float, default=0.0, help="--validate tolerance (default bit-exact)")
    m.add_argument("--rtol", type=float, default=0.0)
    m.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating tensors on export")
    m.add_argument("--max-shard-size", type=float, default=5.0, help="GiB per safetensors shard")
    m.add_argument("--lora-alpha", type=float, help="LoRA alpha when no lora_train_meta.json is kept")


def _merge(args) -> None:
    from mcore_rl.convert.merge import merge

    if not args.local_dir and not args.manifest:
        raise CheckpointError("give --local-dir DIR [DIR ...] or --manifest FILE")
    merge(args.backend, args.local_dir, args.target_dir, args.manifest, hf_config=args.hf_config,
          dtype=args.dtype, max_shard_bytes=int(args.max_shard_size * 2**30), validate=args.validate,
          atol=args.atol, rtol=args.rtol, lora_alpha=args.lora_alpha)


def return_freed_memory() -> None:
    """Tensors of a few MiB come from glibc's heap, where fragmentation keeps freed space resident
    (a streaming conversion then grows to the model's size); above a 1 MiB mmap threshold each
    is its own mapping, handed back to the OS when freed."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return_freed_memory()
    # our own progress at INFO; megatron's import-time INFO chatter would bury a refusal's one line
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("mcore_rl.convert").setLevel(logging.INFO)
    from mcore_rl.convert import hf_mcore as convert

    t0 = time.perf_counter()
    try:
        if args.cmd == "hf-to-mcore":
            convert.hf_to_mcore(args.hf, args.out, args.tp, args.pp, args.ep, args.etp, args.dtype)
        elif args.cmd == "random-hf":
            convert.random_hf(args.hf_config, args.out, args.dtype, args.seed, int(args.max_shard_size * 2**30))
        elif args.cmd == "merge":
            _merge(args)
            args.out = args.target_dir
        else:
            convert.mcore_to_hf(args.ckpt, args.out, args.hf_config, args.dtype,
                                int(args.max_shard_size * 2**30))
    except (*BAD_INPUT, KeyError) as e:  # KeyError: a checkpoint lacking a tensor the model needs
        return report(e)
    except ValidationFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} in {time.perf_counter() - t0:.1f}s")
    return 0
