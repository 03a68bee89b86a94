"""Checkpoint merger: real FSDP2 (`fully_shard`, gloo) checkpoints in verl's file layout and real
megatron checkpoints from our saver at TP2 / EP2 / PP2, spread over per-node directories, merged
back bit-exact to the HF model they started from; broken inputs refused before any write."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from mcore_rl.convert import hf_mcore as convert
from mcore_rl.convert.hf_io import CheckpointError, HFCheckpoint
from mcore_rl.convert.merge import ValidationFailed, merge
from tests.support import distributed
from tests.support.tiny_models import make_hf_model

FSDP_FAMILIES = ("llama", "qwen2", "deepseek_v3", "glm4_moe")  # glm4_moe: experts fused in memory
FSDP4_FAMILIES = ("llama", "deepseek_v3")  # 4 processes cost more on 2 cores: tied + MoE cases
LORA_FAMILY, LORA_RANK, LORA_ALPHA = "qwen2", 4, 8
MEGATRON_LAYOUTS = {"tp2": (2, 1, 1), "ep2": (1, 1, 2), "pp2": (1, 2, 1)}


def _save_tokenizer(d):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(250)} | {"<unk>": 250}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(d)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    for fam in FSDP_FAMILIES:
        make_hf_model(fam, str(root / fam / "hf"))
        _save_tokenizer(str(root / fam / "hf"))
    return root


# ---- FSDP2 checkpoints written the way verl writes them ------------------------------------------

def _add_peft_lora(model, r=LORA_RANK, seed=1):
    """Wrap q_proj/v_proj the way PEFT does (base_layer, lora_A/B ModuleDicts keyed by adapter
    name) under `base_model.model`, so the state dict has PEFT's exact key names."""
    from torch import nn

    class LoraLinear(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base_layer = base
            self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
            self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})

    torch.manual_seed(seed)
    for layer in model.model.layers:
        for name in ("q_proj", "v_proj"):
            setattr(layer.self_attn, name, LoraLinear(getattr(layer.self_attn, name)))
    outer, inner = nn.Module(), nn.Module()
    inner.model = model
    outer.base_model = inner
    return outer


def _fsdp_worker(rank, root, families):
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for fam in families:
        hf = os.path.join(root, fam, "hf")
        model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        layers = model.model.layers
        wrapped = _add_peft_lora(model) if fam == LORA_FAMILY else model
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(wrapped, mesh=mesh)
        node = os.path.join(root, fam, f"fsdp{world}", f"node{rank * 2 // world}")
        os.makedirs(node, exist_ok=True)
        # verl: model, optimizer and extra state per rank; rank 0 adds fsdp_config + huggingface/
        torch.save(wrapped.state_dict(), os.path.join(node, f"model_world_size_{world}_rank_{rank}.pt"))
        optim = torch.optim.AdamW(wrapped.parameters())
        torch.save(optim.state_dict(), os.path.join(node, f"optim_world_size_{world}_rank_{rank}.pt"))
        torch.save({"lr_scheduler": None}, os.path.join(node, f"extra_state_world_size_{world}_rank_{rank}.pt"))
        if rank == 0:
            with open(os.path.join(node, "fsdp_config.json"), "w") as f:
                json.dump({"FSDP_version": 2, "world_size": world}, f, indent=4)
            side = os.path.join(node, "huggingface")
            model.config.save_pretrained(side)
            model.generation_config.save_pretrained(side)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(os.path.join(hf, name), side)
            if fam == LORA_FAMILY:
                with open(os.path.join(node, "lora_train_meta.json"), "w") as f:
                    json.dump({"r": LORA_RANK, "lora_alpha": LORA_ALPHA, "task_type": "CAUSAL_LM"}, f)


@pytest.fixture(scope="module")
def fsdp(root):
    distributed.run(_fsdp_worker, 2, str(root), FSDP_FAMILIES)
    distributed.run(_fsdp_worker, 4, str(root), FSDP4_FAMILIES)
    return root


def _nodes(root, fam, world):
    return [str(root / fam / f"fsdp{world}" / f"node{i}") for i in range(2)]


def _tensors(d):
    ck = HFCheckpoint(str(d))
    return {n: ck.get(n) for n in ck.names()}


