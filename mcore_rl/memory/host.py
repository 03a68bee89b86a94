"""Host memory per node of a run, next to the per-GPU plan, refused when it exceeds the node's RAM.

A node holds trainer ranks and engine ranks (GPUs are numbered node-major; trainer rank r runs on
GPU r, `mcore_rl.rollout.placement`), and its host memory is the sum over them of, per trainer
rank (PP stage s = r // (world / pp): megatron's rank order puts PP outermost):
  trainer states, pinned   weights + optimizer of the rank as the GPU plan's train phase counts
                           them, when colocated with an engine (not embedded) and
                           memory.offload_train_states: the offloader keeps exactly that much pinned
                           (the grad buffers are freed, not moved: each update zeroes them first)
  optimizer offload        memory.optimizer_offload_fraction of the Adam moments (those the GPU plan
                           leaves out), and as many bytes again: megatron's HybridDeviceOptimizer
                           keeps pinned fp32 copies of that share's main params and grads (4 + 4 B)
  reference model          the reference weights (use_kl_loss or use_kl_in_reward, memory.offload_ref)
  checkpoint save staging  max(2 GiB, 5 % of what the rank saves: its state incl. host moments, or
                           its weights with trainer.save_optimizer false): the checkpoint
                           writer's bound; with the states on the GPU at a save (not offloaded:
                           kept, not colocated, or the embedded engine) the rank's weights too,
                           which megatron's save stages on the host (measured on 4 x H200 at
                           27 Moonlight layers, states kept: a model-only save of 4 x 9.62 GiB of
                           weights raised the node's PSS by 43.2 GiB); none when the run never
                           saves (trainer.save_freq <= 0 and not trainer.save_last)
  trainer process          torch, megatron and the CUDA context's host side (memory.host_trainer_process_gb)
and per engine rank (a GPU of an SGLang or vLLM engine) its process with its share of the
tokenizer/detokenizer processes (memory.host_engine_process_gb). The process baselines are fitted
on the node's PSS, less the planned items, of the H200 loop runs since the grads stopped being pinned
(fe9ce60; below).

Node RAM: cluster.host_memory_gb, else this machine's MemTotal where it is a node of the run (its
GPUs are visible, as the GPU capacity then comes from them); elsewhere the plan is shown, not checked.
Not counted: the driver process, Ray's object store (shared memory) and a critic's states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mcore_rl.memory.layout import inventory, megatron_rank_numel
from mcore_rl.memory.planner import (GiB, Plan, MemoryPlanError, PlanInputs, make_plan, moment_bytes, optimizer_elements,
                                     trainer_bytes)
from mcore_rl.models.config import HFModel

# A trainer rank and the engine rank on its GPU: 7.2-9.0 GiB of the node's PSS beside the planned items
# on the nine H200 loop runs since fe9ce60 (bbf4835 to 2c0a7f5: Moonlight at 4, 16 and 27 layers, states
# kept or offloaded, 1-4 GPUs; docs/memory.md), 8 GiB the pair. The split follows issue 24's RSS on one
# H100 (trainer 7.4 GiB, engine rank 4.3), which counted shared pages in every process (8 + 4.5 GiB
# was planned from it: 56 % over the PSS of the 27-layer runs). The monitor's
# memory/host_pss_at_peak_gib_{phase}_{role} measures the split.
TRAINER_PROCESS_GB = 5.0
ENGINE_PROCESS_GB = 3.0
CKPT_STAGING_MIN, CKPT_STAGING_SHARE = 2 * GiB, 0.05  # the checkpoint writer's staging bound per rank

STATES = "trainer states, pinned"
OPT = "optimizer offload"
REF = "reference model"
CKPT = "checkpoint save staging"
TRAINER = "trainer processes"
ENGINE = "engine processes"
ITEMS = (STATES, OPT, REF, CKPT, TRAINER, ENGINE)
NOT_GIVEN = "node RAM not given; host plan not checked"


class HostPlanError(MemoryPlanError):
    """A node's host memory exceeds its RAM; carries the plan (GPU and host tables)."""

    def __init__(self, plan: Plan):
        host = plan.host
        node = host.fullest
        top = sorted(((v, k) for k, v in host.nodes[node].items() if v), reverse=True)[:3]
        RuntimeError.__init__(self, f"host memory plan refused: node {node} is short by {host.shortfall / GiB:.2f} "
                                    f"GiB (needs {host.total(node) / GiB:.2f} of {host.ram / GiB:.2f} GiB RAM; "
                                    "largest: " + ", ".join(f"{k} {v / GiB:.2f} GiB" for v, k in top) + ")")
        self.phase, self.shortfall, self.plan = "host", host.shortfall, plan


