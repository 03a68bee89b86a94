"""Megatron -> SGLang weight sync against SGLang's own model, loader and wire classes.

Two gloo processes each hold a megatron rank (loaded through our converter) and an SGLang rank
(SGLang's real DeepseekV2ForCausalLM / Qwen2ForCausalLM / Qwen3MoeForCausalLM / Glm4MoeForCausalLM;
SGLang as installed in the venv, with the CPU stand-ins of mcore_rl.rollout.sglang_cpu). Weights
go through our plan, gather and transports (CudaIpcTransport with SGLang's FlattenedTensorMetadata,
read back by its MultiprocessingSerializer; update-group broadcast; disk) into SGLang's
WeightUpdater, exactly as its TpModelWorker does; the result must equal the same SGLang model
loaded straight from the HF files, bit for bit, and colocated, the digests a verified sync expects
(the engine-layout table) must be SGLang's. Layouts that cannot run here (TP16 over 2 nodes, EP8)
are checked as plans.
"""

from __future__ import annotations

import glob
import json
import os
import threading

import pytest
import torch

from mcore_rl.convert import hf_mcore as convert
from mcore_rl.models.config import HFModel
from mcore_rl.parallel.groups import Layout
from mcore_rl.sync.engine_layout import EngineLayout, SyncPlanError
from mcore_rl.sync.plan import SyncPlan, single_source
from tests.support import distributed, sglang_reference
from tests.support.tiny_models import make_hf_model

CASES = {  # name: (family, trainer layout, engine tp, engine ep, transport)
    "ds_tp2": ("deepseek_v3", Layout(tp=2), 2, 1, "ipc"),
    "ds_tp2ep2_from_ep2": ("deepseek_v3", Layout(ep=2), 2, 2, "ipc"),
    "qwen2_tp2": ("qwen2", Layout(tp=2), 2, 1, "ipc"),
    "qwen3moe_tp2ep2_from_ep2": ("qwen3_moe_one_kv_head", Layout(ep=2), 2, 2, "ipc"),  # KV head replicated
    "glm_tp2_from_tp2": ("glm4_moe", Layout(tp=2), 2, 1, "ipc"),
    "ds_tp2ep2_broadcast": ("deepseek_v3", Layout(ep=2), 2, 2, "broadcast"),  # gloo stands in for NCCL
    "ds_tp2_disk": ("deepseek_v3", Layout(tp=2), 2, 1, "disk"),  # synced twice: versions replace each other
    # rollout.sync_load=direct: buckets copied into SGLang's parameters by the placement table, not its loader
    "qwen3moe_tp2ep2_direct": ("qwen3_moe_one_kv_head", Layout(ep=2), 2, 2, "direct"),
    "glm_tp2_direct": ("glm4_moe", Layout(tp=2), 2, 1, "direct"),
    "qwen2_tp2_direct": ("qwen2", Layout(tp=2), 2, 1, "direct"),
    # rollout.dp_attention: attention, embeddings, lm_head and the dense MLP whole on each rank
    "ds_tp2dp2ep2_from_ep2": ("deepseek_v3", Layout(ep=2), 2, 2, "ipc"),
}
ATTENTION_DP = {"ds_tp2dp2ep2_from_ep2": 2}  # case: SGLang's dp_size under DP attention (others: 1)
BUCKET = 48 << 10  # small, so every model needs many buckets


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    reason = sglang_reference.available()
    if reason:  # scripts/setup.sh installs SGLang: missing is an error, not a skip
        pytest.fail(reason)
    root = tmp_path_factory.mktemp("sync")
    for fam in {c[0] for c in CASES.values()}:
        make_hf_model(fam, str(root / fam / "hf"))
        convert.hf_to_mcore(str(root / fam / "hf"), str(root / fam / "ckpt"), dtype="fp32")
    return root


