"""The planner picks the micro-batch token budget and the recompute mode that fit (config "auto"),
says which, and refuses a set budget that cannot fit, naming the largest that would. At Moonlight's
widths, all 27 layers, on a declared 4 x H200 (issue 45's run: 16384 tokens refused, 4096 ran)."""

from __future__ import annotations

import os
import re

import pytest

from mcore_rl.config import sections as C
from mcore_rl.config import checks as config_checks
from mcore_rl.memory.planner import BUDGET_STEP, GiB, MemoryPlanError, PlanInputs, make_plan
from mcore_rl.models.config import HFModel
from mcore_rl.memory.plan import apply_choice, plan_for_config, settle_without_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOONLIGHT_2GPU = os.path.join(ROOT, "configs", "moonlight_2gpu.yaml")  # budget and recompute: auto
WHOLE_ON_4 = ("model.hf_config.num_hidden_layers=27", "cluster.n_gpus_per_node=4", "parallel.ep=4",
              "rollout.tp_size=1", "cluster.host_memory_gb=480", "rollout.max_response_len=256")
H200 = int(139.8 * GiB)  # the free memory NVML reported on issue 45's 4 x H200


def cfg_of(*overrides):
    return C.load_config(MOONLIGHT_2GPU, [*WHOLE_ON_4, *overrides])


def fits(cfg, budget: int, recompute: str) -> bool:
    """Whether make_plan takes `cfg` at this budget and recompute (the planner's own check, made here)."""
    hf = HFModel.from_dict(config_checks.hf_model_dims(cfg.model))
    try:
        make_plan(hf, PlanInputs.from_config(cfg, H200, budget=budget, recompute=recompute))
    except MemoryPlanError as e:
        assert e.phase == "train", e  # only the train phase depends on the budget
        return False
    return True


def test_auto_picks_the_largest_budget_that_fits_without_recompute_and_the_run_gets_it():
    cfg = cfg_of()
    plan, _ = plan_for_config(cfg, capacity=H200)
    budget, mode = plan.inputs.micro_tokens, plan.inputs.recompute
    assert mode == "none" and 4096 <= budget < 16384 and budget % BUDGET_STEP == 0
    assert fits(cfg, budget, "none") and not fits(cfg, budget + BUDGET_STEP, "none")
    assert plan.total("train") <= H200
    assert f"micro-batch: {budget:,} tokens per GPU (picked: the largest up to 16384 that fits); recompute none " \
           "(picked: the cheapest that fits)" in plan.table()
    apply_choice(cfg, plan)  # what train.memory_plan does before the actors start
    assert (cfg.actor.ppo_max_token_len_per_gpu, cfg.memory.recompute) == (budget, "none")
    assert C.to_dict(cfg)["actor"]["ppo_max_token_len_per_gpu"] == budget


def test_a_set_budget_that_cannot_fit_is_refused_naming_the_largest_that_would():
    with pytest.raises(MemoryPlanError) as info:
        plan_for_config(cfg_of("actor.ppo_max_token_len_per_gpu=16384", "memory.recompute=none"), capacity=H200)
    e = info.value
    assert e.phase == "train" and "megatron activations" in str(e)
    m = re.search(r"actor\.ppo_max_token_len_per_gpu=16384 cannot fit; the largest that fits is (\d+) "
                  r"\(memory\.recompute: none\)", str(e))
    assert m, str(e)
    largest = int(m[1])
    plan, _ = plan_for_config(cfg_of(f"actor.ppo_max_token_len_per_gpu={largest}", "memory.recompute=none"),
                              capacity=H200)
    assert plan.inputs.micro_tokens == largest
    assert "tokens per GPU; recompute none" in plan.table()  # set, not picked
    with pytest.raises(MemoryPlanError, match="phase 'train'"):
        plan_for_config(cfg_of(f"actor.ppo_max_token_len_per_gpu={largest + BUDGET_STEP}", "memory.recompute=none"),
                        capacity=H200)


def test_auto_recompute_is_the_cheapest_under_which_a_set_budget_fits():
    cfg = cfg_of("actor.ppo_max_token_len_per_gpu=16384")
    plan, _ = plan_for_config(cfg, capacity=H200)
    mode = plan.inputs.recompute
    assert plan.inputs.micro_tokens == 16384 and mode in ("selective", "full")
    assert not fits(cfg, 16384, "none") and fits(cfg, 16384, mode)
    assert mode == "selective" or not fits(cfg, 16384, "selective")  # full only where selective does not do
    assert f"recompute {mode} (picked: the cheapest that fits)" in plan.table()


