"""Megatron-core models built from HuggingFace configs, and what each family maps, needs and checks."""
