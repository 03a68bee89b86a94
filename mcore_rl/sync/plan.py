"""The weight-sync plan: which trainer rank produces, sends and receives which HF tensor, in which bucket.

Computed once from the declarative mapping (`mcore_rl.models.mappings.mapping_for`), the trainer's
megatron layout and the SGLang engine layout, before any transfer. Rules it enforces:
- routed experts travel per expert (`mlp.experts.{i}.gate_proj.weight`, ...) and only to the
  engine ranks that own expert i, so nobody ever builds a fused [E, 2I, H] tensor;
- q_a_proj and kv_a_proj_with_mqa of a layer always share a bucket (SGLang fuses them only when
  both arrive in the same load_weights call; split, the fused parameter silently stays stale);
- GPUs per node come from the placement (`EngineLayout.gpus_per_node`), never a default;
- with FP8 engine weights (`weight_dtype="fp8"`) every weight the engine runs in FP8
  (`engine_layout.runs_in_fp8`) travels as e4m3 with its `weight_scale_inv` beside it, in the
  same bucket (the engine needs both to use either); the linear weights it keeps in the model's
  dtype at its layout (its config's ignored_layers) travel as they are, with no scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mcore_rl.models.mappings import Param, mapping_for
from mcore_rl.sync import fp8
from mcore_rl.sync.engine_layout import EngineLayout, SyncPlanError, hf_shape, keeps_fp32, runs_in_fp8
from mcore_rl.models.config import HFModel, stage_layers, validate_layout
from mcore_rl.parallel.groups import Layout


@dataclass(frozen=True)
class Tensor:
    """One HF tensor the sync moves."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    param: Param = field(repr=False)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class RankBucket:
    """What one trainer rank does for one bucket."""

    gather: list[Param] = field(default_factory=list)  # megatron params it assembles (collectives)
    sends: list[tuple[str, int]] = field(default_factory=list)  # (hf name, destination rank)
    recvs: list[tuple[str, int]] = field(default_factory=list)  # (hf name, source rank)
    payload: list[Tensor] = field(default_factory=list)  # what its engine rank loads, in order

    @property
    def payload_bytes(self) -> int:
        return sum(t.nbytes for t in self.payload)


