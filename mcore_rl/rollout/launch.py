"""Start the configured engines (SGLang or vLLM) where the placement says, and wire the weight sync to them.

    launching = Launching(cfg, hf_dir, run_dir, pg, stop_ids)  # the engines' processes start and import
    ...                                                         # the trainer builds meanwhile
    rollout = launching.start(actors)                           # the engines are built
    sync = launching.weight_sync(actors)

or, in one call, `rollout, sync = launch(cfg, hf_dir, run_dir, actors, stop_ids)`.

Colocated engines go on the trainer's own bundles (the ranks' GPUs, matched by UUID to SGLang's
rank order for CUDA IPC); separate engines get a placement group of their own and are fed over
an update group (NCCL; gloo on CPU) or from disk.
"""

from __future__ import annotations

import os
import threading
import time

from mcore_rl.config import sections as C
from mcore_rl.config import checks as config_checks
from mcore_rl.parallel.groups import rendezvous_on
from mcore_rl.rollout.base import EngineError
from mcore_rl.rollout.embedded import EmbeddedRollout
from mcore_rl.rollout.engine_kwargs import warn_overridden
from mcore_rl.rollout.group import EngineGroup, EngineSlot
from mcore_rl.rollout.placement import plan_placement
from mcore_rl.rollout.weights import WeightSync
from mcore_rl.models.config import HFModel
from mcore_rl.sync.engine_layout import EngineLayout, SyncPlanError, fp8_kept_line
from mcore_rl.sync.plan import single_source

TRAINER_GPU_SHARE, ENGINE_GPU_SHARE = 0.8, 0.2  # colocated: both on every GPU bundle


def launch(cfg: C.Config, hf_dir: str, run_dir: str, actors, stop_ids: list[int], pad_id: int = 0, plan=None):
    """(rollout, weight sync or None), in one call (`Launching`)."""
    launching = Launching(cfg, hf_dir, run_dir, actors.pg, stop_ids, pad_id, plan)
    try:
        return launching.start(actors), launching.weight_sync(actors)
    except BaseException:
        launching.shutdown()
        raise


