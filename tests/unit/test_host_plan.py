"""Host memory per node (mcore_rl.memory.host): the numbers against the planner's own inventory, the
refusal of a node over its RAM by `python -m mcore_rl.memory.plan` and `train --dry-run`, and the config keys."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from mcore_rl.config.sections import ConfigError, load_config
from mcore_rl.memory import host as H
from mcore_rl.memory.layout import inventory, megatron_rank_numel
from mcore_rl.memory.planner import GiB, MemoryPlanError, PlanInputs
from mcore_rl.models.config import HFModel
from mcore_rl.memory.plan import plan_for_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOONLIGHT_YAML = os.path.join(ROOT, "configs", "moonlight_16b.yaml")
CAP = int(80 * GiB)


def plan_of(*overrides, capacity=CAP):
    cfg = load_config(MOONLIGHT_YAML, list(overrides))
    return cfg, plan_for_config(cfg, capacity=capacity)[0]


def by_hand(cfg, stage: int) -> dict[str, int]:
    """One trainer rank's host bytes, from megatron_rank_numel of the inventory and the documented rules."""
    hf = HFModel.from_dict(cfg.model.hf_config)
    p, world, f = cfg.parallel, 16, cfg.memory.optimizer_offload_fraction
    n = megatron_rank_numel(inventory(hf), hf, tp=p.tp, pp=p.pp, ep=p.ep, etp=p.etp, stage=stage)
    el = math.ceil(n["dense"] / (world // (p.tp * p.pp))) + math.ceil(n["expert"] / (world // (p.pp * p.ep * p.etp)))
    weights = 2 * (n["dense"] + n["expert"]) + 4 * n["buffer"]
    assert f == 0.5  # half the moments (8 B per element) on the host
    host_moments = 4 * el
    states = weights + 4 * (n["dense"] + n["expert"]) + 4 * el + 8 * el - host_moments  # bf16 w, fp32 g, main, moments
    grads = 4 * (n["dense"] + n["expert"])  # freed while offloaded, not pinned on the host
    return {H.STATES: states - grads, H.OPT: 2 * host_moments, H.REF: weights,
            H.CKPT: max(2 * GiB, math.ceil(0.05 * (states + host_moments))), H.TRAINER: int(H.TRAINER_PROCESS_GB * GiB)}


def test_items_per_node_equal_the_hand_count_at_pp2():
    cfg, plan = plan_of("parallel.pp=2", "memory.optimizer_offload_fraction=0.5", "actor.use_kl_loss=true")
    host = plan.host
    assert host.ram == 1800 * GiB and host.ram_source == "cluster.host_memory_gb"
    # megatron's rank order puts PP outermost: ranks 0-7 (node 0) are stage 0, ranks 8-15 (node 1) stage 1
    for node in (0, 1):
        want = {k: 8 * v for k, v in by_hand(cfg, node).items()}
        want[H.ENGINE] = 8 * int(H.ENGINE_PROCESS_GB * GiB)  # the TP-16 engine has 8 ranks on each node
        assert host.nodes[node] == want, node
    assert host.fullest == max((0, 1), key=host.total) and host.shortfall == 0
    # the pinned states are the states the GPU plan's train phase counts, but the grads (freed)
    train = plan.phases["train"]
    s = plan.worst_stage["train"]  # the stage whose states the train column shows
    assert host.nodes[s][H.STATES] == 8 * sum(train[k] for k in ("megatron weights", "megatron optimizer"))


def test_what_lives_on_the_host_follows_the_config():
    _, plan = plan_of("memory.offload_train_states=false", "memory.host_engine_process_gb=0",
                      "memory.host_trainer_process_gb=1.5")
    node = plan.host.nodes[0]
    assert node[H.STATES] == node[H.OPT] == node[H.REF] == node[H.ENGINE] == 0  # no KL: no reference model
    # a 26 GiB state: the writer's 2 GiB floor, and the weights a save stages from the GPU (states kept there)
    weights = plan.phases["train"]["megatron weights"]
    assert node[H.TRAINER] == 8 * int(1.5 * GiB) and node[H.CKPT] == 8 * (2 * GiB + weights)
    _, never = plan_of("memory.offload_train_states=false", "trainer.save_freq=-1", "trainer.save_last=false")
    assert never.host.nodes[0][H.CKPT] == 0  # a run that never saves stages nothing
    # engines on GPUs of their own: node 0 trains (nothing to offload), node 1 holds the engine ranks only
    _, plan = plan_of("cluster.colocate=false", "cluster.rollout_gpus=8", "rollout.tp_size=8", "rollout.ep_size=8")
    n0, n1 = plan.host.nodes
    assert n0[H.STATES] == 0 and n0[H.TRAINER] == 8 * int(H.TRAINER_PROCESS_GB * GiB) and n0[H.ENGINE] == 0
    assert n1 == {**dict.fromkeys(H.ITEMS, 0), H.ENGINE: 8 * int(H.ENGINE_PROCESS_GB * GiB)}
    _, plan = plan_of("rollout.engine=embedded")  # samples on the trainer's shards: nothing offloaded
    assert plan.host.nodes[0][H.STATES] == plan.host.nodes[0][H.ENGINE] == 0


def test_a_node_over_its_ram_is_refused_after_the_gpu_checks():
    _, ok = plan_of()
    need = ok.host.total(0)
    with pytest.raises(H.HostPlanError) as e:
        plan_of(f"cluster.host_memory_gb={(need - 10 * GiB) / GiB}")
    assert isinstance(e.value, MemoryPlanError) and e.value.shortfall == pytest.approx(10 * GiB, abs=2)
    assert "host memory plan refused: node 0 is short by 10.00 GiB" in str(e.value)
    assert "largest: trainer states, pinned" in str(e.value) and "OVER" in e.value.plan.table()
    with pytest.raises(MemoryPlanError) as e:  # both short: the GPU refusal is the one raised
        plan_of("cluster.host_memory_gb=10", "memory.gpu_memory_gb=24", capacity=None)
    assert not isinstance(e.value, H.HostPlanError) and "phase 'train'" in str(e.value)
    assert e.value.plan.host is not None  # its table still shows the host side


def test_node_ram_from_the_config_this_node_or_not_checked(tmp_path, monkeypatch):
    from mcore_rl.memory import gpus

    assert H.node_ram(512.0) == (512 * GiB, "cluster.host_memory_gb")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       2113470148 kB\nMemFree:        1000 kB\n")
    monkeypatch.setattr(gpus, "all_gpus", lambda: [])  # planning on a machine without the run's GPUs
    assert H.node_ram(None, str(meminfo)) == (None, H.NOT_GIVEN)
    monkeypatch.setattr(gpus, "all_gpus", lambda: ["a GPU"])  # on a node of the run
    assert H.node_ram(None, str(meminfo))[0] == 2113470148 * 1024
    plan = H.make_host_plan(HFModel.from_dict(load_config(MOONLIGHT_YAML).model.hf_config),
                            PlanInputs(capacity=CAP, world=8, ep=8), H.HostInputs(nnodes=1, gpus_per_node=8))
    assert H.NOT_GIVEN in plan.table() and plan.shortfall == 0  # not given: shown, never refused


def test_config_keys_are_validated():
    for bad, says in (("cluster.host_memory_gb=0", "cluster.host_memory_gb must be > 0 or null"),
                      ("memory.host_engine_process_gb=-1", "memory.host_engine_process_gb must be >= 0")):
        with pytest.raises(ConfigError, match=says):
            load_config(MOONLIGHT_YAML, [bad])


def run(module, *args):
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", module, "--config", MOONLIGHT_YAML, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_prints_the_host_table_and_refuses_a_small_node():
    ok = run("mcore_rl.memory.plan")
    assert ok.returncode == 0, ok.stderr
    table = ok.stdout[ok.stdout.index("host memory per node (RAM from cluster.host_memory_gb"):]
    assert "trainer states, pinned" in table and "node RAM" in table and "OVER" not in table
    assert ok.stdout.index("engine kv cache") < ok.stdout.index("host memory per node")  # after the GPU table
    small = run("mcore_rl.memory.plan", "cluster.host_memory_gb=100")
    assert small.returncode == 1, small.stderr
    err = small.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("host memory plan refused: node 0 is short by"), small.stderr
    assert "GiB RAM; largest: trainer states, pinned" in err[0] and "OVER" in small.stdout
    # a dry run reads the data files as the run would; the config's gsm8k files are not made here
    dry = run("mcore_rl.train", "--dry-run", "cluster.host_memory_gb=100", "data.train_files=[]", "data.val_files=[]",
              "data.task=copy_last")
    assert dry.returncode == 1, dry.stderr  # a dry run exits as the run would: the plan is refused
    assert "memory plan REFUSED: host memory plan refused: node 0 is short by" in dry.stdout
