"""A start from an HF checkpoint: every trainer rank reads its own shard straight from the safetensors
(mcore_rl.checkpoint.hf_init) and ends with the parameters megatron's own checkpoint loader gives it
from the converter's torch_dist copy, bit for bit, at TP2 x ETP2, EP2 and PP2; and it reads exactly
the tensors its shard is made of (only its rows of those split along dim 0, a QKV's and a GLU's too),
each at most once, no more than its shard but for what can only be read whole (named in
_expected_reads), counted by the reader and by the kernel's tally of the process's reads."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from mcore_rl.convert.hf_mcore import hf_to_mcore
from tests.support.distributed import run
from tests.support.tiny_models import make_fp8_variant, make_hf_model

LAYOUTS = (dict(tp=2, etp=2, ep=1), dict(ep=2), dict(pp=2))
# family: (model dtype, layouts). MLA with q_lora, a dense first layer, sigmoid routing and its expert
# bias (fp32 whatever the model's dtype); GQA with q/k/v fused per KV group and q/k norms, every layer
# sparse, in bf16 (cast as read); a tied embedding, which the last pipeline stage holds as its head;
# DeepSeek-V3's FP8 release format (a block-scaled weight, dequantized as read, and an MTP layer left unread)
CASES = {"deepseek_v3": ("fp32", LAYOUTS), "qwen3_moe": ("bf16", LAYOUTS), "llama": ("fp32", LAYOUTS[2:]),
         "deepseek_v3_fp8": ("bf16", LAYOUTS[:1])}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each family's HF checkpoint and the converter's torch_dist copy of it (the old start)."""
    root = tmp_path_factory.mktemp("hf_init")
    for fam, (dtype, _) in CASES.items():
        if fam.endswith("_fp8"):
            shutil.copytree(root / fam.removesuffix("_fp8") / "hf", root / fam / "hf")
            make_fp8_variant(root / fam / "hf")
        else:
            make_hf_model(fam, str(root / fam / "hf"))
        hf_to_mcore(str(root / fam / "hf"), str(root / fam / "ckpt"), dtype=dtype)
    return root


def _rchar() -> int:
    """Bytes this process has read through read syscalls, as the kernel counts them."""
    with open("/proc/self/io") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("rchar:"))


def _expected_reads(model, hf, hf_dir: str) -> tuple[dict[str, int], int, dict[str, int]]:
    """HF tensor -> the bytes a rank holding `model` must read of it, from megatron's own TP marks on its
    parameters alone (not from how the reader works): of a tensor its parameter slices along dim 0 (a
    column-parallel weight, a GLU's gate and up, a QKV's KV groups: every mapping only reorders whole rows),
    or holds whole, exactly its share of the rows; whole, once, what cannot be read by rows: a tensor its
    parameter slices along dim 1 (row-parallel at TP > 1: a column block is not contiguous in the file) and
    an FP8 block-scaled weight with its scales (a block spans 128 rows). Also the rank's shard (its
    parameters' share of the HF bytes) and, of the tensors read whole, the bytes beyond their share: the
    only reads allowed beyond the shard."""
    from mcore_rl.convert.hf_io import HFCheckpoint
    from mcore_rl.models.builder import global_names
    from mcore_rl.models.mappings import mapping_for

    ckpt = HFCheckpoint(hf_dir)
    params = mapping_for(hf).by_mcore(hf)
    global_name = global_names(model, hf.num_experts)
    out, shard, beyond = {}, 0, {}
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state"):
            continue
        p = params.get(global_name(name)) or params["embedding.word_embeddings.weight"]  # a tied head
        numel = sum(torch.Size(ckpt.meta[h]["shape"]).numel() for h in p.hf)
        by_rows = not getattr(t, "tensor_model_parallel", False) or t.partition_dim == 0
        for h in p.hf:
            share = ckpt.nbytes(h) * t.numel() // numel
            shard += share
            if ckpt.block_scaled(h):
                out[h], out[h + "_scale_inv"] = ckpt.nbytes(h), ckpt.nbytes(h + "_scale_inv")
                beyond[h] = out[h] + out[h + "_scale_inv"] - share
            elif by_rows:
                out[h] = share
            else:
                out[h] = ckpt.nbytes(h)
                beyond[h] = out[h] - share
    return out, shard, beyond