class Launching:
    """The configured engines, started in two stages around the trainer's build. Made first: the
    engines' processes start and import SGLang or vLLM (10-25 s on a GPU node) while the trainer
    builds. `start`: the engines themselves (weights, KV cache, CUDA graphs), which colocated take
    the GPUs' memory, so only once the trainer is in the memory plan's rollout phase (its states
    offloaded or its grads dropped). `weight_sync`: the sync, wired to the trainer and the engines.
    Engines on GPUs of their own are built at once, beside the trainer. `console` (a
    metrics.console.StartConsole): the imports' seconds get a line of their own, a parallel phase.
    `plan` (the memory plan, GPUs) sizes the engines' memory."""

    def __init__(self, cfg: C.Config, hf_dir: str, run_dir: str, pg, stop_ids: list[int], pad_id: int = 0,
                 plan=None, console=None):
        self.cfg, self.run_dir, self.pad_id = cfg, run_dir, pad_id
        self.group = self.reporter = None
        self.closed = False
        if cfg.rollout.engine == "embedded":
            return
        server, starter = _server(cfg.rollout.engine), STARTERS[cfg.rollout.engine]
        self.placement = placement = plan_placement(cfg)
        _check_cpu_tp(cfg)
        # weights=False: the first sync gives the engines their weights, so they build on a dummy load
        # rather than read the checkpoint's files (a start from model.hf_path) only to overwrite them
        self.layout = EngineLayout(cfg.rollout.tp_size, cfg.rollout.ep_size, placement.nnodes,
                                   cfg.rollout.tp_size // placement.nnodes, config_checks.attention_dp(cfg))
        self.model_dir = server.engine_model_dir(hf_dir, os.path.join(run_dir, "engine_hf"), stop_ids,
                                                 cfg.cluster.device, cfg.rollout.weight_dtype, weights=False,
                                                 layout=self.layout)
        if cfg.rollout.weight_dtype == "fp8":  # which layers its config keeps in the model's dtype
            print(fp8_kept_line(HFModel.from_dir(hf_dir), self.layout), flush=True)
        t0 = time.perf_counter()
        if placement.colocate:
            self.bundles = bundle_devices(pg, len(placement.trainer_gpus), cfg.cluster.device,
                                          cfg.cluster.placement_timeout_s)
            slots = _colocated_slots(placement, self.bundles, cfg.cluster.device, pg)
        else:
            slots = own_slots(placement, cfg.cluster.device, cfg.cluster.placement_timeout_s)
        self.group = starter(cfg, self.model_dir, slots, self.layout,
                             ENGINE_GPU_SHARE if placement.colocate else self.layout.gpus_per_node, plan,
                             log_dir=os.path.join(run_dir, "logs"), start=False)
        if not placement.colocate:  # their own GPUs: nothing of the trainer's to wait for
            self.group.start()
        if console is not None:
            name = f"starting the {cfg.rollout.engine} engines' processes and importing {self.group.label}"
            self.reporter = threading.Thread(target=self._report_imports, args=(console, name, t0), daemon=True,
                                             name="mcore_rl-engine-imports")
            self.reporter.start()

    def _report_imports(self, console, name: str, t0: float) -> None:
        try:
            self.group.imported(self.cfg.rollout.start_timeout_s)
            failed = False
        except EngineError:  # said by `start`, which meets it too
            failed = True
        if not self.closed:
            console.parallel(name, time.perf_counter() - t0, failed)

    def start(self, actors):
        """The rollout: the engines built (colocated: on the GPUs of the trainer's `actors`, which
        must hold no more than the memory plan's rollout phase gives them by now) and started."""
        if self.group is None:
            return EmbeddedRollout(actors, self.pad_id)
        self.where = actors.call("where")
        if self.placement.colocate:
            _check_bundles(self.bundles, self.where)
            self.group.start()
        try:
            self.group.wait_started()
        finally:
            if self.reporter is not None:  # its line before the engines' own
                self.reporter.join(timeout=5)
        return self.group

    def weight_sync(self, actors):
        """The weight sync from the trainer's `actors` into the started engines (None: the embedded
        engine samples on the trainer's own weights)."""
        if self.group is None:
            return None
        feed = _feeds(self.placement, self.where, self.layout) if self.placement.colocate else None
        return WeightSync(self.cfg, actors, self.group, self.layout, feed, self.where, self.run_dir,
                          self.model_dir)

    def shutdown(self) -> None:
        """The engines stopped, started or not (idempotent)."""
        self.closed = True
        if self.group is not None:
            self.group.shutdown()


def bundle_devices(pg, n: int, device: str, timeout_s: float) -> list[dict]:
    """{"node": Ray node id, "gpu_ids": [GPU], on CPU []} of the first `n` bundles of `pg` (the
    trainer's): what the trainer's ranks will say in `where`, known before they exist. The nodes are
    in the group's table; on GPUs a Ray task on each bundle asks for a sliver of its GPU, which Ray
    gives it by the bundle's id (no CUDA)."""
    import ray
    from ray.util.placement_group import placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    nodes = placement_group_table(pg)["bundles_to_node_id"]
    gpus = [[] for _ in range(n)]
    if device == "gpu":
        probe = ray.remote(num_cpus=0, num_gpus=0.01)(_bundle_gpus)
        gpus = ray.get([probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i)).remote() for i in range(n)], timeout=timeout_s)
    return [{"node": nodes[i], "gpu_ids": gpus[i]} for i in range(n)]


def _bundle_gpus() -> list[str]:
    import ray

    return [str(g) for g in ray.get_gpu_ids()]


def _check_bundles(bundles: list[dict], where: list[dict]) -> None:
    """The trainer's ranks are where their bundles were found (`bundle_devices`): the engines,
    placed by the latter, share each rank's GPU."""
    for r, (b, w) in enumerate(zip(bundles, where)):
        if (b["node"], b["gpu_ids"]) != (w["node"], w["gpu_ids"]):
            raise SyncPlanError(f"trainer rank {r} runs on GPU(s) {w['gpu_ids']} of node {w['node'][:8]}, but its "
                                f"placement bundle, where its colocated engine went, on {b['gpu_ids']} of node "
                                f"{b['node'][:8]}")


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
           args_of, label: str, env: dict, log_dir: str | None, start: bool) -> EngineGroup:
    from mcore_rl.rollout.jit_cache import DIR_ENV

    if cfg.cluster.jit_cache_dir:
        env = {**env, DIR_ENV: cfg.cluster.jit_cache_dir}
    return EngineGroup(server_cls, slots, args_of, device=cfg.cluster.device, tp_size=layout.tp_size,
                       timeout_s=cfg.rollout.timeout_s, start_timeout_s=cfg.rollout.start_timeout_s,
                       gpu_share=gpu_share, label=label, env=env, log_dir=log_dir, start=start)


