"""Training curves from a run's metrics.jsonl:  python -m mcore_rl.plot RUN_DIR [--out DIR]

Writes one PNG per panel that has data (reward.png, kl.png, entropy.png, timing.png, plus
length.png and loss.png) and overview.png with all of them, into RUN_DIR/plots by default.
When a resumed run re-logged a step, the last record of that step wins.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Callable

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402

Series = dict[str, tuple[list[int], list[float]]]

# panel -> (title, y label, which metric keys it shows)
PANELS: dict[str, tuple[str, str, Callable[[str], bool]]] = {
    "reward": ("Reward", "score", lambda k: ("score" in k or "reward" in k) and "kl" not in k
               and not k.endswith(("/max", "/min", "/std"))),
    "kl": ("KL", "kl", lambda k: "kl" in k and "clipfrac" not in k),
    "entropy": ("Entropy", "nats", lambda k: "entropy" in k),
    "timing": ("Time per phase", "seconds", lambda k: k.startswith("timing_s/")),
    "length": ("Response length", "tokens", lambda k: k.startswith("response_length/") and "clip" not in k),
    "loss": ("Losses", "loss", lambda k: k.endswith("_loss") or k.endswith("/loss")),
}


def records_by_step(path: str) -> dict[int, dict]:
    """A run's metrics.jsonl as {step: record}. A step's records merge, the later one winning a key
    both have: the loop logs a step twice (its training, then its sync, save and validation)."""
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
                print(f"[plot] skipping unreadable line {line_no} of {path}", file=sys.stderr)
                continue
            by_step.setdefault(int(record["step"]), {}).update(record)
    return by_step


def load_metrics(path: str) -> Series:
    """{metric: (steps, values)} sorted by step, from `records_by_step`."""
    by_step = records_by_step(path)
    series: Series = {}
    for step in sorted(by_step):
        for key, value in by_step[step].items():
            if key in ("step", "time") or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            steps, values = series.setdefault(key, ([], []))
            steps.append(step)
            values.append(float(value))
    return series


def _draw(ax, title: str, ylabel: str, series: Series) -> None:
    for key, (steps, values) in sorted(series.items()):
        ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=key)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def plot_run(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Write the PNGs for RUN_DIR/metrics.jsonl; returns their paths (overview last)."""
    series = load_metrics(os.path.join(run_dir, "metrics.jsonl"))
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    panels = {name: (title, ylabel, {k: v for k, v in series.items() if wants(k)})
              for name, (title, ylabel, wants) in PANELS.items()}
    panels = {name: panel for name, panel in panels.items() if panel[2]}
    if not panels:
        raise ValueError(f"no plottable metrics in {run_dir}/metrics.jsonl (have: {sorted(series)[:20]})")
    written = []
    for name, (title, ylabel, data) in panels.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        _draw(ax, title, ylabel, data)
        fig.tight_layout()
        written.append(os.path.join(out_dir, f"{name}.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    cols = 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(13, 4 * rows), squeeze=False)
    for ax, (title, ylabel, data) in zip(axes.flat, panels.values()):
        _draw(ax, title, ylabel, data)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    written.append(os.path.join(out_dir, "overview.png"))
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot a run's metrics.jsonl to PNG files.")
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="output directory (default RUN_DIR/plots)")
    args = parser.parse_args(argv)
    try:
        paths = plot_run(args.run_dir, args.out)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("\n".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
