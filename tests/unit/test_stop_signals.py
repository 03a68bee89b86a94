"""A run stopped by SIGTERM or SIGINT (mcore_rl.loop.progress.stop_on_signals): the signal raises Stopped in
the main thread, whatever `except Exception` lies between, and the line printed names the signal,
the step and the checkpoint the same command resumes from. The whole run under SIGTERM:
tests/e2e/test_checkpoints.py."""

from __future__ import annotations

import json
import os
import signal

import pytest

from mcore_rl.loop import progress


@pytest.fixture
def handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    before = dict(progress.PROGRESS)
    yield
    for s, h in saved.items():
        signal.signal(s, h)
    progress.PROGRESS.clear()
    progress.PROGRESS.update(before)


def _complete_checkpoint(root, step: int) -> None:
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text("{}")
    (d / "manifest.json").write_text(json.dumps({"step": step, "files": {"trainer_state.json": 2}}))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_run_with_one_line(sig, tmp_path, handlers):
    root = tmp_path / "checkpoints"
    _complete_checkpoint(root, 4)
    progress.PROGRESS.update(step=7, done=6, total=30, ckpt_root=str(root), signal=None)
    progress.stop_on_signals()
    with pytest.raises(progress.Stopped):
        try:
            os.kill(os.getpid(), sig)
            for _ in range(10**6):  # the handler runs between bytecodes
                pass
        except Exception:  # noqa: BLE001 - what the loop's own handlers do: Stopped passes through
            pytest.fail("Stopped was caught as an Exception")
    name = signal.Signals(sig).name
    assert progress.stopped_line() == (f"error: stopped by {name} during step 7 of 30; the newest complete checkpoint "
                                    f"is {root / 'step_4'} (step 4): the same command resumes from it")


def test_before_any_checkpoint_the_line_says_the_run_starts_again(tmp_path, handlers):
    progress.PROGRESS.update(step=None, done=None, total=None, ckpt_root=str(tmp_path / "checkpoints"), signal="SIGTERM")
    assert progress.stopped_line() == ("error: stopped by SIGTERM before its first step; no checkpoint was saved yet: "
                                    "the same command starts the run again")
    progress.PROGRESS.update(done=3, total=30)  # between two steps
    assert progress.stopped_line().startswith("error: stopped by SIGTERM after step 3 of 30; no checkpoint")
