"""Distributed model checkpoints through megatron-core's own dist_checkpointing (torch_dist).

Saves go to `<dir>.tmp` and are renamed by rank 0 after every rank has finished, so a
directory named like a checkpoint is always complete. A save writes the tensors it is given:
host tensors (CPU runs, or the pinned copies of offloaded states through `read`) are written
where they lie, with no staging copy.
"""

from __future__ import annotations

import ctypes
import os
import queue
import shutil
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from mcore_rl.models.builder import sharded_state_dict


def unwrap(model):
    """The GPTModel inside wrappers (megatron's DDP would prefix every key with 'module.')."""
    while hasattr(model, "module"):
        model = model.module
    return model


def load_model(model, ckpt_dir: str, strict: bool = True) -> None:
    """Load a torch_dist checkpoint written at any layout into `model` (resharding as needed)."""
    from megatron.core import dist_checkpointing

    if not os.path.exists(os.path.join(ckpt_dir, "metadata.json")):
        raise FileNotFoundError(f"{ckpt_dir}: not a torch_dist checkpoint (no metadata.json)")
    model = unwrap(model)
    sharded = sharded_state_dict(model)
    state = dist_checkpointing.load(sharded, ckpt_dir)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if strict and (missing or unexpected):
        raise KeyError(f"checkpoint/model mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _exact_storage(t: torch.Tensor) -> torch.Tensor:
    """t itself, or for a host tensor that views part of a larger storage (a param inside DDP's
    buffer, an offloaded state inside its host copy) the same memory under a storage of exactly its
    bytes: megatron's writer clones such views (so torch.save writes only their part), which would
    stage a copy of the whole model."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or not nbytes or t.untyped_storage().nbytes() == nbytes:
        return t
    if not t.is_contiguous():
        return t
    memory = (ctypes.c_byte * nbytes).from_address(t.data_ptr())
    memory.owner = t  # the new tensor keeps `memory`, and so t's storage, alive (from_address owns nothing)
    return torch.frombuffer(memory, dtype=t.dtype).view(t.shape)


def _read_through(sharded: dict, read) -> dict:
    """What to write for every sharded tensor: read(its data) (the host copy of an offloaded one),
    factories built (gate/up halves), each under a storage of exactly its bytes."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    if read is not None:
        for item in nested_values(sharded):
            if hasattr(item, "data") and torch.is_tensor(item.data):
                item.data = read(item.data)
    apply_factories(sharded)  # the halves are views too: they must not be cloned either
    for item in nested_values(sharded):
        if hasattr(item, "data") and torch.is_tensor(item.data):
            item.data = _exact_storage(item.data)
    return sharded


def _results_in_process() -> None:
    """megatron hands the write results to finalize() through a queue of a spawned Manager process,
    made for its forked writers. `ModelSave.write` writes from threads of this process, so a plain
    queue does: the Manager's start and its unpickling of the first results (it imports torch and
    megatron first) took 11 of a tiny model's 12 seconds of save on CPU."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):
        raise RuntimeError("megatron's filesystem_async has no _results_queue: not the version this was written for")
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


class ModelSave:
    """One model's torch_dist save in three parts: made now (collective: the sharded state dict
    and megatron's write plan), `write()` the files (any thread, no collectives), `finalize()`
    (collective: rank 0 writes the metadata). read(t): the tensor to write for the live tensor t."""

    def __init__(self, model, ckpt_dir: str, read=None):
        from megatron.core import dist_checkpointing

        if dist.get_rank() == 0:
            os.makedirs(ckpt_dir, exist_ok=True)
        dist.barrier()
        # the live tensors (which it references) outlive the save: the caller keeps the model
        sharded = _read_through(sharded_state_dict(unwrap(model)), read)
        _results_in_process()
        self.request = dist_checkpointing.save(sharded, ckpt_dir, async_sharded_save=True)
        self.args = list(self.request.async_fn_args)
        if self.request.preload_fn:  # host tensors stay where they are; device ones are staged
            self.args[1] = self.request.preload_fn()

    def write(self) -> None:
        """Write every bucket of this rank from this process, a thread per bucket. megatron's own
        `write_preloaded_data_multiproc` forks a writer per bucket, and a fork copies every page
        pinned for DMA (Linux keeps those with the parent and gives the child copies): with the
        offloaded states in pinned buffers, that was a second full copy of the state (measured on
        an H200: host PSS +41.4 GiB during the save of 42.05 GiB)."""
        fn = self.request.async_fn
        if fn is None:
            return
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        if getattr(fn, "func", None) is not FileSystemWriterAsync.write_preloaded_data_multiproc:
            raise RuntimeError(f"megatron's save function is {fn!r}, not the writer this was written for")
        transform_list, use_msc = fn.args
        _, buckets, results_queue = self.args
        local, count = queue.Queue(), queue.Queue()  # what write_preloaded_data reports into
        with ThreadPoolExecutor(max(1, len(buckets)), thread_name_prefix="ckpt-write") as pool:
            writes = []
            for i, bucket in enumerate(buckets):
                count.put(i)
                writes.append(pool.submit(FileSystemWriterAsync.write_preloaded_data, transform_list, i, bucket,
                                          local, count, True, use_msc=use_msc))
        for w in writes:  # a writer that failed outside its own try (it reports the rest) raises here
            w.result()
        results = {}
        for _ in buckets:
            i, got = local.get_nowait()
            if isinstance(got, Exception):
                results = got
                break
            results[i] = got
        results_queue.put(results)  # as the forked writers would have: finalize() reads it

    def finalize(self) -> None:
        for fn in self.request.finalize_fns:
            fn()


def save_model(model, ckpt_dir: str, side_files_from: str | None = None, read=None) -> None:
    """Save `model` (all ranks call this) as a torch_dist checkpoint at `ckpt_dir`, atomically."""
    tmp = ckpt_dir.rstrip("/") + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    save = ModelSave(model, tmp, read)
    save.write()
    save.finalize()
    if dist.get_rank() == 0:
        if side_files_from:
            shutil.copytree(side_files_from, os.path.join(tmp, "hf"))
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        os.rename(tmp, ckpt_dir)
    dist.barrier()
