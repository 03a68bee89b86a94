"""Starting an engine's own processes from the Ray actor that hosts it."""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def children_skip_main():
    """multiprocessing's spawned children (SGLang's scheduler and detokenizer, vLLM's engine core)
    first run their parent's main script again, as `__mp_main__`: in a Ray actor that is Ray's worker
    script, which imports Ray, seconds of CPU in each child for nothing (their targets live in the
    engines' modules). A main module without `__file__`, as in an interactive session, is not rerun."""
    main = sys.modules.get("__main__")
    path = None
    if main is not None and getattr(main, "__spec__", None) is None:  # a script, not `python -m`
        path = main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        if path is not None:
            main.__file__ = path


def _titled_process_class():
    import multiprocessing

    class Titled(multiprocessing.get_context("fork").Process):
        """A forked child that names itself after its target before running it (SGLang's
        `run_scheduler_process` -> `sglang::scheduler`, as `ps` shows a spawned one). SGLang's own
        setproctitle cannot retitle a child forked from a Ray worker, whose argv Ray's copy of
        setproctitle already took over; Ray's copy can."""

        def run(self):
            target = getattr(self._target, "__name__", "")
            if target.startswith("run_") and target.endswith("_process"):
                try:
                    from ray._raylet import setproctitle
                except ImportError:  # not in a Ray worker: SGLang's own call will do
                    pass
                else:
                    setproctitle(f"sglang::{target[4:-8]}")
            super().run()

    return Titled


@contextlib.contextmanager
def children_forked(module):
    """`module`'s `multiprocessing.Process` children (SGLang's engine module: its scheduler and
    detokenizer) forked from this process instead of spawned: they inherit its imports (SGLang,
    torch, transformers) where a spawned child imports them again, 7-11 s of CPU for each of an
    engine's processes. Only where no CUDA context exists yet (a CPU engine): a fork does not carry
    one. `module` takes `import multiprocessing as mp`; its `mp.set_start_method` becomes a no-op,
    as it would force "spawn" for every later child of this process."""
    import multiprocessing

    class Forking:
        Process = _titled_process_class()

        @staticmethod
        def set_start_method(*args, **kwargs) -> None:
            pass

        def __getattr__(self, name):
            return getattr(multiprocessing, name)

    old, module.mp = module.mp, Forking()
    try:
        yield
    finally:
        module.mp = old
