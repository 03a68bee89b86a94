"""Typed trainer config: pydantic sections, YAML + dotted `key=value` overrides, validation.

    cfg = load_config("configs/x.yaml", ["actor.lr=1e-6", "trainer.logger=[console,jsonl]"])
    print(to_yaml(cfg))

Every mistake is reported before anything starts, all at once, in one ConfigError: unknown keys (with
the closest valid key), wrong types (with the expected type), values out of range, and the cross checks
against the cluster and the model's dimensions (mcore_rl.config.checks).
`python -m mcore_rl.config CONFIG [key=value ...]` prints the resolved config or the errors; `--schema`
every key, as docs/config.md.
"""

from __future__ import annotations

import json
import os
import sys
import types
import typing
from typing import Annotated, Any, Callable, Literal, Union

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from mcore_rl.config import checks as config_checks
from mcore_rl.preflight.bad_input import BAD_INPUT, BadInput, ConfigError, read_yaml_mapping, report, suggest, yaml_load

Dtype = Literal["bf16", "fp16", "fp32"]
AdvEstimator = Literal["grpo", "gae", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
KLType = Literal["k1", "k2", "low_var_kl"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
Logger = Literal["console", "jsonl", "tensorboard", "wandb"]
# a single value where a list is expected is a list of one (`data.train_files=a.parquet`)
OneOrMany = BeforeValidator(lambda v: [v] if isinstance(v, str) else v)


class Section(BaseModel):
    """A config section: unknown keys, and assignments out of type or range, are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _is_section(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, Section)


class ModelConfig(Section):
    hf_path: str | None = Field(None, description="HF checkpoint dir (config.json, tokenizer, safetensors)")
    hf_config: dict[str, Any] | None = Field(None, description="or an embedded HF config dict (tiny random model)")
    tokenizer_path: str | None = Field(None, description="defaults to hf_path")
    dtype: Dtype = "bf16"
    mla_base_rank: int | None = Field(None, ge=1, description=(
        "an embedded MLA model (hf_config with kv_lora_rank, no hf_path): its latent's up-projection (kv_b) is "
        "initialised with std x sqrt(base / kv_lora_rank) and stepped with actor.lr x base / kv_lora_rank (muP's "
        "rule for a hidden weight's fan-in), so a latent widened for an engine's kernels (vLLM's CPU MLA: 512) "
        "trains as one of this rank; null, or equal to kv_lora_rank: as every other weight"))


class ParallelConfig(Section):
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    etp: int = Field(1, ge=1)
    sequence_parallel: bool = False


class ClusterConfig(Section):
    nnodes: int = Field(1, ge=1)
    n_gpus_per_node: int = Field(8, ge=1)
    colocate: bool = Field(True, description="actor and rollout share all GPUs, taking turns")
    rollout_gpus: int = Field(0, ge=0, description="GPUs given to rollout alone when not colocated")
    device: Literal["gpu", "cpu"] = Field("gpu", description="cpu: gloo processes stand in for GPUs (tests)")
    host_memory_gb: float | None = Field(None, gt=0, description=(
        "RAM of each node, for the host memory plan (mcore_rl.memory.host); null: this machine's MemTotal where its "
        "GPUs are visible (planning on a node), else the host plan is not checked"))
    placement_timeout_s: float = Field(120.0, gt=0, description=(
        "how long Ray may take to place the trainer's and engines' bundles; then the run stops naming what it asked "
        "for and what the cluster has (a GPU config on a machine without GPUs would otherwise wait forever)"))
    jit_cache_dir: str | None = Field("~/.cache/mcore_rl/jit", description=(
        "on each node, where the engines' first-use compiles are kept across runs (flashinfer, triton, DeepGEMM, "
        "torch inductor, CUDA's PTX cache: mcore_rl.rollout.jit_cache); `~` is the node's home; a cache variable "
        "already set in the environment (TRITON_CACHE_DIR, ...) wins; null: each library's own default"))


class RolloutConfig(Section):
    engine: Literal["embedded", "sglang", "vllm"] = Field("sglang", description="mcore_rl/rollout/: a file per engine")
    n: int = Field(8, ge=1, description="responses per prompt")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_prompt_len: int | None = Field(None, description="defaults to data.max_prompt_length")
    max_response_len: int = Field(1024, ge=1)
    stop_token_ids: Annotated[list[int], OneOrMany] = Field(default_factory=list, description="and the tokenizer's EOS")
    ignore_eos: bool = Field(False, description=(
        "nothing ends a response early, neither EOS nor stop_token_ids: each runs to max_response_len "
        "(benchmarks at a fixed length, random weights)"))
    tp_size: int = Field(1, ge=1)
    ep_size: int = Field(1, ge=1)
    dp_attention: bool = Field(False, description=(
        "SGLang's DP attention in each engine (enable_dp_attention, dp_size = tp_size; MLA models): each rank "
        "runs its own requests through whole attention with its own KV cache (plain TP replicates MLA's latent "
        "cache on every rank), embeddings, lm_head and dense MLP whole per rank, experts over the TP group "
        "(rollout.ep_size); rollout.max_running_requests / cuda_graph_max_bs are then per rank"))
    mem_fraction_static: float = Field(0.7, gt=0, lt=1)
    enable_memory_saver: bool = True
    val_temperature: float = Field(0.0, ge=0, description="validation sampling; 0 = greedy")
    val_n: int = Field(1, ge=1)
    cuda_graph_max_bs: int = Field(256, ge=1, description="largest decode batch captured in a CUDA graph")
    max_running_requests: int | None = Field(None, ge=1, description=(
        "largest decode batch an engine runs; null: on GPUs cuda_graph_max_bs, so every decode step "
        "replays a captured graph and stays within the memory plan; on CPU no limit"))
    chunked_prefill_size: int = Field(8192, ge=1, description="prefill tokens per forward")
    attention_backend: str | None = Field(None, description="SGLang's; null: its default (CPU: torch_native)")
    seeded: bool = Field(True, description="each completion samples with its own seed: reproducible (pytorch sampler)")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description=(
        "any further argument of the engine itself, passed through: SGLang's ServerArgs (sglang.Engine) or vLLM's "
        "EngineArgs (vllm.LLM), e.g. rollout.engine_kwargs.enable_mixed_chunk=true; a key the installed engine does "
        "not take is refused up front; where the run sets the same key itself (model, layout, memory, what the "
        "sync assumes) its own value is kept, with a warning naming the key (mcore_rl.rollout.engine_kwargs)"))
    cpu_kv_tokens: int = Field(8192, ge=1, description="an engine's KV cache on CPU (not a fraction of memory there)")
    sync_transport: Literal["auto", "ipc", "broadcast", "disk"] = Field(
        "auto", description="auto: ipc colocated, else broadcast")
    sync_load: Literal["sglang", "direct"] = Field("sglang", description=(
        "how an SGLang engine takes a synced bucket over ipc. sglang: its model's load_weights. direct: copied "
        "straight into its parameters by the read-back's placement table (mcore_rl.sync.engine_layout.load_direct), "
        "without SGLang's per-tensor name matching; qwen3_moe, glm4_moe and qwen2 in bf16 (SGLang derives state from MLA and FP8 weights)"))
    verify_sync_every: int = Field(0, ge=0, description=(
        "read the engines back after the first sync and every N steps (0: first only)"))
    verify_logprob_tol: float = Field(1e-3, gt=0, description=(
        "vLLM's check: its log-probs of fixed sequences vs the trainer's, max abs"))
    verify_sync_probe: bool = Field(False, description=(
        "at each read-back (colocated, once the engine has its KV cache back), also "
        "the trainer's and every engine's log-probs of fixed probe sequences (sync/probe_gap_mean, "
        "sync/probe_gap_max): state the engine derives from its weights, which no weight digest covers; a "
        "metric, not a check (bf16 engines differ from the trainer by their kernels)"))
    timeout_s: float = Field(600.0, gt=0, description="engine calls (generate, sync, release) taking longer are errors")
    start_timeout_s: float = Field(900.0, gt=0)
    log_level: str = Field("error", description="the engine's own log level")
    return_routed_experts: bool = Field(True, description=(
        "SGLang with an MoE model returns each token's routed experts (actor.routing_replay, rollout/route_agreement); "
        "each engine holds a host buffer of KV tokens x layers x top-k int32"))
    moe_config_dir: str | None = Field(None, description=(
        "SGLang's fused-MoE tiles tuned for this model and GPU (SGLANG_MOE_CONFIG_DIR; scripts/tune_fused_moe.py "
        "writes one); null: the tiles SGLang ships, or its generic default where it ships none"))
    weight_dtype: Literal["bf16", "fp8"] = Field("bf16", description=(
        "fp8: the engine's linear weights are DeepSeek-V3's block FP8 (e4m3, a scale per 128 x 128 block), quantized "
        "in each sync; a layer whose slice per engine rank is not whole blocks stays in model.dtype (listed in the "
        "engine config's ignored_layers). Training stays in model.dtype. Turns token TIS on by default "
        "(ppo.correction_settings). SGLang"))
    env: str | None = Field(None, description=(
        "multi-turn rollouts: package.module:Class of the environment, built per conversation (async reset(sample), "
        "step(model_turn) -> (observation, reward, done); mcore_rl/rollout/multiturn.py, README 'Multi-turn rollouts')"))
    env_args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of rollout.env's class")
    generate_fn: str | None = Field(None, description=(
        "package.module:function, an async per-sample rollout replacing the environment loop (slime's custom "
        "generate): fn(ctx: TurnContext, conv: Conversation)"))
    max_turns: int = Field(4, ge=1, description="model turns of a conversation at most")
    max_turn_tokens: int | None = Field(None, ge=1, description=(
        "tokens of one model turn at most; null: what is left of max_response_len, which bounds the whole "
        "conversation's response (model and environment tokens)"))
    tool_timeout_s: float = Field(30.0, gt=0, description=(
        "an environment call (reset, step) taking longer ends its conversation with tool_failure_reward"))
    max_observation_tokens: int = Field(1024, ge=1, description=(
        "an observation longer than this ends its conversation with tool_failure_reward"))
    tool_failure_reward: float = Field(0.0, description=(
        "the score of a conversation whose tool raised, timed out or flooded (multiturn/tool_failures_*)"))
    fp8_kernels: Literal["triton", "deep_gemm", "deep_gemm_moe"] = Field("triton", description=(
        "weight_dtype=fp8 on GPUs: the engine's block-FP8 GEMMs. triton: SGLang's triton kernels, dense and fused MoE. "
        "deep_gemm: the dense GEMMs on DeepGEMM's JIT kernels (Hopper; sgl-deep-gemm installed), the fused MoE on "
        "triton. deep_gemm_moe: the MoE on DeepGEMM's grouped GEMMs too. Compiled on first use (SGLang's "
        "pre-compile off). Their speeds: docs/performance.md"))


class MemoryConfig(Section):
    """Colocated memory planning (mcore_rl.memory.planner; `python -m mcore_rl.memory.plan`)."""

    gpu_memory_gb: float | None = Field(None, gt=0, description="plan for this much per GPU; null: NVML's free memory")
    reserved_gb: float = Field(6.0, ge=0, description=(
        "per GPU outside both models' planned tensors: the trainer's and the engine's CUDA contexts, NCCL, "
        "kernels, the released engine's leftovers"))
    offload_train_states: bool | Literal["auto"] = Field(True, description=(
        "Megatron params/grads/optimizer to CPU while the engine runs. auto: the memory plan keeps them on the GPUs "
        "where they fit beside the engine with KV for the whole step's sequences (no copies to switch phases), "
        "else offloads them (offloaded without a plan, on CPU)"))
    offload_ref: bool = Field(True, description="the frozen reference policy stays on the host between forwards (GPU)")
    grad_fp32: bool = Field(True, description="grads accumulated and reduced in fp32 (megatron's grad_reduce_in_fp32)")
    recompute_activations: bool = Field(False, description="shorthand for recompute: full")
    recompute: Literal["none", "full", "selective", "auto"] = Field("none", description=(
        "activation recompute (megatron's; the planner counts it). full: keep each recomputed layer's input only "
        "(recompute_layers: the first N of each pipeline stage; null: all). selective: rerun recompute_modules "
        "in backward (moe: the MoE layers' router, dispatch and experts; mlp: dense MLPs). auto: the memory plan "
        "picks the cheapest of none, selective, full that fits (none without a plan, on CPU)"))
    recompute_layers: int | None = Field(None, ge=1)
    recompute_modules: Annotated[list[Literal["moe", "mlp"]], OneOrMany] = Field(default_factory=lambda: ["moe"])
    optimizer_offload_fraction: float = Field(0.0, ge=0, le=1, description=(
        "share of the optimizer's fp32 main params whose Adam moments live and step on the host (GPU only; "
        "megatron's optimizer_cpu_offload). The moments leave the GPU; main params stay."))
    saver_hook_mode: Literal["preload", "torch"] = Field("preload", description="torch: CUDA graphs cannot be released")
    auto_mem_fraction: bool = Field(True, description="pick rollout.mem_fraction_static; false: check the set one")
    sync_bucket_mb: int = Field(512, ge=1, description="weight-sync bucket (two in flight plus the gathers filling one, outside saver regions)")
    expandable_segments: bool = Field(True, description=(
        "the trainer's CUDA allocator maps pages into growing segments: what it reserves follows what it "
        "allocates across the offload/onload cycles (mcore_rl.memory.allocator); GPU only"))
    cuda_graph_gb: float | None = Field(None, ge=0, description="null: estimate from rollout.cuda_graph_max_bs")
    host_trainer_process_gb: float | None = Field(None, ge=0, description=(
        "host memory of each process besides its states; null: mcore_rl.memory.host's estimates "
        "(TRAINER_PROCESS_GB per trainer rank, ENGINE_PROCESS_GB per engine rank with its tokenizer/detokenizer)"))
    host_engine_process_gb: float | None = Field(None, ge=0, description="as host_trainer_process_gb")


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.001, ge=0)
    target_kl: float = Field(0.1, gt=0)
    horizon: int = Field(10000, gt=0)


class RolloutCorrectionConfig(Section):
    """The engine's log-probs as the behaviour policy (mcore_rl.algos.rollout_correction; verl's
    algorithm.rollout_correction). The defaults correct nothing."""

    rollout_is: Literal["token", "sequence"] | None = Field(None, description="importance weights by token or sequence")
    # text first: lax float() would read the band 0.5_2 as 0.52 (mcore_rl.algos.rollout_correction parses text)
    rollout_is_threshold: str | float = Field(2.0, union_mode="left_to_right", description=(
        "a number: truncate (TIS); \"lower_upper\": zero outside (IcePop)"))
    rollout_is_batch_normalize: bool = Field(False, description="weights rescaled to mean 1 over the batch")
    rollout_rs: str | None = Field(None, description=(
        "rejection (masked IS), comma-separated, e.g. \"token_k1\" or \"seq_mean_k1\" (geometric mean ratio)"))
    rollout_rs_threshold: str | float | None = Field(None, union_mode="left_to_right",
                                                     description="k1: \"lower_upper\" ratios; k2/k3: an upper bound")


class FilterGroupsConfig(Section):
    """DAPO's dynamic sampling (verl's algorithm.filter_groups): groups whose `metric` is equal
    for all rollout.n samples are dropped and refilled from further prompts."""

    enable: bool = False
    metric: Literal["reward", "score"] = Field("reward", description="reward: the score plus reward shaping")
    max_num_gen_batches: int = Field(0, description="rounds of data.gen_batch_size prompts per step; <= 0: no limit")


class AlgorithmConfig(Section):
    adv_estimator: AdvEstimator = "grpo"
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: KLType = Field("k1", description="estimator used for the in-reward penalty")
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)


class PolicyLossConfig(Section):
    loss_mode: Literal["vanilla", "gspo", "cispo"] = Field("vanilla", description="algos.losses.POLICY_LOSS_MODES")


class ActorConfig(Section):
    lr: float = Field(1e-6, gt=0)
    lr_warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: float = Field(1.0, ge=0, description="global grad-norm clip; 0: none")
    clip_ratio_low: float = Field(0.2, ge=0, lt=1)
    clip_ratio_high: float = Field(0.2, ge=0)
    clip_ratio_c: float = Field(3.0, gt=1, description="dual-clip bound for negative advantages")
    loss_agg_mode: LossAggMode = "token-mean"
    loss_scale_factor: float | None = Field(None, gt=0, description=(
        "seq-mean-token-sum-norm's divisor; null: rollout.max_response_len"))
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    entropy_coeff: float = Field(0.0, ge=0, description="entropy bonus in the policy loss")
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.001, ge=0)
    kl_loss_type: KLType = "low_var_kl"
    ppo_epochs: int = Field(1, ge=1)
    ppo_mini_batch_size: int = Field(256, ge=1, description="prompts per optimizer step (times rollout.n samples)")
    micro_batch_size: int = Field(4, ge=1, description="samples per GPU per forward, when not use_dynamic_bsz")
    use_dynamic_bsz: bool = Field(False, description="pack micro-batches up to ppo_max_token_len_per_gpu tokens")
    ppo_max_token_len_per_gpu: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(16384, description=(
        "tokens per micro-batch with use_dynamic_bsz. auto: the memory plan picks the largest that fits, up to "
        "16384 (with memory.recompute: auto, under the cheapest recompute that fits at least 4096; "
        "16384 without a plan, on CPU); a set budget that cannot fit is refused, naming the largest that would"))
    tis_imp_ratio_cap: float | None = Field(None, gt=0, description=(
        "token-level TIS cap, verl's older key: algorithm.rollout_correction with rollout_is: token"))
    use_distributed_optimizer: bool = Field(True, description="shard fp32 main params and Adam moments over DP")
    router_bias_update_rate: float = Field(0.0, ge=0, description=(
        "aux-loss-free balancing (DeepSeek-V3): expert-bias step per update; 0 keeps routing as loaded"))
    routing_replay: bool = Field(False, description=(
        "R3, rollout routing replay: the policy's routers take the experts the engine routed each token to (old "
        "log-probs and update) and weigh them with their own live scores (docs/routing_replay.md)"))
    packed_attention: Literal["sdpa", "varlen"] | None = Field(None, description=(
        "varlen: one flash call per micro-batch (GPU); sdpa: a call per sequence (MLA's unequal q/v head widths keep "
        "it off its flash kernel); null: varlen on GPUs"))
    fused_logprobs: bool | None = Field(None, description=(
        "log-probs and entropies without fp32 [tokens, vocab] copies (mcore_rl.models.head); null: on with GPUs"))
    fused_adam: bool | None = Field(None, description="fused AdamW kernel, not torch's multi-tensor ops; null: on GPUs")
    overlap_grad_reduce: bool | None = Field(None, description=(
        "reduce-scatter grad buckets during the last micro-batch's backward; null: on with GPUs"))
    grad_bucket_size: int | None = Field(None, ge=1, description=(
        "elements per DDP grad bucket; null: megatron's (40 M, or 1 M x DP)"))


class CriticConfig(Section):
    enabled: bool = False
    hf_path: str | None = Field(None, description="defaults to model.hf_path")
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: float = Field(1.0, ge=0, description="global grad-norm clip; 0: none")
    cliprange_value: float = Field(0.5, gt=0)
    ppo_epochs: int = Field(1, ge=1)
    micro_batch_size: int = Field(4, ge=1, description="also the micro-batch of `values`")
    ppo_mini_batch_size: int | None = Field(None, ge=1, description=(
        "null: the actor's. Without a vocabulary-wide output the critic usually fits longer packs"))
    ppo_max_token_len_per_gpu: int | None = Field(None, ge=1, description="null: the actor's")


class DataConfig(Section):
    train_files: Annotated[list[str], OneOrMany] = Field(default_factory=list)
    val_files: Annotated[list[str], OneOrMany] = Field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = Field(512, ge=1)
    filter_overlong_prompts: bool = True
    truncation: Literal["error", "left", "right"] = "error"
    train_batch_size: int = Field(1024, ge=1, description="prompts per step")
    gen_batch_size: int | None = Field(None, ge=1, description=(
        "prompts per generation round of dynamic sampling; null: train_batch_size"))
    val_batch_size: int | None = Field(None, ge=1, description="null: the whole validation set at once")
    shuffle: bool = True
    task: str | None = Field(None, description="an embedded generated task (mcore_rl.data.tasks) instead of files")
    chat_template: str | None = Field(None, description=(
        "the chat template prompts are rendered with and multi-turn conversations continue in (an environment's "
        "message observations, mcore_rl/rollout/chat.py): qwen3, deepseek_v3 or glm4_5 (shipped with mcore_rl), a "
        "path to a Jinja file, or null: the tokenizer's own"))
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description=(
        "passed to every rendering of the chat template, e.g. enable_thinking: false (Qwen3, GLM-4.5)"))
    task_train_size: int = Field(4096, ge=1)
    task_val_size: int = Field(256, ge=1)


class OverlongBufferConfig(Section):
    """DAPO's soft overlong penalty (verl's reward_kwargs.overlong_buffer_cfg): a response longer
    than rollout.max_response_len - len loses up to penalty_factor of reward, linearly."""

    enable: bool = False
    len: int = Field(0, ge=0)
    penalty_factor: float = Field(1.0, ge=0)


class RewardConfig(Section):
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)


class TrainerConfig(Section):
    project: str = "mcore_rl"
    experiment: str = "default"
    output_dir: str = "outputs"
    total_epochs: int = Field(1, ge=1)
    total_training_steps: int | None = Field(None, ge=1, description="overrides epochs * steps per epoch")
    save_freq: int = Field(-1, ge=-1, description="steps; -1 or 0: never")
    save_last: bool = Field(True, description="the last step saves too, whatever save_freq says")
    save_optimizer: bool = Field(True, description=(
        "checkpoints hold the optimizer state too, which a resume needs; false: the model only (an eighth of the "
        "size with Adam's fp32 states), to export with `python -m mcore_rl.convert mcore-to-hf`; a run does not resume "
        "from such a checkpoint"))
    test_freq: int = Field(-1, ge=-1, description="validation every N steps (and at the last); -1 or 0: only the last")
    val_before_train: bool = True
    resume: Literal["auto", "disable"] = Field("auto", description="disable: refused where output_dir holds a run")
    max_checkpoints: int | None = Field(None, ge=1, description="keep the newest N complete checkpoints; null: all")
    async_save: bool = Field(False, description="checkpoint files written in the background during the next rollout")
    rollout_dump_dir: str | None = Field(None, description="each step's rollout to DIR/step_N.pt, for `--replay DIR`")
    mode: Literal["sync", "one_step_off", "fully_async"] = Field("sync", description=(
        "sync: each step waits for its own rollout. one_step_off: step k trains on the rollout of step k-1's weights "
        "while step k+1's is generated. fully_async: a rollout worker keeps the engines busy and hands finished groups "
        "to a buffer (mcore_rl/loop/async_sources.py). Both need engines of their own (cluster.colocate: false)"))
    sync_every: int = Field(1, ge=1, description="fully_async: weights go to the engines after every N updates")
    max_staleness: int = Field(1, ge=0, description=(
        "fully_async: a group with a token > N versions older than the trainer's weights is stale (stale_groups)"))
    stale_groups: Literal["regenerate", "drop"] = Field("regenerate", description=(
        "fully_async: regenerate: a stale group is generated again on the engines' weights; drop: left out of its "
        "step, which trains on the rest (dynamic sampling's refills make up the batch); a step left with no group "
        "regenerates"))
    partial_rollout_tokens: int = Field(0, ge=0, description=(
        "fully_async: responses are generated this many tokens at a time and resubmitted with their tokens so far, "
        "so a weight sync lands between the pieces (partial rollout); 0: whole responses"))
    decoupled_loss: bool = Field(True, description=(
        "off-policy modes: PPO's ratio against the trainer's (proximal) log-probs times the engine's (behaviour) ratio "
        "truncated at rollout_correction.rollout_is_threshold, unless a correction is set (decoupled PPO, as AReaL)"))
    logger: Annotated[list[Logger], OneOrMany] = Field(default_factory=lambda: ["console", "jsonl"])
    console: Literal["short", "full"] = Field("short", description=(
        "short: one line a step (step i/N, reward, validation reward, seconds, ETA); full: every metric"))
    seed: int = Field(1, ge=0)


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)


# ----------------------------------------------------------------------------- building
def _type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is Annotated:  # a bounded arm of a union (int >= 1 or 'auto')
        bounds = " ".join(filter(None, (_range(m) for m in args[1:] if hasattr(m, "metadata"))))
        return " ".join(filter(None, (_type_name(args[0]), bounds)))
    if origin is not None:
        return str(tp).replace("typing.", "")
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _range(field) -> str:
    """A field's bounds as the errors and the schema say them: '>= 1', 'in (0, 1]'."""
    b = {k: getattr(m, k) for m in field.metadata for k in ("ge", "gt", "le", "lt") if hasattr(m, k)}
    low = f"[{b['ge']}" if "ge" in b else f"({b['gt']}" if "gt" in b else ""
    high = f"{b['le']}]" if "le" in b else f"{b['lt']})" if "lt" in b else ""
    if low and high:
        return f"in {low}, {high}"
    return f">= {b['ge']}" if "ge" in b else f"> {b['gt']}" if "gt" in b else ""  # no field has an upper bound alone


