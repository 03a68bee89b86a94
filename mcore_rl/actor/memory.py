"""Memory moves of the training states (params, grads, optimizer states of policy and critic):
to pinned host memory while a colocated engine has the GPU and back, their size, the GPU's free
memory, and the allocator peaks of each pass of the train phase (memory/trainer_* metrics)."""

from __future__ import annotations

import torch

from mcore_rl import optim


class MemoryMoves:
    def _state_offloader(self):
        if getattr(self, "_offloader", None) is None:
            from mcore_rl.memory.offload import StorageOffloader

            self._offloader = StorageOffloader(self._train_state_tensors)
        return self._offloader

    def _train_state_tensors(self):
        """Params, grad buffers (through main_grad views) and optimizer states of policy and critic."""
        for _, model, opt in self._parts():
            for p in model.parameters():
                yield p
                if getattr(p, "main_grad", None) is not None:
                    yield p.main_grad
            for sub in optim._subs(opt):
                inner = getattr(sub, "optimizer", sub)
                yield from (p for g in inner.param_groups for p in g["params"])
                yield from (v for st in inner.state.values() for v in st.values() if torch.is_tensor(v))

    def state_bytes(self) -> int:
        """Bytes of this rank's training state, on the device or offloaded (the host copies)."""
        seen, total = set(), 0
        host = self._state_offloader().by_storage if self.device.type == "cuda" else {}
        for t in self._train_state_tensors():
            s = t.untyped_storage()
            if s._cdata not in seen:
                seen.add(s._cdata)
                total += host[s._cdata].numel() if s._cdata in host else s.nbytes()
        return total

    def offload_states(self) -> int:
        """Params, grads and optimizer states to pinned host memory while a colocated engine runs."""
        self._writes_done()
        return self._state_offloader().offload() if self.device.type == "cuda" else 0

    def onload_states(self) -> None:
        self._writes_done()
        if self.device.type == "cuda":
            # what this process kept on the GPU while the engine had it (the rollout phase)
            self._peaks = {"memory/trainer_offloaded_allocated_gib": torch.cuda.memory_allocated() / 2**30,
                           "memory/trainer_offloaded_reserved_gib": torch.cuda.memory_reserved() / 2**30}
            torch.cuda.reset_peak_memory_stats()
            self._state_offloader().onload()
            self._allocator_peak("onload")

    def gpu_free_bytes(self) -> int:
        """Free memory of this rank's GPU, every process's use counted (the colocated resume guard)."""
        return torch.cuda.mem_get_info(self.device)[0]

    def _allocator_peak(self, name: str) -> None:
        """Record this process's allocator peaks since the last record (GPU), then reset them."""
        if self.device.type == "cuda":
            self._peaks[f"memory/trainer_max_allocated_gib_{name}"] = torch.cuda.max_memory_allocated() / 2**30
            self._peaks[f"memory/trainer_max_reserved_gib_{name}"] = torch.cuda.max_memory_reserved() / 2**30
            torch.cuda.reset_peak_memory_stats()
