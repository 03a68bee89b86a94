"""Checkpoints of the actor's parts: models as torch_dist, optimizer states in model space
(mcore_rl.checkpoint.optimizer), written from wherever the states are (offloaded ones from their host
copies), optionally in a background thread that anything changing the states first waits for."""

from __future__ import annotations

import contextlib
import os

import torch.distributed as dist

from mcore_rl.parallel import optimizer as optim


class Checkpoints:
    def save(self, step_dir: str, background: bool = False) -> None:
        """Models (torch_dist, any layout can load them) and this rank's optimizer states in model
        space (`mcore_rl.checkpoint.optimizer`: any layout can resume them) into `step_dir`. Offloaded
        states are written from their pinned host copies: a save stages nothing. background: the
        writes go on in a thread (the rollout runs meanwhile); `finish_save` completes them, and
        anything that would change the states first waits for them."""
        from mcore_rl.checkpoint.model import ModelSave
        from mcore_rl.checkpoint.optimizer import save as save_optim

        self.finish_save()
        read = self.read_state
        os.makedirs(os.path.join(step_dir, "optim"), exist_ok=True)
        saves = [ModelSave(model, os.path.join(step_dir, name), read=read) for name, model, _ in self._parts()]
        with_optimizer = self.cfg["trainer"]["save_optimizer"]  # false: a checkpoint to export, not to resume

        def write():
            with _no_crc32():  # the manifest's sizes catch a truncated file; CRC32 took most of a save's time
                for (name, model, opt), ms in zip(self._parts(), saves):
                    ms.write()
                    if not with_optimizer:
                        continue
                    extra = {"updates": self.updates} if name == "model" else {}
                    path = os.path.join(step_dir, "optim", f"{name}.rank{dist.get_rank()}.pt")
                    save_optim(opt, model, path, extra, read, self._regions[name])

        self._pending_save = _Writer(write, saves)
        if not background:
            self.finish_save()

    def finish_save(self) -> None:
        """Wait for a save's writes and complete it (every rank calls this; collective)."""
        pending, self._pending_save = getattr(self, "_pending_save", None), None
        if pending is not None:
            try:
                pending.finish()
            finally:  # a rank whose writes failed (a full disk) still meets the others, then raises
                dist.barrier()

    def _writes_done(self) -> None:
        """Before the states change (update, onload, offload): a background save has read them."""
        pending = getattr(self, "_pending_save", None)
        if pending is not None:
            pending.join()

    def load(self, step_dir: str) -> None:
        from mcore_rl.checkpoint.model import load_model
        from mcore_rl.checkpoint.optimizer import files, load

        self.finish_save()
        for name, model, opt in self._parts():
            load_model(model, os.path.join(step_dir, name))
            extra = load(opt, model, files(step_dir, name), self._regions[name])
            if name == "model":
                self.updates = int(extra.get("updates", 0))
            if self._optim_options()["fused_adam"]:
                optim.use_fused_adam(opt)  # the loaded steps onto the device
        dist.barrier()


@contextlib.contextmanager
def _no_crc32():
    """torch.save without its per-record CRC32 (torch >= 2.6; a no-op before): 4x faster writes.
    Process-wide while it lasts, so megatron's forked writers inherit it."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # pragma: no cover - older torch
        yield
        return
    old, config.save.compute_crc32 = config.save.compute_crc32, False
    try:
        yield
    finally:
        config.save.compute_crc32 = old


class _Writer:
    """A save's file writes in a thread; `finish` joins it, re-raises its error and runs the
    collective completions (megatron's metadata) in the calling thread."""

    def __init__(self, write, saves):
        import threading

        self.saves, self.error = saves, None
        self.thread = threading.Thread(target=self._run, args=(write,), name="checkpoint-writer", daemon=True)
        self.thread.start()

    def _run(self, write):
        try:
            write()
        except BaseException as e:  # noqa: BLE001 - surfaced by join()
            self.error = e

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def finish(self) -> None:
        self.join()
        for s in self.saves:
            s.finalize()
