"""tests/gpu: checks that need a CUDA GPU. Skipped where none is visible (CI, laptops); the lent GPU
machines run them (scripts/gpu/session.sh)."""
import pytest


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "/tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
