"""Run a function in N gloo processes on loopback and surface any worker's exception."""

from __future__ import annotations

import os
import traceback

import torch.multiprocessing as mp

from mcore_rl.parallel.groups import free_port


def _entry(rank, world, port, fn, args, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(rank, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(fn, world: int, *args) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_entry, args=(world, free_port(), fn, args, errors), nprocs=world,
                           start_method="spawn")
    except Exception:
        msgs = []
        while not errors.empty():
            rank, tb = errors.get()
            msgs.append(f"--- rank {rank} ---\n{tb}")
        raise AssertionError("distributed worker failed:\n" + "\n".join(msgs)) from None
