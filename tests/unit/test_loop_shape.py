"""The RL loop reads in one screen (issue 48): `mcore_rl.loop.run._loop` is at most 40 lines and
calls each phase of a step itself, in order, read from its source with ast."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (phase, the call that runs it in _loop)
PHASES = [("generate", "generate"), ("to_train", "to_train"), ("log-probs", "log_probs"),
          ("advantages", "advantages"), ("update", "update"), ("to_rollout, 1st half", "offload"),
          ("save", "_timed_save"), ("to_rollout, 2nd half, the sync", "resume")]


def _loop_node() -> ast.FunctionDef:
    path = os.path.join(ROOT, "mcore_rl", "loop", "run.py")
    tree = ast.parse(open(path).read(), path)
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_loop")


def test_the_loop_fits_a_screen_and_names_each_phase_in_order():
    loop = _loop_node()
    assert loop.end_lineno - loop.lineno + 1 <= 40, f"_loop is {loop.end_lineno - loop.lineno + 1} lines"
    # the loop's own phase functions, and the methods of its Phases (who holds the GPUs)
    calls = sorted((n.lineno, n.col_offset, n.func.id if isinstance(n.func, ast.Name) else n.func.attr)
                   for n in ast.walk(loop) if isinstance(n, ast.Call)
                   and (isinstance(n.func, ast.Name) or isinstance(n.func, ast.Attribute)
                        and isinstance(n.func.value, ast.Name) and n.func.value.id == "phases"))
    names = [name for _, _, name in calls]
    at = [names.index(call) if call in names else -1 for _, call in PHASES]
    missing = [phase for (phase, _), i in zip(PHASES, at) if i < 0]
    assert not missing, f"_loop does not call the phase(s) {missing}"
    order = [phase for (phase, _), _ in sorted(zip(PHASES, at), key=lambda pair: pair[1])]
    assert at == sorted(at), f"_loop calls its phases out of order: {order}"
