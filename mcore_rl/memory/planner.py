"""Per-GPU memory plan of colocated training and rollout, refused before anything is allocated.

Everything is bytes on one GPU; for the trainer, the worst pipeline stage. Shapes come from
`layout.inventory` (megatron's meta model + the declarative mapping), never from formulas here.

Trainer (one rank of PP stage s; N_d dense and N_e expert elements it holds, `layout.py`):
  weights    = (N_d + N_e) * b            b = 2 for bf16, 4 for fp32; the router's expert bias: 4 B
  grads      = (N_d + N_e) * (4 if memory.grad_fp32 else b)
  optimizer  = o * (N_d / dp + N_e / edp) with the distributed optimizer, else o * (N_d + N_e);
               o = 4 (fp32 main params, only when b != 4) + 8 (Adam's two fp32 moments) * (1 - f),
               f = memory.optimizer_offload_fraction (those moments live on the host; the main
               params stay), dp = world / (tp * pp), edp = world / (pp * ep * etp) (expert DP)
  activations, T = tokens per micro-batch (micro_batch_size * (prompt + response), or
               ppo_max_token_len_per_gpu with dynamic batching), n = its response tokens (the rows
               whose log-probs are taken; T * max_response_len / (max_prompt_length +
               max_response_len) unless given):
               per layer ACT * T * h / tp, plus T * topk / tp * (2h + 3 * I_moe / etp) * 2 for the
               routed experts of an MoE layer (balanced routing: each rank of the EP group gets its
               share of the T / tp tokens every TP rank holds under sequence parallelism), and at
               ep > 1 T * topk / tp * 2h * 2 for the dispatch: the EP=2 runs named below hold two
               more copies of each routed token's hidden state per MoE layer than the EP=1 runs
               (its sent and received sides), about 1 GiB a layer at 16 k tokens, and selective
               "moe" recompute does not drop them.
               ACT depends on the packed attention (actor.packed_attention). "varlen" (one flash
               call, the GPU default): ACT = 21, fitted on seven 2 x H200 EP=2 runs of 8 Moonlight
               layers at 14-16 k-token micro-batches (benchmarks/RESULTS.md at d90d714, issue 15): every
               recompute and offload choice within 2.3 % of the measured peak; then, with the EP
               term split off, on 1 x H100 and 1 x H200 EP=1 loop runs of 4 and 8 layers at 16 k
               tokens (a flat 42 at every EP was 5-6 % high there); at EP=1 and 6.3 k tokens
               (actor_bench on 1 x H100, not fitted) every memory option is 0.2-4.6 % under. Korthikanti et al.'s
               34 (bf16, sequence parallel, flash attention) leaves out MLA's wider q/k/v, RoPE'd
               copies, norms in fp32, shared experts, router and dispatch. "sdpa" (an SDPA call per
               sequence; MLA's unequal q/v widths keep it off flash kernels, so each sequence's
               scores are stored): ACT = 132, fitted on the H200 runs at 2064-token sequences; it
               over-predicts by 8 % at 14 k-token micro-batches of 512-4096-token sequences.
               Recompute: full keeps 2 * T * h / tp per recomputed layer (its input) and, when every
               layer is recomputed, one layer's full set while it is rebuilt in backward;
               recompute_layers = N recomputes the first N layers of the stage (megatron's block
               method). Selective "moe" keeps of an MoE layer only its input, dropping the routed
               term, the shared experts' 8 * I_shared / tp and the router's 16 E bytes per token;
               "mlp" drops a dense MLP's 8 * I / tp bytes per token (fc1 output, SiLU, product).
               1F1B keeps pp - s micro-batches in flight on stage s; the last stage adds the
               output head (the actor gathers full-vocabulary logits on every TP rank): 2 T V (bf16
               logits, later their gradient) + 14 n V (the selected rows as fp32, log-softmax,
               exp and their gradients, measured on the autograd chain) or, with
               actor.fused_logprobs, 2 n V (bf16 rows kept, mcore_rl.models.head) + one chunk of fp32
               temporaries (mcore_rl.models.head.CHUNK_BYTES).
               The optimizer step runs after backward has freed the activations; it allocates an
               fp32 copy of the rank's shard of bf16 grads (memory.grad_fp32=false) and torch's
               multi-tensor AdamW one fp32 temporary per moment element (none with
               actor.fused_adam or the offloading optimizer), 4 B an element each: the larger of
               the two peaks counts.
Engine (SGLang, one rank of an engine with tp_size, ep_size; moe_tp = tp / ep):
  weights    = the rank's tensors in SGLang's layout (`layout.engine_tensors`): vocab-split
               embeddings/lm_head, replicated q_a/kv_a, experts E/ep per rank split over moe_tp,
               plus SGLang's w_kc/w_vc copies of kv_b_proj; with rollout.weight_dtype=fp8 the
               linear weights are 1 B an element plus an fp32 scale per 128 x 128 block (w_kc/w_vc
               stay in the model dtype)
  KV cache   per token: MLA (kv_lora_rank + qk_rope_head_dim) * L * 2 B (not split over tp);
               MHA/GQA 2 * max(1, kv_heads / tp) * head_dim * L * 2 B. With plain TP every rank
               holds the KV of all the engine's requests (MLA's latent replicated); under DP
               attention (rollout.dp_attention, dp = tp) a rank holds only its own requests', so
               the engine holds dp x the tokens (max_total_tokens is SGLang's per rank either way)
  mem_fraction_static f: SGLang measures the free memory P before loading (pre_model_load_memory)
               and sizes the pool as free-after-load - P * (1 - f), i.e. weights + KV = f * P and
               (1 - f) * P is left for CUDA graphs and activations. P here is the capacity minus
               what is resident between phases (reserved, sync buffers, trainer states if not
               offloaded). The planner picks the largest f (step 0.01, at most 0.95) whose
               (1 - f) * P still holds the CUDA graphs and runtime activations.
  CUDA graphs = memory.cuda_graph_gb, or about cuda_graph_max_bs * (4 V / tp + 64 h) + 512 MiB
               (V whole under DP attention: lm_head per rank)
               (the largest batch's logits and hidden buffers, shared pool). Under hook mode
               "torch" torch_memory_saver cannot pause graph memory: it stays in every phase.
  activations = chunked_prefill_size * 32 h + B * S * V, B = max_running_requests (the largest
               decode batch: rollout.max_running_requests, by default cuda_graph_max_bs), S the
               sampler's bytes per row and vocabulary entry over the full gathered vocabulary:
               32 with seeded sampling (SGLang 0.5.17's pytorch sampler: fp32 probs, their log,
               the uint32 hash and two fp64 rows of its Gumbel trick), 12 otherwise
Always resident: memory.reserved_gb, what both processes hold outside the tensors planned here.
Measured per process on an H100 at Moonlight widths (4 layers, the monitor's split of each phase's
peak): the trainer 3.5 GiB with its states offloaded and its allocator empty (CUDA context,
kernels and NCCL's communicators, which appear with the first update: 1.3 GiB before it), the
released engine 2.6 GiB (context, NCCL, its allocator's cache, the buffers SGLang stashes); the
default 6 GiB is their sum. In the sync phase, 3 sync buckets of memory.sync_bucket_mb: the
trainer's two bucket buffers (the engine loads one while the next is filled) and the gathers
filling one (with one buffer, its allocator peaked at 1.36 GiB with 512 MiB buckets); the sync
frees them (`empty_cache`) before the rollout.

Phases: train (engine released), sync (engine weights resumed, trainer's weights still on the GPU,
its other states released), rollout (KV cache and CUDA graphs resumed). A phase over capacity
raises MemoryPlanError(phase, shortfall).

Host memory per node (`mcore_rl.memory.host`, given HostInputs): made with the GPU plan, shown
after its table, and refused (HostPlanError, a MemoryPlanError) once the GPU plan fits.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from mcore_rl.memory.layout import engine_tensors, inventory, megatron_rank_numel
from mcore_rl.models.config import HFModel, stage_layers

if TYPE_CHECKING:  # host.py imports this module and fills Plan.host
    from mcore_rl.memory.host import HostPlan

GiB = 1 << 30
MiB = 1 << 20
PHASES = ("train", "sync", "rollout")
SYNC_BUCKETS = 3  # two bucket buffers in flight and the gathers filling one (docstring)
# Kept trainer states (offload_train_states false): what the trainer's process holds beyond them while
# the engine runs. Measured on 4 x H200, Moonlight's 27 layers, TP4 engine (2026-11-28): its allocator
# reserved 2.0 GiB over the kept states after the sync, and the rollout peaked 2.0 GiB over a plan made
# with 3 GiB more reserve (6 GiB of reserve alone: the KV resume was refused, 2.2 GiB short).
KEPT_STATES_SLACK = 5 * GiB
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


class MemoryPlanError(RuntimeError):
    """A phase does not fit on the GPU; carries the plan so the table can show where."""

    def __init__(self, phase: str, shortfall: int, plan: "Plan | None" = None, why: str = ""):
        self.phase, self.shortfall, self.plan, self.why = phase, shortfall, plan, why
        need = f" ({why})" if why else ""
        super().__init__(f"memory plan refused: phase '{phase}' is short by {shortfall / GiB:.2f} GiB "
                         f"per GPU{need}")



ACT = {"varlen": 21, "sdpa": 132}  # activation bytes per token and hidden unit per layer, by attention (docstring)
DISPATCH_COPIES = 2  # hidden-state copies of each routed token an MoE layer keeps more at ep > 1 (docstring)
HEAD_PLAIN = 14  # bytes per response token and vocabulary entry of the autograd log-prob chain
HEAD_FUSED = 2  # the same through mcore_rl.models.head: the bf16 rows it keeps
RECOMPUTE_MODES = ("none", "full", "selective")
# the update's largest micro-batch, logged each step (packed tokens, log-prob rows, longest sequence):
# Plan.train_at evaluates the train phase at the first two
LARGEST_MICRO = ("memory/micro_batch_tokens", "memory/micro_batch_response_tokens",
                 "memory/micro_batch_longest_sequence")

@dataclass(frozen=True)
class PlanInputs:
    """What the planner needs, taken from a Config (`from_config`) or given directly (tests)."""

    capacity: int  # bytes usable on one GPU
    world: int  # actor GPUs
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    dtype: str = "bf16"
    micro_tokens: int = 4096
    rollout_tp: int = 1
    rollout_ep: int = 1
    rollout_attn_dp: int = 1  # DP attention: attention-DP ranks of an engine, each with its own requests' KV
    rollout_weight_dtype: str = "bf16"  # fp8: the engine's linear weights in block FP8 (+ fp32 scales)
    mem_fraction_static: float | None = None  # None: pick
    seq_len: int = 4096  # one full sequence (prompt + response) must fit in the KV cache
    cuda_graph_max_bs: int = 256
    max_running_requests: int | None = None  # None: cuda_graph_max_bs
    seeded_sampling: bool = True
    chunked_prefill_size: int = 8192
    cuda_graph_bytes: int | None = None
    reserved: int = 6 * GiB
    sync_bucket: int = 512 * MiB
    offload_train_states: bool = True
    distributed_optimizer: bool = True
    grad_fp32: bool = True
    recompute: str = "none"  # none | full | selective (True: full, as memory.recompute_activations)
    recompute_layers: int | None = None  # full: the first N layers of a stage; None: all
    recompute_modules: tuple[str, ...] = ("moe",)  # selective
    optimizer_offload_fraction: float = 0.0
    response_tokens: int | None = None  # log-prob rows per micro-batch; None: all micro_tokens
    fused_logprobs: bool = True
    fused_adam: bool = True
    hook_mode: str = "preload"
    packed_attention: str = "varlen"  # varlen | sdpa (actor.packed_attention)

    def __post_init__(self):
        if isinstance(self.recompute, bool):  # the older boolean: full recompute
            object.__setattr__(self, "recompute", "full" if self.recompute else "none")
        if self.packed_attention not in ACT:
            raise ValueError(f"packed_attention {self.packed_attention!r}: expected one of {tuple(ACT)}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute {self.recompute!r}: expected one of {RECOMPUTE_MODES}")
        object.__setattr__(self, "recompute_modules", tuple(self.recompute_modules))

    @classmethod
    def from_config(cls, cfg, capacity: int, budget: int | None = None, recompute: str | None = None) -> "PlanInputs":
        """budget, recompute: in place of the config's (its "auto": AUTO_BUDGET_MAX, none)."""
        from mcore_rl.config.checks import actor_gpus, attention_dp, max_running_requests, recompute_choice

        a, r, m, d, p = cfg.actor, cfg.rollout, cfg.memory, cfg.data, cfg.parallel
        seq = d.max_prompt_length + r.max_response_len
        if budget is None:
            budget = AUTO_BUDGET_MAX if a.ppo_max_token_len_per_gpu == "auto" else a.ppo_max_token_len_per_gpu
        micro = budget if a.use_dynamic_bsz else a.micro_batch_size * seq
        mode, layers, modules = recompute_choice(m)
        mode = recompute or ("none" if mode == "auto" else mode)
        gpu = cfg.cluster.device == "gpu"  # the actor's null switches follow the device
        return cls(
            capacity=capacity, world=actor_gpus(cfg), tp=p.tp, pp=p.pp, ep=p.ep, etp=p.etp,
            dtype=cfg.model.dtype, micro_tokens=micro, response_tokens=-(-micro * r.max_response_len // seq),
            recompute=mode, recompute_layers=layers, recompute_modules=modules,
            optimizer_offload_fraction=m.optimizer_offload_fraction,
            fused_logprobs=gpu if a.fused_logprobs is None else a.fused_logprobs,
            fused_adam=gpu if a.fused_adam is None else a.fused_adam,
            packed_attention=a.packed_attention or ("varlen" if gpu else "sdpa"),
            rollout_tp=r.tp_size, rollout_ep=r.ep_size, rollout_attn_dp=attention_dp(cfg),
            rollout_weight_dtype=r.weight_dtype,
            mem_fraction_static=None if m.auto_mem_fraction else r.mem_fraction_static,
            seq_len=seq, cuda_graph_max_bs=r.cuda_graph_max_bs, chunked_prefill_size=r.chunked_prefill_size,
            max_running_requests=max_running_requests(cfg), seeded_sampling=r.seeded,
            cuda_graph_bytes=None if m.cuda_graph_gb is None else int(m.cuda_graph_gb * GiB),
            reserved=int(m.reserved_gb * GiB), sync_bucket=m.sync_bucket_mb * MiB,
            offload_train_states=m.offload_train_states, distributed_optimizer=cfg.actor.use_distributed_optimizer,
            grad_fp32=m.grad_fp32, hook_mode=m.saver_hook_mode)


@dataclass
class Plan:
    inputs: PlanInputs
    phases: dict[str, dict[str, int]]  # phase -> component -> bytes
    mem_fraction_static: float
    kv_tokens: int
    worst_stage: dict[str, int]
    notes: list[str] = field(default_factory=list)
    host: HostPlan | None = None  # host memory per node (mcore_rl.memory.host), when planned
    hf: HFModel | None = field(default=None, repr=False)  # the model planned (make_plan sets it)

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    def train_at(self, tokens: int, response_tokens: int) -> int:
        """The train phase's bytes by this plan's own model for a step whose largest micro-batch
        packed `tokens` tokens with `response_tokens` log-prob rows: what the step should have used.
        The plan's own train phase is this at the budget, every micro-batch full: the bound a plan
        is refused by."""
        at = dataclasses.replace(self.inputs, micro_tokens=tokens, response_tokens=min(response_tokens, tokens))
        return sum(train_phase(self.hf, at)[0].values())

    def resume_needs(self) -> dict[str, int]:
        """Bytes each engine resume takes, by tag (the Colocation's guard): the weights, then the KV
        cache with the CUDA graphs where the saver releases them (hook mode "preload")."""
        rollout, pinned = self.phases["rollout"], "engine cuda graphs" in self.phases["train"]
        return {"weights": rollout["engine weights"],
                "kv_cache": rollout["engine kv cache"] + (0 if pinned else rollout["engine cuda graphs"])}

    def metrics(self) -> dict[str, float]:
        """The plan as run metrics, in GiB: each phase's total per GPU, the GPU capacity and, when
        planned, the fullest node's host memory and RAM (memory/*_peak_gib_* are the readings)."""
        out = {f"plan/gpu_gib_{ph}": self.total(ph) / GiB for ph in PHASES}
        out["plan/gpu_capacity_gib"] = self.inputs.capacity / GiB
        if self.host is not None:
            out["plan/host_gib"] = self.host.total(self.host.fullest) / GiB
            if self.host.ram is not None:
                out["plan/host_ram_gib"] = self.host.ram / GiB
        return out

    def shortfalls(self) -> dict[str, int]:
        return {ph: self.total(ph) - self.inputs.capacity for ph in PHASES
                if self.total(ph) > self.inputs.capacity}

    def table(self) -> str:
        comps = list(dict.fromkeys(c for ph in PHASES for c in self.phases[ph]))
        w = max(len(c) for c in comps + ["free (capacity - total)"]) + 2
        head = f"{'GiB per GPU':<{w}}" + "".join(f"{ph:>10}" for ph in PHASES)
        lines = [head, "-" * len(head)]
        for c in comps:
            lines.append(f"{c:<{w}}" + "".join(f"{self.phases[ph].get(c, 0) / GiB:>10.2f}" for ph in PHASES))
        lines.append("-" * len(head))
        lines.append(f"{'total':<{w}}" + "".join(f"{self.total(ph) / GiB:>10.2f}" for ph in PHASES))
        cap = self.inputs.capacity
        lines.append(f"{'capacity':<{w}}" + "".join(f"{cap / GiB:>10.2f}" for _ in PHASES))
        lines.append(f"{'free (capacity - total)':<{w}}"
                     + "".join(f"{(cap - self.total(ph)) / GiB:>10.2f}" for ph in PHASES))
        over = ["OVER" if self.total(ph) > cap else "ok" for ph in PHASES]
        lines.append(f"{'fits':<{w}}" + "".join(f"{o:>10}" for o in over))
        i = self.inputs
        lines.append("")
        lines.append(f"trainer: tp={i.tp} pp={i.pp} ep={i.ep} etp={i.etp} on {i.world} GPUs, worst stage "
                     f"{self.worst_stage['train']}; engine: tp={i.rollout_tp} ep={i.rollout_ep}"
                     + (f" dp_attention={i.rollout_attn_dp}" if i.rollout_attn_dp > 1 else ""))
        lines.append(f"mem_fraction_static={self.mem_fraction_static:.2f} -> KV cache "
                     f"{self.kv_tokens:,} tokens ({self.kv_tokens // max(i.seq_len, 1):,} full "
                     f"sequences of {i.seq_len})" + (" per rank, each for its own requests (an engine: "
                     f"{self.kv_tokens * i.rollout_attn_dp:,})" if i.rollout_attn_dp > 1 else ""))
        lines += self.notes
        if self.host is not None:
            lines += ["", self.host.table()]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"capacity": self.inputs.capacity, "phases": self.phases,
                "totals": {ph: self.total(ph) for ph in PHASES},
                "mem_fraction_static": self.mem_fraction_static, "kv_tokens": self.kv_tokens,
                "worst_stage": self.worst_stage, "host": None if self.host is None else self.host.as_dict()}


