"""Converter behaviour beyond parity: bad input is refused before any write, FP8 and MTP import,
the CLI, and bounded memory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_rl.convert import hf_mcore as convert
from mcore_rl.convert.hf_io import CheckpointError, HFCheckpoint, dequantize_fp8
from mcore_rl.models.config import LayoutError, UnsupportedModelError
from tests.support.tiny_models import FP8_WEIGHT, make_fp8_variant, make_hf_model


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    d = tmp_path_factory.mktemp("v3") / "hf"
    make_hf_model("deepseek_v3", str(d))
    return d


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _assert_no_output(out):
    parent = os.path.dirname(out)
    assert not os.path.exists(out), "partial output left behind"
    assert not [p for p in os.listdir(parent) if ".tmp-" in p], "temporary directory left behind"


@pytest.mark.parametrize("layout,msg", [
    (dict(tp=3), "tp=3 does not divide num_attention_heads=4"),
    (dict(ep=3), "ep=3 does not divide n_routed_experts=8"),
    (dict(pp=5), "pp=5 is larger than num_hidden_layers=4"),
    (dict(tp=0), "tp=0 must be a positive integer"),
])
def test_bad_layout_refused_before_writing(v3, tmp_path, layout, msg):
    out = str(tmp_path / "ck")
    with pytest.raises(LayoutError, match=msg):
        convert.hf_to_mcore(str(v3), out, **layout)
    _assert_no_output(out)


def test_unknown_model_type(v3, tmp_path):
    d = _copy(v3, tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "mamba_v9"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="unknown model_type 'mamba_v9'"):
        convert.hf_to_mcore(str(d), str(tmp_path / "ck"))
    _assert_no_output(str(tmp_path / "ck"))


def test_each_family_reads_its_own_expert_keys():
    """Qwen3-MoE counts experts under its own keys and has no shared expert, as transformers' model:
    keys of DeepSeek's in its config (n_routed_experts, n_shared_experts) change nothing."""
    from mcore_rl.models.mappings import mapping_for
    from mcore_rl.models.config import HFModel

    cfg = dict(model_type="qwen3_moe", num_hidden_layers=1, num_experts=4, n_routed_experts=9,
               n_shared_experts=1, first_k_dense_replace=1)
    m = HFModel.from_dict(cfg)
    assert (m.num_experts, m.num_shared_experts, m.is_moe_layer(0)) == (4, 0, True)
    names = [h for p in mapping_for(m).params(m) for h in p.hf]
    assert not [n for n in names if "shared" in n] and "model.layers.0.mlp.experts.3.up_proj.weight" in names


def test_sliding_window_is_refused_clearly():
    from mcore_rl.models.config import HFModel, transformer_config

    cfg = dict(model_type="qwen3_moe", num_hidden_layers=1, num_experts=4, num_experts_per_tok=2, hidden_size=64,
               num_attention_heads=4, intermediate_size=128, moe_intermediate_size=32, vocab_size=256)
    assert transformer_config(HFModel.from_dict(dict(cfg, sliding_window=4096)), cpu=True)  # unused: fine
    with pytest.raises(UnsupportedModelError, match="use_sliding_window=true .sliding_window=4096. is not supported"):
        transformer_config(HFModel.from_dict(dict(cfg, use_sliding_window=True, sliding_window=4096)), cpu=True)


