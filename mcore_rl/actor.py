"""The Megatron actor: one process per GPU (gloo process on CPU) holding a shard of the policy.

Ranks of one group run every method together (the model's collectives span them); each rank
works on its data-parallel slice of a batch and the results are gathered by the driver.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _seq_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0):
    """Log-probs of tokens[:, 1:] under logits[:, :-1], and per-position entropy."""
    logits = logits[:, :-1].float() / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


class MegatronActor:
    def __init__(self, rank: int, world: int, master_port: int, hf_dir: str, cfg: dict):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world), TORCHDYNAMO_DISABLE="1")
        from megatron.core import parallel_state as ps

        from mcore_rl.models import HFModel, build_model, transformer_config
        from mcore_rl.parallel import Layout, init_distributed

        torch.set_num_threads(1)
        p = cfg["parallel"]
        self.layout = Layout(tp=p["tp"], pp=p["pp"], ep=p["ep"], etp=p["etp"])
        init_distributed(self.layout, seed=cfg["trainer"]["seed"])
        self.rank, self.ps = rank, ps
        self.hf = HFModel.from_dir(hf_dir)
        self.hf_dir = hf_dir
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg["model"]["dtype"]]
        tcfg = transformer_config(self.hf, tp=p["tp"], pp=p["pp"], ep=p["ep"], etp=p["etp"],
                                  dtype=dtype)
        self.model = build_model(self.hf, tcfg)
        # batches arrive and results leave on the host; the model's device does the work
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        a = cfg["actor"]
        self.cfg = cfg
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=a["lr"], weight_decay=a["weight_decay"],
                                     betas=(0.9, 0.999))

    # ---- data-parallel slicing -------------------------------------------------------------
    def _dp_slice(self, n: int) -> slice:
        dp, r = self.ps.get_data_parallel_world_size(), self.ps.get_data_parallel_rank()
        per = -(-n // dp)
        return slice(r * per, min(n, (r + 1) * per))

    def _is_reporter(self) -> bool:
        return self.ps.get_tensor_model_parallel_rank() == 0 and self.ps.is_pipeline_last_stage()

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        from mcore_rl.models.forward import full_logits

        if self.layout.pp != 1:
            raise NotImplementedError("pp > 1 training needs megatron's pipeline schedule")
        return full_logits(self.model, tokens)

    # ---- rollout (the embedded engine runs on the policy's own shards) ---------------------------
    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, max_new: int, temperature: float, seed: int):
        """Sample `max_new` tokens for this rank's slice of left-padded `prompts` [B, P]."""
        self.model.eval()
        tokens = prompts[self._dp_slice(len(prompts))].to(self.device)
        gen = torch.Generator(self.device).manual_seed(seed + self.ps.get_data_parallel_rank())
        for _ in range(max_new):
            logits = self._logits(tokens)[:, -1].float() / temperature
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
            # every TP rank must append the same token: take TP rank 0's choice
            dist.broadcast(nxt, self.ps.get_tensor_model_parallel_src_rank(),
                           group=self.ps.get_tensor_model_parallel_group())
            tokens = torch.cat([tokens, nxt], dim=1)
        return tokens.cpu() if self._is_reporter() else None

    @torch.no_grad()
    def log_probs(self, tokens: torch.Tensor):
        self.model.eval()
        tokens = tokens[self._dp_slice(len(tokens))].to(self.device)
        logp, _ = _seq_logprobs(self._logits(tokens), tokens)
        return logp.cpu() if self._is_reporter() else None

    # ---- update ----------------------------------------------------------------------------------
    def update(self, batch: dict) -> dict | None:
        from mcore_rl.algos.losses import policy_loss

        a = self.cfg["actor"]
        self.model.train()
        sl = self._dp_slice(len(batch["tokens"]))
        batch = {k: v[sl].to(self.device) for k, v in batch.items()}
        tokens, mask = batch["tokens"], batch["loss_mask"]
        adv, old = batch["advantages"], batch["old_log_probs"]
        logp, entropy = _seq_logprobs(self._logits(tokens), tokens)
        pg_loss, pg = policy_loss(old, logp, adv, mask, clip_ratio_low=a["clip_ratio_low"],
                                  clip_ratio_high=a["clip_ratio_high"], clip_ratio_c=a["clip_ratio_c"],
                                  loss_agg_mode=a["loss_agg_mode"])
        ent = (entropy * mask).sum() / mask.sum().clamp(min=1)
        loss = pg_loss - a["entropy_coeff"] * ent
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self._reduce_grads()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a["grad_clip"])
        self.opt.step()
        out = {"actor/pg_loss": loss.item(), "actor/entropy": ent.item(),
               "actor/grad_norm": float(gnorm), **{k: float(v) for k, v in pg.items()}}
        return out if self._is_reporter() else None

    def _reduce_grads(self):
        """Average grads over data-parallel replicas: dense params over DP, experts over expert-DP,
        and sequence-parallel norm weights over TP (each TP rank saw part of the sequence)."""
        ps = self.ps
        groups = {True: (ps.get_data_parallel_group(), ps.get_data_parallel_world_size()),
                  False: (ps.get_expert_data_parallel_group(), ps.get_expert_data_parallel_world_size())}
        for p in self.model.parameters():
            if p.grad is None:
                continue
            if getattr(p, "sequence_parallel", False) and self.layout.tp > 1:
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
            group, size = groups[getattr(p, "allreduce", True)]
            if size > 1:
                dist.all_reduce(p.grad, group=group)
                p.grad /= size

    # ---- checkpoints -----------------------------------------------------------------------------
    def save(self, step_dir: str):
        """Model (torch_dist, any layout can load it) and this rank's optimizer state."""
        from mcore_rl.checkpoint import save_model

        save_model(self.model, os.path.join(step_dir, "model"), side_files_from=None)
        os.makedirs(os.path.join(step_dir, "optim"), exist_ok=True)
        torch.save(self.opt.state_dict(), os.path.join(step_dir, "optim", f"rank{dist.get_rank()}.pt"))
        dist.barrier()

    def load(self, step_dir: str):
        from mcore_rl.checkpoint import load_model

        load_model(self.model, os.path.join(step_dir, "model"))
        optim = os.path.join(step_dir, "optim", f"rank{dist.get_rank()}.pt")
        if os.path.exists(optim):  # absent when starting from a converted HF model
            self.opt.load_state_dict(torch.load(optim, weights_only=True))
        dist.barrier()
