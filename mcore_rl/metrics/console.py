"""What a run prints per step (`trainer.console`).

short (the default): one line a step that a person can read at a glance,

    step 12/30 | reward 0.512 | val 0.620 | 1.21 s/step | ETA 0:22

and, where stdout is a terminal, a progress bar kept on the last line. full: every metric of every
log call, the long lines of `MetricsLogger`'s console backend. Either way every metric still goes
to metrics.jsonl and TensorBoard.

Before the first step, `StartConsole` prints one line per start-up phase with its seconds,

    start: building the trainer's model 12.3 s

and, while a phase runs longer than a few seconds, a line saying what is running (on a terminal,
kept on the last line and replaced by the phase's line when it ends).

Also what every process leaves out: megatron-core's warnings about its own fallbacks, which no
user acts on (`quiet_fallback_warnings`); a run names the missing accelerators once instead
(`accelerators_line`).
"""

from __future__ import annotations

import contextlib
import importlib
import re
import sys
import threading
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


START_PREFIX = "start: "
PARALLEL = " (in parallel)"  # ends the name of a phase that ran beside the others
_START_DONE = re.compile(r"^start: (.+?) (failed after )?(\d+\.\d) s$")
_START_READY = re.compile(r"^start: ready for step (\d+) after (\d+\.\d) s$")
STILL_RUNNING_S = 5.0  # a phase still running after this long says so (a compile, a slow load)


class StartConsole:
    """One line per start-up phase, `start: <phase> <seconds> s`, in the order they end; a phase
    running longer than `still_running_s` first prints `start: <phase> ...` (on a terminal that
    line is replaced when the phase ends). A phase that ran beside the others (the engines'
    processes importing their engine while the trainer builds) says so: `start: <phase> (in
    parallel) <seconds> s` (`parallel`). `done()` ends with the total."""

    def __init__(self, stream=None, still_running_s: float = STILL_RUNNING_S):
        self.stream = stream or sys.stdout
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.still_running_s = still_running_s
        self.t0 = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()
        self._running = ""  # on a terminal: the running phase's line, shown without its end of line

    @contextlib.contextmanager
    def phase(self, name: str):
        t = time.perf_counter()
        timer = threading.Timer(self.still_running_s, lambda: self._write(f"{START_PREFIX}{name} ...", running=True))
        timer.daemon = True
        timer.start()
        failed = True
        try:
            yield
            failed = False
        finally:
            timer.cancel()
            self._ended(name, time.perf_counter() - t, failed)

    def parallel(self, name: str, seconds: float, failed: bool = False) -> None:
        """The line of a phase that ran beside the others for `seconds` (timed by its caller)."""
        self._ended(name + PARALLEL, seconds, failed, beside=True)

    def _ended(self, name: str, seconds: float, failed: bool, beside: bool = False) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self._write(f"{START_PREFIX}{name} " + (f"failed after {seconds:.1f} s" if failed else f"{seconds:.1f} s"),
                    beside=beside)

    def done(self, what: str = "ready for step 1") -> None:
        self._write(f"{START_PREFIX}{what} after {time.perf_counter() - self.t0:.1f} s")

    def _write(self, text: str, running: bool = False, beside: bool = False) -> None:
        """running: a phase's `...` line, which on a terminal stays open until the next line
        replaces it; beside: a parallel phase's line, under which that open line shows again."""
        with self._lock:
            again = self._running if beside else ""
            if self._running:
                self.stream.write("\r\x1b[K")
            self.stream.write(text + ("" if running and self.tty else "\n"))
            self._running = text if running and self.tty else again
            if again:
                self.stream.write(again)
            self.stream.flush()


def start_record(lines) -> dict:
    """A run's start-up as its console printed it (StartConsole's lines among any others):
    {"phases": [[name, seconds], ...] in the order they ended, "parallel": the same of the phases
    that ran beside those (their seconds overlap theirs; the names without PARALLEL), "failed": the
    phase that failed or None, "ready_for_step": n, "ready_s": seconds from the first phase to
    then} (the last two None when the run never got there)."""
    out = {"phases": [], "parallel": [], "failed": None, "ready_for_step": None, "ready_s": None}
    for line in lines:
        line = line.rstrip("\n")
        if m := _START_READY.match(line):
            out["ready_for_step"], out["ready_s"] = int(m[1]), float(m[2])
        elif m := _START_DONE.match(line):
            if m[1].endswith(PARALLEL):
                out["parallel"].append([m[1][:-len(PARALLEL)], float(m[3])])
                continue
            out["phases"].append([m[1], float(m[3])])
            out["failed"] = m[1] if m[2] else out["failed"]
    return out
