"""An example code-execution tool and environment for multi-turn rollouts.

`run_code` runs Python source in a subprocess of its own: CPU seconds, address space, file size
and open files capped with resource.setrlimit, no network (a new network namespace through
`unshare -rn`, which needs unprivileged user namespaces; where it fails the tool refuses to run
unless built with `network=True`), its own session (a timeout kills the whole process group), a
fresh working directory removed afterwards, an empty environment, and its output cut at
`max_output_bytes`. It is a sandbox against mistakes, not against a determined attacker: use a
container or a VM for untrusted code at scale.

`CodeEnv` (rollout.env: mcore_rl.envs.code_exec:CodeEnv) is a ReTool-style environment for models
with a text tokenizer: a model turn holding ```python ...``` gets the program's output back as
`<output>...</output>` (its text encoded once; the model's own tokens are never re-encoded); a turn
without code ends the conversation, scored by the data's rule reward of that turn.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from mcore_rl.rollout.multiturn import SampleInfo, StepResult


@dataclass
class ExecResult:
    stdout: str
    stderr: str
    returncode: int | None  # None: killed at the wall-clock timeout
    timed_out: bool = False


@functools.lru_cache(maxsize=1)
def network_isolation() -> list[str] | None:
    """The command prefix that runs a process without network, or None where this host allows none."""
    try:
        ok = subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return ["unshare", "-rn"] if ok else None


def _limits(cpu_s: int, memory_mb: int, file_mb: int):
    def apply():  # in the child, before exec
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


async def _read(stream, into: bytearray, limit: int) -> None:
    """The stream to its end, keeping its first `limit` bytes (a flood costs no memory here)."""
    while chunk := await stream.read(65536):
        into += chunk[:max(0, limit - len(into))]


async def run_code(code: str, *, timeout_s: float = 10.0, cpu_s: int = 5, memory_mb: int = 512, file_mb: int = 16,
                   max_output_bytes: int = 4096, network: bool = False) -> ExecResult:
    """Run `code` with `python -I` in a sandboxed subprocess (module docstring)."""
    prefix = []
    if not network:
        prefix = network_isolation()
        if prefix is None:
            raise RuntimeError("no network isolation on this host (`unshare -rn` fails: user namespaces off?); "
                               "build the tool with network=True to run code with network access")
    workdir = tempfile.mkdtemp(prefix="mcore_rl_code_")
    try:
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(code)
        proc = await asyncio.create_subprocess_exec(
            *prefix, sys.executable, "-I", "main.py", cwd=workdir, env={"PATH": "/usr/bin:/bin", "HOME": workdir},
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            preexec_fn=_limits(cpu_s, memory_mb, file_mb), start_new_session=True)
        kept = {"out": bytearray(), "err": bytearray()}
        try:
            await asyncio.wait_for(asyncio.gather(_read(proc.stdout, kept["out"], max_output_bytes),
                                                  _read(proc.stderr, kept["err"], max_output_bytes), proc.wait()),
                                   timeout_s)
            timed_out = False
        except (asyncio.TimeoutError, asyncio.CancelledError):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
            timed_out = True
            if asyncio.current_task().cancelling():  # our caller's own timeout: the process is gone, pass it on
                raise
        text = lambda b: bytes(b).decode("utf-8", errors="replace")  # noqa: E731
        return ExecResult(text(kept["out"]), text(kept["err"]), None if timed_out else proc.returncode, timed_out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


CODE_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


class CodeEnv:
    """ReTool-style: code in, its output back, until a turn without code (module docstring)."""

    def __init__(self, timeout_s: float = 10.0, cpu_s: int = 5, memory_mb: int = 512, max_output_bytes: int = 2048,
                 network: bool = False):
        self.limits = dict(timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes,
                           network=network)
        self.tokenizer = None

    async def reset(self, sample: SampleInfo):
        self.tokenizer = sample.tokenizer
        return None

    async def step(self, model_turn: list[int]) -> StepResult:
        text = self.tokenizer.decode(model_turn)  # read only: the context keeps the sampled ids
        found = CODE_BLOCK.search(text)
        if found is None:
            return StepResult(done=True)  # the answer: the data's rule reward scores it
        r = await run_code(found.group(1), **self.limits)
        shown = r.stdout + (f"\n{r.stderr}" if r.stderr else "") + ("\n[timed out]" if r.timed_out else "")
        return StepResult(f"\n<output>\n{shown}\n</output>\n")
