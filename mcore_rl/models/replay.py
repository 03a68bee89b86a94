"""R3, rollout routing replay, on megatron-core's own hook: every TopKRouter hands its top-k
selection to its `router_replay` object (megatron's RouterReplay, 0.16.1). Ours is a subclass
installed on the policy's routers only (the reference policy and the critic route live):

- replay: the router takes the engine's expert ids for each token and weighs them with its own
  live scores, gathered from the DENSE score tensor megatron passes in (sigmoid or softmax over all
  experts), so gradients still reach the router; rows the engine did not route (-1: a sample's
  last token, the packing filler) take the router's own top-k.
- record: the ids the router took (replayed or its own) are kept per forward, so the trainer can
  show its choice next to the engine's (rollout/route_agreement).

Targets are set per micro-batch just before its forward (mcore_rl.loop.schedule's before_forward).
Activation recompute reruns the router inside autograd's backward; there the micro-batches' ids
are taken back in the order their forwards ran (megatron's replay_backward_list; 1F1B runs
backwards in forward order).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay


class RouteReplay(RouterReplay):
    def __init__(self, column: int):
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)  # ours are driven per model, not globally
        self.column = column  # this router's MoE layer in a batch's routes
        self.replaying = False
        self.recording = False
        self.taken: list[torch.Tensor] = []  # ids taken per forward, while recording

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        own_probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if not self.replaying:
            probs, ids = own_probs, own
        else:
            in_backward = torch._C._current_graph_task_id() != -1  # a recompute of this router
            target = self.replay_backward_list.pop(0) if in_backward else self.target_topk_idx
            target = target.to(scores.device, torch.long)
            ids = torch.where(target >= 0, target, own)
            probs = scores.gather(1, ids)
        if self.recording and not torch.is_grad_enabled():
            self.taken.append(ids.detach().to(torch.int16))  # to the host after the pass: no sync per layer
        return probs, ids

    def reset(self) -> None:
        self.clear_indices()
        self.taken = []
        self.replaying = self.recording = False


def install(model, moe_layers: tuple[int, ...]) -> list[RouteReplay]:
    """A RouteReplay on every TopKRouter of `model` (this pipeline stage's), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    out = []
    for m in model.modules():
        if isinstance(m, TopKRouter):
            m.router_replay = RouteReplay(moe_layers.index(m.layer_number - 1))  # layer_number: global, 1-based
            out.append(m.router_replay)
    return out


def start(replays: list[RouteReplay], replay: bool, record: bool) -> None:
    for r in replays:
        r.reset()
        r.replaying, r.recording = replay, record


def set_targets(replays: list[RouteReplay], routes: torch.Tensor, tp_rank: int, tp: int) -> None:
    """A micro-batch's packed routes [T, MoE layers, top-k]: each router takes its layer's ids of
    the tokens it routes (with sequence parallelism, this TP rank's contiguous 1/tp of them)."""
    n = routes.shape[0] // tp
    mine = routes[tp_rank * n:(tp_rank + 1) * n]
    for r in replays:
        r.set_target_indices(mine[:, r.column])
