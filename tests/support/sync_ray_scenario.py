"""Weight sync into an engine spread over two Ray nodes: the scenario behind
tests/e2e/test_sync_ray_placement.py (issue #8, item 2).

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python -m tests.support.sync_ray_scenario --hf H --ckpt C --out r.json

`ray.cluster_utils.Cluster` starts two raylets on loopback, each declaring two logical GPUs and a
resource naming the node. A fake NVML table gives each (node, GPU index) a UUID. One placement
group spans both nodes with one bundle per GPU; in each bundle a megatron trainer rank (gloo
process) and an engine-rank actor share the GPU (half a GPU each), as colocated SGLang ranks do.

Trainer ranks are numbered in a scrambled bundle order. The engine (tp=4, ep=4, nnodes=2) is laid
out the way SGLang's launcher does it: node_rank 0 on the head, node_rank 1 on the second raylet,
each node's ranks on its GPUs in that node's CUDA_VISIBLE_DEVICES order (reversed on node 1).
The placement (trainer rank -> GPU UUID -> (node_rank, tp_rank)) comes from
`mcore_rl.sync.placement.colocate` over what the actors report; the plan, the gather and
CudaIpcTransport are the real ones. In place of CUDA IPC each payload is pickled and tagged with
the UUID of the GPU that produced it (SGLang's patched CUDA handles carry it too); it travels
through Ray's object store to the engine rank, which records what it got. The result JSON holds
the facts the test asserts on.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NODE_GPUS = 2
ENGINE_TP, ENGINE_EP = 4, 4
TRAINER = dict(tp=2, ep=2)
RANK_OF_BUNDLE = [1, 3, 2, 0]  # trainer rank placed in bundle i: deliberately not the engine's order
ENGINE_VISIBLE = ([0, 1], [1, 0])  # per node_rank: SGLang's CUDA_VISIBLE_DEVICES order on that node
BUCKET = 48 << 10


def fake_uuid(node_id: str, index: int) -> str:
    """What NVML would report for GPU `index` of a node; distinct per node, never in index order."""
    return f"GPU-{node_id[:8]}-{(index * 7 + 3) % 16:04x}-{index:04x}"


def _identity(uuids: dict[str, list[str]]) -> dict:
    """Where this actor runs, as Ray reports it, and the UUID of the GPU Ray gave it."""
    import ray

    from mcore_rl.sync.placement import parse_visible_devices

    node_id = ray.get_runtime_context().get_node_id()
    visible = parse_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), device_count=NODE_GPUS)
    if not visible or len(visible) != 1:
        raise RuntimeError(f"expected exactly one GPU from Ray, CUDA_VISIBLE_DEVICES={visible}")
    index = int(visible[0])
    return dict(node_id=node_id, ip=ray.util.get_node_ip_address(), gpu_index=index,
                gpu_uuid=uuids[node_id][index], pid=os.getpid())


class EngineRank:
    """One SGLang tp rank on one GPU: unpacks its flattened-bucket payloads and keeps the tensors."""

    def __init__(self, uuids):
        self.me = _identity(uuids)
        self.node_rank = self.tp_rank = None
        self.received: dict = {}
        self.sources: list[str] = []
        self.loads_outside_update = 0
        self.updating = False

    def where(self) -> dict:
        return self.me

    def launch(self, node_args: dict, local_rank: int) -> int:
        """SGLang's rule: node n runs tp ranks [n * tp/nnodes, (n+1) * tp/nnodes) on its GPUs in order."""
        self.node_rank = node_args["node_rank"]
        self.tp_rank = self.node_rank * (node_args["tp_size"] // node_args["nnodes"]) + local_rank
        return self.tp_rank

    def begin(self):
        self.updating = True

    def end(self):
        self.updating = False

    def load(self, payload: bytes) -> None:
        from mcore_rl.sync.bucket import unflatten

        data = pickle.loads(payload)
        self.sources.append(data["device_uuid"])
        self.loads_outside_update += not self.updating
        for name, t in unflatten(data["flattened_tensor"], data["metadata"]):
            if name in self.received:
                raise RuntimeError(f"engine rank {self.tp_rank}: {name} arrived twice")
            self.received[name] = t.clone()

    def report(self) -> dict:
        return dict(self.me, node_rank=self.node_rank, tp_rank=self.tp_rank, sources=self.sources,
                    loads_outside_update=self.loads_outside_update, received=self.received)


class RayEngine:
    """The engine as the transport's driver sees it: a call reaches every rank; payload r goes to
    tp rank r (SGLang's update_weights_from_tensor takes one serialized payload per tp rank)."""

    def __init__(self, ranks):
        self.ranks = ranks  # actor handles in tp-rank order

    def _all(self, method: str, *per_rank):
        import ray

        calls = [getattr(r, method).remote(*(a[i] for a in per_rank)) for i, r in enumerate(self.ranks)]
        ray.get(calls)

    def begin_weight_update(self):
        self._all("begin")

    def end_weight_update(self):
        self._all("end")

    def update_weights_from_tensor(self, payloads, load_format=None, flush_cache=True):
        if load_format != "flattened_bucket" or len(payloads) != len(self.ranks):
            raise ValueError(f"load_format={load_format}, {len(payloads)} payloads for {len(self.ranks)} ranks")
        self._all("load", payloads)


def tagged_pickle(device_uuid: str, obj: dict) -> bytes:
    """The CPU stand-in for a CUDA IPC payload: the data itself, plus the producing GPU's UUID."""
    return pickle.dumps({**obj, "device_uuid": device_uuid})


class TrainerRank:
    """A megatron trainer rank on one GPU of a Ray node (a gloo process here)."""

    def __init__(self, uuids):
        self.me = _identity(uuids)

    def where(self) -> dict:
        return self.me

    def rendezvous(self) -> tuple[str, int]:
        from mcore_rl.parallel.groups import free_port

        return self.me["ip"], free_port(self.me["ip"])

    def sync(self, rank: int, world: int, addr: str, port: int, hf_dir: str, ckpt: str, plan, engine):
        import torch

        from mcore_rl.checkpoint.model import load_model
        from mcore_rl.models.config import HFModel, transformer_config
        from mcore_rl.models.builder import build_model
        from mcore_rl.parallel.groups import destroy, init_distributed
        from mcore_rl.sync import LiveShards, sync_weights
        from mcore_rl.sync.bucket import Meta
        from mcore_rl.sync.transports import CudaIpcTransport

        torch.set_num_threads(1)
        lay = plan.trainer
        init_distributed(lay, rank=rank, world_size=world, init_method=f"tcp://{addr}:{port}", backend="gloo")
        try:
            hf = HFModel.from_dir(hf_dir)
            model = build_model(hf, transformer_config(hf, tp=lay.tp, ep=lay.ep, etp=lay.etp,
                                                       dtype=torch.float32, cpu=True))
            load_model(model, ckpt)
            transport = CudaIpcTransport(engine, plan.engine_rank_of, serializer=partial(tagged_pickle,
                                         self.me["gpu_uuid"]), meta_cls=Meta)
            return sync_weights(plan, LiveShards(model, plan), transport)
        finally:
            destroy()


def start_cluster(temp_dir: str):
    """Two raylets on loopback, each with NODE_GPUS logical GPUs and a resource naming it."""
    from ray.cluster_utils import Cluster

    common = dict(num_cpus=1, num_gpus=NODE_GPUS, node_ip_address="127.0.0.1", temp_dir=temp_dir,
                  object_store_memory=100 << 20)
    cluster = Cluster(initialize_head=True, head_node_args=dict(common, resources={"node0": NODE_GPUS},
                                                                include_dashboard=False))
    worker = cluster.add_node(**common, resources={"node1": NODE_GPUS})
    cluster.wait_for_nodes()
    return cluster, cluster.head_node.node_id, worker.node_id


def run(hf_dir: str, ckpt: str, temp: str) -> dict:
    import ray
    import torch
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from safetensors.torch import load_file

    from mcore_rl.models.config import HFModel
    from mcore_rl.parallel.groups import Layout
    from mcore_rl.rollout.sglang import EngineLaunch
    from mcore_rl.sync.placement import GpuSlot, colocate
    from mcore_rl.sync.plan import SyncPlan

    t0 = time.monotonic()
    cluster = None
    try:
        cluster, head, worker = start_cluster(temp)
        ray.init(address=cluster.address, runtime_env={"env_vars": {
            "PYTHONPATH": str(REPO), "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}})
        started = time.monotonic() - t0
        nodes = (head, worker)
        uuids = {n: [fake_uuid(n, g) for g in range(NODE_GPUS)] for n in nodes}
        pg = placement_group([{"GPU": 1, f"node{n}": 1} for n in range(2) for _ in range(NODE_GPUS)],
                             strategy="PACK")
        ray.get(pg.ready(), timeout=60)
        on = lambda i: PlacementGroupSchedulingStrategy(placement_group=pg,  # noqa: E731
                                                        placement_group_bundle_index=i)
        trainer_cls = ray.remote(num_cpus=0, num_gpus=0.5)(TrainerRank)
        engine_cls = ray.remote(num_cpus=0, num_gpus=0.5)(EngineRank)
        by_bundle = [trainer_cls.options(scheduling_strategy=on(i)).remote(uuids) for i in range(len(RANK_OF_BUNDLE))]
        trainers = [by_bundle[RANK_OF_BUNDLE.index(r)] for r in range(len(by_bundle))]
        ranks = [engine_cls.options(scheduling_strategy=on(i)).remote(uuids) for i in range(len(RANK_OF_BUNDLE))]
        trainer_where = ray.get([t.where.remote() for t in trainers])
        engine_where = ray.get([r.where.remote() for r in ranks])

        # the launcher: node_rank 0 on the head (its address is dist_init_addr), 1 on the other raylet
        lay = Layout(**TRAINER)
        engine_nodes = [[uuids[n][g] for g in ENGINE_VISIBLE[k]] for k, n in enumerate(nodes)]
        slots = [GpuSlot(w["node_id"], w["gpu_uuid"]) for w in trainer_where]
        placement = colocate(slots, engine_nodes, tp_size=ENGINE_TP, ep_size=ENGINE_EP)
        launch = EngineLaunch(hf_dir, placement.engine, dist_init_addr=f"{trainer_where[0]['ip']}:29999")
        tp_ranks = ray.get([r.launch.remote(launch.node_args(nodes.index(w["node_id"])),
                                            ENGINE_VISIBLE[nodes.index(w["node_id"])].index(w["gpu_index"]))
                            for r, w in zip(ranks, engine_where)])
        by_tp = [ranks[tp_ranks.index(t)] for t in range(ENGINE_TP)]

        hf = HFModel.from_dir(hf_dir)
        world = len(trainers)
        plan = SyncPlan.build(hf, lay, world, placement.engine, placement.trainer_to_engine, BUCKET,
                              torch.float32)
        plan.check_complete()
        addr, port = ray.get(trainers[0].rendezvous.remote())
        stats = ray.get([t.sync.remote(r, world, addr, port, hf_dir, ckpt, plan, RayEngine(by_tp) if r == 0 else None)
                         for r, t in enumerate(trainers)], timeout=300)
        reports = ray.get([r.report.remote() for r in by_tp])

        reference = {}
        for f in sorted(Path(hf_dir).glob("*.safetensors")):
            reference.update(load_file(str(f)))
        node_of_trainer = [w["node_id"] for w in trainer_where]
        cross_node_sends = sum(1 for b in plan.buckets for src, rb in b.items() for _, dst in rb.sends
                               if node_of_trainer[src] != node_of_trainer[dst])
        engines = []
        for rep in reports:
            got = rep.pop("received")
            t = next(r for r, tr in placement.trainer_to_engine.items() if tr == rep["tp_rank"])
            engines.append(dict(
                rep, trainer_rank=t, planned=sorted(plan.payload_names(t)), received=sorted(got),
                differ=sorted(n for n, x in got.items() if n not in reference or not torch.equal(x, reference[n])),
                experts=sorted({int(m.group(1)) for n in got if (m := re.search(r"\.mlp\.experts\.(\d+)\.", n))})))
        return dict(
            started_s=round(started, 1), elapsed_s=round(time.monotonic() - t0, 1), head=head, worker=worker,
            cluster_nodes=sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
            trainers=trainer_where, engine_ranks=engines, reference=sorted(reference),
            placement=dict(trainer_to_engine={str(k): v for k, v in placement.trainer_to_engine.items()},
                           engine_nodes=list(placement.engine_nodes), layout=vars(placement.engine)),
            buckets=len(plan.buckets), cross_node_sends=cross_node_sends, stats=stats,
            num_experts=hf.num_experts)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def leftover(temp: str, grace: float = 15.0) -> list[int]:
    """Pids still running from our cluster's temp dir after shutdown (Ray stops them itself)."""
    from tests.support.cluster_scenario import _pids_mentioning

    deadline = time.monotonic() + grace
    while (left := _pids_mentioning(temp)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", required=True, help="tiny HF model directory")
    ap.add_argument("--ckpt", required=True, help="its torch_dist checkpoint (converters hf_to_mcore)")
    ap.add_argument("--out", required=True, help="write the result JSON here")
    args = ap.parse_args()
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0" or "ray" in sys.modules:
        sys.exit("set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray is imported (keeps the nodes on loopback)")
    temp = tempfile.mkdtemp(prefix="mrl-sync-", dir="/tmp")  # short: Ray's unix sockets live here
    try:
        result = run(args.hf, args.ckpt, temp)
        result["leftover"] = leftover(temp)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
