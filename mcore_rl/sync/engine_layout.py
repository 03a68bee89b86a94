"""Where each HF tensor lands in an SGLang engine rank: one declarative table, read by the
sync's read-back check (`ExpectedDigests`) and by the memory planner's engine tensors
(`mcore_rl.memory.layout.engine_tensors`).

A rule matches an HF tensor by the end of its name and says which SGLang parameter receives it,
how it is split over a group of the engine's ranks, and which part of a fused parameter it fills
(SGLang fuses q_a/kv_a, q/k/v, gate/up, and stacks routed experts into w13/w2). With n the
group's size and r the rank's place in it (`EngineLayout.parts_of`):

| split      | rank r gets                                                                     |
| ---------- | ------------------------------------------------------------------------------- |
| `rep`      | the whole tensor                                                                |
| `row`      | its r-th chunk of rows                                                          |
| `col`      | its r-th chunk of columns                                                       |
| `vocab`    | rows [r*P, (r+1)*P) of the vocab padded to 64 * n, P = padded/n (rest zero)     |
| `kv_head`  | the kv heads of r (q/k/v fusion; replicated when n > kv heads)                  |
| `moe_row` / `moe_col` | as row/col over moe_tp = tp/ep, for experts in r's EP block          |

| group   | what                                   | n, r: plain TP  | with DP attention (dp = attn_dp_size)   |
| ------- | -------------------------------------- | --------------- | --------------------------------------- |
| `attn`  | attention, embeddings, lm_head         | tp, tp_rank     | attn_tp = tp/dp, tp_rank % attn_tp      |
| `dense` | the dense layers' MLP                  | tp, tp_rank     | 1, 0 (SGLang's moe_dense_tp_size=1)     |
| `tp`    | shared experts                         | tp, tp_rank     | tp, tp_rank (inside the MoE, over all)  |

DP attention is SGLang's `enable_dp_attention` with `dp_size` = dp: each group of attn_tp ranks
serves its own requests with its own KV cache. It builds the embedding over the attention-TP group
(`get_embedding_tp_kwargs`), lm_head there with `enable_dp_lm_head` (the engine sets it, and
moe_dense_tp_size=1: `mcore_rl.rollout.sglang.own_args`), the shared experts of DeepseekV2MoE over
the whole TP group (no all-to-all MoE backend), the routed experts as without it (0.5.17 and 0.5.20).

`fp8` marks the weights an FP8 engine (`rollout.weight_dtype: fp8`, DeepSeek-V3's checkpoint
format) can hold as e4m3: the linear layers of attention and of the dense, shared and routed MLPs;
not norms, the router, embeddings or lm_head. It holds them so where their shard sits on whole
128 x 128 blocks at the engine's layout (`runs_in_fp8`), the rest in the model's dtype, listed in
its config's `ignored_layers` (Moonlight's shared experts at TP 4: 704 rows a rank). Each has a
`weight_scale_inv` rule beside it (`SCALE_RULES`, derived): the same split and fusion, in blocks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from mcore_rl.models.config import HFModel
from mcore_rl.models.families import family_of
from mcore_rl.sync import fp8
from mcore_rl.sync.bucket import unflatten
from mcore_rl.sync.checksum import digest
from mcore_rl.sync.fp8 import SCALE_SUFFIX


class SyncPlanError(ValueError):
    """The engine layout, the placement or the plan cannot work; raised before any transfer."""


@dataclass(frozen=True)
class EngineLayout:
    """One SGLang engine: tp_size ranks over nnodes nodes, gpus_per_node taken from the placement."""

    tp_size: int
    ep_size: int = 1
    nnodes: int = 1
    gpus_per_node: int | None = None
    attn_dp_size: int = 1  # SGLang's dp_size under enable_dp_attention (1: off)

    @property
    def moe_tp(self) -> int:
        return self.tp_size // self.ep_size

    @property
    def attn_tp(self) -> int:
        return self.tp_size // self.attn_dp_size

    def parts_of(self, rule: Place, tp_rank: int) -> tuple[int, int]:
        """(n, r): how many parts `rule`'s tensor is split into over engine ranks, and rank
        `tp_rank`'s (the module docstring's group table; SGLang's attn_tp_rank = tp_rank % attn_tp)."""
        if rule.split == "rep":
            return 1, 0
        if rule.split.startswith("moe_"):
            return self.moe_tp, tp_rank % self.moe_tp  # SGLang: moe_tp_rank = tp_rank % moe_tp
        if rule.group == "attn":
            return self.attn_tp, tp_rank % self.attn_tp
        if rule.group == "dense" and self.attn_dp_size > 1:
            return 1, 0
        return self.tp_size, tp_rank

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
        for name in ("tp_size", "ep_size", "nnodes", "attn_dp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                problems.append(f"{name}={v!r} must be a positive integer")
        if problems:
            raise SyncPlanError("invalid engine layout: " + "; ".join(problems))
        tp, ep = self.tp_size, self.ep_size
        if tp % self.attn_dp_size:
            problems.append(f"attention dp_size={self.attn_dp_size} does not divide engine tp_size={tp}")
            raise SyncPlanError("invalid engine layout: " + "; ".join(problems))
        attn = f"engine tp_size={tp}" if self.attn_tp == tp else f"attention tp = tp_size/dp_size = {self.attn_tp}"
        if hf.num_attention_heads % self.attn_tp:
            problems.append(f"{attn} does not divide num_attention_heads={hf.num_attention_heads}")
        if not hf.is_mla and hf.num_kv_heads % self.attn_tp and self.attn_tp % hf.num_kv_heads:
            problems.append(f"{attn} and num_key_value_heads={hf.num_kv_heads}: neither divides the other")
        if hf.intermediate_size % tp and self.attn_dp_size == 1:
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
            raise SyncPlanError("invalid engine layout: " + "; ".join(problems))


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


_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class Place:
    suffix: str  # end of the HF name ("self_attn.q_proj.weight")
    split: str  # rep | row | col | vocab | kv_head | moe_row | moe_col
    into: str | None = None  # the SGLang parameter's suffix when it differs (a fused one)
    part: int = 0  # position in the fused parameter, counted along dim 0 (dim 1 of w13 per expert)
    parts: tuple[str, ...] = ()  # suffixes of all parts of that fused parameter, in order
    when: str | None = None  # "mla", "gqa" or "q_lora": only for such models
    fp8: bool = False  # held as e4m3 + weight_scale_inv by an FP8 engine
    group: str = "attn"  # the ranks a split is over: attn | dense | tp (the module docstring's table)

    def applies(self, name: str, mla: bool, q_lora: bool) -> bool:
        ok = {None: True, "mla": mla, "gqa": not mla, "q_lora": mla and q_lora}[self.when]
        return ok and name.endswith(self.suffix)


QKV_PARTS = ("q_proj", "k_proj", "v_proj")
EXPERT_LINEARS = ("gate_proj", "up_proj", "down_proj")
WEIGHT_RULES = (
    Place("embed_tokens.weight", "vocab"),
    Place("lm_head.weight", "vocab"),
    # MLA with q_lora: q_a and kv_a are one fused parameter, q_a first; without, q_proj is split
    Place("self_attn.q_a_proj.weight", "rep", "self_attn.fused_qkv_a_proj_with_mqa.weight", 0,
          ("q_a_proj", "kv_a_proj_with_mqa"), when="q_lora", fp8=True),
    Place("self_attn.kv_a_proj_with_mqa.weight", "rep", "self_attn.fused_qkv_a_proj_with_mqa.weight", 1,
          ("q_a_proj", "kv_a_proj_with_mqa"), when="q_lora", fp8=True),
    Place("self_attn.kv_a_proj_with_mqa.weight", "rep", when="mla", fp8=True),  # without q_lora: unfused
    Place("self_attn.q_proj.weight", "row", when="mla", fp8=True),
    Place("self_attn.q_b_proj.weight", "row", fp8=True),
    Place("self_attn.kv_b_proj.weight", "row", fp8=True),
    *(Place(f"self_attn.{x}.{kind}", "kv_head", f"self_attn.qkv_proj.{kind}", i, QKV_PARTS, when="gqa")
      for kind in ("weight", "bias") for i, x in enumerate(QKV_PARTS)),
    Place("self_attn.o_proj.weight", "col", fp8=True),
    Place("experts.{E}.gate_proj.weight", "moe_row", "experts.w13_weight", 0, ("gate_proj", "up_proj"), fp8=True),
    Place("experts.{E}.up_proj.weight", "moe_row", "experts.w13_weight", 1, ("gate_proj", "up_proj"), fp8=True),
    Place("experts.{E}.down_proj.weight", "moe_col", "experts.w2_weight", fp8=True),
    Place("mlp.gate_proj.weight", "row", "mlp.gate_up_proj.weight", 0, ("gate_proj", "up_proj"), fp8=True, group="dense"),
    Place("mlp.up_proj.weight", "row", "mlp.gate_up_proj.weight", 1, ("gate_proj", "up_proj"), fp8=True, group="dense"),
    Place("mlp.down_proj.weight", "col", fp8=True, group="dense"),
    Place("shared_experts.gate_proj.weight", "row", "shared_experts.gate_up_proj.weight", 0, ("gate_proj", "up_proj"),
          fp8=True, group="tp"),
    Place("shared_experts.up_proj.weight", "row", "shared_experts.gate_up_proj.weight", 1, ("gate_proj", "up_proj"),
          fp8=True, group="tp"),
    Place("shared_experts.down_proj.weight", "col", fp8=True, group="tp"),
)
SCALE_RULES = tuple(replace(r, suffix=r.suffix + SCALE_SUFFIX, into=r.into and r.into + SCALE_SUFFIX, fp8=False)
                    for r in WEIGHT_RULES if r.fp8)
SGLANG_RULES = WEIGHT_RULES + SCALE_RULES + (
    Place("", "rep"),  # norms, router weight and expert bias (fp32 in SGLang, as the plan sends it)
)


def keeps_fp32(name: str, hf) -> bool:
    """HF tensors the engine holds in fp32 whatever the model's dtype, so the sync sends them in
    fp32: the expert bias (fp32 in HF, megatron and SGLang alike) and GLM-4.5's router weight where
    SGLang's Glm4MoeGate is an fp32 parameter (`sglang_gate_is_fp32`)."""
    return name.endswith("e_score_correction_bias") or (
        family_of(hf.model_type).fp32_router and name.endswith(".mlp.gate.weight") and sglang_gate_is_fp32())


@functools.cache
def sglang_gate_is_fp32() -> bool:
    """SGLang 0.5.20 (CI's) holds GLM-4.5's router weight in fp32; 0.5.17 (the GPU machines') in the
    model's dtype, projecting through an fp32 copy it makes once (mcore_rl.rollout.sglang_plugin
    keeps that copy current). Versions between were not checked: a wrong guess fails the first
    sync's read-back. Without SGLang installed, the newer layout."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        return Version(version("sglang")).release >= (0, 5, 20)
    except PackageNotFoundError:
        return True


def _rule(name: str, hf) -> Place:
    generic = name
    if ".mlp.experts." in name:  # experts.{i}. -> experts.{E}.
        head, _, rest = name.partition(".mlp.experts.")
        generic = head + ".mlp.experts.{E}." + rest.partition(".")[2]
    return _rule_of(generic, hf.is_mla, hf.is_mla and hf.q_lora)


@functools.cache  # a sync asks once per tensor: hundreds of expert tensors a layer
def _rule_of(generic: str, mla: bool, q_lora: bool) -> Place:
    return next(r for r in SGLANG_RULES if r.applies(generic, mla, q_lora))


def runs_in_fp8(name: str, hf, layout: EngineLayout) -> bool:
    """Whether an FP8 engine of `layout` holds HF weight `name` as e4m3 with a weight_scale_inv: a
    linear weight (`Place.fp8`) that sits on whole blocks there (`fp8_misfit`). The others it holds
    in the model's dtype, as an FP8 checkpoint's `ignored_layers` say (`fp8_ignored_layers`)."""
    return _rule(name, hf).fp8 and fp8_misfit(name, hf, layout) is None


def fp8_misfit(name: str, hf, layout: EngineLayout) -> str | None:
    """Why linear HF weight `name` cannot be block FP8 in an engine of `layout`, or None. SGLang's
    Fp8LinearMethod and Fp8MoEMethod refuse at start a shard that is not whole 128-row blocks (a
    split or fused part) or 128-column blocks (a column split); a fused part that ends mid-block
    (q_a_proj of a q_lora_rank not a multiple of 128) would pair its last rows with the next part's
    scale. SGLang holds a module in one precision, so its weights share the answer: the parts of a
    fused parameter, and a layer's routed experts (one FusedMoE of w13 and w2)."""
    rule = engine_param(name, hf)[1]
    leaf = rule.suffix.split(".")[-2]
    for part in EXPERT_LINEARS if rule.split.startswith("moe_") else rule.parts or (leaf,):
        why = _block_misfit(name.removesuffix(f"{leaf}.weight") + f"{part}.weight", hf, layout)
        if why:
            return why
    return None


def _block_misfit(name: str, hf, layout: EngineLayout) -> str | None:
    rule = engine_param(name, hf)[1]
    rows, cols = hf_shape(hf, name)
    parts = layout.parts_of(rule, 0)[0]
    if rule.split in ("row", "moe_row") and parts > 1 or rule.parts and rule.part < len(rule.parts) - 1:
        rows //= parts if rule.split in ("row", "moe_row") else 1
        if rows % fp8.BLOCK[0]:
            return f"{name} has {rows} rows per engine rank"
    if rule.split in ("col", "moe_col") and parts > 1 and (cols // parts) % fp8.BLOCK[1]:
        return f"{name} has {cols // parts} columns per engine rank"
    return None


def fp8_ignored_layers(hf, layout: EngineLayout) -> dict[str, str]:
    """The linear modules an FP8 engine of `layout` keeps in the model's dtype (`fp8_misfit`), by
    the module names of an FP8 checkpoint's `ignored_layers` (HF's: SGLang's Fp8Config matches them
    as module prefixes and splits its fused gate_up_proj / fused_qkv_a_proj_with_mqa into them; a
    layer's routed experts are its one `mlp.experts` module), each with why."""
    from mcore_rl.models.mappings import mapping_for

    out: dict[str, str] = {}
    for p in mapping_for(hf).params(hf):
        for h in p.hf:
            module = h.split(".mlp.experts.")[0] + ".mlp.experts" if p.expert is not None else h.removesuffix(".weight")
            if module not in out and _rule(h, hf).fp8 and (why := fp8_misfit(h, hf, layout)):
                out[module] = why
    return out


def fp8_kept_line(hf, layout: EngineLayout) -> str:
    """The run's log line saying which linear modules an FP8 engine of `layout` keeps in the model's dtype."""
    kept = fp8_ignored_layers(hf, layout)
    where = f"rollout.weight_dtype=fp8 at engine tp_size={layout.tp_size} ep_size={layout.ep_size}: "
    if not kept:
        return where + "every linear layer runs in FP8"
    why = list(dict.fromkeys(kept.values()))  # a fused module's parts give one reason
    return (where + f"{len(kept)} linear modules stay in the model's dtype, their slices per rank not whole "
            f"128 x 128 blocks ({'; '.join(why[:2])}{'; ...' if len(why) > 2 else ''})")


def fp8_quantization_config(hf, layout: EngineLayout) -> dict:
    """The engine's config.json `quantization_config`: an FP8 DeepSeek-V3 checkpoint's, plus the
    modules it holds in the model's dtype at `layout` (what the sync sends them as)."""
    ignored = sorted(fp8_ignored_layers(hf, layout))
    return {**fp8.QUANTIZATION_CONFIG, **({"ignored_layers": ignored} if ignored else {})}


def engine_param(name: str, hf) -> tuple[str, Place]:
    """The SGLang parameter HF tensor `name` lands in (experts: the layer's stacked w13/w2), and its rule."""
    rule = _rule(name, hf)
    if rule.split in ("moe_row", "moe_col"):
        return name.split(".mlp.experts.")[0] + ".mlp." + rule.into, rule
    return (name[:-len(rule.suffix)] + (rule.into or rule.suffix) if rule.suffix else name), rule


def expert_of(name: str) -> int:
    """The routed expert of an HF expert tensor (`...mlp.experts.{e}...`)."""
    return int(name.split(".mlp.experts.")[1].split(".")[0])


def padded_vocab(vocab: int, tp: int, pad_to: int = 64) -> int:
    """SGLang's VocabParallelEmbedding: the vocab padded to a multiple of 64, or of 64 * tp where
    that would not split evenly (its CPU path; on GPUs SGLang refuses such a layout)."""
    if -(-vocab // pad_to) * pad_to % tp:
        pad_to *= tp
    return -(-vocab // pad_to) * pad_to


@dataclass
class Piece:
    param: str  # SGLang parameter name
    offset: int  # element offset of `src` inside that (contiguous) parameter
    src: torch.Tensor  # what lands there, contiguous rows


def place(name: str, t: torch.Tensor, layout: EngineLayout, tp_rank: int, hf) -> list[Piece]:
    """The pieces of SGLang engine rank `tp_rank`'s parameters that HF tensor `name` fills (none when
    an expert lives on another EP block)."""
    target, rule = engine_param(name, hf)
    parts, index = layout.parts_of(rule, tp_rank)
    if rule.split in ("moe_row", "moe_col"):
        e = expert_of(name)
        experts = layout.experts_of(tp_rank, hf.num_experts)
        if e not in experts:
            return []
        moe_tp, moe_rank = parts, index
        if rule.split == "moe_col":
            src = t.chunk(moe_tp, dim=1)[moe_rank].contiguous() if moe_tp > 1 else t.contiguous()
            return [Piece(target, (e - experts.start) * src.numel(), src)]
        src = t.chunk(moe_tp, dim=0)[moe_rank].contiguous() if moe_tp > 1 else t.contiguous()  # w13[e] = [gate_r; up_r]
        return [Piece(target, ((e - experts.start) * len(rule.parts) + rule.part) * src.numel(), src)]
    if rule.split == "vocab":
        per = padded_vocab(t.shape[0], parts) // parts
        return [Piece(target, 0, t[index * per:(index + 1) * per].contiguous())]  # may be all padding
    if rule.split == "kv_head":
        return [_qkv_piece(name, target, t, rule, parts, index, hf)]
    src = t if rule.split == "rep" else t.chunk(parts, dim=0 if rule.split == "row" else 1)[index]
    src = src.contiguous()
    return [Piece(target, _rows_before(name, rule, parts, hf) * src[0].numel(), src)]


def _rows_before(name: str, rule: Place, tp: int, hf) -> int:
    """Rows of a fused parameter that come before `name`'s part on one rank (parts differ in size:
    q_a has q_lora_rank rows, kv_a kv_lora_rank + rope)."""
    if not rule.part:
        return 0
    head = name[:-len(rule.suffix)]
    leaf = rule.suffix.split(".")[-2]
    rows = 0
    for sibling in rule.parts[:rule.part]:
        rows += hf_shape(hf, head + rule.suffix.replace(leaf, sibling))[0] // (tp if rule.split == "row" else 1)
    return rows


def _qkv_piece(name, target, t, rule, tp, tp_rank, hf) -> Piece:
    heads, kv, d = hf.num_attention_heads, hf.num_kv_heads, hf.head_dim
    q_rows = heads // tp * d
    kv_per = max(1, kv // tp)  # kv heads on this rank (replicated when tp > kv heads)
    kv_index = tp_rank * kv // tp if kv < tp else tp_rank * kv_per
    if rule.part == 0:
        src, start = t[tp_rank * q_rows:(tp_rank + 1) * q_rows], 0
    else:
        src = t[kv_index * d:(kv_index + kv_per) * d]
        start = q_rows + (rule.part - 1) * kv_per * d
    width = t[0].numel() if t.dim() > 1 else 1
    return Piece(target, start * width, src.contiguous())


def load_order(name: str, hf) -> tuple:
    """Sort key of HF tensor `name` by where it lands in SGLang: its parameter, then the expert and
    the fused part (w13[e] = [gate_e; up_e], w2[e] = down_e)."""
    target, rule = engine_param(name, hf)
    expert = expert_of(name) if rule.split in ("moe_row", "moe_col") else -1
    return target, expert, rule.part


def load_direct(params: dict[str, torch.Tensor], flat: torch.Tensor, metas, layout: EngineLayout, tp_rank: int,
                hf) -> None:
    """A flattened bucket (`mcore_rl.sync.bucket`: its buffer and per-tensor metadata) copied straight
    into SGLang engine rank `tp_rank`'s parameters where `place` puts each HF tensor: what SGLang's
    `load_weights` does, without its per-tensor name matching (a layer of 128 experts is 384 tensors,
    each matched against a list of 384 expert names; `rollout.sync_load: direct`). Only for models
    SGLang derives nothing from after loading (not MLA, not FP8).
    Tensors that follow each other both in the bucket and in one parameter (a layer's experts, in
    the plan's `load_order`) go as one copy. The copies of a bucket are worked out once: every sync
    sends the same buckets, and the per-tensor work was most of a direct load's host time."""
    key = (repr(layout), tp_rank, repr(sorted(hf.cfg.items())), tuple((m.name, m.start_idx, m.end_idx) for m in metas))
    if key not in _COPIES:
        _COPIES[key] = [_copy(flat, *run) for run in _runs(unflatten(flat, metas), layout, tp_rank, hf)]
    with torch.no_grad():
        for param, offset, start, numel, dtype, vocab, origin in _COPIES[key]:
            if origin is None:  # a slice of the bucket
                src = flat[start:start + numel * dtype.itemsize].view(dtype)
            else:  # a TP slice of one tensor, made contiguous: sliced again
                (name, t), = unflatten(flat, [metas[origin[0]]])
                src = place(name, t, layout, tp_rank, hf)[origin[1]].src.view(-1)
            dst = params[param].data.view(-1)
            dst[offset:offset + numel].copy_(src)
            if vocab:  # past the vocab: zero, as SGLang's loader leaves it
                dst[numel:].zero_()


# per engine rank, model and bucket (its tensors' names and places): the copies `load_direct` makes
_COPIES: dict[tuple, list[tuple]] = {}


def _copy(flat: torch.Tensor, param: str, offset: int, src: torch.Tensor, vocab: bool, origin: tuple) -> tuple:
    """(param, offset, byte start in `flat`, numel, dtype, is vocab, origin): origin None where the
    source is a slice of `flat`, else (tensor, piece) of the `place` piece it is."""
    if src.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
        start, origin = src.storage_offset() * src.element_size() - flat.storage_offset(), None
    else:
        start = -1
    return param, offset, start, src.numel(), src.dtype, vocab, origin


def _runs(named, layout: EngineLayout, tp_rank: int, hf):
    """(parameter, element offset, 1-D source, is vocab, (tensor, piece) it starts with) per copy:
    `place`'s pieces, a piece joined to the one before where it continues it in memory (the same
    buffer, right after) and in the parameter (right after)."""
    run = None  # [param, offset, first source, numel, origin]
    for i, (name, t) in enumerate(named):
        vocab = _rule(name, hf).split == "vocab"
        for k, p in enumerate(place(name, t, layout, tp_rank, hf)):
            if run is not None and not vocab and run[0] == p.param and run[1] + run[3] == p.offset \
                    and _continues(run[2], run[3], p.src):
                run[3] += p.src.numel()
                continue
            if run is not None:
                yield run[0], run[1], _span(run[2], run[3]), False, run[4]
            if vocab:
                yield p.param, p.offset, p.src.view(-1), True, (i, k)
                run = None
            else:
                run = [p.param, p.offset, p.src, p.src.numel(), (i, k)]
    if run is not None:
        yield run[0], run[1], _span(run[2], run[3]), False, run[4]


def _continues(first: torch.Tensor, numel: int, src: torch.Tensor) -> bool:
    return (src.dtype == first.dtype and src.device == first.device and src.is_contiguous()
            and src.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and src.storage_offset() == first.storage_offset() + numel)


def _span(first: torch.Tensor, numel: int) -> torch.Tensor:
    """`numel` elements of `first`'s buffer from where `first` starts."""
    return first.as_strided((numel,), (1,), first.storage_offset())


class ExpectedDigests:
    """Digests of what SGLang engine rank(s) must hold, accumulated piece by piece as a sync sends
    the HF tensors (no fused tensor is ever built). `digests[tp_rank][param] = (sum, weighted sum)`
    as `mcore_rl.sync.checksum.digest` computes them over the whole parameter (zero padding adds 0)."""

    def __init__(self, layout: EngineLayout, hf, tp_ranks):
        self.layout, self.hf = layout, hf
        self.digests: dict[int, dict[str, list[int]]] = {r: {} for r in tp_ranks}

    def add(self, named) -> None:
        for name, t in named:
            for r, acc in self.digests.items():
                for piece in place(name, t, self.layout, r, self.hf):
                    _, s, w = digest(piece.src, piece.offset)
                    have = acc.setdefault(piece.param, [0, 0])
                    have[0], have[1] = (have[0] + s) & _U64, (have[1] + w) & _U64


def held_whole(names, layout: EngineLayout, hf) -> set[str]:
    """The engine parameters every rank of `layout` holds whole, from HF tensors `names`: no source of
    theirs split over the ranks, none an expert. Such a parameter is one tensor on every rank."""
    whole, split = set(), set()
    for name in names:
        target, rule = engine_param(name, hf)
        parts, _ = layout.parts_of(rule, 0)  # a rule's part count is the same on every rank
        (whole if parts == 1 and not rule.split.startswith("moe_") else split).add(target)
    return whole - split


def replica_problems(actual: dict[int, dict], whole: set[str], where: str) -> list[str]:
    """Problems (as lines) where an engine's ranks read back different digests of a parameter each holds
    whole (`held_whole`): each rank matches the trainer rank that fed it, but those trainer ranks
    disagree on a tensor they should share (a router's bias shifted on one rank only, say)."""
    problems = []
    for param in sorted(whole):
        got = {r: (d[param][3] & _U64, d[param][4] & _U64) for r, d in sorted(actual.items()) if param in d}
        if len(set(got.values())) > 1:
            problems.append(f"{where}: {param} differs between tp ranks {sorted(got)}, each of which holds it "
                            "whole: the trainer ranks that fed them disagree on it")
    return problems


def compare_engine(expected: dict[int, dict], actual: dict[int, dict], where: str) -> list[str]:
    """Problems (as lines) between expected digests and an engine's `weight_digests()` per tp rank:
    a parameter the sync filled that differs or is missing, or one the engine has that no synced
    tensor reached (SGLang ignores names it does not know: such a parameter would stay stale), and a rank
    that reported digests but was expected nothing (a read-back must not pass by checking no rank)."""
    problems = [f"{where} tp rank {r}: its digests were read but no synced tensor was expected there (not verified)"
                for r in sorted(set(actual) - set(expected))]
    for r, want in expected.items():
        have = actual.get(r)
        if have is None:
            problems.append(f"{where} tp rank {r}: no digests reported")
            continue
        for param, (s, w) in want.items():
            got = have.get(param)
            if got is None:
                problems.append(f"{where} tp rank {r}: SGLang has no parameter {param}")
            elif (got[3] & _U64, got[4] & _U64) != (s, w):
                problems.append(f"{where} tp rank {r}: {param} differs from the trainer's weights")
        for param in sorted(set(have) - set(want)):
            problems.append(f"{where} tp rank {r}: {param} was not reached by any synced tensor")
    return problems
