"""mcore_rl's SGLang plugin: loaded by SGLang itself (entry-point group `sglang.srt.plugins`) in
every engine process whose path holds `sglang_site/` (the engine actor puts it there), before the
model is built.

- `Scheduler.mcore_rl_weight_digests(path)`: digests of every parameter of this TP rank, written
  atomically to `path.tp{rank}.json`. Reached through `Engine.collective_rpc`, which reports only
  success, hence the file. This is how a sync is read back and verified.
- On CPU, the MLA attention handler for `torch_native` (mcore_rl.rollout.sglang_cpu).
"""

from __future__ import annotations

import json
import os


def weight_digests(model) -> dict:
    from mcore_rl.sync.checksum import digest

    return {name: [str(p.dtype).removeprefix("torch."), list(p.shape), *digest(p.data)]
            for name, p in model.named_parameters()}


def _scheduler_weight_digests(self, path: str) -> None:
    model = self.tp_worker.model_runner.model
    tp_rank = self.ps.tp_rank if hasattr(self, "ps") else self.tp_rank  # 0.5.17+: a parallel-state view
    out = f"{path}.tp{tp_rank}.json"
    with open(out + ".tmp", "w") as f:
        json.dump(weight_digests(model), f)
    os.replace(out + ".tmp", out)


def register() -> None:
    from sglang.srt.managers.scheduler import Scheduler

    Scheduler.mcore_rl_weight_digests = _scheduler_weight_digests
    if os.environ.get("MCORE_RL_SGLANG_CPU") == "1":
        from mcore_rl.rollout.sglang_cpu import register_mla_handler

        register_mla_handler()
