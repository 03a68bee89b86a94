"""docker/Dockerfile.{gpu,cpu}: hadolint, and version pins that agree with pyproject.toml."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from tests.support.cluster_tools import INSTALL_HINT, find_tool

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = {"gpu": REPO / "docker" / "Dockerfile.gpu", "cpu": REPO / "docker" / "Dockerfile.cpu"}
PINNED = re.compile(r'"([A-Za-z0-9_.\-]+(?:\[[A-Za-z0-9_,\-]+\])?==[^"\s]+)"')
# Python version a base image ships (only the bases we use or might switch to).
BASE_PYTHON = {"ubuntu24.04": "3.12", "ubuntu22.04": "3.10", "ubuntu20.04": "3.8"}


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def instructions(path: Path) -> list[str]:
    """Dockerfile instructions with line continuations joined and comments dropped."""
    out, cur = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        cur += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            if cur.strip():
                out.append(cur.strip())
            cur = ""
    return out


def pins(path: Path) -> dict[str, Requirement]:
    found = {}
    for ins in instructions(path):
        if ins.startswith("RUN "):
            for token in PINNED.findall(ins):
                req = Requirement(token)
                found[canonicalize_name(req.name)] = req
    return found


def pinned_version(req: Requirement) -> str:
    (spec,) = req.specifier
    assert spec.operator == "==", req
    return spec.version


def base_python(path: Path) -> str:
    text = path.read_text()
    m = re.search(r"^ARG BASE_IMAGE=(\S+)", text, re.MULTILINE) or re.search(r"^FROM (\S+)", text, re.MULTILINE)
    image = m.group(1)
    if m := re.match(r"python:(\d+\.\d+)", image):
        return m.group(1)
    return next(v for k, v in BASE_PYTHON.items() if k in image)


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_hadolint(kind):
    hl = find_tool("hadolint")
    if hl is None:
        pytest.skip(f"hadolint not installed ({INSTALL_HINT['hadolint']})")
    r = subprocess.run([hl, "--no-color", str(DOCKERFILES[kind])], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_core_dependencies_pinned_and_agree_with_pyproject(kind):
    proj = pyproject()["project"]
    have = pins(DOCKERFILES[kind])
    for dep in proj["dependencies"]:
        want = Requirement(dep)
        name = canonicalize_name(want.name)
        assert name in have, f"{DOCKERFILES[kind].name} does not pin {want.name} (pyproject: {dep})"
        got = have[name]
        version = pinned_version(got)
        assert want.specifier.contains(version, prereleases=True), f"{got} violates pyproject's {dep}"
        assert want.extras <= got.extras, f"{got} lacks extras {want.extras} of pyproject's {dep}"


def test_gpu_image_has_every_gpu_extra_pinned_like_pyproject():
    extras = pyproject()["project"]["optional-dependencies"]
    have = pins(DOCKERFILES["gpu"])
    for extra in ("gpu", "te", "sglang"):
        for dep in extras[extra]:
            want = Requirement(dep)
            got = have.get(canonicalize_name(want.name))
            assert got is not None, f"Dockerfile.gpu does not pin {want.name} (extra [{extra}]: {dep})"
            assert want.specifier.contains(pinned_version(got), prereleases=True), f"{got} violates {dep}"


def test_exact_pins_are_identical_everywhere():
    """An == pin in pyproject (megatron-core, sglang) must be the very same in each image."""
    proj = pyproject()["project"]
    deps = proj["dependencies"] + [d for ds in proj["optional-dependencies"].values() for d in ds]
    exact = {canonicalize_name(r.name): next(iter(r.specifier)).version
             for r in map(Requirement, deps) if len(r.specifier) == 1 and next(iter(r.specifier)).operator == "=="}
    assert exact.get("megatron-core") == "0.16.1"
    for path in DOCKERFILES.values():
        have = pins(path)
        for name, version in exact.items():
            if name in have:
                assert pinned_version(have[name]) == version, f"{path.name}: {have[name]} != pyproject {version}"


def test_torch_builds_and_constraints():
    for kind, index, version in (("cpu", "https://download.pytorch.org/whl/cpu", "2.13.0"),
                                 ("gpu", "https://download.pytorch.org/whl/cu130", "2.14.1")):
        runs = [i for i in instructions(DOCKERFILES[kind]) if i.startswith("RUN ")]
        torch_run = next(r for r in runs if f'"torch=={version}"' in r)
        assert f"--index-url {index}" in torch_run, f"{kind}: torch must come from {index}"
        # the later installs are constrained to the same torch
        assert f'echo "torch=={version}"' in torch_run
        assert pinned_version(pins(DOCKERFILES[kind])["torch"]) == version
        assert all("-c /" in r for r in runs if "megatron-core==" in r or "transformer-engine" in r)


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_base_image_python_satisfies_requires_python(kind):
    requires = SpecifierSet(pyproject()["project"]["requires-python"])
    assert requires.contains(base_python(DOCKERFILES[kind]) + ".0"), (kind, requires)
