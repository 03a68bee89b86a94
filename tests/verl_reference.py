"""Load verl's own implementations to serve as an independent reference in tests.

verl cannot live in the main venv (it pins transformers < 5.11), so unless `import verl` already
works we pip-install the pinned wheel and the few light modules its `core_algos` imports, all
with --no-deps, into a side directory that is appended (not prepended) to sys.path, so that
nothing in it can shadow the main venv's packages. Set MCORE_RL_VERL_DIR to choose the directory
(CI can pre-populate it); MCORE_RL_NO_VERL_INSTALL=1 forbids the install and skips instead;
MCORE_RL_REQUIRE_VERL=1 turns a skip into a failure (for CI, so the comparisons cannot vanish).
`python -m tests.verl_reference` installs and imports up front, exiting non-zero on failure.
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

VERL_VERSION = "0.9.1"
# what verl.trainer.ppo.core_algos and verl.utils.reward_score import beyond the main venv
SIDE_PACKAGES = [f"verl=={VERL_VERSION}", "tensordict==0.10.0", "omegaconf==2.4.0",
                 "antlr4-python3-runtime==4.9.3", "pyvers==0.2.3", "cloudpickle==3.1.2",
                 "codetiming==1.4.0", "orjson==3.13.0"]


def side_dir() -> str:
    return os.environ.get("MCORE_RL_VERL_DIR") or os.path.join(tempfile.gettempdir(),
                                                               f"mcore_rl_verl_{VERL_VERSION}")


def _install(target: str) -> str | None:
    """pip install the side packages into `target`; returns an error text or None."""
    if os.environ.get("MCORE_RL_NO_VERL_INSTALL") == "1":
        return "MCORE_RL_NO_VERL_INSTALL=1"
    staging = f"{target}.partial-{os.getpid()}"  # renamed into place only when complete
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--target", staging, *SIDE_PACKAGES]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        return proc.stderr.strip()[-2000:]
    try:
        os.rename(staging, target)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return None


@functools.lru_cache(maxsize=None)
def _import(module: str):
    try:
        return importlib.import_module(module), None
    except ImportError:
        pass
    target = side_dir()
    if not os.path.isdir(os.path.join(target, "verl")):
        error = _install(target)
        if error:
            return None, f"could not pip-install verl=={VERL_VERSION} into {target}: {error}"
    if target not in sys.path:
        sys.path.append(target)
    try:
        return importlib.import_module(module), None
    except Exception as e:  # noqa: BLE001 - any import failure means "no reference here"
        return None, f"cannot import {module} from {target}: {type(e).__name__}: {e}"


REFERENCE_MODULES = ("verl.trainer.ppo.core_algos", "verl.utils.reward_score.gsm8k",
                     "verl.utils.reward_score.math_reward")


def verl_module(module: str):
    """Import a verl module (installing verl on the side if needed), or skip the calling test."""
    mod, reason = _import(module)
    if mod is None:
        if os.environ.get("MCORE_RL_REQUIRE_VERL") == "1":
            pytest.fail(f"MCORE_RL_REQUIRE_VERL=1 but {reason}")
        pytest.skip(reason)
    return mod


if __name__ == "__main__":
    for name in REFERENCE_MODULES:
        mod, reason = _import(name)
        if mod is None:
            sys.exit(reason)
    print(side_dir())
