"""Routing replay (actor.routing_replay, MoE with SGLang's routed experts): the policy's routers
replay the engine's routes, and record their own choice in the old-log-prob pass, which is
compared with the engine's (rollout/route_agreement)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_rl.loop import micro_batches as mb


class RouteReplay:
    def _install_route_replay(self, cfg: dict) -> None:
        """With routes coming back from the engine (SGLang, MoE): the policy's routers replay them
        (actor.routing_replay) and record their own choice in the old-log-prob pass."""
        from mcore_rl.models.routed_experts import ExpertLayout

        r = cfg["rollout"]
        layout = ExpertLayout.of(self.hf)
        self.route_replays, self.trainer_routes, self._route_agreement = [], None, None
        self._routes_on = layout is not None and r["engine"] == "sglang" and r["return_routed_experts"]
        if self._routes_on:  # a pipeline stage of dense layers only has none, but takes part
            from mcore_rl.models import replay

            self.route_replays = replay.install(self.model, layout.moe_layers)

    def _routes_hook(self, model, packs: list[mb.Packed], replay: bool, record: bool):
        """pipeline's before_forward for `model` over `packs`: None unless the policy gets routes."""
        if model is not self.model or not self._routes_on or packs[0].routes is None:
            return None
        from mcore_rl.models.replay import set_targets, start

        start(self.route_replays, replay=replay, record=record)
        tp_rank = self.ps.get_tensor_model_parallel_rank()
        return lambda k: set_targets(self.route_replays, packs[k].routes, tp_rank, self.layout.tp)

    def _collect_routes(self, d: dict, packs: list[mb.Packed]) -> None:
        """The experts the policy's routers took in the pass that just ran, in the batch's layout
        (self.trainer_routes, -1 where another rank routed), and the agreement with the engine's
        over all ranks (rollout/route_agreement)."""
        from mcore_rl.models.routed_experts import agreement_counts

        engine = d["routes"]
        mine = torch.full_like(engine, -1)
        flat = mine.flatten(0, 1)
        tp, tp_rank = self.layout.tp, self.ps.get_tensor_model_parallel_rank()
        for r in self.route_replays:
            for packed, taken in zip(packs, r.taken):
                n = packed.length // tp
                src = packed.source[tp_rank * n:(tp_rank + 1) * n].cpu()
                flat[src[src >= 0], r.column] = taken.cpu()[src >= 0]
            r.reset()
        self.trainer_routes = mine
        counts = torch.tensor(agreement_counts(mine, engine), dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)  # ranks route disjoint tokens (DP, TP slices) or layers (PP)
        self._route_agreement = (counts[0] / counts[1]).item() if counts[1] > 0 else None

    def route_agreement(self) -> float | None:
        """rollout/route_agreement of the last old-log-prob pass (the reporting rank)."""
        return self._route_agreement if self._is_reporter() else None
