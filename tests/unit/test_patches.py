"""The patches that remove host syncs from megatron's no-TE fallbacks compute what megatron
computes (bit for bit where the same kernels run) and no longer read device values on the host."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mcore_rl import patches
from mcore_rl.patches import no_te

ONE_CP_RANK = SimpleNamespace(size=lambda: 1, rank=lambda: 0)


def _host_reads(fn) -> int:
    """How many times `fn` reads a tensor value on the host (.item(), .tolist(), bool(t), float(t))."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense")


@pytest.mark.parametrize("lens,mla", [((5, 3, 7), True), ((5, 3, 7), False), ((9,), True)],
                         ids=["packed-mla", "packed-gqa", "one-sequence"])
def test_packed_rope_equals_megatron_without_host_reads(lens, mla):
    from megatron.core.models.common.embeddings import rope_utils

    patches.apply(cpu=True)
    patched = rope_utils._apply_rotary_pos_emb_thd
    original = patched.__wrapped__
    torch.manual_seed(0)
    total, heads, dim = sum(lens), 3, 16
    t = torch.randn(total, heads, dim)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    freqs = torch.randn(max(lens), 1, 1, dim)  # megatron's RotaryEmbedding: [max_seqlen, 1, 1, dim]
    kwargs = dict(multi_latent_attention=mla, mscale=1.3, cp_group=ONE_CP_RANK)
    got, want = patched(t, cu, freqs, **kwargs), original(t, cu, freqs, **kwargs)
    assert torch.equal(got, want)
    assert _host_reads(lambda: patched(t, cu, freqs, **kwargs)) == 0
    assert _host_reads(lambda: original(t, cu, freqs, **kwargs)) >= 1  # (.tolist() on CPU is not counted)


def test_grad_norm_and_scale_equal_megatron_fallbacks_without_host_reads():
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    patches.apply(cpu=True)
    assert clip_grads.l2_norm_impl is no_te.foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is no_te.foreach_scale
    torch.manual_seed(1)
    grads = [torch.randn(n) for n in (7, 300, 1, 64)]
    flag = torch.zeros(1, dtype=torch.int)
    ours, _ = no_te.foreach_l2_norm(0, flag, [grads], False)
    theirs, _ = utils.local_multi_tensor_l2_norm(0, flag, [grads], False)
    torch.testing.assert_close(ours, theirs.to(ours.device), rtol=1e-6, atol=0)
    assert _host_reads(lambda: no_te.foreach_l2_norm(0, flag, [grads], False)) == 0
    assert _host_reads(lambda: utils.local_multi_tensor_l2_norm(0, flag, [grads], False)) == len(grads) + 1

    scaled = [g.clone() for g in grads]
    no_te.foreach_scale(0, flag, [scaled, scaled], 0.25)  # in place, as clipping calls it
    assert all(torch.equal(s, g * 0.25) for s, g in zip(scaled, grads))
    into = [torch.empty_like(g, dtype=torch.bfloat16) for g in grads]  # main -> model params
    want = [torch.empty_like(g, dtype=torch.bfloat16) for g in grads]
    no_te.foreach_scale(0, flag, [grads, into], 1.0)
    utils.local_multi_tensor_scale(0, flag, [grads, want], 1.0)
    assert all(torch.equal(a, b) for a, b in zip(into, want))


def test_skipped_patches_are_named(monkeypatch):
    monkeypatch.setenv(patches.SKIP_ENV, "no_such_patch")
    with pytest.raises(ValueError, match="no_such_patch"):
        patches.apply(cpu=True)


def test_the_cpu_stand_ins_are_not_imported_on_a_gpu():
    """On a GPU, apply() imports the megatron and no-TE patches only: patches/cpu.py stays out."""
    import subprocess
    import sys

    code = ("import sys; from mcore_rl import patches; applied = patches.apply(cpu=False); "
            "assert 'mcore_rl.patches.cpu' not in sys.modules, 'cpu patches imported'; "
            "assert not [n for n in applied if n.startswith('cpu_')], applied; print(applied)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "rope_thd_no_sync" in p.stdout
