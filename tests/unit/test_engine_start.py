"""The engines' start-up as the console shows it (mcore_rl.rollout.engine_start), their per-node compile
cache (jit_cache) and how rollout.engine_kwargs enter their arguments (engine_kwargs). The kwargs
reaching the engines themselves, and unknown keys refused, are proved against SGLang's and vLLM's
CPU engines (tests/e2e/test_rollout_sglang.py, test_rollout_vllm.py; tests/unit/test_cli_errors.py)."""

from __future__ import annotations

import os
import shutil
import subprocess

from mcore_rl.config.sections import load_config
from mcore_rl.rollout import engine_kwargs, engine_start, jit_cache
from mcore_rl.sync.engine_layout import EngineLayout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_GPU = os.path.join(ROOT, "configs", "tiny_gpu.yaml")
TINY_CPU = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
FUSION = "enforce_disable_flashinfer_allreduce_fusion"
TWO = ("cluster.n_gpus_per_node=2", "rollout.tp_size=2", "parallel.ep=2", "actor.micro_batch_size=64")


def test_compile_target_names_what_is_built():
    nvcc = ["/usr/local/cuda/bin/nvcc", "-c", "/root/.cache/flashinfer/0.6/90/generated/trtllm_comm/x.cu",
            "-o", "/root/.cache/flashinfer/0.6/90/cached_ops/trtllm_comm/csrc_trtllm_allreduce_fusion.cuda.o"]
    assert engine_start.compile_target("nvcc", nvcc) == "trtllm_comm/csrc_trtllm_allreduce_fusion.cuda.o"
    assert engine_start.compile_target("ninja", ["ninja", "-v", "-C", "/c/cached_ops/trtllm_comm/"]) \
        == "cached_ops/trtllm_comm"
    assert engine_start.compile_target("ptxas", ["ptxas"]) == "ptxas"
    kernel = ("batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_head_dim_qk_192_head_dim_vo_128_sm90/"
              "batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_head_dim_qk_192_head_dim_vo_128_sm90"
              "_batch_prefill_ragged_sm90_kernel_mask_1.cuda.o")  # flashinfer's, shortened here too
    assert engine_start.compile_target("nvcc", ["nvcc", "-o", "/c/cached_ops/" + kernel]) \
        == "batch_prefill_with_kv_cache_dt..._batch_prefill_ragged_sm90_kernel_mask_1.cuda.o"


def test_latest_phase_reads_the_newest_start_line(tmp_path):
    log = tmp_path / "engine_0_node0.log"
    assert engine_start.latest_phase(str(log)) is None and engine_start.latest_phase(None) is None
    log.write_text(f"noise\n{engine_start.MARK} importing SGLang\nmore noise\n")
    assert engine_start.latest_phase(str(log)) == "importing SGLang"
    with open(log, "a") as f:  # SGLang's own lines, at log level info, count too
        f.write("[2026-11-28 10:00:00 TP0] Load weight begin. avail mem=139.1 GB\n")
    assert engine_start.latest_phase(str(log)) == "loading weights"
    with open(log, "a") as f:
        f.write(f"{engine_start.MARK} compiling trtllm_comm/fusion.cuda.o (nvcc)\n")
    assert engine_start.latest_phase(str(log)) == "compiling trtllm_comm/fusion.cuda.o (nvcc)"


def test_compile_watch_marks_a_compiler_among_its_children(tmp_path, capfd):
    """A child process named nvcc (a copy of sleep) is named while it runs, then its time."""
    fake = tmp_path / "nvcc"
    shutil.copy(shutil.which("sleep"), fake)
    with engine_start.CompileWatch(interval_s=0.2):
        subprocess.run([str(fake), "1.5"], check=True)
        subprocess.run(["sleep", "0.6"], check=True)
    out = capfd.readouterr().out
    assert f"{engine_start.MARK} compiling nvcc (nvcc)" in out, out
    assert f"{engine_start.MARK} compiles done after" in out, out


def test_jit_cache_env_is_one_directory_and_leaves_set_variables(tmp_path):
    env = jit_cache.cache_env("~/jit", environ={"TRITON_CACHE_DIR": "/site/triton"})
    home = os.path.expanduser("~")
    assert "TRITON_CACHE_DIR" not in env  # the site's own wins
    assert env["FLASHINFER_WORKSPACE_BASE"] == os.path.join(home, "jit", "flashinfer")
    assert env["DG_JIT_CACHE_DIR"] == env["SGLANG_DG_CACHE_DIR"] == os.path.join(home, "jit", "deep_gemm")
    assert {os.path.dirname(v) for v in env.values()} == {os.path.join(home, "jit")}
    assert jit_cache.cache_env(None) == {} and jit_cache.cache_env("") == {}
    assert load_config(TINY_CPU, []).cluster.jit_cache_dir == "~/.cache/mcore_rl/jit"


