"""Where every weight lives: megatron's shards per rank and the SGLang engine's tensors per rank.

Shapes are never written by hand. `inventory(hf)` takes megatron's own meta-device model
(`mcore_rl.convert.mcore_ckpt.skeleton`, TP=PP=EP=1) for the megatron shapes, and the ONE declarative
mapping (`Param.to_hf` on meta tensors) for the HF shapes. What is added here is only how each
tensor is split:

- megatron: `linear_*`, word embeddings and the output layer are split over TP (experts over
  expert-TP, `etp`), routed experts are spread over EP, layers over PP stages; norms and the router
  are replicated; the router's expert bias is an fp32 buffer (no gradient, no optimizer state).
- SGLang (DeepseekV2ForCausalLM, Qwen3MoeForCausalLM, Glm4MoeForCausalLM and the Llama/Qwen
  models), as the sync's table
  (`mcore_rl.sync.engine_layout.SGLANG_RULES`) places them: embeddings and lm_head are vocab-split
  over tp, q_a/kv_a projections are replicated (fused into `fused_qkv_a_proj_with_mqa` with
  q_lora), column-parallel weights are split on dim 0 and row-parallel ones (o_proj, down_proj)
  on dim 1, routed experts are stacked per layer into `w13_weight [E/ep, 2I/moe_tp, H]` and
  `w2_weight [E/ep, H, I/moe_tp]` with moe_tp = tp / ep, gate/up are fused into `gate_up_proj`,
  and after loading SGLang derives `w_kc`/`w_vc` from `kv_b_proj` (one more kv_b-sized tensor).
  Under DP attention (rollout.dp_attention: dp = tp) attention, embeddings, lm_head and the dense
  MLP are whole on every rank; shared and routed experts are split as without it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

import torch

from mcore_rl.models.config import HFModel, stage_layers

@dataclass(frozen=True)
class Weight:
    """One megatron parameter (unsharded) and the HF tensors it is made of."""

    mcore: str
    numel: int
    layer: int | None
    expert: int | None
    split: str  # "tp", "replicated" or "buffer" (fp32, not trained)
    hf: tuple[tuple[str, tuple[int, ...]], ...]


def _megatron_split(mcore: str) -> str:
    module = mcore.rsplit(".", 2)[-2]
    if mcore.endswith("expert_bias"):
        return "buffer"
    if module.startswith("linear_") or module in ("word_embeddings", "output_layer"):
        return "tp"
    return "replicated"


@functools.lru_cache(maxsize=8)
def _inventory(cfg_json: str) -> tuple[Weight, ...]:
    from mcore_rl.convert.mcore_ckpt import skeleton

    hf = HFModel.from_dict(json.loads(cfg_json))
    _, entries = skeleton(hf)
    out = []
    for e in entries.values():
        parts = [torch.empty(s, device="meta") for s in e.shapes]
        full = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)  # GLU halves
        hf_shapes = tuple((name, tuple(t.shape)) for name, t in e.param.to_hf(hf, full).items())
        out.append(Weight(e.param.mcore, full.numel(), e.param.layer, e.param.expert,
                          _megatron_split(e.param.mcore), hf_shapes))
    return tuple(out)


def inventory(hf: HFModel) -> tuple[Weight, ...]:
    """Every megatron parameter of `hf` with its HF tensors (cached per config)."""
    return _inventory(json.dumps(hf.cfg, sort_keys=True))


def hf_shapes(hf: HFModel) -> dict[str, tuple[int, ...]]:
    """Every HF tensor's shape as the model `hf`'s config.json implies it (the checks of an HF
    checkpoint: built once a process, the run's memory plan reuses the preflight's)."""
    return {name: shape for w in inventory(hf) for name, shape in w.hf}


# ----------------------------------------------------------------------------- megatron side
def megatron_rank_numel(weights, hf: HFModel, *, tp: int, pp: int, ep: int, etp: int,
                        stage: int) -> dict[str, int]:
    """Elements one rank of `stage` holds: {'dense': .., 'expert': .., 'buffer': ..}.

    Dense parameters are data-parallel replicas of each other; expert parameters are replicas
    over expert-DP. Every EP rank holds the same number of experts, so rank 0 of each is taken.
    """
    layers = stage_layers(hf.num_layers, pp)[stage]
    local_experts = range(hf.num_experts // ep) if hf.num_experts else range(0)
    out = {"dense": 0, "expert": 0, "buffer": 0}
    for w in weights:
        if w.layer is None:
            on_stage = (stage == 0) if "embedding" in w.mcore else (stage == pp - 1)
        else:
            on_stage = w.layer in layers
        if not on_stage:
            continue
        if w.expert is not None:
            if w.expert in local_experts:
                out["expert"] += w.numel // etp
        elif w.split == "buffer":
            out["buffer"] += w.numel
        else:
            out["dense"] += w.numel // tp if w.split == "tp" else w.numel
    return out


# ----------------------------------------------------------------------------- SGLang side
@dataclass
class EngineTensor:
    """One tensor of the SGLang model on one rank, and the HF shards it is assembled from."""

    name: str
    dtype: torch.dtype
    # (hf name, split dim or None, parts, this rank's part, expert slot or -1), in row order
    pieces: list[tuple[str, int | None, int, int, int]] = field(default_factory=list)
    shape: tuple[int, ...] = ()
    derived_from: str | None = None  # SGLang's w_kc/w_vc, computed from kv_b_proj after loading

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def _engine_name(hf: HFModel, hf_name: str) -> tuple[str, int | None]:
    """(engine tensor name, expert index) for an HF tensor; fused tensors share a name."""
    from mcore_rl.sync.engine_layout import engine_param, expert_of

    name, rule = engine_param(hf_name, hf)
    expert = expert_of(hf_name) if rule.split.startswith("moe_") else None
    return name, expert


def _engine_shard(hf: HFModel, hf_name: str, layout, rank: int):
    """(split dim, parts, this rank's part) of one HF tensor on engine rank `rank`, from the sync's
    table (`mcore_rl.sync.engine_layout.SGLANG_RULES`, `EngineLayout.parts_of`)."""
    from mcore_rl.sync.engine_layout import engine_param

    rule = engine_param(hf_name, hf)[1]
    split = rule.split
    parts, index = layout.parts_of(rule, rank)
    if parts == 1:
        return None, 1, 0
    if split == "kv_head" and rule.part > 0 and hf.num_kv_heads < parts:  # k or v (q is part 0)
        # SGLang replicates KV heads when tp > kv heads: one head per rank
        return 0, hf.num_kv_heads, index * hf.num_kv_heads // parts
    return (1 if split in ("col", "moe_col") else 0), parts, index


def engine_tensors(hf: HFModel, weights, *, tp: int, ep: int, rank: int = 0, attn_dp: int = 1,
                   dtype: torch.dtype = torch.bfloat16, weight_dtype: str = "bf16") -> dict[str, EngineTensor]:
    """The SGLang model's tensors on engine rank `rank` (experts: the rank's contiguous block) of an
    engine of `tp` ranks, `ep` expert-parallel, `attn_dp` attention-DP (SGLang's dp_size under DP attention).
    `weight_dtype="fp8"`: what the engine runs in FP8 at this layout is e4m3 plus an fp32
    weight_scale_inv; the linear layers it keeps in `dtype` there (`runs_in_fp8`) count as such."""
    from mcore_rl.sync import fp8
    from mcore_rl.sync.engine_layout import EngineLayout, keeps_fp32, runs_in_fp8

    layout = EngineLayout(tp, ep, attn_dp_size=attn_dp)
    mine = layout.experts_of(rank, hf.num_experts or 0)  # the rank's contiguous block, as the sync places them
    per_ep = len(mine)
    out: dict[str, EngineTensor] = {}
    rows: dict[str, list[int]] = {}
    for w in weights:
        if w.expert is not None and w.expert not in mine:
            continue
        tensors = []
        for hf_name, shape in w.hf:
            if weight_dtype == "fp8" and runs_in_fp8(hf_name, hf, layout):
                tensors += [(hf_name, shape, fp8.E4M3), (fp8.scale_name(hf_name), fp8.scale_shape(shape), torch.float32)]
            else:
                tensors.append((hf_name, shape, torch.float32 if keeps_fp32(hf_name, hf) else dtype))
        for hf_name, shape, tdtype in tensors:
            name, expert = _engine_name(hf, hf_name)
            dim, parts, index = _engine_shard(hf, hf_name, layout, rank)
            local = list(shape)
            if dim is not None:
                local[dim] //= parts
            t = out.setdefault(name, EngineTensor(name, tdtype))
            slot = None if expert is None else expert - mine.start
            t.pieces.append((hf_name, dim, parts, index, slot if slot is not None else -1))
            if slot is None:
                rows.setdefault(name, [0, *local[1:]])[0] += local[0]  # concatenated on dim 0
            elif slot == 0:
                rows.setdefault(name, [0, *local[1:]])[0] += local[0]  # w13: gate then up rows
            if expert is not None:
                t.shape = (per_ep, *rows[name])
            else:
                t.shape = tuple(rows[name])
            if hf_name.endswith("kv_b_proj.weight"):
                derived = hf_name.replace("kv_b_proj.weight", "w_kc_w_vc")
                out[derived] = EngineTensor(derived, dtype, shape=tuple(local), derived_from=name)  # upper bound: SGLang may keep them FP8
    return out
