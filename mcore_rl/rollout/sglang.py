"""SGLang as the rollout engine: one Ray actor per node of each engine (`SGLangServer`).

An SGLang engine is never created in the driver: when a scheduler fails SGLang kills the process
that created the engine, which then is this actor, and the driver sees a clear EngineError.
Works with sglang 0.5.17 to 0.5.23; API differences are feature-detected (`begin_weight_update`
/ `end_weight_update` exist from 0.5.23 on). On CPU (CI) the engine runs with the stand-ins of
`mcore_rl.rollout.sglang_cpu`; `mcore_rl.rollout.sglang_plugin` is loaded by SGLang in every
engine process (weight digests for verifying a sync, the CPU MLA handler).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import os
import sys
import time
from dataclasses import dataclass, field

from mcore_rl.config import checks as config_checks
from mcore_rl.parallel.groups import free_port
from mcore_rl.rollout import dp_routing, engine_start, model_files
from mcore_rl.rollout.model_files import DTYPE_NAMES
from mcore_rl.rollout.base import Completion, EngineError, Request, check_tags
from mcore_rl.rollout.engine_process import EngineProcess
from mcore_rl.rollout.spawn import children_forked, children_skip_main
from mcore_rl.sync.engine_layout import EngineLayout, SyncPlanError

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_site")


def engine_model_dir(hf_dir: str, out_dir: str, stop_token_ids: list[int], device: str,
                     weight_dtype: str = "bf16", weights: bool = True, layout: EngineLayout | None = None) -> str:
    """`hf_dir` as SGLang should read it (`model_files.engine_model_dir`). On CPU SGLang's DeepSeek
    rope needs a `yarn` entry: yarn with factor 1 is plain rope, so the model is unchanged. With FP8
    weights the config carries an FP8 DeepSeek-V3 checkpoint's quantization_config, its
    ignored_layers those the engine `layout` keeps in the model's dtype (as the sync sends them)."""
    quantization_config = None
    if weight_dtype == "fp8":
        from mcore_rl.models.config import HFModel
        from mcore_rl.sync.engine_layout import fp8_quantization_config

        if layout is None:
            raise ValueError("FP8 engine weights: which layers run in FP8 depends on the engine layout; pass it")
        quantization_config = fp8_quantization_config(HFModel.from_dir(hf_dir), layout)
    return model_files.engine_model_dir(hf_dir, out_dir, stop_token_ids, plain_rope_as_yarn=device == "cpu",
                                        quantization_config=quantization_config, weights=weights)


@dataclass
class EngineLaunch:
    """Everything every node of one SGLang engine needs; `node_args(n)` is node n's Engine kwargs.

    All nodes share dist_init_addr, nnodes, tp/ep sizes and the memory settings; only node_rank
    (and, when several nodes share a host, the ports) differ. Each node takes tp_size/nnodes
    consecutive tp ranks on its GPUs from base_gpu_id (CUDA_VISIBLE_DEVICES applied).
    """

    model_path: str
    layout: EngineLayout
    dist_init_addr: str  # "host:port" of node_rank 0, reachable from every node
    mem_fraction_static: float = 0.5
    enable_memory_saver: bool = True
    base_gpu_id: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        host, _, port = self.dist_init_addr.rpartition(":")
        if not host or not port.isdigit():
            raise SyncPlanError(f"dist_init_addr={self.dist_init_addr!r} must be host:port")
        if not 0 < self.mem_fraction_static < 1:
            raise SyncPlanError(f"mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")
        lay = self.layout
        if lay.gpus_per_node is None or lay.gpus_per_node * lay.nnodes != lay.tp_size:
            raise SyncPlanError(f"engine layout {lay}: gpus_per_node x nnodes must equal tp_size "
                            "(take gpus_per_node from the placement)")

    def node_args(self, node_rank: int) -> dict:
        if not 0 <= node_rank < self.layout.nnodes:
            raise SyncPlanError(f"node_rank={node_rank} outside 0..{self.layout.nnodes - 1}")
        args = dict(model_path=self.model_path, tp_size=self.layout.tp_size, ep_size=self.layout.ep_size,
                    nnodes=self.layout.nnodes, node_rank=node_rank, dist_init_addr=self.dist_init_addr,
                    base_gpu_id=self.base_gpu_id, mem_fraction_static=self.mem_fraction_static,
                    enable_memory_saver=self.enable_memory_saver)
        return {**args, **self.extra}

    def cli(self, node_rank: int) -> list[str]:
        """`python -m sglang.launch_server ...` arguments for node `node_rank`."""
        out = ["python", "-m", "sglang.launch_server"]
        for k, v in self.node_args(node_rank).items():
            flag = "--" + k.replace("_", "-")
            if v is True:
                out.append(flag)
            elif v is not False and v is not None:
                out += [flag, str(v)]
        return out


