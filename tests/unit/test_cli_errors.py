"""Bad input at every entry point (train, train --dry-run, plan, config, the converters and their
merge): one line on stderr naming the file or key and what is wrong, exit code 2, no traceback,
nothing written to the output directory. Issue 30's table, one row per case.

RULE: a new entry point, or a new check of an entry point's input, gets its rows in CASES (the
entry points it applies to, its arguments, the words its error line must hold). Where the run and
`--dry-run` share a check, the row lists both: a dry run refuses what the run would refuse.

The entry points run in-process (their `main(argv)`), so the whole table takes seconds; only the
GPU-placement row starts Ray, in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import NamedTuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")

RUN = ("train", "dry-run")  # the real run and --dry-run: the same checks
CONFIG = ("train", "dry-run", "config", "plan")  # refused by load_config itself


class Case(NamedTuple):
    name: str
    entries: tuple[str, ...]  # train, dry-run, config, plan, convert
    args: tuple[str, ...]  # "{d}" stands for the fixtures' directory
    says: str  # in the error line ("{d}" as in args)


SOURCE = "openai/gsm8k"  # the fixtures' rows: a data_source with a reward function
FAMILIES_ = ("deepseek_v3", "deepseek_v2", "qwen3_moe", "glm4_moe", "llama", "qwen2", "qwen3")
# a non-square tensor of each family's tiny model (a square one transposed keeps its shape)
WRONG_SHAPE = {"deepseek_v3": "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
               "deepseek_v2": "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
               "qwen3_moe": "model.layers.1.self_attn.o_proj.weight", "glm4_moe": "model.layers.1.self_attn.o_proj.weight",
               **dict.fromkeys(("llama", "qwen2", "qwen3"), "model.layers.1.mlp.down_proj.weight")}

LLAMA_66 = ("model.hf_config={model_type: llama, vocab_size: 16, hidden_size: 66, intermediate_size: 128, "
            "num_hidden_layers: 2, num_attention_heads: 4}")

CASES = [
    # config files
    Case("config missing", ("train", "dry-run", "config", "plan"), ("--config", "{d}/missing.yaml"),
         "{d}/missing.yaml: no such file"),
    Case("config not yaml", ("train", "config", "plan"), ("--config", "{d}/broken.yaml"), "not valid YAML at line"),
    Case("config a list", ("train", "config"), ("--config", "{d}/list.yaml"),
         "a YAML mapping (key: value lines) is needed, found a list"),
    Case("config a scalar", ("train",), ("--config", "{d}/scalar.yaml"), "is needed, found a str"),
    Case("config binary", ("train",), ("--config", "{d}/binary.yaml"), "not a YAML file (not UTF-8 text)"),
    Case("config a directory", ("train", "config"), ("--config", "{d}/a_dir.yaml"), "is a directory"),
    Case("config under a file", ("train",), ("--config", "{d}/afile/x.yaml"), "cannot be read (Not a directory)"),
    # data files
    Case("data missing", RUN, ("data.train_files={d}/missing.parquet",), "{d}/missing.parquet: no such file"),
    Case("val data missing", RUN, ("data.train_files={d}/good.parquet", "data.val_files={d}/none.parquet"),
         "{d}/none.parquet: no such file"),
    Case("data a directory", RUN, ("data.train_files={d}",), "{d}: is a directory, not a parquet file"),
    Case("data empty parquet", RUN, ("data.train_files={d}/empty.parquet",), "{d}/empty.parquet: no rows"),
    Case("data no columns", RUN, ("data.train_files={d}/nocols.parquet",),
         "{d}/nocols.parquet: missing column(s) ['data_source', 'prompt', 'reward_model']; has []"),
    Case("data wrong columns", RUN, ("data.train_files={d}/wrongcols.parquet",),
         "has ['question', 'answer'] (verl format"),
    Case("data prompt not messages", RUN, ("data.train_files={d}/intprompt.parquet",),
         "{d}/intprompt.parquet: row 0: 'prompt' must be a list of {role, content} messages"),
    Case("data content not a string", RUN, ("data.train_files={d}/intcontent.parquet",),
         "{d}/intcontent.parquet: row 1: 'prompt' must be a list of {role, content} messages with string content"),
    Case("data garbage", RUN, ("data.train_files={d}/garbage.parquet",),
         "{d}/garbage.parquet: not a parquet file: Parquet magic bytes not found"),
    Case("data 0 bytes", RUN, ("data.train_files={d}/zero.parquet",), "{d}/zero.parquet: not a parquet file"),
    Case("data jsonl", RUN, ("data.train_files={d}/rows.jsonl",),
         "{d}/rows.jsonl: not a parquet file: Parquet magic bytes not found in footer. Either the file is "
         "corrupted or this is not a parquet file. (data files are verl-format parquet"),
    Case("data all too long", RUN, ("data.train_files={d}/good.parquet", "data.max_prompt_length=2"),
         "{d}/good.parquet: no prompts left: all 1 are longer than data.max_prompt_length = 2 tokens"),
    Case("text outside the tiny vocabulary", RUN, ("data.train_files={d}/words.parquet",),
         "{d}/words.parquet: row 0: the tokenizer cannot encode the prompt: character 'o' is not in the alphabet "
         "'abcdefghijklm' (an embedded model with vocab_size < 259 uses the generated tasks' 16-id character "
         "tokenizer: set model.hf_config.vocab_size >= 259"),
    # the output directory
    Case("output_dir a file", RUN, ("trainer.output_dir={d}/afile",),
         "{d}/afile: trainer.output_dir is a file, not a directory"),
    Case("output_dir under a file", RUN, ("trainer.output_dir={d}/afile/run",),
         "{d}/afile/run: trainer.output_dir lies under {d}/afile, which is a file"),
    Case("resume from a model-only checkpoint", RUN, ("trainer.output_dir={d}/model_only_run",),
         "{d}/model_only_run/checkpoints/step_2: the newest checkpoint holds the model only"),
    Case("output_dir holds a run", RUN, ("trainer.output_dir={d}/old_run", "trainer.resume=disable"),
         "{d}/old_run: trainer.output_dir already holds a run"),
    # divisors set to 0: the >= 1 checks come before any division
    *[Case(f"{key}=0", CONFIG[:3], (f"{key}=0",), f"invalid config: {key} must be >= 1, got 0")
      for key in ("actor.micro_batch_size", "actor.ppo_mini_batch_size", "parallel.tp", "parallel.ep",
                  "rollout.tp_size", "cluster.n_gpus_per_node")],
    Case("placement_timeout_s=0", CONFIG[:3], ("cluster.placement_timeout_s=0",),
         "cluster.placement_timeout_s must be > 0"),
    Case("fp8 rollout, embedded engine", CONFIG[:3], ("rollout.weight_dtype=fp8", "rollout.engine=embedded"),
         "rollout.weight_dtype=fp8 needs rollout.engine=sglang, not embedded"),
    Case("DeepGEMM without fp8 rollout", CONFIG[:3], ("rollout.fp8_kernels=deep_gemm",),
         "rollout.fp8_kernels=deep_gemm needs rollout.weight_dtype=fp8"),
    Case("DeepGEMM on CPU", CONFIG[:3], ("rollout.weight_dtype=fp8", "rollout.fp8_kernels=deep_gemm_moe",
                                         "model.hf_config.moe_intermediate_size=128", "model.hf_config.q_lora_rank=128"),
         "rollout.fp8_kernels=deep_gemm_moe runs on GPUs (Hopper)"),
    # rollout.dp_attention: SGLang's, over an engine's TP ranks, for the MLA models whose layout under it is checked
    Case("dp attention at tp 1", CONFIG[:3], ("rollout.dp_attention=true",),
         "rollout.dp_attention needs rollout.tp_size > 1"),
    Case("dp attention, embedded", CONFIG[:3], ("rollout.dp_attention=true", "rollout.tp_size=2", "rollout.engine=embedded"),
         "rollout.dp_attention is SGLang's (enable_dp_attention); rollout.engine is embedded"),
    Case("dp attention, no MLA", CONFIG[:3], ("rollout.dp_attention=true", "rollout.tp_size=2",
                                             "model.hf_config.model_type=qwen3_moe", "model.hf_config.num_experts=4",
                                             "model.hf_config.num_key_value_heads=2"),
         "rollout.dp_attention is wired for MLA models (DeepSeek-V3 family), not qwen3_moe"),
    Case("tuned MoE tiles missing", CONFIG[:3], ("rollout.moe_config_dir={d}/no_tiles",),
         "rollout.moe_config_dir={d}/no_tiles holds no configs/ folder"),
    # multi-turn rollouts (mcore_rl.rollout.multiturn)
    Case("env not module:Class", CONFIG[:3], ("rollout.env=SecretLookupEnv",),
         "rollout.env: 'SecretLookupEnv' must be package.module:name"),
    Case("env module missing", RUN, ("rollout.env=no_such_pkg.envs:Env",),
         "rollout.env: cannot import 'no_such_pkg.envs' (ModuleNotFoundError"),
    Case("env class missing", RUN, ("rollout.env=mcore_rl.envs.lookup:NoSuchEnv",),
         "rollout.env: 'mcore_rl.envs.lookup' has no 'NoSuchEnv'"),
    Case("env not a class", RUN, ("rollout.env=mcore_rl.envs.lookup:LETTER_IDS",),
         "rollout.env: 'mcore_rl.envs.lookup:LETTER_IDS' is a tuple, not a class"),
    Case("generate_fn not async", RUN, ("rollout.generate_fn=mcore_rl.rollout.multiturn:is_multiturn",),
         "rollout.generate_fn: 'mcore_rl.rollout.multiturn:is_multiturn' is not an async function"),
    Case("turn longer than the response", CONFIG[:3], ("rollout.env=mcore_rl.envs.lookup:SecretLookupEnv",
                                                       "rollout.max_turn_tokens=9", "rollout.max_response_len=8"),
         "rollout.max_turn_tokens = 9 > rollout.max_response_len = 8"),
    # the model config against what the builder, converters and engines take
    Case("num_attention_heads 0", CONFIG, ("model.hf_config.num_attention_heads=0", "memory.gpu_memory_gb=80"),
         "invalid config: model.hf_config: num_attention_heads must be an integer >= 1, got 0"),
    Case("num_attention_heads 0, vLLM on CPU", CONFIG[:3], ("model.hf_config.num_attention_heads=0",
                                                          "rollout.engine=vllm"),
         "invalid config: model.hf_config: num_attention_heads must be an integer >= 1, got 0"),
    Case("async mode colocated", CONFIG, ("trainer.mode=one_step_off",),
         "trainer.mode 'one_step_off' overlaps rollout and training: it needs the engines on processes of their "
         "own (cluster.colocate: false"),
    Case("max_staleness below sync_every", CONFIG,
         ("trainer.mode=fully_async", "cluster.colocate=false", "cluster.n_gpus_per_node=3", "cluster.rollout_gpus=1",
          "trainer.sync_every=3", "trainer.max_staleness=1"),
         "trainer.max_staleness = 1 must be >= sync_every - 1 = 2"),
    Case("unsupported model_type", CONFIG, ("model.hf_config.model_type=gpt_neox", "memory.gpu_memory_gb=80"),
         "model.hf_config: unknown model_type 'gpt_neox': supported are deepseek_v3"),
    Case("unsupported model_type on disk", CONFIG,
         ("model.hf_config=null", "model.hf_path={d}/neox", "memory.gpu_memory_gb=80"),
         "{d}/neox/config.json: unknown model_type 'gpt_neox'"),
    Case("llama heads not dividing hidden", CONFIG, (LLAMA_66, "parallel.ep=1", "memory.gpu_memory_gb=80"),
         "model.hf_config: num_attention_heads = 4 does not divide hidden_size = 66"),
    Case("hidden_act not SwiGLU", CONFIG[:3], ("model.hf_config.hidden_act=gelu",),
         "model.hf_config: hidden_act 'gelu' is not supported"),
    Case("MLA base rank without a latent", CONFIG, (LLAMA_66.replace("66", "64"), "parallel.ep=1",
                                                    "model.mla_base_rank=16"),
         "model.mla_base_rank = 16: the model has no MLA latent (kv_lora_rank)"),
    Case("MLA base rank of a checkpoint", CONFIG[:3],
         ("model.hf_config=null", "model.hf_path={d}/deepseek_v3", "model.mla_base_rank=16"),
         "model.mla_base_rank scales a random model's init; model.hf_path's weights are a checkpoint's"),
    Case("config.json without a size", CONFIG[:3], ("model.hf_config=null", "model.hf_path={d}/no_vocab"),
         "{d}/no_vocab/config.json: lacks vocab_size"),
    # model and tokenizer directories: the run reads them; a dry run plans for a cluster that has them
    Case("model dir missing", ("train",), ("model.hf_config=null", "model.hf_path={d}/nope"),
         "{d}/nope: no such directory"),
    Case("model dir without config.json", ("train",), ("model.hf_config=null", "model.hf_path={d}/empty"),
         "{d}/empty: no config.json"),
    Case("model config.json not json", ("train",), ("model.hf_config=null", "model.hf_path={d}/badjson"),
         "{d}/badjson/config.json: not valid JSON"),
    Case("tokenizer dir missing", ("train",), ("model.tokenizer_path={d}/nope",),
         "{d}/nope: no such directory (model.tokenizer_path)"),
    Case("chat template neither shipped nor a file", RUN, ("data.chat_template=qwen4",),
         "data.chat_template: 'qwen4' is neither a template of mcore_rl (qwen3, deepseek_v3, glm4_5) nor a file"),
    Case("chat template with the embedded task", RUN, ("data.chat_template=qwen3",),
         "data.chat_template: applies to data.train_files' prompts"),
    Case("plan without the model's shapes", ("plan",),
         ("model.hf_config=null", "model.hf_path={d}/nope", "memory.gpu_memory_gb=80"), "needs the model's shapes"),
    Case("budget neither a count nor auto", CONFIG, ("actor.ppo_max_token_len_per_gpu=0",),
         "actor.ppo_max_token_len_per_gpu: expected int >= 1 or one of 'auto', got int 0"),
    Case("auto budget without dynamic batching", CONFIG, ("actor.ppo_max_token_len_per_gpu=auto",),
         "actor.ppo_max_token_len_per_gpu: auto picks a budget for actor.use_dynamic_bsz: true only"),
    # rollout.engine_kwargs: the keys read from the installed engine's own argument class (one subprocess each)
    Case("engine_kwargs key SGLang lacks", RUN, ("rollout.engine_kwargs.enable_mixd_chunk=true",),
         "rollout.engine_kwargs.enable_mixd_chunk: not an argument of SGLang's ServerArgs (engine 0.5.20) "
         "(did you mean 'enable_mixed_chunk'?)"),
    Case("engine_kwargs key vLLM lacks", RUN,
         ("rollout.engine=vllm", "model.hf_config.kv_lora_rank=512", "model.hf_config.qk_rope_head_dim=64",
          "rollout.engine_kwargs.gpu_memory_utilisation=0.5"),
         "rollout.engine_kwargs.gpu_memory_utilisation: not an argument of vLLM's EngineArgs"),
    Case("engine_kwargs for the embedded engine", CONFIG, ("rollout.engine=embedded", "rollout.engine_kwargs.tp_size=2"),
         "rollout.engine_kwargs (tp_size) are arguments of an SGLang or vLLM engine; rollout.engine 'embedded' takes none"),
    # converters and merge
    Case("hf dir missing", ("convert",), ("hf-to-mcore", "--hf", "{d}/nope"), "{d}/nope: no such directory"),
    Case("hf dir without config.json", ("convert",), ("hf-to-mcore", "--hf", "{d}/empty"), "no config.json"),
    Case("hf config.json a list", ("convert",), ("hf-to-mcore", "--hf", "{d}/listjson"),
         "{d}/listjson/config.json: a JSON object is needed, found a list"),
    *[Case(f"hf config.json without {key}", ("convert",), ("hf-to-mcore", "--hf", "{d}/no_" + key),
           "{d}/no_" + key + "/config.json: lacks " + key)
      for key in ("hidden_size", "kv_lora_rank", "vocab_size")],
    Case("hf config.json unsupported", ("convert",), ("hf-to-mcore", "--hf", "{d}/neox"),
         "{d}/neox/config.json: unknown model_type 'gpt_neox'"),
    Case("checkpoint missing", ("convert",), ("mcore-to-hf", "--ckpt", "{d}/nope"),
         "{d}/nope: no such checkpoint directory"),
    Case("export config.json incomplete", ("convert",),
         ("mcore-to-hf", "--ckpt", "{d}/empty", "--hf-config", "{d}/no_hidden_size"),
         "{d}/no_hidden_size/config.json: lacks hidden_size"),
    Case("truncated .distcp", ("convert",), ("mcore-to-hf", "--ckpt", "{d}/truncated_ckpt"),
         "{d}/truncated_ckpt/__0_0.distcp: truncated:"),
    Case("missing .distcp", ("convert",), ("mcore-to-hf", "--ckpt", "{d}/shardless_ckpt"),
         "{d}/shardless_ckpt/__0_0.distcp: missing (the checkpoint's .metadata lists it)"),
    Case("merge dir missing", ("convert",), ("merge", "--backend", "megatron", "--local-dir", "{d}/nope"),
         "not a directory"),
    Case("merge manifest not json", ("convert",), ("merge", "--backend", "fsdp", "--manifest", "{d}/manifest.json"),
         "{d}/manifest.json: not valid JSON"),
    Case("merge manifest missing", ("convert",), ("merge", "--backend", "fsdp", "--manifest", "{d}/absent.json"),
         "{d}/absent.json: no such file"),
    # second sweep (issue 50): values out of range, inputs of the newer features
    Case("val_batch_size -1", CONFIG[:3], ("data.val_batch_size=-1",),
         "invalid config: data.val_batch_size must be >= 1 or null, got -1"),
    Case("overlong penalty negative", CONFIG[:3], ("reward.overlong_buffer.penalty_factor=-1",),
         "invalid config: reward.overlong_buffer.penalty_factor must be >= 0, got -1"),
    Case("override value not YAML", CONFIG[:3], ("actor.lr=[1,",),
         "invalid config: override 'actor.lr=[1,': the value is not valid YAML"),
    Case("output_dir empty", CONFIG[:3], ("trainer.output_dir=",),
         "invalid config: trainer.output_dir is empty: name the directory"),
    Case("fp8 rollout on a CPU engine", CONFIG[:3], ("rollout.weight_dtype=fp8",),
         "rollout.weight_dtype=fp8 needs cluster.device gpu: SGLang's CPU engine does not start with block-FP8"),
    Case("shipped config by name, data not made", ("dry-run",), ("--config", "moonlight_16b.yaml"),
         "data/gsm8k/train.parquet: no such file (make it with: python scripts/preprocess_gsm8k.py "
         "--output_dir data/gsm8k)"),
    Case("config name neither a file nor shipped", ("train", "config"), ("--config", "moonlight_99b.yaml"),
         "moonlight_99b.yaml: no such file, nor a shipped config (deepseek_v3_671b.yaml, "),
    Case("data row without a reward function", RUN, ("data.train_files={d}/unrewarded.parquet",),
         "{d}/unrewarded.parquet: row 1: no reward function for data_source 'nobody/knows'"),
    Case("rollout_dump_dir a file", RUN, ("trainer.rollout_dump_dir={d}/afile",),
         "{d}/afile: trainer.rollout_dump_dir is a file, not a directory"),
    Case("replay dir missing", RUN, ("--replay", "{d}/nope"), "{d}/nope: no such directory (--replay takes"),
    Case("replay dir without dumps", RUN, ("--replay", "{d}/empty"), "{d}/empty: no rollout dumps (step_N.pt)"),
    Case("replay dump truncated", RUN, ("--replay", "{d}/dump_truncated"),
         "{d}/dump_truncated/step_1.pt: truncated or not a torch file"),
    Case("replay pickle not a dump", RUN, ("--replay", "{d}/dump_pickle"),
         "{d}/dump_pickle/step_1.pt: not a rollout dump (it holds objects other than tensors"),
    Case("replay torch file not a dump", RUN, ("--replay", "{d}/dump_dict"),
         "{d}/dump_dict/step_1.pt: not a rollout dump (lacks ['batch', 'index', 'reward', 'score'])"),
    Case("replay dump of another model", RUN, ("--replay", "{d}/dump_qwen3_moe"),
         "{d}/dump_qwen3_moe/step_1.pt: dumped by another model than this run's: "),
    Case("replay dump beyond the vocabulary", RUN, ("--replay", "{d}/dump_vocab"),
         "{d}/dump_vocab/step_1.pt: token id 200 is outside the model's vocabulary of 16"),
    Case("resume with another hidden_size", RUN, ("trainer.output_dir={d}/tiny_run", "model.hf_config.hidden_size=96"),
         "{d}/tiny_run: the model differs from the one this run directory holds ({d}/tiny_run/init_hf/config.json): "
         "hidden_size (64 -> 96); keep the old model settings to resume it, or start afresh in a new "
         "trainer.output_dir"),
    Case("resume with other experts", RUN, ("trainer.output_dir={d}/tiny_run", "model.hf_config.n_routed_experts=8"),
         "n_routed_experts (4 -> 8)"),
    Case("hf safetensors index not json", ("convert",), ("hf-to-mcore", "--hf", "{d}/bad_index"),
         "{d}/bad_index/model.safetensors.index.json: not valid JSON"),
    Case("hf safetensors index without a weight map", ("convert",), ("hf-to-mcore", "--hf", "{d}/index_no_map"),
         "{d}/index_no_map/model.safetensors.index.json: no \"weight_map\" of tensor name -> shard file"),
    *[Case(f"hf {fam} tensor transposed", ("convert",), ("hf-to-mcore", "--hf", "{d}/transposed_" + fam),
           "{d}/transposed_" + fam + ": tensor " + WRONG_SHAPE[fam] + " has shape [") for fam in FAMILIES_],
    # a run from an HF checkpoint checks it whole from its headers before it starts (each rank reads its shard later)
    Case("train from an hf checkpoint with a tensor transposed", ("train",),
         ("model.hf_config=null", "model.hf_path={d}/transposed_deepseek_v3"),
         "{d}/transposed_deepseek_v3: tensor " + WRONG_SHAPE["deepseek_v3"] + " has shape ["),
    Case("hf tensor reshaped, same elements", ("convert",), ("hf-to-mcore", "--hf", "{d}/reshaped_llama"),
         "{d}/reshaped_llama: tensor " + WRONG_SHAPE["llama"] + " has shape [32, 256], config.json implies [64, 128]"),
    Case("hf tensor of integers", ("convert",), ("hf-to-mcore", "--hf", "{d}/integer_llama"),
         "{d}/integer_llama: tensor " + WRONG_SHAPE["llama"] + " has dtype I32 (not a floating dtype)"),
    Case("qwen3_moe config.json without its head_dim", ("convert",), ("hf-to-mcore", "--hf", "{d}/qwen3_moe_no_head_dim"),
         "{d}/qwen3_moe_no_head_dim: tensor model.layers.0.self_attn.q_proj.weight has shape [128, 64], config.json "
         "implies [64, 64]"),
]


def _write_fixtures(d) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mcore_rl.data.rows import make_row, write_rows
    from tests.support.tiny_models import FAMILIES

    (d / "broken.yaml").write_text("model: {dtype: fp32\nparallel: [1\n")
    (d / "list.yaml").write_text("- a\n- b\n")
    (d / "scalar.yaml").write_text("just some words\n")
    (d / "binary.yaml").write_bytes(b"\xff\xfe\x00\x81")
    (d / "a_dir.yaml").mkdir()
    (d / "afile").write_text("x")
    write_rows(str(d / "good.parquet"), [make_row(SOURCE, "abc", "a")])
    write_rows(str(d / "words.parquet"), [make_row(SOURCE, "hello world", "a")])
    row = {k: v for k, v in make_row(SOURCE, "abc", "a").items() if k != "extra_info"}
    pq.write_table(pa.Table.from_pylist([row]).slice(0, 0), d / "empty.parquet")
    pq.write_table(pa.table({}), d / "nocols.parquet")
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), d / "wrongcols.parquet")
    pq.write_table(pa.table({"data_source": [SOURCE], "prompt": [5], "reward_model": [{"ground_truth": "a"}]}),
                   d / "intprompt.parquet")
    rows = [make_row(SOURCE, "abc", "a"), {**row, "prompt": [{"role": "user", "content": None}]}]
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in r.items() if k != "extra_info"} for r in rows]),
                   d / "intcontent.parquet")
    (d / "garbage.parquet").write_bytes(b"not parquet at all" * 10)
    (d / "zero.parquet").write_bytes(b"")
    (d / "rows.jsonl").write_text(json.dumps(make_row(SOURCE, "abc", "a")) + "\n")
    (d / "old_run").mkdir()
    (d / "old_run" / "metrics.jsonl").write_text('{"step": 1}\n')
    step = d / "model_only_run" / "checkpoints" / "step_2"  # complete, but saved with save_optimizer=false
    (step / "model").mkdir(parents=True)
    (step / "model" / "metadata.json").write_text("{}")
    (step / "trainer_state.json").write_text('{"step": 2}')
    (step / "manifest.json").write_text(json.dumps({"step": 2, "files": {"model/metadata.json": 2,
                                                                         "trainer_state.json": 11}}))
    (d / "empty").mkdir()
    (d / "badjson").mkdir()
    (d / "badjson" / "config.json").write_text("{not json")
    (d / "listjson").mkdir()
    (d / "listjson" / "config.json").write_text("[1, 2]")
    (d / "manifest.json").write_text("{\"ranks\": ")

    def hf_dir(name: str, family: str, **change):
        cfg = {"model_type": family, **FAMILIES[family][1], **change}
        (d / name).mkdir()
        (d / name / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))

    write_rows(str(d / "unrewarded.parquet"), [make_row(SOURCE, "abc", "a"), make_row("nobody/knows", "abc", "a")])
    _dump_fixtures(d)
    _run_dir_fixture(d)
    hf_dir("neox", "llama", model_type="gpt_neox")
    for key, family in (("hidden_size", "llama"), ("kv_lora_rank", "deepseek_v3"), ("vocab_size", "qwen2")):
        hf_dir(f"no_{key}", family, **{key: None})
    hf_dir("no_vocab", "qwen2", vocab_size=None)
    hf_dir("deepseek_v3", "deepseek_v3")


def _dump_fixtures(d) -> None:
    """--replay directories: a truncated dump, a pickle of other objects, a torch file of other keys,
    a dump by another model (Qwen3-MoE) and one whose tokens lie beyond the tiny vocabulary."""
    import datetime

    import torch

    from mcore_rl.loop.rollout_dump import dump_rollout
    from tests.support.tiny_models import FAMILIES

    batch = {"tokens": torch.tensor([[1, 2, 3]]), "response_mask": torch.ones(1, 1)}
    score = torch.zeros(1)
    dump_rollout(str(d / "dump_qwen3_moe"), 1, batch, [0], score, score, {"model_type": "qwen3_moe",
                                                                           **FAMILIES["qwen3_moe"][1]})
    dump_rollout(str(d / "dump_vocab"), 1, {**batch, "tokens": torch.tensor([[1, 200]])}, [0], score, score)
    dump_rollout(str(d / "dump_truncated"), 1, batch, [0], score, score)
    path = d / "dump_truncated" / "step_1.pt"
    os.truncate(path, path.stat().st_size // 2)
    for name, obj in (("dump_pickle", {"batch": datetime.date(2026, 1, 1)}), ("dump_dict", {"weights": score})):
        (d / name).mkdir()
        torch.save(obj, d / name / "step_1.pt")


def _run_dir_fixture(d) -> None:
    """An output directory as a run of the tiny config leaves it before its first checkpoint: its
    initial model, written by transformers from the config's hf_config."""
    import transformers

    from mcore_rl.config.sections import load_config

    transformers.AutoConfig.for_model(**load_config(TINY).model.hf_config).save_pretrained(d / "tiny_run" / "init_hf")


