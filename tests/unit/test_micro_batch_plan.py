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
