"""Typed trainer config: dataclass sections, YAML + dotted `key=value` overrides, validation.

    cfg = load_config("configs/x.yaml", ["actor.lr=1e-6", "trainer.logger=[console,jsonl]"])
    print(to_yaml(cfg))

Every mistake is reported before anything starts, all at once, in one ConfigError: unknown
keys (with the closest valid key), wrong types (with the expected type), and layout checks
against the cluster and the model's dimensions.
`python -m mcore_rl.config CONFIG [key=value ...]` prints the resolved config or the errors.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Union

import yaml

from mcore_rl.cli_errors import BAD_INPUT, BadInput, hf_config, read_yaml_mapping, report
from mcore_rl.model_checks import hf_config_problems, num_experts

Dtype = Literal["bf16", "fp16", "fp32"]
AdvEstimator = Literal["grpo", "gae", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
KLType = Literal["k1", "k2", "low_var_kl"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
Logger = Literal["console", "jsonl", "tensorboard", "wandb"]


class ConfigError(BadInput):
    """One or more config problems; `.errors` holds one line per problem (one problem: one line)."""

    def __init__(self, errors: list[str] | str):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        sep = "\n  " if len(self.errors) > 1 else " "
        super().__init__("invalid config:" + sep + sep.join(self.errors))


@dataclass
class ModelConfig:
    hf_path: str | None = None  # HF checkpoint dir (config.json, tokenizer, safetensors)
    hf_config: dict[str, Any] | None = None  # or an embedded HF config dict (tiny random model)
    tokenizer_path: str | None = None  # defaults to hf_path
    dtype: Dtype = "bf16"


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False


@dataclass
class ClusterConfig:
    nnodes: int = 1
    n_gpus_per_node: int = 8
    colocate: bool = True  # actor and rollout share all GPUs, taking turns
    rollout_gpus: int = 0  # GPUs given to rollout alone when not colocated
    device: Literal["gpu", "cpu"] = "gpu"  # cpu: gloo processes stand in for GPUs (tests)
    # RAM of each node, for the host memory plan (mcore_rl.memory.host); null: this machine's
    # MemTotal where its GPUs are visible (planning on a node), else the host plan is not checked
    host_memory_gb: float | None = None
    # how long to wait for Ray to place the trainer's and engines' bundles; past it the run stops
    # naming what it asked for and what the cluster has (a GPU config on a machine without them
    # would otherwise wait forever)
    placement_timeout_s: float = 120.0


@dataclass
class RolloutConfig:
    engine: Literal["embedded", "sglang", "vllm"] = "sglang"  # mcore_rl/rollout/: one file per engine
    n: int = 8  # responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    max_prompt_len: int | None = None  # defaults to data.max_prompt_length
    max_response_len: int = 1024
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's EOS
    tp_size: int = 1
    ep_size: int = 1
    mem_fraction_static: float = 0.7
    enable_memory_saver: bool = True
    val_temperature: float = 0.0  # validation sampling; 0 = greedy
    val_n: int = 1
    cuda_graph_max_bs: int = 256  # largest decode batch captured in a CUDA graph
    chunked_prefill_size: int = 8192  # prefill tokens per forward
    attention_backend: str | None = None  # SGLang's; null: its default (CPU: torch_native)
    seeded: bool = True  # each completion samples with its own seed: reproducible (pytorch sampler)
    cpu_kv_tokens: int = 8192  # KV cache size of an engine on CPU (there it is not a fraction of memory)
    sync_transport: Literal["auto", "ipc", "broadcast", "disk"] = "auto"  # auto: ipc colocated, else broadcast
    verify_sync_every: int = 0  # read the engines back after the first sync and every N steps (0: first only)
    verify_logprob_tol: float = 1e-3  # vLLM's check: its log-probs of fixed sequences vs the trainer's, max abs
    timeout_s: float = 600.0  # an engine call (generate, sync, release) that takes longer is an error
    start_timeout_s: float = 900.0
    log_level: str = "error"  # the engine's own log level
    # SGLang with an MoE model returns each token's routed experts (actor.routing_replay and
    # rollout/route_agreement); costs each engine a host buffer of KV tokens x layers x top-k int32
    return_routed_experts: bool = True
    # fp8: the engine holds its linear weights as DeepSeek-V3's block FP8 (e4m3, a scale per 128 x 128
    # block), quantized in each sync; training stays in model.dtype. Turns token TIS on by default
    # (mcore_rl.ppo.correction_settings). SGLang, DeepSeek-V3-style (MLA) models.
    weight_dtype: Literal["bf16", "fp8"] = "bf16"


@dataclass
class MemoryConfig:
    """Colocated memory planning (mcore_rl.memory.planner; `python -m mcore_rl.plan`)."""

    gpu_memory_gb: float | None = None  # plan for this much per GPU; null: NVML's free memory
    reserved_gb: float = 4.0  # per GPU outside both models: CUDA contexts, NCCL, fragmentation
    offload_train_states: bool = True  # Megatron params/grads/optimizer to CPU while the engine runs
    offload_ref: bool = True  # the frozen reference policy lives on the host between its forwards (GPU)
    grad_fp32: bool = True  # grads accumulated and reduced in fp32 (megatron's grad_reduce_in_fp32)
    recompute_activations: bool = False  # shorthand for recompute: full
    # activation recompute (megatron's, counted by the planner): none; full: keep only each
    # recomputed layer's input (recompute_layers: the first N layers of each pipeline stage, null:
    # all); selective: rerun recompute_modules in backward ("moe": the MoE layers' router, dispatch
    # and experts; "mlp": dense MLPs)
    recompute: Literal["none", "full", "selective"] = "none"
    recompute_layers: int | None = None
    recompute_modules: list[Literal["moe", "mlp"]] = field(default_factory=lambda: ["moe"])
    # share of the optimizer's fp32 main params whose Adam moments live and step on the host (GPU
    # only; megatron's optimizer_cpu_offload). The moments leave the GPU; main params stay.
    optimizer_offload_fraction: float = 0.0
    saver_hook_mode: Literal["preload", "torch"] = "preload"  # torch: CUDA graphs cannot be released
    auto_mem_fraction: bool = True  # pick rollout.mem_fraction_static; false: check the configured one
    sync_bucket_mb: int = 512  # weight-sync bucket (two are resident, outside saver regions)
    # the trainer's CUDA allocator maps pages into growing segments: what it reserves follows what
    # it allocates across the offload/onload cycles (mcore_rl.memory.allocator); GPU only
    expandable_segments: bool = True
    cuda_graph_gb: float | None = None  # null: estimate from rollout.cuda_graph_max_bs
    # host memory of each process besides its states (mcore_rl.memory.host); null: the planner's
    # estimates, 3 GiB per trainer rank and 4 GiB per engine rank (with its tokenizer/detokenizer)
    host_trainer_process_gb: float | None = None
    host_engine_process_gb: float | None = None


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class RolloutCorrectionConfig:
    """The engine's log-probs as the behaviour policy (mcore_rl.algos.rollout_correction; verl's
    algorithm.rollout_correction). The defaults correct nothing."""

    rollout_is: Literal["token", "sequence"] | None = None  # importance weights per token or per sequence
    rollout_is_threshold: float | str = 2.0  # a number: truncate (TIS); "lower_upper": zero outside (IcePop)
    rollout_is_batch_normalize: bool = False  # weights rescaled to mean 1 over the batch
    # rejection (masked IS), comma-separated, e.g. "token_k1" or "seq_mean_k1" (geometric mean ratio)
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None  # k1: "lower_upper" ratios; k2/k3: an upper bound


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's algorithm.filter_groups): groups whose `metric` is equal
    for all rollout.n samples are dropped and refilled from further prompts."""

    enable: bool = False
    metric: Literal["reward", "score"] = "reward"  # reward: the score plus reward shaping
    max_num_gen_batches: int = 0  # generation rounds per step (of data.gen_batch_size prompts); <= 0: no limit


