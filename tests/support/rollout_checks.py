"""What every rollout engine behind mcore_rl's interface must do, as checks the engines' test
modules (test_rollout_sglang, test_rollout_vllm) run against their real engines.

References are independent of the engine: transformers' forward for greedy tokens and log-probs,
the engine against itself for seeds and order, process signals for hung and killed engines.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import psutil
import pytest
import torch

from mcore_rl.config import sections as C
from mcore_rl.rollout.base import EngineError, SamplingParams, flatten
from mcore_rl.rollout.group import EngineSlot
from mcore_rl.sync.engine_layout import EngineLayout

STOP = 7  # a token id that ends a response (the tiny models' configs say nothing about EOS)
PROMPTS = [[11, 12, 13, 14], [21, 22, 23], [31, 32, 33, 34, 35], [41, 42]]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield ray
    ray.shutdown()


def rollout_cfg(engine: str, **rollout) -> C.Config:
    return C.config_from_dict({"model": {"dtype": "fp32"}, "cluster": {"device": "cpu"},
                               "rollout": {"engine": engine, **rollout}})


def start(ray, starter, engine: str, model_dir: str, engines: int = 1, tp: int = 1, **rollout):
    """`engines` data-parallel engines of `tp` ranks, each on a bundle of its own, started as
    training starts them (`starter`: `mcore_rl.rollout.launch.start_sglang` / `start_vllm`); the
    group removes the placement group at shutdown."""
    from ray.util.placement_group import placement_group

    pg = placement_group([{"CPU": 1}] * engines)
    ray.get(pg.ready())
    slots = [EngineSlot(k, 0, pg, k, None, owns_pg=True) for k in range(engines)]
    return starter(rollout_cfg(engine, tp_size=tp, **rollout), model_dir, slots, EngineLayout(tp, 1, 1, tp), 0)


def stop(ray, group):
    group.shutdown()


@contextlib.contextmanager
def running(ray, starter, engine: str, model_dir: str, **kwargs):
    group = start(ray, starter, engine, model_dir, **kwargs)
    try:
        yield group
    finally:
        stop(ray, group)


def make_models(root, families: tuple[str, ...], engine_model_dir) -> dict:
    """{family: (transformers model, the engine's model dir)} of tiny random models under `root`."""
    from tests.support.tiny_models import make_hf_model

    return {fam: (make_hf_model(fam, str(root / fam)),
                  engine_model_dir(str(root / fam), str(root / f"{fam}_engine"), [STOP], "cpu"))
            for fam in families}


def engine_fixtures(engine: str, starter, engine_model_dir, families: tuple[str, ...]):
    """An engine test module's two module fixtures: `models` (make_models of `families`, the MoE
    model first) and `ds_two` (two data-parallel engines of the MoE model, started by `starter`).
    Assign both at the module's top level: `models, ds_two = engine_fixtures(...)`."""

    @pytest.fixture(scope="module", name="models")
    def models(tmp_path_factory):
        return make_models(tmp_path_factory.mktemp("rollout_models"), families, engine_model_dir)

    @pytest.fixture(scope="module", name="ds_two")
    def ds_two(ray_cluster, models):
        with running(ray_cluster, starter, engine, models[families[0]][1], engines=2) as group:
            yield group

    return models, ds_two


class EngineContract:
    """What every engine passes, on its module's `models` and `ds_two` fixtures (engine_fixtures):
    the engine's test module subclasses it as `TestEngineContract`, with `moe` naming the MoE family."""

    moe: str

    def test_greedy_tokens_and_logprobs_equal_transformers(self, ds_two, models):
        check_against_transformers(ds_two, models[self.moe][0])

    def test_samples_per_prompt_seeds_stop_ids_and_length(self, ds_two):
        check_samples_seeds_stop_ids_and_length(ds_two)

    def test_order_is_kept_across_two_engines(self, ds_two):
        check_order_across_two_engines(ds_two)


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


def transformers_routes(model, tokens: list[int]) -> torch.Tensor:
    """[tokens, MoE layers, top-k] experts transformers' routers pick for each token of `tokens` (its
    DeepSeek gates' top-k indices, read by forward hooks), each token's set sorted."""
    picked, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):  # a dense layer has none
            hooks.append(layer.mlp.gate.register_forward_hook(
                lambda m, args, out, i=i: picked.__setitem__(i, out[-1].reshape(len(tokens), -1))))
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([picked[i] for i in sorted(picked)], 1).sort(-1).values


def check_against_transformers(group, hf_model, prompts=PROMPTS, steps=8):
    got = group.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=steps, stop_token_ids=(STOP,)))
    for p, (c,) in zip(prompts, got):
        tokens, logps = transformers_greedy(hf_model, p, steps)
        assert c.token_ids == tokens, (p, c.token_ids, tokens)
        assert max(abs(a - b) for a, b in zip(c.log_probs, logps)) < 1e-4
        assert c.finish_reason == ("stop" if tokens[-1] == STOP else "length")


