"""Checkpoint converters: HF <-> megatron-core torch_dist, and the mappings they share."""
