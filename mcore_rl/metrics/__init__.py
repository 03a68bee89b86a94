"""What a run reports: per-step metrics to jsonl/TensorBoard/W&B (logger.py), the console line (console.py), the training curves (plot.py)."""
