"""Megatron's DDP + distributed optimizer (mcore_rl.parallel.optimizer) on gloo: a step at EP2 or TP2xETP2
equals the one-process step (resuming its state: tests/e2e/test_checkpoints.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from mcore_rl.convert import hf_mcore as convert
from tests.support import distributed
from tests.support.tiny_models import make_hf_model

# eps = 1 makes Adam's first step ~ lr * grad, so the comparison checks gradients (a missed
# reduction shows) rather than the sign of rounding noise in near-zero grads
SECTION = dict(lr=10.0, weight_decay=0.0, grad_clip=100.0, adam_eps=1.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("optim")
    make_hf_model("deepseek_v3", str(d / "hf"))
    convert.hf_to_mcore(str(d / "hf"), str(d / "ckpt"), dtype="fp32")
    return d


def _setup(root, tp, ep, etp, ckpt, dtype=torch.float32, grad_fp32=True, lr_scale=None, section=SECTION):
    from mcore_rl.parallel import optimizer as optim
    from mcore_rl.checkpoint.model import load_model
    from mcore_rl.models.config import HFModel, transformer_config
    from mcore_rl.models.builder import build_model
    from mcore_rl.parallel.groups import Layout, init_distributed

    init_distributed(Layout(tp=tp, ep=ep, etp=etp))
    hf = HFModel.from_dir(os.path.join(root, "hf"))
    tcfg = transformer_config(hf, tp=tp, ep=ep, etp=etp, dtype=dtype, cpu=True)
    model = build_model(hf, tcfg)
    load_model(model, ckpt)
    return optim.wrap(model, tcfg, section, grad_fp32, lr_scale=lr_scale)


def _train_step(ddp, opt, seed):
    """Mean log-partition over a global batch of 4; each DP rank takes its share."""
    from megatron.core import parallel_state as ps

    from mcore_rl.parallel import optimizer as optim
    from mcore_rl.models.forward import full_logits

    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(seed))
    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    optim.zero_grad(ddp, opt)
    full_logits(ddp, ids[r * 4 // dp:(r + 1) * 4 // dp]).float().logsumexp(-1).mean().backward()
    return optim.step(ddp, opt)


def _eval(ddp):
    from megatron.core import parallel_state as ps

    from mcore_rl.models.forward import full_logits

    with torch.no_grad():
        logits = full_logits(ddp, torch.arange(32).reshape(2, 16))
    return logits if logits is not None and ps.get_tensor_model_parallel_rank() == 0 else None


def _one_step(rank, root, layout, name):
    ddp, opt = _setup(root, *layout, os.path.join(root, "ckpt"))
    before = _eval(ddp)
    ok, gnorm = _train_step(ddp, opt, seed=1)
    logits = _eval(ddp)
    if rank == 0:
        torch.save({"ok": ok, "gnorm": gnorm, "logits": logits, "before": before},
                   os.path.join(root, f"{name}.pt"))


def test_distributed_optimizer_step_matches_one_process(tiny):
    root = str(tiny)
    distributed.run(_one_step, 1, root, (1, 1, 1), "ref")
    distributed.run(_one_step, 2, root, (1, 2, 1), "ep2")
    distributed.run(_one_step, 2, root, (2, 1, 2), "tp2_etp2")
    # the layout the config refuses: experts replicated over TP while each TP rank routes half
    # the tokens; their grads then miss the other half, which this comparison must detect
    distributed.run(_one_step, 2, root, (2, 1, 1), "tp2_etp1")
    ref = torch.load(os.path.join(root, "ref.pt"), weights_only=True)

    def errors(name):  # relative error of the grad norm and of the logits after the step
        got = torch.load(os.path.join(root, f"{name}.pt"), weights_only=True)
        assert got["ok"]
        return (abs(got["gnorm"] - ref["gnorm"]) / ref["gnorm"],
                ((got["logits"] - ref["logits"]).norm() / ref["logits"].norm()).item())

    report = {name: errors(name) for name in ("ep2", "tp2_etp2", "tp2_etp1")}
    # TP sums partial grads in another order: near-zero grads (norms, router) differ ~1e-4
    assert report["ep2"][0] < 1e-6 and report["ep2"][1] < 1e-5, json.dumps(report)
    assert report["tp2_etp2"][0] < 1e-4 and report["tp2_etp2"][1] < 3e-3, json.dumps(report)
    assert report["tp2_etp1"][0] > 2e-4, json.dumps(report)
    # the step moved the model: the agreement above is not the trivial one
    assert (ref["logits"] - ref["before"]).norm() / ref["logits"].norm() > 1e-2


def _bf16_grads_step(rank, root):
    """Two steps with bf16 grads (memory.grad_fp32=false): megatron copies each rank's shard of them
    to fp32 for the step; after `optim.step` no main param may still hold such a copy."""
    ddp, opt = _setup(root, 1, 2, 1, os.path.join(root, "ckpt"), dtype=torch.bfloat16, grad_fp32=False)
    mains = [p for g in opt.param_groups for p in g["params"]]
    assert mains and all(p.dtype == torch.float32 for p in mains)
    before = _eval(ddp)
    left = []
    for seed in (1, 2):
        ok, gnorm = _train_step(ddp, opt, seed)
        assert ok and gnorm > 0
        left.append(sum(p.grad.numel() for p in mains if p.grad is not None))
    after = _eval(ddp)
    if after is not None:
        torch.save({"left": left, "moved": (after - before).abs().max().item()},
                   os.path.join(root, f"bf16_grads{rank}.pt"))


def test_bf16_grads_fp32_copies_are_dropped_after_the_step(tiny):
    """With bf16 grads the step's fp32 copies (4 B per element of the rank's optimizer shard; 9.4 GiB
    on an H100 at 4 Moonlight layers) are freed by optim.step, not kept through the rollout."""
    root = str(tiny)
    distributed.run(_bf16_grads_step, 2, root)
    got = torch.load(os.path.join(root, "bf16_grads0.pt"), weights_only=True)
    assert got["left"] == [0, 0] and got["moved"] > 0


def _fused_vs_foreach(rank, root):
    from megatron.core import parallel_state as ps

    from mcore_rl.parallel import optimizer as optim

    out = {}
    for fused in (False, True):
        ps.destroy_model_parallel()
        ddp, opt = _setup(root, 1, 2, 1, os.path.join(root, "ckpt"))
        if fused:
            optim.use_fused_adam(opt)
            inner = [sub.optimizer for sub in opt.chained_optimizers]
            assert all(g["fused"] and not g["foreach"] for o in inner for g in o.param_groups)
        for seed in (1, 2):
            _train_step(ddp, opt, seed)
        out[fused] = _eval(ddp)
    if out[True] is not None:
        torch.save(out, os.path.join(root, f"fused_adam{rank}.pt"))


def test_fused_adam_steps_like_the_multi_tensor_adam(tiny):
    """torch's fused AdamW kernel (actor.fused_adam, default on GPU) against the multi-tensor AdamW
    megatron builds without apex/TE: two distributed-optimizer steps at EP2 (moments and steps
    carried over), logits after them."""
    root = str(tiny)
    distributed.run(_fused_vs_foreach, 2, root)
    got = torch.load(os.path.join(root, "fused_adam0.pt"), weights_only=True)
    assert ((got[True] - got[False]).norm() / got[False].norm()).item() < 1e-5


def _scaled_lr_step(rank, root):
    """One Adam step with the latent's up-projection at a quarter of the lr: Adam's first step moves
    every element with a gradient by the lr itself (eps negligible), so the largest move of each
    parameter is its group's lr."""
    from mcore_rl.models.latent_width import KV_UP

    ddp, opt = _setup(root, 1, 1, 1, os.path.join(root, "ckpt"), lr_scale={KV_UP: 0.25},
                      section=dict(lr=1e-3, weight_decay=0.0, grad_clip=0.0, adam_eps=1e-12))
    before = {n: p.detach().clone() for n, p in ddp.named_parameters()}
    assert _train_step(ddp, opt, seed=1)[0]
    moved = {n.split("layers.")[-1]: (p.detach() - before[n]).abs().max().item() for n, p in ddp.named_parameters()}
    torch.save(moved, os.path.join(root, "scaled_lr.pt"))


def test_a_scaled_lr_steps_its_params_with_their_own_lr(tiny):
    """optim.wrap's lr_scale (model.mla_base_rank's lr rule): the matching params take lr x factor
    in groups of their own, every other param the lr."""
    distributed.run(_scaled_lr_step, 1, str(tiny))
    moved = torch.load(os.path.join(str(tiny), "scaled_lr.pt"), weights_only=True)
    up = {n: v for n, v in moved.items() if "linear_kv_up_proj" in n}
    assert len(up) == 4 and all(abs(v - 0.25e-3) < 1e-7 for v in up.values()), moved  # one a layer
    others = [v for n, v in moved.items() if n not in up and v > 0]
    assert len(others) > 10 and all(abs(v - 1e-3) < 1e-7 for v in others), moved
