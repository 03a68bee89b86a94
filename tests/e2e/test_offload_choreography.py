"""The colocated phase change's moves of the training states (mcore_rl.actor.memory, the offloaders
of mcore_rl.memory.offload), driven on CPU with megatron's DDP + distributed optimizer at EP2 over
gloo: update, offload the other states and free the grad buffers, offload the weights, onload,
update again; and the change that keeps the states on the GPU (memory.offload_train_states false or
the plan's auto): the grad buffers freed and restored. Weights, optimizer states and logits must equal,
bit for bit, two updates with no phase change between them; the grad buffers must really be freed and
nothing read from them."""

from __future__ import annotations

import itertools
import os

import torch

from tests.e2e.test_optim import _eval, _setup, _train_step, tiny  # noqa: F401 - the tiny model's fixture
from tests.support import distributed


def _states(ddp, opt):
    from mcore_rl.parallel import optimizer as optim

    out = {f"w.{n}": p.detach().clone() for n, p in ddp.named_parameters()}
    for k, sub in enumerate(optim._subs(opt)):
        inner = getattr(sub, "optimizer", sub)
        for i, (p, st) in enumerate(inner.state.items()):
            out.update({f"opt{k}.{i}.{n}": v.detach().clone() for n, v in st.items() if torch.is_tensor(v)})
        out.update({f"main{k}.{i}": p.detach().clone() for i, p in enumerate(p for g in inner.param_groups
                                                                          for p in g["params"])})
    return out


def _run(rank, root):
    from megatron.core import parallel_state as ps

    for dtype in (torch.float32, torch.bfloat16):  # fp32 main params view the weights; bf16's are their own
        for phase_change in (None, "offload", "kept"):
            _cycle(rank, root, dtype, phase_change)
            ps.destroy_model_parallel()


def _cycle(rank, root, dtype, phase_change: str | None):
    from mcore_rl.actor.memory import MemoryMoves

    ddp, opt = _setup(root, 1, 2, 1, os.path.join(root, "ckpt"), dtype=dtype)

    class Moves(MemoryMoves):  # the actor's state moves, on this rank's model and optimizer
        model, device = ddp, torch.device("cpu")

        def _parts(self):
            return [("model", ddp, opt)]

        def _writes_done(self):
            pass

        def _moves_states(self):
            return True

    _train_step(ddp, opt, seed=1)
    report = {}
    if phase_change == "kept":
        moves = Moves()
        weight = next(ddp.parameters())
        moves.drop_grads()
        report["grads_freed"] = all(p.main_grad.untyped_storage().nbytes() == 0 for p in ddp.parameters())
        report["weights_stay"] = weight.untyped_storage().nbytes() > 0
        report["nothing_offloaded"] = not any(o.offloaded for k, o in moves._offloaders().items() if k != "grads")
        moves.restore_grads()
        report["grads_back_zeroed"] = all(p.main_grad.untyped_storage().nbytes() > 0 and not p.main_grad.any()
                                          for p in ddp.parameters())
    elif phase_change == "offload":
        moves = Moves()
        total = moves.state_bytes()
        grad_storages = {p.main_grad.untyped_storage()._cdata for p in ddp.parameters()}
        moved = moves.offload_states(weights=False)
        weight = next(ddp.parameters())
        report["weights_stay_for_the_sync"] = weight.untyped_storage().nbytes() > 0
        report["grads_freed"] = all(p.main_grad.untyped_storage().nbytes() == 0 for p in ddp.parameters())
        report["state_bytes_kept"] = moves.state_bytes() == total
        before = weight.detach().clone()
        moved += moves.offload_states()
        report["weights_offloaded"] = weight.untyped_storage().nbytes() == 0
        report["read_state_gives_host_copy"] = torch.equal(moves.read_state(weight), before)
        grad_bytes = sum(moves._offloaders()["grads"].dropped_bytes().values())
        report["moved_all_but_grads"] = moved == total - grad_bytes and grad_bytes > 0
        report["grad_storages_dropped"] = set(moves._offloaders()["grads"].dropped_bytes()) == grad_storages
        moves.onload_states()
        report["grads_back_zeroed"] = all(p.main_grad.untyped_storage().nbytes() > 0 and not p.main_grad.any()
                                          for p in ddp.parameters())
    _train_step(ddp, opt, seed=2)
    torch.save({"states": _states(ddp, opt), "logits": _eval(ddp), "report": report},
               os.path.join(root, f"{phase_change or 'still'}.{dtype}.rank{rank}.pt"))


def test_phase_change_moves_keep_training_bit_exact(tiny):  # noqa: F811 - the fixture
    root = str(tiny)
    distributed.run(_run, 2, root)
    for rank, dtype in itertools.product(range(2), (torch.float32, torch.bfloat16)):
        still = torch.load(os.path.join(root, f"still.{dtype}.rank{rank}.pt"), weights_only=True)
        for change in ("offload", "kept"):
            moved = torch.load(os.path.join(root, f"{change}.{dtype}.rank{rank}.pt"), weights_only=True)
            assert moved["report"] and all(moved["report"].values()), (change, moved["report"])
            assert still["states"].keys() == moved["states"].keys() and len(still["states"]) > 10
            for k, v in still["states"].items():
                assert torch.equal(v, moved["states"][k]), (change, k)
            if still["logits"] is not None:
                assert torch.equal(still["logits"], moved["logits"]), change
