"""Which attention-DP rank serves each request (mcore_rl.rollout.dp_routing): a prompt's samples, or a
group's requests, on one rank; groups balanced by requests, then tokens; a group's later requests on its rank. What
SGLang's engine does with the placement (one rank's prefix cache serving a group) is proven on its real
CPU engine in tests/e2e/test_rollout_sglang.py."""

from __future__ import annotations

import itertools

from mcore_rl.rollout.base import Request, SamplingParams, flatten, new_group
from mcore_rl.rollout.dp_routing import RankAffinity, assign_ranks, by_rank, repeated_prompts


def prompt(length: int, first: int) -> list[int]:
    return list(range(first, first + length))


def loads(requests, ranks_of, ranks: int) -> list[tuple[int, int]]:
    """(requests, tokens) per rank, tokens as each request attends to them: its prompt and max_new_tokens."""
    out = [(0, 0)] * ranks
    for r, d in zip(requests, ranks_of):
        out[d] = (out[d][0] + 1, out[d][1] + len(r.prompt) + r.params.max_new_tokens)
    return out


def best_makespan(weights: list[int], ranks: int, per_rank: int) -> int:
    """The least possible largest load with `per_rank` groups on every rank, by trying every placement."""
    return min(max(sum(w for w, d in zip(weights, place) if d == k) for k in range(ranks))
               for place in itertools.product(range(ranks), repeat=len(weights))
               if all(place.count(k) == per_rank for k in range(ranks)))


def test_a_prompts_samples_share_a_rank_and_prompts_balance_by_requests_then_tokens():
    """The target shape in small: 8 prompts x 8 samples over 4 ranks (prompt-major, as flatten makes them)."""
    lengths = [4096, 512, 3000, 3900, 800, 2048, 1500, 4000]
    prompts = [prompt(n, 1000 * k) for k, n in enumerate(lengths)]
    requests = flatten(prompts, SamplingParams(n=8, max_new_tokens=256))
    ranks_of = assign_ranks(requests, 4, {})
    for k in range(8):
        assert len(set(ranks_of[8 * k:8 * k + 8])) == 1, (k, ranks_of)  # all 8 samples on one rank
    # SGLang's own round robin puts every prompt on every rank: each prefilled 4 times
    assert all(len({i % 4 for i in range(8 * k, 8 * k + 8)}) == 4 for k in range(8))
    got = loads(requests, ranks_of, 4)
    assert [n for n, _ in got] == [16] * 4  # every rank's decode batch a quarter of the requests
    weights = [8 * (n + 256) for n in lengths]
    assert sum(t for _, t in got) == sum(weights)
    # largest first, onto the lightest rank: here the best of the placements of two prompts a rank
    assert max(t for _, t in got) == best_makespan(weights, 4, per_rank=2), (got, weights)


def test_requests_count_before_tokens():
    """Three long prompts and five short ones over 4 ranks: by tokens alone the short ones would all share
    one rank, whose 40 requests would decode in two waves where each rank runs 16."""
    lengths = [6000, 6000, 6000, 500, 500, 500, 500, 500]
    requests = flatten([prompt(n, 10_000 * k) for k, n in enumerate(lengths)], SamplingParams(n=8, max_new_tokens=256))
    got = loads(requests, assign_ranks(requests, 4, {}), 4)
    assert [n for n, _ in got] == [16] * 4, got


def test_identical_prompts_of_different_prompt_indices_are_one_group_and_one_rank():
    requests = flatten([[5, 6, 7], [9, 9], [5, 6, 7]], SamplingParams(n=2, max_new_tokens=4))
    ranks_of = assign_ranks(requests, 2, {})
    assert ranks_of[0] == ranks_of[1] == ranks_of[4] == ranks_of[5] != ranks_of[2] == ranks_of[3]


def test_known_groups_keep_their_rank_and_new_ones_fill_around_them():
    long_known = [Request(tuple(prompt(1000, 0)), SamplingParams(max_new_tokens=10), group=7)] * 3
    new = [Request(tuple(prompt(200, 5000 + 1000 * k)), SamplingParams(max_new_tokens=10), group=k) for k in range(3)]
    ranks_of = assign_ranks(long_known + new, 2, {7: 0})
    assert ranks_of[:3] == [0, 0, 0]  # kept, although rank 1 is empty
    assert ranks_of[3:] == [1, 1, 1]  # 3 requests on rank 0 already: the three new (one each) go to rank 1
    # a remembered rank beyond this engine's ranks is no placement: placed afresh
    assert assign_ranks(long_known, 2, {7: 5}) == [0, 0, 0]


def test_a_conversation_keeps_its_rank_over_its_turns():
    """Multi-turn: turn 1 places each prompt's conversations together; later turns (longer, different
    prompts per conversation, some conversations ended) keep them there, where their KV is, even where
    a fresh placement would balance otherwise."""
    affinity = RankAffinity(ranks=2)
    groups = [new_group() for _ in range(3)]
    params = SamplingParams(max_new_tokens=8)
    turn1 = [Request(tuple(prompt(n, 100 * g)), params, groups[g]) for g, n in ((0, 30), (1, 20), (2, 20))
             for _ in range(2)]
    first = affinity.assign(turn1)
    assert first == [0, 0, 1, 1, 1, 1]
    # turn 2: group 2's conversations ended; group 0 and 1 go on with their own tokens
    turn2 = [Request(tuple(prompt(30, 0) + [7, c, 8, 9]), params, groups[0]) for c in range(2)] + \
            [Request(tuple(prompt(20, 100) + [c] * 40), params, groups[1]) for c in range(2)]
    assert affinity.assign(turn2) == [0, 0, 1, 1]
    assert assign_ranks(turn2, 2, {}) != [0, 0, 1, 1]  # fresh, the heavier group 1 would go to rank 0
    # a prompt asked again in a later call (no group) is placed afresh, not where it was
    again = flatten([prompt(30, 0), prompt(50, 900)], SamplingParams(n=2, max_new_tokens=8))
    assert affinity.assign(again) == assign_ranks(again, 2, {}) == [1, 1, 0, 0]


def test_the_memory_holds_the_latest_groups_only():
    affinity = RankAffinity(ranks=2, remember=3)
    for g in range(5):
        affinity.assign([Request((1, 2, g), SamplingParams(), group=g)])
    assert list(affinity.known) == [2, 3, 4]


def test_by_rank_keeps_request_order_within_a_rank():
    assert by_rank([1, 0, 1, 1, 0]) == {1: [0, 2, 3], 0: [1, 4]}
    assert by_rank([]) == {}


def test_repeated_prompts_are_each_prefilled_once():
    requests = flatten([[1, 2], [3], [1, 2]], SamplingParams(n=2)) + [Request((4, 5)), Request((1, 2), group=3)]
    assert repeated_prompts(requests) == [[1, 2], [3]]
    assert repeated_prompts(flatten([[1], [2]], SamplingParams(n=1))) == []