def trainer_coords(rank: int, world: int, layout: Layout) -> tuple[int, int, int]:
    """(pp_rank, tp_rank, ep_rank) of a trainer rank in megatron's default rank order
    (tp-cp-dp-pp for dense groups, etp-ep-edp inside a pipeline stage for expert groups)."""
    per_stage = world // layout.pp
    pp_rank, in_stage = divmod(rank, per_stage)
    return pp_rank, in_stage % layout.tp, (in_stage // layout.etp) % layout.ep


@dataclass
class SyncPlan:
    hf: HFModel
    trainer: Layout
    world: int
    engine: EngineLayout
    tensors: dict[str, Tensor]
    holders: dict[str, list[int]]  # megatron param -> trainer ranks that hold it after gathering
    buckets: list[dict[int, RankBucket]]  # per bucket: trainer rank -> its part
    engine_rank_of: dict[int, int]  # trainer rank -> engine tp rank whose payload it produces
    outputs: dict[str, tuple[str, ...]] = field(default_factory=dict)  # megatron param -> HF tensors sent

    def names_of(self, p: Param) -> tuple[str, ...]:
        """The HF tensors param p becomes on the wire: its HF names, plus their scales in FP8."""
        return self.outputs.get(p.mcore, p.hf)

    @classmethod
    def build(cls, hf: HFModel, trainer: Layout, world: int, engine: EngineLayout,
              engine_rank_of: dict[int, int], bucket_bytes: int = 512 << 20,
              dtype: torch.dtype = torch.bfloat16, weight_dtype: str = "bf16") -> "SyncPlan":
        """`engine_rank_of` maps each trainer rank that feeds an engine to its engine tp rank:
        the colocated rank on the same GPU (CUDA IPC; with several data-parallel engines every
        tp rank appears once per engine), or {0: every engine rank}-style single source for NCCL
        broadcast / disk (pass `single_source(engine)`). `weight_dtype="fp8"`: the weights the
        engine runs in FP8 are quantized in the sync (`mcore_rl.sync.fp8`)."""
        engine.validate(hf)
        if weight_dtype not in ("bf16", "fp8"):
            raise SyncPlanError(f"weight_dtype={weight_dtype!r}: use 'bf16' or 'fp8'")
        if weight_dtype == "fp8" and not hf.is_mla:
            raise SyncPlanError(f"FP8 engine weights are wired for DeepSeek-V3-style (MLA) models, not {hf.model_type}")
        try:
            validate_layout(hf, trainer.tp, trainer.pp, trainer.ep, trainer.etp)
        except ValueError as e:
            raise SyncPlanError(f"trainer layout: {e}") from None
        if world % (trainer.tp * trainer.pp) or (world // trainer.pp) % (trainer.ep * trainer.etp):
            raise SyncPlanError(f"trainer world size {world} does not fit TP={trainer.tp} PP={trainer.pp} "
                            f"EP={trainer.ep} ETP={trainer.etp}")
        if bucket_bytes <= 0:
            raise SyncPlanError(f"bucket_bytes={bucket_bytes} must be positive")
        bad = sorted(r for r in engine_rank_of if not 0 <= r < world)
        if bad:
            raise SyncPlanError(f"trainer ranks {bad} do not exist in a world of {world}")
        fed = sorted(engine_rank_of.values())
        single = fed == [-1]
        copies = len(fed) // engine.tp_size  # data-parallel engines, each fed by its own trainer ranks
        if not single and (copies == 0 or fed != sorted(list(range(engine.tp_size)) * copies)):
            raise SyncPlanError(f"engine ranks fed by the trainer are {fed}; need each of 0..{engine.tp_size - 1} "
                            "once per engine (mismatched GPU counts?)")
        params = list(mapping_for(hf).params(hf))
        stages = stage_layers(hf.num_layers, trainer.pp)
        coords = [trainer_coords(r, world, trainer) for r in range(world)]
        tensors, holders, outputs = {}, {}, {}
        for p in params:
            for h in p.hf:
                tensors[h] = Tensor(h, hf_shape(hf, h), torch.float32 if keeps_fp32(h, hf) else dtype, p)
            if weight_dtype == "fp8" and runs_in_fp8(p.hf[0], hf, engine):
                scales = tuple(fp8.scale_name(h) for h in p.hf)
                for h, s in zip(p.hf, scales):
                    tensors[h] = Tensor(h, tensors[h].shape, fp8.E4M3, p)
                    tensors[s] = Tensor(s, hf_shape(hf, s), torch.float32, p)
                outputs[p.mcore] = p.hf + scales
            holders[p.mcore] = [r for r, (pp_rank, _, ep_rank) in enumerate(coords)
                                if _holds(p, pp_rank, ep_rank, stages, hf, trainer)]
            if not holders[p.mcore]:
                raise SyncPlanError(f"no trainer rank holds {p.mcore}")
        plan = cls(hf, trainer, world, engine, tensors, holders, [], dict(engine_rank_of), outputs)
        plan._bucket(params, bucket_bytes, single)
        return plan

    def _needs(self, p: Param, single: bool) -> list[int]:
        """Trainer ranks whose engine rank must receive param p."""
        if single:
            return list(self.engine_rank_of)
        if p.expert is None:
            return sorted(self.engine_rank_of)
        return sorted(t for t, r in self.engine_rank_of.items()
                      if p.expert in self.engine.experts_of(r, self.hf.num_experts))

    def _bucket(self, params: list[Param], cap: int, single: bool) -> None:
        units: list[list[Param]] = []
        pending_qa: dict[int, list[Param]] = {}
        for p in params:  # q_a_proj waits for its kv_a_proj_with_mqa so both share a unit
            if p.hf[0].endswith("self_attn.q_a_proj.weight"):
                pending_qa[p.layer] = [p]
                continue
            if p.hf[0].endswith("self_attn.kv_a_proj_with_mqa.weight") and p.layer in pending_qa:
                units.append(pending_qa.pop(p.layer) + [p])
                continue
            units.append([p])
        units.extend(pending_qa.values())
        current: dict[int, RankBucket] = {}
        filled = dict.fromkeys(self.engine_rank_of, 0)  # current's payload bytes per rank, kept as it grows
        for unit in units:
            dests = {p.mcore: self._needs(p, single) for p in unit}
            size = {t: sum(self.tensors[h].nbytes for p in unit if t in dests[p.mcore] for h in self.names_of(p))
                    for t in self.engine_rank_of}
            if current and any(filled[t] + size[t] > cap for t in size if size[t]):
                self.buckets.append(current)
                current, filled = {}, dict.fromkeys(self.engine_rank_of, 0)
            for p in unit:
                self._place(p, dests[p.mcore], current)
            for t, n in size.items():
                filled[t] += n
        if current:
            self.buckets.append(current)
        # larger itemsizes first: every tensor stays aligned in the flat buffer; then in the order of the
        # engine's parameters, so a layer's experts lie in the bucket as in SGLang's stacked w13/w2 and
        # a direct load copies them as one run (mcore_rl.sync.engine_layout.load_direct)
        from mcore_rl.sync.engine_layout import load_order

        for b in self.buckets:
            for rb in b.values():
                rb.payload.sort(key=lambda t: (-t.dtype.itemsize, load_order(t.name, self.hf)))

    def _place(self, p: Param, dests: list[int], bucket: dict[int, RankBucket]) -> None:
        holders = self.holders[p.mcore]
        for r in holders:
            bucket.setdefault(r, RankBucket()).gather.append(p)
        for d in dests:
            src = d if d in holders else holders[d % len(holders)]
            for h in self.names_of(p):
                if src != d:
                    bucket.setdefault(src, RankBucket()).sends.append((h, d))
                    bucket.setdefault(d, RankBucket()).recvs.append((h, src))
                bucket.setdefault(d, RankBucket()).payload.append(self.tensors[h])

    # ---- views ------------------------------------------------------------------------------
    def for_rank(self, rank: int) -> list[RankBucket]:
        return [b.get(rank, RankBucket()) for b in self.buckets]

    def payload_names(self, rank: int) -> list[str]:
        return [t.name for b in self.for_rank(rank) for t in b.payload]

    def check_complete(self) -> None:
        """Every HF tensor the mapping names reaches every engine rank that needs it."""
        for t, r in self.engine_rank_of.items():
            got = set(self.payload_names(t))
            want = {h for p in {x.param for x in self.tensors.values()}
                    for h in self.names_of(p) if t in self._needs(p, r == -1)}
            if want - got:
                raise SyncPlanError(f"trainer rank {t} (engine rank {r}) is missing {sorted(want - got)[:3]}")


def single_source(rank: int = 0) -> dict[int, int]:
    """The feed for NCCL broadcast / disk: one trainer rank sends every tensor; -1 = all engine ranks."""
    return {rank: -1}


def _holds(p: Param, pp_rank: int, ep_rank: int, stages: list[range], hf: HFModel, trainer: Layout) -> bool:
    if p.layer is None:  # embedding on the first stage, final norm and head on the last
        first = p.mcore.startswith("embedding.")
        return pp_rank == (0 if first else trainer.pp - 1)
    if p.layer not in stages[pp_rank]:
        return False
    return p.expert is None or p.expert // (hf.num_experts // trainer.ep) == ep_rank