# ----------------------------------------------------------------------------- components
def optimizer_elements(hf: HFModel, i: PlanInputs, n: dict) -> int:
    """fp32 main-param (and Adam moment) elements of a rank holding `n` (megatron_rank_numel)."""
    if not i.distributed_optimizer:
        return n["dense"] + n["expert"]
    dp, edp = i.world // (i.tp * i.pp), i.world // (i.pp * i.ep * i.etp)
    return math.ceil(n["dense"] / dp) + math.ceil(n["expert"] / edp)


def trainer_bytes(hf: HFModel, i: PlanInputs, stage: int) -> dict[str, int]:
    b = DTYPE_BYTES[i.dtype]
    n = megatron_rank_numel(inventory(hf), hf, tp=i.tp, pp=i.pp, ep=i.ep, etp=i.etp, stage=stage)
    elements = optimizer_elements(hf, i, n)
    moments = moment_bytes(elements, i.optimizer_offload_fraction)[0]
    return {"megatron weights": (n["dense"] + n["expert"]) * b + n["buffer"] * 4,
            "megatron grads": (n["dense"] + n["expert"]) * (4 if i.grad_fp32 else b),
            "megatron optimizer": (4 if b != 4 else 0) * elements + moments,
            "megatron activations": max(activation_bytes(hf, i, stage), step_temporary_bytes(hf, i, stage))}