def _bad_hf_checkpoints(d) -> None:
    """An HF checkpoint per family with one tensor transposed; a llama one with it reshaped (the same
    number of elements), one with it in integers; a Qwen3-MoE config.json without its head_dim; two
    malformed safetensors indexes."""
    import torch
    from safetensors.torch import load_file, save_file

    from tests.support.tiny_models import make_hf_model

    def variant(name: str, family: str, change) -> None:
        make_hf_model(family, str(d / name))
        f = str(d / name / "model.safetensors")
        tensors = load_file(f)
        tensors[WRONG_SHAPE[family]] = change(tensors[WRONG_SHAPE[family]]).contiguous()
        save_file(tensors, f, metadata={"format": "pt"})

    for fam in FAMILIES_:
        variant("transposed_" + fam, fam, lambda t: t.t())
    variant("reshaped_llama", "llama", lambda t: t.reshape(t.shape[0] // 2, t.shape[1] * 2))
    variant("integer_llama", "llama", lambda t: t.to(torch.int32))
    make_hf_model("qwen3_moe", str(d / "qwen3_moe_no_head_dim"))
    cfg = json.loads((d / "qwen3_moe_no_head_dim" / "config.json").read_text())
    del cfg["head_dim"]  # 32 in its tensors; hidden_size / num_attention_heads = 16
    (d / "qwen3_moe_no_head_dim" / "config.json").write_text(json.dumps(cfg))
    for name, index in (("bad_index", "{\"weight_map\": "), ("index_no_map", "{\"metadata\": {}}")):
        make_hf_model("llama", str(d / name))
        (d / name / "model.safetensors.index.json").write_text(index)


def _broken_checkpoints(d) -> None:
    """Real torch_dist checkpoints of a tiny Llama: one with its data file cut in half, one without it."""
    import shutil

    from mcore_rl.convert.hf_mcore import hf_to_mcore
    from tests.support.tiny_models import make_hf_model

    make_hf_model("llama", str(d / "llama_hf"))
    hf_to_mcore(str(d / "llama_hf"), str(d / "llama_ckpt"))
    shutil.copytree(d / "llama_ckpt", d / "truncated_ckpt")
    shutil.copytree(d / "llama_ckpt", d / "shardless_ckpt")
    os.remove(d / "shardless_ckpt" / "__0_0.distcp")
    shard = d / "truncated_ckpt" / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_input")
    _write_fixtures(d)
    return d


def _run(entry: str, args: list[str], out: str) -> int:
    from mcore_rl import train
    from mcore_rl.config import sections as config
    from mcore_rl.memory import plan

    if entry == "convert":
        from mcore_rl.convert.cli import main

        flag = "--target-dir" if args[0] == "merge" else "--out"
        return main([*args, flag, out])
    if args[:1] != ["--config"]:
        args = ["--config", TINY, *args]
    if entry == "config":
        return config.main([args[1], *args[2:]])
    if entry == "plan":
        return plan.main(args)
    has_out = any(a.startswith("trainer.output_dir=") for a in args)
    return train.main([*args, *([] if has_out else [f"trainer.output_dir={out}"]),
                       *(["--dry-run"] if entry == "dry-run" else [])])


def _listing(path: str):
    return sorted(os.listdir(path)) if os.path.isdir(path) else os.path.exists(path)


@pytest.mark.parametrize("entry,case", [(e, c) for c in CASES for e in c.entries],
                         ids=[f"{e}: {c.name}" for c in CASES for e in c.entries])
def test_bad_input_is_one_line_and_exit_2(entry, case, fixtures, capsys, monkeypatch):
    if ".distcp" in case.name and not (fixtures / "truncated_ckpt").exists():
        _broken_checkpoints(fixtures)
    if any(w in case.name for w in ("tensor", "index", "head_dim")) and not (fixtures / "bad_index").exists():
        _bad_hf_checkpoints(fixtures)
    monkeypatch.setenv("MCORE_RL_NO_PROGRESS", "1")
    monkeypatch.chdir(fixtures)  # relative paths (a shipped config's data/) resolve away from the checkout
    d, out = str(fixtures), str(fixtures / "out")
    args = [a.replace("{d}", d) for a in case.args]
    named = [a.split("=", 1)[1] for a in args if a.startswith("trainer.output_dir=")]
    watched = {p: _listing(p) for p in [out, *named]}
    capsys.readouterr()
    assert _run(entry, args, out) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "error: " in lines[0] and case.says.replace("{d}", d) in lines[0], lines[0]
    for p, before in watched.items():
        assert _listing(p) == before, f"{p} written"
    assert not [p for p in os.listdir(d) if ".tmp" in p]


def test_unreadable_permissions(tmp_path, capsys):
    from mcore_rl import train

    if os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    p = tmp_path / "secret.yaml"
    p.write_text("model: {}\n")
    p.chmod(0)
    assert train.main(["--config", str(p)]) == 2
    assert "cannot be read (Permission denied)" in capsys.readouterr().err


def test_unread_hf_config_keys_are_named_in_a_warning(tmp_path, capsys):
    """An HF-config key nothing reads is not dropped without a word; the run goes on."""
    from mcore_rl import train

    assert train.main(["--config", TINY, "--dry-run", f"trainer.output_dir={tmp_path / 'out'}",
                       "model.hf_config.attn_logit_softcapping=30"]) == 0
    err = capsys.readouterr().err
    assert "warning: model.hf_config: key(s) attn_logit_softcapping are not read by mcore_rl" in err, err
    assert not (tmp_path / "out").exists()


def test_unread_checkpoint_tensors_are_named_in_a_warning(fixtures, tmp_path, caplog):
    """A checkpoint tensor no mapping rule reads is named, not dropped without a word."""
    import pickle
    import shutil

    from mcore_rl.convert.hf_mcore import mcore_to_hf

    if not (fixtures / "llama_ckpt").exists():
        _broken_checkpoints(fixtures)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(fixtures / "llama_ckpt", ckpt)
    meta = pickle.loads((ckpt / ".metadata").read_bytes())
    some = next(iter(meta.state_dict_metadata.values()))
    meta.state_dict_metadata["decoder.layers.0.mystery.weight"] = some
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    mcore_to_hf(str(ckpt), str(tmp_path / "hf"))
    assert "1 checkpoint tensor(s) with no mapping rule are not exported: decoder.layers.0.mystery.weight" \
        in caplog.text


def test_shipped_configs_raise_no_model_warning():
    """The checks refuse what the model builder cannot take, and nothing the shipped configs say."""
    import glob

    from mcore_rl.config.sections import load_config
    from mcore_rl.models.checks import hf_config_problems, unread_keys

    for path in glob.glob(os.path.join(ROOT, "configs", "*.yaml")):
        hf = load_config(path).model.hf_config
        if hf is not None:
            assert hf_config_problems(hf, complete=False) == [] and unread_keys(hf) == [], path


def _user_run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, RAY_SCHEDULER_EVENTS="0", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "mcore_rl.train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_python_m_train_missing_config_exit_code():
    """As a user sees it: `python -m mcore_rl.train --config configs/missing.yaml`."""
    r = _user_run("--config", "configs/missing.yaml")
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: ") and r.stderr.strip().endswith("configs/missing.yaml: no such file")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_gpu_config_without_gpus_stops_at_the_placement_deadline(tmp_path):
    """A GPU config on a machine without its GPUs: Ray would wait for them forever. Past
    cluster.placement_timeout_s the run stops naming what it asked for and what the cluster has,
    before anything is written."""
    out = tmp_path / "run"
    r = _user_run("--config", TINY, "cluster.device=gpu", "memory.gpu_memory_gb=80", "rollout.engine=embedded",
                  "cluster.placement_timeout_s=2", f"trainer.output_dir={out}", timeout=90)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(errors) == 1 and r.stderr.strip().endswith(errors[0]), r.stderr
    assert ("cluster.placement_timeout_s = 2 s passed and Ray could not place the 2 trainer rank(s): asked for "
            "2 bundle(s) of CPU 1, GPU 1 (PACK); the cluster has CPU 2 in all") in errors[0]
    assert not out.exists()


# ---- issue 50's cases beside the table: exit codes other than 2, warnings, locks, installs ----------
def test_dry_run_exits_as_the_run_would_when_the_memory_plan_is_refused(tmp_path, capsys):
    """`--dry-run` of a plan that cannot fit exits 1, as the run and `python -m mcore_rl.memory.plan` do."""
    from mcore_rl import train
    from mcore_rl.memory import plan

    args = ["--config", os.path.join(ROOT, "configs", "tiny_gpu.yaml"), "memory.gpu_memory_gb=4",
            f"trainer.output_dir={tmp_path / 'out'}"]
    assert plan.main(args) == 1
    assert train.main([*args, "--dry-run"]) == 1
    assert "memory plan REFUSED" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_options_inert_in_the_chosen_mode_are_named_once(tmp_path, capsys):
    from mcore_rl import train

    assert train.main(["--config", TINY, "--dry-run", f"trainer.output_dir={tmp_path / 'out'}",
                       "trainer.max_staleness=3", "trainer.sync_every=2",
                       "reward.overlong_buffer.penalty_factor=0.5"]) == 0
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert warnings == [
        "warning: trainer.sync_every is set but acts only with trainer.mode fully_async; it is ignored here",
        "warning: trainer.max_staleness is set but acts only with trainer.mode fully_async; it is ignored here",
        "warning: reward.overlong_buffer.penalty_factor is set but acts only with reward.overlong_buffer.enable; it "
        "is ignored here"], warnings


def test_shipped_configs_warn_of_no_inert_option():
    import glob

    from mcore_rl.config.sections import load_config
    from mcore_rl.config.checks import inert_options

    for path in glob.glob(os.path.join(ROOT, "configs", "*.yaml")):
        assert inert_options(load_config(path, validate=False)) == [], path


def test_a_second_run_is_refused_naming_the_first_runs_pid_and_a_dead_runs_lock_is_taken_over(tmp_path, capsys):
    """The lock file of trainer.output_dir: a live holder (here this process, holding it as a run
    does) refuses the run and its dry run in one line naming its pid; a lock file whose run died
    (its flock gone with it) is taken over with a warning naming that pid."""
    from mcore_rl import train
    from mcore_rl.preflight.run_dir import LOCK, RunLock

    out = tmp_path / "run"
    out.mkdir()
    args = ["--config", TINY, f"trainer.output_dir={out}", "rollout.engine=embedded"]
    with RunLock(str(out)):
        for extra in ([], ["--dry-run"]):
            capsys.readouterr()
            assert train.main([*args, *extra]) == 2
            err = capsys.readouterr().err.strip()
            assert err == (f"error: {out}: another run (pid {os.getpid()}) is using this trainer.output_dir; wait "
                           "for it to end, stop it, or choose another trainer.output_dir"), err
        assert sorted(os.listdir(out)) == [LOCK]  # nothing written
    assert not (out / LOCK).exists()  # released
    (out / LOCK).write_text("4194303\n")  # a run killed with its lock file left (pid beyond pid_max)
    with RunLock(str(out)):
        assert (out / LOCK).read_text().strip() == str(os.getpid())
    assert (f"warning: {out / LOCK}: run pid 4194303 ended without releasing it; taking it over"
            in capsys.readouterr().err)


@pytest.fixture
def read_only():
    """make(path): the directory read-only for this process (chmod; as root, a read-only bind mount)."""
    mounted = []

    def make(path: str) -> None:
        if os.geteuid() != 0:
            os.chmod(path, 0o555)
            return
        for cmd in (["mount", "--bind", path, path], ["mount", "-o", "remount,ro,bind", path]):
            if subprocess.run(cmd, capture_output=True).returncode != 0:
                pytest.skip("root without mount: no way to make a directory read-only here")
            if cmd[1] == "--bind":
                mounted.append(path)

    yield make
    for path in mounted:
        subprocess.run(["umount", path], check=True)


def test_a_read_only_checkpoint_directory_is_refused_before_the_run_starts(tmp_path, capsys, read_only):
    from mcore_rl import train

    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    read_only(str(out / "checkpoints"))
    for extra in ([], ["--dry-run"]):
        capsys.readouterr()
        assert train.main(["--config", TINY, f"trainer.output_dir={out}", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"error: {out / 'checkpoints'}: the run's checkpoint directory is not writable (read-only); "
                       "make it writable or choose another trainer.output_dir"), err
    assert sorted(os.listdir(out)) == ["checkpoints"]


def test_a_shipped_config_resolves_by_name_when_installed(tmp_path):
    """`--config NAME.yaml` finds the shipped configs in an installed package (a wheel built from
    this checkout, unpacked away from it), not only in a checkout."""
    import zipfile

    src, site = tmp_path / "src", tmp_path / "site"
    files = subprocess.run(["git", "ls-files", "pyproject.toml", "README.md", "mcore_rl", "configs"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        dst = src / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if os.path.islink(os.path.join(ROOT, rel)):
            os.symlink(os.readlink(os.path.join(ROOT, rel)), dst)
        else:
            dst.write_bytes(open(os.path.join(ROOT, rel), "rb").read())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").iterdir()
    zipfile.ZipFile(wheel).extractall(site)
    r = subprocess.run([sys.executable, "-m", "mcore_rl.config", "moonlight_16b.yaml"], cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(site)), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "model_type: deepseek_v3" in r.stdout and "n_routed_experts: 64" in r.stdout  # Moonlight's
