"""SGLang 0.5.23's own model, loader and weight-sync classes as an independent reference in tests.

SGLang cannot live in the main venv (it pins torch 2.14.1 and transformers 5.19), so unless
`import sglang` already works, the pinned wheel and the light modules its model code imports are
installed on the side by tests/side_install.py (environment variables and the fail-by-default
policy are described there; <NAME> is SGLANG). `python -m tests.sglang_reference` installs and
imports up front, exiting non-zero on failure.

torchvision is left out on purpose: PyPI's wheel is a CUDA build that cannot load beside CPU
torch ("operator torchvision::nms does not exist"). Only SGLang's multimodal processors use it,
at import time; a stand-in module that fails on any use satisfies those imports, after
transformers has cached "torchvision is not available".
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import types

from tests.side_install import SideInstall

SGLANG_VERSION = "0.5.23"
# what sglang.srt.models.{deepseek_v2,qwen2} import beyond the main venv (found by importing)
SIDE = SideInstall("sglang", SGLANG_VERSION, (
    f"sglang=={SGLANG_VERSION}", "triton==3.9.0", "orjson==3.13.0", "pybase64==1.5.1",
    "starlette==1.10.0", "msgspec==0.22.0", "pyzmq==27.3.0", "ipython==9.18.1",
    "traitlets==5.16.1", "dill==0.4.1", "apache-tvm-ffi==0.1.15.post2", "sentencepiece==0.2.3",
    "einops==0.8.2", "compressed-tensors==0.20.0", "loguru==0.7.3", "gguf==0.19.0",
    "openai==3.54.0", "sniffio==1.3.1", "partial-json-parser==0.2.1.1.post7",
    "uvicorn==0.54.0", "fastapi==0.165.0"), probe="sglang.srt")
ABSENT = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
          "torchvision.transforms.v2", "torchvision.transforms.v2.functional")
# fields DeepSeek-V3 hub configs carry that transformers' DeepseekV3Config no longer writes
HUB_DEFAULTS = {"deepseek_v3": dict(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid"),
                "deepseek_v2": dict(moe_layer_freq=1, topk_method="greedy", scoring_func="softmax")}


class _Absent(types.ModuleType):
    """A module that exists for `import` statements and fails on first real use."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{self.__name__}.{name}")

    def __call__(self, *a, **kw):
        raise RuntimeError(f"{self.__name__} is not installed in the SGLang reference environment")


def _stand_in_torchvision():
    from transformers.utils import import_utils

    if import_utils.is_torchvision_available():
        return  # a working torchvision is installed: use it
    for name in ABSENT:
        if name not in sys.modules:
            mod = _Absent(name)
            mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
            mod.__path__ = []
            sys.modules[name] = mod


def _cpu_ready_sglang():
    _stand_in_torchvision()
    importlib.import_module("sglang.srt.layers.rotary_embedding.base")._is_cpu = True  # as its CPU layer tests


def _import(module: str):
    return SIDE.load(module, prepare=_cpu_ready_sglang)


REFERENCE_MODULES = ("sglang.srt.models.deepseek_v2", "sglang.srt.models.qwen2",
                     "sglang.srt.weight_sync.tensor_bucket")


def sglang_module(module: str):
    """Import an SGLang module (installing SGLang on the side if needed), or fail the calling test
    (skip it under MCORE_RL_NO_SIDE_INSTALL=1)."""
    return SIDE.require(module, prepare=_cpu_ready_sglang)


def available() -> str | None:
    """None when SGLang imports, else the reason (for code outside a test function)."""
    for name in REFERENCE_MODULES:
        mod, reason = _import(name)
        if mod is None:
            return reason
    return None


def init_sglang_parallel(rank: int, world: int, tp: int, ep: int, model_path: str) -> None:
    """SGLang's model-parallel groups on the already initialised gloo world (as its CPU layer
    tests do, without sglang.test.test_utils, which needs the benchmark datasets)."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (init_distributed_environment,
                                                       initialize_model_parallel)
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    os.environ.setdefault("LOCAL_RANK", str(rank))
    init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo")
    reset_context()
    publish(ServerArgs(model_path=model_path, tp_size=tp, ep_size=ep, device="cpu"), role="test",
            ranks=SpawnRanks(world_rank=rank))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")


def build_model(hf_dir: str):
    """SGLang's own model class for the checkpoint in `hf_dir`, on CPU, weights uninitialised."""
    import torch
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_dir)
    for k, v in HUB_DEFAULTS.get(cfg.model_type, {}).items():
        if not hasattr(cfg, k):
            setattr(cfg, k, v)
    if cfg.model_type.startswith("deepseek"):
        cls = sglang_module("sglang.srt.models.deepseek_v2").DeepseekV2ForCausalLM
    elif cfg.model_type == "qwen2":
        cls = sglang_module("sglang.srt.models.qwen2").Qwen2ForCausalLM
    else:
        raise ValueError(f"no SGLang reference class wired for {cfg.model_type}")
    with torch.device("cpu"):
        return cls(cfg)


if __name__ == "__main__":
    SIDE.main(REFERENCE_MODULES, prepare=_cpu_ready_sglang)
