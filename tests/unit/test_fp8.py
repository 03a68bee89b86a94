"""Block FP8 quantization (mcore_rl.sync.fp8) against DeepSeek-V3's reference math, bit for bit.

The reference below is written block by block from DeepSeek-V3's `weight_quant` kernel
(inference/kernel.py): per 128 x 128 block (partial at the edges) s = max|x| / 448 in fp32 and
q = (x / s) cast to e4m3. SGLang ships no quantizer with these scales (its per_block_cast_to_fp8
is DeepGEMM's power-of-two variant); its dequantization is compared in tests/e2e/test_sglang_sync.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from mcore_rl.convert.hf_io import dequantize_fp8
from mcore_rl.sync import fp8


def deepseek_reference(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x.shape
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-m // block), -(-n // block), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = x[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            s[i, j] = tile.abs().max() / 448.0
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def _weight(shape, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g)
    rows = torch.logspace(-4, 2, shape[0])[torch.randperm(shape[0], generator=g)]
    return (w * rows[:, None]).to(dtype)  # blocks of very different magnitudes


@pytest.mark.parametrize("shape", [(1, 1), (128, 128), (129, 257), (300, 77), (576, 64), (256, 384)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantization_is_deepseeks_reference_bit_for_bit(shape, dtype):
    w = _weight(shape, seed=sum(shape), dtype=dtype)
    q, s = fp8.quantize(w)
    ref_q, ref_s = deepseek_reference(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == fp8.scale_shape(shape) == ref_s.shape
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(s.view(torch.int32), ref_s.view(torch.int32))
    # each block's largest magnitude lands on e4m3's largest finite value, and nothing is NaN
    assert q.float().abs().max().item() == 448.0 and not q.float().isnan().any()
    back = fp8.dequantize(q, s)
    assert torch.equal(dequantize_fp8(q, s, fp8.BLOCK), back.to(torch.bfloat16))  # the converter's import
    assert ((back - w.float()).abs() <= w.float().abs() * 2 ** -4 + s.max() * 2 ** -9).all()


def test_an_all_zero_block_dequantizes_to_zeros_not_nan():
    w = _weight((256, 200), seed=1)
    w[:128, 128:] = 0  # where DeepSeek's reference divides 0 by 0
    q, s = fp8.quantize(w)
    assert s[0, 1].item() == 1.0 and not q.float().isnan().any()
    assert torch.equal(fp8.dequantize(q, s)[:128, 128:], torch.zeros(128, 72))
    ref_q, ref_s = deepseek_reference(w)
    mask = torch.ones_like(q, dtype=torch.bool)
    mask[:128, 128:] = False
    assert torch.equal(q.view(torch.uint8)[mask], ref_q.view(torch.uint8)[mask])


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _hf_of(config: str, overrides=()):
    from mcore_rl.config.checks import hf_model_dims
    from mcore_rl.config.sections import load_config
    from mcore_rl.models.config import HFModel

    return HFModel.from_dict(hf_model_dims(load_config(os.path.join(ROOT, "configs", config), list(overrides)).model))


def test_linear_layers_not_whole_fp8_blocks_per_engine_rank_stay_in_the_model_dtype():
    """Moonlight's shared experts (2 x 1408 rows) over engine TP 4 are 704 rows a rank: SGLang's
    block-FP8 linear refuses them, so the engine keeps them in bf16, listed as an FP8 checkpoint
    lists the layers it leaves unquantized; everything else still runs in FP8."""
    from mcore_rl.sync.engine_layout import (EngineLayout, fp8_ignored_layers, fp8_kept_line,
                                             fp8_quantization_config, runs_in_fp8)

    moonlight, tp4 = _hf_of("moonlight_16b.yaml"), EngineLayout(4, 4, 1, 4)
    shared = sorted(f"model.layers.{i}.mlp.shared_experts.{x}" for i in range(1, 27)
                    for x in ("gate_proj", "up_proj", "down_proj"))
    kept = fp8_ignored_layers(moonlight, tp4)
    assert sorted(kept) == shared
    assert kept["model.layers.26.mlp.shared_experts.up_proj"] == \
        "model.layers.26.mlp.shared_experts.gate_proj.weight has 704 rows per engine rank"
    assert kept["model.layers.26.mlp.shared_experts.down_proj"] == \
        "model.layers.26.mlp.shared_experts.down_proj.weight has 704 columns per engine rank"
    assert fp8_quantization_config(moonlight, tp4) == {**fp8.QUANTIZATION_CONFIG, "ignored_layers": shared}
    assert fp8_kept_line(moonlight, tp4) == (
        "rollout.weight_dtype=fp8 at engine tp_size=4 ep_size=4: 78 linear modules stay in the model's dtype, their "
        "slices per rank not whole 128 x 128 blocks (model.layers.1.mlp.shared_experts.gate_proj.weight has 704 rows "
        "per engine rank; model.layers.1.mlp.shared_experts.down_proj.weight has 704 columns per engine rank; ...)")
    assert not runs_in_fp8("model.layers.3.mlp.shared_experts.up_proj.weight", moonlight, tp4)
    for name in ("model.layers.3.mlp.experts.63.down_proj.weight", "model.layers.3.self_attn.q_proj.weight",
                 "model.layers.3.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.mlp.gate_proj.weight"):
        assert runs_in_fp8(name, moonlight, tp4), name
    # TP 2 without EP: the routed experts' 1408 rows are 704 a rank; a layer's experts are one module
    kept = fp8_ignored_layers(moonlight, EngineLayout(2, 1, 1, 2))
    assert sorted(kept) == sorted(f"model.layers.{i}.mlp.experts" for i in range(1, 27))
    assert not any(runs_in_fp8(f"model.layers.5.mlp.experts.7.{x}.weight", moonlight, EngineLayout(2, 1, 1, 2))
                   for x in ("gate_proj", "up_proj", "down_proj"))
    # where every shard is whole blocks the engine's config is an FP8 checkpoint's as it is
    for layout in (EngineLayout(1, 1, 1, 1), EngineLayout(2, 2, 1, 2)):
        assert fp8_ignored_layers(moonlight, layout) == {}
        assert fp8_quantization_config(moonlight, layout) == fp8.QUANTIZATION_CONFIG
        assert fp8_kept_line(moonlight, layout).endswith(f"ep_size={layout.ep_size}: every linear layer runs in FP8")
    # one module, one precision: kv_a_proj_with_mqa fits alone but shares fused_qkv_a_proj_with_mqa
    # with a q_a_proj of 32 rows; a shared expert's down_proj (no split at TP 1) is a module of its own
    tiny = _hf_of("tiny_cpu.yaml")
    assert sorted(fp8_ignored_layers(tiny, EngineLayout(1, 1, 1, 1))) == sorted(
        [f"model.layers.{i}.self_attn.{x}" for i in (0, 1) for x in ("q_a_proj", "kv_a_proj_with_mqa")]
        + ["model.layers.1.mlp.experts", "model.layers.1.mlp.shared_experts.gate_proj",
           "model.layers.1.mlp.shared_experts.up_proj"])


def test_sync_plan_and_memory_plan_hold_the_same_layers_in_fp8_as_the_engine_config():
    """The sync sends what the engine keeps in the model's dtype as it is, with no scale, and the
    memory planner counts it at that size: the same rule for all three."""
    from mcore_rl.memory.layout import engine_tensors, inventory
    from mcore_rl.parallel.groups import Layout
    from mcore_rl.sync.engine_layout import EngineLayout, engine_param, fp8_ignored_layers
    from mcore_rl.sync.plan import SyncPlan

    tiny, layout = _hf_of("tiny_cpu.yaml"), EngineLayout(1, 1, 1, 1)
    plan = SyncPlan.build(tiny, Layout(ep=2), 2, layout, {0: 0, 1: 0}, 1 << 20, torch.float32, weight_dtype="fp8")
    plan.check_complete()
    engine = engine_tensors(tiny, inventory(tiny), tp=1, ep=1, dtype=torch.float32, weight_dtype="fp8")
    kept = fp8_ignored_layers(tiny, layout)
    linear = [n for n in plan.tensors if n.endswith("_proj.weight") or n.endswith("_with_mqa.weight")]
    for name in linear:
        module = name.split(".mlp.experts.")[0] + ".mlp.experts" if ".mlp.experts." in name else name[:-len(".weight")]
        in_fp8 = module not in kept
        assert (plan.tensors[name].dtype == fp8.E4M3) == in_fp8, name
        assert (fp8.scale_name(name) in plan.tensors) == in_fp8, name
        assert engine[engine_param(name, tiny)[0]].dtype == (fp8.E4M3 if in_fp8 else torch.float32), name
    assert {n for n in linear if plan.tensors[n].dtype == fp8.E4M3} and len(kept) == 7


def test_an_fp8_engine_starts_from_an_fp8_checkpoints_config(tmp_path):
    import json

    from mcore_rl.config.sections import load_config
    from mcore_rl.models.config import HFModel
    from mcore_rl.rollout.sglang import engine_args, engine_env, engine_model_dir
    from mcore_rl.sync.engine_layout import EngineLayout, fp8_ignored_layers

    cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), ["cluster.device=gpu", "rollout.weight_dtype=fp8",
                      "model.hf_config.moe_intermediate_size=128", "model.hf_config.q_lora_rank=128"])
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(cfg.model.hf_config))
    out = engine_model_dir(str(hf), str(tmp_path / "engine"), [1], "cpu", "fp8", layout=EngineLayout(1, 1, 1, 1))
    written = json.loads((tmp_path / "engine" / "config.json").read_text())
    assert written["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                              "weight_block_size": [128, 128]}
    # at TP 2 the tiny widths are 64 rows a rank: those linears stay in the model's dtype, as the
    # sync sends them (fp8_ignored_layers, the rule of the test above)
    engine_model_dir(str(hf), str(tmp_path / "tp2"), [1], "cpu", "fp8", layout=EngineLayout(2, 2, 1, 2))
    ignored = json.loads((tmp_path / "tp2" / "config.json").read_text())["quantization_config"]["ignored_layers"]
    assert ignored == sorted(fp8_ignored_layers(HFModel.from_dict(cfg.model.hf_config), EngineLayout(2, 2, 1, 2)))
    assert "model.layers.1.mlp.shared_experts.gate_proj" in ignored and "model.layers.1.mlp.experts" not in ignored
    with pytest.raises(ValueError, match="depends on the engine layout"):
        engine_model_dir(str(hf), str(tmp_path / "unknown"), [1], "cpu", "fp8")
    args = engine_args(cfg, out, EngineLayout(1, 1, 1, 1), 0, None, 0.5)
    assert args["load_format"] == "dummy"  # every weight comes from the first (read-back) sync
    assert engine_env(cfg, EngineLayout(1, 1, 1, 1))["SGLANG_ENABLE_JIT_DEEPGEMM"] == "0"
    assert "moe_runner_backend" not in args  # SGLang's auto: triton without DeepEP
    for kernels, moe in (("deep_gemm", None), ("deep_gemm_moe", "deep_gemm")):
        cfg.rollout.fp8_kernels = kernels
        assert engine_args(cfg, out, EngineLayout(1, 1, 1, 1), 0, None, 0.5).get("moe_runner_backend") == moe
        env = engine_env(cfg, EngineLayout(1, 1, 1, 1))
        assert (env["SGLANG_ENABLE_JIT_DEEPGEMM"], env["SGLANG_JIT_DEEPGEMM_PRECOMPILE"]) == ("1", "0")
    plain = engine_model_dir(str(hf), str(tmp_path / "plain"), [1], "cpu")
    assert "quantization_config" not in json.loads(open(os.path.join(plain, "config.json")).read())


def test_an_engine_asked_for_deep_gemm_without_it_is_an_error_not_triton():
    """SGLang runs triton's FP8 kernels wherever `import deep_gemm` fails: fp8_kernels=deep_gemm on
    such a node must stop the engine's start, not quietly measure triton."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("deep_gemm") is not None:
        pytest.skip("deep_gemm is installed here")
    code = ("from mcore_rl.rollout.sglang import SGLangServer\n"
            "SGLangServer('gpu', env={'SGLANG_ENABLE_JIT_DEEPGEMM': '1'})")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "EngineError: rollout.fp8_kernels asks for DeepGEMM, which this node's Python lacks" in p.stderr
