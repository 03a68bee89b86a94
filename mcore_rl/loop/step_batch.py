"""The step batch on the driver: `StepBatch` (what a batch source gives a step), made from the
engine's completions, scored, given rewards (with the optional KL penalty) and advantages,
corrected against the engine's log-probs, and measured (data metrics named like verl's, so
dashboards line up); `step_seed`, the seed of a step's sampling.

A batch is a dict of tensors over B samples: tokens [B, P + R] (left-padded prompts, then
responses), attention_mask [B, P + R], and response-aligned [B, R] tensors (response_mask,
rollout/old/ref log-probs, values, advantages, returns).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mcore_rl.config import sections as C
from mcore_rl.algos.advantages import compute_advantage
from mcore_rl.algos.dapo import overlong_penalty
from mcore_rl.algos.kl import apply_kl_in_reward, make_kl_controller
from mcore_rl.algos.rollout_correction import compute_rollout_correction
from mcore_rl.rollout.base import SamplingParams
from mcore_rl.models.routed_experts import batch_routes


@dataclass
class StepBatch:
    """One step's scored rollout. batch: the tensors above; idx: each sample's prompt index (each
    prompt rollout.n times in a row); score: each sample's rule score; reward: the score after
    reward shaping (what advantages use); metrics: what the rollout measured."""

    batch: dict
    idx: list[int]
    score: torch.Tensor
    reward: torch.Tensor
    metrics: dict = field(default_factory=dict)
    # every sampled token: rollout correction may take some out of batch["response_mask"] later
    sampled_mask: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.sampled_mask = self.batch["response_mask"]


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of step `step` of a run seeded `seed` (trainer.seed); also orders its refills."""
    return seed * 100003 + step


