"""Which attention-DP rank of one engine serves each request (SGLang's DP attention, `rollout.dp_attention`).

Each rank keeps its own KV and prefix (radix) cache. SGLang's own dispatch deals requests out round
robin, so the n samples of one prompt land on every rank and each rank prefills the prompt again;
a conversation's next turn lands on a rank that holds none of its KV. Here a prompt's requests (or,
with `Request.group` set, a group's: a multi-turn conversation's samples and their later turns)
go to one rank, the groups balanced over the ranks by requests, then tokens; a group seen before
keeps its rank.

On its rank a prompt's samples still arrive together: those in one prefill batch each compute it (so
on an engine without DP attention too), and under DP attention SGLang gives a rank's prefill batch
chunked_prefill_size / dp_size tokens (2K of a 4K prompt at our 8K, DP 4), so the others find only its
first chunk cached. A prompt asked more than once is therefore prefilled alone first
(`repeated_prompts`, SGLang's max_new_tokens=0, as SGLang's own parallel sampling does;
`SGLangServer.outputs`), and its samples then find all of it cached.
"""

from __future__ import annotations

import collections
from typing import Hashable, Mapping, Sequence

from mcore_rl.rollout.base import Request

REMEMBERED_GROUPS = 65536  # ranks kept for this many of the latest Request.group ids (far more than live at once)


def group_key(r: Request) -> Hashable:
    """Requests sharing a key share a prefix: the caller's group, else the same prompt."""
    return r.prompt if r.group is None else r.group


def assign_ranks(requests: Sequence[Request], ranks: int, known: Mapping[Hashable, int]) -> list[int]:
    """The rank of each request: a group's requests one rank, its `known` one if it has one (a
    conversation's later turn); the other groups, largest first, each on the rank with the fewest
    requests so far, of those the one with the fewest tokens (ties: the lowest rank). Requests first:
    a rank's decode batch is capped on its own (SGLang's max_running_requests is per rank), and one
    past it waits for a second wave; then the tokens they attend to (prompt and max_new_tokens each)."""
    members: dict[Hashable, list[int]] = {}
    for i, r in enumerate(requests):
        members.setdefault(group_key(r), []).append(i)
    size = {k: (len(idx), sum(len(requests[i].prompt) + requests[i].params.max_new_tokens for i in idx))
            for k, idx in members.items()}
    load, rank_of = [(0, 0)] * ranks, {}

    def place(k, d):
        rank_of[k] = d
        load[d] = (load[d][0] + size[k][0], load[d][1] + size[k][1])

    for k in members:
        if k in known and 0 <= known[k] < ranks:
            place(k, known[k])
    for k in sorted((k for k in members if k not in rank_of), key=lambda k: size[k], reverse=True):
        place(k, min(range(ranks), key=lambda d: load[d]))
    return [rank_of[group_key(r)] for r in requests]


class RankAffinity:
    """assign_ranks with a memory: the rank of each of the latest REMEMBERED_GROUPS `Request.group` ids
    (prompt-keyed groups are not remembered: a prompt asked again later is a new group, placed afresh)."""

    def __init__(self, ranks: int, remember: int = REMEMBERED_GROUPS):
        self.ranks, self.remember = ranks, remember
        self.known: collections.OrderedDict[Hashable, int] = collections.OrderedDict()

    def assign(self, requests: Sequence[Request]) -> list[int]:
        out = assign_ranks(requests, self.ranks, self.known)
        for r, rank in zip(requests, out):
            if r.group is not None:
                self.known[r.group] = rank
                self.known.move_to_end(r.group)
        while len(self.known) > self.remember:
            self.known.popitem(last=False)
        return out


def by_rank(ranks_of: Sequence[int]) -> dict[int, list[int]]:
    """{rank: the indices of its requests, in request order} for the ranks that have any."""
    out: dict[int, list[int]] = {}
    for i, d in enumerate(ranks_of):
        out.setdefault(d, []).append(i)
    return out


def repeated_prompts(requests: Sequence[Request]) -> list[list[int]]:
    """The prompts more than one of `requests` has, each once, in request order."""
    counts = collections.Counter(r.prompt for r in requests)
    return [list(p) for p, k in counts.items() if k > 1]