# engine arguments we only default (rollout.engine_kwargs replaces them; an SGLang without one runs
# without it). enforce_disable_flashinfer_allreduce_fusion: SGLang fuses each TP all-reduce with the
# residual add and RMSNorm through flashinfer's TRT-LLM kernels for DeepSeek-V3, Qwen3-MoE and GLM-4.5 at
# TP > 1 on Hopper/Blackwell, a JIT module that each fresh node compiles for minutes in silence before the
# first request (4 x H200, TP 4, Moonlight, issue 45). At our decode batches (<= cuda_graph_max_bs rows of a
# 2048-5120 wide hidden state) each fused all-reduce saves microseconds of a step of milliseconds.
GPU_DEFAULTS = {"enforce_disable_flashinfer_allreduce_fusion": True}


def engine_args(cfg, model_dir: str, layout: EngineLayout, node_rank: int, dist_init_addr: str | None,
                mem_fraction: float, kv_tokens: int | None = None) -> dict:
    """`sglang.Engine(**...)` for node `node_rank` of an engine with `layout`, from the config; on GPUs
    `kv_tokens` (the memory plan's) caps its KV pool. rollout.engine_kwargs go in between our defaults
    and our own settings (mcore_rl.rollout.engine_kwargs)."""
    from mcore_rl.rollout.engine_kwargs import merge

    ours = own_args(cfg, model_dir, layout, node_rank, dist_init_addr, mem_fraction, kv_tokens)
    return merge(GPU_DEFAULTS if cfg.cluster.device == "gpu" else {}, cfg.rollout.engine_kwargs, ours)


def own_args(cfg, model_dir: str, layout: EngineLayout, node_rank: int, dist_init_addr: str | None,
              mem_fraction: float, kv_tokens: int | None) -> dict:
    """The settings the run depends on (they win over rollout.engine_kwargs)."""
    r = cfg.rollout
    args = dict(model_path=model_dir, tp_size=layout.tp_size, ep_size=layout.ep_size, nnodes=layout.nnodes,
                node_rank=node_rank, dtype=DTYPE_NAMES[cfg.model.dtype], random_seed=cfg.trainer.seed,
                skip_tokenizer_init=True, trust_remote_code=False, mem_fraction_static=mem_fraction,
                chunked_prefill_size=r.chunked_prefill_size, log_level=r.log_level)
    if dist_init_addr:
        args["dist_init_addr"] = dist_init_addr
    # the files hold bf16 weights, FP8 layers get theirs from the first sync; or there are no files
    if r.weight_dtype == "fp8" or not model_files.has_weights(model_dir):
        args["load_format"] = "dummy"
    if r.weight_dtype == "fp8" and r.fp8_kernels == "deep_gemm_moe":  # SGLang's auto picks it only with DeepEP
        args["moe_runner_backend"] = "deep_gemm"
    if config_checks.returns_routes(cfg):
        args["enable_return_routed_experts"] = True
    dp = layout.attn_dp_size
    args.update(dp_attention_args(dp))
    if cfg.cluster.device == "cpu":  # SGLang's CPU engine (mcore_rl.rollout.sglang_cpu)
        # sleep_on_idle: an idle scheduler otherwise polls for requests in a busy loop, a core per engine
        # taken from the trainer's ranks (colocated, they update while the engines wait) and other engines
        args.update(device="cpu", attention_backend="torch_native", sampling_backend="pytorch",
                    disable_cuda_graph=True, max_total_tokens=r.cpu_kv_tokens, sleep_on_idle=True)
        if r.max_running_requests:  # unset, the CPU engine takes any batch; per rank under DP attention
            args["max_running_requests"] = r.max_running_requests * dp
    else:
        # disable_shared_experts_fusion: on GPUs SGLang may fold a shared expert into the routed ones
        # (GLM-4.5, DeepSeek-V3 at EP 1); the sync's read-back table (sync/engine_layout.py) knows
        # shared experts as their own parameters, as the CPU engine and EP > 1 always keep them
        args.update(enable_memory_saver=r.enable_memory_saver and cfg.cluster.colocate,
                    cuda_graph_max_bs=r.cuda_graph_max_bs, disable_shared_experts_fusion=True,
                    max_running_requests=config_checks.max_running_requests(cfg) * dp)  # SGLang's: the engine's
        if r.seeded:  # its flashinfer sampler takes no seeds (mcore_rl.rollout.sglang_plugin)
            args["sampling_backend"] = "pytorch"
        if r.attention_backend:
            args["attention_backend"] = r.attention_backend
        if kv_tokens:
            args["max_total_tokens"] = kv_tokens
    return args