@dataclass
class AlgorithmConfig:
    adv_estimator: AdvEstimator = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: KLType = "k1"  # estimator used for the in-reward penalty
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


@dataclass
class PolicyLossConfig:
    loss_mode: Literal["vanilla", "gspo", "cispo"] = "vanilla"  # mcore_rl.algos.losses.POLICY_LOSS_MODES


@dataclass
class ActorConfig:
    lr: float = 1e-6
    lr_warmup_steps: int = 0
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages
    loss_agg_mode: LossAggMode = "token-mean"
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm's divisor; null: rollout.max_response_len
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: KLType = "low_var_kl"
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 256  # prompts per optimizer step (times rollout.n samples)
    micro_batch_size: int = 4  # samples per GPU per forward, when not use_dynamic_bsz
    use_dynamic_bsz: bool = False  # pack micro-batches up to ppo_max_token_len_per_gpu tokens
    ppo_max_token_len_per_gpu: int = 16384
    # token-level TIS cap, verl's older key: algorithm.rollout_correction with rollout_is: token
    tis_imp_ratio_cap: float | None = None
    use_distributed_optimizer: bool = True  # shard fp32 main params and Adam moments over DP
    # aux-loss-free balancing (DeepSeek-V3): expert-bias step per update; 0 keeps routing as loaded
    router_bias_update_rate: float = 0.0
    # R3, rollout routing replay: the policy's routers take the experts the engine routed each token
    # to (old log-probs and update) and weigh them with their own live scores (docs/routing_replay.md)
    routing_replay: bool = False
    # training throughput (benchmarks/actor_bench.py); null: on with GPUs, off on CPU
    # one varlen flash call per micro-batch (GPU), or an SDPA call per sequence; MLA's unequal q/v head
    # widths keep SDPA off its flash kernel, 10x slower on H200 (benchmarks/RESULTS.md, issue 15)
    packed_attention: Literal["sdpa", "varlen"] | None = None
    fused_logprobs: bool | None = None  # log-probs and entropies without fp32 [tokens, vocab] copies (mcore_rl.head)
    fused_adam: bool | None = None  # torch's fused AdamW kernel instead of its multi-tensor ops
    overlap_grad_reduce: bool | None = None  # reduce-scatter grad buckets during the last micro-batch's backward
    grad_bucket_size: int | None = None  # elements per DDP grad bucket; null: megatron's (40 M, or 1 M x DP)