def check_samples_seeds_stop_ids_and_length(group):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, stop_token_ids=(STOP, 3), seed=5)
    first = group.generate(PROMPTS, params)
    assert [len(g) for g in first] == [4] * len(PROMPTS)
    again = group.generate(PROMPTS, params)
    assert [[c.token_ids for c in g] for g in first] == [[c.token_ids for c in g] for g in again]
    other = group.generate(PROMPTS, params.with_(seed=6))
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
    # ignore_eos (rollout.ignore_eos): nothing ends a response, neither stop ids nor the engine's own EOS
    # (its config's, STOP here): the same seeded samples go on past where they stopped, to the length
    stopped = [c for c in flat if c.finish_reason == "stop"]
    assert stopped, "no completion stopped: the ignore_eos check below would prove nothing"
    full = [c for g in group.generate(PROMPTS, params.with_(stop_token_ids=(), ignore_eos=True)) for c in g]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in full), full
    assert all(f.token_ids[:len(c.token_ids)] == c.token_ids for f, c in zip(full, flat)), (full, flat)


def check_order_across_two_engines(group):
    """The same seeded requests on one engine and split over two give the same completions in order."""
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=17)
    split = group.generate(PROMPTS, params)
    alone = group.ray.get(group.heads[0].generate.remote(flatten(PROMPTS, params)))
    assert [c.token_ids for g in split for c in g] == [c.token_ids for c in alone]


def tp2_fixture(engine: str, starter, family: str, **rollout):
    """A module fixture `tp2`: one TP=2 engine of `family` (and `rollout` settings), for the TP=2 checks
    and then the hung-and-killed one (check_hung_and_killed), which ends it: one engine start for all.
    Assign it at the module's top level: `tp2 = tp2_fixture(...)`."""

    @pytest.fixture(scope="module", name="tp2")
    def tp2(ray_cluster, models):
        group = start(ray_cluster, starter, engine, models[family][1], tp=2, **rollout)
        yield group
        if group.actors:  # not ended by the hung-and-killed check
            group.shutdown()

    return tp2


def engine_processes(group) -> list[psutil.Process]:
    pids = group.ray.get([a.child_pids.remote() for a in group.actors])
    return [psutil.Process(p) for ps in pids for p in ps if psutil.pid_exists(p)]


def check_hung_and_killed(ray, group, victims: list[psutil.Process], label: str, timeout_s: int = 10):
    """SIGSTOP `victims` (a hung engine): generate fails at the deadline (`timeout_s`, the driver's
    rollout.timeout_s, which the group reads at each call); then SIGKILL them mid-rollout (a dead
    one): an EngineError naming the engine, well before the deadline. Afterwards no engine process
    outlives shutdown."""
    group.timeout_s = timeout_s
    procs = engine_processes(group)
    try:
        for p in victims:
            p.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=f"did not finish generate within {timeout_s}s"):
            group.generate(PROMPTS, SamplingParams(max_new_tokens=4))
        assert time.monotonic() - t0 < 2 * timeout_s
        for p in victims:
            p.send_signal(signal.SIGCONT)
        errors = []
        long = threading.Thread(target=lambda: errors.append(_expect_error(group)))
        long.start()
        time.sleep(1.0)  # mid-rollout
        for p in victims:
            p.kill()
        long.join(timeout=3 * timeout_s)
        assert not long.is_alive() and errors and f"{label} engine 0 node 0" in errors[0], errors
        assert "did not finish" not in errors[0], f"a dead engine was only caught by the deadline: {errors}"
    finally:
        group.shutdown()
    deadline = time.monotonic() + 2  # gone within 2 s of shutdown
    while (left := [p for p in procs if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"engine processes outlived shutdown: {[p.pid for p in left]}"


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _expect_error(group) -> str:
    try:
        group.generate(PROMPTS * 8, SamplingParams(n=8, max_new_tokens=400, temperature=1.0))
    except EngineError as e:
        return str(e)
    return "no error"