def test_engine_kwargs_between_our_defaults_and_our_settings(capsys):
    """SGLang on GPUs: a user's key passes through, our default yields to the user, our own
    setting wins with one warning naming the key; on CPU no GPU default is added."""
    from mcore_rl.rollout import sglang as S

    layout = EngineLayout(2, 1, 1, 2)
    plain = S.engine_args(load_config(TINY_GPU, [*TWO]), "/m", layout, 0, None, 0.5)
    assert plain[FUSION] is True  # flashinfer's all-reduce fusion (a JIT compile) off by default on GPUs
    cfg = load_config(TINY_GPU, [*TWO, "rollout.engine_kwargs.enable_mixed_chunk=true",
                                 f"rollout.engine_kwargs.{FUSION}=false", "rollout.engine_kwargs.tp_size=8",
                                 "rollout.engine_kwargs.chunked_prefill_size=8192"])
    args = S.engine_args(cfg, "/m", layout, 0, None, 0.5)
    assert args["enable_mixed_chunk"] is True and args[FUSION] is False and args["tp_size"] == 2
    capsys.readouterr()
    engine_kwargs.warn_overridden(cfg.rollout.engine_kwargs, S.own_args(cfg, "/m", layout, 0, None, 0.5, None),
                                  "sglang")
    err = capsys.readouterr().err.strip().splitlines()
    # chunked_prefill_size equals ours: nothing to warn about
    assert len(err) == 1 and "tp_size=8 (kept 2)" in err[0] and "chunked_prefill" not in err[0], err
    cpu = S.engine_args(load_config(TINY_CPU, []), "/m", EngineLayout(1, 1, 1, 1), 0, None, 0.5)
    assert FUSION not in cpu


def test_vllm_engine_kwargs_pass_through_and_ours_win():
    from mcore_rl.rollout import vllm as V

    cfg = load_config(TINY_GPU, ["rollout.engine=vllm", "rollout.engine_kwargs.max_model_len=256",
                                 "rollout.engine_kwargs.tensor_parallel_size=4"])
    args = V.engine_args(cfg, "/m", EngineLayout(1, 1, 1, 1), 0.5)
    assert args["max_model_len"] == 256 and args["tensor_parallel_size"] == 1
    assert engine_kwargs.overridden(cfg.rollout.engine_kwargs, V.own_args(cfg, "/m", EngineLayout(1, 1, 1, 1), 0.5)) \
        == {"tensor_parallel_size": (4, 1)}


def test_engines_of_the_loop_start_on_a_dummy_load_even_from_a_checkpoint(tmp_path):
    """A start from model.hf_path: the loop's engines get the tokenizer and the config but no weight
    files, so SGLang and vLLM build their layers on a dummy load (the first sync brings the weights)
    instead of reading the checkpoint only to overwrite it; the same directory with its weights for
    whoever loads the checkpoint itself (benchmarks, the export check)."""
    from mcore_rl.rollout import model_files
    from mcore_rl.rollout import sglang as S
    from mcore_rl.rollout import vllm as V

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"):
        (hf / name).write_text("x")
    cfg = load_config(TINY_GPU, [])
    layout = EngineLayout(1, 1, 1, 1)
    for server in (S, V):
        loop = server.engine_model_dir(str(hf), str(tmp_path / f"{server.__name__}_loop"), [2], "gpu", weights=False)
        full = server.engine_model_dir(str(hf), str(tmp_path / f"{server.__name__}_full"), [2], "gpu")
        assert sorted(os.listdir(loop)) == ["config.json", "generation_config.json", "tokenizer.json",
                                            "tokenizer_config.json"]
        assert not model_files.has_weights(loop) and model_files.has_weights(full)
        assert len(os.listdir(full)) == 7
    assert S.engine_args(cfg, str(tmp_path / "mcore_rl.rollout.sglang_loop"), layout, 0, None, 0.5)["load_format"] \
        == "dummy"
    assert "load_format" not in S.engine_args(cfg, str(tmp_path / "mcore_rl.rollout.sglang_full"), layout, 0, None, 0.5)
    assert V.engine_args(cfg, str(tmp_path / "mcore_rl.rollout.vllm_loop"), layout, 0.5)["load_format"] == "dummy"


def test_an_engine_call_that_waits_on_a_compile_says_so(tmp_path, capsys, monkeypatch):
    """Past the start-up the driver speaks only while an engine compiles kernels (its log's newest
    phase, marked by the engine's CompileWatch), naming the call and what is built; during the
    start-up every phase (mcore_rl.rollout.group._watch, ray.wait stood in for: nothing finishes)."""
    import time

    from mcore_rl.rollout import group

    monkeypatch.setattr(engine_start, "PROGRESS_S", 0.0)
    monkeypatch.setattr(engine_start, "POLL_S", 0.05)
    busy, idle = tmp_path / "engine_0_node0.log", tmp_path / "engine_1_node0.log"
    busy.write_text(f"{engine_start.MARK} started in 40 s\n"
                    f"{engine_start.MARK} {engine_start.COMPILING}batch_prefill/batch_prefill_sm90.cuda.o (nvcc)\n")
    idle.write_text(f"{engine_start.MARK} {engine_start.COMPILING}norm.cuda.o (nvcc)\n"
                    f"{engine_start.MARK} compiles done after 12 s\n")

    def never(refs, num_returns, timeout):
        time.sleep(timeout)
        return [], refs

    names = ["SGLang engine 0 node 0", "SGLang engine 1 node 0"]
    group._watch([object(), object()], "generate", names, [[None, str(busy)], [str(idle)]],
                 time.monotonic() + 0.5, started=False, wait=never)
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(line.startswith("SGLang engine 0 node 0: generate (0 s): compiling batch_prefill/"
                                         "batch_prefill_sm90.cuda.o (nvcc)") for line in lines[:1]), lines
    assert not any("engine 1" in line for line in lines), lines
    group._watch([object(), object()], "start-up", names, [[str(busy)], [str(idle)]], time.monotonic() + 0.5,
                 started=True, wait=never)
    lines = capsys.readouterr().out.splitlines()
    assert "SGLang engine 1 node 0: starting (0 s): compiles done after 12 s" in lines, lines
    assert any(line.startswith("SGLang engine 0 node 0: starting (0 s): compiling batch_prefill") for line in lines)