def pad_prompts(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [B, P] and their mask (1 on real tokens)."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def rollout(engine, source, idx: list[int], params, experts=None) -> dict:
    """Sample one completion per entry of `idx` (prompt indices, each repeated rollout.n times in a
    row) with the rollout engine, as a batch: tokens [B, P + R] (left-padded prompts, responses
    right-padded to the longest), attention_mask, response_mask (1 up to and including the stop
    token; a multi-turn completion's 0 on the environment's tokens) and the engine's log-probs of its sampled tokens (rollout_log_probs). experts (an
    mcore_rl.models.routed_experts.ExpertLayout, when the engine returns routes): also the engine's routes."""
    return completions_batch(source, idx, sample(engine, source, idx, params), experts,
                             getattr(engine, "label", "the rollout engine"))


def sample(engine, source, idx: list[int], params) -> list:
    """The engine's Completions of the prompts `idx` (each repeated rollout.n times in a row), one a sample."""
    n = params.n
    firsts = idx[::n]
    if [i for i in firsts for _ in range(n)] != idx:
        raise ValueError(f"prompt indices must come in runs of rollout.n = {n}")
    return [c for group in engine.generate([source.prompts[i] for i in firsts], params) for c in group]


def completions_batch(source, idx: list[int], done: list, experts=None, engine_label: str = "the rollout engine"
                      ) -> dict:
    """`rollout`'s batch from the Completions `done` of the prompts `idx` (one per sample)."""
    tok = source.tokenizer
    prompts, pmask = pad_prompts([source.prompts[i] for i in idx], tok.pad_token_id or 0)
    R = max(1, max(len(c.token_ids) for c in done))
    resp = torch.full((len(done), R), tok.pad_token_id or 0, dtype=torch.long)
    attended = torch.zeros(len(done), R, dtype=torch.long)  # every response token, the environment's too
    resp_mask = torch.zeros(len(done), R)  # the model's tokens: what the loss, KL and advantages see
    logps = torch.zeros(len(done), R)
    for i, c in enumerate(done):
        k = len(c.token_ids)
        resp[i, :k] = torch.as_tensor(c.token_ids, dtype=torch.long)
        attended[i, :k] = 1
        resp_mask[i, :k] = 1 if c.loss_mask is None else torch.as_tensor(c.loss_mask, dtype=torch.float32)
        logps[i, :k] = torch.as_tensor(c.log_probs, dtype=torch.float32)
    batch = {"tokens": torch.cat([prompts, resp], 1), "attention_mask": torch.cat([pmask, attended], 1),
             "response_mask": resp_mask, "rollout_log_probs": logps}
    if experts is not None:
        batch["routes"] = batch_routes(done, [len(source.prompts[i]) for i in idx], batch["tokens"].shape[1],
                                       experts, engine_label)
    return batch


def sampling_params(cfg: C.Config, source, seed: int, validation: bool = False):
    """The rollout's SamplingParams: EOS of the prompts' tokenizer plus rollout.stop_token_ids stop a
    response; with rollout.ignore_eos nothing does (each runs to max_response_len)."""
    r = cfg.rollout
    return SamplingParams(n=r.val_n if validation else r.n, temperature=r.val_temperature if validation else r.temperature,
                          top_p=1.0 if validation else r.top_p, max_new_tokens=r.max_response_len,
                          stop_token_ids=() if r.ignore_eos else stop_ids(cfg, source.tokenizer),
                          ignore_eos=r.ignore_eos, seed=seed if r.seeded else None)


def stop_ids(cfg: C.Config, tokenizer) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return tuple(dict.fromkeys(([eos] if eos is not None else []) + list(cfg.rollout.stop_token_ids)))


def scores(source, idx: list[int], batch: dict) -> torch.Tensor:
    """One outcome score per sample, from its response up to (and including) the first EOS."""
    R = batch["response_mask"].shape[1]
    lengths = batch["response_mask"].sum(1).long().tolist()
    responses = [r[:n] for r, n in zip(batch["tokens"][:, -R:].tolist(), lengths)]
    return torch.tensor(source.rewards(idx, responses), dtype=torch.float32)


def reward_shaping(cfg: C.Config, batch: dict) -> torch.Tensor:
    """What is added to each sample's score: DAPO's overlong penalty (reward.overlong_buffer), or 0."""
    ob = cfg.reward.overlong_buffer
    lengths = batch["response_mask"].sum(1)
    if not ob.enable:
        return torch.zeros_like(lengths)
    return overlong_penalty(lengths, cfg.rollout.max_response_len, ob.len, ob.penalty_factor)


def correction_settings(cfg: C.Config) -> dict:
    """algorithm.rollout_correction, with actor.tis_imp_ratio_cap (verl's older key) as token-level TIS.
    With no correction of its own, token-level TIS comes on where the engine samples from a policy
    measurably off the trainer's: an off-policy trainer.mode with decoupled_loss (the behaviour weight
    of decoupled PPO; the trainer's old log-probs are then the proximal policy), and FP8 engine weights
    (rollout.weight_dtype: fp8)."""
    corr = cfg.algorithm.rollout_correction.model_dump()
    if cfg.actor.tis_imp_ratio_cap is not None:
        corr.update(rollout_is="token", rollout_is_threshold=cfg.actor.tis_imp_ratio_cap)
    elif corr["rollout_is"] is None and ((cfg.trainer.mode != "sync" and cfg.trainer.decoupled_loss)
                                         or (cfg.rollout.weight_dtype == "fp8" and corr["rollout_rs"] is None)):
        corr["rollout_is"] = "token"
    return corr


def correction_line(cfg: C.Config) -> str | None:
    """The log line saying which correction an FP8 rollout trains with (None for bf16 rollout)."""
    if cfg.rollout.weight_dtype != "fp8":
        return None
    corr = correction_settings(cfg)
    on = {k: v for k, v in corr.items() if v is not None and k != "rollout_is_batch_normalize"}
    return (f"rollout.weight_dtype=fp8: rollout correction {on} (token TIS unless configured otherwise); "
            "rollout/logp_diff_abs_mean and rollout/token_mult_prob_error show the FP8 gap")


def correct_rollout(cfg: C.Config, batch: dict) -> dict:
    """Rollout correction against the engine's log-probs: batch["rollout_is_weights"] for the
    policy loss and, with rejection, the response mask the updates use (after advantages and the
    data metrics, which see every sampled token). Returns the rollout_corr/* metrics."""
    corr = correction_settings(cfg)
    if corr["rollout_is"] is None and corr["rollout_rs"] is None:
        return {}
    weights, batch["response_mask"], metrics = compute_rollout_correction(
        batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], **corr)
    if weights is not None:
        batch["rollout_is_weights"] = weights
    return metrics


