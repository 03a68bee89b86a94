"""SGLang's engine on a CPU-only machine: the named, version-gated stand-ins it needs.

SGLang (0.5.20 is what CI installs) runs its real engine on CPU with `SGLANG_USE_CPU_ENGINE=1`,
but a few things it imports or dispatches to exist only in GPU builds:
- `sgl_kernel` has no CPU build. SGLang's CPU paths import two helpers from it at module level
  and call them on every prefill and KV move; both are a few lines of torch here. Any other name
  imported from it is a stand-in that raises when called. No `torch.ops.sgl_kernel` ops are
  registered, so SGLang takes its native torch paths (norms, rope, activations, MoE).
- Seeded sampling calls `torch.ops.sgl_kernel.murmur_hash32_cpu` (the hash behind per-request
  seeds): registered here as a torch op with the same 32-bit MurmurHash3 mixing as SGLang's GPU
  kernel. Registering it leaves `convert_weight_packed` absent, the op SGLang probes for AMX.
- `torchvision`: SGLang imports it unconditionally and PyPI's wheel is a CUDA build that cannot
  load beside CPU torch. transformers must still see it "installed" (its AutoImageProcessor
  refuses otherwise), so the stand-in has a version and fails on first real use.
- DeepSeek/MLA under `attention_backend="torch_native"`: the backend has no MLA handler, SGLang
  falls back to triton's, which takes the MHA prefill path over the latent cache and fails. The
  handler registered here always picks MLA (`register_mla_handler`, run in every scheduler by
  `mcore_rl.rollout.sglang_plugin`).
- Expert parallelism: SGLang's CPU experts (`moe_forward_native`) index a table of the rank's own
  experts with the top-k ids, where an expert of another EP rank is -1 and fails; the GPU kernels
  skip it. Here it counts as expert 0 at weight 0, one top-k slot at a time (`register_expert_parallel`).
- DP attention: SGLang pads an attention-DP rank's batch with dummy requests whose seq_lens come
  from the attention backend's `get_cpu_graph_seq_len_fill_value`, which torch_native lacks (1,
  as intel_amx's), and at ep = dp = tp combines the MoE's output with pynccl's reduce_scatterv,
  where gloo has no reduce-scatter: all-reduce + scatter here, the path it takes otherwise
  (`register_dp_attention`).
- Routed-experts capture (`enable_return_routed_experts`) keeps its host buffer through
  `ALLOC_MEMORY_FUNCS`, whose default pins it with cudaHostRegister ("Torch not compiled with CUDA
  enabled"). On CPU the host buffer is plain memory (`register_host_buffers`, run by the plugin).
- `vllm`, where it is installed beside SGLang (rollout.engine=vllm's venv), is hidden: SGLang
  probes it as it imports (its triton fused-MoE module takes `vllm._custom_ops` off CUDA), which
  costs seconds of CPU in the engine's process and again in each scheduler, and its CPU engine
  uses none of it (native torch paths): SGLang then runs as it does where vLLM is not installed.

The stand-ins must exist in every SGLang process before any SGLang module is imported (the
engine actor's schedulers are forked from it and inherit them; `sglang.launch_server` spawns its own): `sglang_site/sitecustomize.py` calls `install()` at interpreter
start when MCORE_RL_SGLANG_CPU=1 (the engine actor sets it and puts that directory first on
PYTHONPATH). Nothing here runs on GPU machines.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import os
import sys
import types

import torch

TESTED = ("0.5.20",)  # the CPU engine was checked token for token against transformers on these
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_site")
ENV_FLAG = "MCORE_RL_SGLANG_CPU"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len):
    """Request i's token slots start[i]:end[i] take the next end[i]-start[i] cache locations."""
    pos = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[row, start:end] = out_cache_loc[pos:pos + end - start].to(req_to_token.dtype)
        pos += end - start


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """Row src_loc[j] -> row tgt_loc[j] in every KV buffer, each given by its raw data pointer and
    row stride in bytes (the signature of SGLang's CPU kernel)."""
    if not len(src_loc):
        return
    src, tgt = src_loc.long(), tgt_loc.long()
    rows = int(max(src.max(), tgt.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)  # the buffer itself, no copy
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        buf[tgt] = buf[src].clone()


_U32 = 0xFFFFFFFF


def _murmur_mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One MurmurHash3 block on uint32 values held in int64 (products keep their low 32 bits)."""
    k = (k * 0xCC9E2D51) & _U32
    k = ((k << 15) | (k >> 17)) & _U32
    k = (k * 0x1B873593) & _U32
    h = h ^ k
    h = ((h << 13) | (h >> 19)) & _U32
    return (h * 5 + 0xE6546B64) & _U32


def murmur_hash32_cpu(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """[n, m] hashes of (64-bit seed, 32-bit position) of row i and column index j, as SGLang's kernel."""
    s = seed.view(torch.int64) if seed.dtype == torch.uint64 else seed.to(torch.int64)
    h = torch.zeros_like(s)
    for k in (s & _U32, (s >> 32) & _U32, positions.to(torch.int64) & _U32):
        h = _murmur_mix(h, k)
    h = _murmur_mix(h[:, None], (col_indices.to(torch.int64) & _U32)[None, :]) ^ 16
    for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, 1)):
        h = h ^ (h >> shift)
        h = (h * mul) & _U32
    return h.to(torch.uint32)


