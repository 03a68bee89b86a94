"""What the SGLang and vLLM engine actors (`SGLangServer`, `VLLMServer`) share around their engine:
the process's set-up before the engine's library is imported, a compile watch over the engine's
life, and the processes the engine started."""

from __future__ import annotations

import contextlib
import os
import time

from mcore_rl.rollout import engine_logs, engine_start, jit_cache


class EngineProcess:
    """One engine actor's process. A subclass imports its engine's library after `__init__` and
    builds the engine inside `engine_built`."""

    def __init__(self, library: str, visible_devices: str | None, env: dict | None):
        os.environ.update(env or {})
        engine_logs.to_log_file()  # before the library is imported: its import warnings too
        jit_cache.apply(os.environ.get(jit_cache.DIR_ENV))
        engine_start.mark(f"importing {library}")
        if visible_devices is not None:  # the engine's GPUs, by physical index (Ray gives us one)
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        self.compiles: engine_start.CompileWatch | None = None
        self.start_seconds: float | None = None

    @contextlib.contextmanager
    def engine_built(self, what: str):
        """Around the engine's construction: marks its start and end in the engine's log, sets
        `start_seconds`, and starts the compile watch, which runs for the engine's life (kernels
        compiled on first use are shown as those at the start are)."""
        engine_start.mark(what)
        t0 = time.perf_counter()
        self.compiles = engine_start.CompileWatch().start()
        yield
        self.start_seconds = time.perf_counter() - t0
        engine_start.mark(f"started in {self.start_seconds:.0f} s")

    def stop_watching_compiles(self) -> None:
        if self.compiles is not None:
            self.compiles.stop()
            self.compiles = None

    def child_pids(self) -> list[int]:
        """The engine's processes (schedulers, detokenizer, workers): those a kill must reach."""
        import psutil

        return [p.pid for p in psutil.Process().children(recursive=True)]