def _assert_same(out, ref):
    a, b = _tensors(out), _tensors(ref)
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, f"tensors differ: {bad[:5]}"


@pytest.mark.parametrize("fam,world", [(f, 2) for f in FSDP_FAMILIES] + [(f, 4) for f in FSDP4_FAMILIES])
def test_fsdp2_merge_is_bit_exact_and_loads(fsdp, tmp_path, fam, world):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = fsdp / fam / "hf"
    out = tmp_path / "merged"
    merge("fsdp", _nodes(fsdp, fam, world), str(out), validate=str(ref))
    _assert_same(out, ref)
    for side in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / side).exists(), side
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    want = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32)
    got_sd, want_sd = loaded.state_dict(), want.state_dict()
    assert all(torch.equal(got_sd[k], want_sd[k]) for k in want_sd)
    assert (out / "tokenizer.json").read_bytes() == (ref / "tokenizer.json").read_bytes()
    assert AutoTokenizer.from_pretrained(str(out)) is not None
    if fam == LORA_FAMILY:
        _check_adapter(out / "lora_adapter", ref)


def _check_adapter(path, ref):
    """The adapter holds PEFT-named tensors equal to the LoRA weights the ranks started from."""
    from transformers import AutoModelForCausalLM

    want = {k.replace(".default.", "."): v for k, v in
            _add_peft_lora(AutoModelForCausalLM.from_pretrained(str(ref))).state_dict().items()
            if ".lora_" in k}
    got = load_file(str(path / "adapter_model.safetensors"))
    assert set(got) == set(want) and len(got) == 2 * 2 * 2  # layers x (q, v) x (A, B)
    assert all(torch.equal(got[k], want[k]) for k in want)
    cfg = json.loads((path / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["target_modules"]) == (LORA_RANK, LORA_ALPHA, ["q_proj", "v_proj"])


def test_manifest_and_cast(fsdp, tmp_path):
    nodes = _nodes(fsdp, "deepseek_v3", 2)
    manifest = tmp_path / "ranks.json"
    manifest.write_text(json.dumps({"ranks": {str(r): os.path.join(nodes[r], f"model_world_size_2_rank_{r}.pt")
                                              for r in range(2)}}))
    out = tmp_path / "bf16"
    merge("fsdp", [], str(out), str(manifest), dtype="bf16", max_shard_bytes=2**17)
    got, ref = _tensors(out), _tensors(fsdp / "deepseek_v3" / "hf")
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1  # sharded, with an index
    assert all(torch.equal(got[k], ref[k].to(torch.bfloat16)) for k in ref)


# ---- broken inputs: clear error, no output ------------------------------------------------------

def _assert_no_output(out):
    assert not os.path.exists(out), "output left behind"
    assert not [p for p in os.listdir(os.path.dirname(out)) if ".tmp-" in p], "temporary dir left behind"


@pytest.fixture
def broken(fsdp, tmp_path):
    """A private copy of the 4-rank deepseek_v3 checkpoint (2 ranks per node dir)."""
    nodes = []
    for i, src in enumerate(_nodes(fsdp, "deepseek_v3", 4)):
        nodes.append(tmp_path / f"node{i}")
        shutil.copytree(src, nodes[-1])
    return nodes


def _truncate(p):
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage,msg", [
    (lambda n: os.remove(n[1] / "model_world_size_4_rank_3.pt"),
     r"rank 3 of 4 missing: model_world_size_4_rank_3.pt expected in \S*node1 \(which holds ranks 2\)"),
    (lambda n: shutil.copy(n[0] / "model_world_size_4_rank_1.pt", n[1]),
     r"rank 1 appears more than once: \S*node0/model_world_size_4_rank_1.pt, \S*node1/model_world_size_4_rank_1"),
    (lambda n: _truncate(n[1] / "model_world_size_4_rank_2.pt"),
     r"node1/model_world_size_4_rank_2.pt: cannot read rank 2 model file"),
    (lambda n: (n[0] / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 8}'),
     r"fsdp_config.json says world_size 8, the rank files say 4"),
    (lambda n: os.rename(n[1] / "model_world_size_4_rank_3.pt", n[1] / "model_world_size_8_rank_3.pt"),
     r"rank files disagree on the world size: world_size 4: 3 file\(s\).*world_size 8: 1 file"),
], ids=["missing", "duplicated", "truncated", "world-size-config", "world-size-names"])
def test_broken_fsdp_checkpoint_refused(broken, tmp_path, damage, msg):
    damage(broken)
    out = str(tmp_path / "merged")
    with pytest.raises(CheckpointError, match=msg):
        merge("fsdp", [str(n) for n in broken], out)
    _assert_no_output(out)