@dataclass(frozen=True)
class HostInputs:
    """Where ranks sit and what lives on the host, taken from a Config or given directly (tests)."""

    nnodes: int
    gpus_per_node: int
    engine_gpus: tuple[int, ...] = ()  # cluster-global GPUs with an engine rank
    offload_train_states: bool = True  # effective: colocated with an engine that is not embedded
    ref_on_host: bool = False
    saves: bool = True  # the run writes a checkpoint (trainer.save_freq > 0 or trainer.save_last)
    save_optimizer: bool = True  # and the optimizer's states in it
    save_stages_weights: bool = False  # the states are on the GPU when it does: their weights are staged
    ram: int | None = None  # bytes per node; None: not checked
    ram_source: str = NOT_GIVEN
    trainer_process: int = int(TRAINER_PROCESS_GB * GiB)
    engine_process: int = int(ENGINE_PROCESS_GB * GiB)

    @classmethod
    def from_config(cls, cfg) -> "HostInputs":
        from mcore_rl.config.checks import rollout_gpus

        c, m, r, a, alg, t = cfg.cluster, cfg.memory, cfg.rollout, cfg.actor, cfg.algorithm, cfg.trainer
        total, gpu = c.nnodes * c.n_gpus_per_node, c.device == "gpu"  # the offloaders move CUDA tensors only
        engine = () if r.engine == "embedded" else tuple(range(total - rollout_gpus(cfg), total))
        ram, source = node_ram(c.host_memory_gb)
        gb = lambda v, default: int((default if v is None else v) * GiB)  # noqa: E731
        offload = gpu and bool(engine) and c.colocate and m.offload_train_states
        return cls(nnodes=c.nnodes, gpus_per_node=c.n_gpus_per_node, engine_gpus=engine,
                   offload_train_states=offload, saves=t.save_freq > 0 or t.save_last, save_optimizer=t.save_optimizer,
                   save_stages_weights=gpu and not offload,
                   ref_on_host=gpu and m.offload_ref and (a.use_kl_loss or alg.use_kl_in_reward),
                   ram=ram, ram_source=source,
                   trainer_process=gb(m.host_trainer_process_gb, TRAINER_PROCESS_GB),
                   engine_process=gb(m.host_engine_process_gb, ENGINE_PROCESS_GB))


def node_ram(host_memory_gb: float | None, meminfo: str = "/proc/meminfo") -> tuple[int | None, str]:
    """(bytes of RAM per node, where from): the config's, else this machine's MemTotal where its GPUs
    are visible (it is a node of the run), else None."""
    from mcore_rl.memory.gpus import NvmlUnavailable, all_gpus

    if host_memory_gb is not None:
        return int(host_memory_gb * GiB), "cluster.host_memory_gb"
    try:
        on_node = bool(all_gpus())
    except NvmlUnavailable:
        on_node = False
    if not on_node:
        return None, NOT_GIVEN
    with open(meminfo) as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return kib * 1024, f"{meminfo} MemTotal of this node"


