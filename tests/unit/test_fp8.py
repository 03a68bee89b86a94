"""Block FP8 quantization (mcore_rl.sync.fp8) against DeepSeek-V3's reference math, bit for bit.

The reference below is written block by block from DeepSeek-V3's `weight_quant` kernel
(inference/kernel.py): per 128 x 128 block (partial at the edges) s = max|x| / 448 in fp32 and
q = (x / s) cast to e4m3. SGLang ships no quantizer with these scales (its per_block_cast_to_fp8
is DeepGEMM's power-of-two variant); its dequantization is compared in tests/e2e/test_sglang_sync.py.
"""

from __future__ import annotations

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


def test_an_fp8_engine_starts_from_an_fp8_checkpoints_config(tmp_path):
    import json
    import os

    from mcore_rl.config.sections import load_config
    from mcore_rl.rollout.sglang import engine_args, engine_env, engine_model_dir
    from mcore_rl.sync.engine_layout import EngineLayout

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_config(os.path.join(root, "configs", "tiny_cpu.yaml"), ["cluster.device=gpu", "rollout.weight_dtype=fp8",
                      "model.hf_config.moe_intermediate_size=128", "model.hf_config.q_lora_rank=128"])
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(cfg.model.hf_config))
    out = engine_model_dir(str(hf), str(tmp_path / "engine"), [1], "cpu", "fp8")
    written = json.loads((tmp_path / "engine" / "config.json").read_text())
    assert written["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                              "weight_block_size": [128, 128]}
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
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("deep_gemm") is not None:
        pytest.skip("deep_gemm is installed here")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("from mcore_rl.rollout.sglang import SGLangServer\n"
            "SGLangServer('gpu', env={'SGLANG_ENABLE_JIT_DEEPGEMM': '1'})")
    p = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "EngineError: rollout.fp8_kernels asks for DeepGEMM, which this node's Python lacks" in p.stderr
