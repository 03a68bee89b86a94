"""`python -m mcore_rl.train --config configs/NAME.yaml [dotted.key=value ...] [--dry-run]`: the RL loop.

Per step (mcore_rl/loop/run.py, `_loop`): generate -> to_train -> log-probs -> advantages -> update
-> save -> to_rollout and the weight sync. The loop's modules are in mcore_rl/loop/.
`--dry-run` validates everything and prints the placement and the memory plan, starting nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from mcore_rl.config import sections as C
from mcore_rl.config import checks as config_checks
from mcore_rl.preflight.bad_input import BAD_INPUT, BadInput, message, report
from mcore_rl.metrics.console import StartConsole, quiet_fallback_warnings
from mcore_rl.loop.placement_deadline import PlacementTimeout
from mcore_rl.loop.progress import PROGRESS, resume_hint, stopped_line
from mcore_rl.loop.sampling import RefillsExhausted
from mcore_rl.memory.gpus import GpuSelectionError
from mcore_rl.memory.planner import MemoryPlanError
from mcore_rl.memory.plan import plan_for_config
from mcore_rl.preflight.inputs import check_inputs
from mcore_rl.rollout.base import EngineError
from mcore_rl.checkpoint.steps import SaveFailed


PLAN_REFUSED = "memory plan REFUSED"


def dry_run(cfg: C.Config) -> list[str]:
    """What a run of `cfg` would start, as lines: trainer ranks, engines, sync, memory plan."""
    from mcore_rl.rollout.placement import plan_placement  # lazy: imports Ray (2 s), which a bad input's line never needs

    c, p = cfg.cluster, cfg.parallel
    world = config_checks.actor_gpus(cfg)
    units = "GPUs" if c.device == "gpu" else "processes"  # on CPU a gloo process stands in for a GPU
    model = cfg.model.hf_path or "embedded hf_config (random init)"
    if cfg.model.hf_path and not os.path.isdir(cfg.model.hf_path):
        model += " (not on this machine; needed at run time)"
    lines = [f"model: {model}", f"cluster: {c.nnodes} node(s) x {c.n_gpus_per_node} {units}, device {c.device}",
             f"trainer: {world} Megatron ranks on {units} 0..{world - 1}: TP={p.tp} PP={p.pp} EP={p.ep} "
             f"ETP={p.etp} DP={world // (p.tp * p.pp)}, {cfg.model.dtype}"]
    if cfg.rollout.engine == "embedded":
        lines.append("rollout: embedded engine on the trainer's own shards (no sync)")
    else:
        lines += plan_placement(cfg).describe(units)
        check = "a log-prob check" if cfg.rollout.engine == "vllm" else "read-back"
        lines.append(f"weight sync: {config_checks.transport_for(cfg)}, verified by {check} after the first sync"
                     + (f" and every {cfg.rollout.verify_sync_every} steps" if cfg.rollout.verify_sync_every else ""))
    if c.device == "gpu":
        try:
            plan, source = plan_for_config(cfg)
            lines += ["memory plan per GPU (capacity from " + source + "):", *plan.table().splitlines()]
        except MemoryPlanError as e:
            lines += [*(e.plan.table().splitlines() if e.plan else []), f"{PLAN_REFUSED}: {e}"]
        except GpuSelectionError as e:
            lines.append(f"memory plan: not made here ({e})")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mcore_rl.train", description=__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--dry-run", action="store_true", help="validate and print the placement and memory plan")
    p.add_argument("--replay", metavar="DIR", help="train on the rollouts dumped to DIR (trainer.rollout_dump_dir), "
                                                   "without an engine")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    a = p.parse_intermixed_args(argv)  # options may follow the overrides
    quiet_fallback_warnings()  # the driver imports megatron too (plans, sync layout)
    try:
        cfg = C.load_config(a.config, a.overrides)
        # the same checks for both; a dry run plans for the cluster it names: its model files
        # need not be on this machine
        console = None if a.dry_run else StartConsole()  # the run's start-up phases, its checks the first
        inputs = check_inputs(cfg, dry_run=a.dry_run, replay=a.replay, console=console)
        if a.dry_run:
            lines = dry_run(cfg)
            print("\n".join(lines))
            # as the run would end: a refused memory plan stops it (exit 1, as python -m mcore_rl.memory.plan)
            return 1 if any(line.startswith(PLAN_REFUSED) for line in lines) else 0
    except BAD_INPUT as e:
        return report(e)
    # lazy: Ray, megatron, transformers and the engines, which the checks and --dry-run answer without
    from mcore_rl.loop.run import train

    t0 = time.perf_counter()
    try:
        m = train(cfg, inputs, replay=a.replay, stop_on_signal=True, start_console=console)
    except SaveFailed as e:  # a full disk, a read-only directory: the checkpoint before is whole
        report(e)
        return 1
    except (GpuSelectionError, BadInput, RefillsExhausted, PlacementTimeout) as e:
        return report(e)  # BadInput: checkpoints, dumps, a second run that took the lock first, ...
    except OSError as e:  # a file the run writes (metrics, dumps) on a full or read-only disk
        print(f"error: {message(e)}; {resume_hint()}", file=sys.stderr, flush=True)
        return 1
    except EngineError as e:  # an engine died or hung mid-run (its message names it): rerunning resumes
        cause = getattr(e, "cause", None) or e  # met by a trainer rank in a weight sync: Ray wraps it
        print(f"error: {cause}; the same command resumes from the last checkpoint", file=sys.stderr)
        return 1
    except MemoryPlanError as e:  # from memory_plan, before anything started
        if e.plan is not None:
            print(e.plan.table())
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - last: a stop by signal, whatever it interrupted: one line
        if PROGRESS["signal"] is None:
            raise
        print(stopped_line(), file=sys.stderr, flush=True)
        return 128 + getattr(signal, PROGRESS["signal"])
    print(f"done in {time.perf_counter() - t0:.0f}s: " + json.dumps({k: round(v, 4) for k, v in m.items()
                                                                    if k.startswith(("reward", "val"))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
