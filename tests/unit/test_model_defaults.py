"""Model defaults agree with transformers and SGLang, family by family (issue 50): for every key a
config.json may leave out, the value the model builder takes (mcore_rl.models.families, FAMILY_DEFAULTS
through HFModel) equals what transformers' config class for the model_type gives and, where that
class has no such attribute, what SGLang's model code falls back to. Both read from the installed
libraries, never restated here."""

from __future__ import annotations

import ast
import importlib.util
import os

import pytest

from mcore_rl.models.checks import SUPPORTED
from mcore_rl.models.families import FAMILY_DEFAULTS
from mcore_rl.models.config import HFModel
from tests.support.tiny_models import FAMILIES

# the SGLang model file of each family (sglang/srt/models/)
SGLANG_FILES = {"deepseek_v3": "deepseek_v2", "deepseek_v2": "deepseek_v2", "qwen3_moe": "qwen3_moe",
                "glm4_moe": "glm4_moe", "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# how the builder reads a key: through HFModel's accessor where it has one
OURS = {"partial_rotary_factor": lambda m: m.rotary_fraction, "head_dim": lambda m: m.head_dim,
        "n_routed_experts": lambda m: m.num_experts, "num_experts": lambda m: m.num_experts,
        "n_shared_experts": lambda m: m.num_shared_experts}


def _sglang_getattr_defaults(family: str) -> dict:
    """Every `getattr(config, "key", <literal>)` in the family's SGLang model file."""
    spec = importlib.util.find_spec("sglang")
    path = os.path.join(os.path.dirname(spec.origin), "srt", "models", SGLANG_FILES[family] + ".py")
    out = {}
    for node in ast.walk(ast.parse(open(path).read())):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) == 3
                and isinstance(node.args[1], ast.Constant)):
            try:
                out.setdefault(node.args[1].value, ast.literal_eval(node.args[2]))
            except ValueError:
                pass  # a computed default (head_dim from hidden_size): transformers' config has the key
    return out


def _transformers_value(family: str, cfg: dict, key: str):
    """What transformers' config class makes of `cfg`'s `key`; AttributeError if it has no such key."""
    import transformers

    c = transformers.AutoConfig.for_model(**cfg)
    rope = getattr(c, "rope_parameters", None) or {}
    if key in rope:  # transformers 5 keeps rope_theta and partial_rotary_factor there
        return rope[key]
    value = getattr(c, key)
    if key == "head_dim" and value is None:
        raise AttributeError(key)
    return value


@pytest.mark.parametrize("family", SUPPORTED)
def test_defaults_agree_with_transformers_and_sglang(family):
    base = {"model_type": family, **FAMILIES[family][1]}
    sglang = _sglang_getattr_defaults(family)
    checked = []
    for key in FAMILY_DEFAULTS[family]:
        cfg = {k: v for k, v in base.items() if k != key}
        ours = OURS.get(key, lambda m, k=key: m.get(k))(HFModel.from_dict(cfg))
        try:
            theirs, source = _transformers_value(family, cfg, key), "transformers"
        except AttributeError:
            if key not in sglang:
                continue  # neither library reads it for this family
            theirs, source = sglang[key], "SGLang"
        if key == "head_dim" and theirs is None:
            theirs = cfg["hidden_size"] // cfg["num_attention_heads"]
        assert ours == theirs, f"{family}: {key} defaults to {ours!r} here, {theirs!r} in {source}"
        checked.append(key)
    assert len(checked) >= 4, checked  # the comparison ran, not skipped for every key


def test_head_dim_without_the_key():
    """Qwen3 (dense) takes 128, Qwen3-MoE hidden / heads, as transformers' attention modules do."""
    import torch
    import transformers

    for family in ("qwen3", "qwen3_moe", "qwen2", "llama", "glm4_moe"):
        cfg = {"model_type": family, **{k: v for k, v in FAMILIES[family][1].items() if k != "head_dim"}}
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
        attn = model.model.layers[0].self_attn
        assert HFModel.from_dict(cfg).head_dim == attn.head_dim, family


@pytest.mark.parametrize("family", SUPPORTED)
def test_a_config_leaving_defaults_out_builds_what_transformers_writes_of_it(family, tmp_path):
    """The driver reads an embedded hf_config as given; the actors read the config.json transformers
    writes from it (every default filled in). With every defaultable key left out, both build the
    same megatron config."""
    import dataclasses
    import json

    import transformers

    from mcore_rl.models.config import _rope_theta, transformer_config

    keep = ("num_experts_per_tok", "n_routed_experts", "num_experts", "n_group", "topk_group")  # tiny, routable
    cfg = {"model_type": family, **{k: v for k, v in FAMILIES[family][1].items()
                                    if k in keep or (k not in FAMILY_DEFAULTS[family] and k != "head_dim")}}
    transformers.AutoConfig.for_model(**cfg).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())

    def built(c: dict) -> dict:
        m = HFModel.from_dict(c)
        t = transformer_config(m, cpu=True)
        rope = {"rotary_percent": m.rotary_fraction, "rotary_base": _rope_theta(m)}  # the builder's GPTModel args
        return {**rope, **{f.name: getattr(t, f.name) for f in dataclasses.fields(t) if not callable(getattr(t, f.name))}}

    assert built(cfg) == built(written), (family, sorted(set(FAMILIES[family][1]) - set(cfg)))


def test_each_family_is_one_module_declaring_its_mapping_defaults_and_engine_rules():
    """Issue 48: a family's mapping, defaults and engine rules sit together, one module per family, and
    every reader (mapping_for, the defaults, the direct-load and fp32-router rules) takes them from there."""
    import importlib
    import pkgutil

    from mcore_rl.models import families
    from mcore_rl.models.mappings import MAPPINGS

    shared = {"family", "mapping", "rules"}
    modules = [m.name for m in pkgutil.iter_modules(families.__path__) if m.name not in shared]
    declared = [importlib.import_module(f"mcore_rl.models.families.{m}").FAMILY for m in modules]
    assert sorted(f.mapping.name for f in declared) == sorted(f.mapping.name for f in families.FAMILIES)
    assert [f.mapping for f in families.FAMILIES] == list(MAPPINGS)
    assert sorted(t for f in families.FAMILIES for t in f.mapping.model_types) == sorted(SUPPORTED)
    assert set(families.DIRECT_LOAD_TYPES) == {"qwen2", "qwen3_moe", "glm4_moe"}
    assert [f.mapping.name for f in families.FAMILIES if f.fp32_router] == ["glm4_moe"]
    assert families.family_of("qwen3_moe").sglang_problems({"model_type": "qwen3_moe", "mlp_only_layers": [0]})