def _assert_equal(a: dict, b: dict, where) -> None:
    assert a.keys() == b.keys(), where
    differ = [k for k in a if torch.is_tensor(a[k]) and not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]
    assert not differ, (where, differ[:5])


def _each_layout(rank, root):
    from megatron.core import parallel_state as ps

    from mcore_rl.checkpoint.hf_init import load_hf
    from mcore_rl.checkpoint.model import load_model
    from mcore_rl.models.builder import build_model
    from mcore_rl.models.config import HFModel, transformer_config
    from mcore_rl.parallel.groups import Layout, init_distributed

    import mcore_rl.sync.fp8  # noqa: F401 - FP8's dequantizer, imported before the reads are tallied (not its .pyc)

    torch.set_num_threads(1)
    report = {}
    for fam, (dtype, layouts) in CASES.items():
        hf_dir = os.path.join(root, fam, "hf")
        hf = HFModel.from_dir(hf_dir)
        for lay in layouts:
            init_distributed(Layout(**lay), seed=1)
            tcfg = transformer_config(hf, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype], cpu=True, **lay)
            direct, old = build_model(hf, tcfg), build_model(hf, tcfg)
            before = _rchar()
            got = load_hf(direct, hf_dir, hf)
            rchar = _rchar() - before
            load_model(old, os.path.join(root, fam, "ckpt"))  # megatron's loader, the converter's copy
            _assert_equal(direct.state_dict(), old.state_dict(), (fam, lay, rank))
            if fam == "deepseek_v3" and lay.get("tp") == 2:  # a critic from this model: its trunk, its head zero
                from mcore_rl.models import critic

                value = critic.build_critic(hf, tcfg)
                load_hf(value, hf_dir, hf, skip=lambda name: name.startswith(critic.HEAD))
                trunk = {k: v for k, v in old.state_dict().items() if not k.startswith(critic.HEAD)}
                head = value.state_dict().pop(critic.HEAD + "weight")
                _assert_equal({k: v for k, v in value.state_dict().items() if not k.startswith(critic.HEAD)}, trunk,
                              ("critic", lay, rank))
                assert not head.any()
            expected, shard, beyond = _expected_reads(direct, hf, hf_dir)
            report[f"{fam} {json.dumps(lay)}"] = dict(read=got.read, expected=expected, beyond=beyond, shard=shard,
                                                      rchar=rchar)
            ps.destroy_model_parallel()
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def test_each_rank_reads_its_own_shard_and_gets_the_converted_weights(models):
    from mcore_rl.convert.hf_io import HFCheckpoint

    run(_each_layout, 2, str(models))
    ranks = [json.loads((models / f"rank{r}.json").read_text()) for r in range(2)]
    for case in ranks[0]:
        fam = case.split()[0]
        ckpt = HFCheckpoint(str(models / fam / "hf"))
        total = sum(ckpt.nbytes(n) for n in ckpt.names())
        headers = sum(ckpt._data_start.values())  # each shard's header, read when the reader opens it
        for r, rep in enumerate(rank[case] for rank in ranks):
            read = sum(rep["read"].values())
            # no tensor read twice, nothing beyond the shard but what cannot be read by rows
            assert all(n <= ckpt.nbytes(h) for h, n in rep["read"].items()), (case, r)
            assert read <= rep["shard"] + sum(rep["beyond"].values()), (case, r, read, rep["shard"], rep["beyond"])
            assert rep["read"] == rep["expected"], (case, r)
            # the kernel saw these reads and little else (the shard headers, twice, through 8 KiB buffers)
            assert read <= rep["rchar"] <= read + 2 * headers + 2**14, (case, r, read, rep["rchar"])
            assert read < 0.8 * total, (case, r, read, total)  # a shard, not the model
        if '"ep": 2' in case or '"pp": 2' in case:  # disjoint experts / layers: the ranks split the model
            names = [set(rank[case]["read"]) for rank in ranks]
            assert names[0] != names[1] and names[0] | names[1] == set(ckpt.names()), case
