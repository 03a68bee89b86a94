"""Megatron's parallel machinery: process groups (groups.py), DDP and the distributed optimizer (optimizer.py)."""
