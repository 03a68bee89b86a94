"""SGLang's own model, loader and weight-sync classes as an independent reference in tests.

SGLang is installed in the main venv by scripts/setup.sh, at a version listed in
`mcore_rl.rollout.sglang_cpu.TESTED`. On CPU it needs that module's stand-ins for sgl_kernel and
torchvision, installed before any SGLang import; the torchvision stand-in must not reach a process
that only runs transformers, so the pytest process never imports SGLang: `available()` only looks
at the installed package, and `sglang_module()` (which installs the stand-ins) is for the spawned
worker processes of a test.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util


def available() -> str | None:
    """None when the installed SGLang is one the CPU stand-ins were checked with, else the reason.
    Does not import SGLang."""
    from mcore_rl.rollout.sglang_cpu import TESTED

    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed in this venv (scripts/setup.sh installs it)"
    found = importlib.metadata.version("sglang")
    if found not in TESTED:
        return f"sglang {found} is installed; the CPU stand-ins were checked with {', '.join(TESTED)}"
    return None


def sglang_module(name: str):
    """Import an SGLang module in this process, with the CPU stand-ins installed first."""
    from mcore_rl.rollout import sglang_cpu

    sglang_cpu.install()
    return importlib.import_module(name)


def init_sglang_parallel(rank: int, world: int, tp: int, ep: int, model_path: str, dp: int = 1) -> None:
    """SGLang's model-parallel groups on the already initialised gloo world, as its scheduler builds
    them (sglang.srt.distributed.bootstrap): the config published under the "test" role, then the
    world group and the TP/EP groups at the given widths; `dp` > 1: DP attention over that many ranks
    with the engine arguments a run gives it (mcore_rl.rollout.sglang.dp_attention_args)."""
    publish = sglang_module("sglang.srt.runtime_context").publish
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.runtime_context import reset_context
    from sglang.srt.server_args import ServerArgs

    from mcore_rl.rollout.sglang import dp_attention_args

    reset_context()
    args = ServerArgs(model_path=model_path, tp_size=tp, ep_size=ep, device="cpu", **dp_attention_args(dp))
    publish(args, role="test")
    init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo")
    initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                              attention_data_parallel_size=dp, backend="gloo")
    if dp > 1:
        initialize_dp_attention(args, ModelConfig(model_path, dtype="float32"))


def build_model(hf_dir: str):
    """SGLang's own model class for the checkpoint in `hf_dir`, on CPU, weights uninitialised; with
    FP8 layers (SGLang's Fp8Config) where the config has an FP8 quantization_config."""
    import torch
    from transformers import AutoConfig

    from mcore_rl.rollout.model_files import HUB_DEFAULTS

    cfg = AutoConfig.from_pretrained(hf_dir)
    for k, v in HUB_DEFAULTS.get(cfg.model_type, {}).items():
        if not hasattr(cfg, k):
            setattr(cfg, k, v)
    if cfg.model_type.startswith("deepseek"):
        cls = sglang_module("sglang.srt.models.deepseek_v2").DeepseekV2ForCausalLM
    elif cfg.model_type == "qwen2":
        cls = sglang_module("sglang.srt.models.qwen2").Qwen2ForCausalLM
    elif cfg.model_type == "qwen3_moe":
        cls = sglang_module("sglang.srt.models.qwen3_moe").Qwen3MoeForCausalLM
    elif cfg.model_type == "glm4_moe":
        cls = sglang_module("sglang.srt.models.glm4_moe").Glm4MoeForCausalLM
    else:
        raise ValueError(f"no SGLang reference class wired for {cfg.model_type}")
    quant = getattr(cfg, "quantization_config", None)
    if quant:
        quant = sglang_module("sglang.srt.layers.quantization.fp8").Fp8Config.from_config(quant)
    # as SGLang's loader does before it builds a model: decide whether the shared experts are fused
    # into the routed ones (on CPU, DeepSeek's and GLM's gates say no, as in the real engine)
    sglang_module("sglang.srt.layers.moe.utils").install_shared_experts_fusion_decision(cls, cfg, quant)
    with torch.device("cpu"):
        return cls(cfg, quant_config=quant) if quant else cls(cfg)
