"""Move a trainer's parameters, gradients and optimizer states to host memory and back.

Tensors keep their identity (only `.data` moves), so the model, the optimizer and any views
into them stay valid. Host buffers are pinned, allocated on the first offload and reused, so
repeated cycles do not grow host memory.
"""

from __future__ import annotations

import torch


class StateOffloader:
    def __init__(self, params: list[torch.Tensor], optimizers: list[torch.optim.Optimizer] = ()):
        self.params = list(params)
        self.optimizers = list(optimizers)
        self._host: dict[tuple, torch.Tensor] = {}
        self.device: torch.device | None = None

    def _tensors(self):
        """(key, tensor) for every tensor to move; keys are stable across cycles."""
        for i, p in enumerate(self.params):
            yield ("param", i), p
            if p.grad is not None:
                yield ("grad", i), p.grad
        for k, opt in enumerate(self.optimizers):
            for j, group in enumerate(opt.param_groups):
                for i, p in enumerate(group["params"]):
                    for name, v in opt.state.get(p, {}).items():
                        if torch.is_tensor(v) and v.dim() > 0:  # Adam's 'step' is a CPU scalar
                            yield ("opt", k, j, i, name), v

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self._tensors())

    @torch.no_grad()
    def offload(self) -> int:
        """Copy everything to host buffers and free the device copies; returns bytes moved."""
        moved = 0
        for key, t in self._tensors():
            if t.device.type == "cpu" and key in self._host and t.data_ptr() == self._host[key].data_ptr():
                continue  # already offloaded
            self.device = t.device
            host = self._host.get(key)
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                                   pin_memory=torch.cuda.is_available())
                self._host[key] = host
            host.copy_(t.data, non_blocking=True)
            t.data = host
            moved += host.numel() * host.element_size()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return moved

    @torch.no_grad()
    def onload(self, device: torch.device | str | None = None) -> None:
        device = torch.device(device) if device is not None else self.device
        if device is None:
            return  # never offloaded
        for _, t in self._tensors():
            if t.device != device:
                t.data = t.data.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
