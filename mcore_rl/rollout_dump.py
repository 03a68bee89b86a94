"""Each step's rollout on disk (trainer.rollout_dump_dir), and training on it without an engine
(`python -m mcore_rl.train ... --replay DIR`): one fixed batch can then be trained at any
layout, so a trainer-side mismatch (TP, EP, PP) shows up alone, without sampling noise.

A dump `step_N.pt` holds the step's rollout batch as the engine made it (tokens, masks, the
engine's log-probs, and whatever else the rollout carries, such as routed experts), the prompt
index of each sample, its rule score and its shaped reward.
"""

from __future__ import annotations

import os
import re

import torch

from mcore_rl.cli_errors import BadInput

_NAME = re.compile(r"step_(\d+)\.pt$")


class DumpError(BadInput):
    """A replay directory without the dump a step needs, or a dump that is not one."""


def dump_rollout(directory: str, step: int, batch: dict, idx: list[int], score: torch.Tensor,
                 reward: torch.Tensor) -> str:
    """Write step `step`'s rollout to `directory`/step_N.pt (complete or absent: renamed when written)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"step_{step}.pt")
    torch.save({"batch": dict(batch), "index": torch.tensor(idx), "score": score, "reward": reward}, path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


class RolloutReplay:
    """Stands in for the rollout engine in a train-only run: step N trains on step_N.pt."""

    owns_weights = False  # nothing to sync, release or resume

    def __init__(self, directory: str):
        found = sorted(int(m.group(1)) for f in (os.listdir(directory) if os.path.isdir(directory) else [])
                       if (m := _NAME.match(f)))
        if not found:
            raise DumpError(f"{directory}: no rollout dumps (step_N.pt) to replay")
        self.directory, self.steps = directory, found

    def step_batch(self, step: int) -> tuple[dict, list[int], torch.Tensor, torch.Tensor, dict]:
        """(batch, idx, score, reward, metrics) as dynamic_sampling.sample_step_batch gives them."""
        path = os.path.join(self.directory, f"step_{step}.pt")
        if not os.path.exists(path):
            raise DumpError(f"{path}: no dump for step {step} (the directory has steps {self.steps})")
        d = torch.load(path, weights_only=True)
        missing = {"batch", "index", "score", "reward"} - set(d)
        if missing:
            raise DumpError(f"{path}: not a rollout dump (lacks {sorted(missing)})")
        return dict(d["batch"]), d["index"].tolist(), d["score"], d["reward"], {}

    def shutdown(self) -> None:
        pass