class ThreadedEngine:
    """Stands where SGLang's scheduler stands: the driver's calls reach every engine rank (here over
    a gloo group, served by a thread on the other ranks), and each rank deserializes its own tensor
    payload and hands every update to SGLang's own WeightUpdater, as TpModelWorker does (tensor,
    disk, update group, distributed; begin/end where the version has them). A call returns once
    every rank has finished and raises if any rank failed."""

    def __init__(self, model, rank: int, group, hf_dir: str):
        import torch.distributed as dist
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

        self.rank, self.group, self.dist = rank, group, dist
        self.updater = WeightUpdater(
            tp_rank=rank, device="cpu", gpu_id=0, model_config=ModelConfig(hf_dir, dtype="float32"),
            custom_weight_loaders={}, get_model=lambda: model, update_model_fields=lambda *a, **k: None,
            recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)
        self.loaded_names: list[str] = []
        self.loaded_in_session = False  # SGLang's scheduler: post-load hooks run at end only if nothing loaded
        self.thread = None
        if rank != 0:
            self.thread = threading.Thread(target=self._serve, daemon=True)
            self.thread.start()

    def _serve(self):
        while True:
            box = [None]
            self.dist.broadcast_object_list(box, src=0, group=self.group)
            if box[0] is None:
                return
            self._run(*box[0])

    def _call(self, *msg):
        self.dist.broadcast_object_list([msg], src=0, group=self.group)
        failed = [r for r in self._run(*msg) if r is not None]
        if failed:
            raise RuntimeError(f"engine call {msg[0]} failed: {failed}")

    def _run(self, method, *args):
        try:
            result = getattr(self, "_" + method)(*args)
            error = None if result in (None, True) or result[0] else f"rank {self.rank}: {result[1]}"
        except Exception as e:  # noqa: BLE001 - reported to the driver, as SGLang reports failures
            error = f"rank {self.rank}: {type(e).__name__}: {e}"
        errors = [None] * self.dist.get_world_size(self.group)
        self.dist.all_gather_object(errors, error, group=self.group)
        return errors

    def _has_sessions(self) -> bool:
        """SGLang 0.5.23 brackets an update with begin/end and receives apart from loading; 0.5.20
        has neither (its model's load_weights runs the post-load step itself)."""
        return hasattr(self.updater, "begin_weight_update")

    def _begin(self):
        self.loaded_in_session = False
        if self._has_sessions():
            self.updater.begin_weight_update()

    def _end(self):
        if self._has_sessions():
            self.updater.end_weight_update(run_post_load=not self.loaded_in_session)

    def _loaded(self, names, result):
        if result[0]:  # (success, message), as every WeightUpdater method returns
            self.loaded_names += names
            self.loaded_in_session = True
        return result

    def _tensor(self, payloads, load_format):
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        assert load_format == "flattened_bucket"
        monkey_patch_torch_reductions()  # TpModelWorker: each rank deserializes its own payload
        data = MultiprocessingSerializer.deserialize(payloads[self.rank])
        names = [m.name for m in data["metadata"]]
        return self._loaded(names, self.updater.update_weights_from_tensor(data, load_format=load_format))

    def _direct(self, payloads, layout, hf):
        from mcore_rl.rollout.sglang_plugin import load_bucket_direct

        load_bucket_direct(self.updater.get_model(), payloads[self.rank], layout, hf, self.rank)
        self.loaded_in_session = True

    def _init_group(self, kwargs):
        return self.updater.init_weights_update_group(**kwargs)

    def _distributed(self, kwargs):
        if not self._has_sessions():  # 0.5.20: receives and loads in one call
            return self._loaded(kwargs["names"], self.updater.update_weights_from_distributed(**kwargs))
        weights = self.updater.receive_weights_from_distributed(**kwargs)
        return self._loaded([n for n, _ in weights], self.updater.load_weights_from_distributed(weights))

    def _disk(self, path):
        return self.updater.update_weights_from_disk(path, load_format="auto")

    def begin_weight_update(self):
        self._call("begin")

    def end_weight_update(self):
        self._call("end")

    def update_weights_from_tensor(self, payloads, load_format=None, flush_cache=True):
        self._call("tensor", payloads, load_format)

    def load_weights_direct(self, payloads, layout, hf, flush_cache=True):
        self._call("direct", payloads, layout, hf)

    def init_weights_update_group(self, **kwargs):
        self._call("init_group", kwargs)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, load_format=None,
                                        flush_cache=True):
        self._call("distributed", dict(names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
                                       load_format=load_format))

    def update_weights_from_disk(self, model_path):
        self._call("disk", model_path)

    def stop(self):
        if self.rank == 0:
            self.dist.broadcast_object_list([None], src=0, group=self.group)
        else:
            self.thread.join(timeout=60)


