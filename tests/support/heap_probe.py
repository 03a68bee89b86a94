"""Loops a trainer actor's native-heavy operations on 2 gloo ranks with freed memory poisoned, to
make heap corruption (issue 47: "malloc(): unaligned tcache chunk detected", seen once in a trainer
actor) show up:

    python -m tests.support.heap_probe [STEPS] [--moves]

Each step, on each rank (EP=2, the distributed optimizer, overlapped grad reduction): the update,
the log-probs, a checkpoint save in the background (the writer thread and its bucket threads)
while the log-probs run again (as the embedded engine's generation does during an async save),
the save's completion, and every 4th step a load of the last checkpoint. With --moves the phase
changes also move the states as on GPUs (offload, the grad buffers freed and given back), which a
CPU run never does. The ranks run with glibc.malloc.perturb=165: freed memory is filled, so a
use after free reads garbage, and glibc's own tcache and chunk checks (the ones that fired) abort
the rank with their message on its stderr and Python's faulthandler stacks of every thread.
(glibc 2.36's libc_malloc_debug.so with malloc.check=3 caught neither a one-byte overflow nor a
double free here, so it is not used.)
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import subprocess
import sys
import tempfile

TUNABLES = "glibc.malloc.perturb=165"


def _ranks(rank, root, steps, moves):
    import torch

    from mcore_rl.actor import MegatronActor
    from tests.e2e.test_train_algos import actor_cfg

    faulthandler.enable(all_threads=True)
    batch = torch.load(os.path.join(root, "batch.pt"), weights_only=True)
    cfg = actor_cfg("parallel.ep=2", "actor.use_distributed_optimizer=true", "actor.overlap_grad_reduce=true",
                    "actor.grad_bucket_size=2000")
    cfg["actor"]["lr"] = 1e-4
    actor = MegatronActor(rank, 2, 0, os.path.join(root, "hf"), cfg, init={"policy": os.path.join(root, "hf")})
    if moves:
        actor._moves_states = lambda: True  # the GPU's moves, on CPU storages
    for step in range(steps):
        actor.update(batch)
        actor.log_probs(batch)
        step_dir = os.path.join(root, f"step_{step}")
        actor.save(step_dir, background=True)
        actor.log_probs(batch)  # while the writer thread writes
        actor.finish_save()
        if moves:
            actor.offload_states()
            actor.onload_states()
        if step % 4 == 3:
            actor.load(step_dir)
        if rank == 0:  # every rank is past the save before (finish_save's barrier)
            shutil.rmtree(os.path.join(root, f"step_{step - 1}"), ignore_errors=True)
        if rank == 0:
            print(f"heap_probe: step {step + 1}/{steps} ok", flush=True)


def main(argv: list[str]) -> int:
    steps = int(next((a for a in argv if a.isdigit()), "40"))
    moves = "--moves" in argv
    if os.environ.get("HEAP_PROBE_CHILD") != "1":  # tunables are read at start: re-exec with them
        env = dict(os.environ, HEAP_PROBE_CHILD="1", GLIBC_TUNABLES=TUNABLES,
                   PYTHONFAULTHANDLER="1")
        return subprocess.call([sys.executable, "-m", "tests.support.heap_probe", *argv], env=env)
    import torch

    from tests.support import distributed
    from tests.support.rl_batch import rl_batch
    from tests.support.tiny_models import make_hf_model

    root = tempfile.mkdtemp(prefix="heap_probe_")
    try:
        make_hf_model("deepseek_v3", os.path.join(root, "hf"))
        batch = rl_batch()
        batch["rollout_is_weights"] = torch.ones_like(batch["old_log_probs"])
        torch.save(batch, os.path.join(root, "batch.pt"))
        distributed.run(_ranks, 2, root, steps, moves)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"heap_probe: {steps} steps on 2 ranks{' with the moves' if moves else ''}, no heap error", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
