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