def moment_bytes(elements: int, offload_fraction: float) -> tuple[int, int]:
    """(GPU, host) bytes of Adam's two fp32 moments of `elements`, the offloaded share on the host."""
    gpu = round(8 * elements * (1 - offload_fraction))
    return gpu, 8 * elements - gpu


def step_temporary_bytes(hf: HFModel, i: PlanInputs, stage: int) -> int:
    """What the optimizer step allocates on top of the states: with bf16 grads, megatron's fp32 copy
    of the rank's optimizer shard of them (`main_grad.float()`; freed by `optim.step` once the step
    is done), and multi-tensor AdamW's sqrt(v) copy (the fused kernel, also the hybrid offload
    optimizer's, allocates none); 4 B per optimizer element each."""
    n = megatron_rank_numel(inventory(hf), hf, tp=i.tp, pp=i.pp, ep=i.ep, etp=i.etp, stage=stage)
    copies = (not i.grad_fp32 and DTYPE_BYTES[i.dtype] != 4) + (not i.fused_adam and i.optimizer_offload_fraction == 0)
    return 4 * copies * optimizer_elements(hf, i, n)


def activation_bytes(hf: HFModel, i: PlanInputs, stage: int) -> int:
    """Stored activations of the stage's micro-batches in flight, plus the output head."""
    T, h, E = i.micro_tokens, hf.hidden_size, hf.num_experts
    layers = stage_layers(hf.num_layers, i.pp)[stage]

    routed = T * hf.num_experts_per_tok // i.tp * (2 * h + 3 * hf.moe_intermediate_size // i.etp) * 2
    dispatch = T * hf.num_experts_per_tok // i.tp * DISPATCH_COPIES * h * 2 * (i.ep > 1)

    def full(layer: int) -> int:
        return ACT[i.packed_attention] * T * h // i.tp + (routed + dispatch) * hf.is_moe_layer(layer)

    def selective(layer: int) -> int:  # what rerunning recompute_modules in backward leaves stored
        a = full(layer)
        if hf.is_moe_layer(layer) and "moe" in i.recompute_modules:
            shared = hf.num_shared_experts * hf.moe_intermediate_size
            a -= routed + T * (8 * shared + 16 * E) // i.tp  # the dispatch's copies stay
        elif not hf.is_moe_layer(layer) and "mlp" in i.recompute_modules:
            a -= T * 8 * hf.intermediate_size // i.tp
        return a

    if i.recompute == "full":
        first = len(layers) if i.recompute_layers is None else min(i.recompute_layers, len(layers))
        stored = first * 2 * T * h // i.tp + sum(full(x) for x in layers[first:])
        if first == len(layers):  # one layer rebuilt at a time in backward
            stored += max((full(x) for x in layers), default=0)
    elif i.recompute == "selective":
        stored = sum(selective(x) for x in layers)
    else:
        stored = sum(full(x) for x in layers)
    total = (i.pp - stage) * stored
    if stage == i.pp - 1:
        total += head_bytes(hf, i)
    return total