def _cpu_serialize(obj) -> bytes:
    """SGLang's MultiprocessingSerializer bytes for CPU tensors: its monkey_patch_torch_reductions
    (applied by its weight-update path, here in the driver's own process) rewrites the device
    index of CUDA handles and raises IndexError on CPU tensors, so pickle with torch's own tensor
    reducer; SGLang's SafeUnpickler reads the result."""
    import io
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.Tensor] = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)
    pickler.dump(obj)
    return buf.getvalue()


def _tensors(model) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update(model.named_buffers())
    for name, mod in model.named_modules():  # MLA's w_kc / w_vc are derived plain attributes
        for attr in ("w_kc", "w_vc"):
            if isinstance(getattr(mod, attr, None), torch.Tensor):
                out[f"{name}.{attr}"] = getattr(mod, attr)
    return out


def _transport(kind: str, engine, plan, root: str, hf_dir: str):
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    from mcore_rl.parallel.groups import free_port
    from mcore_rl.sync import transports

    if kind in ("ipc", "direct"):
        return transports.CudaIpcTransport(engine, plan.engine_rank_of, serializer=_cpu_serialize,
                                           meta_cls=FlattenedTensorMetadata,
                                           direct=(plan.engine, plan.hf) if kind == "direct" else None)
    if kind == "disk":
        return transports.DiskTransport(engine, os.path.join(root, "disk_sync"), hf_dir=hf_dir)
    group = None
    if engine.rank == 0:  # the driver; the engine ranks join on their side (ThreadedEngine)
        group = transports.open_update_group(engine, "127.0.0.1", free_port(), plan.engine.tp_size,
                                             backend="gloo")
    return transports.NcclBroadcastTransport(engine, group)


def _sglang_model(hf_dir: str, scale: float | None = None):
    """SGLang's model loaded from the HF files (times `scale`), or uninitialised (scale None)."""
    from safetensors.torch import load_file

    model = sglang_reference.build_model(hf_dir)
    if scale is not None:
        files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
        model.load_weights([(n, t * scale) for f in files for n, t in load_file(f).items()])
    return model


def _case(rank, root, name, fam, trainer, tp, ep, kind):
    dp = ATTENTION_DP.get(name, 1)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from sglang.srt.distributed import parallel_state as sps

    from mcore_rl.checkpoint.model import load_model
    from mcore_rl.models.builder import build_model
    from mcore_rl.models.config import transformer_config
    from mcore_rl.parallel.groups import init_distributed
    from mcore_rl.rollout.sglang_plugin import weight_digests
    from mcore_rl.sync import LiveShards, sync_weights
    from mcore_rl.sync.engine_layout import ExpectedDigests, compare_engine

    hf_dir = os.path.join(root, fam, "hf")
    hf = HFModel.from_dir(hf_dir)
    init_distributed(trainer)
    model = build_model(hf, transformer_config(hf, tp=trainer.tp, ep=trainer.ep, dtype=torch.float32, cpu=True))
    load_model(model, os.path.join(root, fam, "ckpt"))

    sglang_reference.init_sglang_parallel(rank, 2, tp, ep, hf_dir, dp)
    synced = _sglang_model(hf_dir)
    colocated = kind in ("ipc", "direct")
    feed = {0: 0, 1: 1} if colocated else single_source(0)
    plan = SyncPlan.build(hf, trainer, 2, EngineLayout(tp, ep, 1, tp, dp), feed, BUCKET, torch.float32)
    plan.check_complete()
    engine = ThreadedEngine(synced, rank, dist.new_group(backend="gloo"), hf_dir)
    transport = _transport(kind, engine, plan, root, hf_dir)
    rounds = []
    for scale in (1.0, 2.0) if kind == "disk" else (1.0,):  # disk: a second sync must replace the first
        shards = LiveShards(model, plan)
        with torch.no_grad():
            for t in shards.local.values():  # what the sync reads: parameters and the router's expert bias
                t.mul_(scale)
        engine.loaded_names.clear()
        # colocated, each rank also accumulates the digests its engine rank must hold, as a verified
        # sync does: the read-back table (engine_layout) must place every piece where SGLang has it
        expected = ExpectedDigests(plan.engine, hf, [rank]) if colocated else None
        stats = sync_weights(plan, shards, transport, observe=expected.add if expected else None)
        dist.barrier()  # single source: other ranks return at once, while their engine thread still loads
        ref, got = _tensors(_sglang_model(hf_dir, scale=2.0 if rounds else 1.0)), _tensors(synced)
        differ = sorted(n for n in ref if n not in got or not torch.equal(ref[n], got[n]))
        readback = compare_engine(expected.digests, {rank: weight_digests(synced)}, name) if expected else []
        rounds.append(dict(tensors=len(ref), differ=differ[:10], n_differ=len(differ), readback=readback[:10]))
    engine.stop()
    if kind == "broadcast":
        engine.updater.destroy_weights_update_group("weight_update_group")
    experts = sorted({int(n.split(".")[5]) for n in engine.loaded_names if ".mlp.experts." in n})
    sps.destroy_model_parallel()
    ps.destroy_model_parallel()
    out = dict(rounds=rounds, buckets=stats["buckets"], bytes=stats["bytes"], experts=experts,
               loaded=sorted(engine.loaded_names), payload=sorted(plan.payload_names(rank)),
               all_tensors=sorted(plan.tensors),
               shapes={n: list(p.shape) for n, p in synced.named_parameters()})
    if kind == "disk":
        out["disk_versions"] = sorted(os.listdir(os.path.join(root, "disk_sync")))
    return out


