"""Trainer rank -> GPU UUID -> SGLang (node_rank, tp_rank), and CUDA_VISIBLE_DEVICES validation."""

from __future__ import annotations

import pytest

from mcore_rl.rollout.sglang import EngineLaunch
from mcore_rl.sync.placement import GpuSlot, colocate, parse_visible_devices
from mcore_rl.sync.engine_layout import EngineLayout, SyncPlanError


@pytest.mark.parametrize("value,match", [("0,1,0,1", "more than once"), ("0,,1", "empty entry"),
                                         ("0,x", "neither GPU indices"), ("0,GPU-1234abcd-aa", "mixes"),
                                         ("0,9", "out of range")])
def test_bad_visible_devices_are_rejected(value, match):
    with pytest.raises(SyncPlanError, match=match):
        parse_visible_devices(value, device_count=8)


def test_good_visible_devices():
    assert parse_visible_devices("3,1") == ["3", "1"]
    assert parse_visible_devices(None) is None


def _trainer(nodes: int, per_node: int) -> list[GpuSlot]:
    # trainer ranks numbered node-major, but GPUs listed in a scrambled order within a node
    return [GpuSlot(f"10.0.0.{n}", f"GPU-{n:02d}{(g * 3) % per_node:02d}aaaa") for n in range(nodes)
            for g in range(per_node)]


def test_colocate_two_nodes_counts_gpus_from_the_placement():
    trainer = _trainer(2, 4)
    engine_nodes = [[f"GPU-{n:02d}{g:02d}aaaa" for g in range(4)] for n in range(2)]
    p = colocate(trainer, engine_nodes, tp_size=8, ep_size=8)
    assert p.engine == EngineLayout(8, 8, nnodes=2, gpus_per_node=4)
    assert sorted(p.trainer_to_engine.values()) == list(range(8))
    for rank, tp_rank in p.trainer_to_engine.items():
        node, local = p.engine.node_and_local(tp_rank)
        assert trainer[rank].node == p.engine_nodes[node]
        assert trainer[rank].gpu_uuid == engine_nodes[node][local]


@pytest.mark.parametrize("engine_nodes,tp,match", [
    ([["GPU-0000aaaa", "GPU-0001aaaa"], ["GPU-0100aaaa"]], 3, "unequal GPU counts"),
    ([["GPU-0000aaaa", "GPU-0001aaaa"]], 4, "tp_size=4 but the placement has 1 node"),
    ([["GPU-0000aaaa", "GPU-0999aaaa"]], 2, "where no trainer rank runs"),
    ([["GPU-0000aaaa", "GPU-0100aaaa"]], 2, "spans hosts"),
])
def test_bad_placements_are_refused(engine_nodes, tp, match):
    with pytest.raises(SyncPlanError, match=match):
        colocate(_trainer(2, 2), engine_nodes, tp_size=tp)


def test_multinode_launch_args_share_everything_but_node_rank():
    launch = EngineLaunch("/models/moonlight", EngineLayout(16, 1, nnodes=2, gpus_per_node=8),
                          dist_init_addr="10.0.0.1:5000", mem_fraction_static=0.6)
    a, b = launch.node_args(0), launch.node_args(1)
    assert {k for k in a if a[k] != b[k]} == {"node_rank"}
    assert a["nnodes"] == 2 and a["enable_memory_saver"] and a["dist_init_addr"] == "10.0.0.1:5000"
    cli = launch.cli(1)
    assert cli[cli.index("--node-rank") + 1] == "1" and "--enable-memory-saver" in cli
    with pytest.raises(SyncPlanError, match="gpus_per_node x nnodes"):
        EngineLaunch("/m", EngineLayout(16, 1, nnodes=2), dist_init_addr="h:1")
    with pytest.raises(SyncPlanError, match="host:port"):
        EngineLaunch("/m", EngineLayout(16, 1, nnodes=2, gpus_per_node=8), dist_init_addr="nohost")


