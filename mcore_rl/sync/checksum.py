"""Weight-equality check after a sync: per-tensor digests on both sides, compared by name.

Off by default in production (it reads every byte once more); on in tests and the benchmark.
Digests are computed where the tensor lives (on GPU too): int64 sums of the raw 32-bit words,
plain and position-weighted. Integer addition wraps modulo 2^64 and is associative, so the result
does not depend on reduction order, and a moved or flipped word changes it.
"""

from __future__ import annotations

import torch


def digest(t: torch.Tensor) -> tuple[int, int, int]:
    """(bytes, sum of 32-bit words, position-weighted sum) of t's raw bytes; bit flips change it."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    pad = (-raw.numel()) % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    words = raw.view(torch.int32).to(torch.int64)
    pos = torch.arange(1, words.numel() + 1, device=words.device, dtype=torch.int64).remainder_(65521)
    return raw.numel() - pad, int(words.sum()), int((words * pos).sum())


def digests(named) -> dict[str, tuple[int, int, int]]:
    return {n: digest(t) for n, t in named}


class WeightMismatch(AssertionError):
    pass


def compare(expected: dict, actual: dict, where: str = "") -> None:
    """Raise WeightMismatch naming missing, unexpected and differing tensors."""
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    differ = sorted(n for n in set(expected) & set(actual) if expected[n] != actual[n])
    if missing or extra or differ:
        raise WeightMismatch(f"weight check failed{' on ' + where if where else ''}: {len(differ)} differ "
                             f"{differ[:5]}, {len(missing)} missing {missing[:5]}, {len(extra)} unexpected {extra[:5]}")
