"""The run's typed config: its sections, loading and overrides (sections.py), and its cross checks against the cluster and the model (checks.py)."""