def _register_ops() -> None:
    if not hasattr(torch.ops.sgl_kernel, "murmur_hash32_cpu"):
        lib = torch.library.Library("sgl_kernel", "FRAGMENT")  # noqa: TOR901 - kept alive below
        lib.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
        lib.impl("murmur_hash32_cpu", murmur_hash32_cpu, "CPU")
        _LIBS.append(lib)


_LIBS: list = []


class _StandIn(types.ModuleType):
    """A module for `import` statements; any attribute is another stand-in that raises when called."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.__name__} is a CPU stand-in (mcore_rl.rollout.sglang_cpu), not the real thing")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    PROVIDED = {"sgl_kernel": {"assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
                               "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu},
                "torchvision": {"__version__": "0.28.0"}}

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.PROVIDED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandIn(spec.name)
        module.__path__ = []
        module.__dict__.update(self.PROVIDED.get(spec.name, {}))
        return module

    def exec_module(self, module):
        pass


class _HiddenFinder(importlib.abc.MetaPathFinder):
    """`import vllm` fails as if it were not installed (see the module docstring)."""

    HIDDEN = ("vllm",)

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden from SGLang's CPU engine by "
                                      "mcore_rl.rollout.sglang_cpu)", name=name)
        return None


def _check_version() -> None:
    from importlib.metadata import version

    found = version("sglang")
    if found not in TESTED:
        raise RuntimeError(f"SGLang {found} on CPU: the CPU stand-ins were written for SGLang {', '.join(TESTED)}; "
                           "install that version (scripts/setup.sh does) or add this one to TESTED after "
                           "checking its tokens against transformers (tests/e2e/test_rollout_sglang.py)")


def install() -> None:
    """Put the stand-ins in place in this process (idempotent). Call before importing SGLang."""
    if any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        return
    _check_version()
    for name in _StandInFinder.PROVIDED:  # a real one must not be shadowed silently
        if name in sys.modules and not isinstance(sys.modules[name], _StandIn):
            raise RuntimeError(f"{name} is already imported in this process; the CPU stand-in cannot replace it")
    sys.meta_path.insert(0, _StandInFinder())
    if not any(name in sys.modules for name in _HiddenFinder.HIDDEN):  # too late to hide once imported
        sys.meta_path.insert(0, _HiddenFinder())
    _register_ops()
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")


def register_mla_handler() -> None:
    """torch_native picks SGLang's MLA forward for DeepSeek attention (see the module docstring)."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    AttentionBackendRegistry.register("torch_native", lambda attn, forward_batch: AttnForwardMethod.MLA)


def register_expert_parallel() -> None:
    """SGLang's CPU experts at EP > 1 (see the module docstring): an expert of another EP rank, id -1
    in top-k, taken as expert 0 at weight 0 (contributes nothing), as the GPU kernels skip it."""
    from sglang.srt.layers.moe import fused_moe_native
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    native = fused_moe_native.moe_forward_native
    if getattr(native, "mcore_rl_ep", False):
        return

    def moe_forward_native(layer, x, topk_output, moe_runner_config):
        weights, ids, logits = topk_output
        other = ids < 0
        if not bool(other.any()):
            return native(layer, x, topk_output, moe_runner_config)
        weights, ids = weights.masked_fill(other, 0), ids.masked_fill(other, 0)
        # one top-k slot a call: SGLang counts a token's experts with scatter_, which would count two
        # slots of expert 0 as one
        return sum(native(layer, x, StandardTopKOutput(weights[:, k:k + 1], ids[:, k:k + 1], logits),
                          moe_runner_config) for k in range(ids.shape[1]))

    moe_forward_native.mcore_rl_ep = True
    fused_moe_native.moe_forward_native = moe_forward_native  # SGLang imports it from there at each call


def register_dp_attention() -> None:
    """DP attention on the CPU engine (see the module docstring): torch_native's fill value for the
    seq_lens of the dummy requests that pad a rank's batch to its peers', and the MoE's combine by
    all-reduce + scatter instead of pynccl's reduce_scatterv (gloo has no reduce-scatter)."""
    from sglang.srt.layers import communicator, moe
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.moe import utils

    TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = lambda self: 1
    for module in (utils, moe, communicator):  # each holds the name
        module.should_use_dp_reduce_scatterv = lambda: False


def _plain_host_buffer(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    return torch.zeros(dims, dtype=dtype, device="cpu")  # a CPU engine's memory is the host's: nothing to pin


def register_host_buffers() -> None:
    """SGLang's host buffers of a CPU engine without cudaHostRegister (see the module docstring)."""
    from sglang.srt.mem_cache.pool_host import common

    common.ALLOC_MEMORY_FUNCS["cpu"] = _plain_host_buffer


def child_env(env: dict | None = None) -> dict:
    """Environment for an SGLang process on CPU: the stand-ins installed at its start."""
    env = dict(os.environ if env is None else env)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = SITE_DIR + (os.pathsep + path if path else "")
    env.update({ENV_FLAG: "1", "SGLANG_USE_CPU_ENGINE": "1"})
    return env
