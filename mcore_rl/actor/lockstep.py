"""The ranks in lockstep: each rank's data-parallel slice of a batch, the rank that reports, and
micro-batch plans (how many, packed to what length) equal on every rank, since MoE token dispatch
and TP/SP collectives need them equal."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_rl.loop import micro_batches as mb


class Lockstep:
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

    @staticmethod
    def _added(batch: dict, added: dict | None) -> dict:
        """A step's batch as the driver holds it: the rows put in the object store once a step
        (loop.groups.SharedBatch), with the tensors added or replaced since."""
        return {**batch, **added} if added else batch

    def _local(self, batch: dict, keys) -> dict:
        """This rank's data-parallel rows of `batch`: sliced here from a whole batch, or as the driver
        sliced them (`dp_rows`: start, stop, of n), which must be this rank's."""
        if "dp_rows" not in batch:
            sl = self._dp_slice(len(batch["tokens"]))
            return {k: batch[k][sl] for k in keys if batch.get(k) is not None}
        start, stop, n = batch["dp_rows"]
        mine = self._dp_slice(n)
        if (mine.start, mine.stop) != (start, stop):
            raise RuntimeError(f"this rank was sent rows {start}:{stop} of {n}; its data-parallel rows are "
                               f"{mine.start}:{mine.stop}")
        return {k: batch[k] for k in keys if batch.get(k) is not None}
