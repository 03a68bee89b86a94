"""Training curves from a run's metrics.jsonl:  python -m mcore_rl.metrics.plot RUN_DIR [--out DIR]

Writes one PNG per panel that has data (reward, kl, entropy, loss, length, time per phase, host
memory and GPU memory per phase against the memory plan) and overview.png with all of them, into
RUN_DIR/plots by default. A CPU run measures no GPU memory and makes no memory plan: its host
memory panel has the readings alone and says so. The keys are the ones mcore_rl.train logs (one
record a step); when a resumed run re-logged a step, the last record of that step wins.
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
from matplotlib.ticker import MaxNLocator  # noqa: E402

Series = dict[str, tuple[list[int], list[float]]]

# a step's phases in order (mcore_rl.train): the figures of each, summed from the keys logged
PHASE_TIMES: dict[str, tuple[str, ...]] = {
    "rollout": ("timing/rollout",),
    "to_train": ("timing/to_train",),
    "log-probs": ("timing/old_log_prob", "timing/ref", "timing/values"),
    "update": ("timing/update_critic", "timing/update_actor"),
    "save": ("timing/save",),
    "sync": ("sync/seconds",),
    "validate": ("timing/validate",),
}
# timing/to_rollout holds the save and the sync: the rest is the hand-over itself (offloads, resumes)
TO_ROLLOUT = "timing/to_rollout"
MEMORY_PHASES = ("rollout", "train", "save", "sync")


REWARD_KEYS = ("reward/mean", "val/reward", "critic/rewards/mean", "critic/score/mean")  # preferred first


# panel -> (title, y label, which metric keys it shows)
PANELS: dict[str, tuple[str, str, Callable[[str], bool]]] = {
    "reward": ("Reward", "score", lambda k: k in REWARD_KEYS),
    "kl": ("KL", "kl", lambda k: "kl" in k and "clipfrac" not in k),
    "entropy": ("Entropy", "nats", lambda k: "entropy" in k),
    "loss": ("Losses", "loss", lambda k: k.endswith("_loss") or k.endswith("/loss")),
    "length": ("Response length", "tokens", lambda k: k.startswith("response/length")),
    "timing": ("Time per phase", "seconds", lambda k: k == TO_ROLLOUT or any(k in v for v in PHASE_TIMES.values())),
    "host_memory": ("Host memory per phase: RSS peak", "GiB",
                    lambda k: k.startswith(("memory/host_rss_peak_gib_", "plan/host_"))),
    "gpu_memory": ("GPU memory per phase: peak", "GiB",
                   lambda k: k.startswith(("memory/gpu_peak_gib_", "plan/gpu_"))),
}


def distinct(series: Series) -> Series:
    """One line per quantity: a series equal to one kept before it at every step is drawn as that
    one, whose label names them all (critic/score/mean is reward/mean; critic/rewards/mean is too
    without a KL penalty in the reward): "reward/mean = critic/score/mean"."""
    kept: dict[str, tuple[list[str], tuple[list[int], list[float]]]] = {}
    for key, (steps, values) in series.items():
        same = next((k for k, (_, (s, v)) in kept.items() if steps == s and all(
            math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(values, v))), None)
        if same is None:
            kept[key] = ([key], (steps, values))
        else:
            kept[same][0].append(key)
    return {" = ".join(names): line for names, line in kept.values()}


def phase_times(series: Series) -> Series:
    """Seconds per phase of each step, from the timing keys (phases a run never logged are absent)."""
    steps = sorted({s for k, (st, _) in series.items() if k.startswith("timing/") for s in st})
    at = {k: dict(zip(*series[k])) for k in series}
    out: Series = {}
    for phase, keys in PHASE_TIMES.items():
        if any(k in at for k in keys):
            out[phase] = (steps, [sum(at.get(k, {}).get(s, 0.0) for k in keys) for s in steps])
    if TO_ROLLOUT in at:
        inner = [sum(at.get(k, {}).get(s, 0.0) for k in ("timing/save", "sync/seconds")) for s in steps]
        out["to_rollout"] = (steps, [max(0.0, at[TO_ROLLOUT].get(s, 0.0) - i) for s, i in zip(steps, inner)])
    order = ("rollout", "to_train", "log-probs", "update", "save", "to_rollout", "sync", "validate")
    return {p: out[p] for p in order if p in out and any(out[p][1])}


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


def _finish(ax, title: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def _draw_lines(ax, series: Series) -> None:
    for key, (steps, values) in series.items():
        ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=key)


def _draw_phases(ax, series: Series) -> None:
    """Stacked bars: each step's time split into its phases, in the order they run."""
    bottom: dict[int, float] = {}
    for phase, (steps, values) in phase_times(series).items():
        ax.bar(steps, values, bottom=[bottom.get(s, 0.0) for s in steps], label=phase, width=0.8)
        for s, v in zip(steps, values):
            bottom[s] = bottom.get(s, 0.0) + v


