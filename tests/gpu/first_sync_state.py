"""Issue 45's first-step defect of a TP > 1 engine: after the first sync its weights read back equal,
yet its log-probs differ from the trainer's (4 layers, TP 2: probe gap 0.35 against 0.03 after the
next sync). Which of the engine's tensors does the first sync leave stale, and what makes them right?

The loop's own start (trainer, colocated SGLang engine, first sync read back and probed), then the
same weights synced again twice: once plainly, once after a release and resume of the engine's
weights (what each later step does). After each sync: the probe's gap, the digest of every tensor
each engine rank holds (parameters, buffers, plain tensor attributes), and each decoder layer's
output in the probe's prefill (rank 0 of engine 0). The weights never change, so a tensor whose
digest moves between the syncs is state the first sync left stale, and the first layer whose
output moves is where it acts.

    python tests/gpu/first_sync_state.py --config configs/moonlight_2gpu.yaml --out first_sync.json \
        rollout.tp_size=2 memory.offload_train_states=auto cluster.host_memory_gb=240
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from mcore_rl.config import checks as config_checks  # noqa: E402
from mcore_rl.config.sections import load_config  # noqa: E402
from mcore_rl.loop.groups import ActorGroup, trainer_placement  # noqa: E402
from mcore_rl.loop.run import _to_rollout_phase  # noqa: E402
from mcore_rl.loop.startup import memory_plan, prepare_model, start_ray  # noqa: E402
from mcore_rl.loop.step_batch import stop_ids  # noqa: E402
from mcore_rl.metrics.console import StartConsole  # noqa: E402
from mcore_rl.preflight.inputs import check_inputs  # noqa: E402
from mcore_rl.rollout.launch import Launching  # noqa: E402


def ray_get(ref):
    import ray

    return ray.get(ref, timeout=300)


def moved(before: dict, after: dict) -> list[str]:
    """Tensors of any engine rank whose digest differs, as 'engine/rank name'."""
    return sorted(f"{e}/{r} {n}" for e, ranks in after.items() for r, d in ranks.items()
                  for n, v in d.items() if before.get(e, {}).get(r, {}).get(n) != v)


def layer_moves(before: torch.Tensor, after: torch.Tensor) -> list[float]:
    """Per decoder layer, |after - before| relative to |before| (mean over tokens and width)."""
    return [round(((a - b).abs().mean() / b.abs().mean().clamp_min(1e-12)).item(), 5) for b, a in zip(before, after)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    cfg = load_config(a.config, [*a.overrides, "rollout.verify_sync_probe=true"])
    inputs = check_inputs(cfg)
    plan = memory_plan(cfg)
    console = StartConsole()
    start_ray(cfg)
    run_dir = tempfile.mkdtemp(prefix="first_sync_")
    hf_dir = prepare_model(cfg, run_dir)
    tok = inputs.train.tokenizer
    pg = trainer_placement(cfg)
    launching = Launching(cfg, hf_dir, run_dir, pg, list(stop_ids(cfg, tok)), tok.pad_token_id or 0, plan, console)
    rows, digests = [], {}
    try:
        group = ActorGroup(cfg, hf_dir, config_checks.initial_weights(cfg), pg, console)
        _to_rollout_phase(cfg, group, console)
        engine = launching.start(group)
        sync = launching.weight_sync(group)
        digests["dummy"] = engine.weight_digests(derived=True)
        hidden, where = {}, os.path.join(run_dir, "hidden", "h")
        tokens = sync.probe.numel()  # the probe's prefill: one forward of its sequences
        for name, release in (("first", False), ("again", False), ("after_release", True), ("again_2", False)):
            if release:
                engine.release(["weights"])
                engine.resume(["weights"])
            ray_get(engine.heads[0].capture_hidden.remote(f"{where}_{name}", tokens))
            metrics = sync(verify=True)
            probe = {**{k: v for k, v in metrics.items() if "probe" in k}, **sync.probe_if_due()}  # the first's inside
            digests[name] = engine.weight_digests(derived=True)
            previous = list(digests)[-2]
            kept = f"{where}_{name}.tp0.pt"
            hidden[name] = torch.load(kept, weights_only=True) if os.path.exists(kept) else None
            rows.append({"sync": name, "released_before": release, "verified": metrics.get("sync/verified"),
                         **{k: round(v, 4) for k, v in probe.items()},
                         "moved_since_" + previous: moved(digests[previous], digests[name])})
            if name != "first" and hidden[name] is not None and hidden["first"] is not None:
                rows[-1]["layer_output_moved_since_first"] = layer_moves(hidden["first"], hidden[name])
            print(json.dumps({k: v if not isinstance(v, list) else f"{len(v)}: {v[:12]}"
                              for k, v in rows[-1].items()}), flush=True)
    finally:
        launching.shutdown()
    with open(a.out + ".tmp", "w") as f:
        json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    os.replace(a.out + ".tmp", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