@dataclass
class CriticConfig:
    enabled: bool = False
    hf_path: str | None = None  # defaults to model.hf_path
    lr: float = 1e-5
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    cliprange_value: float = 0.5
    ppo_epochs: int = 1
    micro_batch_size: int = 4  # also the micro-batch of `values`
    # null: the actor's. Without a vocabulary-wide output the critic usually fits longer packs
    ppo_mini_batch_size: int | None = None
    ppo_max_token_len_per_gpu: int | None = None


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = 512
    filter_overlong_prompts: bool = True
    truncation: Literal["error", "left", "right"] = "error"
    train_batch_size: int = 1024  # prompts per step
    gen_batch_size: int | None = None  # prompts per generation round of dynamic sampling; null: train_batch_size
    val_batch_size: int | None = None  # None: the whole validation set at once
    shuffle: bool = True
    task: str | None = None  # an embedded generated task (mcore_rl.data.tasks) instead of files
    task_train_size: int = 4096
    task_val_size: int = 256


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong penalty (verl's reward_kwargs.overlong_buffer_cfg): a response longer
    than rollout.max_response_len - len loses up to penalty_factor of reward, linearly."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0


@dataclass
class RewardConfig:
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class TrainerConfig:
    project: str = "mcore_rl"
    experiment: str = "default"
    output_dir: str = "outputs"
    total_epochs: int = 1
    total_training_steps: int | None = None  # overrides epochs * steps per epoch
    save_freq: int = -1  # steps; -1 never
    test_freq: int = -1
    val_before_train: bool = True
    resume: Literal["auto", "disable"] = "auto"  # disable: refused where output_dir already holds a run
    max_checkpoints: int | None = None  # keep the newest N complete checkpoints; null keeps all
    async_save: bool = False  # checkpoint files written in the background while the next rollout runs
    rollout_dump_dir: str | None = None  # each step's rollout to DIR/step_N.pt (`--replay DIR` trains on it)
    # sync: each step waits for its own rollout. one_step_off: step k trains on the rollout made with
    # step k-1's weights while step k+1's is generated. fully_async: a rollout worker keeps the
    # engines busy and hands finished groups to a buffer the trainer takes batches from
    # (mcore_rl/async_loop.py). Both need engines on resources of their own (cluster.colocate: false)
    mode: Literal["sync", "one_step_off", "fully_async"] = "sync"
    sync_every: int = 1  # fully_async: weights go to the engines after every N updates
    max_staleness: int = 1  # fully_async: a group with a token more versions old than this is regenerated
    # fully_async: responses are generated this many tokens at a time and resubmitted with their tokens
    # so far, so a weight sync lands between the pieces (partial rollout); 0: whole responses
    partial_rollout_tokens: int = 0
    # off-policy modes: PPO's ratio against the trainer's (proximal) log-probs, times the engine's
    # (behaviour) ratio truncated at algorithm.rollout_correction.rollout_is_threshold, unless a
    # rollout correction is configured (decoupled PPO, as AReaL's)
    decoupled_loss: bool = True
    logger: list[Logger] = field(default_factory=lambda: ["console", "jsonl"])
    # short: one line a step (step i/N, reward, validation reward, seconds, ETA); full: every metric
    console: Literal["short", "full"] = "short"
    seed: int = 1


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)


