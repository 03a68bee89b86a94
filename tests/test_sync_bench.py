"""benchmarks/sync_bench.py at tiny size on CPU: the GPU benchmark's code path (plan, flattened
buckets with double buffering, receivers placing tensors in SGLang layout, digest check) runs
end to end here, with shared-memory handles instead of CUDA IPC."""

from __future__ import annotations

import json

from benchmarks import sync_bench


def test_tiny_cpu_sync_bench(tmp_path):
    out = tmp_path / "sync.json"
    r = sync_bench.main(["--cpu", "--tiny", "--gpus", "2", "--bucket-mb", "0.05", "--repeats", "2",
                         "--out", str(out)])
    assert r["weights_equal"] and r["buckets"] > 3 and len(r["seconds_all"]) == 2
    assert json.loads(out.read_text())["bytes_total"] == r["bytes_total"] > 0


def test_sglang_layout_shapes_for_moonlight():
    plan = sync_bench.make_plan(sync_bench.MOONLIGHT, 4, 512 << 20)
    params = sync_bench.engine_params(plan, 1, "meta")
    L = "model.layers.3."
    assert tuple(params[L + "mlp.experts.w13_weight"].shape) == (16, 2 * 1408, 2048)
    assert tuple(params[L + "mlp.experts.w2_weight"].shape) == (16, 2048, 1408)
    assert tuple(params[L + "mlp.shared_experts.gate_up_proj.weight"].shape) == (2 * 2 * 1408 // 4, 2048)
    assert tuple(params["model.layers.0.mlp.gate_up_proj.weight"].shape) == (2 * 11264 // 4, 2048)
    assert tuple(params["model.embed_tokens.weight"].shape) == (163840 // 4, 2048)
    assert tuple(params[L + "self_attn.o_proj.weight"].shape) == (2048, 16 * 128 // 4)
