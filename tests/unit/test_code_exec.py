"""The example code-execution tool (mcore_rl/envs/code_exec.py): each limit holds, by running
Python programs that break it in the sandbox's subprocess (seconds each)."""

from __future__ import annotations

import asyncio
import glob
import tempfile
import time

import pytest

from mcore_rl.envs.code_exec import network_isolation, run_code


def run(code: str, **limits):
    return asyncio.run(run_code(code, **limits))


def test_output_and_a_removed_working_directory():
    before = set(glob.glob(f"{tempfile.gettempdir()}/mcore_rl_code_*"))
    r = run("import os; print(6 * 7, os.listdir('.'))")
    assert r.stdout == "42 ['main.py']\n" and r.returncode == 0 and not r.timed_out
    assert set(glob.glob(f"{tempfile.gettempdir()}/mcore_rl_code_*")) == before


def test_no_network():
    if network_isolation() is None:
        pytest.skip("no user namespaces here: the tool refuses to run without network=True")
    r = run("import socket; socket.create_connection(('127.0.0.1', 22), timeout=2)")
    assert r.returncode == 1 and "Network is unreachable" in r.stderr


def test_cpu_memory_wall_clock_and_output_limits():
    t = time.perf_counter()
    assert run("while True: pass", cpu_s=1).returncode == -9  # SIGKILL at the CPU-time hard limit
    assert "MemoryError" in run("x = bytearray(1 << 31)", memory_mb=256).stderr
    r = run("import time; time.sleep(60)", timeout_s=1)
    assert r.timed_out and r.returncode is None
    flood = run("import sys\nfor _ in range(500): sys.stdout.write('x' * 100000)", max_output_bytes=10)
    assert flood.stdout == "x" * 10 and flood.returncode == 0
    assert time.perf_counter() - t < 30


def test_a_caller_timeout_kills_the_program(tmp_path):
    """rollout.tool_timeout_s cancels the tool: the program dies with it (it would write a file at 1.5 s)."""
    marker = tmp_path / "still_running"

    async def cut():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(run_code(f"import time; time.sleep(1.5); open({str(marker)!r}, 'w')"), 0.5)

    t = time.perf_counter()
    asyncio.run(cut())
    assert time.perf_counter() - t < 5
    time.sleep(2.5)
    assert not marker.exists()