def dp_attention_args(dp: int) -> dict:
    """SGLang's arguments for DP attention over `dp` ranks (none for 1): attention, embeddings, lm_head
    (enable_dp_lm_head) and the dense MLP (moe_dense_tp_size=1) whole per rank when dp = tp_size, the
    layout the sync places weights by (mcore_rl.sync.engine_layout's groups). SGLang's DP controller would
    deal an engine's requests out to its ranks round robin (load_balance_method auto, 0.5.17-0.5.20);
    SGLangServer routes each group of them to one rank instead (mcore_rl.rollout.dp_routing)."""
    return dict(enable_dp_attention=True, dp_size=dp, enable_dp_lm_head=True, moe_dense_tp_size=1) if dp > 1 else {}


def engine_env(cfg, layout: EngineLayout) -> dict:
    """Environment of the engine's processes."""
    env = {"MCORE_RL_SEEDED_SAMPLING": "1"} if cfg.rollout.seeded else {}
    if cfg.rollout.weight_dtype == "fp8":
        # the kernels read the block scales as the sync sent them (the read-back compares them); with
        # DeepGEMM SGLang requantizes them to UE8M0 after loading on Blackwell (0.5.17-0.5.20), not on Hopper
        deep_gemm = cfg.rollout.fp8_kernels.startswith("deep_gemm")
        env["SGLANG_ENABLE_JIT_DEEPGEMM"] = "1" if deep_gemm else "0"
        if deep_gemm:  # kernels compiled on first use: SGLang's pre-compile of every batch size takes 10-20 min
            env["SGLANG_JIT_DEEPGEMM_PRECOMPILE"] = "0"
    if cfg.rollout.moe_config_dir:  # read by SGLang's schedulers as they pick each fused-MoE call's tile
        env["SGLANG_MOE_CONFIG_DIR"] = os.path.abspath(cfg.rollout.moe_config_dir)
    if cfg.cluster.device != "cpu":
        return env
    env["TORCHDYNAMO_DISABLE"] = "1"  # SGLang's MoE top-k otherwise compiles for 14-25 s on CPU
    if layout.tp_size > 1:  # a core per rank: SGLang refuses more ranks (on all nodes) than NUMA nodes otherwise
        cores = os.cpu_count() or 1
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i % cores) for i in range(layout.tp_size))
    return env


# our name -> the names SGLang releases have used for it (0.5.17-0.5.20: per-phase CUDA-graph sizes)
ARG_ALIASES = {"cuda_graph_max_bs": ("cuda_graph_max_bs_decode",)}


def server_arg_names() -> set[str]:
    """The engine arguments this SGLang's ServerArgs takes (a dataclass before 0.5.20, a msgspec struct after)."""
    from sglang.srt.server_args import ServerArgs

    return set(inspect.signature(ServerArgs).parameters)