def _locate(loc: tuple) -> tuple[str, Any, Any]:
    """The dotted key an error's loc names, its field (None for a list item) and its annotation;
    the tags pydantic adds for a union's arms are dropped."""
    path, field, tp = "", None, Config
    for part in loc:
        if isinstance(part, int):  # a list's item
            path, field, tp = f"{path}[{part}]", None, typing.get_args(tp)[0]
        elif _is_section(tp) and part in tp.model_fields:
            field = tp.model_fields[part]
            path, tp = f"{path}.{part}".lstrip("."), field.annotation
        else:
            break
    return path, field, tp


def _message(error: dict) -> str:
    """One of pydantic's errors as one line that names the key, what it takes, and what it got."""
    (path, field, tp), value = _locate(error["loc"]), error["input"]
    if error["type"] == "extra_forbidden":  # loc: the section's keys, then the unknown one
        prefix = f"{path}." if path else ""
        key = prefix + str(error["loc"][-1])
        return f"unknown key {key!r}" + suggest(key, [prefix + n for n in tp.model_fields])
    if error["type"].startswith(("greater_than", "less_than")) and not _range(field):  # a bounded union arm's
        return f"{path}: expected {_type_name(field.annotation)}, got {type(value).__name__} {value!r}"
    if error["type"].startswith(("greater_than", "less_than")):
        nullable = type(None) in typing.get_args(field.annotation)
        return f"{path} must be {_range(field)}{' or null' if nullable else ''}, got {value}"
    close = suggest(value, typing.get_args(tp)) if error["type"] == "literal_error" else ""
    return f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}{close}"


