"""What a run's output directory holds from earlier runs, checked before a run starts in it:
another run still using it (a lock file naming that run's pid) and the model its checkpoints were
trained on (a resume with a different model is refused, naming what changed).

The lock is `<output_dir>/run.lock`, an flock held for the run's life with the pid written in it:
the kernel drops the flock when the process dies, so a lock left by a killed run is taken over
(with a warning naming its pid), and a live one refuses the second run.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys

from mcore_rl.preflight.bad_input import BadInput
from mcore_rl.models.checks import INERT_KEYS, with_defaults

LOCK = "run.lock"


class OutputDirBusy(BadInput):
    """Another live run holds the output directory."""


def _holder(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip() or "unknown"
    except OSError:
        return "unknown"


def check_unlocked(run_dir: str) -> None:
    """Refuse a run whose output directory another live run holds (nothing is taken or written)."""
    path = os.path.join(run_dir, LOCK)
    if not os.path.exists(path):
        return
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputDirBusy(_busy(run_dir, _holder(path))) from None
        fcntl.flock(f, fcntl.LOCK_UN)


def _busy(run_dir: str, pid: str) -> str:
    return (f"{run_dir}: another run (pid {pid}) is using this trainer.output_dir; wait for it to end, stop it, "
            "or choose another trainer.output_dir")


class RunLock:
    """Held while a run writes to its output directory (a context manager)."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK)
        self.f = None

    def __enter__(self) -> "RunLock":
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise OutputDirBusy(_busy(os.path.dirname(self.path), _holder(self.path))) from None
        f.seek(0)
        stale = f.read().strip()
        if stale and stale != str(os.getpid()):
            print(f"warning: {self.path}: run pid {stale} ended without releasing it; taking it over",
                  file=sys.stderr, flush=True)
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self.f = f
        return self

    def __exit__(self, *exc) -> None:
        if self.f is not None:
            os.remove(self.path)  # while still held: a waiting run then finds no lock of ours
            fcntl.flock(self.f, fcntl.LOCK_UN)
            self.f.close()
            self.f = None


# keys that do not change what the model computes or how its weights are laid out
_NOT_MODEL = INERT_KEYS | {"dtype", "torch_dtype", "quantization_config", "initializer_range",
                           "max_position_embeddings", "num_nextn_predict_layers"}


def _flat(cfg: dict) -> dict:
    """The config with transformers 5's rope_parameters entries at the top, as older files have them."""
    rope = cfg.get("rope_parameters") or {}
    return with_defaults({**{k: rope[k] for k in ("rope_theta", "partial_rotary_factor") if k in rope}, **cfg})


def model_changes(before: dict, now: dict) -> list[str]:
    """'key (before -> now)' for each key that changes the model, comparing what both configs
    say or leave to the family's defaults (a key only one of them names, and nested settings such
    as rope scaling, which transformers rewrites on saving, are left out)."""
    a, b = _flat(before), _flat(now)
    return [f"{k} ({a[k]!r} -> {b[k]!r})" for k in sorted(set(a) & set(b))
            if k not in _NOT_MODEL and not isinstance(a[k], dict) and a[k] != b[k]]


def recorded_model(run_dir: str) -> tuple[str, dict] | None:
    """(where, HF config) of the model the run directory's newest checkpoint (else its initial
    embedded model, init_hf) was trained on; None for a fresh directory."""
    from mcore_rl.checkpoint import steps as run_ckpt

    newest = run_ckpt.latest(os.path.join(run_dir, "checkpoints"), warn=lambda _: None)
    candidates = [os.path.join(newest[1], "model", "hf", "config.json")] if newest else []
    candidates.append(os.path.join(run_dir, "init_hf", "config.json"))
    for path in candidates:
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    return path, json.load(f)
            except (OSError, ValueError):
                raise BadInput(f"{path}: the run's model config cannot be read; choose a new "
                               "trainer.output_dir") from None
    return None


def check_resumable(run_dir: str) -> None:
    """A run going on in `run_dir` resumes from its newest complete checkpoint: one saved without
    the optimizer state (trainer.save_optimizer=false) cannot resume exactly, and is refused."""
    from mcore_rl.checkpoint import steps as run_ckpt

    newest = run_ckpt.latest(os.path.join(run_dir, "checkpoints"), warn=lambda _: None)
    if newest is None:
        return
    from mcore_rl.checkpoint import optimizer as optim_state  # torch: only where there is a checkpoint to resume

    if not optim_state.files(newest[1], "model"):
        raise BadInput(f"{newest[1]}: the newest checkpoint holds the model only (saved with "
                       "trainer.save_optimizer=false), so the run cannot resume from it; export it with "
                       f"`python -m mcore_rl.convert mcore-to-hf --ckpt {os.path.join(newest[1], 'model')} --out DIR`, "
                       "or start afresh in a new trainer.output_dir")


def check_same_model(run_dir: str, now: dict | None) -> None:
    """A run going on in `run_dir` must train the model it holds: a changed model is refused
    naming what changed (the checkpoints stay as they are)."""
    held = recorded_model(run_dir) if now is not None else None
    if held is None:
        return
    where, before = held
    changed = model_changes(before, now)
    if changed:
        raise BadInput(f"{run_dir}: the model differs from the one this run directory holds ({where}): "
                       f"{', '.join(changed)}; keep the old model settings to resume it, or start afresh in a "
                       "new trainer.output_dir")
