"""FP8 engine weights (rollout.weight_dtype: fp8) against SGLang's own FP8 model, loader and dequant.

Two gloo processes each hold a megatron rank (EP=2, fp32, loaded through our converter: each rank
sends its experts' FP8 bytes to the other) and an
SGLang rank of DeepseekV2ForCausalLM built with SGLang's Fp8Config (block FP8, TP=2). The sync
quantizes and sends over the CUDA-IPC transport path into SGLang's WeightUpdater (as
tests/e2e/test_sglang_sync.py does for bf16). What the engine then holds must equal, bit for bit, the
same SGLang model loaded by its own loader from an FP8 DeepSeek-V3 checkpoint of the same weights,
written here block by block with DeepSeek's reference math (tests/unit/test_fp8.py); the read-back
digests of the engine must match what was sent (and a flipped byte must not); SGLang's
dequantization of what it holds must equal our converter's import of that checkpoint.

Two cases on the same two processes: every linear layer in FP8 (engine EP=1), and a model whose
shared experts are not whole 128-row blocks per rank (engine EP=2), which the engine holds in the
model's dtype as its config's ignored_layers say (`engine_layout.fp8_ignored_layers`), against
an FP8 checkpoint that lists them the same way and stores them unquantized. The engine is built
from the config our `engine_model_dir` writes, the reference from the checkpoint's own.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from mcore_rl.convert import hf_mcore as convert
from mcore_rl.models.config import HFModel
from mcore_rl.parallel.groups import Layout
from mcore_rl.sync import fp8
from mcore_rl.sync.engine_layout import EngineLayout
from mcore_rl.sync.plan import SyncPlan
from tests.support import distributed, sglang_reference
from tests.support.tiny_models import make_hf_model
from tests.unit.test_fp8 import deepseek_reference

SHARED = tuple(f"model.layers.1.mlp.shared_experts.{x}" for x in ("gate_proj", "up_proj", "down_proj"))
# name -> (tiny model, engine ep_size, the modules an FP8 checkpoint of it leaves unquantized, the
# engine parameter a flipped byte is put in)
CASES = {
    "fp8": ("deepseek_v3_fp8", 1, (), "model.layers.0.self_attn.o_proj.weight"),
    "bf16_shared": ("deepseek_v3_fp8_bf16_shared", 2, SHARED, "model.layers.1.mlp.shared_experts.gate_up_proj.weight"),
}


def write_fp8_checkpoint(hf_dir: str, out: str, ignored: tuple[str, ...] = ()) -> list[str]:
    """`hf_dir` as an FP8 DeepSeek-V3 checkpoint: every linear projection (`*_proj[_with_mqa].weight`)
    but those of the `ignored` modules as e4m3 + weight_scale_inv by DeepSeek's reference math, the
    rest as it is; its quantization_config lists `ignored` as ignored_layers. Returns the quantized names."""
    from safetensors.torch import load_file, save_file

    os.makedirs(out)
    quantized, tensors = [], {}
    for f in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        for name, t in load_file(f).items():
            module = name.removesuffix(".weight")
            if name.endswith(("_proj.weight", "_proj_with_mqa.weight")) and not any(
                    module == m or module.startswith(m + ".") for m in ignored):  # a module and what it holds
                tensors[name], tensors[name + "_scale_inv"] = deepseek_reference(t)
                quantized.append(name)
            else:
                tensors[name] = t
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {**fp8.QUANTIZATION_CONFIG, **({"ignored_layers": list(ignored)} if ignored else {})}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return quantized


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _worker(rank, root, out):
    sglang_reference.sglang_module("sglang.srt")  # CPU stand-ins before any SGLang import below
    for name, (fam, ep, _, tamper) in CASES.items():
        r = _case(rank, os.path.join(root, name), ep, tamper)
        with open(os.path.join(out, f"{name}.rank{rank}.json"), "w") as f:
            json.dump(r, f)


def _case(rank, root, ep, tamper):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file
    from sglang.srt.distributed import parallel_state as sps
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

    from mcore_rl.convert.hf_io import HFCheckpoint
    from mcore_rl.checkpoint.model import load_model
    from mcore_rl.models.builder import build_model
    from mcore_rl.models.config import transformer_config
    from mcore_rl.parallel.groups import init_distributed
    from mcore_rl.rollout.sglang_plugin import restore_kv_scales, weight_digests
    from mcore_rl.sync import LiveShards, sync_weights
    from mcore_rl.sync.engine_layout import ExpectedDigests, compare_engine
    from tests.e2e.test_sglang_sync import ThreadedEngine, _tensors, _transport

    hf_dir, fp8_dir, engine_dir = (os.path.join(root, d) for d in ("hf", "fp8", "engine"))
    hf = HFModel.from_dir(hf_dir)
    trainer = Layout(ep=2)
    init_distributed(trainer)
    model = build_model(hf, transformer_config(hf, ep=2, dtype=torch.float32, cpu=True))
    load_model(model, os.path.join(root, "ckpt"))
    sglang_reference.init_sglang_parallel(rank, 2, 2, ep, engine_dir)
    engine_layout = EngineLayout(2, ep, 1, 2)
    plan = SyncPlan.build(hf, trainer, 2, engine_layout, {0: 0, 1: 1}, 48 << 10, torch.float32, weight_dtype="fp8")
    synced = sglang_reference.build_model(engine_dir)  # as our engine_model_dir wrote its config
    engine = ThreadedEngine(synced, rank, dist.new_group(backend="gloo"), engine_dir)
    moved = sum(len(b.recvs) for b in plan.for_rank(rank))
    sent = ExpectedDigests(engine_layout, hf, [rank])
    stats = sync_weights(plan, LiveShards(model, plan), _transport("ipc", engine, plan, root, engine_dir),
                         observe=sent.add)
    engine.stop()

    ref = sglang_reference.build_model(fp8_dir)  # SGLang's own loader on the FP8 checkpoint
    ref.load_weights(list(load_file(os.path.join(fp8_dir, "model.safetensors")).items()))
    want, got = _tensors(ref), _tensors(synced)
    differ = sorted(n for n in want if n not in got or got[n].dtype != want[n].dtype
                    or not torch.equal(_bits(got[n]), _bits(want[n])))
    params = dict(synced.named_parameters())
    fp8_params = sorted(n for n, p in params.items() if p.dtype == torch.float8_e4m3fn)
    sent_shared = {t.name: str(t.dtype) for t in plan.tensors.values() if ".shared_experts." in t.name}

    readback = compare_engine({rank: sent.digests[rank]}, {rank: weight_digests(synced)}, "engine")
    with torch.no_grad():  # one flipped byte must show in the read-back
        _bits(params[tamper])[7] ^= 1
    tampered = compare_engine({rank: sent.digests[rank]}, {rank: weight_digests(synced)}, "engine")
    with torch.no_grad():
        _bits(params[tamper])[7] ^= 1

    # SGLang's dequantization of each rank's shard against our converter's import of the checkpoint
    ckpt, dequant = HFCheckpoint(fp8_dir), {}
    for param, hf_name, dim in (("model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.o_proj.weight", 1),
                                ("model.layers.0.self_attn.q_b_proj", "model.layers.0.self_attn.q_b_proj.weight", 0),
                                ("model.layers.0.mlp.down_proj", "model.layers.0.mlp.down_proj.weight", 1)):
        theirs = block_quant_dequant(params[param + ".weight"], params[param + ".weight_scale_inv"], [128, 128],
                                     torch.bfloat16)
        ours = ckpt.get(hf_name).chunk(2, dim=dim)[rank]
        dequant[param] = torch.equal(theirs, ours)

    # The KV-cache scales of the FP8 attention layers, after SGLang's own post-load step, then garbage
    # (what a weights release leaves), then written back by the plugin as the engine actor does on resume
    attn = [m for m in synced.modules() if isinstance(getattr(m, "k_scale", None), torch.Tensor)]
    for m in attn:
        m.quant_method.process_weights_after_loading(m)
    loaded = [[float(m.k_scale), float(m.v_scale)] for m in attn]
    with torch.no_grad():
        for m in attn:
            m.k_scale.fill_(float("nan"))
            m.v_scale.fill_(-3.0)
    kv_scales = dict(layers=len(attn), loaded=loaded, written=restore_kv_scales(synced),
                     restored=[[float(m.k_scale), float(m.v_scale)] for m in attn])

    # SGLang's CPU engine would next run its post-load step on every FP8 layer: record what it says
    layer = synced.model.layers[0].self_attn.o_proj
    try:
        layer.quant_method.process_weights_after_loading(layer)
        cpu_engine = "ran"
    except Exception as e:  # noqa: BLE001 - the message is the finding
        cpu_engine = f"{type(e).__name__}: {e}"
    sps.destroy_model_parallel()
    ps.destroy_model_parallel()
    return dict(tensors=len(want), differ=differ[:10], n_differ=len(differ), fp8_params=fp8_params,
                sent_shared=sent_shared, buckets=stats["buckets"], moved=moved, readback=readback,
                tampered=tampered, dequant=dequant, cpu_engine=cpu_engine, kv_scales=kv_scales)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    reason = sglang_reference.available()
    if reason:
        pytest.fail(reason)
    from mcore_rl.rollout.sglang import engine_model_dir

    root = tmp_path_factory.mktemp("fp8sync")
    quantized, engine_configs = {}, {}
    for name, (fam, ep, ignored, _) in CASES.items():
        case = root / name
        make_hf_model(fam, str(case / "hf"))
        convert.hf_to_mcore(str(case / "hf"), str(case / "ckpt"), dtype="fp32")
        quantized[name] = write_fp8_checkpoint(str(case / "hf"), str(case / "fp8"), ignored)
        engine = engine_model_dir(str(case / "hf"), str(case / "engine"), [1], "cpu", "fp8", weights=False,
                                  layout=EngineLayout(2, ep, 1, 2))
        engine_configs[name] = json.loads(open(os.path.join(engine, "config.json")).read())
    out = root / "out"
    out.mkdir()
    distributed.run(_worker, 2, str(root), str(out))
    return quantized, {name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]
                       for name in CASES}, engine_configs


FP8_LINEARS = [f"model.layers.{i}.self_attn.{x}.weight" for i in (0, 1)
               for x in ("fused_qkv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj")] + [
    "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
    "model.layers.1.mlp.experts.w13_weight", "model.layers.1.mlp.experts.w2_weight"]
FP8_SHARED = ["model.layers.1.mlp.shared_experts.gate_up_proj.weight", "model.layers.1.mlp.shared_experts.down_proj.weight"]


def _every_rank(results) -> list[dict]:
    return [r for ranks in results[1].values() for r in ranks]


def test_fp8_sync_equals_sglang_loading_the_fp8_checkpoint(results):
    quantized, cases, engine_configs = results
    assert len(quantized["fp8"]) == 2 * 5 + 3 + 3 + 8 * 3  # attention x 2 layers, dense MLP, shared expert, experts
    assert "ignored_layers" not in engine_configs["fp8"]["quantization_config"]
    for r in cases["fp8"]:
        assert r["n_differ"] == 0 and r["tensors"] > 20, r["differ"]
        assert r["buckets"] > 3 and r["moved"] >= 2 * 4 * 3  # the other rank's experts: weights and scales
        # every linear layer SGLang runs in FP8 holds e4m3: attention, dense MLP, shared and routed experts
        assert r["fp8_params"] == sorted(FP8_LINEARS + FP8_SHARED)


def test_shared_experts_not_whole_blocks_per_rank_stay_unquantized_as_an_fp8_checkpoint_says(results):
    """Moonlight's shared experts at engine TP=4 (704 rows a rank): here 192 rows a rank at TP=2.
    The engine's config lists them as an FP8 checkpoint that leaves them unquantized does; SGLang
    then holds them in the model's dtype, bit for bit as its own loader reads that checkpoint, and
    the sync sends them so, with no scales."""
    quantized, cases, engine_configs = results
    assert len(quantized["bf16_shared"]) == 2 * 5 + 3 + 8 * 3  # no shared expert
    assert engine_configs["bf16_shared"]["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "ignored_layers": sorted(SHARED)}
    for r in cases["bf16_shared"]:
        assert r["n_differ"] == 0 and r["tensors"] > 20, r["differ"]
        assert r["fp8_params"] == sorted(FP8_LINEARS)
        assert r["sent_shared"] == {f"{m}.weight": "torch.float32" for m in SHARED}  # the model's dtype here
        assert r["buckets"] > 3 and r["moved"] == 0  # EP=2 on both sides: each rank holds its engine rank's experts


def test_fp8_readback_matches_what_was_sent_and_catches_a_flipped_byte(results):
    for name, ranks in results[1].items():
        for rank, r in enumerate(ranks):
            assert r["readback"] == []
            assert r["tampered"] == [f"engine tp rank {rank}: {CASES[name][3]} differs from the trainer's weights"]


def test_sglang_dequantizes_what_it_holds_as_our_converter_imports_the_checkpoint(results):
    for r in _every_rank(results):
        assert r["dequant"] and all(r["dequant"].values()), r["dequant"]


def test_kv_scales_a_weights_release_loses_are_written_back(results):
    """FP8 attention layers divide each cached K by their `k_scale` tensor, which no sync rewrites:
    after a release it held garbage and the engine decoded wrongly (H100, Moonlight widths)."""
    for r in _every_rank(results):
        kv = r["kv_scales"]
        # two RadixAttention modules per MLA layer (absorbed and plain), 1.0 from SGLang's post-load step
        assert kv["layers"] == 4 and kv["loaded"] == [[1.0, 1.0]] * 4
        assert kv["written"] == 8 and kv["restored"] == kv["loaded"]


def test_sglang_cpu_engine_cannot_run_fp8_layers_here(results):
    """SGLang 0.5.20's CPU FP8 linear runs only through sgl_kernel's AMX kernels
    (Fp8LinearMethod.process_weights_after_loading_block_quant asserts AMX support): on a CPU
    without AMX, as CI's, an FP8 engine fails at start, so no FP8 GRPO run happens on CPU."""
    has_amx = "amx_tile" in open("/proc/cpuinfo").read()
    for r in _every_rank(results):
        if has_amx:
            pytest.skip(f"this CPU has AMX; SGLang's post-load step said: {r['cpu_engine']}")
        assert r["cpu_engine"] == "AssertionError: Fp8LinearMethod on CPU requires that CPU has AMX support"
