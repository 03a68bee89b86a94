"""Each step's rollout on disk (trainer.rollout_dump_dir), and training on it without an engine
(`python -m mcore_rl.train ... --replay DIR`): one fixed batch can then be trained at any
layout, so a trainer-side mismatch (TP, EP, PP) shows up alone, without sampling noise.

A dump `step_N.pt` holds the step's rollout batch as the engine made it (tokens, masks, the
engine's log-probs, and whatever else the rollout carries, such as routed experts), the prompt
index of each sample, its rule score and its shaped reward, and the HF config of the model that
made it: a replay into another model (or vocabulary) is refused, naming what differs.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile

import torch

from mcore_rl.preflight.bad_input import BadInput
from mcore_rl.loop.step_batch import StepBatch
from mcore_rl.models.checks import num_experts
from mcore_rl.preflight.run_dir import model_changes

_NAME = re.compile(r"step_(\d+)\.pt$")


class DumpError(BadInput):
    """A replay directory without the dump a step needs, or a dump that is not one."""


KEYS = {"batch", "index", "score", "reward"}


def dump_rollout(directory: str, step: int, batch: dict, idx: list[int], score: torch.Tensor,
                 reward: torch.Tensor, model: dict | None = None) -> str:
    """Write step `step`'s rollout to `directory`/step_N.pt (complete or absent: renamed when
    written); model: the HF config of the model that sampled it."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"step_{step}.pt")
    torch.save({"batch": dict(batch), "index": torch.tensor(idx), "score": score, "reward": reward,
                "model": model}, path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def load_dump(path: str, model: dict | None = None) -> dict:
    """A dump, checked: readable, a rollout dump, made by `model` (where both say), its token ids
    within the model's vocabulary and its routed experts within its experts."""
    try:
        d = torch.load(path, weights_only=True)
    except pickle.UnpicklingError:  # weights_only refused an object: not something dump_rollout wrote
        raise DumpError(f"{path}: not a rollout dump (it holds objects other than tensors and plain values)") \
            from None
    except (RuntimeError, OSError, EOFError, zipfile.BadZipFile, ValueError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise DumpError(f"{path}: truncated or not a torch file ({first})") from None
    missing = KEYS - set(d) if isinstance(d, dict) else KEYS
    if missing or not isinstance(d["batch"], dict) or "tokens" not in d["batch"]:
        raise DumpError(f"{path}: not a rollout dump (lacks {sorted(missing) or ['batch tokens']})")
    if model is not None:
        _check_model(path, d, model)
    return d


def _check_model(path: str, d: dict, model: dict) -> None:
    if d.get("model") is not None:
        changed = model_changes(d["model"], model)
        if changed:
            raise DumpError(f"{path}: dumped by another model than this run's: {', '.join(changed)}")
    vocab, tokens = model.get("vocab_size"), d["batch"]["tokens"]
    if vocab and tokens.numel() and int(tokens.max()) >= vocab:
        raise DumpError(f"{path}: token id {int(tokens.max())} is outside the model's vocabulary of {vocab} "
                        "(dumped with another tokenizer or model)")
    routes, experts = d["batch"].get("routes"), num_experts(model)
    if routes is not None and routes.numel() and int(routes.max()) >= max(experts, 1):
        raise DumpError(f"{path}: routed expert {int(routes.max())} is outside the model's {experts} experts "
                        "(dumped with another model)")


def dumps_in(directory: str) -> list[int]:
    """The steps of the dumps in `directory`, oldest first."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(int(m.group(1)) for f in names if (m := _NAME.match(f)))


def check_replay(directory: str, model: dict | None) -> None:
    """`--replay DIR` before anything starts: DIR holds dumps, each a whole torch file, the first
    one a rollout dump of this run's model (each further one is checked as its step loads it)."""
    if not os.path.isdir(directory):
        kind = "not a directory" if os.path.exists(directory) else "no such directory"
        raise DumpError(f"{directory}: {kind} (--replay takes a trainer.rollout_dump_dir)")
    steps = dumps_in(directory)
    if not steps:
        raise DumpError(f"{directory}: no rollout dumps (step_N.pt) to replay")
    for step in steps:  # a cut-off file lacks the zip directory at its end: found without reading it all
        path = os.path.join(directory, f"step_{step}.pt")
        if not zipfile.is_zipfile(path):
            raise DumpError(f"{path}: truncated or not a torch file (no zip directory at its end)")
    load_dump(os.path.join(directory, f"step_{steps[0]}.pt"), model)


class ReplaySource:
    """The batch source of a train-only run (--replay DIR): step N trains on step_N.pt; no engine,
    so nothing to sync or validate on."""

    sync = validation_engine = None

    def __init__(self, directory: str, model: dict | None = None):
        found = dumps_in(directory)
        if not found:
            raise DumpError(f"{directory}: no rollout dumps (step_N.pt) to replay")
        self.directory, self.steps, self.model = directory, found, model

    def next_batch(self, step: int) -> StepBatch:
        path = os.path.join(self.directory, f"step_{step}.pt")
        if not os.path.exists(path):
            raise DumpError(f"{path}: no dump for step {step} (the directory has steps {self.steps})")
        d = load_dump(path, self.model)
        return StepBatch(dict(d["batch"]), d["index"].tolist(), d["score"], d["reward"])

    def shutdown(self) -> None:
        pass
