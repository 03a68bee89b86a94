"""The side-install policy: a missing reference fails its tests unless explicitly opted out."""

from __future__ import annotations

import subprocess
import sys

from pathlib import Path

import pytest

from tests.support.side_install import SideInstall

REPO = Path(__file__).resolve().parents[2]


def _outcome(tmp_path, monkeypatch, **env) -> str:
    for var in ("MCORE_RL_NO_SIDE_INSTALL", "MCORE_RL_NO_NOPKG_INSTALL", "MCORE_RL_REQUIRE_NOPKG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MCORE_RL_NOPKG_DIR", str(tmp_path / "side"))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # a wheel path that does not exist: pip fails at once, without asking any registry
    side = SideInstall("nopkg", "0", (str(tmp_path / "missing-0-py3-none-any.whl"),),
                       probe="mcore_rl_no_such_module", timeout_s=120)
    try:
        side.require("mcore_rl_no_such_module")
    except pytest.skip.Exception:
        return "skip"
    except pytest.fail.Exception:
        return "fail"
    return "ok"


def test_missing_reference_fails_by_default(tmp_path, monkeypatch):
    assert _outcome(tmp_path, monkeypatch) == "fail"
    assert not (tmp_path / "side").exists()  # nothing half-installed is left to be mistaken for a copy


@pytest.mark.parametrize("var", ["MCORE_RL_NO_SIDE_INSTALL", "MCORE_RL_NO_NOPKG_INSTALL"])
def test_explicit_opt_out_skips(tmp_path, monkeypatch, var):
    assert _outcome(tmp_path, monkeypatch, **{var: "1"}) == "skip"


def test_require_fails_even_when_opted_out(tmp_path, monkeypatch):
    assert _outcome(tmp_path, monkeypatch, MCORE_RL_NO_SIDE_INSTALL="1", MCORE_RL_REQUIRE_NOPKG="1") == "fail"


def test_prepopulated_directory_is_used_without_installing(tmp_path, monkeypatch):
    pkg = tmp_path / "side" / "mcore_rl_no_such_module"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 42\n")
    try:
        assert _outcome(tmp_path, monkeypatch, MCORE_RL_NO_SIDE_INSTALL="1") == "ok"
        assert sys.modules["mcore_rl_no_such_module"].VALUE == 42
        assert sys.path[-1] == str(tmp_path / "side")  # appended: it cannot shadow the main venv
    finally:
        sys.modules.pop("mcore_rl_no_such_module", None)
        sys.path.remove(str(tmp_path / "side"))


def test_reference_modules_cli_reports_failure(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "MCORE_RL_VERL_DIR": str(tmp_path / "none"), "MCORE_RL_NO_SIDE_INSTALL": "1"}
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['verl'] = None\n"
                           "from tests.support.verl_reference import SIDE, REFERENCE_MODULES; SIDE.main(REFERENCE_MODULES)"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert proc.returncode != 0 and "forbids installing" in proc.stderr, proc.stderr[-2000:]
