"""The CPU stand-ins for sgl_kernel's helpers (mcore_rl.rollout.sglang_cpu), against independent
definitions: the MurmurHash3 of the `mmh3` package, and plain-Python versions of what SGLang's
kernels are documented to do. The engine-level proof (tokens equal transformers') is in
tests/e2e/test_rollout_sglang.py."""

from __future__ import annotations

import struct
import subprocess
import sys

import torch

from mcore_rl.rollout import sglang_cpu


def test_murmur_hash_is_murmurhash3_of_seed_position_and_token():
    import mmh3

    seeds = torch.tensor([0, 42, 2**40 + 5, 2**63 - 1], dtype=torch.uint64)
    pos = torch.tensor([0, 3, 1000, 7])
    got = sglang_cpu.murmur_hash32_cpu(seeds, pos, torch.arange(9))
    want = [[mmh3.hash(struct.pack("<IIII", int(s) & 0xFFFFFFFF, int(s) >> 32, int(p), c), 0, signed=False)
             for c in range(9)] for s, p in zip([0, 42, 2**40 + 5, 2**63 - 1], pos.tolist())]
    assert got.dtype == torch.uint32 and got.tolist() == want


def test_assign_req_to_token_pool_fills_each_requests_slots_in_turn():
    pool = torch.full((4, 10), -1, dtype=torch.int32)
    out_loc = torch.arange(100, 109)
    sglang_cpu.assign_req_to_token_pool_cpu(torch.tensor([2, 0]), pool, torch.tensor([3, 0]), torch.tensor([7, 5]),
                                           out_loc, pool.shape[1])
    assert pool[2, 3:7].tolist() == [100, 101, 102, 103] and pool[0, :5].tolist() == [104, 105, 106, 107, 108]
    assert (pool[1] == -1).all() and (pool[2, :3] == -1).all() and (pool[2, 7:] == -1).all()


def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer():
    bufs = [torch.randn(6, 8), torch.randn(6, 3).to(torch.bfloat16)]
    before = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs])
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs])
    sglang_cpu.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([4, 0]), torch.tensor([1, 5]))
    for b, old in zip(bufs, before):
        assert torch.equal(b[4], old[1]) and torch.equal(b[0], old[5])
        assert torch.equal(b[[1, 2, 3, 5]], old[[1, 2, 3, 5]])


def test_install_puts_stand_ins_before_sglang_hides_vllm_and_refuses_to_shadow_a_real_module():
    code = ("import sys, types; sys.modules['torchvision'] = types.ModuleType('torchvision'); "
            "from mcore_rl.rollout import sglang_cpu; sglang_cpu.install()")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "torchvision is already imported" in p.stderr
    code = ("from mcore_rl.rollout import sglang_cpu; sglang_cpu.install(); import sgl_kernel, torchvision; "
            "print(torchvision.__version__, sgl_kernel.assign_req_to_token_pool_cpu.__module__)\n"
            "try:\n    from vllm import _custom_ops\nexcept ImportError as e:\n    print(type(e).__name__)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    # vLLM (installed in this venv) is hidden: SGLang probes it at import, its CPU engine uses none of it
    assert p.returncode == 0 and p.stdout.split() == ["0.28.0", "mcore_rl.rollout.sglang_cpu",
                                                      "ModuleNotFoundError"], p.stderr


def test_an_engine_process_gets_the_stand_ins_at_its_first_sglang_import_and_no_sooner():
    env = sglang_cpu.child_env()  # as SGLang's processes on CPU start: the site dir and the flag
    code = "import sys, multiprocessing.resource_tracker; print('torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and p.stdout.split() == ["False"], p.stderr  # a process without SGLang: no torch
    code = "import sgl_kernel, torchvision; print(torchvision.__version__, sgl_kernel.assign_req_to_token_pool_cpu.__module__)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and p.stdout.split() == ["0.28.0", "mcore_rl.rollout.sglang_cpu"], p.stderr