def start_sglang(cfg: C.Config, model_dir: str, slots: list[EngineSlot], layout: EngineLayout,
                 gpu_share: float, plan=None, log_dir: str | None = None, start: bool = True) -> EngineGroup:
    """SGLang engines on `slots` (multi-node engines meet at a port free on their node 0 as they
    start), each started from `model_dir` (see `sglang.engine_model_dir`), sized by the memory `plan`
    if given, writing their output to files in `log_dir` if given. start=False: their processes
    only, importing SGLang (EngineGroup.start builds the engines)."""
    from mcore_rl.rollout import sglang as S

    mem_fraction, kv_tokens = _engine_memory(cfg, plan)
    warn_overridden(cfg.rollout.engine_kwargs, S.own_args(cfg, model_dir, layout, 0, None, mem_fraction, kv_tokens),
                    "sglang")
    addrs: dict[int, str] = {}  # picked as the engines start: a port picked earlier may be taken by then

    def args_of(s: EngineSlot) -> dict:
        if layout.nnodes > 1 and s.engine not in addrs:
            head = next(h for h in slots if h.engine == s.engine and h.node_rank == 0)
            addrs[s.engine] = "%s:%d" % rendezvous_on(head.pg, head.bundle)
        return S.engine_args(cfg, model_dir, layout, s.node_rank, addrs.get(s.engine), mem_fraction, kv_tokens)

    return _group(cfg, S.SGLangServer, slots, layout, gpu_share, args_of, "SGLang", S.engine_env(cfg, layout),
                  log_dir, start)


def start_vllm(cfg: C.Config, model_dir: str, slots: list[EngineSlot], layout: EngineLayout,
               gpu_share: float, plan=None, log_dir: str | None = None, start: bool = True) -> EngineGroup:
    """vLLM engines on `slots`, one node each, started from `model_dir` (output: files in `log_dir`;
    start=False: their processes only, importing vLLM)."""
    from mcore_rl.rollout import vllm as V

    if layout.nnodes > 1:
        raise SyncPlanError(f"a vLLM engine runs on one node; this placement spreads one over {layout.nnodes}")
    mem_fraction = _engine_memory(cfg, plan)[0]
    warn_overridden(cfg.rollout.engine_kwargs, V.own_args(cfg, model_dir, layout, mem_fraction), "vllm")
    args = V.engine_args(cfg, model_dir, layout, mem_fraction)
    return _group(cfg, V.VLLMServer, slots, layout, gpu_share, lambda s: args, "vLLM", V.engine_env(cfg, layout),
                  log_dir, start)


STARTERS = {"sglang": start_sglang, "vllm": start_vllm}


def _colocated_slots(placement, bundles: list[dict], device: str, pg) -> list[EngineSlot]:
    """The trainer's bundles (`bundle_devices`) for each engine node: colocated, trainer rank r is on GPU r."""
    slots = []
    for nodes in placement.engines:
        for n in nodes:
            ranks = list(n.gpus)
            hosts = {bundles[r]["node"] for r in ranks}
            if len(hosts) != 1:
                raise SyncPlanError(f"engine {n.engine} node_rank {n.node_rank} needs trainer ranks {ranks} on one "
                                f"node, but Ray placed them on {len(hosts)} nodes")
            gpus = ",".join(g for r in ranks for g in bundles[r]["gpu_ids"]) if device == "gpu" else None
            slots.append(EngineSlot(n.engine, n.node_rank, pg, ranks[0], gpus))
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


def _feeds(placement, where: list[dict], layout: EngineLayout) -> dict[int, tuple[int, int]]:
    """trainer rank -> (engine, engine tp rank) on its GPU, matched by UUID (SGLang's rank order)."""
    from mcore_rl.sync.placement import GpuSlot, colocate

    trainer = [GpuSlot(w["node"], w["uuid"]) for w in where]
    feed = {}
    for k, nodes in enumerate(placement.engines):
        uuids = [[where[r]["uuid"] for r in n.gpus] for n in sorted(nodes, key=lambda n: n.node_rank)]
        mapping = colocate(trainer, uuids, layout.tp_size, layout.ep_size).trainer_to_engine
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


__all__ = ["Launching", "launch", "single_source"]
