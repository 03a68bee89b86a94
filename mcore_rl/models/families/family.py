"""What the code reads about one architecture family, declared in one record per family."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from mcore_rl.models.families.mapping import Mapping


def _none(hf: dict) -> list[str]:
    return []


@dataclass(frozen=True)
class Family:
    mapping: Mapping  # HF <-> Megatron names: every conversion, the weight sync and the memory plan expand it
    defaults: dict[str, dict]  # model_type -> what its config.json may leave out (transformers' and SGLang's values)
    direct_load: tuple[str, ...] = ()  # model_types SGLang takes by direct copy (rollout.sync_load=direct)
    fp32_router: bool = False  # SGLang may hold the router weight in fp32: the sync sends it so
    # what SGLang's own model class would build otherwise: one line per problem (the config check refuses them)
    sglang_problems: Callable[[dict], list[str]] = field(default=_none)

    def __post_init__(self):
        if set(self.defaults) != set(self.mapping.model_types):
            raise ValueError(f"family {self.mapping.name}: defaults for {sorted(self.defaults)}, "
                             f"mapping for {sorted(self.mapping.model_types)}")