def adapt_args(args: dict, known: set[str]) -> dict:
    """`args` in the names this SGLang's ServerArgs knows; an argument it knows under no name is an error,
    but for our defaults (GPU_DEFAULTS), which an SGLang without them runs without."""
    out = {}
    for k, v in args.items():
        name = k if k in known else next((a for a in ARG_ALIASES.get(k, ()) if a in known), None)
        if name is None and k in GPU_DEFAULTS:
            print(f"[mcore_rl] this SGLang has no engine argument {k}: running without it", flush=True)  # its log
            continue
        if name is None:
            raise EngineError(f"this SGLang has no engine argument {k!r} (nor {ARG_ALIASES.get(k, ())})")
        out[name] = v
    return out


def sampling_dict(r: Request) -> dict:
    p = r.params
    out = {"temperature": p.temperature, "top_p": p.top_p, "max_new_tokens": p.max_new_tokens,
           "stop_token_ids": list(p.stop_token_ids), "n": 1}
    if p.ignore_eos:  # SGLang's flag also drops stop_token_ids: every response runs to max_new_tokens
        out["ignore_eos"] = True
    if p.seed is not None:
        out["sampling_seed"] = p.seed
    return out


def decode_routes(meta: dict, rows: int, layers: int, topk: int, engine: str):
    """meta_info["routed_experts"] as SGLang encodes it (state_capturer/routed_experts.py, the
    detokenizer's _b64_encode_per_request): base64 of a C-order int32 [rows, layers, top-k] array,
    rows = prompt + output tokens - 1. Missing or short is an error naming the engine."""
    import numpy as np
    import pybase64

    text = meta.get("routed_experts")
    if not text:
        raise EngineError(f"{engine} returned no routed_experts (started without enable_return_routed_experts?)")
    flat = np.frombuffer(pybase64.b64decode(text.encode("utf-8")), dtype=np.int32)
    if flat.size != rows * layers * topk:
        raise EngineError(f"{engine} returned {flat.size} routed expert ids, expected {rows} tokens x {layers} "
                          f"layers x top-{topk} = {rows * layers * topk}")
    return flat.reshape(rows, layers, topk).copy()


def _ok(result, what: str):
    """SGLang answers (success, message) tuples or objects with .success; raise on failure."""
    if result is None:
        return result
    ok, msg = (result[0], result[1]) if isinstance(result, tuple) else (getattr(result, "success", True),
                                                                        getattr(result, "message", ""))
    if not ok:
        raise EngineError(f"SGLang {what} failed: {msg}")
    return result


