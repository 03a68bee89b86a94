"""mcore_rl: RL post-training for DeepSeek-V3-style MoE models on megatron-core."""

__version__ = "0.1.0"
