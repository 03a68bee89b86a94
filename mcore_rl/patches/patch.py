"""One patch: its name, why it exists, what applies it and the release it works around."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Patch:
    name: str
    why: str
    fn: Callable[[], None]
    upstream: str = "megatron-core 0.16.1"  # the release whose behaviour it works around
