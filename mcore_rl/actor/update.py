"""Updates of the policy and the critic: PPO epochs over mini-batches, one optimizer step per
mini-batch with grads accumulated over its packed micro-batches, and the losses they minimise."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function

from mcore_rl.loop import micro_batches as mb
from mcore_rl.memory.planner import LARGEST_MICRO
from mcore_rl.loop import schedule
from mcore_rl.parallel import optimizer as optim
from mcore_rl.actor.logprobs import token_logprobs


class Update:
    def update(self, batch: dict, added: dict | None = None) -> dict | None:
        """PPO epochs over mini-batches of the policy; returns averaged metrics."""
        batch = self._added(batch, added)
        self._writes_done()
        a = self.cfg["actor"]
        self._largest_micro = dict.fromkeys(LARGEST_MICRO, 0)
        keys = ("tokens", "attention_mask", "response_mask", "advantages", "old_log_probs", "ref_log_probs",
                "rollout_is_weights", "routes")
        out = self._epochs(self.model, self.opt, self._local(batch, keys), self._policy_loss, a["ppo_epochs"],
                           self._sizes("actor"), warmup=a["lr_warmup_steps"])
        if self.ref is not None and a["use_kl_loss"]:
            out["actor/kl_coef"] = a["kl_loss_coef"]
        self._allocator_peak("update")
        out.update(self._peaks)  # onload, old log-probs and update: where the train phase's peak comes from
        out.update(self._largest_micro)  # what the step's plan is evaluated at (Plan.train_at)
        return out if self._is_reporter() else None

    def update_critic(self, batch: dict, added: dict | None = None) -> dict | None:
        batch = self._added(batch, added)
        self._writes_done()
        c = self.cfg["critic"]
        keys = ("tokens", "attention_mask", "response_mask", "values", "returns")
        out = self._epochs(self.critic, self.critic_opt, self._local(batch, keys), self._value_loss,
                           c["ppo_epochs"], self._sizes("critic"))
        return {k.replace("actor/", "critic/"): v for k, v in out.items()} if self._is_reporter() else None

    def _epochs(self, model, opt, d: dict, loss_fn, epochs: int, sizes: dict, warmup: int = 0) -> dict:
        mini = sizes["mini"]
        totals: dict[str, float] = {}
        steps = 0
        for _ in range(epochs):
            for chunk in mb.mini_batches(len(d["tokens"]), mini):
                if warmup:  # linear warmup over optimizer steps, to each group's own lr
                    for g in opt.param_groups:
                        g["lr"] = g["max_lr"] * min(1.0, (self.updates + 1) / warmup)
                stats = self._optimizer_step(model, opt, {k: v[chunk.start:chunk.stop] for k, v in d.items()},
                                             loss_fn, sizes)
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
                steps += 1
                self.updates += model is self.model
        out = {k: v / max(steps, 1) for k, v in totals.items()}
        out["actor/lr"] = opt.param_groups[0]["lr"]
        return out

    def _optimizer_step(self, model, opt, d: dict, loss_fn, sizes: dict) -> dict:
        """One optimizer step on a mini-batch, accumulating grads over its micro-batches.

        Losses are normalised by the mini-batch's global token (or sequence) count over all DP
        ranks, so the accumulated, DP-averaged gradient is exactly that of the whole mini-batch.
        """
        model.train()
        mask = d["response_mask"]
        counts = torch.tensor([mask.sum(), (mask.sum(1) > 0).sum()], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts, group=self.ps.get_data_parallel_group())
        agg = dict(global_num_tokens=counts[0].item(), global_num_seqs=counts[1].item(),
                   dp_size=self.ps.get_data_parallel_world_size())
        local_tokens = max(float(mask.sum()), 1.0)
        optim.zero_grad(model, opt)
        with record_function("actor/pack"):
            plan = self._micro_plan(mb.sample_lengths(d["attention_mask"]), sizes)
            packs = self._packs(d, mask.shape[1], plan)
            if model is self.model:  # the plan counts the policy's activations
                self._note_largest(packs)
            # everything the losses read goes to the device before the schedule starts, and the
            # stats stay there until it ends: no host sync between micro-batches
            micros = [{key: v[rows].to(self.device) for key, v in d.items() if key != "routes"} for rows, _ in plan]
            shares = [float(mask[rows].sum()) / local_tokens for rows, _ in plan]  # of this rank's tokens

        def loss_and_stats(out, k):
            loss, loss_stats, mean_stats = loss_fn(out, packs[k], micros[k], agg)
            return loss, {**{s: torch.as_tensor(v).detach().double() for s, v in loss_stats.items()},
                          **{s: shares[k] * torch.as_tensor(v).detach().double() for s, v in mean_stats.items()}}

        totals: dict[str, torch.Tensor] = {}
        routes = self._routes_hook(model, packs, replay=True, record=False) \
            if self.cfg["actor"]["routing_replay"] else None
        for stats in schedule.forward_backward(model, packs, loss_and_stats, tp_gather=model is not self.critic,
                                               before_forward=routes):
            for key, v in stats.items():
                totals[key] = totals.get(key, 0.0) + v
        for r in self.route_replays if routes is not None else ():
            r.reset()
        self.optimizer_states_ready()  # an onload may still be bringing them back in the background
        _, gnorm = optim.step(model, opt)  # DP/expert-DP/TP-SP/PP-embedding grad reductions, clipping, step
        values = torch.stack([v.to(self.device) for v in totals.values()]).tolist() if totals else []
        return {**dict(zip(totals, values)), "actor/grad_norm": gnorm}

    def _note_largest(self, packs: list[mb.Packed]) -> None:
        """The largest micro-batch this update has run, over every rank: its packed tokens (equal on
        all ranks), log-prob rows and longest sequence (each the max over micro-batches and ranks)."""
        seen = self._max_over_ranks(mb.largest(packs))
        self._largest_micro = {k: max(v, s) for (k, v), s in zip(self._largest_micro.items(), seen)}

    def _policy_loss(self, logits, packed, d, agg):
        from mcore_rl.algos.losses import agg_loss, kl_loss, policy_loss
        from mcore_rl.algos.utils import masked_mean

        a = self.cfg["actor"]
        mode = a["loss_agg_mode"]
        logp, ent = token_logprobs(logits, packed, self.cfg["rollout"]["temperature"], with_entropy=True,
                                   fused=self._fused_logprobs)
        mask = d["response_mask"]
        # seq-mean-token-sum-norm's constant: the longest response, unless set
        agg = dict(agg, loss_scale_factor=a["loss_scale_factor"] or self.cfg["rollout"]["max_response_len"])
        pg_loss, pg = policy_loss(d["old_log_probs"], logp, d["advantages"], mask,
                                  loss_mode=a["policy_loss"]["loss_mode"], clip_ratio_low=a["clip_ratio_low"],
                                  clip_ratio_high=a["clip_ratio_high"], clip_ratio_c=a["clip_ratio_c"],
                                  loss_agg_mode=mode, rollout_is_weights=d.get("rollout_is_weights"), **agg)
        loss, sums = pg_loss, {"actor/pg_loss": pg_loss.detach()}
        if a["entropy_coeff"]:
            loss = loss - a["entropy_coeff"] * agg_loss(ent, mask, mode, **agg)
        if a["use_kl_loss"]:
            kl = kl_loss(logp, d["ref_log_probs"], mask, a["kl_loss_type"], mode, **agg)
            loss = loss + a["kl_loss_coef"] * kl
            sums["actor/kl_loss"] = kl.detach()
        return loss, sums, {**pg, "actor/entropy": masked_mean(ent.detach(), mask)}

    def _value_loss(self, values, packed, d, agg):
        from mcore_rl.algos.losses import value_loss
        from mcore_rl.algos.utils import masked_mean

        vpreds = packed.at_responses(values[:, 0].float())
        mask = d["response_mask"]
        loss, clipfrac = value_loss(vpreds, d["returns"], d["values"], mask,
                                    cliprange_value=self.cfg["critic"]["cliprange_value"], **agg)
        return loss, {"critic/vf_loss": loss.detach()}, {"critic/vf_clipfrac": clipfrac,
                                                          "critic/vpred_mean": masked_mean(vpreds.detach(), mask)}
