"""What a run prints per step (`trainer.console`).

short (the default): one line a step that a person can read at a glance,

    step 12/30 | reward 0.512 | val 0.620 | 1.21 s/step | ETA 0:22

and, where stdout is a terminal, a progress bar kept on the last line. full: every metric of every
log call, the long lines of `MetricsLogger`'s console backend. Either way every metric still goes
to metrics.jsonl and TensorBoard.

Also what every process leaves out: megatron-core's warnings about its own fallbacks, which no
user acts on (`quiet_fallback_warnings`); a run names the missing accelerators once instead
(`accelerators_line`).
"""

from __future__ import annotations

import importlib
import sys
import time
import warnings

BAR_WIDTH = 30


def clock(seconds: float) -> str:
    """h:mm:ss, or m:ss under an hour."""
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class StepConsole:
    """Short per-step lines for a run of `total` steps that starts after step `start` (a resume)."""

    def __init__(self, total: int, start: int = 0, stream=None):
        self.total, self.start = total, start
        self.stream = stream or sys.stdout
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = self.last = time.perf_counter()
        self._bar_shown = False

    def line(self, step: int, metrics: dict, step_s: float, eta_s: float) -> str:
        parts = [f"step {step}/{self.total}"]
        if metrics.get("reward/mean") is not None:
            parts.append(f"reward {metrics['reward/mean']:.3f}")
        if metrics.get("val/reward") is not None:
            parts.append(f"val {metrics['val/reward']:.3f}")
        parts += [f"{step_s:.2f} s/step", f"ETA {clock(eta_s)}"]
        return " | ".join(parts)

    def show(self, step: int, metrics: dict) -> None:
        """The line of `step` (all its metrics, merged), timed from the step before."""
        now = time.perf_counter()
        step_s, self.last = now - self.last, now
        done = step - self.start
        eta = (now - self.t0) / done * (self.total - step) if done > 0 else 0.0
        self._print(self.line(step, metrics, step_s, eta))
        if self.tty:
            frac = step / self.total if self.total else 1.0
            filled = int(BAR_WIDTH * frac)
            self.stream.write(f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {100 * frac:3.0f}%")
            self.stream.flush()
            self._bar_shown = True

    def note(self, text: str) -> None:
        """A line outside the steps (validation before training)."""
        self._print(text)

    def _print(self, text: str) -> None:
        if self._bar_shown:  # the bar's line becomes this one
            self.stream.write("\r\x1b[K")
            self._bar_shown = False
        print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar_shown:
            self.stream.write("\n")
            self.stream.flush()
            self._bar_shown = False


# optional accelerators megatron-core falls back from: (name, module)
ACCELERATORS = (("TransformerEngine", "transformer_engine"), ("Apex", "apex"))

# what megatron-core (and torch beneath it) warns about in every process, at import or first use,
# none of it the user's to act on: (message regex, module regex)
_NOT_ACTIONABLE = (
    (r"(Transformer Engine and Apex are|Apex is) not installed", r"megatron\."),
    (r"full scope is deprecated", r"megatron\."),  # megatron's own cuda_graph_scope default
    (r"The \.grad attribute of a Tensor that is not a leaf", r"megatron\."),
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", r"torch\."),
)


def quiet_fallback_warnings() -> None:
    """Silence the warnings above in this process (idempotent); call before megatron is imported.
    A run names the missing accelerators once instead (`accelerators_line`)."""
    for message, module in _NOT_ACTIONABLE:  # filterwarnings replaces an identical filter
        warnings.filterwarnings("ignore", message=message, module=module)


def missing_accelerators() -> list[str]:
    return [name for name, module in ACCELERATORS if not importable(module)]


def accelerators_line() -> str:
    missing = missing_accelerators()
    if not missing:
        return "optional accelerators: " + ", ".join(name for name, _ in ACCELERATORS) + " present"
    return (f"optional accelerators not installed: {', '.join(missing)} "
            "(megatron-core uses its local PyTorch fallbacks)")


def importable(module: str) -> bool:
    """Whether `module` imports (absent, or present but unusable: megatron falls back either way)."""
    try:
        importlib.import_module(module)
    except Exception:  # absent, or present but unusable: megatron falls back either way
        return False
    return True
