"""Memory moves of the training states (params, grads, optimizer states of policy and critic):
to pinned host memory while a colocated engine has the GPU and back, their size, the GPU's free
memory, and the allocator peaks of each pass of the train phase (memory/trainer_* metrics)."""

from __future__ import annotations

import torch

from mcore_rl.parallel import optimizer as optim


class MemoryMoves:
    def _offloaders(self) -> dict:
        """The training states by how they move at a phase change:
        weights    the policy's, which the weight sync reads on the GPU: to the host after it;
        others     every other model state (a critic's weights): to the host before it;
        optimizer  main params and moments: to the host before it, back in the background (only
                   the optimizer step reads them: `optimizer_states_ready`);
        grads      the grad buffers: freed, not moved (each update zeroes them before use)."""
        if getattr(self, "_offload", None) is None:
            from mcore_rl.memory.offload import StorageDropper, StorageOffloader

            kind = self.device.type
            self._offload = {"weights": StorageOffloader(self._weight_tensors, kind),
                             "others": StorageOffloader(self._other_state_tensors, kind),
                             "optimizer": StorageOffloader(self._optimizer_state_tensors, kind),
                             "grads": StorageDropper(self._grad_tensors, kind)}
        return self._offload

    def _weight_tensors(self):
        return self.model.parameters()

    def _grad_tensors(self):
        return (p.main_grad for _, model, _ in self._parts() for p in model.parameters()
                if getattr(p, "main_grad", None) is not None)

    def _optimizer_tensors(self):
        for _, _, opt in self._parts():
            for sub in optim._subs(opt):
                inner = getattr(sub, "optimizer", sub)
                yield from (p for g in inner.param_groups for p in g["params"])
                yield from (v for st in inner.state.values() for v in st.values() if torch.is_tensor(v))

    def _optimizer_state_tensors(self):
        # fp32 models' main params can be views of the weights' own buffer: those move as weights
        skip = {t.untyped_storage()._cdata for t in (*self._weight_tensors(), *self._grad_tensors())}
        return (t for t in self._optimizer_tensors() if t.untyped_storage()._cdata not in skip)

    def _other_state_tensors(self):
        skip = {t.untyped_storage()._cdata for t in (*self._weight_tensors(), *self._grad_tensors(),
                                                      *self._optimizer_tensors())}
        return (t for t in self._train_state_tensors() if t.untyped_storage()._cdata not in skip)

    def _train_state_tensors(self):
        """Params, grad buffers (through main_grad views) and optimizer states of policy and critic."""
        for _, model, _ in self._parts():
            for p in model.parameters():
                yield p
                if getattr(p, "main_grad", None) is not None:
                    yield p.main_grad
        yield from self._optimizer_tensors()

    def optimizer_states_ready(self) -> None:
        """Before an optimizer step: the states an onload brought back in the background are there."""
        if self._moves_states():
            self._offloaders()["optimizer"].wait()

    def read_state(self, t: torch.Tensor) -> torch.Tensor:
        """`t`'s values wherever they are now: `t` itself, or the same view of its host copy."""
        if not self._moves_states():
            return t
        for off in self._offloaders().values():
            got = off.read(t)
            if got is not t:
                return got
        return t

    def state_bytes(self) -> int:
        """Bytes of this rank's training state, on the device or offloaded (the host copies)."""
        seen, total = set(), 0
        offs = self._offloaders() if self._moves_states() else {}
        host = {k: v.numel() for off in offs.values() for k, v in off.by_storage.items()}
        host.update(offs["grads"].dropped_bytes() if offs else {})
        for t in self._train_state_tensors():
            s = t.untyped_storage()
            if s._cdata not in seen:
                seen.add(s._cdata)
                total += host.get(s._cdata, s.nbytes())
        return total

    def offload_states(self, weights: bool = True) -> int:
        """Everything but the policy's weights, and with `weights` those too, to pinned host memory
        while a colocated engine runs (the grad buffers are freed instead). The choreography syncs
        the engine from the weights on the GPU (no host-to-device stream per tensor), then offloads
        them."""
        self._writes_done()
        if not self._moves_states():
            return 0
        off = self._offloaders()
        # the grads first: the offloaders' empty_cache then gives their freed blocks back to the engine too
        moved = off["grads"].offload() + off["others"].offload() + off["optimizer"].offload()
        return moved + (off["weights"].offload() if weights else 0)

    def drop_grads(self) -> None:
        """With the states kept on the GPU while a colocated engine runs (memory.offload_train_states
        false): the grad buffers freed, and the allocator's cached blocks (the update's activations)
        given back, which the engine's processes could not use otherwise."""
        self._writes_done()
        if self._moves_states():
            self._offloaders()["grads"].offload()
            torch.cuda.empty_cache()

    def restore_grads(self) -> None:
        if self._moves_states():
            self._offloaders()["grads"].onload()

    def onload_states(self) -> None:
        """The weights and other model states back now; the optimizer's in the background."""
        self._writes_done()
        if not self._moves_states():
            return
        if self.device.type == "cuda":
            # what this process kept on the GPU while the engine had it (the rollout phase)
            self._peaks = {"memory/trainer_offloaded_allocated_gib": torch.cuda.memory_allocated() / 2**30,
                           "memory/trainer_offloaded_reserved_gib": torch.cuda.memory_reserved() / 2**30}
            torch.cuda.reset_peak_memory_stats()
        off = self._offloaders()
        for name in ("weights", "others", "grads"):
            off[name].onload()
        off["optimizer"].onload(background=True)
        self._allocator_peak("onload")

    def _moves_states(self) -> bool:
        """Whether phase changes move the training states: on GPUs. (A CPU test drives the same moves
        by answering yes.)"""
        return self.device.type == "cuda"

    def gpu_free_bytes(self) -> int:
        """Free memory of this rank's GPU, every process's use counted (the colocated resume guard)."""
        return torch.cuda.mem_get_info(self.device)[0]

    def _allocator_peak(self, name: str) -> None:
        """Record this process's allocator peaks since the last record (GPU), then reset them; after
        the update, also the GPU's use at that peak (`_gpu_at_allocator_peak`)."""
        if self.device.type == "cuda":
            self._peaks[f"memory/trainer_max_allocated_gib_{name}"] = torch.cuda.max_memory_allocated() / 2**30
            self._peaks[f"memory/trainer_max_reserved_gib_{name}"] = torch.cuda.max_memory_reserved() / 2**30
            if name == "update":
                self._peaks["memory/gpu_at_allocator_peak_gib_train"] = self._gpu_at_allocator_peak() / 2**30
            torch.cuda.reset_peak_memory_stats()

    def _gpu_at_allocator_peak(self) -> int:
        """The most any trainer GPU held at its allocator's peak, all processes counted: that peak
        plus what the GPU holds outside this allocator now (the engine's released share, this
        process's CUDA context and NCCL), which the train phase leaves as it is. The phase monitor
        samples NVML every 50 ms and can miss an update's peak (a 4 x H200 run read less than the
        allocator's own peak plus the engine's share)."""
        free, total = torch.cuda.mem_get_info(self.device)
        outside = total - free - torch.cuda.memory_reserved(self.device)
        return self._max_over_ranks([torch.cuda.max_memory_reserved(self.device) + outside])[0]
