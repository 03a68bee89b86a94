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
    """How HF tensors combine into one megatron tensor, and back.

    Every transform here only puts whole rows (dim 0) of its HF tensors in another order, so it is
    described by `runs`: the megatron tensor's rows, top to bottom, as runs of rows of its HF
    tensors. The converter builds the tensor from them; a trainer rank reads from them only the
    rows of its own slice (mcore_rl.checkpoint.hf_init)."""

    name = "copy"

    def runs(self, m: HFModel, rows: Sequence[int]) -> list[tuple[int, int, int]]:
        """(i, start, stop): rows [start, stop) of HF tensor i, for HF tensors of `rows` rows each;
        ValueError where those are not the sizes model `m` has (each row used exactly once)."""
        runs = self._runs(m, rows) if len(rows) == self.tensors else []
        used = [0] * len(rows)
        for i, a, b in runs:
            used[i] += b - a if 0 <= a <= b <= rows[i] else -1
        if not runs or used != list(rows):
            raise ValueError(f"HF tensors of {list(rows)} rows do not make one {self.name} tensor of this model")
        return runs

    tensors = 1  # HF tensors it combines

    def _runs(self, m: HFModel, rows: Sequence[int]) -> list[tuple[int, int, int]]:
        return [(0, 0, rows[0])]

    def to_mcore(self, m: HFModel, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        import torch

        rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        runs = self.runs(m, rows)
        if len(runs) == 1 and runs[0] == (0, 0, rows[0]):
            return tensors[0]  # a copy, as it is (a scalar too)
        return torch.cat([tensors[i][a:b] for i, a, b in runs], dim=0)

    def to_hf(self, m: HFModel, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (t,)


class GLU(Transform):
    """megatron's linear_fc1 is [gate; up] along the output dim."""

    name, tensors = "glu", 2

    def _runs(self, m, rows):
        return [(i, 0, n) for i, n in enumerate(rows)]

    def to_hf(self, m, t):
        return tuple(t.chunk(2, dim=0))


class QKV(Transform):
    """megatron's linear_qkv interleaves heads per KV group: [q_g0 k_g0 v_g0 q_g1 ...]."""

    name, tensors = "qkv", 3

    @staticmethod
    def _dims(m: HFModel):
        g, d = m.num_kv_heads, m.head_dim
        return g, m.num_attention_heads // g * d, d

    def _runs(self, m, rows):
        g, qd, d = self._dims(m)
        return [(i, k * w, (k + 1) * w) for k in range(g) for i, w in enumerate((qd, d, d))]

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
