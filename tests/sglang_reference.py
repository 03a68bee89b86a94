"""SGLang 0.5.23's own model, loader and weight-sync classes as an independent reference in tests.

SGLang cannot live in the main venv (it pins torch 2.14.1 and transformers 5.19), so unless
`import sglang` already works we pip-install the pinned wheel and the light modules its model code
imports, all with --no-deps, into a side directory appended (not prepended) to sys.path.
MCORE_RL_SGLANG_DIR chooses the directory (CI can pre-populate it); MCORE_RL_NO_SGLANG_INSTALL=1
forbids the install and skips instead; MCORE_RL_REQUIRE_SGLANG=1 turns a skip into a failure.
`python -m tests.sglang_reference` installs and imports up front, exiting non-zero on failure.

torchvision is left out on purpose: PyPI's wheel is a CUDA build that cannot load beside CPU
torch ("operator torchvision::nms does not exist"). Only SGLang's multimodal processors use it,
at import time; a stand-in module that fails on any use satisfies those imports, after
transformers has cached "torchvision is not available".
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import os
import shutil
import subprocess
import sys
import tempfile
import types

import pytest

SGLANG_VERSION = "0.5.23"
# what sglang.srt.models.{deepseek_v2,qwen2} import beyond the main venv (found by importing)
SIDE_PACKAGES = [f"sglang=={SGLANG_VERSION}", "triton==3.9.0", "orjson==3.13.0", "pybase64==1.5.1",
                 "starlette==1.10.0", "msgspec==0.22.0", "pyzmq==27.3.0", "ipython==9.18.1",
                 "traitlets==5.16.1", "dill==0.4.1", "apache-tvm-ffi==0.1.15.post2", "sentencepiece==0.2.3",
                 "einops==0.8.2", "compressed-tensors==0.20.0", "loguru==0.7.3", "gguf==0.19.0",
                 "openai==3.54.0", "sniffio==1.3.1", "partial-json-parser==0.2.1.1.post7",
                 "uvicorn==0.54.0", "fastapi==0.165.0"]
ABSENT = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
          "torchvision.transforms.v2", "torchvision.transforms.v2.functional")
# fields DeepSeek-V3 hub configs carry that transformers' DeepseekV3Config no longer writes
HUB_DEFAULTS = {"deepseek_v3": dict(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid"),
                "deepseek_v2": dict(moe_layer_freq=1, topk_method="greedy", scoring_func="softmax")}


def side_dir() -> str:
    return os.environ.get("MCORE_RL_SGLANG_DIR") or os.path.join(tempfile.gettempdir(),
                                                                 f"mcore_rl_sglang_{SGLANG_VERSION}")


def _install(target: str) -> str | None:
    if os.environ.get("MCORE_RL_NO_SGLANG_INSTALL") == "1":
        return "MCORE_RL_NO_SGLANG_INSTALL=1"
    staging = f"{target}.partial-{os.getpid()}"  # renamed into place only when complete
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--target", staging, *SIDE_PACKAGES]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        shutil.rmtree(staging, ignore_errors=True)
        return f"{type(e).__name__}: {e}"
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        return proc.stderr.strip()[-2000:]
    try:
        os.rename(staging, target)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return None


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


@functools.lru_cache(maxsize=None)
def _import(module: str):
    try:
        importlib.import_module("sglang.srt")
    except ImportError:
        target = side_dir()
        if not os.path.isdir(os.path.join(target, "sglang")):
            error = _install(target)
            if error:
                return None, f"could not pip-install sglang=={SGLANG_VERSION} into {target}: {error}"
        if target not in sys.path:
            sys.path.append(target)
    _stand_in_torchvision()
    try:
        mod = importlib.import_module(module)
        importlib.import_module("sglang.srt.layers.rotary_embedding.base")._is_cpu = True
        return mod, None
    except Exception as e:  # noqa: BLE001 - any import failure means "no reference here"
        return None, f"cannot import {module}: {type(e).__name__}: {e}"


REFERENCE_MODULES = ("sglang.srt.models.deepseek_v2", "sglang.srt.models.qwen2",
                     "sglang.srt.weight_sync.tensor_bucket")


def sglang_module(module: str):
    """Import an SGLang module (installing SGLang on the side if needed), or skip the calling test."""
    mod, reason = _import(module)
    if mod is None:
        if os.environ.get("MCORE_RL_REQUIRE_SGLANG") == "1":
            pytest.fail(f"MCORE_RL_REQUIRE_SGLANG=1 but {reason}")
        pytest.skip(reason)
    return mod


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
    import time

    t = time.time()
    reason = available()
    if reason:
        sys.exit(reason)
    print(f"{side_dir()} ready in {time.time() - t:.0f} s")
