"""A run's checkpoints: `checkpoints/step_N/`, each complete or never named so.

A save writes `step_N.tmp/` (the actors: models and optimizer states; the driver: the trainer
state), then a manifest of every file and its size, then renames the directory. A checkpoint
counts only if its manifest is there and every file it lists is there at its size, so a
truncated shard, a deleted rank file or a missing trainer state make it incomplete: it is
skipped with a warning naming it, and the run resumes from the newest complete one. Leftover
`.tmp` directories and incomplete ones are moved out of the way, never crashed over.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys

from mcore_rl.preflight.bad_input import BadInput, message

STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"


class CheckpointError(BadInput):
    """A checkpoint or output directory that cannot be used (one line, naming it)."""


class SaveFailed(CheckpointError):
    """A save that could not be written (a full disk, a read-only directory): the checkpoints
    before it are whole, and the message says how to resume."""


def size_text(n: int) -> str:
    """A byte count in the unit that shows it (a tiny model's checkpoint is not "0.0 GiB")."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _files(root: str) -> dict[str, int]:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = os.path.getsize(p)
    return out


def incomplete(step_dir: str) -> str | None:
    """Why `step_dir` is not a complete checkpoint, or None if it is."""
    try:
        with open(os.path.join(step_dir, MANIFEST)) as f:
            listed = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "no readable manifest (the save did not finish)"
    for rel, size in listed.items():
        path = os.path.join(step_dir, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        if os.path.getsize(path) != size:
            return f"{rel} has {os.path.getsize(path)} bytes, the save wrote {size}"
    try:
        with open(os.path.join(step_dir, TRAINER_STATE)) as f:
            json.load(f)
    except (OSError, ValueError):
        return f"{TRAINER_STATE} is missing or unreadable"
    return None


def steps(root: str) -> list[tuple[int, str]]:
    """Every `step_N` directory under root, oldest first (complete or not)."""
    if not os.path.isdir(root):
        return []
    return sorted((int(m.group(1)), os.path.join(root, d)) for d in os.listdir(root) if (m := STEP_DIR.match(d)))


def latest(root: str, warn=lambda msg: print(msg, file=sys.stderr, flush=True)) -> tuple[int, str] | None:
    """The newest complete checkpoint; each newer incomplete one is named in a warning."""
    for step, path in reversed(steps(root)):
        why = incomplete(path)
        if why is None:
            return step, path
        warn(f"warning: skipping incomplete checkpoint {path}: {why}")
    return None


def saves_at(step: int, total: int, save_freq: int, save_last: bool = True) -> bool:
    """Whether step `step` of `total` writes a checkpoint: every save_freq steps (-1 never), and the
    last step unless save_last is off (verl's rule: save_freq alone)."""
    return save_freq > 0 and step % save_freq == 0 or (step == total and save_last)


def read_state(step_dir: str) -> dict:
    with open(os.path.join(step_dir, TRAINER_STATE)) as f:
        return json.load(f)


def _set_aside(path: str) -> None:
    """Remove a directory in the way (a leftover .tmp, an incomplete or abandoned step), renaming
    it first so that a crash during the removal leaves nothing named like a checkpoint."""
    if os.path.lexists(path):
        trash = path.rstrip("/") + ".trash"
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)


class Checkpointer:
    """The driver's side of saving: `begin(step, state)` has the actors write (in the background
    with `background`), `finish()` completes the newest one: trainer state, manifest, rename,
    rotation to the newest `keep` complete checkpoints. The caller finishes a foreground save once
    its step's metrics are logged; a background one once the next step has trained."""

    def __init__(self, root: str, group, hf_dir: str, keep: int | None = None, background: bool = False):
        self.root, self.group, self.hf_dir, self.keep, self.background = root, group, hf_dir, keep, background
        self.pending: tuple[int, dict] | None = None

    def tmp(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step}.tmp")

    def begin(self, step: int, state: dict) -> None:
        self.finish()
        with self._failing_save(step):
            os.makedirs(self.root, exist_ok=True)
            self.check_space()
            _set_aside(self.tmp(step))
            os.makedirs(self.tmp(step))
            self.group.call("save", self.tmp(step), self.background)
        self.pending = (step, state)  # finish() completes it: the caller's, or the next begin()

    @contextlib.contextmanager
    def _failing_save(self, step: int):
        """A save that fails (no space, a read-only directory, a rank's writer) is one line naming
        the step and the cause; its partial files go, the complete checkpoints before it stay."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a Ray error wraps the rank's: its cause is named
            cause = getattr(e, "cause", None) or e
            shutil.rmtree(self.tmp(step), ignore_errors=True)
            first = message(cause).splitlines()[0] if message(cause) else type(cause).__name__
            newest = latest(self.root, warn=lambda _: None)
            then = (f"{newest[1]} (step {newest[0]}) is complete: free space or make {self.root} writable, then "
                    "the same command resumes from it" if newest else
                    f"no checkpoint was saved before: free space or make {self.root} writable and run again")
            raise SaveFailed(f"{self.root}: saving step {step} failed ({type(cause).__name__}: {first}); "
                             f"{then}") from None

    def finish(self) -> str | None:
        if self.pending is None:
            return None
        (step, state), self.pending = self.pending, None
        with self._failing_save(step):
            return self._complete(step, state)

    def _complete(self, step: int, state: dict) -> str:
        tmp, final = self.tmp(step), os.path.join(self.root, f"step_{step}")
        self.group.call("finish_save")
        shutil.copytree(self.hf_dir, os.path.join(tmp, "model", "hf"),
                        ignore=shutil.ignore_patterns("*.safetensors", "*.json.tmp"))
        with open(os.path.join(tmp, TRAINER_STATE), "w") as f:
            json.dump({"step": step, **state}, f)
        listed = _files(tmp)  # before the manifest exists: it does not list itself
        with open(os.path.join(tmp, MANIFEST + ".tmp"), "w") as f:
            json.dump({"step": step, "files": listed}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(tmp, MANIFEST + ".tmp"), os.path.join(tmp, MANIFEST))
        _set_aside(final)  # an incomplete or abandoned step_N of an earlier attempt
        os.replace(tmp, final)
        self.rotate()
        return final

    def check_space(self) -> None:
        """Refuse a save the disk cannot hold, judged by the newest complete checkpoint's size (a
        full disk otherwise fails deep in a writer, with the save half done)."""
        last = latest(self.root, warn=lambda _: None)
        if last is None:
            return
        with open(os.path.join(last[1], MANIFEST)) as f:
            need = sum(json.load(f)["files"].values())
        free = shutil.disk_usage(self.root).free
        if free < need:
            raise SaveFailed(f"{self.root}: a checkpoint needs about {size_text(need)} and {size_text(free)} "
                             f"are free; free space, lower trainer.max_checkpoints or move trainer.output_dir, "
                             f"then the same command resumes from {last[1]}")

    def rotate(self) -> None:
        if self.keep is None:
            return
        complete = [path for _, path in steps(self.root) if incomplete(path) is None]
        for path in complete[:-self.keep]:
            _set_aside(path)

    def clear_after(self, step: int) -> None:
        """Before a run goes on from `step`: leftover .tmp directories and every step_N past it
        (incomplete ones, or an abandoned future) are removed."""
        if not os.path.isdir(self.root):
            return
        for name in os.listdir(self.root):
            if name.endswith(".trash"):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
            elif name.endswith(".tmp"):
                _set_aside(os.path.join(self.root, name))
        for s, path in steps(self.root):
            if s > step:
                _set_aside(path)
