"""`rollout.engine_kwargs`: any argument of the engine itself (SGLang's ServerArgs, vLLM's EngineArgs),
passed through as verl's engine_kwargs and slime's --sglang-* do.

An engine's arguments are built in three layers: the engine defaults we only suggest (`defaults`:
the user's engine_kwargs replace them quietly), then the user's engine_kwargs, then the settings the
run depends on (`ours`: model path, parallel layout, memory, what the weight sync and read-back
assume), which win, each overridden key named in one warning. A key the installed engine does not
take is refused up front (`check_known`, from preflight), naming it; the valid names are read from the
engine's own argument class in a short subprocess, so the driver imports neither engine (on CPU SGLang
needs the stand-ins of mcore_rl.rollout.sglang_cpu) and nothing is started.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import subprocess
import sys

from mcore_rl.preflight.bad_input import BadInput

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE_NAMES = {"sglang": "SGLang's ServerArgs", "vllm": "vLLM's EngineArgs"}
# prints the engine's argument names as JSON: argv engine, device
_LIST_ARGS = r"""
import json, os, sys
engine, device = sys.argv[1], sys.argv[2]
if engine == "sglang":
    if device == "cpu":
        from mcore_rl.rollout import sglang_cpu
        os.environ.update(sglang_cpu.child_env(os.environ))
        sglang_cpu.install()
    import sglang
    from mcore_rl.rollout.sglang import server_arg_names
    names, version = server_arg_names(), sglang.__version__
else:
    import dataclasses, vllm
    from vllm.engine.arg_utils import EngineArgs
    names, version = {f.name for f in dataclasses.fields(EngineArgs)}, vllm.__version__
print("MCORE_RL_ARGS " + json.dumps({"version": version, "names": sorted(names)}))
"""


def merge(defaults: dict, user: dict, ours: dict) -> dict:
    """The engine's arguments: `defaults`, replaced by the user's engine_kwargs, replaced by `ours`."""
    return {**defaults, **user, **ours}


def overridden(user: dict, ours: dict) -> dict[str, tuple]:
    """{key: (the user's value, ours)} for each engine_kwargs key the run sets otherwise."""
    return {k: (v, ours[k]) for k, v in user.items() if k in ours and ours[k] != v}


def warn_overridden(user: dict, ours: dict, engine: str) -> None:
    """One stderr line naming each engine_kwargs key the run's own setting replaces."""
    if over := overridden(user, ours):
        keys = ", ".join(f"{k}={u!r} (kept {o!r})" for k, (u, o) in over.items())
        print(f"warning: rollout.engine_kwargs: the run sets {keys} for {ENGINE_NAMES[engine]} itself; "
              "the engine_kwargs value is ignored", file=sys.stderr, flush=True)


@functools.lru_cache(maxsize=None)
def known_args(engine: str, device: str, timeout_s: float = 300.0) -> tuple[str, frozenset[str]]:
    """(version, argument names) of the installed engine, read from its argument class in a subprocess
    (once per process)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    p = subprocess.run([sys.executable, "-c", _LIST_ARGS, engine, device], capture_output=True, text=True,
                       timeout=timeout_s, env=env, cwd=REPO)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("MCORE_RL_ARGS ")), None)
    if p.returncode or line is None:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise BadInput(f"rollout.engine_kwargs: cannot read {ENGINE_NAMES[engine]} here to check the keys ({tail})")
    got = json.loads(line.split(" ", 1)[1])
    return got["version"], frozenset(got["names"])


def check_known(engine: str, user: dict, device: str) -> None:
    """Refuse, naming it, the first engine_kwargs key the installed engine does not take."""
    if not user or engine not in ENGINE_NAMES:
        return
    version, names = known_args(engine, device)
    for k in user:
        if k not in names:
            close = difflib.get_close_matches(k, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise BadInput(f"rollout.engine_kwargs.{k}: not an argument of {ENGINE_NAMES[engine]} "
                           f"(engine {version}){hint}")