def scored(cfg: C.Config, source, idx: list[int], batch: dict, score: torch.Tensor | None = None):
    """(batch, idx, score, reward) of a generated batch: rule scores (unless given: a conversation's
    come from its environment), and rewards after shaping."""
    score = scores(source, idx, batch) if score is None else score.float()
    return batch, idx, score, score + reward_shaping(cfg, batch)


def advantages(cfg: C.Config, batch: dict, score: torch.Tensor, idx: list[int], kl_ctrl=None) -> dict:
    """Token-level rewards (score on the last response token, minus beta * KL when
    algorithm.use_kl_in_reward) -> batch["advantages"], batch["returns"]; returns metrics."""
    alg, mask = cfg.algorithm, batch["response_mask"]
    token_scores = torch.zeros_like(mask)
    last = last_token(mask)
    token_scores[torch.arange(len(mask)), last] = score
    metrics = {}
    rewards = token_scores
    if alg.use_kl_in_reward:
        res = apply_kl_in_reward(token_scores, batch["old_log_probs"], batch["ref_log_probs"], mask, kl_ctrl,
                                 kind=alg.kl_penalty)
        rewards = res.token_level_rewards
        metrics.update({"critic/kl": res.mean_kl, "critic/kl_coeff": res.kl_coef})
    adv, ret = compute_advantage(alg.adv_estimator, rewards, mask, index=torch.tensor(idx), values=batch.get("values"),
                                 gamma=alg.gamma, lam=alg.lam, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo)
    batch.update(advantages=adv, returns=ret)
    return {**metrics, **data_metrics(batch, score, rewards)}


def last_token(mask: torch.Tensor) -> torch.Tensor:
    """[B] column of each row's last masked-in token (0 for an empty row): where the outcome score
    goes. A multi-turn mask has gaps (the environment's tokens), so this is not its sum minus one."""
    cols = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), cols, torch.zeros_like(cols)).max(1).values


def _masked_stats(name: str, x: torch.Tensor, mask: torch.Tensor) -> dict:
    vals = x[mask.bool()]
    if vals.numel() == 0:
        return {}
    return {f"{name}/mean": vals.mean().item(), f"{name}/max": vals.max().item(), f"{name}/min": vals.min().item()}


def data_metrics(batch: dict, score: torch.Tensor, rewards: torch.Tensor) -> dict:
    mask = batch["response_mask"]
    lengths = mask.sum(1)
    out = {"critic/score/mean": score.mean().item(), "critic/rewards/mean": rewards.sum(1).mean().item(),
           "response/length_max": lengths.max().item(), "response/length_min": lengths.min().item(),
           **_masked_stats("critic/advantages", batch["advantages"], mask),
           **_masked_stats("critic/returns", batch["returns"], mask)}
    if batch.get("values") is not None:
        out.update(_masked_stats("critic/values", batch["values"], mask))
        ret, val = batch["returns"][mask.bool()], batch["values"][mask.bool()]
        out["critic/vf_explained_var"] = (1 - (ret - val).var() / (ret.var() + 1e-5)).item()
    if batch.get("rollout_log_probs") is not None and batch.get("old_log_probs") is not None:
        out.update(mismatch_metrics(batch["rollout_log_probs"][mask.bool()], batch["old_log_probs"][mask.bool()]))
    return out


def mismatch_metrics(engine: torch.Tensor, trainer: torch.Tensor) -> dict:
    """How far the engine's log-probs of its sampled response tokens are from the trainer's (same
    weights): absolute gaps, NeMo-RL's token_mult_prob_error (mean exp|gap|, 1 when equal) and the
    k3 estimate of KL(rollout || trainer) on the rollout's own samples (r = trainer - engine)."""
    if engine.numel() == 0:
        return {}
    gap = (trainer - engine).double()
    return {"rollout/logp_diff_abs_mean": gap.abs().mean().item(),
            "rollout/logp_diff_abs_max": gap.abs().max().item(),
            "rollout/token_mult_prob_error": gap.abs().exp().mean().item(),
            "rollout/kl_k3": (gap.exp() - 1 - gap).mean().item()}


def kl_controller(cfg: C.Config, coef: float | None = None):
    """algorithm.kl_ctrl's controller, continuing from a checkpointed coefficient when given."""
    if not cfg.algorithm.use_kl_in_reward:
        return None
    ctrl = make_kl_controller(**cfg.algorithm.kl_ctrl.model_dump())
    if coef is not None:
        ctrl.value = coef
    return ctrl
