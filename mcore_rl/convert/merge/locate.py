"""Find the files of one checkpoint spread over several directories (one per node)."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Iterable

from mcore_rl.convert.hf_io import CheckpointError


def check_dirs(dirs: Iterable[str]) -> list[str]:
    dirs = [os.path.abspath(d) for d in dirs]
    for d in dirs:
        if not os.path.isdir(d):
            raise CheckpointError(f"{d}: not a directory")
    if len(set(dirs)) != len(dirs):
        raise CheckpointError(f"a directory is given twice: {dirs}")
    return dirs


def locate_once(dirs: list[str], names: Iterable[str], what: str = "file") -> dict[str, str]:
    """name -> the one directory of `dirs` holding it; missing or duplicated names are errors."""
    names = list(names)
    found: dict[str, list[str]] = defaultdict(list)
    for d in dirs:
        present = set(os.listdir(d))
        for n in names:
            if n in present:
                found[n].append(d)
    twice = {n: ds for n, ds in found.items() if len(ds) > 1}
    if twice:
        n, ds = next(iter(twice.items()))
        raise CheckpointError(f"{what} {n} is in more than one directory: {', '.join(ds)}")
    missing = [n for n in names if n not in found]
    if missing:
        raise CheckpointError(f"{len(missing)} {what}(s) of the checkpoint not found, e.g. "
                              f"{', '.join(missing[:3])}; searched: {', '.join(dirs)}")
    return {n: ds[0] for n, ds in found.items()}


def find_side_dir(dirs: list[str], sub: str, marker: str = "config.json") -> str | None:
    """The first `dir/sub` holding `marker` (rank 0's node writes config and tokenizer)."""
    for d in dirs:
        if os.path.exists(os.path.join(d, sub, marker)):
            return os.path.join(d, sub)
    return None
