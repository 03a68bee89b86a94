"""benchmarks/actor_bench.py at tiny size on CPU (gloo, EP=2): MegatronActor.update on an RL-like
batch per run, the planner beside it, a profile breakdown; and the breakdown's GPU views
(actor_bench's) on a hand-written trace whose answer is known."""

from __future__ import annotations

import json

import pytest

from benchmarks import actor_bench
from tests.support import distributed

TINY = ["--cpu", "--tiny", "--gpus", "2", "--prompt", "2", "8", "--response", "1", "6", "--budget", "24",
        "--micro-batches", "3", "--steps", "1"]


def test_runs_profile_and_plan_on_cpu(tmp_path):
    out = tmp_path / "actor.json"
    assert actor_bench.main(TINY + ["--runs", "baseline,optimized,recompute_full", "--profile",
                                    "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert list(r["runs"]) == ["baseline", "optimized", "recompute_full"]
    for name, run in r["runs"].items():
        assert run["tflops_per_gpu"] > 0 and run["micro_batches"] >= 2 and len(run["ranks"]) == 2
        assert run["micro_tokens_max"] <= 24 and run["ranks"][0]["planner"]["peak_gib"] > 0
    base, fast = r["runs"]["baseline"], r["runs"]["optimized"]
    assert base["patches_skipped"] == ["rope_thd_no_sync", "grad_norm_no_sync"] and not fast["patches_skipped"]
    phases = fast["profile"]["phases_host_ms"]
    assert {"forward", "backward", "loss head", "optimizer step", "pack + unpack"} <= set(phases)
    # the two megatron patches read no device value on the host: the baseline reads more
    reads = "aten::_local_scalar_dense"
    assert base["profile"]["host_reads"][reads] > fast["profile"]["host_reads"][reads]
    assert "profile" not in r["runs"]["recompute_full"]  # memory runs are not profiled
    assert (r["runs"]["recompute_full"]["ranks"][0]["planner"]["activations_gib"]
            < fast["ranks"][0]["planner"]["activations_gib"])


def test_bad_arguments_are_refused_before_work():
    with pytest.raises(SystemExit):
        actor_bench.parse(TINY + ["--runs", "nosuchrun"])
    with pytest.raises(SystemExit):  # a sample longer than the token budget
        actor_bench.parse(TINY[:-6] + ["--budget", "8", "--steps", "1"])


def _x(name, cat, ts, dur, **args):
    return dict(ph="X", name=name, cat=cat, ts=ts, dur=dur, pid=1, tid=1, args=args)


def test_breakdown_of_a_known_trace():
    """One step 0..100 us: a forward range launching a GEMM and an attention kernel, a backward node
    launching a grouped GEMM and an NCCL reduce-scatter that overlaps it half, the optimizer step
    launching a Triton kernel, one stream sync; the GPU idles 100 - 70 = 30 us."""
    ev = [
        _x("bench/step", "user_annotation", 0, 100),
        _x("model/forward", "user_annotation", 1, 20),
        _x("cudaLaunchKernel", "cuda_runtime", 2, 1, correlation=1),
        _x("cudaLaunchKernel", "cuda_runtime", 3, 1, correlation=2),
        _x("autograd::engine::evaluate_function: MmBackward0", "cpu_op", 30, 20),
        _x("cudaLaunchKernel", "cuda_runtime", 31, 1, correlation=3),
        _x("ncclLaunch", "cuda_runtime", 32, 1, correlation=4),
        _x("optim/step", "user_annotation", 60, 30),
        _x("cudaLaunchKernel", "cuda_runtime", 61, 1, correlation=5),
        _x("cudaStreamSynchronize", "cuda_runtime", 70, 15),
        _x("aten::_local_scalar_dense", "cpu_op", 69, 16),
        _x("sm90_xmma_gemm_bf16", "kernel", 5, 20, correlation=1),
        _x("cudnn_sdpa_fwd", "kernel", 25, 10, correlation=2),
        _x("cutlass_grouped_gemm", "kernel", 40, 20, correlation=3),
        _x("ncclDevKernel_ReduceScatter_Sum_f32", "kernel", 50, 20, correlation=4),
        _x("triton_poi_fused_adam", "kernel", 80, 10, correlation=5),
    ]
    b = actor_bench.breakdown({"traceEvents": ev})
    assert b["kernels"] == 5 and b["wall_ms"] == pytest.approx(0.1)
    assert b["phases_gpu_ms"] == pytest.approx({"forward": 0.030, "backward": 0.040, "optimizer step": 0.010})
    assert b["kernel_kinds_ms"] == pytest.approx({"dense GEMM": 0.020, "attention": 0.010, "NCCL reduce-scatter": 0.020,
                                                  "grouped GEMM (experts)": 0.020, "compiled (Triton)": 0.010})
    assert b["gpu_busy_ms"] == pytest.approx(0.070) and b["gpu_idle_ms"] == pytest.approx(0.030)
    assert b["nccl_ms"] == pytest.approx(0.020) and b["nccl_exposed_ms"] == pytest.approx(0.010)
    assert b["host_syncs"]["cudaStreamSynchronize"]["count"] == 1 and b["host_sync_calls"] == 1
    assert b["host_reads"]["aten::_local_scalar_dense"] == 1
    assert "NCCL reduce-scatter" in actor_bench.breakdown_table(b)


def test_gpu_attention_check_runs_on_cpu(tmp_path):
    """tests/gpu/gpu_checks.py's comparison (fp32 reference, per-sequence SDPA, varlen) at tiny
    size on CPU, where the varlen class falls back to per-sequence SDPA: equal to it, the check passes."""
    distributed.run(_attention_check_cpu, 1, str(tmp_path))
    res = json.loads((tmp_path / "check.json").read_text())
    assert res["ok"] and res["varlen_grads"] == res["sdpa_grads"] > 10
    assert res["varlen_logits_err"] == res["sdpa_logits_err"] < 2e-2


def _attention_check_cpu(rank, out):
    from tests.gpu import gpu_checks
    from benchmarks.harness import hf_config
    from mcore_rl.parallel.groups import Layout, init_distributed

    init_distributed(Layout())
    res = gpu_checks.attention_check(hf_config("tiny_cpu.yaml"), lengths=(7, 3, 5), device="cpu")
    with open(f"{out}/check.json", "w") as f:
        json.dump(res, f)