@dataclass
class HostPlan:
    nodes: list[dict[str, int]]  # node -> item -> bytes
    ram: int | None
    ram_source: str

    def total(self, node: int) -> int:
        return sum(self.nodes[node].values())

    @property
    def fullest(self) -> int:
        return max(range(len(self.nodes)), key=self.total)

    @property
    def shortfall(self) -> int:
        return 0 if self.ram is None else max(0, self.total(self.fullest) - self.ram)

    def check(self, plan: Plan) -> None:
        if self.shortfall:
            raise HostPlanError(plan)

    def table(self) -> str:
        node = self.fullest
        w = max(map(len, ITEMS)) + 6
        head = f"{'GiB per node':<{w}}{f'node {node}':>10}"
        rows = [f"{k:<{w}}{self.nodes[node][k] / GiB:>10.2f}" for k in ITEMS]
        total = self.total(node)
        if self.ram is None:
            ends = [f"{'total':<{w}}{total / GiB:>10.2f}", NOT_GIVEN + " (set cluster.host_memory_gb)"]
        else:
            ends = [f"{'total':<{w}}{total / GiB:>10.2f}", f"{'node RAM':<{w}}{self.ram / GiB:>10.2f}",
                    f"{'free (RAM - total)':<{w}}{(self.ram - total) / GiB:>10.2f}",
                    f"{'fits':<{w}}{'OVER' if self.shortfall else 'ok':>10}"]
        source = "" if self.ram is None else f"RAM from {self.ram_source}; "
        title = f"host memory per node ({source}the fullest of {len(self.nodes)} node(s)):"
        return "\n".join([title, head, "-" * len(head), *rows, "-" * len(head), *ends])

    def as_dict(self) -> dict:
        return {"ram": self.ram, "ram_source": self.ram_source, "nodes": self.nodes,
                "totals": [self.total(n) for n in range(len(self.nodes))]}


def rank_host_bytes(hf: HFModel, i: PlanInputs, h: HostInputs, stage: int) -> dict[str, int]:
    """The host bytes of one trainer rank of `stage`, by item."""
    t = trainer_bytes(hf, i, stage)
    n = megatron_rank_numel(inventory(hf), hf, tp=i.tp, pp=i.pp, ep=i.ep, etp=i.etp, stage=stage)
    host_moments = moment_bytes(optimizer_elements(hf, i, n), i.optimizer_offload_fraction)[1]
    on_gpu = t["megatron weights"] + t["megatron grads"] + t["megatron optimizer"]
    pinned = on_gpu - t["megatron grads"]
    saved = on_gpu + host_moments if h.save_optimizer else t["megatron weights"]
    return {STATES: pinned if h.offload_train_states else 0,
            OPT: 2 * host_moments,  # the moments, and megatron's fp32 param + grad copies of that share
            REF: t["megatron weights"] if h.ref_on_host else 0,
            CKPT: h.saves * (max(CKPT_STAGING_MIN, math.ceil(CKPT_STAGING_SHARE * saved))
                             + h.save_stages_weights * t["megatron weights"]),
            TRAINER: h.trainer_process}


def make_host_plan(hf: HFModel, i: PlanInputs, h: HostInputs) -> HostPlan:
    stages = [rank_host_bytes(hf, i, h, s) for s in range(i.pp)]
    nodes = [dict.fromkeys(ITEMS, 0) for _ in range(h.nnodes)]
    for rank in range(i.world):
        for k, v in stages[rank // (i.world // i.pp)].items():
            nodes[rank // h.gpus_per_node][k] += v
    for g in h.engine_gpus:
        nodes[g // h.gpus_per_node][ENGINE] += h.engine_process
    return HostPlan(nodes, h.ram, h.ram_source)


def plan_with_host(hf: HFModel, i: PlanInputs, h: HostInputs) -> Plan:
    """The GPU plan carrying host memory per node: a node over its RAM raises HostPlanError after
    the GPU checks (a GPU refusal is never hidden behind it), and a refused GPU plan's tables show
    the host's too."""
    try:
        plan = make_plan(hf, i)
    except MemoryPlanError as e:
        if e.plan is not None:
            e.plan.host = make_host_plan(hf, i, h)
        raise
    plan.host = make_host_plan(hf, i, h)
    plan.host.check(plan)
    return plan
