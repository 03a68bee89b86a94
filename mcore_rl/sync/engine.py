"""The rollout engine as the weight sync sees it, SGLang's implementation, and its multi-node launcher.

SGLang is imported lazily: the trainer and the GPU benchmark run without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from mcore_rl.sync.plan import EngineLayout, PlanError

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class RolloutEngine(Protocol):
    def begin_weight_update(self) -> None: ...
    def end_weight_update(self) -> None: ...
    def update_weights_from_tensor(self, payloads: list, load_format: str | None, flush_cache: bool) -> None: ...
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str) -> None: ...
    def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str,
                                        load_format: str | None, flush_cache: bool) -> None: ...
    def update_weights_from_disk(self, model_path: str) -> None: ...
    def release_memory_occupation(self, tags: list[str] | None = None) -> None: ...
    def resume_memory_occupation(self, tags: list[str] | None = None) -> None: ...


class EngineError(RuntimeError):
    pass


class SGLangEngine:
    """Wraps an `sglang.Engine` (node_rank 0 of the engine); raises when SGLang reports failure."""

    def __init__(self, engine):
        self.engine = engine

    def _ok(self, result, what: str):
        ok, msg = (result[0], result[1]) if isinstance(result, tuple) else (getattr(result, "success", True),
                                                                            getattr(result, "message", ""))
        if not ok:
            raise EngineError(f"SGLang {what} failed: {msg}")
        return result

    def begin_weight_update(self):
        return self._ok(self.engine.begin_weight_update(), "begin_weight_update")

    def end_weight_update(self):
        return self._ok(self.engine.end_weight_update(), "end_weight_update")

    def update_weights_from_tensor(self, payloads, load_format=None, flush_cache=True):
        return self._ok(self.engine.update_weights_from_tensor(payloads, load_format=load_format,
                                                               flush_cache=flush_cache),
                        "update_weights_from_tensor")

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name="weight_update_group", backend="nccl"):
        return self._ok(self.engine.init_weights_update_group(master_address, master_port, rank_offset,
                                                              world_size, group_name, backend),
                        "init_weights_update_group")

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        load_format=None, flush_cache=True):
        return self._ok(self.engine.update_weights_from_distributed(
            names, dtypes, shapes, group_name, flush_cache=flush_cache, load_format=load_format),
            "update_weights_from_distributed")

    def update_weights_from_disk(self, model_path):
        return self._ok(self.engine.update_weights_from_disk(model_path), "update_weights_from_disk")

    def release_memory_occupation(self, tags=None):
        return self.engine.release_memory_occupation(tags=_tags(tags))

    def resume_memory_occupation(self, tags=None):
        return self.engine.resume_memory_occupation(tags=_tags(tags))


def _tags(tags):
    if tags is None:
        return None
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"unknown memory tags {bad}; SGLang knows {MEMORY_TAGS}")
    return list(tags)


@dataclass
class EngineLaunch:
    """Everything every node of one SGLang engine needs; `node_args(n)` is node n's ServerArgs kwargs.

    All nodes share dist_init_addr, nnodes, tp/ep sizes and the memory settings; only node_rank
    differs. Each node takes tp_size/nnodes consecutive tp ranks on its first gpus_per_node GPUs
    from base_gpu_id (CUDA_VISIBLE_DEVICES applied).
    """

    model_path: str
    layout: EngineLayout
    dist_init_addr: str  # "host:port" of node_rank 0, reachable from every node
    mem_fraction_static: float = 0.5
    enable_memory_saver: bool = True
    base_gpu_id: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        host, _, port = self.dist_init_addr.rpartition(":")
        if not host or not port.isdigit():
            raise PlanError(f"dist_init_addr={self.dist_init_addr!r} must be host:port")
        if not 0 < self.mem_fraction_static < 1:
            raise PlanError(f"mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")
        lay = self.layout
        if lay.gpus_per_node is None or lay.gpus_per_node * lay.nnodes != lay.tp_size:
            raise PlanError(f"engine layout {lay}: gpus_per_node x nnodes must equal tp_size "
                            "(take gpus_per_node from the placement)")

    def node_args(self, node_rank: int) -> dict:
        if not 0 <= node_rank < self.layout.nnodes:
            raise PlanError(f"node_rank={node_rank} outside 0..{self.layout.nnodes - 1}")
        args = dict(model_path=self.model_path, tp_size=self.layout.tp_size, ep_size=self.layout.ep_size,
                    nnodes=self.layout.nnodes, node_rank=node_rank, dist_init_addr=self.dist_init_addr,
                    base_gpu_id=self.base_gpu_id, mem_fraction_static=self.mem_fraction_static,
                    enable_memory_saver=self.enable_memory_saver)
        return {**args, **self.extra}

    def cli(self, node_rank: int) -> list[str]:
        """`python -m sglang.launch_server ...` arguments for node `node_rank`."""
        out = ["python", "-m", "sglang.launch_server"]
        for k, v in self.node_args(node_rank).items():
            flag = "--" + k.replace("_", "-")
            if v is True:
                out.append(flag)
            elif v is not False and v is not None:
                out += [flag, str(v)]
        return out

    def start(self, node_rank: int):
        """Start this node's part in-process (sglang.Engine); nodes > 0 block serving their ranks."""
        import sglang

        return sglang.Engine(**self.node_args(node_rank))