def test_auto_recomputes_when_no_recompute_leaves_less_than_4096_tokens():
    """On a smaller GPU no budget of 4096 tokens fits without recompute: selective recompute of the
    MoE layers buys a larger one, and the plan takes it."""
    cfg = cfg_of()
    small = int(100 * GiB)
    hf = HFModel.from_dict(config_checks.hf_model_dims(cfg.model))

    def ok(budget, mode):
        try:
            make_plan(hf, PlanInputs.from_config(cfg, small, budget=budget, recompute=mode))
            return True
        except MemoryPlanError:
            return False

    assert not ok(4096, "none")
    plan, _ = plan_for_config(cfg, capacity=small)
    assert plan.inputs.recompute == "selective" and plan.inputs.micro_tokens >= 4096
    assert ok(plan.inputs.micro_tokens, "selective") and not ok(plan.inputs.micro_tokens + BUDGET_STEP, "selective")


def test_without_a_plan_auto_is_16384_tokens_and_no_recompute():
    cfg = C.load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"),
                        ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=auto", "memory.recompute=auto"])
    settle_without_plan(cfg)
    assert (cfg.actor.ppo_max_token_len_per_gpu, cfg.memory.recompute) == (16384, "none")


# ---- memory.offload_train_states: auto ------------------------------------------------------------
LONG_64 = ("rollout.tp_size=4", "rollout.ep_size=4", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
           "rollout.max_response_len=8176", "memory.offload_train_states=auto")  # issue 46's 64 x 8K


def test_auto_offload_keeps_the_states_on_the_gpus_where_they_fit_with_kv_for_the_step():
    """64 x 8K at 27 layers, one TP4/EP4 engine: the states (54 GiB a GPU; the grads go) stay beside the engine, whose KV
    still holds all 64 sequences; nothing is pinned on the host, and the run gets the choice."""
    cfg = cfg_of(*LONG_64)
    plan, _ = plan_for_config(cfg, capacity=H200)
    assert plan.inputs.offload_train_states is False
    assert "trainer states: kept on the GPUs while the engine runs (picked: they fit beside the engine, with KV " \
           "for the step's 524,288 tokens an engine rank)" in plan.notes
    assert plan.kv_tokens >= 64 * 8192
    for phase in ("sync", "rollout"):
        assert plan.phases[phase]["megatron optimizer"] > 40 * GiB, phase
    explicit, _ = plan_for_config(cfg_of(*LONG_64[:-1], "memory.offload_train_states=false"), capacity=H200)
    assert {p: plan.total(p) for p in plan.phases} == {p: explicit.total(p) for p in explicit.phases}
    assert plan.host.nodes[0]["trainer states, pinned"] == 0
    apply_choice(cfg, plan)
    assert cfg.memory.offload_train_states is False


def test_dp_attention_plans_each_ranks_kv_for_its_own_requests_and_whole_attention_weights():
    """The same 64 x 8K with DP attention in the TP4/EP4 engine (rollout.dp_attention): a rank's KV cache holds
    only the quarter of the sequences SGLang deals it (plain TP: all 64, MLA's latent replicated), while
    its weights hold attention, embeddings, lm_head and the dense MLP whole; experts as before."""
    plain, _ = plan_for_config(cfg_of(*LONG_64), capacity=H200)
    dp, _ = plan_for_config(cfg_of(*LONG_64, "rollout.dp_attention=true"), capacity=H200)
    assert dp.inputs.rollout_attn_dp == 4 and plain.inputs.rollout_attn_dp == 1
    assert "trainer states: kept on the GPUs while the engine runs (picked: they fit beside the engine, with KV " \
           "for the step's 131,072 tokens an engine rank)" in dp.notes
    w_plain, w_dp = plain.phases["rollout"]["engine weights"], dp.phases["rollout"]["engine weights"]
    hf = HFModel.from_dict(config_checks.hf_model_dims(cfg_of().model))
    from mcore_rl.memory.layout import engine_tensors, inventory

    def numel(tensors, keep):
        return sum(t.nbytes for n, t in tensors.items() if keep(n) and t.derived_from is None)

    one = engine_tensors(hf, inventory(hf), tp=1, ep=1)  # a TP1 engine: everything whole
    four = engine_tensors(hf, inventory(hf), tp=4, ep=4)
    outside = lambda n: ".mlp.experts." not in n and ".shared_experts." not in n  # noqa: E731
    # the growth is exactly the non-expert weights going from a quarter (plain TP4) to whole
    assert w_dp - w_plain == numel(one, outside) - numel(four, outside) + (
        sum(t.nbytes for n, t in one.items() if n.endswith("w_kc_w_vc")) - sum(
            t.nbytes for n, t in four.items() if n.endswith("w_kc_w_vc")))
    assert "per rank, each for its own requests (an engine: " in dp.table()


