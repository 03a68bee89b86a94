"""SGLang's real engine behind mcore_rl's rollout interface, on CPU (what CI proves).

Engines run as Ray actors exactly as in training (`mcore_rl.rollout.launch.start_sglang`), from
tiny random HF models, and are checked (`tests.support.rollout_checks`) against transformers (greedy
tokens and the log-prob of every generated token), against themselves (seeds, order over
data-parallel engines, a TP=2 engine) and for failures (a hung and a killed engine are errors
within the deadline, and no engine process outlives shutdown).
"""

from __future__ import annotations

import os

import pytest
import torch

from mcore_rl.parallel.groups import LISTEN_PORTS
from mcore_rl.rollout.launch import start_sglang
from mcore_rl.rollout.sglang import engine_model_dir
from tests.support import rollout_checks as R
from tests.support.rollout_checks import ray_cluster  # noqa: F401 - a fixture

models, ds_two = R.engine_fixtures("sglang", start_sglang, engine_model_dir, ("deepseek_v3", "qwen2"))
# an engine argument of SGLang's own, passed through: that engine returns hidden states on request
tp2 = R.tp2_fixture("sglang", start_sglang, "qwen2", engine_kwargs={"enable_return_hidden_states": True})


class TestEngineContract(R.EngineContract):
    moe = "deepseek_v3"


def test_release_resume_then_generate(ds_two, models):
    ds_two.release()
    ds_two.resume(["weights"])
    ds_two.resume(["kv_cache", "cuda_graph"])
    R.check_against_transformers(ds_two, models["deepseek_v3"][0], R.PROMPTS[:2], steps=4)
    assert all(h["alive"] and h["version"] == "0.5.20" for h in ds_two.health())


def test_release_right_after_generate(ds_two):
    """SGLang asserts idleness inside its scheduler on release, and that assert killing the scheduler
    took the engine down (CI, and 1 in 5 tries here) when release followed generate at once."""
    from mcore_rl.rollout.base import SamplingParams

    for _ in range(12):
        ds_two.generate(R.PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0, seed=None))
        ds_two.release()
        ds_two.resume()
    assert all(h["alive"] for h in ds_two.health())


def test_a_conversation_stays_on_its_engine(ds_two):
    """Two engines: a group's requests (a prompt's conversations) go to one engine, and its later turn
    to the same one, whose prefix cache holds its prompt (SGLang's cached_tokens), even where a fresh
    placement would put it on the other; a new group meanwhile takes what is free, and a prompt asked
    three times is prefilled once, first, so that each of the three finds it cached."""
    from mcore_rl.rollout.base import Request, SamplingParams, new_group
    from mcore_rl.rollout.dp_routing import assign_ranks

    a, b, c = list(range(20, 60)), list(range(215, 245)), [5, 6, 7, 8, 9] * 14  # no token in common
    greedy, groups = SamplingParams(temperature=0.0, max_new_tokens=2), (new_group(), new_group())
    turn1 = ds_two.generate_requests([Request(tuple(p), greedy, g) for p, g in zip((a, b), groups) for _ in range(2)])
    assert [t.cached_tokens for t in turn1] != [None] * 4
    turn2 = [Request(tuple(c), greedy, new_group())] * 3 + \
            [Request(tuple(p + t.token_ids + [k]), greedy, g) for p, t, g, k in zip((a, b), turn1[::2], groups, (250, 251))]
    engine_of_a = ds_two.affinity.known[groups[0]]
    assert assign_ranks(turn2, 2, {})[3] != engine_of_a  # c, new and largest, would take a's engine
    got = ds_two.generate_requests(turn2)
    assert got[3].cached_tokens >= len(a) and got[4].cached_tokens >= len(b), [t.cached_tokens for t in got]
    assert [t.cached_tokens for t in got[:3]] == [len(c) - 1] * 3  # c prefilled once, first: each sample finds it


def test_engine_processes_are_forked_from_their_actor(ds_two):
    """On CPU an engine's scheduler and detokenizer are forked from its Ray actor, inheriting its
    imports; spawned, each imported SGLang, torch and transformers again (7-11 s of CPU apiece)."""
    procs = R.engine_processes(ds_two)
    assert len(procs) >= 4, procs  # two engines: a scheduler and a detokenizer each
    spawned = [" ".join(p.cmdline()) for p in procs if "spawn_main" in " ".join(p.cmdline())]
    assert not spawned, spawned


def test_tp2_engine_equals_transformers(tp2, models):
    R.check_against_transformers(tp2, models["qwen2"][0])
    lo, hi = LISTEN_PORTS  # the ranks met at our port, not at SGLang's ephemeral pick
    assert all(lo <= h["nccl_port"] < hi for h in tp2.health()), tp2.health()
    digests = tp2.weight_digests()[0]
    assert sorted(digests) == [0, 1]  # both ranks read back
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert digests[0][qkv][1] == [64, 64] and digests[0][qkv][3:] != digests[1][qkv][3:]  # split over TP


