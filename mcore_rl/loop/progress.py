"""Where a run is (`PROGRESS`, set by the loop), and its stop by SIGTERM or SIGINT: one line saying
where it stopped and how to go on."""

from __future__ import annotations

import os
import signal
import threading

from mcore_rl.checkpoint import steps as run_ckpt

# where the run is, for the line a stop by signal prints (set by train and its loop)
PROGRESS: dict = {"step": None, "done": None, "total": None, "ckpt_root": None, "signal": None}


class Stopped(BaseException):
    """SIGTERM or SIGINT: the run stops at once, its engines and workers shut down on the way out.
    A BaseException, as KeyboardInterrupt, so that no `except Exception` takes it for an error."""


def _stop(signum, frame) -> None:
    if PROGRESS["signal"] is not None:  # a second signal while shutting down: out now
        os._exit(128 + signum)
    PROGRESS["signal"] = signal.Signals(signum).name
    raise Stopped(PROGRESS["signal"])


def stop_on_signals() -> None:
    """SIGTERM and SIGINT raise Stopped in the main thread. Installed once Ray has started: its
    core worker's failure handler, chained before Python's, printed a native stack dump first."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _stop)


def resume_hint() -> str:
    """How a run that stopped now goes on: from its newest complete checkpoint, if any."""
    newest = run_ckpt.latest(PROGRESS["ckpt_root"], warn=lambda _: None) if PROGRESS["ckpt_root"] else None
    return (f"the newest complete checkpoint is {newest[1]} (step {newest[0]}): the same command resumes from it"
            if newest else "no checkpoint was saved yet: the same command starts the run again")


def stopped_line() -> str:
    """Where a stopped run stopped, and how to go on."""
    step, done, total = PROGRESS["step"], PROGRESS["done"], PROGRESS["total"]
    where = (f"during step {step} of {total}" if step else f"after step {done} of {total}" if done
             else "before its first step")
    return f"error: stopped by {PROGRESS['signal']} {where}; {resume_hint()}"
