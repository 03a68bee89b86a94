"""Colocated training and rollout on the same GPUs, one phase change at a time.

    to_train():   engine releases kv_cache, weights, cuda_graph -> trainer onloads its states
    to_rollout, in two halves with the checkpoint between them (written from host copies):
      offload():  trainer offloads all but its weights -> engine resumes weights -> weights are
                  synced -> trainer offloads its weights (states kept on the GPU, where the plan says
                  they fit beside the engine: only the grads are freed, before, and back in to_train)
      resume():   engine resumes kv_cache, cuda_graph

Weights come back before the KV cache so the sync never competes with the KV pool for
memory; the trainer's weights stay on the GPU for the sync, which reads them there instead of
streaming each tensor from its host copy (the sync phase holds both sides' weights); every
resume is checked against free memory first (`ResumeRefused`), so a resume that cannot fit fails
with a Python error on every rank instead of a silent exit(1) in one.
Sync and IPC buffers belong to neither side: allocate them outside any memory-saver region.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol, Sequence

from mcore_rl.memory.saver import MemorySaver, ResumeRefused

ROLLOUT_TAGS = ("kv_cache", "weights", "cuda_graph")


class Engine(Protocol):
    def release(self, tags: Sequence[str]) -> None: ...

    def resume(self, tags: Sequence[str]) -> None: ...


class Trainer(Protocol):
    def offload(self, weights: bool = True) -> object: ...  # weights=False: all the rest

    def onload(self) -> None: ...

    def drop_grads(self) -> object: ...  # states kept on the GPU: only the grads freed, and the cache

    def restore_grads(self) -> None: ...


class SaverEngine:
    """An engine whose memory is our own torch_memory_saver regions (tests).

    `tags` maps an engine tag to its saver tags in resume order, e.g. weights -> the dense
    weights, then expert chunks; a tag without saver tags (CUDA graphs in hook mode "torch")
    is left alone.
    """

    def __init__(self, saver: MemorySaver, tags: dict[str, list[str]]):
        self.saver, self.tags = saver, tags

    def release(self, tags):
        for t in tags:
            for s in self.tags.get(t, []):
                self.saver.pause(s)

    def resume(self, tags):
        for t in tags:
            self.saver.resume_in_order(self.tags.get(t, []))


class Colocation:
    """The phase changes of one colocated worker, timed (`timings[name]` in seconds)."""

    def __init__(self, engine: Engine, trainer: Trainer, sync: Callable[[], object], *,
                 offload_train_states: bool = True,
                 free_bytes: Callable[[], int] | None = None,
                 resume_needs: dict[str, int] | None = None):
        self.engine, self.trainer, self.sync = engine, trainer, sync
        self.offload_train_states = offload_train_states
        self.free_bytes, self.resume_needs = free_bytes, resume_needs or {}
        self.phase = "rollout"
        self.timings: dict[str, list[float]] = {}
        self.moved: dict[str, object] = {}  # what the trainer's last offloads returned (bytes moved)

    def _timed(self, name: str, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.timings.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    def _check(self, tag: str) -> None:
        """Refuse an engine resume the plan says cannot fit in the free memory now."""
        need = self.resume_needs.get(tag)
        if need is None or self.free_bytes is None:
            return
        free = self.free_bytes()
        if free < need:
            raise ResumeRefused(tag, need, free)

    def to_train(self, after_release: Callable[[], None] | None = None) -> None:
        """`after_release` runs once the engine's memory is back, before the trainer takes it."""
        if self.phase != "rollout":
            raise RuntimeError(f"to_train() called in phase {self.phase!r}")
        self._timed("release_rollout", self.engine.release, list(ROLLOUT_TAGS))
        if after_release:
            after_release()
        if self.offload_train_states:
            self._timed("onload_trainer", self.trainer.onload)
        else:
            self._timed("restore_grads", self.trainer.restore_grads)
        self.phase = "train"

    def offload(self, before_sync: Callable[[], None] | None = None, **sync_kwargs):
        """to_rollout's first half: the trainer's states to the host, around the engine's weights
        coming back and the sync (which reads the trainer's weights on the GPU); returns what the
        sync returned. What runs next (a checkpoint) finds every trainer state on the host (or kept on
        the GPU) and the KV cache still released. `before_sync` runs once the trainer's other states are offloaded."""
        if self.phase != "train":
            raise RuntimeError(f"to_rollout's offload() called in phase {self.phase!r}")
        if self.offload_train_states:
            self.moved["offload_trainer"] = self._timed("offload_trainer", self.trainer.offload, weights=False)
        else:  # the states stay; the grads (zeroed before each update) and the update's cached blocks go
            self._timed("drop_grads", self.trainer.drop_grads)
        if before_sync:
            before_sync()
        self._check("weights")
        self._timed("resume_weights", self.engine.resume, ["weights"])
        out = self._timed("sync", self.sync, **sync_kwargs)
        if self.offload_train_states:
            self.moved["offload_weights"] = self._timed("offload_weights", self.trainer.offload)
        self.phase = "offloaded"
        return out

    def resume(self) -> None:
        """to_rollout's second half: the engine's KV cache (and CUDA graphs) back."""
        if self.phase != "offloaded":
            raise RuntimeError(f"to_rollout's resume() called in phase {self.phase!r}")
        self._check("kv_cache")
        self._timed("resume_kv_cache", self.engine.resume, ["kv_cache", "cuda_graph"])
        self.phase = "rollout"
