"""Start the configured engines (SGLang or vLLM) where the placement says, and wire the weight sync to them.

    rollout, sync = launch(cfg, hf_dir, run_dir, actors, stop_ids)

Colocated engines go on the trainer's own bundles (the ranks' GPUs, matched by UUID to SGLang's
rank order for CUDA IPC); separate engines get a placement group of their own and are fed over
an update group (NCCL; gloo on CPU) or from disk.
"""

from __future__ import annotations

import os

from mcore_rl.config import sections as C
from mcore_rl.config import checks as config_checks
from mcore_rl.parallel.groups import rendezvous_on
from mcore_rl.rollout.embedded import EmbeddedRollout
from mcore_rl.rollout.engine_kwargs import warn_overridden
from mcore_rl.rollout.group import EngineGroup, EngineSlot
from mcore_rl.rollout.placement import plan_placement
from mcore_rl.rollout.weights import WeightSync
from mcore_rl.sync.engine_layout import EngineLayout, SyncPlanError
from mcore_rl.sync.plan import single_source

TRAINER_GPU_SHARE, ENGINE_GPU_SHARE = 0.8, 0.2  # colocated: both on every GPU bundle


def launch(cfg: C.Config, hf_dir: str, run_dir: str, actors, stop_ids: list[int], pad_id: int = 0, plan=None):
    """(rollout, weight sync or None); `plan` (the memory plan, GPUs) sizes the engines' memory."""
    if cfg.rollout.engine == "embedded":
        return EmbeddedRollout(actors, pad_id), None
    server, start = _server(cfg.rollout.engine), STARTERS[cfg.rollout.engine]
    placement = plan_placement(cfg)
    _check_cpu_tp(cfg)
    where = actors.call("where")
    model_dir = server.engine_model_dir(hf_dir, os.path.join(run_dir, "engine_hf"), stop_ids, cfg.cluster.device,
                                        cfg.rollout.weight_dtype)
    layout = EngineLayout(cfg.rollout.tp_size, cfg.rollout.ep_size, placement.nnodes,
                          cfg.rollout.tp_size // placement.nnodes)
    if placement.colocate:
        slots = _colocated_slots(placement, where, cfg.cluster.device, actors.pg)
    else:
        slots = own_slots(placement, cfg.cluster.device, cfg.cluster.placement_timeout_s)
    engines = start(cfg, model_dir, slots, layout, ENGINE_GPU_SHARE if placement.colocate else layout.gpus_per_node,
                    plan, log_dir=os.path.join(run_dir, "logs"))
    try:
        feed = _feeds(placement, slots, where, layout) if placement.colocate else None
        sync = WeightSync(cfg, actors, engines, layout, feed, where, run_dir, model_dir)
    except BaseException:
        engines.shutdown()
        raise
    return engines, sync


CPU_MOE_PAD = 32  # SGLang's CPU engine pads MLP widths to a multiple of this times tp (update_config.py)


def _check_cpu_tp(cfg: C.Config) -> None:
    """SGLang's CPU engine with tp > 1 pads MLP widths to multiples of 32 * tp, so its ranks no longer
    hold even slices; the read-back would report every MLP as stale. Refuse such configs up front."""
    tp, dims = cfg.rollout.tp_size, config_checks.hf_model_dims(cfg.model) or {}
    if cfg.rollout.engine != "sglang" or cfg.cluster.device != "cpu" or tp == 1:
        return
    bad = [f"{k}={dims[k]}" for k in ("intermediate_size", "moe_intermediate_size")
           if dims.get(k) and dims[k] % (CPU_MOE_PAD * tp)]
    if bad:
        raise C.ConfigError(f"rollout.tp_size={tp} on CPU: SGLang pads {', '.join(bad)} to multiples of "
                            f"{CPU_MOE_PAD * tp}; use model widths that are multiples already")


def _server(engine: str):
    """The module of `engine`'s server (imported only when that engine is used)."""
    import importlib

    return importlib.import_module(f"mcore_rl.rollout.{engine}")


def _group(cfg: C.Config, server_cls, slots: list[EngineSlot], layout: EngineLayout, gpu_share: float,
           args_of, label: str, env: dict, log_dir: str | None) -> EngineGroup:
    from mcore_rl.rollout.jit_cache import DIR_ENV

    if cfg.cluster.jit_cache_dir:
        env = {**env, DIR_ENV: cfg.cluster.jit_cache_dir}
    return EngineGroup(server_cls, slots, args_of, device=cfg.cluster.device, tp_size=layout.tp_size,
                       timeout_s=cfg.rollout.timeout_s, start_timeout_s=cfg.rollout.start_timeout_s,
                       gpu_share=gpu_share, label=label, env=env, log_dir=log_dir)


def start_sglang(cfg: C.Config, model_dir: str, slots: list[EngineSlot], layout: EngineLayout,
                 gpu_share: float, plan=None, log_dir: str | None = None) -> EngineGroup:
    """SGLang engines on `slots` (multi-node engines meet at a port free on their node 0), each
    started from `model_dir` (see `sglang.engine_model_dir`), sized by the memory `plan` if given,
    writing their output to files in `log_dir` if given."""
    from mcore_rl.rollout import sglang as S

    mem_fraction, kv_tokens = _engine_memory(cfg, plan)
    warn_overridden(cfg.rollout.engine_kwargs, S.own_args(cfg, model_dir, layout, 0, None, mem_fraction, kv_tokens),
                    "sglang")
    addrs = {s.engine: "%s:%d" % rendezvous_on(s.pg, s.bundle) for s in slots
             if s.node_rank == 0 and layout.nnodes > 1}
    return _group(cfg, S.SGLangServer, slots, layout, gpu_share,
                  lambda s: S.engine_args(cfg, model_dir, layout, s.node_rank, addrs.get(s.engine), mem_fraction,
                                              kv_tokens),
                  "SGLang", S.engine_env(cfg, layout), log_dir)


def start_vllm(cfg: C.Config, model_dir: str, slots: list[EngineSlot], layout: EngineLayout,
               gpu_share: float, plan=None, log_dir: str | None = None) -> EngineGroup:
    """vLLM engines on `slots`, one node each, started from `model_dir` (output: files in `log_dir`)."""
    from mcore_rl.rollout import vllm as V

    if layout.nnodes > 1:
        raise SyncPlanError(f"a vLLM engine runs on one node; this placement spreads one over {layout.nnodes}")
    mem_fraction = _engine_memory(cfg, plan)[0]
    warn_overridden(cfg.rollout.engine_kwargs, V.own_args(cfg, model_dir, layout, mem_fraction), "vllm")
    args = V.engine_args(cfg, model_dir, layout, mem_fraction)
    return _group(cfg, V.VLLMServer, slots, layout, gpu_share, lambda s: args, "vLLM", V.engine_env(cfg, layout),
                  log_dir)


STARTERS = {"sglang": start_sglang, "vllm": start_vllm}


def _colocated_slots(placement, where: list[dict], device: str, pg) -> list[EngineSlot]:
    slots = []
    for nodes in placement.engines:
        for n in nodes:
            ranks = list(n.gpus)  # colocated: trainer rank r is on GPU r
            hosts = {where[r]["node"] for r in ranks}
            if len(hosts) != 1:
                raise SyncPlanError(f"engine {n.engine} node_rank {n.node_rank} needs trainer ranks {ranks} on one "
                                f"node, but Ray placed them on {len(hosts)} nodes")
            gpus = ",".join(g for r in ranks for g in where[r]["gpu_ids"]) if device == "gpu" else None
            slots.append(EngineSlot(n.engine, n.node_rank, pg, ranks[0], gpus, tuple(where[r]["uuid"] for r in ranks)))
    return slots


def own_slots(placement, device: str, timeout_s: float = 120.0) -> list[EngineSlot]:
    """A placement group per engine, one bundle per engine node; the nodes of one engine on
    distinct machines (STRICT_SPREAD), as SGLang's nnodes means."""
    from mcore_rl.loop.placement_deadline import reserve

    slots = []
    for nodes in placement.engines:
        bundles = [{"CPU": 1} if device == "cpu" else {"GPU": len(n.gpus), "CPU": 1} for n in nodes]
        pg = reserve(bundles, f"rollout engine {nodes[0].engine}'s {len(nodes)} node(s)", timeout_s,
                     strategy="STRICT_SPREAD" if len(nodes) > 1 else "PACK")
        slots += [EngineSlot(n.engine, n.node_rank, pg, i, None, owns_pg=True) for i, n in enumerate(nodes)]
    return slots


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


def _engine_memory(cfg: C.Config, plan) -> tuple[float, int | None]:
    """(mem_fraction_static, KV tokens or None): the plan's, else the configured fraction. SGLang applies
    the fraction to the free memory it finds at start-up, which holds what the plan keeps out of it
    (reserved memory, sync buckets, the trainer's residue): only the plan's token count caps its pool
    at the planned size (an H100 run with 0.95 and no cap ran out of memory resuming that pool)."""
    if plan is None:
        return cfg.rollout.mem_fraction_static, None
    return plan.mem_fraction_static, plan.kv_tokens


__all__ = ["launch", "single_source"]
