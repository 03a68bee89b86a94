"""MegatronActor itself: its construction (policy, reference, critic, optimizers), the parts it
holds, and what rollout engines need from the trainer (run, where, weight sync). The methods of
each other concern come from the mixins it is composed of (see mcore_rl.actor)."""

from __future__ import annotations

import faulthandler
import os

import torch

from mcore_rl.metrics import console
from mcore_rl.parallel import optimizer as optim
from mcore_rl.actor.checkpoint_io import Checkpoints
from mcore_rl.actor.lockstep import Lockstep
from mcore_rl.actor.logprobs import PerToken
from mcore_rl.actor.memory import MemoryMoves
from mcore_rl.actor.routes import RouteReplay
from mcore_rl.actor.update import Update
from mcore_rl.config.checks import recompute_choice


class MegatronActor(Update, PerToken, RouteReplay, MemoryMoves, Checkpoints, Lockstep):
    def __init__(self, rank: int, world: int, master_port: int, hf_dir: str, cfg: dict,
                 master_addr: str = "127.0.0.1", init: dict | None = None, build_only: bool = False):
        """init: HF checkpoints to start from, {"policy": dir|None, "critic": dir|None}; without one
        the policy keeps megatron's seeded init and the critic copies the policy. build_only: stop
        after building the policy on the device; `read_initial(init)` and `load_initial(init)`
        complete the construction (a driver times the three apart)."""
        # a native crash (heap corruption, a segfault) dumps every thread's Python stack, not only
        # the crashing one's (Ray enables faulthandler for the current thread): what ran beside it
        faulthandler.enable(all_threads=True)
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world))
        if not torch.cuda.is_available():  # compiling costs more than it saves on CPU (mcore_rl.models.fused)
            os.environ["TORCHDYNAMO_DISABLE"] = "1"
        from megatron.core import parallel_state as ps

        from mcore_rl.models.config import HFModel, transformer_config
        from mcore_rl.models.builder import build_model
        from mcore_rl.parallel.groups import Layout, init_distributed

        torch.set_num_threads(1)
        from mcore_rl.memory.allocator import use_expandable_segments

        use_expandable_segments(cfg["memory"]["expandable_segments"])  # before anything is allocated
        if rank == 0:
            print(console.accelerators_line(), flush=True)
        unsettled = [k for k, v in (("actor.ppo_max_token_len_per_gpu", cfg["actor"]["ppo_max_token_len_per_gpu"]),
                                    ("memory.recompute", cfg["memory"]["recompute"])) if v == "auto"]
        if unsettled:
            raise ValueError(f"{', '.join(unsettled)}: auto is settled before the actors start, by the memory plan "
                             "(mcore_rl.memory.plan.apply_choice) or without one (settle_without_plan)")
        p = cfg["parallel"]
        self.layout = Layout(tp=p["tp"], pp=p["pp"], ep=p["ep"], etp=p["etp"])
        init_distributed(self.layout, seed=cfg["trainer"]["seed"])
        self.rank, self.ps, self.cfg = rank, ps, cfg
        self.hf = HFModel.from_dir(hf_dir)
        self.hf_dir = hf_dir
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg["model"]["dtype"]]
        bias = {"moe_router_bias_update_rate": cfg["actor"]["router_bias_update_rate"]} if self.hf.num_experts else {}
        mode, layers, modules = recompute_choice(cfg["memory"])
        tcfg = transformer_config(self.hf, tp=p["tp"], pp=p["pp"], ep=p["ep"], etp=p["etp"], dtype=dtype,
                                  recompute=mode, recompute_layers=layers, recompute_modules=modules, **bias)
        self._tcfg = tcfg
        self.model = build_model(self.hf, tcfg, attention=self.packed_attention)
        # batches arrive and results leave on the host; the model's device does the work
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        if not build_only:
            self.read_initial(init)
            self.load_initial(init)

    def read_initial(self, init: dict | None = None) -> dict | None:
        """The policy's weights from the HF checkpoint init["policy"], if any: this rank reads only
        the tensors of its own shard. Returns the bytes it read and the seconds it took."""
        if not (init or {}).get("policy"):
            return None
        from mcore_rl.checkpoint.hf_init import load_hf

        got = load_hf(self.model, init["policy"], self.hf)
        return {"bytes": got.nbytes, "seconds": got.seconds}

    def load_initial(self, init: dict | None = None) -> None:
        """The rest of the construction, after `read_initial`: the reference and critic (its weights
        from init["critic"], read as the policy's are), the optimizers."""
        from mcore_rl.models.builder import build_model
        from mcore_rl.models.latent_width import KV_UP, latent_scales, scale_latent_init

        init, cfg, tcfg, attention = init or {}, self.cfg, self._tcfg, self.packed_attention
        init_scale, lr_scale = latent_scales(self.hf.cfg, cfg["model"]["mla_base_rank"])
        if not init.get("policy") and init_scale != 1.0:  # megatron's seeded init, the wide latent's as the base rank's
            scale_latent_init(self.model, init_scale)
        self._install_route_replay(cfg)
        a, alg = cfg["actor"], cfg["algorithm"]
        self.ref, self.ref_offload = None, None
        if a["use_kl_loss"] or alg["use_kl_in_reward"]:  # a frozen copy of the initial policy
            self.ref = build_model(self.hf, tcfg, attention=attention).eval().requires_grad_(False)
            self.ref.load_state_dict(self.model.state_dict())
            if cfg["memory"]["offload_ref"] and self.device.type == "cuda":
                from mcore_rl.memory.offload import StateOffloader

                self.ref_offload = StateOffloader(list(self.ref.parameters()) + list(self.ref.buffers()))
                self.ref_offload.offload()
        self.critic = None
        if cfg["critic"]["enabled"]:
            self._build_critic(cfg, tcfg, init.get("critic"))
        self.model, self.opt = optim.wrap(self.model, tcfg, a, **self._optim_options(),
                                          lr_scale={KV_UP: lr_scale} if lr_scale != 1.0 else None)
        self.updates = 0
        self._peaks: dict[str, float] = {}  # allocator peaks per pass of the train phase (GPU)
        from mcore_rl.checkpoint.optimizer import regions

        # where each param's elements sit in the checkpoint's tensors; made now, while the params are
        # on the device (a save may run while they are offloaded)
        self._regions = {name: regions(model) for name, model, _ in self._parts()}

    def _optim_options(self) -> dict:
        """optim.wrap's switches from the actor and memory sections; null ones follow the device."""
        a, m = self.cfg["actor"], self.cfg["memory"]
        gpu = self.device.type == "cuda"
        on = lambda v: gpu if v is None else v  # noqa: E731
        return dict(grad_fp32=m["grad_fp32"], fused_adam=on(a["fused_adam"]),
                    overlap_grad_reduce=on(a["overlap_grad_reduce"]), bucket_size=a["grad_bucket_size"],
                    offload_fraction=m["optimizer_offload_fraction"])

    @property
    def packed_attention(self) -> str:
        v = self.cfg["actor"]["packed_attention"]
        return ("varlen" if torch.cuda.is_available() else "sdpa") if v is None else v

    @property
    def _fused_logprobs(self) -> bool:
        v = self.cfg["actor"]["fused_logprobs"]
        return self.device.type == "cuda" if v is None else v

    def _build_critic(self, cfg, tcfg, init_hf):
        from mcore_rl.models import critic
        from mcore_rl.models.config import HFModel, transformer_config

        c, p = cfg["critic"], cfg["parallel"]
        hf = self.hf
        if c["hf_path"] and os.path.abspath(c["hf_path"]) != os.path.abspath(self.hf_dir):
            hf = HFModel.from_dir(c["hf_path"])
            tcfg = transformer_config(hf, tp=p["tp"], pp=p["pp"], ep=p["ep"], etp=p["etp"],
                                      dtype=tcfg.params_dtype)
        model = critic.build_critic(hf, tcfg)
        if init_hf:  # the trunk of another causal LM; the value head keeps its zeros
            from mcore_rl.checkpoint.hf_init import load_hf

            load_hf(model, init_hf, hf, skip=lambda name: name.startswith(critic.HEAD))
        else:
            critic.copy_trunk(self.model, model)
        self.critic, self.critic_opt = optim.wrap(model, tcfg, c, **self._optim_options())

    def _parts(self):
        """(name, model, optimizer) of the policy and, if any, the critic: what is trained, moved and saved."""
        parts = [("model", self.model, self.opt)]
        if self.critic is not None:
            parts.append(("critic", self.critic, self.critic_opt))
        return parts

    # ---- what rollout engines need from the trainer ------------------------------------------------
    def run(self, fn, *args):
        """`fn(self, *args)` on this rank: code that works on its shards (the embedded engine)."""
        return fn(self, *args)

    def where(self) -> dict:
        """This rank's node and device: engines are placed on (colocated) or matched to them."""
        import ray

        ctx = ray.get_runtime_context()
        out = {"rank": self.rank, "node": ctx.get_node_id(), "ip": ray.util.get_node_ip_address()}
        if self.device.type == "cuda":
            from mcore_rl.sync.placement import local_gpu_slot

            out.update(gpu_ids=[str(g) for g in ray.get_gpu_ids()], uuid=local_gpu_slot(out["node"]).gpu_uuid)
        else:  # a gloo process stands in for a GPU: a name unique to it
            out.update(gpu_ids=[], uuid=f"cpu-{out['node'][:8]}-{self.rank}")
        return out

    def setup_sync(self, spec) -> None:
        """Plan, live shards and transport for syncing into the rollout engines, built once. The
        weights are read where they are (offloaded ones from their host copies)."""
        from mcore_rl.sync.session import SyncSession

        self.sync_session = SyncSession(self.model, spec, read=self.read_state)

    def sync_weights(self, verify: bool = False) -> dict:
        if self.device.type != "cuda":
            return self.sync_session.run(verify)
        torch.cuda.reset_peak_memory_stats()  # the sync's own gathers and buckets (the sync phase's trainer share)
        out = self.sync_session.run(verify)
        return {**out, "trainer_max_reserved": torch.cuda.max_memory_reserved()}
