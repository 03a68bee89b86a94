"""`python -m mcore_rl.memory.plan --config CONFIG.yaml [key=value ...]`: the per-GPU and host memory plan.

Prints the table of every phase (works without a GPU: the capacity then comes from
memory.gpu_memory_gb), then host memory per node against cluster.host_memory_gb. Where the config
says `auto` (actor.ppo_max_token_len_per_gpu, memory.recompute, memory.offload_train_states) the
planner picks what fits (`memory.planner.pick_micro_batch`, `plan_for_config`) and the table's first
notes say which. Exit 0 when the
plan fits, 1 with the refusal (phase or node and shortfall) when it does not, 2 on a config error.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

from mcore_rl.preflight.bad_input import BAD_INPUT, report
from mcore_rl.config.sections import ConfigError, load_config
from mcore_rl.config.checks import attention_dp, hf_model_dims, recompute_choice, rollout_gpus
from mcore_rl.memory.gpus import GpuSelectionError, plan_capacity
from mcore_rl.memory.host import HostInputs, plan_with_host
from mcore_rl.memory.planner import AUTO_BUDGET_MAX, RECOMPUTE_BY_COST, MemoryPlanError, Plan, PlanInputs, pick_micro_batch
from mcore_rl.models.config import HFModel


def plan_for_config(cfg, capacity: int | None = None) -> tuple[Plan, str]:
    """The plan of a validated Config, host memory included; raises MemoryPlanError when it cannot fit.
    memory.offload_train_states auto: the trainer's states stay on the GPUs if that plan fits with KV
    for the whole step's sequences in each engine rank, else the plan offloads them."""
    source = "given"
    if capacity is None:  # read once: an auto choice plans twice on the same GPUs
        capacity, source = plan_capacity(cfg.memory.gpu_memory_gb)
    if cfg.memory.offload_train_states != "auto":
        return _plan(cfg, capacity), source
    need = rollout_tokens_per_rank(cfg)
    try:
        plan = _plan(_offloading(cfg, False), capacity)
        why = f"they fit beside the engine, with KV for the step's {need:,} tokens an engine rank"
        if plan.kv_tokens >= need:
            plan.notes.insert(1, f"trainer states: kept on the GPUs while the engine runs (picked: {why})")
            return plan, source
        why = f"kept, the KV cache would hold {plan.kv_tokens:,} of the step's {need:,} tokens an engine rank"
    except MemoryPlanError as e:
        why = f"kept, {str(e).splitlines()[0]}"
    plan = _plan(_offloading(cfg, True), capacity)
    plan.notes.insert(1, f"trainer states: offloaded to the host while the engine runs (picked: {why})")
    return plan, source


def rollout_tokens_per_rank(cfg) -> int:
    """The KV tokens an engine rank needs to hold its share of a step's sequences at once: its
    engine's share (with plain TP every rank holds all of it), or under DP attention that share's
    part that SGLang deals to the rank."""
    engines = max(1, rollout_gpus(cfg) // cfg.rollout.tp_size)
    sequences = -(-cfg.data.train_batch_size * cfg.rollout.n // (engines * attention_dp(cfg)))
    return sequences * (cfg.data.max_prompt_length + cfg.rollout.max_response_len)


def _offloading(cfg, offload: bool):
    out = cfg.model_copy(deep=True)
    out.memory.offload_train_states = offload
    return out


def _plan(cfg, capacity: int) -> Plan:
    dims = hf_model_dims(cfg.model)
    if dims is None:
        where = f" ({cfg.model.hf_path}/config.json does not exist)" if cfg.model.hf_path else ""
        raise ConfigError("model: the planner needs the model's shapes: model.hf_config, or a "
                          f"readable model.hf_path/config.json{where}")
    hf, a = HFModel.from_dict(dims), cfg.actor
    seq = cfg.data.max_prompt_length + cfg.rollout.max_response_len
    mode = recompute_choice(cfg.memory)[0]
    modes = RECOMPUTE_BY_COST if mode == "auto" else (mode,)
    if a.use_dynamic_bsz:
        budget = None if a.ppo_max_token_len_per_gpu == "auto" else a.ppo_max_token_len_per_gpu
        name = "actor.ppo_max_token_len_per_gpu"
    else:  # whole sequences: micro_batch_size of them
        budget, name = a.micro_batch_size * seq, None
    host = HostInputs.from_config(cfg)
    with_host = functools.partial(plan_with_host, h=host)
    inputs, line = pick_micro_batch(hf, lambda t, m: PlanInputs.from_config(cfg, capacity, budget=t, recompute=m),
                                    budget=budget, modes=modes, min_budget=seq, name=name, refused_plan=with_host)
    plan = with_host(hf, inputs)
    plan.notes.insert(0, line)
    return plan


def apply_choice(cfg, plan: Plan) -> None:
    """The config runs as planned: its "auto" budget and recompute become the plan's."""
    if cfg.actor.use_dynamic_bsz:
        cfg.actor.ppo_max_token_len_per_gpu = plan.inputs.micro_tokens
    if cfg.memory.recompute == "auto":
        cfg.memory.recompute = plan.inputs.recompute
    if cfg.memory.offload_train_states == "auto":
        cfg.memory.offload_train_states = plan.inputs.offload_train_states
    if cfg.rollout.verify_sync_probe and cfg.cluster.colocate and plan.inputs.offload_train_states:
        raise ConfigError("rollout.verify_sync_probe scores its probe on the trainer's weights after a sync, where "
                          "memory.offload_train_states has moved them to the host: keep them on the GPUs (false, "
                          "or auto where the plan fits them)")


def settle_without_plan(cfg) -> None:
    """Without a plan (CPU runs): "auto" is AUTO_BUDGET_MAX tokens and no recompute."""
    if cfg.actor.ppo_max_token_len_per_gpu == "auto":
        cfg.actor.ppo_max_token_len_per_gpu = AUTO_BUDGET_MAX
    if cfg.memory.recompute == "auto":
        cfg.memory.recompute = "none"
    if cfg.memory.offload_train_states == "auto":
        cfg.memory.offload_train_states = True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mcore_rl.memory.plan", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        plan, source = plan_for_config(cfg)
    except (*BAD_INPUT, GpuSelectionError) as e:
        return report(e)
    except MemoryPlanError as e:
        if e.plan is not None:
            print(e.plan.table())
        print(f"\n{e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        print(plan.table())
        print(f"capacity from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