def _shard(v3, tmp_path, n=2):
    """Re-save the model as `n` shards with an index, as hub checkpoints are."""
    d = tmp_path / "sharded"
    d.mkdir()
    shutil.copy(v3 / "config.json", d / "config.json")
    tensors = load_file(str(v3 / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i in range(n):
        part = {k: tensors[k] for k in names[i::n]}
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(part, str(d / fname))
        weight_map.update({k: fname for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d


def test_missing_shard(v3, tmp_path):
    d = _shard(v3, tmp_path)
    os.remove(d / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="missing safetensors shard.*model-00002-of-00002"):
        convert.hf_to_mcore(str(d), str(tmp_path / "ck"))
    _assert_no_output(str(tmp_path / "ck"))


def test_truncated_shard(v3, tmp_path):
    d = _shard(v3, tmp_path)
    p = d / "model-00001-of-00002.safetensors"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors: truncated"):
        convert.hf_to_mcore(str(d), str(tmp_path / "ck"))
    _assert_no_output(str(tmp_path / "ck"))


def test_missing_tensor(v3, tmp_path):
    d = _copy(v3, tmp_path / "hf")
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing.*experts.3.up_proj"):
        convert.hf_to_mcore(str(d), str(tmp_path / "ck"))


def test_output_not_overwritten(v3, tmp_path):
    out = tmp_path / "ck"
    out.mkdir()
    (out / "precious").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        convert.hf_to_mcore(str(v3), str(out))
    assert (out / "precious").read_text() == "x"


def test_dequantize_fp8_blocks():
    w = torch.randn(300, 260)
    block = (128, 128)
    scale = torch.rand(3, 3) + 0.5  # one scale per 128x128 block, edges partial
    expand = scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    q = (w / expand).to(torch.float8_e4m3fn)
    got = dequantize_fp8(q, scale, block)
    want = (q.float() * expand).to(torch.bfloat16)
    assert torch.equal(got, want)
    assert got.dtype == torch.bfloat16


def test_fp8_checkpoint_with_mtp_layer_imports(v3, tmp_path, caplog):
    """A DeepSeek-V3-style FP8 checkpoint (weight_scale_inv per 128x128 block, plus an MTP layer)
    imports with dequantized weights and says it skipped the MTP tensors."""
    d = _copy(v3, tmp_path / "fp8")
    make_fp8_variant(d, block=16)
    name = FP8_WEIGHT
    ck = HFCheckpoint(str(d), block_size=(16, 16))
    expected = ck.get(name)
    out = tmp_path / "ck"
    with caplog.at_level("WARNING"):
        convert.hf_to_mcore(str(d), str(out), dtype="bf16")
    assert "skipping 1 multi-token-prediction tensors (layers [4])" in caplog.text
    back = tmp_path / "back"
    convert.mcore_to_hf(str(out), str(back))
    got = load_file(str(back / "model-00001-of-00001.safetensors"))[name]
    assert torch.equal(got, expected)
    assert "quantization_config" not in json.loads((back / "config.json").read_text())


def _as(v3, dst, kind: str):
    """The tiny model re-saved as a checkpoint of `kind`: fp32 (as made); bf16 (the expert bias
    fp32, as transformers saves it); mixed (bf16 matrices, fp32 norms and bias); mixed_no_dtype
    (the same, and its config names no dtype)."""
    d = _copy(v3, dst)
    t = load_file(str(d / "model.safetensors"))
    keep32 = {"fp32": lambda k: True, "bf16": lambda k: "e_score_correction_bias" in k}.get(
        kind, lambda k: "norm" in k or "e_score_correction_bias" in k)
    t = {k: v if keep32(k) else v.to(torch.bfloat16) for k, v in t.items()}
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["dtype"] = "float32" if kind == "fp32" else "bfloat16"
    if kind == "mixed_no_dtype":
        del cfg["dtype"]
    (d / "config.json").write_text(json.dumps(cfg))
    return d, t


@pytest.mark.parametrize("kind,model_dtype", [("fp32", "float32"), ("bf16", "bfloat16"),
                                              ("mixed", "bfloat16"), ("mixed_no_dtype", "bfloat16")])
def test_round_trip_keeps_every_dtype_by_default(v3, tmp_path, kind, model_dtype):
    src, tensors = _as(v3, tmp_path / "hf", kind)
    ck, back = tmp_path / "ck", tmp_path / "back"
    convert.hf_to_mcore(str(src), str(ck))
    assert convert.read_meta(str(ck))["dtype"] == model_dtype  # the config's, else most elements'
    convert.mcore_to_hf(str(ck), str(back))
    got = load_file(str(back / "model-00001-of-00001.safetensors"))
    assert got.keys() == tensors.keys()
    changed = [k for k in tensors if got[k].dtype != tensors[k].dtype or not torch.equal(got[k], tensors[k])]
    assert not changed, changed[:5]
    assert json.loads((back / "config.json").read_text()) == json.loads((src / "config.json").read_text())


def test_dtype_casts_on_purpose_and_the_config_says_so(v3, tmp_path):
    src, tensors = _as(v3, tmp_path / "hf", "fp32")
    ck, back, back16 = tmp_path / "ck", tmp_path / "back", tmp_path / "back16"
    convert.hf_to_mcore(str(src), str(ck), dtype="bf16")
    convert.mcore_to_hf(str(ck), str(back))
    got = load_file(str(back / "model-00001-of-00001.safetensors"))
    bias = [k for k in tensors if "e_score_correction_bias" in k]
    assert bias and all(got[k].dtype == torch.float32 and torch.equal(got[k], tensors[k]) for k in bias)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], tensors[k].to(torch.bfloat16))
               for k in tensors if k not in bias)
    assert json.loads((back / "config.json").read_text())["dtype"] == "bfloat16"
    convert.hf_to_mcore(str(src), str(tmp_path / "ck32"))  # fp32 kept, then cast on export
    convert.mcore_to_hf(str(tmp_path / "ck32"), str(back16), dtype="bf16")
    assert load_file(str(back16 / "model-00001-of-00001.safetensors")).keys() == got.keys()
    assert all(torch.equal(v, got[k]) and v.dtype == got[k].dtype
               for k, v in load_file(str(back16 / "model-00001-of-00001.safetensors")).items())
    assert json.loads((back16 / "config.json").read_text())["dtype"] == "bfloat16"


def _cli(*a):
    env = dict(os.environ, MCORE_RL_NO_PROGRESS="1")
    return subprocess.run([sys.executable, "-m", "mcore_rl.convert", *a], env=env, capture_output=True, text=True,
                          timeout=300)


def test_cli_round_trip(v3, tmp_path):
    ck, back = tmp_path / "ck", tmp_path / "back"
    r = _cli("hf-to-mcore", "--hf", str(v3), "--out", str(ck), "--tp", "2", "--ep", "2")  # fp32 kept
    assert r.returncode == 0, r.stderr
    r = _cli("mcore-to-hf", "--ckpt", str(ck), "--out", str(back))
    assert r.returncode == 0, r.stderr
    a, b = load_file(str(v3 / "model.safetensors")), load_file(str(back / "model-00001-of-00001.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    r = _cli("hf-to-mcore", "--hf", str(v3), "--out", str(tmp_path / "x"), "--ep", "3")
    assert r.returncode == 2 and "ep=3 does not divide n_routed_experts=8" in r.stderr


@pytest.mark.parametrize("fam", ["qwen3_moe", "glm4_moe"])
def test_cli_round_trip_other_moe_families(tmp_path, fam):
    """Qwen3-MoE and GLM-4.5 through the CLI, at TP=2 x PP=2 x EP=2 (megatron's own save and load at
    that layout: tests/e2e/test_parity.py); GLM's MTP layer (num_nextn_predict_layers) is skipped with a
    note and left out of the export."""
    hf, ck, back = tmp_path / "hf", tmp_path / "ck", tmp_path / "back"
    make_hf_model(fam, str(hf))
    a = load_file(str(hf / "model.safetensors"))
    if fam == "glm4_moe":  # the hub checkpoint's MTP layer: one more layer index, as GLM-4.5 ships it
        mtp = {k.replace("layers.2.", "layers.3."): v.clone() for k, v in a.items() if "layers.2." in k}
        mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
        save_file({**a, **mtp}, str(hf / "model.safetensors"), metadata={"format": "pt"})
    r = _cli("hf-to-mcore", "--hf", str(hf), "--out", str(ck), "--tp", "2", "--pp", "2", "--ep", "2")
    assert r.returncode == 0, r.stderr
    if fam == "glm4_moe":
        assert f"skipping {len(mtp)} multi-token-prediction tensors (layers [3])" in r.stderr, r.stderr
    r = _cli("mcore-to-hf", "--ckpt", str(ck), "--out", str(back))
    assert r.returncode == 0, r.stderr
    b = load_file(str(back / "model-00001-of-00001.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_random_hf_checkpoint_is_whole_seeded_and_converts(v3, tmp_path):
    """`python -m mcore_rl.convert random-hf`: every tensor transformers saves for the model (its load
    misses none, finds none extra), drawn per tensor name from the seed (the same files at any shard size; another seed,
    other weights), matrices N(0, initializer_range) and norms ones; the trainer's converter takes it."""
    import transformers

    from mcore_rl.convert.cli import main

    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    shutil.copy(v3 / "config.json", cfg_dir / "config.json")
    assert main(["random-hf", "--hf-config", str(cfg_dir), "--out", str(tmp_path / "a"), "--dtype", "fp32",
                 "--seed", "3"]) == 0
    convert.random_hf(str(cfg_dir), str(tmp_path / "b"), "fp32", seed=3, max_shard_bytes=4096)
    convert.random_hf(str(cfg_dir), str(tmp_path / "c"), "fp32", seed=4)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"), output_loading_info=True)
    assert not any(info.values()), info
    a, b, c = (HFCheckpoint(str(tmp_path / x)) for x in "abc")
    assert len(os.listdir(tmp_path / "b")) > 3  # several shards
    assert sorted(a.names()) == sorted(HFCheckpoint(str(v3)).names()) == sorted(b.names())  # transformers' own save
    assert all(torch.equal(a.get(n), b.get(n)) for n in a.names())
    matrices = [n for n in a.names() if a.get(n).dim() == 2]
    assert not any(torch.equal(a.get(n), c.get(n)) for n in matrices)
    std = json.loads((cfg_dir / "config.json").read_text()).get("initializer_range", 0.02)
    embed = a.get("model.embed_tokens.weight")
    assert abs(embed.std().item() - std) < 0.2 * std and abs(embed.mean().item()) < 0.2 * std
    assert all(torch.equal(a.get(n), torch.ones_like(a.get(n))) for n in a.names() if n.endswith("norm.weight"))
    convert.hf_to_mcore(str(tmp_path / "a"), str(tmp_path / "ckpt"))
    assert os.path.exists(tmp_path / "ckpt" / "metadata.json")