def test_validation_failure_leaves_no_output(fsdp, tmp_path):
    out = str(tmp_path / "merged")
    other = tmp_path / "other"
    make_hf_model("deepseek_v3", str(other), seed=1)
    with pytest.raises(ValidationFailed, match="differs from"):
        merge("fsdp", _nodes(fsdp, "deepseek_v3", 2), out, validate=str(other))
    _assert_no_output(out)


def test_cli_verl_spelling_and_exit_codes(broken, tmp_path, capsys):
    from mcore_rl.convert.cli import main

    args = ["merge", "--backend", "fsdp", "--local_dir", *map(str, broken), "--target_dir"]
    assert main(args + [str(tmp_path / "cli")]) == 0
    os.remove(broken[0] / "model_world_size_4_rank_0.pt")
    assert main(args + [str(tmp_path / "cli2")]) == 2
    assert "error: rank 0 of 4 missing" in capsys.readouterr().err
    _assert_no_output(str(tmp_path / "cli2"))


# ---- megatron checkpoints saved by our trainer's saver at several layouts -----------------------

def _megatron_worker(rank, root, fam, layouts):
    from megatron.core import parallel_state as ps

    from mcore_rl.checkpoint.model import load_model, save_model
    from mcore_rl.models.config import HFModel, transformer_config
    from mcore_rl.models.builder import build_model
    from mcore_rl.parallel.groups import Layout, init_distributed

    hf_dir = os.path.join(root, fam, "hf")
    hf = HFModel.from_dir(hf_dir)
    for name, (tp, pp, ep) in layouts.items():
        init_distributed(Layout(tp=tp, pp=pp, ep=ep))
        model = build_model(hf, transformer_config(hf, tp=tp, pp=pp, ep=ep, dtype=torch.float32, cpu=True))
        load_model(model, os.path.join(root, fam, "mcore"))
        save_model(model, os.path.join(root, fam, name, "model"), side_files_from=hf_dir)
        ps.destroy_model_parallel()


@pytest.fixture(scope="module")
def megatron(root):
    fam = "deepseek_v3"
    convert.hf_to_mcore(str(root / fam / "hf"), str(root / fam / "mcore"), dtype="fp32")
    distributed.run(_megatron_worker, 2, str(root), fam, MEGATRON_LAYOUTS)
    for name in MEGATRON_LAYOUTS:  # as if rank 1 ran on a second node with its own disk
        node1 = root / fam / name / "node1"
        node1.mkdir()
        os.rename(root / fam / name / "model" / "__1_0.distcp", node1 / "__1_0.distcp")
    return root / fam


@pytest.mark.parametrize("layout", list(MEGATRON_LAYOUTS))
def test_megatron_merge_is_bit_exact(megatron, tmp_path, layout):
    out = tmp_path / "merged"
    dirs = [str(megatron / layout / "model"), str(megatron / layout / "node1")]
    merge("megatron", dirs, str(out), validate=str(megatron / "hf"))
    _assert_same(out, megatron / "hf")


def test_megatron_missing_and_truncated_files(megatron, tmp_path):
    model, node1 = tmp_path / "model", tmp_path / "node1"
    shutil.copytree(megatron / "tp2" / "model", model)
    with pytest.raises(CheckpointError, match=r"checkpoint data file\(s\) of the checkpoint not found, "
                                              r"e.g. __1_0.distcp; searched: \S*model"):
        merge("megatron", [str(model)], str(tmp_path / "a"))
    shutil.copytree(megatron / "tp2" / "node1", node1)
    _truncate(node1 / "__1_0.distcp")
    with pytest.raises(CheckpointError, match=r"node1/__1_0.distcp: truncated"):
        merge("megatron", [str(model), str(node1)], str(tmp_path / "b"))
    _assert_no_output(str(tmp_path / "a"))
    _assert_no_output(str(tmp_path / "b"))