class SGLangServer(EngineProcess):
    """Node `node_rank` of one SGLang engine, in its own Ray actor process. Only node 0 serves."""

    READBACK = "digests"  # how a sync is verified (see WeightSync.verify)

    def __init__(self, device: str, visible_devices: str | None = None, env: dict | None = None):
        """The engine's process as it starts, before its engine: its environment and log file, and
        SGLang imported (10-25 s on a GPU node), while the trainer builds; `start` builds the engine."""
        super().__init__("SGLang", visible_devices, env)
        t0 = time.perf_counter()
        # SGLang's spawned processes take this process's sys.path: the plugin must be on it
        sys.path.insert(0, SITE_DIR)
        if device == "cpu":  # and, on CPU, the stand-ins at their interpreter's start
            from mcore_rl.rollout import sglang_cpu

            os.environ.update(sglang_cpu.child_env(os.environ))
            sglang_cpu.install()
        if os.environ.get("SGLANG_ENABLE_JIT_DEEPGEMM") == "1" and importlib.util.find_spec("deep_gemm") is None:
            # SGLang would quietly run triton's kernels instead
            raise EngineError("rollout.fp8_kernels asks for DeepGEMM, which this node's Python lacks "
                              "(pip install sgl-deep-gemm, the version this SGLang requires)")
        import sglang
        from sglang.srt.entrypoints import engine as engine_module  # what sglang.Engine imports: the bulk

        self.version, self.device, self.engine_module = sglang.__version__, device, engine_module
        self.known = server_arg_names()
        self.engine, self.nccl_port = None, None
        engine_start.mark(f"SGLang {self.version} imported in {time.perf_counter() - t0:.0f} s")

    def start(self, engine_args: dict) -> dict:
        """Build the engine (node `node_rank` of it): the model, the KV cache and, on GPUs, the CUDA
        graphs. Colocated, only once the trainer holds no more than the memory plan's rollout phase
        gives it. Returns `health()`."""
        device = self.device
        self.node_rank, self.nnodes = engine_args.get("node_rank", 0), engine_args.get("nnodes", 1)
        per = engine_args.get("tp_size", 1) // engine_args.get("nnodes", 1)
        self.tp_ranks = range(self.node_rank * per, (self.node_rank + 1) * per)  # SGLang's, on this node
        self.rpc_peers = engine_args.get("dp_size", 1) if engine_args.get("enable_dp_attention") else 1
        if self.node_rank > 0:  # serve the ranks of this node, return instead of blocking
            os.environ["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = "0"
        if "nccl_port" in self.known and engine_args.get("nccl_port") is None:  # SGLang's own pick is ephemeral
            engine_args = {**engine_args, "nccl_port": free_port()}
        self.nccl_port = engine_args.get("nccl_port")
        engine_args = adapt_args(engine_args, self.known)
        start = children_forked(self.engine_module) if device == "cpu" else children_skip_main()
        with self.engine_built(f"starting SGLang {self.version}'s engine: model, KV cache"
                               + (", CUDA graphs" if device == "gpu" else "")), start:
            self.engine = self.engine_module.Engine(**engine_args)
        # DP attention: a group of requests to one rank, its prefix cache's (dp_routing), by SGLang's argument
        # for the rank (its older name: data_parallel_rank)
        self.affinity = dp_routing.RankAffinity(self.rpc_peers) if self.rpc_peers > 1 else None
        known = inspect.signature(self.engine.async_generate).parameters
        self.rank_arg = "routed_dp_rank" if "routed_dp_rank" in known else "data_parallel_rank"
        self.route_shape = None  # (layers, top-k) of the routed experts it returns
        if engine_args.get("enable_return_routed_experts"):
            with open(os.path.join(engine_args["model_path"], "config.json")) as f:
                hf = json.load(f)
            self.route_shape = (hf["num_hidden_layers"], hf["num_experts_per_tok"])
        return self.health()

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, requests: list[Request]) -> list[Completion]:
        done = []
        for r, o in zip(requests, self.outputs(requests), strict=True):
            meta = o["meta_info"]
            reason = meta["finish_reason"]["type"] if meta.get("finish_reason") else "length"
            experts = None
            if self.route_shape:
                experts = decode_routes(meta, len(r.prompt) + len(o["output_ids"]) - 1, *self.route_shape,
                                        f"SGLang {self.version} node {self.node_rank}")
            done.append(Completion(list(o["output_ids"]), [lp[0] for lp in meta["output_token_logprobs"]],
                                   "stop" if reason == "stop" else "length", experts,
                                   cached_tokens=meta.get("cached_tokens")))
        return done

    def outputs(self, requests: list[Request]) -> list[dict]:
        """SGLang's answer to each request, in order. A prompt asked more than once is prefilled alone
        first (dp_routing.repeated_prompts), so that its samples find it in the prefix cache instead of
        each computing it in one prefill batch. Under DP attention each group of requests goes to one
        rank (mcore_rl.rollout.dp_routing): a call per rank, all at once on the engine's event loop."""
        if not requests:
            return []
        routes = {"return_routed_experts": True} if self.route_shape else {}
        per_rank = (dp_routing.by_rank(self.affinity.assign(requests)) if self.affinity is not None
                    else {None: list(range(len(requests)))})  # None: SGLang's one rank, no route to name

        async def rank_call(rank: int | None, idx: list[int]):
            route = {} if rank is None else {self.rank_arg: rank}
            repeated = dp_routing.repeated_prompts([requests[i] for i in idx])
            if repeated:
                await self.engine.async_generate(input_ids=repeated, sampling_params={"max_new_tokens": 0}, **route)
            return await self.engine.async_generate(
                input_ids=[list(requests[i].prompt) for i in idx], sampling_params=[sampling_dict(requests[i]) for i in idx],
                return_logprob=True, **routes, **route)

        async def every_rank():
            return await asyncio.gather(*(rank_call(rank, idx) for rank, idx in per_rank.items()))

        outs: list = [None] * len(requests)
        for idx, got in zip(per_rank.values(), self.engine.loop.run_until_complete(every_rank())):
            for i, o in zip(idx, got, strict=True):
                outs[i] = o
        return outs

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """The log-prob of each token of each sequence after its prefix (untempered): len - 1 values."""
        outs = self.engine.generate(input_ids=[list(s) for s in sequences], return_logprob=True, logprob_start_len=0,
                                    sampling_params={"max_new_tokens": 1, "temperature": 0.0})
        return [[lp[0] for lp in o["meta_info"]["input_token_logprobs"][1:]] for o in outs]

    # ---- weight updates (the WeightTarget entry points, for this engine) ---------------------------
    def collective_rpc(self, method: str, **kwargs) -> None:
        """SGLang's `Engine.collective_rpc`: `method` run by every scheduler; a failed call raises
        AssertionError, as SGLang's does. Under DP attention each attention-DP leader (every rank at dp
        = tp) holds a socket of the engine's RPC channel, which deals messages round robin, and
        answers each call SGLang's schedulers run (all ranks run tp rank 0's, from the one it got;
        0.5.17-0.5.20): SGLang's own call there reaches one rank, and hangs when that is not rank 0.
        So one message a leader, and as many answers read."""
        if self.rpc_peers == 1:
            return self.engine.collective_rpc(method, **kwargs)
        import zmq
        from sglang.srt.managers.io_struct import RpcReqInput, RpcReqOutput, sock_recv, sock_send

        for _ in range(self.rpc_peers):
            sock_send(self.engine.send_to_rpc, RpcReqInput(method=method, parameters=kwargs))
        answers = [sock_recv(self.engine.send_to_rpc, flags=zmq.BLOCKY) for _ in range(self.rpc_peers)]
        assert all(isinstance(a, RpcReqOutput) for a in answers), answers
        failed = [a.message for a in answers if not a.success]
        assert not failed, failed[0]

    def begin_weight_update(self) -> None:
        if hasattr(self.engine, "begin_weight_update"):  # sglang >= 0.5.23
            _ok(self.engine.begin_weight_update(), "begin_weight_update")

    def end_weight_update(self) -> None:
        if hasattr(self.engine, "end_weight_update"):
            _ok(self.engine.end_weight_update(), "end_weight_update")
        self.collective_rpc("mcore_rl_refresh_derived")  # what SGLang derived from the old weights

    def update_weights_from_tensor(self, payloads: list, load_format: str | None = None, flush_cache: bool = True):
        """One payload per tp rank of this engine: serialized buckets (CUDA IPC handles, from the
        trainer's GPUs) or, on CPU, the buckets themselves, serialized here for SGLang's schedulers."""
        payloads = [self._serialize(p, by_name=self.nnodes > 1) if isinstance(p, dict) else p for p in payloads]
        _ok(self.engine.update_weights_from_tensor(payloads, load_format=load_format, flush_cache=flush_cache),
            "update_weights_from_tensor")

    def load_weights_direct(self, payloads: list, layout, hf, flush_cache: bool = True):
        """As update_weights_from_tensor, each rank's bucket copied straight into its parameters by
        the read-back's placement table (`rollout.sync_load: direct`, mcore_rl.rollout.sglang_plugin)."""
        payloads = [self._serialize(p, by_name=self.nnodes > 1) if isinstance(p, dict) else p for p in payloads]
        try:
            self.collective_rpc("mcore_rl_load_bucket", payloads=payloads, layout=layout, hf=hf)
        except AssertionError as e:  # how collective_rpc reports a failed call
            raise EngineError(f"SGLang direct weight load failed: {e}") from None
        if flush_cache:  # what update_weights_from_tensor(flush_cache=True) does after its load
            _ok(self.engine.flush_cache(), "flush_cache")

    @staticmethod
    def _serialize(bucket: dict, by_name: bool) -> bytes:
        """CPU tensors for SGLang's schedulers. A scheduler on another "node" of this host is no child
        of this process, so it cannot fetch a file descriptor from it (torch's default): those get
        the shared memory by file name (by_name). That needs torch's shm manager daemon, whose start
        times out on a loaded machine ("Shared memory manager connection has timed out", seen in CI
        runs), so a one-node engine, whose schedulers are our children, keeps file descriptors."""
        import torch.multiprocessing
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        torch.multiprocessing.set_sharing_strategy("file_system" if by_name else "file_descriptor")

        return MultiprocessingSerializer.serialize({
            "flattened_tensor": bucket["flattened_tensor"],
            "metadata": [FlattenedTensorMetadata(**m) for m in bucket["metadata"]]})

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name="weight_update_group", backend="nccl"):
        _ok(self.engine.init_weights_update_group(master_address, master_port, rank_offset, world_size,
                                                  group_name, backend), "init_weights_update_group")

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        load_format=None, flush_cache=True):
        _ok(self.engine.update_weights_from_distributed(names, dtypes, shapes, group_name, flush_cache=flush_cache,
                                                        load_format=load_format), "update_weights_from_distributed")

    def update_weights_from_disk(self, model_path: str):
        # the sync writes HF safetensors; an engine started on dummy weights (no files at start) would
        # otherwise reload with its start-up loader, which reads no files
        _ok(self.engine.update_weights_from_disk(model_path, load_format="auto"), "update_weights_from_disk")

    def write_weight_digests(self, path: str, derived: bool = False) -> None:
        """Node 0: every rank of the engine, on every node, writes its parameters' digests (`derived`:
        and those of every other tensor its model holds) to `path.tp{rank}.json` on its own machine
        (SGLang's collective_rpc reaches all schedulers)."""
        self.collective_rpc("mcore_rl_weight_digests", path=path, derived=derived)

    def capture_hidden(self, path: str, tokens: int) -> None:
        """Each rank keeps every decoder layer's output of its next forward of `tokens` tokens (a
        prefill) in `path.tp{rank}.pt` (sglang_plugin.capture_hidden)."""
        self.collective_rpc("mcore_rl_capture_hidden", path=path, tokens=tokens)

    def read_weight_digests(self, path: str) -> dict[int, dict]:
        """{tp rank: {SGLang parameter name: [dtype, shape, bytes, sum, weighted sum]}} of this
        node's ranks, as `write_weight_digests` left them; the files (and their directory when
        empty) are removed."""
        out = {}
        for r in self.tp_ranks:
            with open(f"{path}.tp{r}.json") as f:
                out[r] = json.load(f)
            os.remove(f"{path}.tp{r}.json")
        try:  # the read-back's directory, once every engine on this machine has read its files
            os.rmdir(os.path.dirname(path))
        except OSError:
            pass
        return out

    # ---- memory ------------------------------------------------------------------------------------
    def release(self, tags: list[str], timeout_s: float = 60.0) -> None:
        """SGLang asserts idleness in its scheduler, and a failed assert there kills the engine: wait
        until every rank says it is idle (sglang_plugin's check, a plain error reply when not)."""
        tags = check_tags(tags)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.collective_rpc("mcore_rl_check_idle")
                break
            except AssertionError:  # collective_rpc's way of reporting a failed call
                if time.monotonic() > deadline:
                    raise EngineError(f"SGLang did not become idle within {timeout_s:.0f}s to release {tags}")
                time.sleep(0.02)
        self.engine.release_memory_occupation(tags=tags)

    def resume(self, tags: list[str]) -> None:
        tags = check_tags(tags)
        self.engine.resume_memory_occupation(tags=tags)
        self.collective_rpc("mcore_rl_refresh_derived")  # what the release lost (sglang_plugin)

    # ---- life ----------------------------------------------------------------------------------------
    def health(self) -> dict:
        return {"engine": "sglang", "version": self.version, "node_rank": self.node_rank, "pid": os.getpid(),
                "nccl_port": self.nccl_port, "start_seconds": round(self.start_seconds, 2), "alive": True}

    def shutdown(self) -> None:
        self.stop_watching_compiles()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
