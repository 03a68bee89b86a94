"""Reference packages that cannot live in the main venv, pip-installed on the side for tests.

verl pins versions of transformers/torch that conflict with ours, so when such a package
does not import from the main venv its pinned wheels are pip-installed with --no-deps into a side
directory that is appended (not prepended) to sys.path: nothing there can shadow the main venv.

Policy: a test that needs a reference FAILS when the reference cannot be installed or imported.
CI has PyPI access, and a silent skip would hide lost coverage. Environment:
- MCORE_RL_NO_SIDE_INSTALL=1 (or, per package, MCORE_RL_NO_<NAME>_INSTALL=1): never pip-install;
  tests whose reference is missing are skipped instead (offline machines). An already
  populated side directory is still used.
- MCORE_RL_<NAME>_DIR: the side directory (CI can pre-populate it); default
  <tmp>/mcore_rl_<name>_<version>.
- MCORE_RL_REQUIRE_<NAME>=1: failing is the default now; with an opt-out it still fails instead
  of skipping (no install either: for a CI that pre-populates the directory).
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import pytest

OPT_OUT = "MCORE_RL_NO_SIDE_INSTALL"


@dataclass(frozen=True)
class SideInstall:
    name: str  # e.g. "verl": also the environment variables' <NAME>
    version: str
    packages: tuple[str, ...]  # pinned requirements, installed together with --no-deps
    probe: str  # a module that imports from the main venv when the package is installed there
    timeout_s: int = 900
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def _env(self, what: str) -> str:
        return f"MCORE_RL_{what.format(self.name.upper())}"

    def directory(self) -> str:
        return os.environ.get(self._env("{}_DIR")) or os.path.join(
            tempfile.gettempdir(), f"mcore_rl_{self.name}_{self.version}")

    def install_forbidden_by(self) -> str | None:
        """The opt-out variable that is set (no pip install; missing means skipped), or None."""
        for var in (OPT_OUT, self._env("NO_{}_INSTALL")):
            if os.environ.get(var) == "1":
                return var
        return None

    def install(self, target: str) -> str | None:
        """pip-install the pinned packages into `target` (staged, renamed when complete); error text or None."""
        var = self.install_forbidden_by()
        if var:
            return f"{var}=1 forbids installing it"
        staging = f"{target}.partial-{os.getpid()}"
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--target", staging, *self.packages]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s)
            error = None if proc.returncode == 0 else proc.stderr.strip()[-2000:]
        except (OSError, subprocess.TimeoutExpired) as e:
            error = f"{type(e).__name__}: {e}"
        if error:
            shutil.rmtree(staging, ignore_errors=True)
            return error
        try:
            os.rename(staging, target)
        except OSError:  # another process finished first
            shutil.rmtree(staging, ignore_errors=True)
        return None

    def load(self, module: str, prepare=None):
        """(module, None), or (None, why not). From the main venv if the package is there, else
        from the side directory, installed first if absent. `prepare()` runs before the import."""
        if module in self._cache:
            return self._cache[module]
        try:
            importlib.import_module(self.probe)
        except ImportError:
            target = self.directory()
            if not os.path.isdir(os.path.join(target, self.probe.split(".")[0])):
                error = self.install(target)
                if error:
                    return self._cache.setdefault(module, (None, f"could not pip-install {self.name}=="
                                                                 f"{self.version} into {target}: {error}"))
            if target not in sys.path:
                sys.path.append(target)
        try:
            if prepare is not None:
                prepare()
            result = importlib.import_module(module), None
        except Exception as e:  # noqa: BLE001 - any import failure means "no reference here"
            result = None, f"cannot import {module}: {type(e).__name__}: {e}"
        return self._cache.setdefault(module, result)

    def require(self, module: str, prepare=None):
        """The module, or fail the calling test (skip it only under an explicit opt-out)."""
        mod, reason = self.load(module, prepare)
        if mod is None:
            self.unavailable(reason)
        return mod

    def unavailable(self, reason: str):
        var = self.install_forbidden_by()
        if var and os.environ.get(self._env("REQUIRE_{}")) != "1":
            pytest.skip(f"{self.name} reference unavailable ({var}=1): {reason}")
        pytest.fail(f"{self.name} reference unavailable: {reason}\n(offline? set {OPT_OUT}=1 to skip "
                    f"these tests, or pre-populate {self._env('{}_DIR')})", pytrace=False)

    def main(self, modules, prepare=None) -> None:
        """`python -m tests.<x>_reference`: install and import up front, exit non-zero on failure."""
        for name in modules:
            mod, reason = self.load(name, prepare)
            if mod is None:
                sys.exit(reason)
        print(self.directory())
