"""Which GPUs each rollout engine gets, planned from the config and then matched to where Ray put
the trainer's ranks.

GPUs are numbered node-major (GPU g is local GPU g % n_gpus_per_node of node g // n_gpus_per_node).
Colocated, trainer rank r runs on GPU r and engine k on GPUs k*tp .. (k+1)*tp - 1; otherwise the
trainer takes the first GPUs and the engines the last `cluster.rollout_gpus`. An engine either
fits in one node (tp divides the GPUs per node) or spans whole nodes (tp is a multiple of them):
one SGLang "node" per machine, `nnodes` of them, each with tp/nnodes consecutive tp ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config import sections as C
from mcore_rl.config import checks as config_checks


@dataclass(frozen=True)
class EngineNode:
    engine: int
    node_rank: int
    gpus: tuple[int, ...]  # cluster-global GPU numbers, in SGLang's rank order

    def host(self, per_node: int) -> int:
        return self.gpus[0] // per_node


@dataclass(frozen=True)
class RolloutPlacement:
    trainer_gpus: tuple[int, ...]  # trainer rank -> global GPU
    engines: tuple[tuple[EngineNode, ...], ...]  # engine -> its nodes
    tp_size: int
    ep_size: int
    gpus_per_node: int
    colocate: bool
    engine: str = "sglang"

    @property
    def nnodes(self) -> int:
        return len(self.engines[0]) if self.engines else 0

    def describe(self, units: str = "GPUs") -> list[str]:
        per = self.gpus_per_node
        name = {"sglang": "SGLang", "vllm": "vLLM"}.get(self.engine, self.engine)
        lines = [f"rollout engines: {len(self.engines)} x {name} TP={self.tp_size} EP={self.ep_size} over "
                 f"{self.nnodes} node(s) each ({'colocated with the trainer' if self.colocate else 'own ' + units})"]
        for nodes in self.engines:
            for n in nodes:
                local = [g % per for g in n.gpus]
                lines.append(f"  engine {n.engine} node_rank {n.node_rank}/{len(nodes)}: tp ranks "
                             f"{n.node_rank * len(n.gpus)}-{(n.node_rank + 1) * len(n.gpus) - 1} on node "
                             f"{n.host(per)} {units} {local[0]}-{local[-1]}")
        return lines


def plan_placement(cfg: C.Config) -> RolloutPlacement:
    c, r = cfg.cluster, cfg.rollout
    per, total, tp = c.n_gpus_per_node, c.nnodes * c.n_gpus_per_node, r.tp_size
    trainer = tuple(range(config_checks.actor_gpus(cfg)))
    rollout = list(range(total)) if c.colocate else list(range(total - c.rollout_gpus, total))
    node_gpus = min(tp, per)  # config validation: tp divides a node's GPUs or is a multiple of them
    if rollout[0] % node_gpus:
        raise C.ConfigError(f"the rollout's GPUs start at GPU {rollout[0]}, inside a group of {node_gpus}: "
                            "make cluster.rollout_gpus a multiple of the engine's GPUs per node")
    engines = []
    for k in range(len(rollout) // tp):
        gpus = rollout[k * tp:(k + 1) * tp]
        engines.append(tuple(EngineNode(k, n, tuple(gpus[n * node_gpus:(n + 1) * node_gpus]))
                             for n in range(tp // node_gpus)))
    return RolloutPlacement(trainer, tuple(engines), tp, r.ep_size, per, c.colocate, r.engine)