def test_the_dp_attention_layout_places_a_tp1_engines_tensors_but_the_experts():
    """Moonlight at TP4/DP4/EP4 (rollout.dp_attention): every rank holds what a TP1 engine holds, but the
    routed experts (its EP quarter, whole) and the shared experts (a quarter, split over the TP group as
    SGLang's DeepseekV2MoE builds them); the read-back's pieces (engine_layout.place) agree."""
    import torch

    from mcore_rl.memory.layout import engine_tensors, inventory
    from mcore_rl.sync.engine_layout import EngineLayout, place

    hf = HFModel.from_dict(config_checks.hf_model_dims(cfg_of().model))
    one = engine_tensors(hf, inventory(hf), tp=1, ep=1)
    for rank in range(4):
        dp = engine_tensors(hf, inventory(hf), tp=4, ep=4, attn_dp=4, rank=rank)
        assert dp.keys() == one.keys()
        for name, t in dp.items():
            if name.endswith(("w13_weight", "w2_weight")):
                assert t.shape == (one[name].shape[0] // 4, *one[name].shape[1:]), name
            elif ".shared_experts." in name:
                dim = 1 if name.endswith("down_proj.weight") else 0
                assert t.shape[dim] * 4 == one[name].shape[dim], name
            else:
                assert t.shape == one[name].shape, name
    layout = EngineLayout(4, 4, 1, 4, attn_dp_size=4)
    layout.validate(hf)
    for name in ("model.layers.3.self_attn.kv_b_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                 "lm_head.weight", "model.layers.3.mlp.shared_experts.down_proj.weight"):
        t = torch.arange(torch.Size(hf_shape_of(hf, name)).numel(), dtype=torch.float32).view(hf_shape_of(hf, name))
        pieces = [place(name, t, layout, r, hf) for r in range(4)]
        if ".shared_experts." in name:  # split over the four ranks on its columns
            assert torch.equal(torch.cat([p[0].src for p in pieces], 1), t)
        else:
            assert all(torch.equal(p[0].src, t) for p in pieces), name


def hf_shape_of(hf, name):
    from mcore_rl.sync.engine_layout import hf_shape

    return hf_shape(hf, name)


def test_auto_offload_moves_the_states_where_kept_ones_leave_too_little_kv():
    """Eight times the sequences: kept states would leave the KV cache short of the step's share an engine."""
    cfg = cfg_of(*LONG_64, "data.train_batch_size=64", "actor.ppo_mini_batch_size=64")
    plan, _ = plan_for_config(cfg, capacity=H200)
    assert plan.inputs.offload_train_states is True
    note = next(n for n in plan.notes if n.startswith("trainer states: offloaded"))
    assert re.search(r"picked: kept, the KV cache would hold [\d,]+ of the step's 4,194,304 tokens an engine", note), note
    apply_choice(cfg, plan)
    assert cfg.memory.offload_train_states is True


def test_auto_offload_moves_the_states_where_kept_ones_do_not_fit():
    """On an 85 GiB GPU the kept states (54 GiB without the grads, which go anyway, and 5 of cache), four TP1 engines' weights
    (30) and the reserve leave the rollout phase short: the states go to the host, and the refusal of keeping
    them is the note's reason."""
    cfg = C.load_config(os.path.join(ROOT, "configs", "moonlight_4gpu.yaml"),
                        ["cluster.host_memory_gb=480", "memory.offload_train_states=auto"])
    plan, _ = plan_for_config(cfg, capacity=85 * GiB)
    assert plan.inputs.offload_train_states is True
    note = next(n for n in plan.notes if n.startswith("trainer states: offloaded"))
    assert "picked: kept, memory plan refused: phase 'rollout' is short by 11.76 GiB per GPU" in note, note
    assert plan.host.nodes[0]["trainer states, pinned"] > 200 * GiB


def test_the_sync_probe_is_refused_where_the_plan_offloads_the_trainers_weights():
    """rollout.verify_sync_probe scores the trainer's weights after a sync: refused before anything
    starts where the plan moved them to the host, taken where it keeps them."""
    args = ["cluster.host_memory_gb=480", "memory.offload_train_states=auto", "rollout.verify_sync_probe=true"]
    path = os.path.join(ROOT, "configs", "moonlight_4gpu.yaml")
    offloaded = C.load_config(path, args)
    plan, _ = plan_for_config(offloaded, capacity=85 * GiB)
    with pytest.raises(C.ConfigError, match="rollout.verify_sync_probe .* moved them to the host"):
        apply_choice(offloaded, plan)
    kept = C.load_config(path, args)
    apply_choice(kept, plan_for_config(kept, capacity=H200)[0])
    assert kept.memory.offload_train_states is False


def test_without_a_plan_auto_offload_offloads():
    cfg = C.load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), ["memory.offload_train_states=auto"])
    settle_without_plan(cfg)
    assert cfg.memory.offload_train_states is True
