"""Checkpoints: models through megatron's dist_checkpointing (model.py), optimizer states in model space (optimizer.py), a run's step_N directories (steps.py)."""
