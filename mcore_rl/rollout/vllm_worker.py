"""The weight-update side of mcore_rl inside vLLM's worker processes (`worker_extension_cls`).

vLLM mixes `WeightUpdates` into its worker class, so these methods run in every worker (one per
TP rank) when the engine actor calls `llm.collective_rpc("mcore_rl_...")`. A sync stages HF
tensors (by value, over a gloo/NCCL update group, or from a disk version) and loads them all at
once on commit with vLLM's in-place `reload_weights`: vLLM fuses q/k/v, gate/up and the experts of
a layer, and a layer that gets only part of its tensors in one reload is processed half-empty.

Names are HF checkpoint names (what `mcore_rl.sync.plan` produces from the declarative mapping).
A name or shape this model's checkpoint does not have is refused before anything is loaded: vLLM
would raise in the middle of the reload and leave the engine dead. Tensors cannot ride in
collective_rpc's arguments (msgpack turns them into lists), so they travel as bytes plus metadata.
"""

from __future__ import annotations

import glob
import logging
import os

import torch

from mcore_rl.sync.bucket import Meta, unflatten

log = logging.getLogger(__name__)

DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16)}


def wire_bucket(bucket: dict) -> tuple[bytes, list[dict]]:
    """A by-value flattened bucket ({"flattened_tensor", "metadata"}) as collective_rpc can carry it."""
    metas = [m if isinstance(m, dict) else vars(m) for m in bucket["metadata"]]
    return (bucket["flattened_tensor"].contiguous().numpy().tobytes(),
            [dict(name=m["name"], shape=list(m["shape"]), dtype=str(m["dtype"]).removeprefix("torch."),
                  start_idx=m["start_idx"], end_idx=m["end_idx"], numel=m["numel"]) for m in metas])


def _metas(wire: list[dict]) -> list[Meta]:
    return [Meta(m["name"], torch.Size(m["shape"]), DTYPES[m["dtype"]], m["start_idx"], m["end_idx"], m["numel"])
            for m in wire]


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...] | None]:
    """{name: shape} of every tensor in the safetensors files of `model_dir` (headers only). A dir
    without them (an embedded config's, dummy-loaded): the HF names its config maps to, shapes unknown."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        from mcore_rl.models.mappings import mapping_for
        from mcore_rl.models.config import HFModel

        hf = HFModel.from_dir(model_dir)
        return {name: None for p in mapping_for(hf).params(hf) for name in p.hf}
    out = {}
    for f in files:
        with safe_open(f, "pt") as st:
            out.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    return out


def check_update(staged: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...] | None]) -> list[str]:
    """Problems that would break vLLM's reload: unknown names, wrong shapes (where known), a partial model."""
    problems = [f"{n}: not in this model's checkpoint" for n in sorted(set(staged) - set(expected))]
    problems += [f"{n}: shape {tuple(t.shape)}, the checkpoint has {expected[n]}" for n, t in sorted(staged.items())
                 if expected.get(n) is not None and tuple(t.shape) != expected[n]]
    missing = sorted(set(expected) - set(staged))
    if missing:
        problems.append(f"{len(missing)} of the checkpoint's tensors were not sent (a partial update would leave "
                        f"vLLM's fused layers half-loaded), e.g. {missing[:3]}")
    return problems


class WeightUpdates:
    """Methods vLLM's workers gain (`self` is the worker: .rank, .model_runner, .reload_weights)."""

    def _staged(self) -> dict:
        if not hasattr(self, "_mcore_rl_staged"):
            self._mcore_rl_staged = {}
        return self._mcore_rl_staged

    def mcore_rl_begin(self) -> None:
        self._staged().clear()

    def mcore_rl_stage(self, per_rank: list[tuple[bytes, list[dict]]]) -> int:
        """One wire bucket per engine rank (this rank takes its own; one for all when alone)."""
        blob, wire = per_rank[self.rank] if len(per_rank) > 1 else per_rank[0]
        flat = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        self._staged().update(unflatten(flat, _metas(wire)))
        return len(wire)

    def mcore_rl_join_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                   world_size: int, group_name: str, backend: str) -> None:
        from mcore_rl.sync.transports import update_group

        self._mcore_rl_group = update_group(master_address, master_port, world_size, rank_offset + self.rank,
                                            backend, group_name)
        self._mcore_rl_backend = backend

    def mcore_rl_receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> int:
        """One flattened bucket broadcast by the trainer (rank 0 of the update group)."""
        import torch.distributed as dist

        from mcore_rl.sync.bucket import layout

        metas, total = layout([(n, torch.Size(s), DTYPES[d]) for n, d, s in zip(names, dtypes, shapes)])
        device = self.device if self._mcore_rl_backend == "nccl" else "cpu"
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._mcore_rl_group.broadcast([flat], opts).wait()
        self._staged().update(unflatten(flat, metas))
        return len(names)

    def mcore_rl_stage_dir(self, path: str) -> int:
        """A version directory of HF safetensors (the disk transport)."""
        from safetensors.torch import load_file

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        for f in files:
            self._staged().update(load_file(f))
        return len(files)

    def mcore_rl_commit(self) -> dict:
        """Load everything staged since begin in one reload; nothing staged loads nothing."""
        staged = self._staged()
        if not staged:
            return {"tensors": 0, "repacked": []}
        if not hasattr(self, "_mcore_rl_expected"):
            self._mcore_rl_expected = checkpoint_shapes(self.vllm_config.model_config.model)
        problems = check_update(staged, self._mcore_rl_expected)
        if problems:
            staged.clear()
            raise ValueError("weight update refused, the engine keeps its weights: " + "; ".join(problems[:5]))
        names = list(staged)
        self.reload_weights(weights_iterator=list(staged.items()))
        staged.clear()
        repacked = vllm_repack_reloaded_experts(self.model_runner.model, names)
        return {"tensors": len(names), "repacked": repacked}


VLLM_REPACK_VERSIONS = ("0.32.",)


def vllm_repack_reloaded_experts(model, names: list[str]) -> list[str]:
    """vllm_moe_reload_prepack: vLLM 0.32's in-place reload leaves MoE experts in checkpoint layout.
    `UnquantizedFusedMoEMethod._setup_kernel` runs `moe_kernel.fused_experts.process_weights_after_loading`
    (on CPU: the prepack into its grouped-GEMM layout) only when the kernel is first built, and a reload
    finds it built; the experts then compute garbage, even after reloading identical weights. Run it
    for the MoE layers whose experts `names` (HF names, one reload) contained. Only the prepack is
    re-run, never twice for a load, so it must not run on a vLLM that fixed this: gated on version.
    Returns the modules repacked."""
    import vllm

    if not vllm.__version__.startswith(VLLM_REPACK_VERSIONS):
        log.warning("vLLM %s is not one vllm_moe_reload_prepack was written for (%s); not applied",
                    vllm.__version__, VLLM_REPACK_VERSIONS)
        return []
    layers = {n.partition(".mlp.experts.")[0] for n in names if ".mlp.experts." in n}
    done = []
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and hasattr(module, "w13_weight") and name.partition(".mlp.")[0] in layers:
            kernel.fused_experts.process_weights_after_loading(module)
            done.append(name)
    return done
