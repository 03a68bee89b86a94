"""The config's cross checks: the sections against each other, the cluster layout and the model's
dimensions (mcore_rl.config.sections checks each key's type and range as it builds the sections).

validate_config reports every problem at once, in one ConfigError, before anything starts.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Callable

from mcore_rl.preflight.bad_input import BadInput, ConfigError, hf_config, suggest
from mcore_rl.models.checks import hf_config_problems, num_experts
from mcore_rl.models.families import DIRECT_LOAD_TYPES, family_of

if TYPE_CHECKING:  # the sections it checks; mcore_rl.config.sections imports this module for load_config
    from mcore_rl.config.sections import Config, ModelConfig


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


def initial_weights(cfg: Config) -> dict[str, str]:
    """The HF checkpoints a run starts from: {"policy": model.hf_path, "critic": an enabled critic's
    hf_path where it is another model}; none for an embedded model.hf_config (megatron's seeded init).
    Each trainer rank reads its own shard of them (MegatronActor.read_initial)."""
    m, c = cfg.model, cfg.critic
    if not m.hf_path:
        return {}
    init = {"policy": m.hf_path}
    if c.enabled and c.hf_path and os.path.abspath(c.hf_path) != os.path.abspath(m.hf_path):
        init["critic"] = c.hf_path
    return init


def recompute_choice(memory) -> tuple[str, int | None, tuple[str, ...]]:
    """(mode, layers, modules) of a MemoryConfig or its dict, recompute_activations read as full."""
    get = memory.get if isinstance(memory, dict) else functools.partial(getattr, memory)
    mode = get("recompute")
    if mode in ("none", "auto") and get("recompute_activations"):
        mode = "full"
    return mode, get("recompute_layers"), tuple(get("recompute_modules") or ())


def actor_gpus(cfg: Config) -> int:
    total = cfg.cluster.nnodes * cfg.cluster.n_gpus_per_node
    return total if cfg.cluster.colocate else total - cfg.cluster.rollout_gpus


def max_running_requests(cfg: Config) -> int:
    """The largest decode batch an engine rank runs: rollout.max_running_requests, else the graphs' size
    (under DP attention each rank its own requests: the engine runs attention_dp(cfg) times as many)."""
    r = cfg.rollout
    return r.max_running_requests or r.cuda_graph_max_bs


def attention_dp(cfg: Config) -> int:
    """SGLang's dp_size under DP attention (rollout.dp_attention: one attention-DP rank per TP rank), else 1."""
    return cfg.rollout.tp_size if cfg.rollout.dp_attention else 1


def transport_for(cfg: Config) -> str:
    """The weight sync's transport: rollout.sync_transport, with auto resolved (ipc colocated, else broadcast)."""
    t = cfg.rollout.sync_transport
    if t == "auto":
        return "ipc" if cfg.cluster.colocate else "broadcast"
    return t


def rollout_gpus(cfg: Config) -> int:
    c = cfg.cluster
    return c.nnodes * c.n_gpus_per_node if c.colocate else c.rollout_gpus


def _check_memory_and_device(cfg: Config, errors: list[str]) -> None:
    """Settings that need a GPU, and recompute settings that contradict each other."""
    mem, gpu = cfg.memory, cfg.cluster.device == "gpu"
    if cfg.actor.packed_attention == "varlen" and not gpu:
        errors.append("actor.packed_attention=varlen needs cluster.device 'gpu' (torch's varlen attention is CUDA-only)")
    if mem.optimizer_offload_fraction > 0 and not gpu:
        errors.append("memory.optimizer_offload_fraction > 0 needs cluster.device 'gpu' (megatron's hybrid optimizer "
                      "copies over CUDA streams)")
    if mem.recompute_activations and mem.recompute == "selective":
        errors.append("memory.recompute_activations: true (full recompute) conflicts with memory.recompute: selective")
    mode = recompute_choice(mem)[0]
    if mem.recompute_layers is not None and mode != "full":
        errors.append("memory.recompute_layers applies to memory.recompute: full only")
    if mode == "selective" and not mem.recompute_modules:
        errors.append("memory.recompute: selective needs memory.recompute_modules")


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
    if t.mode == "fully_async" and t.max_staleness < t.sync_every - 1:
        errors.append(f"trainer.max_staleness = {t.max_staleness} must be >= sync_every - 1 = {t.sync_every - 1}: "
                      "the last update before a sync trains on samples that old")
    if r.engine == "embedded" and not c.colocate:
        errors.append("rollout.engine 'embedded' samples on the trainer's own shards: it needs cluster.colocate: true")
    if r.engine == "embedded" and r.engine_kwargs:
        errors.append(f"rollout.engine_kwargs ({', '.join(r.engine_kwargs)}) are arguments of an SGLang or vLLM engine; "
                      "rollout.engine 'embedded' takes none")
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
    if m.mla_base_rank is not None:
        if m.hf_path is not None:
            errors.append("model.mla_base_rank scales a random model's init; model.hf_path's weights are a "
                          "checkpoint's (leave it null)")
        elif "kv_lora_rank" not in hf:
            errors.append(f"model.mla_base_rank = {m.mla_base_rank}: the model has no MLA latent (kv_lora_rank)")
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
    """Models SGLang's own classes build differently from the checkpoint (each family says which)."""
    family = family_of(hf.get("model_type")) if hf else None
    if family is not None:
        errors.extend(family.sglang_problems(hf))


def _check_dp_attention(cfg: Config, errors: list[str], hf: dict | None) -> None:
    """rollout.dp_attention: SGLang's, at tp > 1, for the MLA models whose layout under it the sync knows."""
    from mcore_rl.models.config import HFModel

    r = cfg.rollout
    if not r.dp_attention:
        return
    if r.engine != "sglang":
        errors.append(f"rollout.dp_attention is SGLang's (enable_dp_attention); rollout.engine is {r.engine}")
    if r.tp_size == 1:
        errors.append("rollout.dp_attention needs rollout.tp_size > 1: it splits an engine's requests over its TP ranks")
    if hf is not None and not HFModel.from_dict(hf).is_mla:
        errors.append(f"rollout.dp_attention is wired for MLA models (DeepSeek-V3 family), not {hf.get('model_type')}: "
                      "SGLang's layout under it is checked for DeepseekV2 only")


def _check_moe_config_dir(cfg: Config, errors: list[str]) -> None:
    where = cfg.rollout.moe_config_dir
    if where is None:
        return
    if cfg.rollout.engine != "sglang":
        errors.append("rollout.moe_config_dir is SGLang's (SGLANG_MOE_CONFIG_DIR); "
                      f"rollout.engine is {cfg.rollout.engine}")
    elif not os.path.isdir(os.path.join(where, "configs")):  # SGLang would fall back to its defaults silently
        errors.append(f"rollout.moe_config_dir={where} holds no configs/ folder (scripts/tune_fused_moe.py "
                      "writes one)")


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
        if a.use_dynamic_bsz and budget not in (None, "auto") and budget < seq_len:
            errors.append(f"{section}.ppo_max_token_len_per_gpu = {budget} is below one full "
                          f"sequence (max_prompt_length + max_response_len = {seq_len})")
    if a.ppo_max_token_len_per_gpu == "auto" and not a.use_dynamic_bsz:
        errors.append("actor.ppo_max_token_len_per_gpu: auto picks a budget for actor.use_dynamic_bsz: true only")
    _check_routing_replay(cfg, errors)
    if not d.train_files and d.task is None:
        errors.append("data: set data.train_files or data.task")
    if d.task is not None:
        from mcore_rl.data.tasks import TASKS
        if d.task not in TASKS:
            errors.append(f"data.task: unknown task {d.task!r}{suggest(d.task, TASKS)}; known: {sorted(TASKS)}")
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
    if alg.filter_groups.enable and cfg.rollout.n < 2:
        errors.append("algorithm.filter_groups needs rollout.n >= 2 (it drops groups whose rewards are all equal)")


def _check_fp8(cfg: Config, errors: list[str], hf: dict | None) -> None:
    """FP8 engine weights: SGLang only (the sync quantizes into its layout), MLA models only, GPUs only."""
    if cfg.rollout.weight_dtype != "fp8":
        if cfg.rollout.fp8_kernels != "triton":
            errors.append(f"rollout.fp8_kernels={cfg.rollout.fp8_kernels} needs rollout.weight_dtype=fp8")
        return
    if cfg.cluster.device == "cpu" and cfg.rollout.engine == "sglang":
        # SGLang's CPU engine dies starting a block-FP8 model: say so before anything starts
        kernels = cfg.rollout.fp8_kernels
        errors.append(f"rollout.fp8_kernels={kernels} runs on GPUs (Hopper)" if kernels != "triton" else
                      "rollout.weight_dtype=fp8 needs cluster.device gpu: SGLang's CPU engine does not start "
                      "with block-FP8 weights")
        return
    if cfg.rollout.engine != "sglang":
        errors.append(f"rollout.weight_dtype=fp8 needs rollout.engine=sglang, not {cfg.rollout.engine}")
    # a linear layer whose shard is not whole 128 x 128 blocks at the engine's layout stays in the
    # model's dtype (mcore_rl.sync.engine_layout.fp8_misfit): every layout SGLang takes works
    if hf is not None and not str(hf.get("model_type", "")).startswith("deepseek"):
        errors.append(f"rollout.weight_dtype=fp8 is wired for DeepSeek-V3-style models, not {hf.get('model_type')}")


def _check_direct_load(cfg: Config, errors: list[str], hf: dict | None) -> None:
    """rollout.sync_load=direct: SGLang over ipc, models SGLang derives nothing from after loading."""
    r = cfg.rollout
    if r.sync_load != "direct":
        return
    transport = transport_for(cfg)
    if r.engine != "sglang" or transport != "ipc":
        errors.append(f"rollout.sync_load=direct needs SGLang over the ipc transport (colocated), not "
                      f"{r.engine} over {transport}")
    if r.weight_dtype != "bf16":
        errors.append("rollout.sync_load=direct loads bf16 weights; SGLang processes FP8 ones after loading "
                      "(use sync_load: sglang)")
    if hf is not None and hf.get("model_type") not in DIRECT_LOAD_TYPES:
        errors.append(f"rollout.sync_load=direct is checked against SGLang's loader for "
                      f"{', '.join(DIRECT_LOAD_TYPES)} (tests/e2e/test_sglang_sync.py), not {hf.get('model_type')} "
                      "(MLA: SGLang derives absorbed weights after loading); use sync_load: sglang")


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


# options that act only in some settings: (key, whether it acts, when it does)
_CONDITIONAL = [
    *[(f"trainer.{k}", lambda c: c.trainer.mode == "fully_async", "trainer.mode fully_async")
      for k in ("sync_every", "max_staleness", "stale_groups", "partial_rollout_tokens")],
    ("trainer.decoupled_loss", lambda c: c.trainer.mode != "sync", "an off-policy trainer.mode"),
    *[(f"reward.overlong_buffer.{k}", lambda c: c.reward.overlong_buffer.enable, "reward.overlong_buffer.enable")
      for k in ("len", "penalty_factor")],
    *[(f"algorithm.filter_groups.{k}", lambda c: c.algorithm.filter_groups.enable, "algorithm.filter_groups.enable")
      for k in ("metric", "max_num_gen_batches")],
    ("data.gen_batch_size", lambda c: c.algorithm.filter_groups.enable, "algorithm.filter_groups.enable"),
    *[(f"actor.{k}", lambda c: c.actor.use_kl_loss, "actor.use_kl_loss") for k in ("kl_loss_coef", "kl_loss_type")],
    ("algorithm.kl_penalty", lambda c: c.algorithm.use_kl_in_reward, "algorithm.use_kl_in_reward"),
    *[(f"algorithm.kl_ctrl.{k}", lambda c: c.algorithm.use_kl_in_reward, "algorithm.use_kl_in_reward")
      for k in ("type", "kl_coef", "target_kl", "horizon")],
    ("actor.loss_scale_factor", lambda c: c.actor.loss_agg_mode == "seq-mean-token-sum-norm",
     "actor.loss_agg_mode seq-mean-token-sum-norm"),
    *[(f"{s}.ppo_max_token_len_per_gpu", lambda c: c.actor.use_dynamic_bsz, "actor.use_dynamic_bsz")
      for s in ("actor", "critic")],
    ("algorithm.rollout_correction.rollout_is_threshold", lambda c: c.algorithm.rollout_correction.rollout_is
     is not None, "algorithm.rollout_correction.rollout_is"),
    ("algorithm.rollout_correction.rollout_rs_threshold", lambda c: c.algorithm.rollout_correction.rollout_rs
     is not None, "algorithm.rollout_correction.rollout_rs"),
    *[(f"critic.{k}", lambda c: c.critic.enabled, "critic.enabled") for k in
      ("hf_path", "lr", "weight_decay", "grad_clip", "cliprange_value", "ppo_epochs", "micro_batch_size",
       "ppo_mini_batch_size")],
]


def _was_set(cfg: Config, key: str) -> bool:
    """Whether the config file or an override gave `key` (a dotted path), not its default."""
    *sections, name = key.split(".")
    node = cfg
    for part in sections:
        if part not in node.model_fields_set:
            return False
        node = getattr(node, part)
    return name in node.model_fields_set


def inert_options(cfg: Config) -> list[str]:
    """One warning line per option given that does nothing in this config, naming it and when it acts."""
    return [f"warning: {key} is set but acts only with {when}; it is ignored here"
            for key, acts, when in _CONDITIONAL if _was_set(cfg, key) and not acts(cfg)]


def _check_multiturn(cfg: Config, errors: list[str]) -> None:
    r = cfg.rollout
    for key in ("env", "generate_fn"):
        spec = getattr(r, key)
        module, sep, name = (spec or "").partition(":")
        if spec is not None and not (sep and module and name):
            errors.append(f"rollout.{key}: {spec!r} must be package.module:name")
    if (r.env or r.generate_fn) and r.max_turn_tokens is not None and r.max_turn_tokens > r.max_response_len:
        errors.append(f"rollout.max_turn_tokens = {r.max_turn_tokens} > rollout.max_response_len = "
                      f"{r.max_response_len} (which bounds the whole conversation)")


def validate_config(cfg: Config, *, model_info: Callable[[ModelConfig], dict | None] | dict | None = None,
                    available_gpus: int | None = None) -> Config:
    """Cross-check the sections; raises ConfigError listing every problem. Fills derived defaults.

    model_info: the model's HF config dict, or a callable returning it from cfg.model; by default
    the embedded hf_config or hf_path/config.json (model checks are skipped if neither is there).
    available_gpus: when given and cluster.device is gpu, the cluster must have exactly these.
    """
    errors: list[str] = []  # the sections' own types and ranges were checked as they were built
    if not cfg.trainer.output_dir.strip():
        errors.append("trainer.output_dir is empty: name the directory for the run's checkpoints and logs")
    _check_memory_and_device(cfg, errors)
    _check_layout(cfg, errors, available_gpus)
    hf = model_info(cfg.model) if callable(model_info) else model_info
    hf = hf if hf is not None else hf_model_dims(cfg.model)
    sound = _check_model(cfg, errors, hf)
    if cfg.rollout.engine == "vllm":
        _check_vllm(cfg, errors, hf if sound else None)
    if cfg.rollout.engine == "sglang" and sound:
        _check_sglang(errors, hf)
    _check_dp_attention(cfg, errors, hf if sound else None)
    _check_moe_config_dir(cfg, errors)
    _check_algorithm(cfg, errors)
    _check_corrections(cfg, errors)
    _check_fp8(cfg, errors, hf if sound else None)
    _check_direct_load(cfg, errors, hf if sound else None)
    _check_multiturn(cfg, errors)
    if errors:
        raise ConfigError(errors)
    if cfg.rollout.max_prompt_len is None:
        cfg.rollout.max_prompt_len = cfg.data.max_prompt_length
    return cfg
