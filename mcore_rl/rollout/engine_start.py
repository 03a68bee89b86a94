"""What an engine is doing while it starts, and later while it compiles kernels, shown on the
driver's console.

An engine's start-up can take minutes (weights, KV cache, CUDA graphs, and on a fresh node kernels
compiled on first use: flashinfer's TRT-LLM all-reduce fusion sat in nvcc for minutes at TP 4) while
its own output goes to its log file (`engine_logs`). The engine actor marks its phases in that log
(`mark`), and a thread (`CompileWatch`) names each compiler the engine's processes run (nvcc, ptxas,
ninja: what they build); the driver, waiting, reads the newest phase from the log (`latest_phase`,
SGLang's and vLLM's own start-up lines too where their log level shows them) and prints which engine
nodes are starting, for how long and doing what: from PROGRESS_S seconds on, when a phase changes and
otherwise every HEARTBEAT_S (mcore_rl.rollout.group). A node whose log is on another machine shows its
seconds only. Past the start, a generate or log-prob call that waits on a compile says so alike.
"""

from __future__ import annotations

import os
import threading
import time

MARK = "[mcore_rl] engine start:"
PROGRESS_S = 10.0  # the driver's first line for engines still starting, and the least time between two
HEARTBEAT_S = 60.0  # between two lines while no engine's phase changes
POLL_S = 5.0  # how often the driver looks
COMPILING = "compiling "  # how a CompileWatch's mark begins
COMPILERS = ("nvcc", "cicc", "ptxas", "ninja", "nvlink", "fatbinary", "cudafe++", "cc1plus")
TAIL_BYTES = 1 << 16
TARGET_CHARS = 80  # the most of a compile target a console line shows
# lines of the engines' own logs (info level) -> the phase they begin
ENGINE_PHASES = (
    ("Load weight begin", "loading weights"),
    ("Load weight end", "weights loaded; allocating the KV cache"),
    ("KV Cache is allocated", "KV cache allocated"),
    ("Capture cuda graph begin", "capturing CUDA graphs"),
    ("Capture cuda graph end", "CUDA graphs captured"),
    ("Loading weights took", "weights loaded"),  # vLLM
    ("Compiling a graph", "torch.compile"),  # vLLM
    ("Capturing CUDA graph", "capturing CUDA graphs"),  # vLLM
)


def mark(phase: str) -> None:
    """Record that this engine process begins `phase` (its stdout is the engine's log file)."""
    print(f"{MARK} {phase}", flush=True)


def compile_target(name: str, cmdline: list[str]) -> str:
    """What a compiler process builds: nvcc's `-o` output or ninja's `-C` directory, as the last two
    path components (flashinfer's `trtllm_comm/csrc_trtllm_allreduce_fusion.cuda.o`); else its name."""
    for flag in ("-o", "-C"):
        if flag in cmdline[:-1]:
            path = "/".join(cmdline[cmdline.index(flag) + 1].rstrip("/").split("/")[-2:])
            # flashinfer names a prefill kernel by its every template argument, 400 characters: its
            # family (the head) and the instance (the tail) tell it apart on a console line
            return path if len(path) <= TARGET_CHARS else path[:30] + "..." + path[-(TARGET_CHARS - 33):]
    return name


class CompileWatch:
    """While running, marks each compiler process among this process's descendants (with what it
    builds) and, when none runs any more, for how long they ran. The engine actors run one from
    their engine's start to its end: kernels compiled on first use (flashinfer's prefill at the
    first request) are marked as those at the start are."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mcore_rl-compile-watch", daemon=True)

    def start(self) -> "CompileWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def compiling(self) -> list[str]:
        import psutil

        out = []
        for p in psutil.Process().children(recursive=True):
            try:
                name = p.name()
                if name in COMPILERS:
                    out.append(f"{compile_target(name, p.cmdline())} ({name})")
            except psutil.Error:  # gone meanwhile
                continue
        return sorted(set(out))

    def _run(self) -> None:
        shown, since = [], None
        while not self._stop.wait(self.interval_s):
            now = self.compiling()
            if now and now != shown:
                since = since or time.monotonic()
                mark(COMPILING + ", ".join(now[:3]) + (f" and {len(now) - 3} more" if len(now) > 3 else ""))
            elif not now and since is not None:
                mark(f"compiles done after {time.monotonic() - since:.0f} s")
                since = None
            shown = now


def latest_phase(log_path: str | None) -> str | None:
    """The newest start-up phase in an engine's log file: our marks and the engines' own lines."""
    if not log_path or not os.path.exists(log_path):
        return None
    with open(log_path, "rb") as f:
        f.seek(max(0, os.path.getsize(log_path) - TAIL_BYTES))
        lines = f.read().decode("utf-8", "replace").splitlines()
    for line in reversed(lines):
        if MARK in line:
            return line.split(MARK, 1)[1].strip()
        for text, phase in ENGINE_PHASES:
            if text in line:
                return phase
    return None
