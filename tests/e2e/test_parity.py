"""Logit parity: transformers' HF models vs megatron-core models loaded through the converter.

Layouts run in real gloo process groups: TP=1 here, TP=2 / EP=2 / PP=2 (even and uneven) in two
processes, and TP=2 x PP=2 x EP=2 in four, which also saves with megatron's own saver (DeepSeek-V3,
Qwen3-MoE, GLM-4.5). Routing configs on which megatron-core's own routing differs from the model's
(tests/tiny_models.ROUTING_VARIANTS) run at TP=1, EP=2 and PP=2.
"""

from __future__ import annotations

import glob
import json
import os
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file

from mcore_rl.convert import hf_mcore as convert
from tests.support import distributed
from tests.support.tiny_models import FAMILIES, ROUTING_VARIANTS, make_hf_model

TOL = 1e-4
MOE = ("deepseek_v3", "deepseek_v2", "qwen3_moe", "glm4_moe")
RESHARDED = ("deepseek_v3", "qwen3_moe", "glm4_moe")  # also saved by megatron at TP=2 x PP=2 x EP=2
ROUTING = tuple(ROUTING_VARIANTS)
ALL = (*FAMILIES, *ROUTING)


class L(NamedTuple):
    tp: int
    pp: int
    ep: int
    first: int | None  # first-stage layers (uneven PP)
    fams: tuple[str, ...]
    etp: int = 1


LAYOUTS = {
    "tp2": L(2, 1, 1, None, tuple(FAMILIES)),
    "ep2": L(1, 1, 2, None, MOE + ROUTING),
    "tp2_etp2": L(2, 1, 1, None, MOE, etp=2),  # experts split over TP too (expert tensor parallel)
    "pp2": L(1, 2, 1, None, tuple(ALL)),
    "pp2_uneven": L(1, 2, 1, 1, ("deepseek_v3",)),
}


