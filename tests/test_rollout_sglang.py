"""SGLang's real engine behind mcore_rl's rollout interface, on CPU (what CI proves).

Engines run as Ray actors exactly as in training (`mcore_rl.rollout.launch.start_sglang`), from
tiny random HF models, and are checked against transformers (greedy tokens and the log-prob of
every generated token), against themselves (seeds, order over data-parallel engines, a TP=2
engine) and for failures (a hung and a killed engine are errors within the deadline, and no
engine process outlives shutdown).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import torch

from mcore_rl import config as C
from mcore_rl.rollout.base import EngineError, SamplingParams
from mcore_rl.rollout.group import EngineSlot
from mcore_rl.sync.plan import EngineLayout
from tests.tiny_models import make_hf_model

STOP = 7  # a token id that ends a response (the tiny models' configs say nothing about EOS)
PROMPTS = [[11, 12, 13, 14], [21, 22, 23], [31, 32, 33, 34, 35], [41, 42]]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from mcore_rl.rollout.sglang import engine_model_dir

    root = tmp_path_factory.mktemp("rollout_models")
    out = {}
    for fam in ("deepseek_v3", "qwen2"):
        hf = make_hf_model(fam, str(root / fam))
        out[fam] = (hf, engine_model_dir(str(root / fam), str(root / f"{fam}_engine"), [STOP], "cpu"))
    return out


def _cfg(**rollout) -> C.Config:
    return C.config_from_dict({"model": {"dtype": "fp32"}, "cluster": {"device": "cpu"},
                               "rollout": {"engine": "sglang", **rollout}})


def start(ray, model_dir: str, engines: int = 1, tp: int = 1, **rollout):
    """`engines` data-parallel SGLang engines of `tp` ranks, each on a bundle of its own."""
    from ray.util.placement_group import placement_group

    from mcore_rl.rollout.launch import start_sglang

    pg = placement_group([{"CPU": 1}] * engines)
    ray.get(pg.ready())
    slots = [EngineSlot(k, 0, pg, k, None, owns_pg=True) for k in range(engines)]
    return start_sglang(_cfg(tp_size=tp, **rollout), model_dir, slots, EngineLayout(tp, 1, 1, tp), 0)


def stop(ray, group):
    group.shutdown()


@pytest.fixture(scope="module")
def ds_two(ray_cluster, models):
    group = start(ray_cluster, models["deepseek_v3"][1], engines=2)
    yield group
    stop(ray_cluster, group)


def transformers_greedy(model, prompt: list[int], steps: int, stop_id: int = STOP):
    """Greedy tokens and their log-probs from transformers' forward, stopping after `stop_id`."""
    ids, logps = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(steps):
            logp = torch.log_softmax(model(ids).logits[0, -1].double(), -1)
            nxt = int(logp.argmax())
            ids, logps = torch.cat([ids, torch.tensor([[nxt]])], 1), logps + [float(logp[nxt])]
            if nxt == stop_id:
                break
    return ids[0, len(prompt):].tolist(), logps


def _check_against_transformers(group, hf_model, prompts=PROMPTS, steps=8):
    got = group.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=steps, stop_token_ids=(STOP,)))
    for p, (c,) in zip(prompts, got):
        tokens, logps = transformers_greedy(hf_model, p, steps)
        assert c.token_ids == tokens, (p, c.token_ids, tokens)
        assert max(abs(a - b) for a, b in zip(c.log_probs, logps)) < 1e-4
        assert c.finish_reason == ("stop" if tokens[-1] == STOP else "length")


def test_deepseek_greedy_tokens_and_logprobs_equal_transformers(ds_two, models):
    _check_against_transformers(ds_two, models["deepseek_v3"][0])


