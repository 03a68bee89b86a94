"""Weight-equality check after a sync: per-tensor digests on both sides, compared by name.

Off by default in production (it reads every byte once more); on after the first sync of a run
and in tests and benchmarks. Digests are computed where the tensor lives (on GPU too, in chunks):
int64 sums of the raw 16-bit words, plain and weighted by position (mod 65521); 1-byte
dtypes (FP8 weights) are summed byte by byte, so a piece at an odd offset still lines up. Integer addition
is associative, so the result does not depend on reduction order, and a moved or flipped word
changes it. Given the element offset of a piece inside a larger tensor, the piece's digest is its
share of the whole tensor's: pieces add up (mod 2^64) to the digest of what they tile, so the
sync can check a fused SGLang parameter without ever building it.
"""

from __future__ import annotations

import torch

_MOD = 65521
_CHUNK = 1 << 24  # words per pass: bounds the int64 temporaries on the device


def digest(t: torch.Tensor, offset: int = 0) -> tuple[int, int, int]:
    """(bytes, sum of 16-bit words (bytes for 1-byte dtypes), position-weighted sum) of t's raw bytes, t placed at element
    `offset` of a larger contiguous tensor of its dtype."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    if t.element_size() == 1:
        words, first = raw, offset  # this piece's first word in the whole tensor
    else:
        if raw.numel() % 2:
            raw = torch.cat([raw, raw.new_zeros(1)])
        words, first = raw.view(torch.int16), offset * t.element_size() // 2
    plain = weighted = 0
    for start in range(0, words.numel(), _CHUNK):
        w = words[start:start + _CHUNK].to(torch.int64)
        pos = torch.arange(first + start + 1, first + start + 1 + w.numel(), device=w.device,
                           dtype=torch.int64).remainder_(_MOD)
        plain += int(w.sum())
        weighted += int((w * pos).sum())
    mask = (1 << 64) - 1
    return t.numel() * t.element_size(), plain & mask, weighted & mask


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
