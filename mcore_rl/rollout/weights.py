"""The driver's side of the weight sync: plan once, ship it to every trainer rank, run it after
each update, and check the engines to verify (after the first sync, then every N steps).

A sync that "succeeded" can leave a parameter stale (SGLang ignores weight names it does not
know), so every engine is checked in the way its kind allows (`READBACK` of its server class):
- "digests" (SGLang): every parameter of every engine rank, digested inside the engine's own
  processes, against what the trainer sent; a difference names the parameter.
- "logprobs" (vLLM, which repacks its weights past comparing): the engine's log-probs of fixed
  token sequences against the trainer's on the same sequences, within rollout.verify_logprob_tol.
"""

from __future__ import annotations

import os

import torch

from mcore_rl.config import sections as C
from mcore_rl.config import checks as config_checks
from mcore_rl.models.config import HFModel
from mcore_rl.parallel.groups import Layout, rendezvous_on
from mcore_rl.sync.checksum import WeightMismatch
from mcore_rl.sync.engine_layout import compare_engine, held_whole, replica_problems
from mcore_rl.sync.engine_layout import EngineLayout
from mcore_rl.sync.plan import SyncPlan, single_source
from mcore_rl.sync.session import SyncSpec, merge_expected

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class WeightSync:
    def __init__(self, cfg: C.Config, actors, engines, layout: EngineLayout,
                 feed: dict[int, tuple[int, int]] | None, where: list[dict], run_dir: str, hf_dir: str):
        """`feed`: colocated trainer rank -> (engine, tp rank) on its GPU; None for a single source."""
        self.actors, self.engines, self.verify_every = actors, engines, cfg.rollout.verify_sync_every
        kind = config_checks.transport_for(cfg)
        if kind == "ipc" and feed is None:
            raise C.ConfigError("rollout.sync_transport = 'ipc' needs colocated engines (cluster.colocate: true)")
        p = cfg.parallel
        hf = HFModel.from_dir(hf_dir)
        rank_of = {t: r for t, (_, r) in feed.items()} if kind == "ipc" else single_source(0)
        plan = SyncPlan.build(hf, Layout(p.tp, p.pp, p.ep, p.etp), len(where), layout, rank_of,
                              bucket_bytes=cfg.memory.sync_bucket_mb << 20, dtype=DTYPES[cfg.model.dtype],
                              weight_dtype=cfg.rollout.weight_dtype)
        master = rendezvous_on(actors.pg, 0) if kind == "broadcast" else None  # trainer rank 0's node
        spec = SyncSpec(plan, engines.weight_target(), kind, engines.engines,
                        slot_of={t: k * layout.tp_size + r for t, (k, r) in (feed or {}).items()},
                        master=master, disk_dir=os.path.join(run_dir, "sync_disk"), hf_dir=hf_dir,
                        timeout_s=cfg.rollout.timeout_s, direct_load=cfg.rollout.sync_load == "direct")
        actors.call("setup_sync", spec)
        self.whole = held_whole(plan.tensors, layout, hf)  # read back equal on every rank of an engine
        self.kind, self.syncs = kind, 0
        self.probe = probe_sequences(hf, rows=2 * (len(where) // (p.tp * p.pp)))
        self.tol, self.probe_on_verify = cfg.rollout.verify_logprob_tol, cfg.rollout.verify_sync_probe
        # a colocated engine has released its KV cache at every sync but the first: it cannot score
        # the probe then (SGLang's scheduler dies on a request without its KV pool), so its probe waits
        # for the KV cache's resume (`probe_if_due`, mcore_rl.loop.phases)
        self.kv_held_at_sync, self.probe_due = not cfg.cluster.colocate, False

    def __call__(self, step: int | None = None, verify: bool | None = None) -> dict:
        """Sync every weight into every engine; read back and compare when `verify`, by default
        after the first sync and every rollout.verify_sync_every steps. Returns metrics."""
        if verify is None:
            verify = self.syncs == 0 or (self.verify_every > 0 and step is not None and step % self.verify_every == 0)
        results = self.actors.call("sync_weights", verify and self.engines.readback == "digests")
        self.syncs += 1
        out = {"sync/seconds": max(r["seconds"] for r in results), "sync/bytes": sum(r["bytes"] for r in results),
               # of those seconds (slowest rank each): begin and end, gathers, sends, and in the
               # sends the driver's wait for the engine's calls beyond the gathers they overlap
               **{f"sync/{k}_seconds": max(r[f"{k}_seconds"] for r in results)
                  for k in ("begin_end", "gather", "send", "engine_call", "engine_wait")}}
        if any("trainer_max_reserved" in r for r in results):  # GPU: the largest rank's allocator peak
            out["memory/trainer_max_reserved_gib_sync"] = max(r["trainer_max_reserved"] for r in results) / 2**30
        if verify:
            out.update(self.verify(merge_expected(results)), **{"sync/verified": 1.0})
            self.probe_due = self.probe_on_verify
            if self.syncs == 1 or self.kv_held_at_sync:
                out.update(self.probe_if_due())
        return out

    def probe_if_due(self) -> dict:
        """The probe's metrics (rollout.verify_sync_probe) once after each read-back, with the
        engines serving; {} when none is due."""
        if not self.probe_due:
            return {}
        self.probe_due = False
        gaps = torch.cat(self._probe_gaps())
        return {"sync/probe_gap_mean": gaps.mean().item(), "sync/probe_gap_max": gaps.max().item()}

    def verify(self, expected: dict[int, dict[int, dict]]) -> dict:
        """`expected`: {engine: {tp rank: digests}} the trainer ranks sent (digest read-back only).
        Raises WeightMismatch listing the problems; returns the check's metrics."""
        check = self._digest_problems if self.engines.readback == "digests" else self._logprob_problems
        problems, metrics = check(expected)
        if problems:
            more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
            raise WeightMismatch("weight sync read-back failed:\n  " + "\n  ".join(problems[:8]) + more)
        return metrics

    def _digest_problems(self, expected: dict[int, dict[int, dict]]) -> tuple[list[str], dict]:
        actual = self.engines.weight_digests()
        return [problem for k, name in enumerate(self.engines.head_names)
                for problem in compare_engine(expected.get(k, {}), actual.get(k, {}), name)
                + replica_problems(actual.get(k, {}), self.whole, name)], {}

    def _probe_gaps(self) -> list[torch.Tensor]:
        """Each engine's |log-prob - the trainer's| on every token of the probe sequences."""
        ours = torch.cat(self.actors.call("log_probs", probe_batch(self.probe)))
        return [(ours - torch.tensor(theirs)).abs() for theirs in self.engines.prompt_logprobs(self.probe.tolist())]

    def _logprob_problems(self, expected=None) -> tuple[list[str], dict]:
        problems, worst = [], 0.0
        for name, gaps in zip(self.engines.head_names, self._probe_gaps()):
            gap = gaps.max().item()
            worst = max(worst, gap)
            if not gap <= self.tol:
                problems.append(f"{name}: its log-probs of the probe sequences differ from the trainer's by up to "
                                f"{gap:.2e} (tolerance {self.tol:.0e}): its weights are not the trainer's")
        return problems, {"sync/check_logprob_max_diff": worst}


def probe_sequences(hf: HFModel, rows: int, length: int = 32) -> torch.Tensor:
    """Fixed random token sequences [rows, length] (seeded: the same every sync) for the log-prob check."""
    length = min(length, hf.get("max_position_embeddings") or length)
    return torch.randint(0, hf.vocab_size, (rows, length), generator=torch.Generator().manual_seed(1234))


def probe_batch(tokens: torch.Tensor) -> dict:
    """The trainer's view of the probe: a one-token prompt, the rest as the response, untempered
    (the engine's prompt log-probs are)."""
    rows, length = tokens.shape
    return {"tokens": tokens, "attention_mask": torch.ones_like(tokens),
            "response_mask": torch.ones(rows, length - 1), "temperature": 1.0}
