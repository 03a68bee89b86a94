"""The weight-sync plan: which trainer rank produces, sends and receives which HF tensor, in which bucket.

Computed once from the declarative mapping (`converters.mappings.mapping_for`), the trainer's
megatron layout and the SGLang engine layout, before any transfer. Rules it enforces:
- routed experts travel per expert (`mlp.experts.{i}.gate_proj.weight`, ...) and only to the
  engine ranks that own expert i, so nobody ever builds a fused [E, 2I, H] tensor;
- q_a_proj and kv_a_proj_with_mqa of a layer always share a bucket (SGLang fuses them only when
  both arrive in the same load_weights call; split, the fused parameter silently stays stale);
- GPUs per node come from the placement (`EngineLayout.gpus_per_node`), never a default;
- with FP8 engine weights (`weight_dtype="fp8"`) every weight the engine runs in FP8
  (`engine_layout.runs_in_fp8`) travels as e4m3 with its `weight_scale_inv` beside it, in the
  same bucket (the engine needs both to use either).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from converters.mappings import Param, mapping_for
from mcore_rl.sync import fp8
from mcore_rl.models.config import HFModel, validate_layout
from mcore_rl.parallel import Layout


class PlanError(ValueError):
    """The engine layout, the placement or the plan cannot work; raised before any transfer."""


@dataclass(frozen=True)
class EngineLayout:
    """One SGLang engine: tp_size ranks over nnodes nodes, gpus_per_node taken from the placement."""

    tp_size: int
    ep_size: int = 1
    nnodes: int = 1
    gpus_per_node: int | None = None

    @property
    def moe_tp(self) -> int:
        return self.tp_size // self.ep_size

    def node_and_local(self, tp_rank: int) -> tuple[int, int]:
        """SGLang gives each node tp_size/nnodes consecutive ranks."""
        return divmod(tp_rank, self.tp_size // self.nnodes)

    def experts_of(self, tp_rank: int, num_experts: int) -> range:
        """SGLang's EP: moe_ep_rank = tp_rank // moe_tp owns a contiguous block of experts."""
        per = num_experts // self.ep_size
        ep_rank = tp_rank // self.moe_tp
        return range(ep_rank * per, (ep_rank + 1) * per)

    def validate(self, hf: HFModel) -> None:
        problems = []
        for name in ("tp_size", "ep_size", "nnodes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                problems.append(f"{name}={v!r} must be a positive integer")
        if problems:
            raise PlanError("invalid engine layout: " + "; ".join(problems))
        tp, ep = self.tp_size, self.ep_size
        if hf.num_attention_heads % tp:
            problems.append(f"engine tp_size={tp} does not divide num_attention_heads={hf.num_attention_heads}")
        if not hf.is_mla and hf.num_kv_heads % tp and tp % hf.num_kv_heads:
            problems.append(f"engine tp_size={tp} and num_key_value_heads={hf.num_kv_heads}: neither divides the other")
        if hf.intermediate_size % tp:
            problems.append(f"engine tp_size={tp} does not divide intermediate_size={hf.intermediate_size}")
        if tp % ep:
            problems.append(f"engine ep_size={ep} does not divide tp_size={tp}")
        if hf.num_experts:
            if hf.num_experts % ep:
                problems.append(f"engine ep_size={ep} does not divide n_routed_experts={hf.num_experts}")
            elif not tp % ep and hf.moe_intermediate_size % (tp // ep):
                problems.append(f"moe tp = tp_size/ep_size = {tp // ep} does not divide "
                                f"moe_intermediate_size={hf.moe_intermediate_size}")
        elif ep != 1:
            problems.append(f"engine ep_size={ep} needs a MoE model; {hf.model_type} has no experts")
        if tp % self.nnodes:
            problems.append(f"nnodes={self.nnodes} does not divide engine tp_size={tp}")
        if self.gpus_per_node is None:
            problems.append("gpus_per_node is unknown: take it from the placement (placement.engine_layout)")
        elif self.gpus_per_node * self.nnodes != tp:
            problems.append(f"gpus_per_node={self.gpus_per_node} x nnodes={self.nnodes} != tp_size={tp}")
        if problems:
            raise PlanError("invalid engine layout: " + "; ".join(problems))


def hf_shape(hf: HFModel, name: str) -> tuple[int, ...]:
    """Shape of HF tensor `name` from the config alone (so plans for any size need no weights);
    a `weight_scale_inv` has one entry per 128 x 128 block of its weight."""
    if name.endswith(fp8.SCALE_SUFFIX):
        return fp8.scale_shape(hf_shape(hf, name.removesuffix(fp8.SCALE_SUFFIX)))
    c, H = hf.cfg, hf.hidden_size
    heads = hf.num_attention_heads
    leaf = name.split(".")[-2] if name.endswith((".weight", ".bias")) else name.split(".")[-1]
    if leaf in ("embed_tokens", "lm_head"):
        return (hf.vocab_size, H)
    if leaf in ("norm", "input_layernorm", "post_attention_layernorm"):
        return (H,)
    if ".mlp." in name:
        if leaf == "gate":
            return (hf.num_experts, H)
        if leaf == "e_score_correction_bias":
            return (hf.num_experts,)
        inter = c["intermediate_size"]
        if ".experts." in name:
            inter = c["moe_intermediate_size"]
        elif ".shared_experts." in name:
            inter = c["moe_intermediate_size"] * c["n_shared_experts"]
        return (H, inter) if leaf == "down_proj" else (inter, H)
    if hf.is_mla:
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        return {"q_a_proj": (c.get("q_lora_rank"), H), "q_a_layernorm": (c.get("q_lora_rank"),),
                "q_b_proj": (heads * qk, c.get("q_lora_rank")), "q_proj": (heads * qk, H),
                "kv_a_proj_with_mqa": (c["kv_lora_rank"] + c["qk_rope_head_dim"], H),
                "kv_a_layernorm": (c["kv_lora_rank"],),
                "kv_b_proj": (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
                "o_proj": (H, heads * c["v_head_dim"])}[leaf]
    d, kv = hf.head_dim, hf.num_kv_heads
    out = {"q_proj": heads * d, "k_proj": kv * d, "v_proj": kv * d}
    if leaf in out:
        return (out[leaf],) if name.endswith(".bias") else (out[leaf], H)
    return {"o_proj": (H, heads * d), "q_norm": (d,), "k_norm": (d,)}[leaf]


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


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Megatron's split as transformer_config sets it: an uneven remainder goes to the last stage."""
    first = num_layers // pp
    starts = [i * first for i in range(pp)]
    return [range(s, starts[i + 1] if i + 1 < pp else num_layers) for i, s in enumerate(starts)]


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
        from mcore_rl.sync.engine_layout import runs_in_fp8

        engine.validate(hf)
        if weight_dtype not in ("bf16", "fp8"):
            raise PlanError(f"weight_dtype={weight_dtype!r}: use 'bf16' or 'fp8'")
        if weight_dtype == "fp8" and not hf.is_mla:
            raise PlanError(f"FP8 engine weights are wired for DeepSeek-V3-style (MLA) models, not {hf.model_type}")
        if weight_dtype == "fp8" and fp8_misfits(hf, engine):
            raise PlanError(fp8_misfits(hf, engine)[0])
        try:
            validate_layout(hf, trainer.tp, trainer.pp, trainer.ep, trainer.etp)
        except ValueError as e:
            raise PlanError(f"trainer layout: {e}") from None
        if world % (trainer.tp * trainer.pp) or (world // trainer.pp) % (trainer.ep * trainer.etp):
            raise PlanError(f"trainer world size {world} does not fit TP={trainer.tp} PP={trainer.pp} "
                            f"EP={trainer.ep} ETP={trainer.etp}")
        if bucket_bytes <= 0:
            raise PlanError(f"bucket_bytes={bucket_bytes} must be positive")
        bad = sorted(r for r in engine_rank_of if not 0 <= r < world)
        if bad:
            raise PlanError(f"trainer ranks {bad} do not exist in a world of {world}")
        fed = sorted(engine_rank_of.values())
        single = fed == [-1]
        copies = len(fed) // engine.tp_size  # data-parallel engines, each fed by its own trainer ranks
        if not single and (copies == 0 or fed != sorted(list(range(engine.tp_size)) * copies)):
            raise PlanError(f"engine ranks fed by the trainer are {fed}; need each of 0..{engine.tp_size - 1} "
                            "once per engine (mismatched GPU counts?)")
        from mcore_rl.sync.engine_layout import keeps_fp32  # it imports this module

        params = list(mapping_for(hf).params(hf))
        stages = stage_layers(hf.num_layers, trainer.pp)
        coords = [trainer_coords(r, world, trainer) for r in range(world)]
        tensors, holders, outputs = {}, {}, {}
        for p in params:
            for h in p.hf:
                tensors[h] = Tensor(h, hf_shape(hf, h), torch.float32 if keeps_fp32(h, hf) else dtype, p)
            if weight_dtype == "fp8" and runs_in_fp8(p.hf[0], hf):
                scales = tuple(fp8.scale_name(h) for h in p.hf)
                for h, s in zip(p.hf, scales):
                    tensors[h] = Tensor(h, tensors[h].shape, fp8.E4M3, p)
                    tensors[s] = Tensor(s, hf_shape(hf, s), torch.float32, p)
                outputs[p.mcore] = p.hf + scales
            holders[p.mcore] = [r for r, (pp_rank, _, ep_rank) in enumerate(coords)
                                if _holds(p, pp_rank, ep_rank, stages, hf, trainer)]
            if not holders[p.mcore]:
                raise PlanError(f"no trainer rank holds {p.mcore}")
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
                raise PlanError(f"trainer rank {t} (engine rank {r}) is missing {sorted(want - got)[:3]}")


def single_source(rank: int = 0) -> dict[int, int]:
    """The feed for NCCL broadcast / disk: one trainer rank sends every tensor; -1 = all engine ranks."""
    return {rank: -1}


def fp8_misfits(hf: HFModel, engine: EngineLayout) -> list[str]:
    """Problems (one line, naming a few weights) if some FP8 weight would not sit on whole blocks."""
    from mcore_rl.sync.engine_layout import runs_in_fp8

    # the first layer and the last: a dense and an MoE layer of a DeepSeek model (the others repeat their shapes)
    bad = [f"{h} {why}" for p in mapping_for(hf).params(hf) if p.layer in (None, 0, hf.num_layers - 1)
           for h in p.hf if runs_in_fp8(h, hf) and (why := _fp8_misfit(hf, engine, h))]
    if not bad:
        return []
    return [f"FP8 engine weights need whole 128 x 128 blocks per engine rank (tp_size={engine.tp_size}, "
            f"ep_size={engine.ep_size}) and per fused part, as SGLang's Fp8LinearMethod does: " + "; ".join(bad[:4])]


def _fp8_misfit(hf: HFModel, engine: EngineLayout, name: str) -> str | None:
    """Why HF weight `name`, as SGLang splits and fuses it, would not sit on whole 128-row/column
    blocks (SGLang refuses split ones at start; a fused part that ends mid-block, e.g. q_lora_rank
    not a multiple of 128, would pair its rows with the next part's scale), or None."""
    from mcore_rl.sync.engine_layout import engine_param

    rule = engine_param(name, hf)[1]
    rows, cols = hf_shape(hf, name)
    parts = engine.moe_tp if rule.split.startswith("moe_") else engine.tp_size
    if rule.split in ("row", "moe_row") and parts > 1 or rule.parts and rule.part < len(rule.parts) - 1:
        rows //= parts if rule.split in ("row", "moe_row") else 1
        if rows % fp8.BLOCK[0]:
            return f"has {rows} rows per engine rank"
    if rule.split in ("col", "moe_col") and parts > 1 and (cols // parts) % fp8.BLOCK[1]:
        return f"has {cols // parts} columns per engine rank"
    return None


def _holds(p: Param, pp_rank: int, ep_rank: int, stages: list[range], hf: HFModel, trainer: Layout) -> bool:
    if p.layer is None:  # embedding on the first stage, final norm and head on the last
        first = p.mcore.startswith("embedding.")
        return pp_rank == (0 if first else trainer.pp - 1)
    if p.layer not in stages[pp_rank]:
        return False
    return p.expert is None or p.expert // (hf.num_experts // trainer.ep) == ep_rank