def test_colocated_engines_take_the_gpus_of_the_trainers_bundles_before_the_ranks_exist():
    """Launching places colocated engines by the trainer's bundles (`bundle_devices`, before the
    ranks are built): each engine's CUDA_VISIBLE_DEVICES lists its ranks' GPUs in rank order; the
    feed then matches by the ranks' own `where`, and a rank found elsewhere than its bundle is refused."""
    from mcore_rl.config.sections import load_config
    from mcore_rl.rollout.launch import _check_bundles, _colocated_slots, _feeds
    from mcore_rl.rollout.placement import plan_placement

    cfg = load_config("configs/tiny_gpu.yaml", ["cluster.n_gpus_per_node=4", "rollout.tp_size=2", "parallel.ep=4",
                                                "actor.micro_batch_size=32"])
    placement = plan_placement(cfg)
    bundles = [{"node": "n" * 8, "gpu_ids": [g]} for g in ("3", "1", "0", "2")]  # Ray's picks, any order
    slots = _colocated_slots(placement, bundles, "gpu", pg="pg")
    assert [(s.engine, s.node_rank, s.bundle, s.gpus) for s in slots] == [(0, 0, 0, "3,1"), (1, 0, 2, "0,2")]
    where = [{**b, "uuid": f"GPU-{b['gpu_ids'][0]}"} for b in bundles]
    _check_bundles(bundles, where)
    assert _feeds(placement, where, EngineLayout(2, 1, 1, 2)) == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
    with pytest.raises(SyncPlanError, match=r"trainer rank 1 runs on GPU\(s\) \['2'\]"):
        _check_bundles(bundles, [*where[:1], {**where[1], "gpu_ids": ["2"]}, *where[2:]])
    with pytest.raises(SyncPlanError, match="needs trainer ranks \\[0, 1\\] on one node"):
        _colocated_slots(placement, [{"node": "m" * 8, "gpu_ids": ["3"]}, *bundles[1:]], "gpu", pg="pg")


def test_a_read_back_names_a_rank_that_was_expected_nothing():
    """The read-back checks every rank the engine reported: a rank no synced tensor was expected at
    (a feed that missed it) is a problem, not a pass by default."""
    import torch

    from mcore_rl.rollout.sglang_plugin import weight_digests
    from mcore_rl.sync.engine_layout import compare_engine

    layer = torch.nn.Linear(4, 3)
    have = weight_digests(layer)  # what an engine rank reports: [dtype, shape, bytes, sum, weighted sum]
    want = {name: (d[3] & (2**64 - 1), d[4] & (2**64 - 1)) for name, d in have.items()}
    assert compare_engine({0: want, 1: want}, {0: have, 1: have}, "engine 0") == []
    assert compare_engine({0: want}, {0: have, 1: have}, "engine 0") == [
        "engine 0 tp rank 1: its digests were read but no synced tensor was expected there (not verified)"]
    with torch.no_grad():
        layer.bias[0] += 1
    assert compare_engine({0: want}, {0: weight_digests(layer)}, "engine 0") == [
        "engine 0 tp rank 0: bias differs from the trainer's weights"]


def test_a_read_back_names_engine_ranks_that_disagree_on_a_tensor_each_holds_whole():
    """A parameter every rank of an engine holds whole must read back the same on each: ranks fed by
    trainer ranks that disagree on it (a router bias shifted on one only) each match their own feed, so
    only this comparison sees it. Which parameters count follows the engine layout: under DP attention
    attention, embeddings and the dense MLP are whole per rank, never the experts."""
    import torch

    from mcore_rl.memory.layout import hf_shapes
    from mcore_rl.models.config import HFModel
    from mcore_rl.rollout.sglang_plugin import weight_digests
    from mcore_rl.sync.engine_layout import held_whole, replica_problems
    from tests.support.tiny_models import FAMILIES

    hf = HFModel.from_dict({"model_type": "deepseek_v3", **FAMILIES["deepseek_v3"][1]})
    names = list(hf_shapes(hf))
    bias, q_b = "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.self_attn.q_b_proj.weight"
    plain, dp = held_whole(names, EngineLayout(2, 2), hf), held_whole(names, EngineLayout(2, 2, attn_dp_size=2), hf)
    assert {bias, "model.norm.weight", "model.layers.0.input_layernorm.weight"} <= plain
    assert q_b not in plain and "model.embed_tokens.weight" not in plain
    assert {q_b, "model.embed_tokens.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= dp - plain
    assert not any("experts" in p for p in dp)

    layer = torch.nn.Linear(4, 3)
    same = weight_digests(layer)
    assert replica_problems({0: same, 1: same}, {"bias", "weight"}, "engine 0") == []
    with torch.no_grad():
        layer.bias[0] += 1
    assert replica_problems({0: same, 1: weight_digests(layer)}, {"bias", "weight"}, "engine 0") == [
        "engine 0: bias differs between tp ranks [0, 1], each of which holds it whole: the trainer ranks "
        "that fed them disagree on it"]