def _routes_by_rank(server, prompts, lengths):
    """Run in an engine actor: (output ids, attention-DP rank, routed experts) of each greedy request."""
    from mcore_rl.rollout.sglang import decode_routes

    outs = server.engine.generate(input_ids=prompts, return_routed_experts=True,
                                  sampling_params=[{"max_new_tokens": n, "temperature": 0.0} for n in lengths])
    return [(o["output_ids"], o["meta_info"]["dp_rank"],
             decode_routes(o["meta_info"], len(p) + len(o["output_ids"]) - 1, *server.route_shape, "SGLang"))
            for p, o in zip(prompts, outs)]


def test_a_dp_attention_engine_equals_transformers_and_each_rank_holds_what_the_layout_places(ray_cluster, models):
    """One TP2 engine with SGLang's DP attention and EP 2 (rollout.dp_attention; the CPU stand-ins of
    mcore_rl.rollout.sglang_cpu): its two ranks serve their own requests, routed a prompt's samples or a
    conversation's turns to one rank (check_dp_affinity), and the greedy tokens and log-probs are
    transformers'. The experts it returns for each token (R3, actor.routing_replay) are
    those transformers' routers pick, on both ranks, through batches the ranks pad to each other's
    and steps where one is idle. Each rank, read back, holds what the sync's layout places there:
    attention, embeddings, lm_head and the dense MLP whole (the experts aside: SGLang's CPU engine pads
    this model's at tp 2; tests/e2e/test_sglang_sync.py checks them, and our sync, bit for bit)."""
    import glob

    from ray.util.placement_group import placement_group
    from safetensors.torch import load_file

    from mcore_rl.models.config import HFModel
    from mcore_rl.rollout.group import EngineSlot
    from mcore_rl.sync.engine_layout import EngineLayout, ExpectedDigests, compare_engine

    hf_model, model_dir = models["deepseek_v3"]
    pg = placement_group([{"CPU": 1}])
    ray_cluster.get(pg.ready())
    layout = EngineLayout(2, 2, 1, 2, attn_dp_size=2)
    # a rank's prefill batch (SGLang's chunked_prefill_size / dp_size) 32 tokens, less than check_dp_affinity's
    # 48-token prompts, as 2K of our default 8192 at DP 4 is to 4K-token prompts; the other checks' are shorter
    cfg = R.rollout_cfg("sglang", tp_size=2, ep_size=2, dp_attention=True, chunked_prefill_size=64,
                        engine_kwargs={"enable_return_routed_experts": True})
    group = start_sglang(cfg, model_dir, [EngineSlot(0, 0, pg, 0, None, owns_pg=True)], layout, 0)
    try:
        R.check_against_transformers(group, hf_model)
        check_dp_affinity(group, hf_model)
        # 7 requests of 1-9 tokens, 2-8 steps each: dealt 4 and 3, decodes padded to the other rank's, then one idle
        prompts = R.PROMPTS + [[51, 52, 53, 54, 55, 56, 57, 58, 59], [61], [71, 72, 73, 74, 75, 76]]
        got = ray_cluster.get(group.heads[0].__ray_call__.remote(_routes_by_rank, prompts, [8, 3, 6, 2, 8, 5, 7]))
        assert {rank for _, rank, _ in got} == {0, 1}
        moe = [i for i, layer in enumerate(hf_model.model.layers) if hasattr(layer.mlp, "gate")]
        for p, (out, rank, routes) in zip(prompts, got):
            engine = torch.as_tensor(routes[:, moe]).sort(-1).values
            assert torch.equal(engine.long(), R.transformers_routes(hf_model, p + out[:-1]).long()), (p, rank)
        expected = ExpectedDigests(layout, HFModel.from_dir(model_dir), [0, 1])
        for f in glob.glob(os.path.join(model_dir, "*.safetensors")):
            expected.add(load_file(f).items())
        read = group.weight_digests()[0]

        def outside_experts(by_rank):
            return {r: {p: d for p, d in got.items() if "experts." not in p} for r, got in by_rank.items()}

        assert not compare_engine(outside_experts(expected.digests), outside_experts(read), "dp attention engine")
        kv_b = "model.layers.1.self_attn.kv_b_proj.weight"
        assert read[0][kv_b][1] == list(hf_model.state_dict()[kv_b].shape) and read[0][kv_b][3:] == read[1][kv_b][3:]
    finally:
        group.shutdown()


def _served(server, requests, routed: bool = True):
    """Run in an engine actor: each request's (attention-DP rank, cached prompt tokens, output ids) as
    SGLang's meta_info reports them; routed by mcore_rl.rollout.dp_routing, or else by SGLang's own dispatch."""
    from mcore_rl.rollout.sglang import sampling_dict

    outs = server.outputs(requests) if routed else server.engine.generate(
        input_ids=[list(r.prompt) for r in requests], sampling_params=[sampling_dict(r) for r in requests])
    return [(o["meta_info"]["dp_rank"], o["meta_info"]["cached_tokens"], list(o["output_ids"])) for o in outs]


