"""The offloaders on a real GPU: pinned host copies, a background onload on a side stream that the
caller's work overlaps, and values that arrive bit-exact once `wait()` has ordered them."""

from __future__ import annotations

import time

import torch

from mcore_rl.memory.offload import StorageDropper, StorageOffloader


def test_background_onload_overlaps_and_arrives_exact():
    g = torch.Generator(device="cuda").manual_seed(0)
    states = [torch.randn(64 << 20, device="cuda", generator=g) for _ in range(4)]  # 4 x 256 MiB fp32
    views = [s[1000:2000] for s in states]  # views keep their identity through the moves
    want = [s.clone() for s in states]
    off = StorageOffloader(lambda: iter(states))
    moved = off.offload()
    assert moved == sum(s.numel() * 4 for s in states) and all(s.untyped_storage().nbytes() == 0 for s in states)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    off.onload(background=True)
    returned_s = time.perf_counter() - t0
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16, generator=g)
    for _ in range(20):  # the caller's work, on its own stream, while the copies run
        a = (a @ a).clamp_(-1, 1)
    off.wait()
    got = [s.clone() for s in states]  # on the current stream: ordered after the copies
    torch.cuda.synchronize()
    copy_s = moved / 20e9  # well under a PCIe Gen5 link's rate: a blocking onload takes at least this
    assert returned_s < copy_s, (returned_s, copy_s)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert all(torch.equal(v, w[1000:2000]) for v, w in zip(views, want))


def test_dropped_storages_come_back_zeroed():
    grads = [torch.ones(1 << 20, device="cuda") for _ in range(3)]
    drop = StorageDropper(lambda: iter(grads))
    free0 = torch.cuda.memory_allocated()
    assert drop.offload() == 0 and torch.cuda.memory_allocated() == free0 - 3 * (4 << 20)
    drop.onload()
    assert all(g.untyped_storage().nbytes() == 4 << 20 and not g.any() for g in grads)
