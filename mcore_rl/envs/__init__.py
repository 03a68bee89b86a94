"""Example environments for multi-turn rollouts (rollout.env; mcore_rl/rollout/multiturn.py)."""
