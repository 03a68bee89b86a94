"""Model-independent RL math: advantages, policy/value/entropy/KL losses, KL control."""

from mcore_rl.algos.advantages import (ESTIMATORS, compute_advantage, gae_advantage, grpo_advantage,
                                       reinforce_plus_plus_advantage,
                                       reinforce_plus_plus_baseline_advantage, rloo_advantage)
from mcore_rl.algos.kl import (AdaptiveKLController, FixedKLController, KLPenaltyResult,
                               apply_kl_in_reward, kl_estimate, make_kl_controller)
from mcore_rl.algos.dapo import overlong_penalty, varied_groups
from mcore_rl.algos.losses import (LOSS_AGG_MODES, POLICY_LOSS_MODES, agg_loss, entropy_from_logits, entropy_loss,
                                   kl_loss, policy_loss, value_loss)
from mcore_rl.algos.rollout_correction import compute_rollout_correction
from mcore_rl.algos.utils import group_ids, masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "ESTIMATORS", "compute_advantage", "gae_advantage", "grpo_advantage", "reinforce_plus_plus_advantage",
    "reinforce_plus_plus_baseline_advantage", "rloo_advantage", "AdaptiveKLController",
    "FixedKLController", "KLPenaltyResult", "apply_kl_in_reward", "kl_estimate", "make_kl_controller",
    "LOSS_AGG_MODES", "POLICY_LOSS_MODES", "agg_loss", "entropy_from_logits", "entropy_loss", "kl_loss",
    "policy_loss", "value_loss", "compute_rollout_correction", "overlong_penalty", "varied_groups", "group_ids", "masked_mean", "masked_sum", "masked_var", "masked_whiten",
]
