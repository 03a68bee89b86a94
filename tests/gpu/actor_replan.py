"""The planner's memory prediction for runs actor_bench.py already measured, with today's planner.

Each run's JSON keeps the planner inputs of its worst rank (layout, micro-batch tokens, switches);
this recomputes the prediction from them, so a planner change is checked against every recorded
measurement without a GPU. Prints a table; --out writes JSON.

    python tests/gpu/actor_replan.py benchmarks/gpu/actor_memory_h200x2/*.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def _attention(overrides: list[str]) -> str:
    """The packed attention a recorded run used: its override, else "sdpa" (the actor's default until
    the planner recorded it)."""
    chosen = [o.split("=", 1)[1] for o in overrides if o.startswith("actor.packed_attention=")]
    return chosen[-1] if chosen else "sdpa"


def replan(path: str) -> list[dict]:
    from benchmarks.actor_bench import planner
    from benchmarks.harness import moonlight

    with open(path) as f:
        report = json.load(f)
    hf_cfg = report.get("hf_cfg") or moonlight(report["layers"])  # actor_bench's default --config
    rows = []
    for name, run in report["runs"].items():
        if "peak_gib" not in run:
            continue
        worst = max(run["ranks"], key=lambda r: r["peak_gib"])
        inputs = dict(worst["plan_inputs"])
        inputs.setdefault("packed_attention", _attention(run["overrides"]))
        plan = planner(hf_cfg, inputs)["peak_gib"]
        rows.append(dict(file=os.path.basename(path), run=name, attention=inputs["packed_attention"],
                         micro_tokens=inputs["micro_tokens"], measured_gib=worst["peak_gib"],
                         recorded_plan_gib=run["planner_gib"], plan_gib=plan,
                         err_pct=100 * (plan - worst["peak_gib"]) / worst["peak_gib"]))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+")
    p.add_argument("--out")
    args = p.parse_args(argv)
    missing = [f for f in args.files if not os.path.exists(f)]
    if missing:
        p.error(f"no such file: {missing[0]}")
    rows = [r for f in args.files for r in replan(f)]
    from benchmarks.harness import table, write_json

    keys = ("file", "run", "attention", "micro_tokens", "measured_gib", "recorded_plan_gib", "plan_gib", "err_pct")
    print(table(["file", "run", "attention", "T", "peak GiB", "plan then", "plan now", "err %"],
                [[r[k] for k in keys] for r in rows], 1))
    if args.out:
        write_json({"rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
