"""The run's console: one short line a step (step i/N, reward, validation reward, seconds, ETA), a
progress bar only on a terminal; engine processes write to log files without import warnings."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from mcore_rl.config import sections as C
from mcore_rl.metrics.console import StartConsole, StepConsole, clock, start_record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_one_short_line_a_step_without_a_bar_off_a_terminal():
    out = io.StringIO()
    c = StepConsole(total=30, start=0, stream=out)
    c.show(1, {"reward/mean": 0.125, "timing/step": 0.3, "actor/pg_loss": 1.0})
    c.show(2, {"reward/mean": 0.5, "val/reward": 0.75})
    c.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in out.getvalue()
    assert lines[0].startswith("step 1/30 | reward 0.125 | ") and "s/step | ETA " in lines[0]
    assert "pg_loss" not in lines[0] and "val" not in lines[0]
    assert lines[1].startswith("step 2/30 | reward 0.500 | val 0.750 | ")


def test_a_terminal_gets_a_progress_bar_on_its_last_line():
    out = _Tty()
    c = StepConsole(total=4, start=2, stream=out)  # a run resumed after step 2
    c.show(3, {"reward/mean": 0.1})
    c.show(4, {"reward/mean": 0.2})
    c.close()
    text = out.getvalue()
    assert text.count("/4 | reward") == 2 and "step 3/4" in text and "step 4/4" in text
    assert text.rstrip().endswith("100%") and "\r\x1b[K" in text  # the bar is replaced, not stacked


def test_start_up_phases_one_line_each_with_seconds_and_a_line_while_a_long_one_runs():
    import re
    import time

    out = io.StringIO()
    c = StartConsole(stream=out, still_running_s=60)  # no phase here runs that long
    with c.phase("building the trainer's model"):
        pass
    with pytest.raises(RuntimeError), c.phase("first weight sync"):
        raise RuntimeError("engine gone")
    c.done()
    lines = out.getvalue().splitlines()
    assert re.fullmatch(r"start: building the trainer's model \d+\.\d s", lines[0]), lines
    assert re.fullmatch(r"start: first weight sync failed after \d+\.\d s", lines[1]), lines
    assert re.fullmatch(r"start: ready for step 1 after \d+\.\d s", lines[2]) and len(lines) == 3, lines
    assert set(c.seconds) == {"building the trainer's model", "first weight sync"}
    rec = start_record(["(MegatronActor pid=1) something else\n", *lines])  # as benchmarks read a run's output
    assert [n for n, _ in rec["phases"]] == ["building the trainer's model", "first weight sync"]
    assert rec["failed"] == "first weight sync" and rec["ready_for_step"] == 1 and rec["ready_s"] >= 0
    # a phase running longer than still_running_s says so first; its line then gives the seconds
    out = io.StringIO()
    c = StartConsole(stream=out, still_running_s=0.01)
    with c.phase("starting the sglang engines"):
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    assert lines[0] == "start: starting the sglang engines ..." and len(lines) == 2, lines
    assert re.fullmatch(r"start: starting the sglang engines \d+\.\d s", lines[1]) and c.seconds[
        "starting the sglang engines"] >= 0.3, lines
    # on a terminal the running line is replaced by the phase's own
    tty = _Tty()
    c = StartConsole(stream=tty, still_running_s=0.01)
    with c.phase("compiling"):
        time.sleep(0.3)
    assert tty.getvalue().startswith("start: compiling ...\r\x1b[Kstart: compiling ")


def test_a_parallel_phase_says_so_and_is_kept_apart_from_the_serial_ones():
    """A phase that ran beside the others (the engines' imports while the trainer builds): its line
    says so, start_record keeps it out of the serial phases (whose seconds the total may not
    exceed), and on a terminal the running phase's open line shows again under it."""
    import re
    import time

    out = io.StringIO()
    c = StartConsole(stream=out, still_running_s=60)
    with c.phase("building the trainer's model"):
        c.parallel("importing SGLang", 12.34)
    c.parallel("warming a cache", 0.5, failed=True)
    c.done()
    lines = out.getvalue().splitlines()
    assert lines[0] == "start: importing SGLang (in parallel) 12.3 s" and len(lines) == 4, lines
    assert lines[2] == "start: warming a cache (in parallel) failed after 0.5 s", lines
    rec = start_record(lines)
    assert rec["phases"] == [["building the trainer's model", rec["phases"][0][1]]] and rec["failed"] is None
    assert rec["parallel"] == [["importing SGLang", 12.3], ["warming a cache", 0.5]], rec
    tty = _Tty()
    c = StartConsole(stream=tty, still_running_s=0.01)
    with c.phase("building"):
        time.sleep(0.3)  # its running line is open
        c.parallel("importing SGLang", 1.0)
    assert re.fullmatch(r"start: building \.\.\.\r\x1b\[Kstart: importing SGLang \(in parallel\) 1\.0 s\n"
                        r"start: building \.\.\.\r\x1b\[Kstart: building 0\.\d s\n", tty.getvalue()), repr(tty.getvalue())


def test_clock():
    assert clock(5) == "0:05" and clock(125) == "2:05" and clock(3725) == "1:02:05"


def test_an_engine_process_writes_to_its_log_file_without_import_warnings(tmp_path):
    """The engine actor's redirect reaches the processes it starts, and so do its warning filters."""
    log = tmp_path / "logs" / "engine_0_node0.log"
    code = ("import subprocess, sys, warnings\n"
            "from mcore_rl.rollout import engine_logs\n"
            "engine_logs.to_log_file(sys.argv[1])\n"
            "print('engine started')\n"
            "warnings.warn('Only CUDA, HIP and XPU support AWQ currently.')\n"
            "subprocess.run([sys.executable, '-c', 'import warnings; print(\"child\"); "
            "warnings.warn(\"Transformer Engine and Apex are not installed. Falling back\"); "
            "warnings.warn(\"a real problem\")'])\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    r = subprocess.run([sys.executable, "-c", code, str(log)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and r.stderr == ""  # nothing left for Ray to forward to the driver
    text = log.read_text()
    assert "engine started" in text and "child" in text and "a real problem" in text
    assert "Only CUDA" not in text and "Transformer Engine" not in text


def test_console_is_a_typed_config_key():
    tiny = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
    assert C.load_config(tiny).trainer.console == "short"
    assert C.load_config(tiny, ["trainer.console=full"]).trainer.console == "full"
    with pytest.raises(C.ConfigError, match="trainer.console"):
        C.load_config(tiny, ["trainer.console=long"])