def head_bytes(hf: HFModel, i: PlanInputs) -> int:
    """The output head's peak: full-vocabulary logits of the micro-batch and the log-prob rows."""
    from mcore_rl.models.head import CHUNK_BYTES

    T, V = i.micro_tokens, hf.vocab_size
    n = T if i.response_tokens is None else min(i.response_tokens, T)
    if i.fused_logprobs:
        return 2 * T * V + HEAD_FUSED * n * V + min(CHUNK_BYTES, 4 * n * V)
    return 2 * T * V + HEAD_PLAIN * n * V


def kv_bytes_per_token(hf: HFModel, tp: int) -> int:
    if hf.is_mla:
        return (hf.kv_lora_rank + hf.qk_rope_head_dim) * hf.num_layers * 2
    return 2 * max(1, hf.num_kv_heads // tp) * hf.head_dim * hf.num_layers * 2


def engine_weight_bytes(hf: HFModel, i: PlanInputs) -> int:
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[i.dtype]
    ts = engine_tensors(hf, inventory(hf), tp=i.rollout_tp, ep=i.rollout_ep, attn_dp=i.rollout_attn_dp, dtype=dtype,
                        weight_dtype=i.rollout_weight_dtype)
    return sum(t.nbytes for t in ts.values())


def cuda_graph_bytes(hf: HFModel, i: PlanInputs) -> int:
    if i.cuda_graph_bytes is not None:
        return i.cuda_graph_bytes
    vocab = hf.vocab_size * i.rollout_attn_dp // i.rollout_tp  # a rank's logits (the whole vocab under DP attention)
    return i.cuda_graph_max_bs * (4 * vocab + 64 * hf.hidden_size) + 512 * MiB


SAMPLER_SEEDED, SAMPLER_PLAIN = 32, 12  # bytes per decode row and vocabulary entry (docstring)


def engine_activation_bytes(hf: HFModel, i: PlanInputs) -> int:
    rows = i.max_running_requests or i.cuda_graph_max_bs
    per_entry = SAMPLER_SEEDED if i.seeded_sampling else SAMPLER_PLAIN
    return i.chunked_prefill_size * 32 * hf.hidden_size + rows * per_entry * hf.vocab_size


# ----------------------------------------------------------------------------- the plan
def make_plan(hf: HFModel, i: PlanInputs) -> Plan:
    """The per-phase plan; raises MemoryPlanError naming the phase with the largest shortfall (host
    memory is added by mcore_rl.memory.host.plan_with_host)."""
    stages = [trainer_bytes(hf, i, s) for s in range(i.pp)]
    states = ("megatron weights", "megatron grads", "megatron optimizer")
    train, worst_train = train_phase(hf, i, stages)
    worst_rest = max(range(i.pp), key=lambda s: sum(stages[s][k] for k in states))
    rest = stages[worst_rest]
    # kept states: the grads are freed all the same (Colocation.offload), the rest stays
    residue = {} if i.offload_train_states else {**{k: rest[k] for k in states if k != "megatron grads"},
                                                  "trainer cache (kept states)": KEPT_STATES_SLACK}
    always, pinned = _always(i), _pinned(hf, i)
    buckets = {"sync buckets": SYNC_BUCKETS * i.sync_bucket}
    # offloaded states leave in two parts: the weights after the sync, which reads them on the GPU
    synced_from = {} if residue else {"megatron weights": rest["megatron weights"]}
    w_engine, graphs = engine_weight_bytes(hf, i), cuda_graph_bytes(hf, i)
    act_engine = engine_activation_bytes(hf, i)

    P = i.capacity - sum(always.values()) - sum(residue.values()) - sum(pinned.values())
    if i.mem_fraction_static is None:
        f = max(0.0, min(0.95, math.floor((P - graphs * (not pinned) - act_engine) / max(P, 1) * 100) / 100))
    else:
        f = i.mem_fraction_static
    kv = max(0, int(f * max(P, 0)) - w_engine)  # a GPU smaller than what is always reserved: no KV at all
    per_token = kv_bytes_per_token(hf, i.rollout_tp)
    phases = {
        "train": train,
        "sync": {**always, **pinned, **residue, **synced_from, **buckets, "engine weights": w_engine},
        "rollout": {**always, **pinned, **residue, "engine weights": w_engine, "engine kv cache": kv,
                    "engine cuda graphs": graphs, "engine activations": act_engine},
    }
    plan = Plan(i, phases, f, kv // per_token, {"train": worst_train, "other": worst_rest}, hf=hf)
    plan.notes.append(f"engine weights per rank {w_engine / GiB:.2f} GiB; KV {per_token:,} B/token")
    if (i.max_running_requests or 0) > i.cuda_graph_max_bs:
        plan.notes.append(f"decode batches of {i.cuda_graph_max_bs + 1}-{i.max_running_requests} run without "
                          "CUDA graphs: their activations beyond the sampler's are not planned")
    short = plan.shortfalls()
    if short:
        phase = max(short, key=short.get)
        raise MemoryPlanError(phase, short[phase], plan, _why(plan, phase))
    need_kv = i.seq_len * per_token
    if kv < need_kv:
        raise MemoryPlanError("rollout", need_kv - kv, plan,
                        f"the KV cache at mem_fraction_static={f:.2f} holds {kv // per_token} tokens, "
                        f"less than one sequence of {i.seq_len}")
    return plan


def train_phase(hf: HFModel, i: PlanInputs, stages: list[dict[str, int]] | None = None) -> tuple[dict[str, int], int]:
    """The train phase's components on the GPU of the worst PP stage, and that stage (`stages`: each
    stage's trainer_bytes, where the caller has them)."""
    stages = stages or [trainer_bytes(hf, i, s) for s in range(i.pp)]
    worst = max(range(i.pp), key=lambda s: sum(stages[s].values()))
    return {**_always(i), **_pinned(hf, i), **stages[worst]}, worst


def _always(i: PlanInputs) -> dict[str, int]:
    """What every phase holds on each GPU."""
    return {"reserved (contexts, NCCL)": i.reserved}


def _pinned(hf: HFModel, i: PlanInputs) -> dict[str, int]:
    """The engine's CUDA graphs, where the memory saver cannot release them (hook mode "torch")."""
    return {"engine cuda graphs": cuda_graph_bytes(hf, i)} if i.hook_mode == "torch" else {}


def _why(plan: Plan, phase: str) -> str:
    top = sorted(plan.phases[phase].items(), key=lambda kv: -kv[1])[:3]
    parts = ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in top)
    return f"needs {plan.total(phase) / GiB:.2f} of {plan.inputs.capacity / GiB:.2f} GiB; largest: {parts}"


# ----------------------------------------------------------------------------- micro-batch and recompute
BUDGET_STEP = 1024  # picked token budgets are multiples of this (or exactly one sequence)
AUTO_BUDGET_MAX = 16384  # the largest budget "auto" picks (or one sequence, if longer); the CPU's without a plan
# below this a recompute mode that fits more is preferred: at Moonlight's 64 experts (top-6) each
# expert's GEMM gets T * 6 / 64 rows, 384 at 4096 tokens
AUTO_BUDGET_FLOOR = 4096
RECOMPUTE_BY_COST = ("none", "selective", "full")  # what each adds to an update: nothing, MoE forwards, all forwards


def pick_micro_batch(hf: HFModel, at: Callable[[int, str], PlanInputs], *, budget: int | None,
                     modes: tuple[str, ...], min_budget: int, name: str | None = "actor.ppo_max_token_len_per_gpu",
                     refused_plan: Callable[[HFModel, PlanInputs], Plan] | None = None) -> tuple[PlanInputs, str]:
    """The plan inputs (`at(tokens, recompute mode)`) of the micro-batch token budget and recompute
    mode to run with, and a line saying which and whether picked.

    budget None: the first of `modes` (cheapest first) under which a budget of at least
    max(min_budget, AUTO_BUDGET_FLOOR) fits, with the largest budget up to max(AUTO_BUDGET_MAX,
    min_budget) that fits under it (a multiple of BUDGET_STEP, or min_budget: one sequence); else the
    mode fitting the largest. A given budget runs under the first of `modes` it fits in; one that fits
    in none is refused, the error naming (as `name`) the largest budget that fits (its plan made by
    `refused_plan`, default make_plan: memory.host.plan_with_host's carries the host side too). Only the train phase depends on these: a refusal of another
    phase is raised as it is."""
    def fits(tokens: int, mode: str) -> bool:
        try:
            make_plan(hf, at(tokens, mode))
        except MemoryPlanError as e:
            if e.phase != "train":
                raise
            return False
        return True

    def largest(mode: str, hi: int) -> int | None:
        sizes = [min_budget] + list(range((min_budget // BUDGET_STEP + 1) * BUDGET_STEP, hi + 1, BUDGET_STEP))
        if not fits(sizes[0], mode):
            return None
        lo, up = 0, len(sizes) - 1  # sizes[lo] fits; memory grows with the budget
        while lo < up:
            mid = (lo + up + 1) // 2
            lo, up = (mid, up) if fits(sizes[mid], mode) else (lo, mid - 1)
        return sizes[lo]

    def line(tokens: int, mode: str) -> str:
        how = f" (picked: the largest up to {cap} that fits)" if budget is None else ""
        picked = " (picked: the cheapest that fits)" if len(modes) > 1 else ""
        return f"micro-batch: {tokens:,} tokens per GPU{how}; recompute {mode}{picked}"

    cap = max(AUTO_BUDGET_MAX, min_budget)
    if budget is not None:
        for mode in modes:
            if fits(budget, mode):
                return at(budget, mode), line(budget, mode)
        best = max(((largest(m, budget), m) for m in modes), key=lambda lm: lm[0] or 0)
        hint = (f"the largest that fits is {best[0]} (memory.recompute: {best[1]})" if best[0]
                else f"not even one sequence ({min_budget} tokens) fits")
        _refuse(refused_plan or make_plan, hf, at(budget, modes[-1]), f"{name}={budget} cannot fit; {hint}" if name else "")
    floor, best = min(cap, max(min_budget, AUTO_BUDGET_FLOOR)), (None, modes[0])
    for mode in modes:
        tokens = largest(mode, cap)
        if tokens is not None and tokens >= floor:
            return at(tokens, mode), line(tokens, mode)
        if (tokens or 0) > (best[0] or 0):
            best = (tokens, mode)
    if best[0] is None:
        _refuse(refused_plan or make_plan, hf, at(min_budget, modes[-1]), f"no micro-batch of one sequence ({min_budget} tokens) fits, "
                                               f"even with recompute {modes[-1]}")
    return at(*best), line(*best)


def _refuse(plan, hf: HFModel, i: PlanInputs, hint: str) -> None:
    """`plan`'s refusal of `i`, its reason followed by `hint`."""
    try:
        plan(hf, i)
    except MemoryPlanError as e:
        raise MemoryPlanError(e.phase, e.shortfall, e.plan, "; ".join(x for x in (e.why, hint) if x)) from None
    raise AssertionError("a plan refused before fits now")  # pragma: no cover