# ----------------------------------------------------------------------------- building
def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _type_name(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is not None:
        return str(tp).replace("typing.", "")
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


class _Mismatch(Exception):
    pass


def _coerce(value, tp, path: str, errors: list[str]):
    """Check `value` against the annotation `tp`; returns the (converted) value or raises _Mismatch."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Mismatch
        return _build(tp, value, path, errors)
    if origin in (Union, types.UnionType):
        for arm in sorted(args, key=lambda a: a is not type(None)):  # try None first
            try:
                return _coerce(value, arm, path, errors)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is Literal:
        if value in args:
            return value
        raise _Mismatch
    if origin is list:
        items = value if isinstance(value, list) else [value] if isinstance(value, str) else None
        if items is None:
            raise _Mismatch
        return [_coerce_or_report(v, args[0], f"{path}[{i}]", errors) for i, v in enumerate(items)]
    if origin is dict or tp is dict:
        if isinstance(value, dict):
            return dict(value)
        raise _Mismatch
    if tp is Any:
        return value
    if tp is type(None):
        if value is None:
            return None
        raise _Mismatch
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-6` as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    raise TypeError(f"{path}: unsupported annotation {tp!r}")


def _coerce_or_report(value, tp, path: str, errors: list[str]):
    try:
        return _coerce(value, tp, path, errors)
    except _Mismatch:
        msg = f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}"
        if typing.get_origin(tp) is Literal and isinstance(value, str):
            msg += _suggest(value, typing.get_args(tp))
        errors.append(msg)
        return None


def _build(cls, data: dict, path: str, errors: list[str]):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in names:
            prefix = f"{path}." if path else ""
            errors.append(f"unknown key {full!r}" + _suggest(f"{prefix}{key}", [prefix + n for n in names]))
            continue
        kwargs[key] = _coerce_or_report(value, hints[key], full, errors)
    return cls(**kwargs)


def config_from_dict(data: dict | None) -> Config:
    """Build a Config from a nested dict (missing keys take defaults); raises ConfigError."""
    errors: list[str] = []
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"the config must be a mapping of sections, got {type(data).__name__}")
    cfg = _build(Config, data or {}, "", errors)
    if errors:
        raise ConfigError(errors)
    return cfg


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides (value parsed as a YAML scalar or list) to a nested dict."""
    data = json.loads(json.dumps(data or {}))  # deep copy of plain YAML data
    errors = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip().lstrip("+")  # tolerate hydra's "+key=value"
        if not sep or not key:
            errors.append(f"override {item!r} is not of the form key=value")
            continue
        node, parts = data, key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                errors.append(f"override {item!r}: {'.'.join(parts[:i + 1])} is a value, not a section")
                break
            node = child
        else:
            node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    if errors:
        raise ConfigError(errors)
    return data


def load_config(path: str | None = None, overrides: list[str] | None = None, *,
                model_info: Callable[[ModelConfig], dict | None] | dict | None = None,
                available_gpus: int | None = None, validate: bool = True) -> Config:
    """Read YAML (optional), apply overrides, build and (by default) validate the config."""
    data: Any = {}
    if path:
        try:
            data = read_yaml_mapping(path)
        except BadInput as e:
            raise ConfigError(str(e)) from None
    cfg = config_from_dict(apply_overrides(data, overrides or []))
    if validate:
        validate_config(cfg, model_info=model_info, available_gpus=available_gpus)
    return cfg


# ----------------------------------------------------------------------------- validation
def hf_model_dims(model: ModelConfig) -> dict | None:
    """The HF config dict of the model: embedded, or read from a local hf_path; None if unknown."""
    if model.hf_config is not None:
        return model.hf_config
    if model.hf_path and os.path.isfile(os.path.join(model.hf_path, "config.json")):
        return _hf_config(model.hf_path, "model.hf_path")
    return None


def _hf_config(path: str, key: str) -> dict:
    try:
        return hf_config(path)
    except BadInput as e:
        raise ConfigError(f"{key}: {e}") from None


def require_model_dirs(cfg: Config) -> None:
    """Training reads the weights, so model.hf_path (and an enabled critic's hf_path), where set,
    must be HF model directories with a readable config.json. validate_config does not ask this:
    the memory planner needs only the shapes, which model.hf_config can give."""
    for key, path in (("model.hf_path", cfg.model.hf_path),
                      ("critic.hf_path", cfg.critic.hf_path if cfg.critic.enabled else None)):
        if path:
            _hf_config(path, key)


def recompute_choice(memory) -> tuple[str, int | None, tuple[str, ...]]:
    """(mode, layers, modules) of a MemoryConfig or its dict, recompute_activations read as full."""
    get = memory.get if isinstance(memory, dict) else functools.partial(getattr, memory)
    mode = get("recompute")
    if mode == "none" and get("recompute_activations"):
        mode = "full"
    return mode, get("recompute_layers"), tuple(get("recompute_modules") or ())


def actor_gpus(cfg: Config) -> int:
    total = cfg.cluster.nnodes * cfg.cluster.n_gpus_per_node
    return total if cfg.cluster.colocate else total - cfg.cluster.rollout_gpus


def rollout_gpus(cfg: Config) -> int:
    c = cfg.cluster
    return c.nnodes * c.n_gpus_per_node if c.colocate else c.rollout_gpus


def _check_ranges(cfg: Config, errors: list[str]) -> None:
    def need(ok: bool, msg: str):
        if not ok:
            errors.append(msg)

    positive = {
        "parallel": ("tp", "pp", "ep", "etp"), "cluster": ("nnodes", "n_gpus_per_node"),
        "rollout": ("n", "max_response_len", "tp_size", "ep_size", "val_n", "cuda_graph_max_bs",
                    "chunked_prefill_size", "cpu_kv_tokens"),
        "memory": ("sync_bucket_mb",),
        "actor": ("ppo_epochs", "ppo_mini_batch_size", "micro_batch_size", "ppo_max_token_len_per_gpu"),
        "critic": ("ppo_epochs", "micro_batch_size"),
        "data": ("max_prompt_length", "train_batch_size", "task_train_size", "task_val_size"),
        "trainer": ("total_epochs",),
    }
    for section, names in positive.items():
        for name in names:
            value = getattr(getattr(cfg, section), name)
            need(value >= 1, f"{section}.{name} must be >= 1, got {value}")
    for name in ("ppo_mini_batch_size", "ppo_max_token_len_per_gpu"):
        value = getattr(cfg.critic, name)
        need(value is None or value >= 1, f"critic.{name} must be >= 1 or null, got {value}")
    for name in ("total_training_steps", "max_checkpoints"):
        value = getattr(cfg.trainer, name)
        need(value is None or value >= 1, f"trainer.{name} must be >= 1 or null, got {value}")
    a, r, alg = cfg.actor, cfg.rollout, cfg.algorithm
    need(0 <= a.clip_ratio_low < 1, f"actor.clip_ratio_low must be in [0, 1), got {a.clip_ratio_low}")
    need(a.clip_ratio_high >= 0, f"actor.clip_ratio_high must be >= 0, got {a.clip_ratio_high}")
    need(a.loss_scale_factor is None or a.loss_scale_factor > 0,
         f"actor.loss_scale_factor must be > 0 or null, got {a.loss_scale_factor}")
    need(a.clip_ratio_c > 1, f"actor.clip_ratio_c must be > 1 (dual-clip bound), got {a.clip_ratio_c}")
    need(a.lr > 0, f"actor.lr must be > 0, got {a.lr}")
    need(a.tis_imp_ratio_cap is None or a.tis_imp_ratio_cap > 0,
         f"actor.tis_imp_ratio_cap must be > 0 or null, got {a.tis_imp_ratio_cap}")
    need(r.temperature > 0, f"rollout.temperature must be > 0, got {r.temperature}")
    need(r.val_temperature >= 0, f"rollout.val_temperature must be >= 0, got {r.val_temperature}")
    need(a.lr_warmup_steps >= 0, f"actor.lr_warmup_steps must be >= 0, got {a.lr_warmup_steps}")
    need(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1], got {r.top_p}")
    need(r.timeout_s > 0 and r.start_timeout_s > 0,
         f"rollout.timeout_s and start_timeout_s must be > 0, got {r.timeout_s} and {r.start_timeout_s}")
    need(r.verify_sync_every >= 0, f"rollout.verify_sync_every must be >= 0, got {r.verify_sync_every}")
    need(r.verify_logprob_tol > 0, f"rollout.verify_logprob_tol must be > 0, got {r.verify_logprob_tol}")
    mem = cfg.memory
    need(mem.gpu_memory_gb is None or mem.gpu_memory_gb > 0,
         f"memory.gpu_memory_gb must be > 0 or null, got {mem.gpu_memory_gb}")
    need(mem.reserved_gb >= 0, f"memory.reserved_gb must be >= 0, got {mem.reserved_gb}")
    need(cfg.cluster.host_memory_gb is None or cfg.cluster.host_memory_gb > 0,
         f"cluster.host_memory_gb must be > 0 or null, got {cfg.cluster.host_memory_gb}")
    need(cfg.cluster.placement_timeout_s > 0,
         f"cluster.placement_timeout_s must be > 0, got {cfg.cluster.placement_timeout_s}")
    for name in ("host_trainer_process_gb", "host_engine_process_gb"):
        value = getattr(mem, name)
        need(value is None or value >= 0, f"memory.{name} must be >= 0 or null, got {value}")
    need(0 < r.mem_fraction_static < 1, f"rollout.mem_fraction_static must be in (0, 1), got "
                                        f"{r.mem_fraction_static}")
    need(0 <= mem.optimizer_offload_fraction <= 1,
         f"memory.optimizer_offload_fraction must be in [0, 1], got {mem.optimizer_offload_fraction}")
    need(cfg.actor.packed_attention != "varlen" or cfg.cluster.device == "gpu",
         "actor.packed_attention=varlen needs cluster.device 'gpu' (torch's varlen attention is CUDA-only)")
    need(mem.optimizer_offload_fraction == 0 or cfg.cluster.device == "gpu",
         "memory.optimizer_offload_fraction > 0 needs cluster.device 'gpu' (megatron's hybrid optimizer "
         "copies over CUDA streams)")
    need(not (mem.recompute_activations and mem.recompute != "full" and mem.recompute != "none"),
         f"memory.recompute_activations: true (full recompute) conflicts with memory.recompute: {mem.recompute}")
    need(mem.recompute_layers is None or mem.recompute_layers >= 1,
         f"memory.recompute_layers must be >= 1 or null, got {mem.recompute_layers}")
    need(mem.recompute_layers is None or recompute_choice(mem)[0] == "full",
         "memory.recompute_layers applies to memory.recompute: full only")
    need(recompute_choice(mem)[0] != "selective" or bool(mem.recompute_modules),
         "memory.recompute: selective needs memory.recompute_modules")
    need(a.grad_bucket_size is None or a.grad_bucket_size >= 1,
         f"actor.grad_bucket_size must be >= 1 or null, got {a.grad_bucket_size}")
    for name in ("gamma", "lam"):
        need(0 <= getattr(alg, name) <= 1, f"algorithm.{name} must be in [0, 1], got {getattr(alg, name)}")
    need(alg.kl_ctrl.type == "fixed" or alg.kl_ctrl.horizon > 0, "algorithm.kl_ctrl.horizon must be > 0")
    need(alg.kl_ctrl.type == "fixed" or alg.kl_ctrl.target_kl > 0, "algorithm.kl_ctrl.target_kl must be > 0")


def _check_layout(cfg: Config, errors: list[str], available_gpus: int | None) -> None:
    c, p, r = cfg.cluster, cfg.parallel, cfg.rollout
    total = c.nnodes * c.n_gpus_per_node
    unit = "GPUs" if c.device == "gpu" else "processes"
    if c.device == "gpu" and available_gpus is not None and total != available_gpus:
        errors.append(f"cluster: nnodes * n_gpus_per_node = {c.nnodes} * {c.n_gpus_per_node} = {total}, "
                      f"but {available_gpus} GPUs are available")
    if c.colocate:
        if c.rollout_gpus not in (0, total):
            errors.append(f"cluster.rollout_gpus = {c.rollout_gpus} with colocate: true; colocated rollout "
                          f"uses all {total} {unit} (set 0, or colocate: false)")
    elif not 0 < c.rollout_gpus < total:
        errors.append(f"cluster.rollout_gpus must be in [1, {total - 1}] when colocate is false "
                      f"(the actor gets the rest of the {total} {unit}), got {c.rollout_gpus}")
        return
    world = actor_gpus(cfg)
    if world % (p.tp * p.pp):
        errors.append(f"parallel: tp * pp = {p.tp} * {p.pp} = {p.tp * p.pp} must divide the actor's "
                      f"world size {world} ({unit})")
    elif world % (p.pp * p.ep * p.etp):
        errors.append(f"parallel: pp * ep * etp = {p.pp * p.ep * p.etp} must divide the actor's world size "
                      f"{world} (megatron's expert-parallel groups)")
    else:
        dp = world // (p.tp * p.pp)
        samples = cfg.actor.ppo_mini_batch_size * r.n
        if samples % dp:
            errors.append(f"actor.ppo_mini_batch_size * rollout.n = {samples} samples must split evenly over "
                          f"data-parallel size {dp}")
        elif not cfg.actor.use_dynamic_bsz and (samples // dp) % cfg.actor.micro_batch_size:
            errors.append(f"actor.micro_batch_size = {cfg.actor.micro_batch_size} must divide the "
                          f"{samples // dp} samples per rank of a mini-batch")
        crit = cfg.critic
        samples = (crit.ppo_mini_batch_size or cfg.actor.ppo_mini_batch_size) * r.n
        if crit.enabled and samples % dp:
            errors.append(f"critic.ppo_mini_batch_size * rollout.n = {samples} samples must split evenly over "
                          f"data-parallel size {dp}")
        elif crit.enabled and not cfg.actor.use_dynamic_bsz and (samples // dp) % crit.micro_batch_size:
            errors.append(f"critic.micro_batch_size = {crit.micro_batch_size} must divide the "
                          f"{samples // dp} samples per rank of a critic mini-batch")
    if rollout_gpus(cfg) % r.tp_size:
        errors.append(f"rollout.tp_size = {r.tp_size} must divide the rollout's {rollout_gpus(cfg)} {unit}")
    if r.tp_size % r.ep_size:
        errors.append(f"rollout.ep_size = {r.ep_size} must divide rollout.tp_size = {r.tp_size}")
    if cfg.trainer.mode != "sync" and c.colocate:
        errors.append(f"trainer.mode '{cfg.trainer.mode}' overlaps rollout and training: it needs the engines on "
                      f"{unit} of their own (cluster.colocate: false, cluster.rollout_gpus: N)")
    t = cfg.trainer
    if t.mode == "fully_async" and (t.sync_every < 1 or t.max_staleness < 0 or t.partial_rollout_tokens < 0):
        errors.append(f"trainer: sync_every must be >= 1, max_staleness and partial_rollout_tokens >= 0; got "
                      f"{t.sync_every}, {t.max_staleness}, {t.partial_rollout_tokens}")
    elif t.mode == "fully_async" and t.max_staleness < t.sync_every - 1:
        errors.append(f"trainer.max_staleness = {t.max_staleness} must be >= sync_every - 1 = {t.sync_every - 1}: "
                      "the last update before a sync trains on samples that old")
    if t.mode == "fully_async" and cfg.algorithm.filter_groups.enable:
        errors.append("trainer.mode 'fully_async' does not run dynamic sampling (algorithm.filter_groups) yet")
    if r.engine == "embedded" and not c.colocate:
        errors.append("rollout.engine 'embedded' samples on the trainer's own shards: it needs cluster.colocate: true")
    if r.engine != "embedded" and r.sync_transport == "ipc" and not c.colocate:
        errors.append("rollout.sync_transport 'ipc' needs cluster.colocate: true (use 'broadcast' or 'disk')")
    per = c.n_gpus_per_node
    if r.tp_size > per and r.tp_size % per:
        errors.append(f"rollout.tp_size = {r.tp_size} spans nodes: it must be a multiple of "
                      f"cluster.n_gpus_per_node = {per}")
    elif r.tp_size <= per and per % r.tp_size:
        errors.append(f"rollout.tp_size = {r.tp_size} must divide cluster.n_gpus_per_node = {per} "
                      "(an engine may not straddle nodes)")


def _check_embedded_shapes(m: ModelConfig, errors: list[str]) -> None:
    """Both set: hf_config describes the checkpoint at hf_path (planning without the weights at
    hand); where that checkpoint's config.json is readable, the two must agree."""
    path = os.path.join(m.hf_path, "config.json")
    if not os.path.isfile(path):
        return
    on_disk = _hf_config(m.hf_path, "model.hf_path")
    differ = [f"{k} ({m.hf_config[k]!r} vs {on_disk[k]!r})" for k in sorted(m.hf_config)
              if k in on_disk and not isinstance(on_disk[k], dict) and on_disk[k] != m.hf_config[k]]
    if differ:
        errors.append(f"model.hf_config disagrees with {path} on " + ", ".join(differ))


def _check_model(cfg: Config, errors: list[str], hf: dict | None) -> bool:
    """Appends the model's problems; returns whether its HF config is sound enough to divide by."""
    m, p, r = cfg.model, cfg.parallel, cfg.rollout
    if m.hf_path is None and m.hf_config is None:
        errors.append("model: set model.hf_path (a checkpoint) or model.hf_config (a random model), or both")
    elif m.hf_path is not None and m.hf_config is not None:
        _check_embedded_shapes(m, errors)
    if hf is None:
        return False
    # a config.json names every size; an embedded hf_config may leave some to transformers' defaults
    on_disk = m.hf_config is None and m.hf_path is not None
    where = os.path.join(m.hf_path, "config.json") if on_disk else "model.hf_config"
    problems = hf_config_problems(hf, complete=on_disk)
    missing = [k for k in ("num_attention_heads", "num_hidden_layers") if k not in hf]
    if missing and not problems:
        problems = [f"lacks {', '.join(missing)}"]
    if problems:
        errors.extend(f"{where}: {p}" for p in problems)
        return False
    heads, layers, experts = hf["num_attention_heads"], hf["num_hidden_layers"], num_experts(hf)
    if heads % p.tp:
        errors.append(f"parallel.tp = {p.tp} must divide the model's num_attention_heads = {heads}")
    kv_heads = hf.get("num_key_value_heads")
    if kv_heads and "kv_lora_rank" not in hf and kv_heads % p.tp:  # MLA has no KV-head groups
        errors.append(f"parallel.tp = {p.tp} must divide the model's num_key_value_heads = {kv_heads}")
    if layers < p.pp:
        errors.append(f"parallel.pp = {p.pp} exceeds the model's num_hidden_layers = {layers}")
    elif (cfg.memory.recompute_layers or 0) > layers // p.pp:
        errors.append(f"memory.recompute_layers = {cfg.memory.recompute_layers} exceeds the "
                      f"{layers // p.pp} layers of a pipeline stage")
    if experts:
        if experts % p.ep:
            errors.append(f"parallel.ep = {p.ep} must divide the model's {experts} routed experts")
        if experts % r.ep_size:
            errors.append(f"rollout.ep_size = {r.ep_size} must divide the model's {experts} routed experts")
        if p.tp > 1 and not p.sequence_parallel:
            errors.append("parallel.sequence_parallel must be true for an MoE model with tp > 1")
        if p.ep == 1 and p.tp > 1 and p.etp != p.tp:
            # each TP rank routes only its sequence-parallel slice of tokens, and with ep = 1
            # megatron reduces expert grads like dense ones (not over TP): they would miss slices
            errors.append(f"parallel.etp = {p.etp} with ep = 1 and tp = {p.tp}: set etp = {p.tp} "
                          f"(experts split like the dense layers) or ep > 1")
    elif p.ep > 1:
        errors.append(f"parallel.ep = {p.ep} but the model has no routed experts")
    return True


# head sizes vLLM's CPU attention has kernels for (0.32: csrc/cpu attention dispatch)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _check_vllm(cfg: Config, errors: list[str], hf: dict | None) -> None:
    """What the vLLM engine (mcore_rl.rollout.vllm) needs; on CPU, what its kernels accept."""
    r, c = cfg.rollout, cfg.cluster
    if r.ep_size != 1:
        errors.append(f"rollout.ep_size = {r.ep_size}: the vLLM engine splits experts over its TP ranks "
                      "(ep_size 1); expert parallelism is SGLang's")
    if r.tp_size > c.n_gpus_per_node:
        errors.append(f"rollout.tp_size = {r.tp_size} spans nodes; the vLLM engine runs on one node")
    if hf is None or c.device != "cpu":
        return
    if "kv_lora_rank" in hf:
        got = (hf["kv_lora_rank"], hf.get("qk_rope_head_dim"))
        if got != (512, 64):
            errors.append(f"vLLM's CPU MLA kernels need kv_lora_rank 512 and qk_rope_head_dim 64, the model has "
                          f"{got[0]} and {got[1]} (a tiny config: add model.hf_config.kv_lora_rank=512 "
                          "model.hf_config.qk_rope_head_dim=64)")
    else:
        head = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        if head not in VLLM_CPU_HEAD_SIZES:
            errors.append(f"vLLM's CPU attention has no kernel for head size {head}; it takes {VLLM_CPU_HEAD_SIZES}")
    moe = hf.get("moe_intermediate_size")
    if num_experts(hf) and moe and (moe // r.tp_size) % 32:
        errors.append(f"moe_intermediate_size / rollout.tp_size = {moe // r.tp_size}: vLLM's CPU experts pad it "
                      "to a multiple of 32, and weight updates then fail; use a multiple of 32")


def _check_sglang(errors: list[str], hf: dict | None) -> None:
    """Models SGLang's own classes build differently from the checkpoint."""
    if hf and hf.get("model_type") == "qwen3_moe" and (hf.get("mlp_only_layers") or
                                                        (hf.get("decoder_sparse_step") or 1) != 1):
        # sglang/srt/models/qwen3_moe.py: "Qwen3MoE all layers are sparse" (0.5.20); it would build
        # experts where the checkpoint has a dense MLP
        errors.append("SGLang's Qwen3MoeForCausalLM makes every layer sparse; this model has dense layers "
                      f"(mlp_only_layers={hf.get('mlp_only_layers')}, decoder_sparse_step="
                      f"{hf.get('decoder_sparse_step')}): use rollout.engine=embedded")


def _check_algorithm(cfg: Config, errors: list[str]) -> None:
    alg, a, r, d = cfg.algorithm, cfg.actor, cfg.rollout, cfg.data
    if alg.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline") and r.n < 2:
        errors.append(f"rollout.n must be >= 2 for algorithm.adv_estimator {alg.adv_estimator!r} "
                      f"(it compares the responses of one prompt), got {r.n}")
    if alg.adv_estimator == "gae" and not cfg.critic.enabled:
        errors.append("algorithm.adv_estimator 'gae' needs critic.enabled: true")
    for section, mini in (("actor", a.ppo_mini_batch_size), ("critic", cfg.critic.ppo_mini_batch_size)):
        if mini is not None and d.train_batch_size % mini:
            errors.append(f"{section}.ppo_mini_batch_size = {mini} must divide "
                          f"data.train_batch_size = {d.train_batch_size}")
    if r.max_prompt_len is not None and r.max_prompt_len != d.max_prompt_length:
        errors.append(f"rollout.max_prompt_len = {r.max_prompt_len} differs from data.max_prompt_length = "
                      f"{d.max_prompt_length} (leave rollout.max_prompt_len unset)")
    seq_len = d.max_prompt_length + r.max_response_len
    for section, budget in (("actor", a.ppo_max_token_len_per_gpu),
                            ("critic", cfg.critic.ppo_max_token_len_per_gpu)):
        if a.use_dynamic_bsz and budget is not None and budget < seq_len:
            errors.append(f"{section}.ppo_max_token_len_per_gpu = {budget} is below one full "
                          f"sequence (max_prompt_length + max_response_len = {seq_len})")
    _check_routing_replay(cfg, errors)
    if not d.train_files and d.task is None:
        errors.append("data: set data.train_files or data.task")
    if d.task is not None:
        from mcore_rl.data.tasks import TASKS
        if d.task not in TASKS:
            errors.append(f"data.task: unknown task {d.task!r}{_suggest(d.task, TASKS)}; known: {sorted(TASKS)}")
    if "wandb" in cfg.trainer.logger and not cfg.trainer.project:
        errors.append("trainer.project must be set for the wandb logger")


def _check_corrections(cfg: Config, errors: list[str]) -> None:
    """Rollout correction, dynamic sampling and reward shaping (their thresholds parsed here, so a
    bad one stops the run before anything starts)."""
    import mcore_rl.algos.rollout_correction as rc

    corr, alg, a = cfg.algorithm.rollout_correction, cfg.algorithm, cfg.actor
    try:
        rc.parse_is_threshold(corr.rollout_is_threshold)
        if corr.rollout_rs is not None:
            rc.parse_rs_thresholds(rc.parse_rs_options(corr.rollout_rs), corr.rollout_rs_threshold)
    except ValueError as e:
        errors.append(f"algorithm.rollout_correction: {e}")
    if a.tis_imp_ratio_cap is not None and corr.rollout_is is not None:
        errors.append("actor.tis_imp_ratio_cap and algorithm.rollout_correction.rollout_is both set: keep one "
                      "(tis_imp_ratio_cap: c is rollout_is: token, rollout_is_threshold: c)")
    ob, max_len = cfg.reward.overlong_buffer, cfg.rollout.max_response_len
    if ob.enable and not 0 < ob.len <= max_len:
        errors.append(f"reward.overlong_buffer.len must be in [1, rollout.max_response_len = {max_len}], got {ob.len}")
    d = cfg.data
    if d.gen_batch_size is not None and d.gen_batch_size < 1:
        errors.append(f"data.gen_batch_size must be >= 1 or null, got {d.gen_batch_size}")
    if alg.filter_groups.enable and cfg.rollout.n < 2:
        errors.append("algorithm.filter_groups needs rollout.n >= 2 (it drops groups whose rewards are all equal)")


def _check_fp8(cfg: Config, errors: list[str], hf: dict | None) -> None:
    """FP8 engine weights: SGLang only (the sync quantizes into its layout), MLA models only."""
    if cfg.rollout.weight_dtype != "fp8":
        return
    if cfg.rollout.engine != "sglang":
        errors.append(f"rollout.weight_dtype=fp8 needs rollout.engine=sglang, not {cfg.rollout.engine}")
    if hf is not None and not str(hf.get("model_type", "")).startswith("deepseek"):
        errors.append(f"rollout.weight_dtype=fp8 is wired for DeepSeek-V3-style models, not {hf.get('model_type')}")
    elif hf is not None and cfg.rollout.engine == "sglang":  # SGLang would refuse at start; say why here
        from mcore_rl.models.config import HFModel
        from mcore_rl.sync.plan import EngineLayout, fp8_misfits

        tp = cfg.rollout.tp_size
        errors.extend(f"rollout.weight_dtype=fp8: {line}" for line in
                      fp8_misfits(HFModel.from_dict(hf), EngineLayout(tp, cfg.rollout.ep_size, 1, tp)))


def returns_routes(cfg: Config, hf: dict | None = None) -> bool:
    """Whether the rollout engines return each token's routed experts (SGLang, an MoE model)."""
    hf = hf if hf is not None else hf_model_dims(cfg.model)
    return cfg.rollout.engine == "sglang" and cfg.rollout.return_routed_experts and bool(hf and num_experts(hf))


def _check_routing_replay(cfg: Config, errors: list[str]) -> None:
    if not cfg.actor.routing_replay:
        return
    engine = cfg.rollout.engine
    if engine == "vllm":  # vLLM 0.32 has enable_return_routed_experts, but mcore_rl.rollout.vllm does not carry them yet
        errors.append("actor.routing_replay: the vLLM engine adapter returns no routed experts; use rollout.engine=sglang")
    elif engine == "embedded":
        errors.append("actor.routing_replay: the embedded engine routes with the trainer's own routers; "
                      "there is nothing to replay")
    elif not cfg.rollout.return_routed_experts:
        errors.append("actor.routing_replay needs rollout.return_routed_experts: true")
    else:
        hf = hf_model_dims(cfg.model)
        if hf is not None and not num_experts(hf):
            errors.append("actor.routing_replay: the model has no routed experts")


def validate_config(cfg: Config, *, model_info: Callable[[ModelConfig], dict | None] | dict | None = None,
                    available_gpus: int | None = None) -> Config:
    """Cross-check the sections; raises ConfigError listing every problem. Fills derived defaults.

    model_info: the model's HF config dict, or a callable returning it from cfg.model; by default
    the embedded hf_config or hf_path/config.json (model checks are skipped if neither is there).
    available_gpus: when given and cluster.device is gpu, the cluster must have exactly these.
    """
    errors: list[str] = []
    _check_ranges(cfg, errors)
    if errors:  # the cross checks below divide by sizes that must first be >= 1
        raise ConfigError(errors)
    _check_layout(cfg, errors, available_gpus)
    hf = model_info(cfg.model) if callable(model_info) else model_info
    hf = hf if hf is not None else hf_model_dims(cfg.model)
    sound = _check_model(cfg, errors, hf)
    if cfg.rollout.engine == "vllm":
        _check_vllm(cfg, errors, hf if sound else None)
    if cfg.rollout.engine == "sglang" and sound:
        _check_sglang(errors, hf)
    _check_algorithm(cfg, errors)
    _check_corrections(cfg, errors)
    _check_fp8(cfg, errors, hf if sound else None)
    if errors:
        raise ConfigError(errors)
    if cfg.rollout.max_prompt_len is None:
        cfg.rollout.max_prompt_len = cfg.data.max_prompt_length
    return cfg


# ----------------------------------------------------------------------------- output
def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m mcore_rl.config CONFIG.yaml [key=value ...]")
        return 0 if argv else 2
    try:
        cfg = load_config(argv[0], argv[1:])
    except BAD_INPUT as e:
        return report(e)
    print(to_yaml(cfg), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