def _bucket_format_matches_sglang() -> dict:
    """Our flatten/unflatten (used where SGLang is absent) against SGLang's FlattenedTensorBucket."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from mcore_rl.sync.bucket import flatten, unflatten

    g = torch.Generator().manual_seed(3)
    named = [("a", torch.randn(3, 5, generator=g)), ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
             ("c", torch.randint(0, 9, (2, 2), generator=g, dtype=torch.int8))]
    ours, metas = flatten(named)
    theirs = FlattenedTensorBucket(named_tensors=named)
    fields = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")
    same_meta = [[getattr(m, f) for f in fields] for m in metas] == \
        [[getattr(m, f) for f in fields] for m in theirs.get_metadata()]
    back = unflatten(theirs.get_flattened_tensor(), theirs.get_metadata())
    return dict(same_bytes=torch.equal(ours, theirs.get_flattened_tensor()), same_meta=same_meta,
                round_trip=all(n == m and torch.equal(t, u) for (n, t), (m, u) in zip(named, back)))


def _worker(rank, root, out):
    sglang_reference.sglang_module("sglang.srt")  # CPU stand-ins before any SGLang import below
    if rank == 0:
        with open(os.path.join(out, "bucket_format.json"), "w") as f:
            json.dump(_bucket_format_matches_sglang(), f)
    for name, (fam, trainer, tp, ep, kind) in CASES.items():
        r = _case(rank, root, name, fam, trainer, tp, ep, kind)
        with open(os.path.join(out, f"{name}.rank{rank}.json"), "w") as f:
            json.dump(r, f)


@pytest.fixture(scope="module")
def synced(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    distributed.run(_worker, 2, str(models), str(out))
    return {p.name.removesuffix(".json"): json.loads(p.read_text()) for p in out.glob("*.json")}


@pytest.mark.parametrize("case", list(CASES))
def test_sync_is_bit_exact_against_sglang_loading_hf(synced, case):
    kind = CASES[case][-1]
    for rank in (0, 1):
        r = synced[f"{case}.rank{rank}"]
        for i, rnd in enumerate(r["rounds"]):
            assert rnd["n_differ"] == 0 and rnd["tensors"] > 10, (case, rank, i, rnd["differ"])
            assert not rnd["readback"], (case, rank, i, rnd["readback"])
        assert r["buckets"] > 3, r  # the small bucket size forced real bucketing
        if kind == "ipc":  # each engine rank loads its own payload
            assert r["loaded"] == r["payload"]
        elif kind == "broadcast":  # every engine rank receives every tensor of the single source
            assert r["loaded"] == r["all_tensors"]
            assert r["payload"] == (r["all_tensors"] if rank == 0 else [])


def test_disk_sync_keeps_only_the_version_the_engine_loaded(synced):
    for rank in (0, 1):
        r = synced[f"ds_tp2_disk.rank{rank}"]
        assert len(r["rounds"]) == 2  # the second sync (weights doubled) matched SGLang loading 2 x HF
        assert r["disk_versions"] == ["v000001"]


def test_our_bucket_format_is_sglangs(synced):
    assert synced["bucket_format"] == dict(same_bytes=True, same_meta=True, round_trip=True)


@pytest.mark.parametrize("case", [c for c, v in CASES.items() if v[-1] == "ipc"])
def test_planner_engine_tensors_are_sglangs(synced, models, case):
    """The memory planner's view of an engine rank (mcore_rl.memory.layout.engine_tensors) has
    SGLang's own parameters, shapes and all (MLA's derived w_kc/w_vc aside)."""
    from mcore_rl.memory.layout import engine_tensors, inventory

    fam, _, tp, ep, _ = CASES[case]
    hf = HFModel.from_dir(str(models / fam / "hf"))
    for rank in (0, 1):
        planned = {n: list(t.shape) for n, t in engine_tensors(hf, inventory(hf), tp=tp, ep=ep, rank=rank,
                                                               attn_dp=ATTENTION_DP.get(case, 1)).items()
                   if t.derived_from is None}
        assert planned == synced[f"{case}.rank{rank}"]["shapes"]


def test_experts_reach_only_their_engine_ranks(synced):
    E = 8
    for rank in (0, 1):
        tp_only = synced[f"ds_tp2.rank{rank}"]
        assert tp_only["experts"] == list(range(E))  # EP=1: every rank owns every expert
        with_ep = synced[f"ds_tp2ep2_from_ep2.rank{rank}"]
        assert with_ep["experts"] == list(range(rank * E // 2, (rank + 1) * E // 2))


def test_dp_attention_keeps_attention_embeddings_lm_head_and_dense_mlp_whole_on_each_rank(synced, models):
    """SGLang's own parameters under DP attention (dp = tp = 2, EP 2), against the same engine without it:
    attention, embeddings, lm_head and the dense layer's MLP whole on each rank; shared experts still
    split over the two ranks, routed experts over EP as before (the values: the bit-exact test above)."""
    from mcore_rl.sync.engine_layout import hf_shape

    hf = HFModel.from_dir(str(models / "deepseek_v3" / "hf"))
    whole = {"model.layers.1.self_attn.kv_b_proj.weight": [hf_shape(hf, "model.layers.1.self_attn.kv_b_proj.weight")],
             "model.layers.1.self_attn.o_proj.weight": [hf_shape(hf, "model.layers.1.self_attn.o_proj.weight")],
             "model.layers.1.self_attn.q_b_proj.weight": [hf_shape(hf, "model.layers.1.self_attn.q_b_proj.weight")],
             "model.embed_tokens.weight": [hf_shape(hf, "model.embed_tokens.weight")],
             "lm_head.weight": [hf_shape(hf, "lm_head.weight")],
             "model.layers.0.mlp.down_proj.weight": [hf_shape(hf, "model.layers.0.mlp.down_proj.weight")]}
    for rank in (0, 1):
        dp, tp = synced[f"ds_tp2dp2ep2_from_ep2.rank{rank}"], synced[f"ds_tp2ep2_from_ep2.rank{rank}"]
        for name, (shape,) in whole.items():
            assert dp["shapes"][name] == list(shape) != tp["shapes"][name], name
        for name in ("model.layers.1.mlp.shared_experts.down_proj.weight", "model.layers.1.mlp.experts.w13_weight"):
            assert dp["shapes"][name] == tp["shapes"][name], name
        assert dp["experts"] == tp["experts"]


# ---- plans for layouts that cannot run here -------------------------------------------------

def _moonlight_like(**kw) -> HFModel:
    cfg = dict(model_type="deepseek_v3", vocab_size=163840, hidden_size=2048, intermediate_size=11264,
               moe_intermediate_size=1408, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
               n_routed_experts=64, n_shared_experts=2, first_k_dense_replace=1, num_experts_per_tok=6,
               kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    cfg.update(kw)
    return HFModel.from_dict(cfg)


def _sglang_rank_bytes(hf: HFModel, engine: EngineLayout, tp_rank: int) -> int:
    """What SGLang's loader reads for one rank, from the config alone: every non-expert HF tensor
    whole (its weight_loader slices), and the three tensors of each expert the rank owns."""
    c, H, bf16 = hf.cfg, hf.hidden_size, 2
    heads, qk = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    ql = c["q_lora_rank"]  # q_a_proj + q_a_layernorm + q_b_proj, or one q_proj
    q = ql * H + ql + heads * qk * ql if ql else heads * qk * H
    attn = (q + (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * H + c["kv_lora_rank"]
            + heads * (c["qk_nope_head_dim"] + c["v_head_dim"]) * c["kv_lora_rank"] + H * heads * c["v_head_dim"])
    total = 2 * hf.vocab_size * H + H
    owned = len(engine.experts_of(tp_rank, hf.num_experts))
    for layer in range(hf.num_layers):
        total += attn + 2 * H
        if hf.is_moe_layer(layer):
            shared = c["moe_intermediate_size"] * c["n_shared_experts"]
            total += hf.num_experts * H + 3 * shared * H + owned * 3 * c["moe_intermediate_size"] * H
        else:
            total += 3 * c["intermediate_size"] * H
    extra_fp32 = sum(hf.num_experts for layer in range(hf.num_layers) if hf.is_moe_layer(layer))  # e_score bias
    return total * bf16 + extra_fp32 * 4


@pytest.mark.parametrize("engine,q_lora", [(EngineLayout(16, 1, nnodes=2, gpus_per_node=8), None),
                                           (EngineLayout(16, 1, nnodes=2, gpus_per_node=8), 1536),
                                           (EngineLayout(8, 8, nnodes=1, gpus_per_node=8), None),
                                           (EngineLayout(16, 8, nnodes=2, gpus_per_node=8), None)])
def test_plan_for_layouts_beyond_this_machine(engine, q_lora):
    hf = _moonlight_like(q_lora_rank=q_lora)
    world = engine.tp_size
    plan = SyncPlan.build(hf, Layout(tp=2, ep=world // 2 if world // 2 <= 64 else 1), world, engine,
                          {r: r for r in range(world)}, bucket_bytes=256 << 20)
    plan.check_complete()
    for r in range(world):
        parts = plan.for_rank(r)
        got = sum(b.payload_bytes for b in parts)
        assert got == _sglang_rank_bytes(hf, engine, r), (r, got)
        names = plan.payload_names(r)
        own = engine.experts_of(r, hf.num_experts)
        experts = {int(n.split(".")[5]) for n in names if ".mlp.experts." in n}
        assert experts == set(own)
        assert len(names) == len(set(names))
        for b in parts:  # the q_a / kv_a pair always shares a bucket
            held = {t.name for t in b.payload}
            for n in held:
                if n.endswith("q_a_proj.weight"):
                    assert n.replace("q_a_proj", "kv_a_proj_with_mqa") in held
        for b in parts:  # nothing fused: no tensor has an expert dimension
            assert all(len(t.shape) <= 2 and t.shape[0] != hf.num_experts * 2 * 1408 for t in b.payload)
    assert {engine.node_and_local(r)[0] for r in range(world)} == set(range(engine.nnodes))


def test_buckets_respect_the_size_cap():
    hf = _moonlight_like()
    plan = SyncPlan.build(hf, Layout(tp=1, ep=8), 8, EngineLayout(8, 8, 1, 8), {r: r for r in range(8)},
                          bucket_bytes=64 << 20)
    biggest = max(t.nbytes for t in plan.tensors.values())
    for r in range(8):
        for b in plan.for_rank(r):
            assert b.payload_bytes <= max(64 << 20, biggest + (8 << 20))


# ---- bad input: clear errors before any transfer ------------------------------------------------

@pytest.mark.parametrize("engine,rank_of,match", [
    (EngineLayout(3, 1, 1, 3), {r: r for r in range(3)}, "does not divide num_attention_heads"),
    (EngineLayout(4, 3, 1, 4), {r: r for r in range(4)}, "does not divide"),
    (EngineLayout(16, 1, 2, None), {r: r for r in range(16)}, "gpus_per_node is unknown"),
    (EngineLayout(16, 1, 2, 4), {r: r for r in range(16)}, "gpus_per_node=4 x nnodes=2"),
    (EngineLayout(4, 1, 1, 4), {0: 0, 1: 1, 2: 2}, "mismatched GPU counts"),
    (EngineLayout(4, 1, 1, 4), {0: 0, 1: 1, 2: 2, 3: 2}, "once per engine"),
    (EngineLayout(4, 1, 1, 4), {0: 0, 1: 1, 2: 2, 9: 3}, "do not exist"),
])
def test_bad_engine_layouts_are_refused(engine, rank_of, match):
    with pytest.raises(SyncPlanError, match=match):
        SyncPlan.build(_moonlight_like(), Layout(tp=2), 4, engine, rank_of)


def test_ep_not_dividing_experts_is_refused():
    with pytest.raises(SyncPlanError, match="ep_size=3 does not divide n_routed_experts=64"):
        SyncPlan.build(_moonlight_like(), Layout(), 6, EngineLayout(6, 3, 1, 6), {r: r for r in range(6)})


def test_missing_tensor_in_plan_is_reported():
    hf = _moonlight_like()
    plan = SyncPlan.build(hf, Layout(), 2, EngineLayout(2, 1, 1, 2), {0: 0, 1: 1}, bucket_bytes=1 << 30)
    plan.buckets[0][1].payload.pop()  # a tensor rank 1's engine needs is no longer sent
    with pytest.raises(SyncPlanError, match="trainer rank 1 .* is missing"):
        plan.check_complete()


def test_single_source_plan_sends_everything_from_rank_zero():
    hf = _moonlight_like()
    plan = SyncPlan.build(hf, Layout(tp=2, ep=2), 4, EngineLayout(4, 2, 1, 4), single_source(0))
    names = plan.payload_names(0)
    assert len(names) == len(plan.tensors) and plan.payload_names(1) == []
    assert any(dst == 0 for r in (1, 2, 3) for b in plan.for_rank(r) for _, dst in b.sends)


@pytest.mark.parametrize("engine,rank_of", [(EngineLayout(1, 1, 1, 1), {0: 0}),
                                             (EngineLayout(2, 2, 1, 2), {0: 0, 1: 1})])
def test_a_direct_load_copies_each_layers_experts_at_once(engine, rank_of):
    """The plan orders a bucket as SGLang stacks the experts (w13[e] = [gate_e; up_e], w2[e] = down_e),
    so the direct load copies a layer's local experts into each of w13 and w2 with one copy, and
    a later sync of the same bucket makes the same copies."""
    from mcore_rl.sync import engine_layout
    from mcore_rl.sync.bucket import flatten

    hf = HFModel.from_dict(dict(model_type="qwen3_moe", vocab_size=256, hidden_size=32, intermediate_size=64,
                                moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2))
    plan = SyncPlan.build(hf, Layout(), len(rank_of), engine, rank_of, bucket_bytes=1 << 30)
    for r in rank_of.values():
        (bucket,) = plan.for_rank(r)
        flat, metas = flatten([(t.name, torch.randn(t.shape).to(t.dtype)) for t in bucket.payload])
        params = {}
        for name, t in engine_layout.unflatten(flat, metas):
            for p in engine_layout.place(name, t, engine, r, hf):
                params[p.param] = max(params.get(p.param, 0), p.offset + p.src.numel())
        params = {k: torch.zeros(n, dtype=torch.bfloat16) for k, n in params.items()}
        engine_layout._COPIES.clear()
        engine_layout.load_direct(params, flat, metas, engine, r, hf)
        (copies,) = engine_layout._COPIES.values()
        experts = [c[0] for c in copies if ".experts." in c[0]]
        assert all(c[6] is None for c in copies if ".experts." in c[0])  # slices of the bucket
        assert sorted(experts) == sorted(f"model.layers.{i}.mlp.experts.{w}" for i in range(2)
                                         for w in ("w13_weight", "w2_weight")), experts
        again = {k: torch.zeros_like(v) for k, v in params.items()}
        engine_layout.load_direct(again, flat.clone(), metas, engine, r, hf)
        assert all(torch.equal(again[k], v) for k, v in params.items())


def test_every_family_the_direct_load_accepts_is_checked_here():
    from mcore_rl.models.families import DIRECT_LOAD_TYPES

    direct = [fam for fam, *_, kind in CASES.values() if kind == "direct"]
    assert all(any(fam.startswith(f) for fam in direct) for f in DIRECT_LOAD_TYPES), (direct, DIRECT_LOAD_TYPES)
