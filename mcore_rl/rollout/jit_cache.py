"""One directory per node for what the engines compile on first use, kept across runs.

SGLang and vLLM build kernels the first time a node runs them: flashinfer's JIT modules (its
TRT-LLM all-reduce fusion took minutes of nvcc at TP 4 on an H200), SGLang's own tvm-ffi JIT kernels
(its MoE gate), triton's kernels (attention, fused MoE), DeepGEMM's FP8 GEMMs, torch inductor's
graphs (SGLang compiles its top-k routing functions), CUDA's PTX. Each library caches them under its own default
(some under the home directory, some under /tmp, some per process); `cluster.jit_cache_dir` puts
them all under one directory on each node, so a second run on that node compiles nothing and
the directory is one thing to keep (or mount) between runs. A variable already set in the
environment wins over it (a site's own cache layout).
"""

from __future__ import annotations

import os

DIR_ENV = "MCORE_RL_JIT_CACHE_DIR"  # the configured directory, passed to each engine actor (applied on its node)
# environment variable -> subdirectory of the cache (SGLang copies SGLANG_DG_CACHE_DIR into
# DG_JIT_CACHE_DIR as it imports DeepGEMM, so both are set)
CACHE_ENV = {
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",  # flashinfer appends .cache/flashinfer/<version>/<arch>
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TORCH_EXTENSIONS_DIR": "torch_extensions",
    "TVM_FFI_CACHE_DIR": "tvm_ffi",  # SGLang's own JIT kernels (sglang.kernels.jit: its MoE gate, ...)
    "DG_JIT_CACHE_DIR": "deep_gemm",
    "SGLANG_DG_CACHE_DIR": "deep_gemm",
    "SGLANG_CACHE_DIR": "sglang",
    "VLLM_CACHE_ROOT": "vllm",
    "CUDA_CACHE_PATH": "cuda",
}


def cache_env(cache_dir: str | None, environ: dict | None = None) -> dict[str, str]:
    """The variables to set on this node for `cache_dir` (`~` expanded here, on the node), leaving out
    those `environ` (default: this process's) already has; {} for no cache directory."""
    if not cache_dir:
        return {}
    environ = os.environ if environ is None else environ
    root = os.path.abspath(os.path.expanduser(cache_dir))
    return {k: os.path.join(root, sub) for k, sub in CACHE_ENV.items() if not environ.get(k)}


def apply(cache_dir: str | None) -> dict[str, str]:
    """Set `cache_env(cache_dir)` in this process (and so in the engine processes it starts); returns it."""
    env = cache_env(cache_dir)
    for path in set(env.values()):
        os.makedirs(path, exist_ok=True)
    os.environ.update(env)
    return env


def share_inductor_headers() -> None:
    """torch inductor keeps its precompiled headers (a g++ run of seconds in each process that compiles)
    under tempfile's directory, whatever TORCHINDUCTOR_CACHE_DIR says: a process that was given a TMPDIR
    of its own (vLLM's engine actor) links that directory's inductor folder to the cache, so the
    headers are compiled once per node rather than at each engine start."""
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not cache:
        return
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    here = default_cache_dir()
    if not os.path.lexists(here):
        os.makedirs(cache, exist_ok=True)
        os.symlink(cache, here)