def test_samples_per_prompt_seeds_stop_ids_and_length(ds_two):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, stop_token_ids=(STOP, 3), seed=5)
    first = ds_two.generate(PROMPTS, params)
    assert [len(g) for g in first] == [4] * len(PROMPTS)
    again = ds_two.generate(PROMPTS, params)
    assert [[c.token_ids for c in g] for g in first] == [[c.token_ids for c in g] for g in again]
    other = ds_two.generate(PROMPTS, params.with_(seed=6))
    assert [[c.token_ids for c in g] for g in first] != [[c.token_ids for c in g] for g in other]
    flat = [c for g in first for c in g]
    assert len({tuple(c.token_ids) for c in flat}) > len(PROMPTS), "completions of one prompt are all equal"
    for c in flat:
        assert 1 <= len(c.token_ids) <= 12 and len(c.log_probs) == len(c.token_ids)
        assert all(lp <= 0 for lp in c.log_probs)
        early = [t for t in c.token_ids[:-1] if t in (STOP, 3)]
        assert not early, f"generation went on after a stop id: {c.token_ids}"
        assert (c.finish_reason == "stop") == (c.token_ids[-1] in (STOP, 3)), c
        assert c.finish_reason == "stop" or len(c.token_ids) == 12


def test_order_is_kept_across_two_engines(ds_two):
    """The same seeded requests on one engine and split over two give the same completions in order."""
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=17)
    split = ds_two.generate(PROMPTS, params)
    from mcore_rl.rollout.base import flatten

    one = ds_two.heads[0]
    alone = ds_two.ray.get(one.generate.remote(flatten(PROMPTS, params)))
    assert [c.token_ids for g in split for c in g] == [c.token_ids for c in alone]


def test_release_resume_then_generate(ds_two, models):
    ds_two.release()
    ds_two.resume(["weights"])
    ds_two.resume(["kv_cache", "cuda_graph"])
    _check_against_transformers(ds_two, models["deepseek_v3"][0], PROMPTS[:2], steps=4)
    assert all(h["alive"] and h["version"] == "0.5.20" for h in ds_two.health())


def test_tp2_engine_equals_transformers(ray_cluster, models):
    group = start(ray_cluster, models["qwen2"][1], engines=1, tp=2)
    try:
        _check_against_transformers(group, models["qwen2"][0])
        digests = group.weight_digests()[0]
        assert sorted(digests) == [0, 1]  # both ranks read back
        qkv = "model.layers.0.self_attn.qkv_proj.weight"
        assert digests[0][qkv][1] == [64, 64] and digests[0][qkv][3:] != digests[1][qkv][3:]  # split over TP
    finally:
        stop(ray_cluster, group)


def _engine_processes(group) -> list[psutil.Process]:
    pids = group.ray.get([a.child_pids.remote() for a in group.actors])
    return [psutil.Process(p) for ps in pids for p in ps if psutil.pid_exists(p)]


def test_hung_and_killed_engines_are_clear_errors(ray_cluster, models):
    group = start(ray_cluster, models["qwen2"][1], timeout_s=20)
    procs = _engine_processes(group)
    schedulers = [p for p in procs if "sglang" in " ".join(p.cmdline()).lower() or p.name().startswith("sglang")]
    victims = schedulers or procs
    try:
        for p in victims:
            p.send_signal(signal.SIGSTOP)  # a hung engine
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="did not finish generate within 20s"):
            group.generate(PROMPTS, SamplingParams(max_new_tokens=4))
        assert time.monotonic() - t0 < 40
        for p in victims:
            p.send_signal(signal.SIGCONT)
        errors = []
        long = threading.Thread(target=lambda: errors.append(_expect_error(group)))
        long.start()
        time.sleep(1.0)  # mid-rollout
        for p in victims:
            p.kill()
        long.join(timeout=60)
        assert not long.is_alive() and errors and "SGLang engine 0 node 0" in errors[0], errors
    finally:
        group.shutdown()
    time.sleep(2)
    left = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"engine processes outlived shutdown: {[p.pid for p in left]}"


def _expect_error(group) -> str:
    try:
        group.generate(PROMPTS * 8, SamplingParams(n=8, max_new_tokens=400, temperature=1.0))
    except EngineError as e:
        return str(e)
    return "no error"
