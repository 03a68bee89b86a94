"""Checkpoint converters: HF <-> megatron-core torch_dist and checkpoint merges, streaming, single process
(`python -m mcore_rl.convert`). The HF <-> Megatron rule lists they expand are the models' own
(mcore_rl.models.mappings)."""
