"""Colocation on CPU: the memory-saver no-op fallback, the choreography's order and guards,
and trainer state offload."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.memory import saver as saver_mod
from mcore_rl.memory.colocate import Colocation, SaverEngine
from mcore_rl.memory.offload import StateOffloader
from mcore_rl.memory.saver import MemorySaver, ResumeRefused, SaverOrderError, chunk_tags


@pytest.fixture
def fresh_decision(monkeypatch):
    monkeypatch.setattr(saver_mod, "_DECIDED", None)


def test_saver_falls_back_to_a_noop_and_is_decided_once(fresh_decision):
    s = saver_mod.decide(enabled=True, hook_mode="torch")
    assert not s.active and s.reason in ("no CUDA device", "torch_memory_saver is not installed")
    assert saver_mod.decide(enabled=True, hook_mode="torch") is s
    with pytest.raises(SaverOrderError, match="already decided"):
        saver_mod.decide(enabled=True, hook_mode="preload")


def test_noop_saver_keeps_the_tag_bookkeeping():
    s = MemorySaver(None, None, "test")
    with s.region("weights"):
        w = torch.ones(4)
    assert s.pause("weights") == 0
    with pytest.raises(RuntimeError, match="already paused"):
        s.pause("weights")
    with pytest.raises(RuntimeError, match="is paused"):
        with s.region("weights"):
            pass
    s.resume("weights")
    with pytest.raises(RuntimeError, match="not paused"):
        s.resume("weights")
    with pytest.raises(KeyError, match="unknown memory-saver tag"):
        s.pause("kv_cache")
    assert w.sum() == 4


def test_chunk_tags_bound_each_chunk():
    assert chunk_tags("e", [3, 3, 3, 5, 1], 6) == ["e/0", "e/0", "e/1", "e/2", "e/2"]
    assert chunk_tags("e", [10, 1], 4) == ["e/0", "e/1"]  # an item over the limit gets its own chunk


class Recorder:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def release(self, tags):
        self.log.append((self.name, "release", tuple(tags)))

    def resume(self, tags):
        self.log.append((self.name, "resume", tuple(tags)))

    def offload(self, weights=True):
        self.log.append((self.name, "offload" if weights else "offload all but weights"))

    def onload(self):
        self.log.append((self.name, "onload"))

    def drop_grads(self):
        self.log.append((self.name, "drop grads"))

    def restore_grads(self):
        self.log.append((self.name, "restore grads"))


def test_choreography_order_and_guard():
    log = []
    co = Colocation(Recorder(log, "engine"), Recorder(log, "trainer"), lambda: log.append(("sync",)))
    co.to_train(after_release=lambda: log.append(("train phase",)))
    out = co.offload(before_sync=lambda: log.append(("sync phase",)))
    log.append(("save",))  # the loop's checkpoint, between the two halves of to_rollout
    co.resume()
    # the sync reads the trainer's weights on the GPU; the save writes every state from the host
    assert log == [("engine", "release", ("kv_cache", "weights", "cuda_graph")), ("train phase",),
                   ("trainer", "onload"), ("trainer", "offload all but weights"), ("sync phase",),
                   ("engine", "resume", ("weights",)), ("sync",), ("trainer", "offload"), ("save",),
                   ("engine", "resume", ("kv_cache", "cuda_graph"))]
    assert out is None  # what the sync returned
    assert set(co.timings) == {"release_rollout", "onload_trainer", "offload_trainer", "resume_weights",
                               "sync", "offload_weights", "resume_kv_cache"}
    with pytest.raises(RuntimeError, match="to_rollout"):
        co.offload()
    # a resume the plan says cannot fit is refused before the engine is touched
    log.clear()
    co = Colocation(Recorder(log, "engine"), Recorder(log, "trainer"), lambda: None,
                    free_bytes=lambda: 1 << 30, resume_needs={"weights": 2 << 30})
    co.to_train()
    with pytest.raises(ResumeRefused, match="'weights'.*short by 1,024 MiB"):
        co.offload()
    assert ("engine", "resume", ("weights",)) not in log


def test_kept_states_move_nothing_but_free_the_grads():
    """memory.offload_train_states false (or the plan's auto keeping them): no state leaves the GPU;
    the grads are freed before the engine resumes and back before the trainer runs."""
    log = []
    co = Colocation(Recorder(log, "engine"), Recorder(log, "trainer"), lambda: log.append(("sync",)),
                    offload_train_states=False)
    co.to_train()
    co.offload()
    log.append(("save",))
    co.resume()
    assert log == [("engine", "release", ("kv_cache", "weights", "cuda_graph")), ("trainer", "restore grads"),
                   ("trainer", "drop grads"), ("engine", "resume", ("weights",)), ("sync",), ("save",),
                   ("engine", "resume", ("kv_cache", "cuda_graph"))]
    assert set(co.timings) == {"release_rollout", "restore_grads", "drop_grads", "resume_weights", "sync",
                               "resume_kv_cache"}


def test_saver_engine_resumes_dense_weights_then_expert_chunks():
    s = MemorySaver(None, None, "test")
    tags = {"weights": ["weights", "weights/experts/0", "weights/experts/1"], "kv_cache": ["kv_cache"]}
    for t in tags["weights"] + tags["kv_cache"]:
        with s.region(t):
            pass
    order = []
    s.resume = lambda tag, _orig=s.resume: (order.append(tag), _orig(tag))
    engine = SaverEngine(s, tags)
    engine.release(["kv_cache", "weights", "cuda_graph"])  # no cuda_graph tag: left alone
    engine.resume(["weights"])
    engine.resume(["kv_cache", "cuda_graph"])
    assert order == ["weights", "weights/experts/0", "weights/experts/1", "kv_cache"]


def test_offload_moves_states_and_keeps_identity():
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = [id(p) for p in model.parameters()]
    off = StateOffloader(list(model.parameters()), [opt])
    assert off.nbytes() == 36 * 4 * 4  # 36 elements (weight + bias) x (param, grad, 2 moments) x fp32
    moved = off.offload()
    assert moved == off.nbytes() and off.offload() == 0  # a second offload moves nothing
    off.onload("cpu")
    assert [id(p) for p in model.parameters()] == ids
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    opt.step()  # the optimizer still works on the same tensors