def _hf_tensors(d):
    out = {}
    for f in glob.glob(os.path.join(d, "*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))
    for fam in ALL:
        d = root / fam
        model = make_hf_model(fam, str(d / "hf"))
        with torch.no_grad():
            torch.save({"ids": ids, "logits": model(ids).logits}, d / "ref.pt")
        convert.hf_to_mcore(str(d / "hf"), str(d / "ckpt"), dtype="fp32")
    return root


def _eval(rank, root, fam, ckpt, tp, pp, ep, first=None, etp=1):
    """Build `fam` at the current layout, load `ckpt`, return (max |diff| vs HF, logits) on the
    rank that holds the full logits, else None."""
    from megatron.core import parallel_state as ps

    from mcore_rl.checkpoint.model import load_model
    from mcore_rl.models.config import HFModel, transformer_config
    from mcore_rl.models.builder import build_model
    from mcore_rl.models.forward import full_logits

    hf = HFModel.from_dir(os.path.join(root, fam, "hf"))
    ref = torch.load(os.path.join(root, fam, "ref.pt"), weights_only=True)
    cfg = transformer_config(hf, tp=tp, pp=pp, ep=ep, etp=etp, dtype=torch.float32, cpu=True,
                             pp_first_layers=first, pp_last_layers=(hf.num_layers - first) if first else None)
    model = build_model(hf, cfg).eval()
    load_model(model, ckpt)
    with torch.no_grad():
        logits = full_logits(model, ref["ids"])
    # one rank per layout: data-parallel replicas (EP=2 of two processes) may differ in the last bit,
    # as each sums its tokens' expert outputs in its own order, and would race to write the logits
    if logits is None or ps.get_tensor_model_parallel_rank() != 0 or ps.get_data_parallel_rank() != 0:
        return None
    return (logits - ref["logits"]).abs().max().item(), logits


def _layouts_worker(rank, root, layouts, out):
    from megatron.core import parallel_state as ps

    from mcore_rl.parallel.groups import Layout, init_distributed

    results = {}
    for name, (tp, pp, ep, first, fams, etp) in layouts.items():
        init_distributed(Layout(tp=tp, pp=pp, ep=ep, etp=etp))
        for fam in fams:
            for ck in ("ckpt", "ckpt_tp2pp2ep2"):
                path = os.path.join(root, fam, ck)
                if not os.path.exists(path):
                    continue
                r = _eval(rank, root, fam, path, tp, pp, ep, first, etp)
                if r is not None:
                    results[f"{name}/{fam}/{ck}"] = r[0]
                    torch.save(r[1], os.path.join(root, fam, f"logits_{name}_{ck}.pt"))
        ps.destroy_model_parallel()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def _tp2pp2ep2_worker(rank, root, fams):
    from mcore_rl.checkpoint.model import load_model, save_model
    from mcore_rl.models.config import HFModel, transformer_config
    from mcore_rl.models.builder import build_model
    from mcore_rl.parallel.groups import Layout, init_distributed

    init_distributed(Layout(tp=2, pp=2, ep=2))
    for fam in fams:
        hf = HFModel.from_dir(os.path.join(root, fam, "hf"))
        model = build_model(hf, transformer_config(hf, tp=2, pp=2, ep=2, dtype=torch.float32, cpu=True))
        load_model(model, os.path.join(root, fam, "ckpt"))
        save_model(model, os.path.join(root, fam, "ckpt_tp2pp2ep2"))


@pytest.fixture(scope="module")
def resharded(zoo):
    distributed.run(_tp2pp2ep2_worker, 4, str(zoo), RESHARDED)
    return zoo


@pytest.fixture(scope="module")
def layout_results(resharded, tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    distributed.run(_layouts_worker, 2, str(resharded), LAYOUTS, str(out))
    merged = {}
    for f in out.glob("rank*.json"):
        merged.update(json.loads(f.read_text()))
    return merged


@pytest.mark.parametrize("fam", list(ALL))
def test_tp1_parity(zoo, fam):
    import torch.distributed as dist

    if not dist.is_initialized():  # the converter set up a one-process group in this process
        pytest.skip("no process group")
    diff, _ = _eval(0, str(zoo), fam, str(zoo / fam / "ckpt"), 1, 1, 1)
    assert diff < TOL, f"{fam}: max |logit diff| {diff:.2e} at TP=1"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_parity(layout_results, layout):
    fams = LAYOUTS[layout].fams
    for fam in fams:
        key = f"{layout}/{fam}/ckpt"
        assert key in layout_results, f"no result for {key}: {sorted(layout_results)}"
        assert layout_results[key] < TOL, f"{key}: max |logit diff| {layout_results[key]:.2e}"


@pytest.mark.parametrize("fam", RESHARDED)
def test_checkpoint_written_at_one_layout_loads_at_another(layout_results, resharded, fam):
    for layout in ("tp2", "ep2", "pp2"):
        a = torch.load(resharded / fam / f"logits_{layout}_ckpt.pt", weights_only=True)
        b = torch.load(resharded / fam / f"logits_{layout}_ckpt_tp2pp2ep2.pt", weights_only=True)
        assert torch.equal(a, b), f"{layout}: logits differ between converter and TP2xPP2xEP2 saves"


@pytest.mark.parametrize("fam", RESHARDED)
def test_round_trip_through_tp2pp2ep2_is_bit_exact(resharded, tmp_path, fam):
    out = tmp_path / "hf_back"
    convert.mcore_to_hf(str(resharded / fam / "ckpt_tp2pp2ep2"), str(out),
                        hf_config=str(resharded / fam / "hf"))
    a, b = _hf_tensors(resharded / fam / "hf"), _hf_tensors(out)
    assert set(a) == set(b)
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, f"tensors changed in the round trip: {bad[:5]}"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(out))  # loadable by transformers


def _routers(rank, families):
    import transformers
    from megatron.core.transformer.moe import moe_utils, router

    from mcore_rl.models.config import HFModel, transformer_config
    from mcore_rl.models.builder import build_model
    from mcore_rl.parallel.groups import Layout, init_distributed
    from tests.support.tiny_models import FAMILIES, ROUTING_VARIANTS

    init_distributed(Layout())
    for fam, want in families.items():
        cls, kwargs = {**FAMILIES, **ROUTING_VARIANTS}[fam]
        hf = HFModel.from_dict(getattr(transformers, cls)(**kwargs).to_dict())
        model = build_model(hf, transformer_config(hf, dtype=torch.float32, cpu=True))
        got = {type(m).__name__ for m in model.modules() if isinstance(m, router.TopKRouter)}
        assert got == {want}, (fam, got)
    # megatron's own routing functions are its own: no global patch
    assert moe_utils.group_limited_topk.__module__ == router.topk_routing_with_score_function.__module__ \
        == "megatron.core.transformer.moe.moe_utils"
    assert router.topk_routing_with_score_function is moe_utils.topk_routing_with_score_function


def test_deepseek_and_glm_routing_is_a_router_in_the_layer_spec():
    """The models whose routing megatron's differs from get ModelRouter in their MoE layer spec;
    the others megatron's TopKRouter (their logits against transformers': the tests above)."""
    distributed.run(_routers, 1, {"deepseek_v3_groups": "ModelRouter", "deepseek_v2_groups": "ModelRouter",
                                  "deepseek_v3_no_norm": "ModelRouter", "qwen3_moe": "TopKRouter"})
