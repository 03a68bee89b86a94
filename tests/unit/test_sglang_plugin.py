"""What the engine actor asks of SGLang's schedulers after a resume or a weight update
(mcore_rl.rollout.sglang_plugin.refresh_fp32_copies), on the pattern SGLang 0.5.17's GLM-4.5 router
uses; CI's SGLang (0.5.20) holds that weight in fp32 and keeps no copy, so its own class cannot show it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore_rl.rollout.sglang_plugin import refresh_fp32_copies


class CachingGate(torch.nn.Module):
    """SGLang 0.5.17's Glm4MoeGate: a bf16 weight, projected through an fp32 copy made once."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 8, dtype=torch.bfloat16), requires_grad=False)
        self.register_buffer("_weight_fp32", None, persistent=False)

    def forward(self, h):
        if self._weight_fp32 is None:
            self._weight_fp32 = self.weight.data.to(torch.float32)
        return F.linear(h.to(torch.float32), self._weight_fp32)


def test_a_synced_router_weight_reaches_the_fp32_copy_in_place():
    model = torch.nn.Sequential(CachingGate(), torch.nn.Linear(4, 4))
    gate, h = model[0], torch.randn(3, 8)
    gate(h)  # the first forward makes the copy
    address = gate._weight_fp32.data_ptr()
    with torch.no_grad():
        gate.weight.copy_(torch.randn(4, 8))  # a weight sync
    stale = gate(h)
    assert refresh_fp32_copies(model) == 1
    assert gate._weight_fp32.data_ptr() == address  # CUDA graphs replay this address
    assert not torch.equal(stale, gate(h))
    assert torch.equal(gate(h), F.linear(h, gate.weight.float()))
