"""One SGLang engine spanning two "nodes": raylets of `ray.cluster_utils.Cluster` on one host.

    python tests/support/multinode_scenario.py --device cpu|gpu --out result.json [--steps 2] [--parts greedy,colocated,separate]

1. reference: a TP=2 engine on one node (a plain process, both GPUs / two CPU ranks), greedy tokens;
2. the same model as a TP=2 engine of nnodes=2 (node_rank 0 on the head raylet, node_rank 1 on the
   other, each with one GPU), started by mcore_rl's own launcher pieces: greedy tokens must equal (1);
3. `python -m mcore_rl.train` joining that cluster (RAY_ADDRESS): 2 trainer ranks (one per node,
   EP=2) colocated with the nnodes=2 engine, `rollout.verify_sync_every=1`: every sync read back
   from both nodes' ranks; then the same with the engine on nodes of its own (colocate=false,
   broadcast over an update group spanning the nodes). On CPU that engine is the nnodes=2 one on two
   more raylets; 2 GPUs hold only a TP=1 engine on the raylet beside the trainer's (an nnodes=2 engine
   of its own plus a trainer GPU needs 3), so there the update group spans the two raylets.
`--parts` runs a subset, so each fits one call of a lent GPU machine.
On GPUs each raylet is started with CUDA_VISIBLE_DEVICES set to its own GPU, so Ray's GPU ids are
physical ids. Prints a JSON summary; exit 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

PROMPTS = [[11, 12, 13, 14], [21, 22, 23], [5, 6, 7, 8, 9]]
# SGLang's CPU engine at tp 2 pads MLP widths to multiples of 64 (mcore_rl.rollout.launch._check_cpu_tp)
WIDE = ["model.hf_config.moe_intermediate_size=64"]
PARTS = ("greedy", "colocated", "separate")
GPU_TWO_RANKS = ["actor.micro_batch_size=64"]  # configs/tiny_gpu.yaml's 128 is one rank's whole mini-batch
GPU_MODEL = dict(model_type="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def make_model(out: str, device: str) -> str:
    """A tiny random model the engines on `device` can run, saved as an HF directory (and its engine view)."""
    import torch
    import transformers

    from mcore_rl.rollout.sglang import engine_model_dir

    torch.manual_seed(0)
    if device == "cpu":
        from tests.support.tiny_models import make_hf_model

        make_hf_model("qwen2", out)
    else:
        cfg = transformers.Qwen2Config(**{k: v for k, v in GPU_MODEL.items() if k != "model_type"})
        transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(out)
    return engine_model_dir(out, out + "_engine", [2], device)


def _cfg(device: str):
    from mcore_rl.config import sections as C

    return C.config_from_dict({"model": {"dtype": "fp32" if device == "cpu" else "bf16"},
                               "cluster": {"device": device, "colocate": False},
                               "rollout": {"engine": "sglang", "tp_size": 2, "attention_backend":
                                           None if device == "cpu" else "triton", "seeded": False}})


def engine_args(model_dir: str, device: str, nnodes: int, node_rank: int, addr: str | None) -> dict:
    from mcore_rl.rollout.sglang import engine_args as build
    from mcore_rl.sync.engine_layout import EngineLayout

    return build(_cfg(device), model_dir, EngineLayout(2, 1, nnodes, 2 // nnodes), node_rank, addr, 0.3)


def engine_env(device: str) -> dict:
    from mcore_rl.rollout.sglang import engine_env as build
    from mcore_rl.sync.engine_layout import EngineLayout

    return build(_cfg(device), EngineLayout(2, 1, 2, 1))


def _greedy_one_node(model_dir: str, device: str, out: str) -> None:
    """(1), in its own process: SGLang kills the process that created an engine when it fails."""
    from mcore_rl.rollout.base import SamplingParams, flatten
    from mcore_rl.rollout.sglang import SGLangServer

    server = SGLangServer(device, None if device == "cpu" else "0,1", engine_env(device))
    server.start(engine_args(model_dir, device, 1, 0, None))
    done = server.generate(flatten(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8)))
    server.shutdown()
    Path(out).write_text(json.dumps([c.token_ids for c in done]))


def start_cluster(device: str, temp: str, count: int = 2, cpus: int = 1, gpus: int = 1, object_store_mb: int = 200):
    """`count` raylets on loopback; on GPUs `gpus` GPUs each (raylet k: GPUs k*gpus .. (k+1)*gpus - 1, its
    CUDA_VISIBLE_DEVICES set as it starts, so Ray's GPU ids are physical ids) and 4 CPUs a GPU, on CPU
    `cpus` CPUs each (a trainer rank takes one)."""
    from ray.cluster_utils import Cluster

    os.makedirs("/tmp/ray", exist_ok=True)  # Cluster writes the head's address there, not under temp_dir
    common = dict(node_ip_address="127.0.0.1", temp_dir=temp, object_store_memory=object_store_mb << 20)
    per = dict(num_cpus=cpus) if device == "cpu" else dict(num_cpus=4 * gpus, num_gpus=gpus)
    nodes = []
    cluster = None
    for k in range(count):
        if device == "gpu":
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(k * gpus + g) for g in range(gpus))
        if cluster is None:
            cluster = Cluster(initialize_head=True, head_node_args=dict(common, **per, include_dashboard=False))
            nodes.append(cluster.head_node.node_id)
        else:
            nodes.append(cluster.add_node(**common, **per).node_id)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    cluster.wait_for_nodes()
    return cluster, nodes


def greedy_two_nodes(model_dir: str, device: str, nodes: list[str]) -> tuple[list, list]:
    """(2): one engine over both raylets, through EngineGroup as training starts it."""
    import ray
    from ray.util.placement_group import placement_group

    from mcore_rl.parallel.groups import rendezvous_on
    from mcore_rl.rollout.base import SamplingParams, flatten
    from mcore_rl.rollout.group import EngineGroup
    from mcore_rl.rollout.sglang import SGLangServer

    bundle = {"CPU": 1} if device == "cpu" else {"CPU": 1, "GPU": 1}
    pg = placement_group([bundle, bundle], strategy="STRICT_SPREAD")
    ray.get(pg.ready(), timeout=120)
    addr = "%s:%d" % rendezvous_on(pg, 0)
    from mcore_rl.rollout.group import EngineSlot

    slots = [EngineSlot(0, n, pg, n, None, owns_pg=True) for n in range(2)]
    group = EngineGroup(SGLangServer, slots, lambda s: engine_args(model_dir, device, 2, s.node_rank, addr),
                        device=device, tp_size=2, timeout_s=300, start_timeout_s=600,
                        gpu_share=1, label="SGLang", env=engine_env(device))
    try:
        where = ray.get([a.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                         for a in group.actors])
        done = group.generate_requests(flatten(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8)))
        digests = group.weight_digests()[0]
        return [c.token_ids for c in done], [where, sorted(digests)]
    finally:
        group.shutdown()


def train(address: str, device: str, out: str, steps: int, extra: list[str]) -> dict:
    config = "configs/tiny_cpu.yaml" if device == "cpu" else "configs/tiny_gpu.yaml"
    cmd = [sys.executable, "-m", "mcore_rl.train", "--config", config, f"trainer.output_dir={out}",
           f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
           "trainer.save_freq=-1", "rollout.verify_sync_every=1", *extra]
    env = dict(os.environ, RAY_ADDRESS=address, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500, env=env)
    steps_seen = {}
    if os.path.exists(os.path.join(out, "metrics.jsonl")):
        for line in open(os.path.join(out, "metrics.jsonl")):
            r = json.loads(line)
            steps_seen.setdefault(r["step"], {}).update(r)
    return dict(rc=p.returncode, seconds=round(time.monotonic() - t0, 1), tail=(p.stdout + p.stderr)[-2500:],
                steps={k: {m: v for m, v in r.items() if m.startswith(("sync/", "rollout/logp", "reward"))}
                       for k, r in sorted(steps_seen.items())})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--parts", default=",".join(PARTS),
                    help="comma-separated, of: greedy (one-node vs two-node tokens), colocated, separate")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if parts - set(PARTS):
        sys.exit(f"--parts: unknown {sorted(parts - set(PARTS))}; known: {', '.join(PARTS)}")
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        sys.exit("set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (keeps the raylets on loopback)")
    work = tempfile.mkdtemp(prefix="mrl-mn-", dir="/tmp")
    model_dir = make_model(os.path.join(work, "hf"), args.device)
    result: dict = {"device": args.device}
    checks = {}
    import ray

    if "greedy" in parts:
        ref = os.path.join(work, "one_node.json")
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); "
                        f"from tests.support.multinode_scenario import _greedy_one_node; "
                        f"_greedy_one_node({model_dir!r}, {args.device!r}, {ref!r})"], check=True, timeout=900)
        result["one_node_tokens"] = json.loads(Path(ref).read_text())
    cluster, nodes = start_cluster(args.device, os.path.join(work, "ray"))
    try:
        if "greedy" in parts:
            ray.init(address=cluster.address, log_to_driver=os.environ.get("MCORE_RL_SCENARIO_LOGS") == "1")
            result["two_node_tokens"], (where, ranks) = greedy_two_nodes(model_dir, args.device, nodes)
            result["engine_nodes_on"] = [nodes.index(n) for n in where]
            result["read_back_tp_ranks"] = ranks
            ray.shutdown()
            checks.update(same_greedy_tokens=result["one_node_tokens"] == result["two_node_tokens"],
                          engine_spans_both_raylets=sorted(result["engine_nodes_on"]) == [0, 1],
                          both_tp_ranks_read_back=result["read_back_tp_ranks"] == [0, 1])
        if "colocated" in parts:  # trainer rank k and engine node_rank k on raylet k, fed over IPC / by value
            result["train_colocated"] = train(cluster.address, args.device, os.path.join(work, "colo"), args.steps,
                                              ["cluster.nnodes=2", "cluster.n_gpus_per_node=1", "rollout.tp_size=2",
                                               "parallel.ep=2", *WIDE,
                                               *(GPU_TWO_RANKS if args.device == "gpu" else [])])
        if "separate" in parts and args.device == "gpu":  # trainer on raylet 0, a TP=1 engine on raylet 1
            result["train_separate"] = train(cluster.address, "gpu", os.path.join(work, "sep"), args.steps,
                                             ["cluster.nnodes=2", "cluster.n_gpus_per_node=1", "cluster.colocate=false",
                                              "cluster.rollout_gpus=1", "rollout.tp_size=1", "parallel.ep=1", *WIDE])
    finally:
        ray.shutdown()
        cluster.shutdown()
    if "separate" in parts and args.device == "cpu":
        # the engine on raylets of its own: the trainer on one, a TP=2 engine over two more (a rank each),
        # fed by trainer rank 0 over an update group spanning the three (gloo standing in for NCCL)
        cluster, _ = start_cluster("cpu", os.path.join(work, "ray3"), count=3, cpus=1)
        try:
            result["train_separate"] = train(cluster.address, "cpu", os.path.join(work, "sep"), args.steps,
                                             ["cluster.nnodes=3", "cluster.n_gpus_per_node=1", "cluster.colocate=false",
                                              "cluster.rollout_gpus=2", "rollout.tp_size=2", "parallel.ep=1", *WIDE])
        finally:
            cluster.shutdown()
    for name in ("train_colocated", "train_separate"):
        if name in result:
            r = result[name]
            trained = [s for k, s in r["steps"].items() if int(k) > 0]
            checks[name] = r["rc"] == 0 and len(trained) == args.steps and all(
                s.get("sync/verified") == 1.0 and s.get("rollout/logp_diff_abs_mean", 1) < (1e-3 if args.device == "cpu"
                                                                                           else 3e-2) for s in trained)
    result["checks"] = checks
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({"checks": checks, **{k: result[k] for k in ("one_node_tokens", "two_node_tokens") if k in result}},
                     indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