def _draw_memory(ax, series: Series) -> None:
    """Each phase's measured peak as a line, the plan's budget for it as a dashed line in its colour
    (dotted where planned each step)."""
    steps = sorted({s for k, (st, _) in series.items() if "_peak_gib_" in k for s in st})
    colors = dict(zip(MEMORY_PHASES, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for key, (st, values) in sorted(series.items()):
        phase = key.rsplit("_", 1)[-1]
        if "_peak_gib_" in key:
            ax.plot(st, values, marker=".", color=colors.get(phase), label=f"{phase} peak")
        elif len(st) > 1:  # a plan of each step (plan/gpu_gib_step_train: for the micro-batches it ran)
            ax.plot(st, values, linestyle=":", color=colors.get(phase, "black"), label=key.removeprefix("plan/"))
        elif steps:  # the start-up plan's keys are logged once, at the run's first record
            ax.hlines(values[-1], min(steps), max(steps), colors=colors.get(phase, "black"),
                      linestyles="--", label=key.removeprefix("plan/"))


DRAW = {"timing": _draw_phases, "host_memory": _draw_memory, "gpu_memory": _draw_memory}


def _draw(ax, name: str, title: str, ylabel: str, series: Series) -> None:
    DRAW.get(name, _draw_lines)(ax, series)
    _finish(ax, title, ylabel)


def select_panels(series: Series) -> dict[str, tuple[str, str, Series]]:
    """{panel: (title, y label, its series)} for each panel with something to draw."""
    panels = {}
    for name, (title, ylabel, wants) in PANELS.items():
        data = {k: v for k, v in sorted(series.items()) if wants(k)}
        if name == "reward":
            data = distinct({k: data[k] for k in REWARD_KEYS if k in data})
        measured = phase_times(data) if name == "timing" else \
            {k: v for k, v in data.items() if not k.startswith("plan/")}  # a plan alone is no reading
        if name in ("host_memory", "gpu_memory"):  # CPU runs make no plan (mcore_rl.loop.startup.memory_plan)
            title += ", no plan in this run" if len(measured) == len(data) else ", dashed: the plan"
        if measured:
            panels[name] = (title, ylabel, data)
    return panels


def plot_run(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Write the PNGs for RUN_DIR/metrics.jsonl; returns their paths (overview last)."""
    series = load_metrics(os.path.join(run_dir, "metrics.jsonl"))
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    panels = select_panels(series)
    if not panels:
        raise ValueError(f"no plottable metrics in {run_dir}/metrics.jsonl (have: {sorted(series)[:20]})")
    written = []
    for name, (title, ylabel, data) in panels.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        _draw(ax, name, title, ylabel, data)
        fig.tight_layout()
        written.append(os.path.join(out_dir, f"{name}.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    cols = 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(13, 4 * rows), squeeze=False)
    for ax, (name, (title, ylabel, data)) in zip(axes.flat, panels.items()):
        _draw(ax, name, title, ylabel, data)
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