def config_from_dict(data: dict | None) -> Config:
    """Build a Config from a nested dict (missing keys take defaults); raises ConfigError."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"the config must be a mapping of sections, got {type(data).__name__}")
    try:
        return Config.model_validate(data or {})
    except ValidationError as e:
        # a union's arms each report the same value: one line per key
        raise ConfigError(list(dict.fromkeys(_message(err) for err in e.errors()))) from None


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
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                errors.append(f"override {item!r}: {'.'.join(parts[:i + 1])} is a value, not a section")
                break
        else:
            try:
                node[parts[-1]] = yaml_load(raw) if raw.strip() else ""
            except yaml.YAMLError as e:
                errors.append(f"override {item!r}: the value is not valid YAML "
                              f"({getattr(e, 'problem', None) or type(e).__name__})")
    if errors:
        raise ConfigError(errors)
    return data


def shipped_configs_dir() -> str:
    """The configs shipped with the package (configs/ of a checkout, package data when installed)."""
    import importlib.resources

    return str(importlib.resources.files("mcore_rl") / "configs")


def resolve_config_path(path: str) -> str:
    """A bare NAME.yaml that is not a file here names a shipped config (configs/NAME.yaml)."""
    if os.path.exists(path) or os.path.dirname(path):
        return path
    shipped = os.path.join(shipped_configs_dir(), path)
    if not os.path.isfile(shipped):
        names = sorted(n for n in os.listdir(shipped_configs_dir()) if n.endswith(".yaml"))
        raise ConfigError(f"{path}: no such file, nor a shipped config ({', '.join(names)})")
    return shipped


def load_config(path: str | None = None, overrides: list[str] | None = None, *,
                model_info: Callable[[ModelConfig], dict | None] | dict | None = None,
                available_gpus: int | None = None, validate: bool = True) -> Config:
    """Read YAML (optional), apply overrides, build and (by default) validate the config."""
    try:
        data = read_yaml_mapping(resolve_config_path(path)) if path else {}
    except BadInput as e:
        raise ConfigError(str(e)) from None
    cfg = config_from_dict(apply_overrides(data, overrides or []))
    if validate:
        config_checks.validate_config(cfg, model_info=model_info, available_gpus=available_gpus)
    return cfg


to_dict = Config.model_dump  # to_dict(cfg): the nested plain dict (YAML, the workers' config)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def schema() -> str:
    """Every key with its type, default and description, a table per section: docs/config.md."""
    out = ["# Config keys", "", "Generated by `python -m mcore_rl.config --schema > docs/config.md` "
           "(tests/unit/test_config.py checks they agree). Set any key in the YAML config or as a `key=value` override.", ""]
    sections = [(name, field.annotation) for name, field in Config.model_fields.items()]
    for key, section in sections:  # a nested section is appended as it is met, and comes in turn
        out += [f"## `{key}`", "", *([" ".join(section.__doc__.split()), ""] if section.__doc__ else []),
                "| key | type | default | description |", "|---|---|---|---|"]
        for name, field in section.model_fields.items():
            if _is_section(field.annotation):
                sections.append((f"{key}.{name}", field.annotation))
                continue
            kind = ", ".join(filter(None, (_type_name(field.annotation), _range(field))))
            default = json.dumps(field.get_default(call_default_factory=True))
            out.append(f"| `{key}.{name}` | {kind} | `{default}` | {field.description or ''} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m mcore_rl.config CONFIG.yaml [key=value ...] | --schema (every key: docs/config.md)")
        return 0 if argv else 2
    try:
        print(schema() if argv == ["--schema"] else to_yaml(load_config(argv[0], argv[1:])), end="")
    except BAD_INPUT as e:
        return report(e)
    return 0


__all__ = ["Config", "ConfigError", "apply_overrides", "config_from_dict", "load_config", "schema", "to_dict",
           "to_yaml"]

if __name__ == "__main__":  # as a script: the package's module, the one every other module's isinstance checks see
    import mcore_rl.config.sections

    sys.exit(mcore_rl.config.sections.main())