def check_dp_affinity(group, hf_model):
    """On a DP-attention engine (2 ranks, a prefill batch of 32 tokens a rank): a prompt's samples go to one
    rank, the prompts to both, and every sample finds the prompt in that rank's prefix cache (SGLang's
    cached_tokens); a conversation's next turn goes to the rank of its first, whose cache holds its prompt,
    even where a fresh placement would swap the ranks. SGLang's own dispatch (round robin) spreads each
    group over both ranks, each rank prefills the prompt, and samples in one prefill batch find only its
    first chunk; the greedy tokens are transformers' either way."""
    from mcore_rl.rollout.base import Request, SamplingParams, flatten, new_group
    from mcore_rl.rollout.dp_routing import assign_ranks

    def served(requests, routed=True):
        return group.ray.get(group.heads[0].__ray_call__.remote(_served, requests, routed))

    a, b = list(range(60, 108)), list(range(150, 190))  # no token in common
    greedy = SamplingParams(temperature=0.0, max_new_tokens=2)
    samples = served(flatten([a, b], greedy.with_(n=4)))  # GRPO's shape: prompt-major, no group
    ranks = [d for d, _, _ in samples]
    assert ranks == [0] * 4 + [1] * 4, ranks  # a, the heavier, to rank 0 (SGLang's own numbering)
    for p, got in ((a, samples[:4]), (b, samples[4:])):  # prefilled once, first: every sample finds it cached
        assert [k for _, k, _ in got] == [len(p) - 1] * 4, samples  # (SGLang computes a prompt's last token)
        assert all(o == R.transformers_greedy(hf_model, p, 2)[0] for _, _, o in got), samples
    c = list(range(110, 150))
    spread = served(flatten([c], greedy.with_(n=4)), routed=False)
    assert {d for d, _, _ in spread} == {0, 1} and {d for d, k, _ in spread if k == 0} == {0, 1}, spread
    groups = new_group(), new_group()
    turn1 = served([Request(tuple(p), greedy, g) for p, g in zip((a, b), groups) for _ in range(4)])
    assert [d for d, _, _ in turn1] == ranks
    out_a, out_b = turn1[0][2], turn1[4][2]
    # turn 2: each conversation its own observation; b's now long, so a fresh placement would swap the ranks
    turn2 = [Request(tuple(a + out_a + [200 + k]), greedy, groups[0]) for k in range(4)] + \
            [Request(tuple(b + out_b + [210 + k] * 20), greedy, groups[1]) for k in range(4)]
    assert assign_ranks(turn2, 2, {}) == [1] * 4 + [0] * 4
    kept = served(turn2)
    assert [d for d, _, _ in kept] == ranks, kept
    assert all(c >= len(p) for (_, c, _), p in zip(kept, [a] * 4 + [b] * 4)), kept  # the prompt from the cache
    theirs = served(turn2, routed=False)
    assert all(len({d for d, _, _ in theirs[k:k + 4]}) == 2 for k in (0, 4)), theirs  # each group on both ranks
    assert min(c for _, c, _ in theirs[:4]) < len(a), theirs  # a prefilled again on the rank without it
    assert [o for _, _, o in theirs] == [o for _, _, o in kept]
    print(f"dp affinity, cached tokens: a call's {[k for _, k, _ in samples]} (SGLang's dispatch "
          f"{[k for _, k, _ in spread]}), a later turn's {[k for _, k, _ in kept]} (SGLang's {[k for _, k, _ in theirs]})")


def _hidden_states(server):
    """Run in an engine actor: SGLang's hidden states of a prompt's tokens, asked of the engine itself."""
    out = server.engine.generate(input_ids=[[11, 12, 13]], sampling_params={"max_new_tokens": 2, "temperature": 0.0},
                                 return_hidden_states=True)
    return out[0]["meta_info"]["hidden_states"]


def test_engine_kwargs_reach_the_engine(tp2, ds_two):
    """rollout.engine_kwargs.enable_return_hidden_states (tp2's config): that engine answers a request for
    hidden states with a 64-wide row for each token it generates; ds_two, started without it, refuses."""
    import numpy as np
    import pytest

    hidden = tp2.ray.get(tp2.heads[0].__ray_call__.remote(_hidden_states))
    rows = np.concatenate([np.asarray(h, dtype=np.float32).reshape(-1, 64) for h in hidden])
    assert rows.shape == (2, 64) and np.isfinite(rows).all() and np.abs(rows).sum() > 0, rows.shape  # a row a token out
    with pytest.raises(Exception, match="not configured to return hidden states"):
        ds_two.ray.get(ds_two.heads[0].__ray_call__.remote(_hidden_states))
    assert all(h["alive"] for h in ds_two.health())


@pytest.mark.alone  # timing: the call's bound, twice the deadline
def test_hung_and_killed_engines_are_clear_errors(ray_cluster, tp2):  # noqa: F811 - fixtures
    """On the TP=2 engine (both ranks' schedulers hung, then killed); last: it ends that engine."""
    procs = R.engine_processes(tp2)
    schedulers = [p for p in procs if "sglang" in " ".join(p.cmdline()).lower() or p.name().startswith("sglang")]
    R.check_hung_and_killed(ray_cluster, tp2, schedulers or procs, "SGLang")
