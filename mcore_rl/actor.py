"""The Megatron actor: one process per GPU (gloo process on CPU) holding a shard of the policy,
and, colocated in the same process like verl's default, the frozen reference policy and the critic.

Ranks of one group run every method together (the model's collectives span them); each rank
works on its data-parallel slice of a batch and the results are gathered by the driver.
Micro-batches are packed without padding (mcore_rl.batching); every rank runs the same number
of micro-batches of the same packed length, because MoE token dispatch and TP/SP collectives
need the ranks in lockstep. Forward and backward passes run through megatron's own schedule
(mcore_rl.pipeline), so with pipeline parallelism outputs, losses and stats exist on the last
stage, whose TP rank 0 reports them.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import record_function

from mcore_rl import batching as mb
from mcore_rl import compat, optim, pipeline
from mcore_rl.config import recompute_choice

compat.quiet_fallback_warnings()  # before megatron is imported: rank 0 names what is missing once


def token_logprobs(logits: torch.Tensor, packed: mb.Packed, temperature: float, with_entropy: bool = False,
                   fused: bool = False):
    """Log-probs [mb, R] of the response tokens (and their entropies) from packed logits [T, V].

    Only the positions that predict response tokens are normalised over the vocabulary. fused: the
    same numbers through mcore_rl.head (no fp32 [rows, V] copies kept for backward).
    """
    target = packed.response_targets
    if fused:
        from mcore_rl.head import logprob_entropy

        logp_sel, ent_sel = logprob_entropy(logits, target, temperature, with_entropy, index=packed.response_rows)
    else:
        rows = logits[packed.response_rows]
        logp_all = F.log_softmax(rows.float() / temperature, dim=-1)
        logp_sel = logp_all.gather(-1, target[:, None]).squeeze(-1)
        ent_sel = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    logp = packed.scatter_responses(logp_sel)
    return logp, packed.scatter_responses(ent_sel) if with_entropy else None


class MegatronActor:
    def __init__(self, rank: int, world: int, master_port: int, hf_dir: str, cfg: dict,
                 master_addr: str = "127.0.0.1", init: dict | None = None):
        """init: torch_dist checkpoints to start from, {"policy": dir|None, "critic": dir|None};
        without one the policy keeps megatron's seeded init and the critic copies the policy."""
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world))
        if not torch.cuda.is_available():  # compiling costs more than it saves on CPU (mcore_rl.models.fused)
            os.environ["TORCHDYNAMO_DISABLE"] = "1"
        from megatron.core import parallel_state as ps

        from mcore_rl.models import HFModel, build_model, transformer_config
        from mcore_rl.parallel import Layout, init_distributed

        torch.set_num_threads(1)
        from mcore_rl.memory.allocator import use_expandable_segments

        use_expandable_segments(cfg["memory"]["expandable_segments"])  # before anything is allocated
        if rank == 0:
            print(compat.accelerators_line(), flush=True)
        init = init or {}
        p = cfg["parallel"]
        self.layout = Layout(tp=p["tp"], pp=p["pp"], ep=p["ep"], etp=p["etp"])
        init_distributed(self.layout, seed=cfg["trainer"]["seed"])
        self.rank, self.ps, self.cfg = rank, ps, cfg
        self.hf = HFModel.from_dir(hf_dir)
        self.hf_dir = hf_dir
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg["model"]["dtype"]]
        bias = {"moe_router_bias_update_rate": cfg["actor"]["router_bias_update_rate"]} if self.hf.num_experts else {}
        mode, layers, modules = recompute_choice(cfg["memory"])
        tcfg = transformer_config(self.hf, tp=p["tp"], pp=p["pp"], ep=p["ep"], etp=p["etp"], dtype=dtype,
                                  recompute=mode, recompute_layers=layers, recompute_modules=modules, **bias)
        attention = self.packed_attention
        self.model = build_model(self.hf, tcfg, attention=attention)
        # batches arrive and results leave on the host; the model's device does the work
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        if init.get("policy"):
            from mcore_rl.checkpoint import load_model

            load_model(self.model, init["policy"])
        self._install_route_replay(cfg)
        a, alg = cfg["actor"], cfg["algorithm"]
        self.ref, self.ref_offload = None, None
        if a["use_kl_loss"] or alg["use_kl_in_reward"]:  # a frozen copy of the initial policy
            self.ref = build_model(self.hf, tcfg, attention=attention).eval().requires_grad_(False)
            self.ref.load_state_dict(self.model.state_dict())
            if cfg["memory"]["offload_ref"] and self.device.type == "cuda":
                from mcore_rl.memory.offload import StateOffloader

                self.ref_offload = StateOffloader(list(self.ref.parameters()) + list(self.ref.buffers()))
                self.ref_offload.offload()
        self.critic = None
        if cfg["critic"]["enabled"]:
            self._build_critic(cfg, tcfg, init.get("critic"))
        self.model, self.opt = optim.wrap(self.model, tcfg, a, **self._optim_options())
        self.updates = 0
        self._peaks: dict[str, float] = {}  # allocator peaks per pass of the train phase (GPU)
        from mcore_rl.optim_state import regions

        # where each param's elements sit in the checkpoint's tensors; made now, while the params are
        # on the device (a save may run while they are offloaded)
        self._regions = {name: regions(model) for name, model, _ in self._parts()}

    def _install_route_replay(self, cfg: dict) -> None:
        """With routes coming back from the engine (SGLang, MoE): the policy's routers replay them
        (actor.routing_replay) and record their own choice in the old-log-prob pass."""
        from mcore_rl.routing import ExpertLayout

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
        from mcore_rl.routing import agreement_counts

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

    def _optim_options(self) -> dict:
        """optim.wrap's switches from the actor and memory sections; null ones follow the device."""
        a, m = self.cfg["actor"], self.cfg["memory"]
        gpu = self.device.type == "cuda"
        on = lambda v: gpu if v is None else v  # noqa: E731
        return dict(grad_fp32=m["grad_fp32"], fused_adam=on(a["fused_adam"]),
                    overlap_grad_reduce=on(a["overlap_grad_reduce"]), bucket_size=a["grad_bucket_size"],
                    offload_fraction=m["optimizer_offload_fraction"])

    @property
    def packed_attention(self) -> str:
        v = self.cfg["actor"]["packed_attention"]
        return ("varlen" if torch.cuda.is_available() else "sdpa") if v is None else v

    @property
    def _fused_logprobs(self) -> bool:
        v = self.cfg["actor"]["fused_logprobs"]
        return self.device.type == "cuda" if v is None else v

    def _build_critic(self, cfg, tcfg, init_ckpt):
        from mcore_rl import critic
        from mcore_rl.models import HFModel, transformer_config

        c, p = cfg["critic"], cfg["parallel"]
        hf = self.hf
        if c["hf_path"] and os.path.abspath(c["hf_path"]) != os.path.abspath(self.hf_dir):
            hf = HFModel.from_dir(c["hf_path"])
            tcfg = transformer_config(hf, tp=p["tp"], pp=p["pp"], ep=p["ep"], etp=p["etp"],
                                      dtype=tcfg.params_dtype)
        model = critic.build_critic(hf, tcfg)
        if init_ckpt:
            critic.load_trunk(model, init_ckpt)
        else:
            critic.copy_trunk(self.model, model)
        self.critic, self.critic_opt = optim.wrap(model, tcfg, c, **self._optim_options())

    # ---- lockstep helpers -----------------------------------------------------------------------
    def _dp_slice(self, n: int) -> slice:
        dp, r = self.ps.get_data_parallel_world_size(), self.ps.get_data_parallel_rank()
        per = -(-n // dp)
        return slice(min(n, r * per), min(n, (r + 1) * per))

    def _is_reporter(self) -> bool:
        return self.ps.get_tensor_model_parallel_rank() == 0 and self.ps.is_pipeline_last_stage()

    def _max_over_ranks(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def _pack(self, d: dict, response_len: int, rows: list[int], pad_to: int) -> mb.Packed:
        return mb.pack(d["tokens"], d["attention_mask"], response_len, rows, pad_to,
                       routes=d.get("routes")).to(self.device)

    def _sizes(self, section: str) -> dict:
        """Per-rank mini-batch, micro-batch and packed-token budget of 'actor' or 'critic' (the
        critic's unset ones follow the actor's, as in verl)."""
        a, s = self.cfg["actor"], self.cfg[section]
        pick = lambda key: a[key] if s.get(key) is None else s[key]  # noqa: E731
        mini = pick("ppo_mini_batch_size") * self.cfg["rollout"]["n"] // self.ps.get_data_parallel_world_size()
        return dict(mini=mini, micro=s["micro_batch_size"], max_tokens=pick("ppo_max_token_len_per_gpu"))

    def _micro_plan(self, lengths: list[int], sizes: dict) -> list[tuple[list[int], int]]:
        """Micro-batches (sample indices) and the packed length each is padded to, equal on all ranks."""
        count = 1
        while True:
            if self.cfg["actor"]["use_dynamic_bsz"]:
                bins = mb.balanced_micro_batches(lengths, sizes["max_tokens"], count)
            else:
                bins = mb.fixed_micro_batches(len(lengths), sizes["micro"], count)
            hi, neg_lo = self._max_over_ranks([len(bins), -len(bins)])
            if hi == -neg_lo:
                break
            count = hi  # some rank needs more micro-batches: everyone repacks into that many
        tp = self.layout.tp
        pads = self._max_over_ranks([sum(lengths[i] for i in b) for b in bins])
        return list(zip(bins, [-(-t // tp) * tp for t in pads]))  # SP splits the sequence over TP

    def _packs(self, d: dict, response_len: int, plan) -> list[mb.Packed]:
        return [self._pack(d, response_len, rows, pad_to) for rows, pad_to in plan]

    def _from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as the last pipeline stage's TP rank 0 holds it, on every rank (in place)."""
        ps = self.ps
        if self.layout.pp > 1:
            dist.broadcast(t, ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        dist.broadcast(t, ps.get_tensor_model_parallel_src_rank(), group=ps.get_tensor_model_parallel_group())
        return t

    def _local(self, batch: dict, keys) -> dict:
        sl = self._dp_slice(len(batch["tokens"]))
        return {k: batch[k][sl] for k in keys if batch.get(k) is not None}

    # ---- what rollout engines need from the trainer ------------------------------------------------
    def run(self, fn, *args):
        """`fn(self, *args)` on this rank: code that works on its shards (the embedded engine)."""
        return fn(self, *args)

    def where(self) -> dict:
        """This rank's node and device: engines are placed on (colocated) or matched to them."""
        import ray

        ctx = ray.get_runtime_context()
        out = {"rank": self.rank, "node": ctx.get_node_id(), "ip": ray.util.get_node_ip_address()}
        if self.device.type == "cuda":
            from mcore_rl.sync.placement import local_gpu_slot

            out.update(gpu_ids=[str(g) for g in ray.get_gpu_ids()], uuid=local_gpu_slot(out["node"]).gpu_uuid)
        else:  # a gloo process stands in for a GPU: a name unique to it
            out.update(gpu_ids=[], uuid=f"cpu-{out['node'][:8]}-{self.rank}")
        return out

    def setup_sync(self, spec) -> None:
        """Plan, live shards and transport for syncing into the rollout engines, built once.
        Offloaded weights are read from their host copies (streamed bucket by bucket)."""
        from mcore_rl.sync.session import SyncSession

        read = self._state_offloader().read if self.device.type == "cuda" else None
        self.sync_session = SyncSession(self.model, spec, read=read)

    def sync_weights(self, verify: bool = False) -> dict:
        return self.sync_session.run(verify)

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

    # ---- per-token outputs of the policy, the reference and the critic ---------------------------
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
        for (rows, _), got in zip(plan, pipeline.forward(model, packs, per_token, tp_gather=not values,
                                                         before_forward=routes)):
            if rows:
                out[rows] = got.cpu()
        if routes is not None:
            self._collect_routes(d, packs)
        return out if self._is_reporter() else None

    def _allocator_peak(self, name: str) -> None:
        """Record this process's allocator peaks since the last record (GPU), then reset them."""
        if self.device.type == "cuda":
            self._peaks[f"memory/trainer_max_allocated_gib_{name}"] = torch.cuda.max_memory_allocated() / 2**30
            self._peaks[f"memory/trainer_max_reserved_gib_{name}"] = torch.cuda.max_memory_reserved() / 2**30
            torch.cuda.reset_peak_memory_stats()

    def log_probs(self, batch: dict):
        out = self._per_response_token(self.model, batch, values=False)
        self._allocator_peak("old_log_prob")
        return out

    def ref_log_probs(self, batch: dict):
        if self.ref_offload is None:
            return self._per_response_token(self.ref, batch, values=False)
        self.ref_offload.onload()
        try:
            return self._per_response_token(self.ref, batch, values=False)
        finally:
            self.ref_offload.offload()

    def values(self, batch: dict):
        return self._per_response_token(self.critic, batch, values=True)

    # ---- updates ---------------------------------------------------------------------------------
    def update(self, batch: dict) -> dict | None:
        """PPO epochs over mini-batches of the policy; returns averaged metrics."""
        self._writes_done()
        a = self.cfg["actor"]
        keys = ("tokens", "attention_mask", "response_mask", "advantages", "old_log_probs", "ref_log_probs",
                "rollout_is_weights", "routes")
        out = self._epochs(self.model, self.opt, self._local(batch, keys), self._policy_loss, a["ppo_epochs"],
                           self._sizes("actor"), warmup=a["lr_warmup_steps"], base_lr=a["lr"])
        if self.ref is not None and a["use_kl_loss"]:
            out["actor/kl_coef"] = a["kl_loss_coef"]
        self._allocator_peak("update")
        out.update(self._peaks)  # onload, old log-probs and update: where the train phase's peak comes from
        return out if self._is_reporter() else None

    def update_critic(self, batch: dict) -> dict | None:
        self._writes_done()
        c = self.cfg["critic"]
        keys = ("tokens", "attention_mask", "response_mask", "values", "returns")
        out = self._epochs(self.critic, self.critic_opt, self._local(batch, keys), self._value_loss,
                           c["ppo_epochs"], self._sizes("critic"))
        return {k.replace("actor/", "critic/"): v for k, v in out.items()} if self._is_reporter() else None

    def _epochs(self, model, opt, d: dict, loss_fn, epochs: int, sizes: dict, warmup: int = 0,
                base_lr: float | None = None) -> dict:
        mini = sizes["mini"]
        totals: dict[str, float] = {}
        steps = 0
        for _ in range(epochs):
            for chunk in mb.mini_batches(len(d["tokens"]), mini):
                if warmup:  # linear warmup over optimizer steps
                    for g in opt.param_groups:
                        g["lr"] = base_lr * min(1.0, (self.updates + 1) / warmup)
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
        for stats in pipeline.forward_backward(model, packs, loss_and_stats, tp_gather=model is not self.critic,
                                               before_forward=routes):
            for key, v in stats.items():
                totals[key] = totals.get(key, 0.0) + v
        for r in self.route_replays if routes is not None else ():
            r.reset()
        _, gnorm = optim.step(model, opt)  # DP/expert-DP/TP-SP/PP-embedding grad reductions, clipping, step
        values = torch.stack([v.to(self.device) for v in totals.values()]).tolist() if totals else []
        return {**dict(zip(totals, values)), "actor/grad_norm": gnorm}

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

    # ---- checkpoints -----------------------------------------------------------------------------
    def _parts(self):
        parts = [("model", self.model, self.opt)]
        if self.critic is not None:
            parts.append(("critic", self.critic, self.critic_opt))
        return parts

    def save(self, step_dir: str, background: bool = False) -> None:
        """Models (torch_dist, any layout can load them) and this rank's optimizer states in model
        space (`mcore_rl.optim_state`: any layout can resume them) into `step_dir`. Offloaded
        states are written from their pinned host copies: a save stages nothing. background: the
        writes go on in a thread (the rollout runs meanwhile); `finish_save` completes them, and
        anything that would change the states first waits for them."""
        from mcore_rl.checkpoint import ModelSave
        from mcore_rl.optim_state import save as save_optim

        self.finish_save()
        read = self._state_offloader().read if self.device.type == "cuda" else None
        os.makedirs(os.path.join(step_dir, "optim"), exist_ok=True)
        saves = [ModelSave(model, os.path.join(step_dir, name), read=read) for name, model, _ in self._parts()]

        def write():
            with _no_crc32():  # the manifest's sizes catch a truncated file; CRC32 took most of a save's time
                for (name, model, opt), ms in zip(self._parts(), saves):
                    ms.write()
                    extra = {"updates": self.updates} if name == "model" else {}
                    path = os.path.join(step_dir, "optim", f"{name}.rank{dist.get_rank()}.pt")
                    save_optim(opt, model, path, extra, read, self._regions[name])

        self._pending_save = _Writer(write, saves)
        if not background:
            self.finish_save()

    def finish_save(self) -> None:
        """Wait for a save's writes and complete it (every rank calls this; collective)."""
        pending, self._pending_save = getattr(self, "_pending_save", None), None
        if pending is not None:
            pending.finish()
            dist.barrier()

    def _writes_done(self) -> None:
        """Before the states change (update, onload, offload): a background save has read them."""
        pending = getattr(self, "_pending_save", None)
        if pending is not None:
            pending.join()

    def load(self, step_dir: str) -> None:
        from mcore_rl.checkpoint import load_model
        from mcore_rl.optim_state import files, load

        self.finish_save()
        for name, model, opt in self._parts():
            load_model(model, os.path.join(step_dir, name))
            extra = load(opt, model, files(step_dir, name), self._regions[name])
            if name == "model":
                self.updates = int(extra.get("updates", 0))
            if self._optim_options()["fused_adam"]:
                optim.use_fused_adam(opt)  # the loaded steps onto the device
        dist.barrier()


@contextlib.contextmanager
def _no_crc32():
    """torch.save without its per-record CRC32 (torch >= 2.6; a no-op before): 4x faster writes.
    Process-wide while it lasts, so megatron's forked writers inherit it."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # pragma: no cover - older torch
        yield
        return
    old, config.save.compute_crc32 = config.save.compute_crc32, False
    try:
        yield
    finally:
        config.save.compute_crc32 = old


class _Writer:
    """A save's file writes in a thread; `finish` joins it, re-raises its error and runs the
    collective completions (megatron's metadata) in the calling thread."""

    def __init__(self, write, saves):
        import threading

        self.saves, self.error = saves, None
        self.thread = threading.Thread(target=self._run, args=(write,), name="checkpoint-writer", daemon=True)
        self.thread.start()

    def _run(self, write):
        try:
            write()
        except BaseException as e:  # noqa: BLE001 - surfaced by join()
            self.error = e

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def finish(self) -> None:
        self.join()
        for s in self.saves:
            s.finalize()
