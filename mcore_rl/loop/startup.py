"""What a run prepares before its first step: the memory plan, Ray, the policy's HF directory,
and a checkpoint to resume from."""

from __future__ import annotations

import logging
import os
import shutil

import ray
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from mcore_rl.config import sections as C
from mcore_rl.checkpoint import steps as run_ckpt
from mcore_rl.loop.groups import ActorGroup
from mcore_rl.memory.plan import apply_choice, plan_for_config, settle_without_plan
from mcore_rl.rollout.model_files import DTYPE_NAMES


def prepare_model(cfg: C.Config, run_dir: str) -> str:
    """An HF directory for the policy: the given one, or the embedded config's, written once. The
    latter holds the config only: the trainer starts from megatron's seeded init, built on its
    device, and the engines build theirs without reading weights (a dummy load) and get the
    trainer's from the first sync. (A whole random model built on the host, as transformers'
    from_config does, took 2.5 minutes and 63 GB at Moonlight's size, for weights no one read.)"""
    if cfg.model.hf_path:
        return cfg.model.hf_path
    hf_dir = os.path.join(run_dir, "init_hf")
    if not os.path.exists(os.path.join(hf_dir, "config.json")):
        hcfg = transformers.AutoConfig.for_model(**cfg.model.hf_config)
        # what save_pretrained of the model would record: the engines pick their model class by it
        hcfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hcfg.model_type]]
        hcfg.dtype = getattr(torch, DTYPE_NAMES[cfg.model.dtype])  # the weights' dtype, as the run has them
        shutil.rmtree(hf_dir + ".tmp", ignore_errors=True)
        hcfg.save_pretrained(hf_dir + ".tmp")
        os.replace(hf_dir + ".tmp", hf_dir)
    return hf_dir


def memory_plan(cfg: C.Config):
    """The memory plan of a GPU run (None on CPU), made before anything takes GPU memory, so that
    its capacity is the GPUs' free memory; a plan that cannot fit raises MemoryPlanError here. The
    config's "auto" budget and recompute become the plan's picks (on CPU, their defaults)."""
    if cfg.cluster.device != "gpu":
        settle_without_plan(cfg)
        return None
    plan, source = plan_for_config(cfg)
    apply_choice(cfg, plan)  # the micro-batch budget and recompute the plan picked, where the config says auto
    print(f"memory plan per GPU (capacity from {source}):\n{plan.table()}", flush=True)
    return plan


def _not_ray_auth_notice(record) -> bool:
    """Ray logs at WARNING level that a new local cluster uses token authentication, its default and
    nothing to act on; the opposite notice (authentication off) still shows."""
    return "Token authentication is enabled" not in record.getMessage()


def _quiet_ray_auth_notice() -> None:
    # addFilter keeps one copy of a filter however often a process starts Ray
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(_not_ray_auth_notice)


def start_ray(cfg: C.Config) -> None:
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):  # a submitted job: join the cluster as it is
        ray.init(log_to_driver=True)
    else:  # a local run: a private Ray on loopback ("local": never the cluster of a stale address file)
        _quiet_ray_auth_notice()
        ray.init(address="local", num_cpus=max(2, cfg.cluster.nnodes * cfg.cluster.n_gpus_per_node),
                 include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=True)



def load_checkpoint(group: ActorGroup, step_dir: str) -> None:
    """Every rank's models and optimizer states from `step_dir` (saved at any layout)."""
    try:
        group.call("load", step_dir)
    except Exception as e:  # noqa: BLE001 - a Ray error wrapping the rank's: one line naming the checkpoint
        cause = getattr(e, "cause", None) or e
        first = str(cause).splitlines()[0] if str(cause) else ""
        raise run_ckpt.CheckpointError(f"{step_dir}: cannot resume from this checkpoint: "
                                       f"{type(cause).__name__}: {first}") from None
