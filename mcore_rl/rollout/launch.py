"""Start the configured engines (SGLang or vLLM) where the placement says, and wire the weight sync to them.

    rollout, sync = launch(cfg, hf_dir, run_dir, actors, stop_ids)

Colocated engines go on the trainer's own bundles (the ranks' GPUs, matched by UUID to SGLang's
rank order for CUDA IPC); separate engines get a placement group of their own and are fed over
an update group (NCCL; gloo on CPU) or from disk.
"""

from __future__ import annotations

import os

from mcore_rl import config as C
from mcore_rl.parallel import rendezvous_on
from mcore_rl.rollout.base import EngineError
from mcore_rl.rollout.embedded import EmbeddedRollout
from mcore_rl.rollout.group import EngineGroup, EngineSlot
from mcore_rl.rollout.placement import plan_placement
from mcore_rl.rollout.weights import WeightSync
from mcore_rl.sync.plan import EngineLayout, PlanError, single_source

TRAINER_GPU_SHARE, ENGINE_GPU_SHARE = 0.8, 0.2  # colocated: both on every GPU bundle


def launch(cfg: C.Config, hf_dir: str, run_dir: str, actors, stop_ids: list[int], pad_id: int = 0):
    """(rollout, weight sync or None)."""
    if cfg.rollout.engine == "embedded":
        return EmbeddedRollout(actors, pad_id), None
    server, start = _server(cfg.rollout.engine), STARTERS[cfg.rollout.engine]
    placement = plan_placement(cfg)
    where = actors.call("where")
    model_dir = server.engine_model_dir(hf_dir, os.path.join(run_dir, "engine_hf"), stop_ids, cfg.cluster.device)
    layout = EngineLayout(cfg.rollout.tp_size, cfg.rollout.ep_size, placement.nnodes,
                          cfg.rollout.tp_size // placement.nnodes)
    if placement.colocate:
        slots, pg = _colocated_slots(placement, where, cfg.cluster.device), actors.pg
    else:
        slots, pg = own_slots(placement, cfg.cluster.device)
    engines = start(cfg, model_dir, slots, pg, layout, ENGINE_GPU_SHARE if placement.colocate else layout.gpus_per_node)
    try:
        feed = _feeds(placement, slots, where, layout) if placement.colocate else None
        sync = WeightSync(cfg, actors, engines, layout, feed, where, run_dir, model_dir)
    except BaseException:
        engines.shutdown()
        raise
    return engines, sync


def _server(engine: str):
    """The module of `engine`'s server (imported only when that engine is used)."""
    import importlib

    return importlib.import_module(f"mcore_rl.rollout.{engine}")


def _group(cfg: C.Config, server_cls, slots: list[EngineSlot], pg, layout: EngineLayout, gpu_share: float,
           args_of, label: str, env: dict) -> EngineGroup:
    return EngineGroup(server_cls, slots, args_of, pg=pg, device=cfg.cluster.device, tp_size=layout.tp_size,
                       timeout_s=cfg.rollout.timeout_s, start_timeout_s=cfg.rollout.start_timeout_s,
                       gpu_share=gpu_share, label=label, env=env)


def start_sglang(cfg: C.Config, model_dir: str, slots: list[EngineSlot], pg, layout: EngineLayout,
                 gpu_share: float) -> EngineGroup:
    """SGLang engines on `slots` of placement group `pg` (multi-node engines meet at a port free on
    their node 0), each started from `model_dir` (see `sglang.engine_model_dir`)."""
    from mcore_rl.rollout import sglang as S

    mem_fraction = _mem_fraction(cfg)
    addrs = {s.engine: "%s:%d" % rendezvous_on(pg, s.bundle) for s in slots
             if s.node_rank == 0 and layout.nnodes > 1}
    return _group(cfg, S.SGLangServer, slots, pg, layout, gpu_share,
                  lambda s: S.engine_args(cfg, model_dir, layout, s.node_rank, addrs.get(s.engine), mem_fraction),
                  "SGLang", S.engine_env(cfg, layout))


def start_vllm(cfg: C.Config, model_dir: str, slots: list[EngineSlot], pg, layout: EngineLayout,
               gpu_share: float) -> EngineGroup:
    """vLLM engines on `slots` of placement group `pg`, one node each, started from `model_dir`."""
    from mcore_rl.rollout import vllm as V

    if layout.nnodes > 1:
        raise PlanError(f"a vLLM engine runs on one node; this placement spreads one over {layout.nnodes}")
    args = V.engine_args(cfg, model_dir, layout, _mem_fraction(cfg))
    return _group(cfg, V.VLLMServer, slots, pg, layout, gpu_share, lambda s: args, "vLLM", V.engine_env(cfg, layout))


STARTERS = {"sglang": start_sglang, "vllm": start_vllm}


def _colocated_slots(placement, where: list[dict], device: str) -> list[EngineSlot]:
    slots = []
    for nodes in placement.engines:
        for n in nodes:
            ranks = list(n.gpus)  # colocated: trainer rank r is on GPU r
            hosts = {where[r]["node"] for r in ranks}
            if len(hosts) != 1:
                raise PlanError(f"engine {n.engine} node_rank {n.node_rank} needs trainer ranks {ranks} on one "
                                f"node, but Ray placed them on {len(hosts)} nodes")
            gpus = ",".join(g for r in ranks for g in where[r]["gpu_ids"]) if device == "gpu" else None
            slots.append(EngineSlot(n.engine, n.node_rank, ranks[0], gpus, tuple(where[r]["uuid"] for r in ranks)))
    return slots


def own_slots(placement, device: str):
    import ray
    from ray.util.placement_group import placement_group

    nodes = [n for engine in placement.engines for n in engine]
    bundle = (lambda n: {"CPU": 1}) if device == "cpu" else (lambda n: {"GPU": len(n.gpus), "CPU": 1})
    pg = placement_group([bundle(n) for n in nodes], strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=120)
    except ray.exceptions.GetTimeoutError:
        raise EngineError(f"Ray could not reserve the rollout's {len(nodes)} bundle(s) "
                          f"({bundle(nodes[0])} each) within 120 s: too few free GPUs/CPUs?") from None
    return [EngineSlot(n.engine, n.node_rank, i, None) for i, n in enumerate(nodes)], pg


def _feeds(placement, slots, where: list[dict], layout: EngineLayout) -> dict[int, tuple[int, int]]:
    """trainer rank -> (engine, engine tp rank) on its GPU, matched by UUID (SGLang's rank order)."""
    from mcore_rl.sync.placement import GpuSlot, colocate

    trainer = [GpuSlot(w["node"], w["uuid"]) for w in where]
    feed = {}
    for k in range(len(placement.engines)):
        nodes = [list(s.gpu_uuids) for s in sorted((s for s in slots if s.engine == k), key=lambda s: s.node_rank)]
        mapping = colocate(trainer, nodes, layout.tp_size, layout.ep_size).trainer_to_engine
        feed.update({t: (k, r) for t, r in mapping.items()})
    return feed


def _mem_fraction(cfg: C.Config) -> float:
    """The planner's choice on GPUs (memory.auto_mem_fraction), else the configured fraction."""
    if cfg.cluster.device == "cpu" or not cfg.memory.auto_mem_fraction:
        return cfg.rollout.mem_fraction_static
    from mcore_rl.plan import plan_for_config

    plan, _ = plan_for_config(cfg)
    return plan.mem_fraction_static


__all__ = ["launch", "single_source"]
