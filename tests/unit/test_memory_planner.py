"""The memory planner against byte counts written out here from the raw HF config numbers."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import yaml

from mcore_rl.memory.gpus import GpuSelectionError, parse_visible, plan_capacity
from mcore_rl.memory.layout import inventory
from mcore_rl.memory.planner import GiB, MemoryPlanError, PlanInputs, make_plan, trainer_bytes
from mcore_rl.models.config import HFModel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOONLIGHT_YAML = os.path.join(ROOT, "configs", "moonlight_16b.yaml")
V3_YAML = os.path.join(ROOT, "configs", "deepseek_v3_671b.yaml")


def hf_of(path: str) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)["model"]["hf_config"]


MOONLIGHT, V3 = hf_of(MOONLIGHT_YAML), hf_of(V3_YAML)


# ----------------------------------------------------------------------------- closed forms
def layer_params(c: dict, layer: int) -> dict[str, int]:
    """Parameters of one decoder layer by kind, straight from the HF config numbers."""
    H, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v, kvl = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    qlr = c["q_lora_rank"]
    out = {"norms": 2 * H + kvl, "kv_a": (kvl + rope) * H, "kv_b": heads * (nope + v) * kvl,
           "o": H * heads * v}
    if qlr:
        out.update(q_a=qlr * H, q_b=heads * (nope + rope) * qlr, norms=out["norms"] + qlr)
    else:
        out["q"] = heads * (nope + rope) * H
    if layer < c["first_k_dense_replace"]:
        out["mlp"] = 3 * H * c["intermediate_size"]
    else:
        E, Im = c["n_routed_experts"], c["moe_intermediate_size"]
        out.update(router=E * H, expert_bias=E, expert=3 * H * Im,
                   shared=3 * H * c["n_shared_experts"] * Im)
    return out


def split_layers(n: int, pp: int) -> list[range]:
    first = n // pp
    sizes = [first] * pp if n % pp == 0 else [first] * (pp - 1) + [n - (pp - 1) * first]
    return [range(sum(sizes[:s]), sum(sizes[:s + 1])) for s in range(pp)]


def megatron_expected(c, tp, pp, ep, etp, world, stage) -> dict[str, int]:
    """Megatron: every linear (also MLA's down projections) split over TP, norms and router replicated."""
    dense = expert = bias = 0
    for layer in split_layers(c["num_hidden_layers"], pp)[stage]:
        p = layer_params(c, layer)
        dense += p["norms"] + (p["kv_a"] + p["kv_b"] + p["o"] + p.get("q", 0) + p.get("q_a", 0)
                               + p.get("q_b", 0) + p.get("mlp", 0) + p.get("shared", 0)) // tp
        if "expert" in p:
            dense += p["router"]
            bias += p["expert_bias"]
            expert += c["n_routed_experts"] // ep * p["expert"] // etp
    V, H = c["vocab_size"], c["hidden_size"]
    if stage == 0:
        dense += V * H // tp
    if stage == pp - 1:
        dense += V * H // tp + H
    dp, edp = world // (tp * pp), world // (pp * ep * etp)
    return {"megatron weights": 2 * (dense + expert) + 4 * bias, "megatron grads": 4 * (dense + expert),
            "megatron optimizer": 12 * (math.ceil(dense / dp) + math.ceil(expert / edp))}


def engine_expected(c, tp, ep) -> int:
    """SGLang: q_a/kv_a replicated, experts E/ep per rank over moe_tp = tp/ep, w_kc/w_vc = kv_b again."""
    V, H, E = c["vocab_size"], c["hidden_size"], c["n_routed_experts"]
    n, fp32 = 2 * V * H // tp + H, 0
    for layer in range(c["num_hidden_layers"]):
        p = layer_params(c, layer)
        n += p["norms"] + p["kv_a"] + p.get("q_a", 0) + 2 * p["kv_b"] // tp + p["o"] // tp
        n += (p.get("q", 0) + p.get("q_b", 0) + p.get("mlp", 0) + p.get("shared", 0)) // tp
        if "expert" in p:
            n += p["router"] + E // ep * p["expert"] // (tp // ep)
            fp32 += p["expert_bias"]
    return 2 * n + 4 * fp32


def fp8_engine_expected(c, tp, ep) -> int:
    """As engine_expected with the linear weights in block FP8: 1 B an element plus one fp32
    scale per 128 x 128 block of each rank's slice (w_kc/w_vc stay bf16); shared experts whose
    slice is not whole 128-row blocks stay bf16 (2 B an element, no scales)."""
    V, H, E, Im = c["vocab_size"], c["hidden_size"], c["n_routed_experts"], c["moe_intermediate_size"]
    heads, nope, rope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    kvl, qlr, moe_tp = c["kv_lora_rank"], c.get("q_lora_rank"), tp // ep

    def fp8(rows, cols):  # one rank's [rows, cols] slice
        return rows * cols + 4 * math.ceil(rows / 128) * math.ceil(cols / 128)

    total = 2 * (2 * V * H // tp + H)
    for layer in range(c["num_hidden_layers"]):
        p = layer_params(c, layer)
        q = fp8(qlr, H) + fp8(heads * (nope + rope) // tp, qlr) if qlr else fp8(heads * (nope + rope) // tp, H)
        total += 2 * p["norms"] + q + fp8(kvl + rope, H)
        total += fp8(heads * (nope + v) // tp, kvl) + 2 * p["kv_b"] // tp + fp8(H, heads * v // tp)
        if "mlp" in p:
            I = c["intermediate_size"] // tp
            total += 2 * fp8(I, H) + fp8(H, I)
        else:
            shared = c["n_shared_experts"] * Im // tp
            total += 2 * p["router"] + 4 * p["expert_bias"]
            total += 2 * 3 * shared * H if shared % 128 else 2 * fp8(shared, H) + fp8(H, shared)
            total += E // ep * (2 * fp8(Im // moe_tp, H) + fp8(H, Im // moe_tp))
    return total


# ----------------------------------------------------------------------------- tests
LAYOUTS = [
    ("moonlight", dict(tp=2, pp=1, ep=8, etp=1, world=16)),
    ("moonlight", dict(tp=1, pp=3, ep=4, etp=1, world=12)),
    ("moonlight", dict(tp=4, pp=2, ep=2, etp=2, world=16)),  # 27 layers: 13 + 14
    ("v3", dict(tp=8, pp=8, ep=32, etp=1, world=256)),  # 61 layers: 7 x 7 + 12
    ("v3", dict(tp=4, pp=16, ep=64, etp=1, world=1024)),
]


@pytest.mark.parametrize("name,lay", LAYOUTS, ids=[f"{n}-tp{l['tp']}pp{l['pp']}ep{l['ep']}" for n, l in LAYOUTS])
def test_megatron_bytes_per_stage(name, lay):
    c = MOONLIGHT if name == "moonlight" else V3
    hf = HFModel.from_dict(c)
    i = PlanInputs(capacity=80 * GiB, world=lay["world"], tp=lay["tp"], pp=lay["pp"], ep=lay["ep"],
                   etp=lay["etp"])
    for stage in range(lay["pp"]):
        got = trainer_bytes(hf, i, stage)
        want = megatron_expected(c, lay["tp"], lay["pp"], lay["ep"], lay["etp"], lay["world"], stage)
        assert {k: got[k] for k in want} == want, f"stage {stage}"


@pytest.mark.parametrize("name,tp,ep", [("moonlight", 16, 16), ("moonlight", 8, 2), ("moonlight", 1, 1),
                                        ("v3", 32, 32), ("v3", 16, 8)])
def test_engine_weights_and_kv_cache(name, tp, ep):
    c = MOONLIGHT if name == "moonlight" else V3
    i = PlanInputs(capacity=1 << 50, world=8, rollout_tp=tp, rollout_ep=ep, mem_fraction_static=0.5)
    plan = make_plan(HFModel.from_dict(c), i)
    assert plan.phases["rollout"]["engine weights"] == engine_expected(c, tp, ep)
    kv_per_token = (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * c["num_hidden_layers"] * 2  # MLA: not split
    assert plan.kv_tokens == plan.phases["rollout"]["engine kv cache"] // kv_per_token
    # SGLang: weights + KV = f * (free memory when the engine starts)
    P = i.capacity - i.reserved  # the sync buckets are freed before the KV cache comes back
    assert plan.phases["rollout"]["engine kv cache"] == int(0.5 * P) - engine_expected(c, tp, ep)


@pytest.mark.parametrize("name,tp,ep", [("v3", 16, 8), ("v3", 8, 8), ("moonlight", 4, 4), ("moonlight", 2, 2)])
def test_fp8_engine_weights_count_e4m3_and_block_scales(name, tp, ep):
    """Moonlight at TP 4: its shared experts, 704 rows a rank, count in bf16 (the engine keeps them so)."""
    c = MOONLIGHT if name == "moonlight" else V3
    i = PlanInputs(capacity=1 << 50, world=8, rollout_tp=tp, rollout_ep=ep, mem_fraction_static=0.5,
                   rollout_weight_dtype="fp8")
    got = make_plan(HFModel.from_dict(c), i).phases["rollout"]["engine weights"]
    assert got == fp8_engine_expected(c, tp, ep)
    # about half the bf16 engine; above 0.535 with Moonlight's shared experts in bf16 at TP 4
    low, high = (0.535, 0.565) if (name, tp) == ("moonlight", 4) else (0.5, 0.53)
    assert low < got / engine_expected(c, tp, ep) < high


def test_whole_model_counts_match_the_published_sizes():
    # Moonlight-16B-A3B: 15.96 B parameters; DeepSeek-V3: 671 B without the MTP layer
    for c, billions in ((MOONLIGHT, 15.96), (V3, 671.0)):
        lay = dict(tp=1, pp=1, ep=1, etp=1, world=1)
        w = megatron_expected(c, stage=0, **lay)["megatron grads"] // 4
        assert abs(w / 1e9 - billions) < 0.05


def test_activations_follow_the_documented_estimate():
    c = MOONLIGHT
    hf = HFModel.from_dict(c)
    T, H, V, tp, n = 8192, c["hidden_size"], c["vocab_size"], 2, 3000
    i = PlanInputs(capacity=80 * GiB, world=16, tp=tp, ep=8, micro_tokens=T, response_tokens=n,
                   fused_logprobs=False)
    moe = T * c["num_experts_per_tok"] // tp * (4 * H + 3 * c["moe_intermediate_size"]) * 2  # ep > 1: dispatch copies
    layers = 27 * 21 * T * H // tp + 26 * moe
    assert trainer_bytes(hf, i, 0)["megatron activations"] == layers + 2 * T * V + 14 * n * V
    one_ep = dataclasses.replace(i, ep=1, world=2)  # no dispatch: two hidden-state copies fewer per routed token
    assert trainer_bytes(hf, i, 0)["megatron activations"] - trainer_bytes(hf, one_ep, 0)["megatron activations"] \
        == 26 * T * c["num_experts_per_tok"] // tp * 2 * H * 2
    fused = dataclasses.replace(i, fused_logprobs=True)  # bf16 rows kept + one fp32 chunk
    assert trainer_bytes(hf, fused, 0)["megatron activations"] == layers + 2 * T * V + 2 * n * V + (1 << 29)
    sdpa = dataclasses.replace(i, packed_attention="sdpa")  # each sequence's attention scores stored too
    assert trainer_bytes(hf, sdpa, 0)["megatron activations"] - trainer_bytes(hf, i, 0)["megatron activations"] \
        == 27 * (132 - 21) * T * H // tp


def _moonlight_train(**kw) -> dict:
    hf = HFModel.from_dict(MOONLIGHT)
    return trainer_bytes(hf, PlanInputs(capacity=80 * GiB, world=16, tp=2, ep=8, micro_tokens=8192,
                                        response_tokens=0, **kw), 0)


def test_recompute_choices_keep_what_the_docstring_says():
    c = MOONLIGHT
    T, H, tp, L = 8192, c["hidden_size"], 2, c["num_hidden_layers"]
    moe = T * c["num_experts_per_tok"] // tp * (2 * H + 3 * c["moe_intermediate_size"]) * 2
    dispatch = T * c["num_experts_per_tok"] // tp * 2 * H * 2  # ep 8: its two copies, kept by every choice
    dense_layer, moe_layer = 21 * T * H // tp, 21 * T * H // tp + moe + dispatch
    head = 2 * T * c["vocab_size"]  # no response rows
    act = lambda **kw: _moonlight_train(**kw)["megatron activations"]  # noqa: E731
    assert act() == dense_layer + 26 * moe_layer + head
    # every layer: its input, plus one layer rebuilt in backward
    assert act(recompute="full") == L * 2 * T * H // tp + moe_layer + head
    assert act(recompute=True) == act(recompute="full")  # memory.recompute_activations
    # the first 5 layers (one dense, four MoE) keep their input, the other 22 everything
    assert act(recompute="full", recompute_layers=5) == 5 * 2 * T * H // tp + 22 * moe_layer + head
    shared = c["n_shared_experts"] * c["moe_intermediate_size"]
    moe_kept = moe_layer - moe - T * (8 * shared + 16 * c["n_routed_experts"]) // tp
    assert act(recompute="selective", recompute_modules=("moe",)) == dense_layer + 26 * moe_kept + head
    mlp_kept = dense_layer - T * 8 * c["intermediate_size"] // tp
    assert act(recompute="selective", recompute_modules=("moe", "mlp")) == mlp_kept + 26 * moe_kept + head


def test_optimizer_offload_and_fused_adam():
    base = _moonlight_train()
    elements = base["megatron optimizer"] // 12  # fp32 main params (4) + moments (8) per element
    half = _moonlight_train(optimizer_offload_fraction=0.5)
    assert half["megatron optimizer"] == 4 * elements + 4 * elements  # half the moments on the host
    assert _moonlight_train(optimizer_offload_fraction=1.0)["megatron optimizer"] == 4 * elements
    # multi-tensor AdamW's sqrt(v) temporaries (4 B per element) exceed these activations only
    # when they are small: here with full recompute and 256 tokens
    small = dict(recompute="full", micro_tokens=256)
    hf = HFModel.from_dict(MOONLIGHT)
    foreach = trainer_bytes(hf, PlanInputs(capacity=80 * GiB, world=16, tp=2, ep=8, fused_adam=False, **small), 0)
    fused = trainer_bytes(hf, PlanInputs(capacity=80 * GiB, world=16, tp=2, ep=8, **small), 0)
    assert foreach["megatron activations"] == 4 * elements > fused["megatron activations"]


def test_config_options_reach_the_plan():
    from mcore_rl.config.sections import ConfigError, load_config

    cfg = load_config(MOONLIGHT_YAML, ["memory.recompute=selective", "memory.recompute_modules=[moe]",
                                       "memory.optimizer_offload_fraction=0.25", "actor.fused_adam=false"])
    i = PlanInputs.from_config(cfg, 80 * GiB)
    assert (i.recompute, i.recompute_modules, i.optimizer_offload_fraction) == ("selective", ("moe",), 0.25)
    assert i.fused_logprobs and not i.fused_adam  # null follows the device (gpu), false stays false
    assert i.packed_attention == "varlen"
    assert PlanInputs.from_config(load_config(MOONLIGHT_YAML, ["actor.packed_attention=sdpa"]),
                                  80 * GiB).packed_attention == "sdpa"
    with pytest.raises(ConfigError, match="packed_attention=varlen needs cluster.device 'gpu'"):
        load_config(MOONLIGHT_YAML, ["cluster.device=cpu", "actor.packed_attention=varlen"])
    # 6144-token micro-batches of 1024-token prompts and 4096-token responses: 4/5 of them responses
    assert i.response_tokens == -(-6144 * 4096 // 5120)  # rounded up
    legacy = PlanInputs.from_config(load_config(MOONLIGHT_YAML, ["memory.recompute_activations=true"]), 80 * GiB)
    assert legacy.recompute == "full" and legacy.recompute_layers is None


def test_oversized_plan_is_refused_naming_phase_and_shortfall():
    hf = HFModel.from_dict(MOONLIGHT)
    i = PlanInputs(capacity=24 * GiB, world=16, tp=2, ep=8, micro_tokens=2 * 5120, rollout_tp=16, rollout_ep=16)
    with pytest.raises(MemoryPlanError) as info:
        make_plan(hf, i)
    e = info.value
    assert e.phase == "train" and e.shortfall == e.plan.total("train") - 24 * GiB > 0
    assert f"phase 'train' is short by {e.shortfall / GiB:.2f} GiB" in str(e)
    assert "OVER" in e.plan.table()
    # the KV cache must hold at least one full sequence
    tiny_kv = PlanInputs(capacity=80 * GiB, world=16, tp=2, ep=8, micro_tokens=1024, rollout_tp=16,
                         rollout_ep=16, mem_fraction_static=0.03, seq_len=100_000)
    with pytest.raises(MemoryPlanError, match="phase 'rollout'.*less than one sequence"):
        make_plan(hf, tiny_kv)


def test_picked_mem_fraction_leaves_room_for_graphs_and_activations():
    hf = HFModel.from_dict(MOONLIGHT)
    i = PlanInputs(capacity=80 * GiB, world=16, tp=2, ep=8, rollout_tp=16, rollout_ep=16)
    plan = make_plan(hf, i)
    P = i.capacity - i.reserved  # trainer states offloaded, sync buckets freed
    r = plan.phases["rollout"]
    assert r["engine weights"] + r["engine kv cache"] == int(plan.mem_fraction_static * P)
    assert (1 - plan.mem_fraction_static) * P >= r["engine cuda graphs"] + r["engine activations"]
    assert plan.total("rollout") <= i.capacity


def test_sync_phase_holds_the_trainers_weights_it_reads():
    """Colocated, the sync reads the trainer's weights on the GPU: they leave after it, the grads
    and optimizer states before it; not offloaded, everything stays (and counts) anyway."""
    hf = HFModel.from_dict(MOONLIGHT)
    i = PlanInputs(capacity=80 * GiB, world=16, tp=2, ep=8, rollout_tp=16, rollout_ep=16)
    plan = make_plan(hf, i)
    sync, train = plan.phases["sync"], plan.phases["train"]
    assert sync["megatron weights"] == train["megatron weights"] > 0
    assert "megatron optimizer" not in sync and "megatron grads" not in sync
    assert sync["sync buckets"] == 3 * i.sync_bucket
    kept = make_plan(hf, dataclasses.replace(i, offload_train_states=False)).phases["sync"]
    assert kept["megatron weights"] == train["megatron weights"] and kept["megatron optimizer"] > 0


def run_cli(*args):
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "mcore_rl.memory.plan", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_prints_the_table_and_refuses_a_small_gpu():
    ok = run_cli("--config", MOONLIGHT_YAML)
    assert ok.returncode == 0, ok.stderr
    assert "engine kv cache" in ok.stdout and "mem_fraction_static=" in ok.stdout
    assert "micro-batch: 6,144 tokens per GPU; recompute none\n" in ok.stdout  # the config's, not picked
    small = run_cli("--config", MOONLIGHT_YAML, "memory.gpu_memory_gb=24")
    assert small.returncode == 1
    assert "OVER" in small.stdout and "memory plan refused: phase 'train' is short by" in small.stderr
    assert "actor.ppo_max_token_len_per_gpu=6144 cannot fit; not even one sequence (5120 tokens) fits" in small.stderr
    bad = run_cli("--config", MOONLIGHT_YAML, "memory.gpu_memory_gb=-1")
    assert bad.returncode == 2 and "memory.gpu_memory_gb must be > 0" in bad.stderr


@pytest.mark.parametrize("name", ["deepseek_v3_671b", "qwen3_30b_a3b", "glm45_air"])
def test_config_fits_with_its_layout(name):
    from mcore_rl.config.sections import load_config
    from mcore_rl.memory.plan import plan_for_config

    plan, _ = plan_for_config(load_config(os.path.join(ROOT, "configs", f"{name}.yaml")), capacity=int(80 * GiB))
    assert all(plan.total(ph) <= plan.inputs.capacity for ph in plan.phases)


def gqa_moe_params(c: dict) -> int:
    """Qwen3-MoE / GLM-4.5 parameters from the HF config numbers (untied, every layer but GLM's first
    first_k_dense_replace sparse; the expert bias counted with GLM's router)."""
    H, d, heads, kv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    E = c.get("n_routed_experts") or c["num_experts"]
    attn = 2 * H + (heads + 2 * kv) * d * H + H * heads * d
    attn += (heads + 2 * kv) * d if c.get("attention_bias") else 0
    attn += 2 * d if c["model_type"] == "qwen3_moe" or c.get("use_qk_norm") else 0
    moe = E * H + 3 * (E + c.get("n_shared_experts", 0)) * c["moe_intermediate_size"] * H
    moe += E if c["model_type"] == "glm4_moe" else 0  # the expert bias
    dense = c.get("first_k_dense_replace", 0)
    layers = c["num_hidden_layers"]
    return 2 * c["vocab_size"] * H + H + layers * attn + (layers - dense) * moe + dense * 3 * c["intermediate_size"] * H


@pytest.mark.parametrize("name,billions", [("qwen3_30b_a3b", 30.5), ("glm45_air", 106.9)])
def test_inventory_of_gqa_moe_families(name, billions):
    """megatron's own model (the planner's inventory) holds exactly the HF model's parameters, and
    as many as the model cards say (GLM-4.5-Air without its MTP layer)."""
    c = hf_of(os.path.join(ROOT, "configs", f"{name}.yaml"))
    total = sum(w.numel for w in inventory(HFModel.from_dict(c)))
    assert total == gqa_moe_params(c) and round(total / 1e9, 1) == billions


# ----------------------------------------------------------------------------- GPUs
UUIDS = ["GPU-aaaa-0000", "GPU-bbbb-1111", "GPU-cccc-2222", "GPU-cccd-3333"]


def test_visible_devices_resolve_to_uuids_and_refuse_duplicates():
    assert parse_visible(None, UUIDS) == UUIDS
    assert parse_visible("2,0", UUIDS) == [UUIDS[2], UUIDS[0]]
    assert parse_visible("GPU-bbbb-1111,aaaa", UUIDS) == [UUIDS[1], UUIDS[0]]  # full UUID, prefix
    for spec, msg in (("0,1,0,1", "twice"), ("1,GPU-bbbb", "twice"), ("4", "not one of"),
                      ("GPU-ccc", "matches 2 GPUs"), ("0,,1", "empty entry")):
        with pytest.raises(GpuSelectionError, match=msg):
            parse_visible(spec, UUIDS)


def test_capacity_without_nvml_comes_from_the_config():
    try:
        import pynvml

        pynvml.nvmlInit()
        pytest.skip("NVML present: the capacity comes from the GPUs")
    except Exception:
        pass
    assert plan_capacity(24.0) == (24 * GiB, "memory.gpu_memory_gb (no NVML)")
    with pytest.raises(GpuSelectionError, match="set memory.gpu_memory_gb"):
        plan_capacity(None)


# ----------------------------------------------------------------------------- megatron itself
MEGATRON_LAYOUTS = [dict(ep=2), dict(pp=2), dict(tp=2, etp=2)]  # TP2xETP2 covers dense TP too


def _count_local_params(rank, cfg, out_dir):
    import json

    import torch
    from megatron.core import parallel_state as ps

    from mcore_rl.models.builder import build_model
    from mcore_rl.models.config import transformer_config
    from mcore_rl.parallel.groups import Layout, init_distributed

    hf = HFModel.from_dict(cfg)
    counts = []
    for lay in MEGATRON_LAYOUTS:
        init_distributed(Layout(**lay))
        model = build_model(hf, transformer_config(hf, dtype=torch.float32, cpu=True, **lay))
        counts.append(sum(p.numel() for p in model.parameters()))
        ps.destroy_model_parallel()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(counts, f)


def test_rank_counts_match_megatron_models_built_at_each_layout(tmp_path):
    """Per-rank parameter counts against megatron-core's own models at EP2, PP2, TP2 x ETP2."""
    import json

    from mcore_rl.memory.layout import megatron_rank_numel
    from tests.support.distributed import run
    from tests.support.tiny_models import FAMILIES

    cfg = dict(FAMILIES["deepseek_v3"][1], model_type="deepseek_v3")
    run(_count_local_params, 2, cfg, str(tmp_path))
    hf = HFModel.from_dict(cfg)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for lay, n in zip(MEGATRON_LAYOUTS, got):
            full = {**dict(tp=1, pp=1, ep=1, etp=1), **lay}
            stage = rank if full["pp"] == 2 else 0
            want = megatron_rank_numel(inventory(hf), hf, stage=stage, **full)
            assert want["dense"] + want["expert"] == n, (lay, rank)


# ----------------------------------------------------------------------------- the plan in a run
TINY_GPU_YAML = os.path.join(ROOT, "configs", "tiny_gpu.yaml")


@pytest.mark.parametrize("hook_mode", ["preload", "torch"])
def test_resume_needs_are_what_each_engine_resume_brings_back(hook_mode):
    plan = make_plan(HFModel.from_dict(MOONLIGHT), PlanInputs(capacity=80 * GiB, world=16, tp=2, ep=8, rollout_tp=16,
                                                              rollout_ep=16, hook_mode=hook_mode))
    r, needs = plan.phases["rollout"], plan.resume_needs()
    assert needs["weights"] == r["engine weights"] > 0
    # graphs the saver cannot release (hook mode torch) stay resident, so their resume takes nothing
    graphs = r["engine cuda graphs"] if hook_mode == "preload" else 0
    assert needs["kv_cache"] == r["engine kv cache"] + graphs > 0


def test_a_gpu_engine_gets_the_planned_fraction_and_kv_tokens():
    """SGLang applies mem_fraction_static to the free memory it finds, which still holds what the plan
    keeps out; the plan's token count caps the pool (SGLang takes the smaller)."""
    from mcore_rl.config.sections import load_config
    from mcore_rl.memory.plan import plan_for_config
    from mcore_rl.rollout import sglang as S
    from mcore_rl.rollout.launch import _engine_memory
    from mcore_rl.sync.engine_layout import EngineLayout

    cfg = load_config(TINY_GPU_YAML, ["memory.auto_mem_fraction=true"])
    plan, _ = plan_for_config(cfg, capacity=int(79 * GiB))
    args = S.engine_args(cfg, "/model", EngineLayout(1, 1, 1, 1), 0, None, *_engine_memory(cfg, plan))
    assert args["mem_fraction_static"] == plan.mem_fraction_static == 0.95
    assert args["disable_shared_experts_fusion"]  # the layout the sync's read-back table describes
    assert args["max_total_tokens"] == plan.kv_tokens == plan.phases["rollout"]["engine kv cache"] // (576 * 2 * 2)
    assert "max_total_tokens" not in S.engine_args(cfg, "/model", EngineLayout(1, 1, 1, 1), 0, None,
                                                   *_engine_memory(cfg, None))


def test_the_engine_decodes_no_larger_batch_than_planned():
    """The plan's engine activations (the sampler's rows) are for max_running_requests decode rows,
    by default the CUDA graphs' size; the engine is started with that cap, so a batch larger than
    the graphs (a validation of every prompt at once) queues instead of running eagerly unplanned."""
    from mcore_rl.config.sections import load_config
    from mcore_rl.memory.plan import plan_for_config
    from mcore_rl.rollout import sglang as S
    from mcore_rl.sync.engine_layout import EngineLayout

    def planned(*overrides):
        cfg = load_config(TINY_GPU_YAML, ["rollout.cuda_graph_max_bs=64", *overrides])
        act = plan_for_config(cfg, capacity=int(79 * GiB))[0].phases["rollout"]["engine activations"]
        return S.engine_args(cfg, "/model", EngineLayout(1, 1, 1, 1), 0, None, 0.5)["max_running_requests"], act

    rows, act = planned()
    rows2, act2 = planned("rollout.max_running_requests=192")
    unseeded = planned("rollout.seeded=false")[1]
    V = 16  # tiny_gpu.yaml's vocabulary
    assert (rows, rows2) == (64, 192)
    assert act2 - act == 128 * 32 * V  # the seeded sampler's 32 B per row and vocabulary entry
    assert act - unseeded == 64 * (32 - 12) * V


def test_dp_attention_engine_args_are_the_layout_the_sync_places_weights_by():
    """rollout.dp_attention: SGLang's DP attention over the engine's TP ranks with lm_head and dense MLP
    per rank (the layout's groups), and the decode batch a rank runs as the config's: SGLang divides
    max_running_requests over its attention-DP ranks."""
    from mcore_rl.config.sections import load_config
    from mcore_rl.rollout import sglang as S
    from mcore_rl.sync.engine_layout import EngineLayout

    cfg = load_config(TINY_GPU_YAML, ["rollout.cuda_graph_max_bs=16", "rollout.dp_attention=true",
                                      "rollout.tp_size=2", "cluster.n_gpus_per_node=2", "actor.micro_batch_size=32"])
    args = S.engine_args(cfg, "/model", EngineLayout(2, 1, 1, 2, attn_dp_size=2), 0, None, 0.5)
    assert {k: args[k] for k in ("enable_dp_attention", "dp_size", "enable_dp_lm_head", "moe_dense_tp_size",
                                 "cuda_graph_max_bs", "max_running_requests")} == dict(
        enable_dp_attention=True, dp_size=2, enable_dp_lm_head=True, moe_dense_tp_size=1, cuda_graph_max_bs=16,
        max_running_requests=32)
    plain = S.engine_args(cfg, "/model", EngineLayout(2, 1, 1, 2), 0, None, 0.5)
    assert "enable_dp_attention" not in plain and plain["max_running_requests"] == 16


def test_a_gpu_run_whose_plan_cannot_fit_stops_before_anything_starts(tmp_path):
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", PYTHONWARNINGS="ignore")
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "mcore_rl.train", "--config", TINY_GPU_YAML, "memory.gpu_memory_gb=3",
                        f"trainer.output_dir={out}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "memory plan refused: phase" in r.stderr and "OVER" in r.stdout
    assert "actor ranks" not in r.stdout and not (out / "metrics.jsonl").exists()  # no actor, no step


def test_planning_a_gpu_run_opens_no_cuda_context():
    """The driver plans every run; on a GPU host a CUDA context there held 0.6 GiB of GPU 0 all run
    (megatron's RNG seeding, RoPE and router asked for the current CUDA device, and its models import
    flashinfer, whose import asks the device). A fresh process that believes CUDA is present, and
    fails on any CUDA initialisation or flashinfer import, plans the Moonlight run."""
    code = """
import torch, torch.cuda.random
def opened(*a, **k):
    raise SystemExit("CUDA initialised by the plan")
torch.cuda.is_available = lambda: True
torch.cuda._lazy_init = torch.cuda.random._lazy_init = opened
class Flashinfer:  # its import asks the GPU's compute capability: a CUDA context
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "flashinfer":
            raise SystemExit("flashinfer imported by the plan")
import sys
sys.meta_path.insert(0, Flashinfer())
from mcore_rl.config import sections as C
from mcore_rl.loop.startup import memory_plan
memory_plan(C.load_config('configs/moonlight_2gpu.yaml', ['cluster.n_gpus_per_node=1', 'parallel.ep=1',
                                                             'rollout.tp_size=1']))
print('planned')
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, TORCHDYNAMO_DISABLE="1"))
    assert r.returncode == 0 and "planned" in r.stdout, r.stderr[-2000:]
