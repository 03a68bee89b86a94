"""Declarative parameter mappings between megatron-core and HuggingFace names.

A mapping is a list of `Rule`s. Each rule names one megatron parameter (as in an unsharded,
TP=PP=EP=1 model, with `{L}` for the global layer and `{E}` for the global expert) and the HF
tensors it is made of, plus how they combine. Every conversion (HF<->Megatron checkpoints,
Megatron->SGLang weight sync, the merger) expands the same list for a concrete config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

if TYPE_CHECKING:  # annotations only: the families' records import this module, and the config command
    import torch  # reads their defaults without importing torch (the transforms import it when they run)

    from mcore_rl.models.config import HFModel

Pred = Callable[["HFModel", int], bool]


def always(m: HFModel, layer: int) -> bool:
    return True


class Transform:
    """How HF tensors combine into one megatron tensor, and back."""

    name = "copy"

    def to_mcore(self, m: HFModel, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        (t,) = tensors
        return t

    def to_hf(self, m: HFModel, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (t,)

    def part_source(self, part: int, parts: int) -> int | None:
        """Which HF tensor is, unchanged, part `part` of the megatron tensor cut into `parts` along
        dim 0 (as megatron's checkpoints store it); None where no one is. A rank then reads only its
        rows of that tensor (mcore_rl.checkpoint.hf_init)."""
        return 0 if parts == 1 else None


class GLU(Transform):
    """megatron's linear_fc1 is [gate; up] along the output dim."""

    name = "glu"

    def to_mcore(self, m, tensors):
        import torch

        return torch.cat(tensors, dim=0)

    def to_hf(self, m, t):
        return tuple(t.chunk(2, dim=0))

    def part_source(self, part, parts):
        return part if parts == 2 else None  # megatron stores gate and up as two tensors


class QKV(Transform):
    """megatron's linear_qkv interleaves heads per KV group: [q_g0 k_g0 v_g0 q_g1 ...]."""

    name = "qkv"

    @staticmethod
    def _dims(m: HFModel):
        g, d = m.num_kv_heads, m.head_dim
        return g, m.num_attention_heads // g * d, d

    def to_mcore(self, m, tensors):
        import torch

        g, qd, d = self._dims(m)
        q, k, v = tensors
        tail = q.shape[1:]
        return torch.cat([q.reshape(g, qd, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail)],
                         dim=1).reshape(-1, *tail)

    def part_source(self, part, parts):
        return None  # each KV group's rows interleave q, k and v

    def to_hf(self, m, t):
        g, qd, d = self._dims(m)
        tail = t.shape[1:]
        q, k, v = t.reshape(g, qd + 2 * d, *tail).split([qd, d, d], dim=1)
        return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


COPY, GLU_, QKV_ = Transform(), GLU(), QKV()


@dataclass(frozen=True)
class Rule:
    mcore: str
    hf: tuple[str, ...]
    transform: Transform = COPY
    when: Pred = always
    per_expert: bool = False

    def __post_init__(self):
        if isinstance(self.hf, str):
            object.__setattr__(self, "hf", (self.hf,))


@dataclass(frozen=True)
class Param:
    """A rule expanded for one layer/expert: concrete names on both sides."""

    mcore: str
    hf: tuple[str, ...]
    transform: Transform
    layer: int | None = None
    expert: int | None = None

    def to_mcore(self, m: HFModel, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.transform.to_mcore(m, tensors)

    def to_hf(self, m: HFModel, t: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(self.hf, self.transform.to_hf(m, t)))


@dataclass(frozen=True)
class Mapping:
    """One architecture's rules: before the layers (embedding), per layer, after (norm, head)."""

    name: str
    model_types: tuple[str, ...]
    pre: tuple[Rule, ...]
    layer: tuple[Rule, ...]
    post: tuple[Rule, ...]

    def params(self, m: HFModel) -> Iterator[Param]:
        """Every parameter of model `m`, in HF file order (embedding, layers, head)."""
        for r in self.pre:
            if r.when(m, -1):
                yield Param(r.mcore, r.hf, r.transform)
        for layer in range(m.num_layers):
            for r in self.layer:
                if not r.when(m, layer):
                    continue
                experts = range(m.num_experts) if r.per_expert else (None,)
                for e in experts:
                    fmt = dict(L=layer, E=e)
                    yield Param(r.mcore.format(**fmt), tuple(h.format(**fmt) for h in r.hf),
                                r.transform, layer, e)
        for r in self.post:
            if r.when(m, -1):
                yield Param(r.mcore, r.hf, r.transform)

    def by_mcore(self, m: HFModel) -> dict[str, Param]:
        return {p.mcore: p for p in self.params(m)}

    def by_hf(self, m: HFModel) -> dict[str, Param]:
        return {h: p for p in self.params(m) for h in p.hf}
