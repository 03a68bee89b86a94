"""Trainer rank -> GPU UUID -> SGLang (node_rank, tp_rank), checked before the first transfer.

GPUs are matched by UUID (NVML and CUDA indices disagree once CUDA_VISIBLE_DEVICES is set), and
the engine's GPUs per node are counted from where its ranks actually are, never assumed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from mcore_rl.sync.engine_layout import EngineLayout, SyncPlanError

_UUID = re.compile(r"^(GPU|MIG)-[0-9a-fA-F-]{8,}$")


def parse_visible_devices(value: str | None, device_count: int | None = None) -> list[str] | None:
    """Validate a CUDA_VISIBLE_DEVICES value; None means unset (all devices).

    Rejected with a clear message: duplicates (a real report: "0,1,0,1" gave two ranks one GPU and
    sent IPC handles to the wrong device), empty entries, ids that are neither indices nor UUIDs,
    indices out of range, and a mix of indices and UUIDs.
    """
    if value is None:
        return None
    items = [v.strip() for v in value.split(",")]
    if value.strip() == "" or any(v == "" for v in items):
        raise SyncPlanError(f"CUDA_VISIBLE_DEVICES={value!r} has an empty entry")
    bad = [v for v in items if not (v.isdigit() or _UUID.match(v))]
    if bad:
        raise SyncPlanError(f"CUDA_VISIBLE_DEVICES={value!r}: {bad} are neither GPU indices nor GPU-/MIG- UUIDs")
    if len({v.isdigit() for v in items}) > 1:
        raise SyncPlanError(f"CUDA_VISIBLE_DEVICES={value!r} mixes indices and UUIDs")
    dup = sorted({v for v in items if items.count(v) > 1})
    if dup:
        raise SyncPlanError(f"CUDA_VISIBLE_DEVICES={value!r} lists {dup} more than once: two ranks would share "
                        "one GPU and CUDA IPC handles would reach the wrong device")
    if device_count is not None:
        out = [v for v in items if v.isdigit() and int(v) >= device_count]
        if out:
            raise SyncPlanError(f"CUDA_VISIBLE_DEVICES={value!r}: {out} out of range, this node has "
                            f"{device_count} GPU(s)")
    return items


@dataclass(frozen=True)
class GpuSlot:
    """Where one process runs: its node and its GPU's UUID.

    `node` is any name unique per node: Ray's node id is the safe choice (IPs repeat when
    several raylets share a host, as in tests), an IP or hostname works with one node per host.
    """

    node: str
    gpu_uuid: str


@dataclass(frozen=True)
class Placement:
    """trainer rank -> engine tp rank, plus the engine layout counted from the actual GPUs."""

    trainer_to_engine: dict[int, int]
    engine: EngineLayout
    engine_nodes: tuple[str, ...]  # node of each SGLang node_rank

    def node_rank_of(self, tp_rank: int) -> int:
        return self.engine.node_and_local(tp_rank)[0]


def colocate(trainer: list[GpuSlot], engine_nodes: list[list[str]], tp_size: int, ep_size: int = 1) -> Placement:
    """Match each engine rank to the trainer rank on the same GPU.

    `engine_nodes[n]` is node_rank n's GPU UUIDs in SGLang's order on that node (base_gpu_id
    onward, CUDA_VISIBLE_DEVICES applied); SGLang gives node n the tp ranks
    [n*g, (n+1)*g) with g its GPU count, which must be equal on every node.
    """
    counts = {len(g) for g in engine_nodes}
    if not engine_nodes or 0 in counts:
        raise SyncPlanError("the engine has a node with no GPUs")
    if len(counts) != 1:
        raise SyncPlanError(f"engine nodes have unequal GPU counts {[len(g) for g in engine_nodes]}: SGLang "
                        "gives every node tp_size/nnodes ranks")
    per_node = counts.pop()
    if per_node * len(engine_nodes) != tp_size:
        raise SyncPlanError(f"engine tp_size={tp_size} but the placement has {len(engine_nodes)} node(s) x "
                        f"{per_node} GPU(s)")
    layout = EngineLayout(tp_size, ep_size, nnodes=len(engine_nodes), gpus_per_node=per_node)
    by_uuid: dict[str, int] = {}
    for rank, slot in enumerate(trainer):
        if slot.gpu_uuid in by_uuid:
            raise SyncPlanError(f"trainer ranks {by_uuid[slot.gpu_uuid]} and {rank} share GPU {slot.gpu_uuid}")
        by_uuid[slot.gpu_uuid] = rank
    mapping, nodes = {}, []
    for n, uuids in enumerate(engine_nodes):
        for local, uuid in enumerate(uuids):
            tp_rank = n * per_node + local
            if uuid not in by_uuid:
                raise SyncPlanError(f"engine rank {tp_rank} (node_rank {n}) is on GPU {uuid} where no trainer "
                                "rank runs: colocated CUDA IPC needs one trainer rank per engine GPU")
            rank = by_uuid[uuid]
            if rank in mapping:
                raise SyncPlanError(f"GPU {uuid} appears twice in the engine placement")
            mapping[rank] = tp_rank
        node_names = {trainer[by_uuid[u]].node for u in uuids}
        if len(node_names) != 1:
            raise SyncPlanError(f"engine node_rank {n} spans hosts {sorted(node_names)}")
        nodes.append(node_names.pop())
    if len(set(nodes)) != len(nodes):
        raise SyncPlanError(f"two engine node_ranks on one host: {nodes}")
    return Placement(mapping, layout, tuple(nodes))


def local_gpu_slot(node: str) -> GpuSlot:
    """This process's GpuSlot on a CUDA machine (UUID of the current device)."""
    import torch

    parse_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))  # indices are physical: no count here
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return GpuSlot(node, f"GPU-{props.uuid}")
