"""Per-token outputs without gradients: log-probs of the policy (the old log-probs, recording the
routers' choice) and of the frozen reference (onloaded for the pass if offloaded), and the
critic's values. token_logprobs is shared with the policy loss (mcore_rl.actor.update)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from mcore_rl.loop import micro_batches as mb
from mcore_rl.loop import schedule


def token_logprobs(logits: torch.Tensor, packed: mb.Packed, temperature: float, with_entropy: bool = False,
                   fused: bool = False):
    """Log-probs [mb, R] of the response tokens (and their entropies) from packed logits [T, V].

    Only the positions that predict response tokens are normalised over the vocabulary. fused: the
    same numbers through mcore_rl.models.head (no fp32 [rows, V] copies kept for backward).
    """
    target = packed.response_targets
    if fused:
        from mcore_rl.models.head import logprob_entropy

        logp_sel, ent_sel = logprob_entropy(logits, target, temperature, with_entropy, index=packed.response_rows)
    else:
        rows = logits[packed.response_rows]
        logp_all = F.log_softmax(rows.float() / temperature, dim=-1)
        logp_sel = logp_all.gather(-1, target[:, None]).squeeze(-1)
        ent_sel = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    logp = packed.scatter_responses(logp_sel)
    return logp, packed.scatter_responses(ent_sel) if with_entropy else None


class PerToken:
    @torch.no_grad()
    def _per_response_token(self, model, batch: dict, values: bool) -> torch.Tensor | None:
        model.eval()
        d = self._local(batch, ("tokens", "attention_mask", "response_mask", "routes"))
        R = d["response_mask"].shape[1]
        out = torch.zeros(len(d["tokens"]), R)
        temperature = batch.get("temperature", self.cfg["rollout"]["temperature"])  # a sync check's is 1
        with record_function("actor/pack"):
            plan = self._micro_plan(mb.sample_lengths(d["attention_mask"]), self._sizes("critic" if values else "actor"))
            packs = self._packs(d, R, plan)

        def per_token(y, k):
            if values:
                return packs[k].at_responses(y[:, 0].float())
            return token_logprobs(y, packs[k], temperature, fused=self._fused_logprobs)[0]

        routes = self._routes_hook(model, packs, replay=self.cfg["actor"]["routing_replay"], record=True)
        for (rows, _), got in zip(plan, schedule.forward(model, packs, per_token, tp_gather=not values,
                                                         before_forward=routes)):
            if rows:
                out[rows] = got.cpu()
        if routes is not None:
            self._collect_routes(d, packs)
        return out if self._is_reporter() else None

    def log_probs(self, batch: dict, added: dict | None = None):
        out = self._per_response_token(self.model, self._added(batch, added), values=False)
        self._allocator_peak("old_log_prob")
        return out

    def ref_log_probs(self, batch: dict, added: dict | None = None):
        batch = self._added(batch, added)
        if self.ref_offload is None:
            return self._per_response_token(self.ref, batch, values=False)
        self.ref_offload.onload()
        try:
            return self._per_response_token(self.ref, batch, values=False)
        finally:
            self.ref_offload.offload()

    def values(self, batch: dict, added: dict | None = None):
        return self._per_response_token(self.critic, self._added(batch, added), values=True)
