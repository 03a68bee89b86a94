"""Config: YAML + overrides, typed building with suggestions, cross checks, YAML round trip."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from mcore_rl.config.sections import Config, ConfigError, apply_overrides, config_from_dict, load_config, to_yaml
from mcore_rl.config.checks import validate_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "grpo_tiny_task_cpu.yaml")
MOE = dict(model_type="deepseek_v3", num_attention_heads=16, num_hidden_layers=4, n_routed_experts=64,
           kv_lora_rank=16)


def errors_of(overrides, path=TINY, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, **kwargs)
    return str(info.value)


def gpu_overrides(n_gpus=8, **extra):
    base = {"cluster.device": "gpu", "cluster.n_gpus_per_node": n_gpus, "rollout.engine": "sglang",
            "actor.ppo_mini_batch_size": 16, "data.train_batch_size": 32}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def test_shipped_tiny_config_is_valid_and_resolves_derived_values():
    cfg = load_config(TINY)
    assert isinstance(cfg, Config)
    assert cfg.data.task == "copy_last" and cfg.actor.lr == 1e-3
    assert cfg.rollout.max_prompt_len == cfg.data.max_prompt_length == 8  # filled from data


def test_overrides_parse_yaml_values_and_coerce_types():
    cfg = load_config(TINY, ["actor.lr=1e-6", "trainer.logger=[console,tensorboard]", "rollout.n=4",
                             "data.train_files=/d/train.parquet", "+trainer.seed=7",
                             "model.hf_config.num_hidden_layers=3", "actor.tis_imp_ratio_cap=2"])
    assert cfg.actor.lr == 1e-6 and isinstance(cfg.actor.lr, float)  # YAML 1.1 reads 1e-6 as a string
    assert cfg.trainer.logger == ["console", "tensorboard"]
    assert cfg.rollout.n == 4 and cfg.trainer.seed == 7
    assert cfg.data.train_files == ["/d/train.parquet"]  # a single path becomes a list
    assert cfg.model.hf_config["num_hidden_layers"] == 3 and cfg.model.hf_config["vocab_size"] == 16
    assert cfg.actor.tis_imp_ratio_cap == 2.0


def test_unknown_keys_and_bad_types_are_all_reported_with_suggestions():
    msg = errors_of(["actor.clip_ratio_hgih=0.3", "actr.lr=1", "actor.ppo_epochs=two",
                     "actor.loss_agg_mode=token_mean", "trainer.logger=[console,tensorbord]",
                     "rollout.enable_memory_saver=maybe"])
    assert "unknown key 'actor.clip_ratio_hgih' (did you mean 'actor.clip_ratio_high'?)" in msg
    assert "unknown key 'actr' (did you mean 'actor'?)" in msg
    assert "actor.ppo_epochs: expected int, got str 'two'" in msg
    assert "(did you mean 'token-mean'?)" in msg
    assert "trainer.logger[1]" in msg and "(did you mean 'tensorboard'?)" in msg
    assert "rollout.enable_memory_saver: expected bool" in msg


def test_malformed_overrides_and_sections():
    assert "not of the form key=value" in errors_of(["actor.lr"])
    assert "actor.lr is a value, not a section" in errors_of(["actor.lr.x=1"])
    with pytest.raises(ConfigError, match="actor: expected ActorConfig"):
        config_from_dict({"actor": 3})
    with pytest.raises(ConfigError, match="model.hf_config: expected"):
        config_from_dict({"model": {"hf_config": [1, 2]}})


def test_gpu_count_and_parallel_layout_checks():
    assert load_config(TINY, gpu_overrides(8, **{"parallel.tp": 2, "parallel.pp": 2}), available_gpus=8)
    msg = errors_of(gpu_overrides(8), available_gpus=16)
    assert "nnodes * n_gpus_per_node = 1 * 8 = 8, but 16 GPUs are available" in msg
    assert "tp * pp = 3 * 1 = 3 must divide the actor's world size 8" in errors_of(
        gpu_overrides(8, **{"parallel.tp": 3}))
    # not colocated: the actor gets what the rollout does not
    assert "world size 6" in errors_of(gpu_overrides(8, **{"cluster.colocate": False,
                                                            "cluster.rollout_gpus": 2, "parallel.tp": 4}))
    assert "rollout_gpus must be in [1, 7]" in errors_of(gpu_overrides(8, **{"cluster.colocate": False}))
    assert "rollout.tp_size = 3 must divide" in errors_of(gpu_overrides(8, **{"rollout.tp_size": 3}))
    # SGLang runs on CPU too now; what is refused is a layout the rollout cannot take
    assert "rollout.engine 'embedded' samples on the trainer's own shards" in errors_of(gpu_overrides(
        8, **{"rollout.engine": "embedded", "cluster.colocate": False, "cluster.rollout_gpus": 2}))
    assert "sync_transport 'ipc' needs cluster.colocate: true" in errors_of(gpu_overrides(
        8, **{"rollout.sync_transport": "ipc", "cluster.colocate": False, "cluster.rollout_gpus": 2}))
    assert "spans nodes: it must be a multiple" in errors_of(gpu_overrides(
        8, **{"cluster.nnodes": 2, "cluster.n_gpus_per_node": 4, "rollout.tp_size": 6}))
    assert "must split evenly over data-parallel size" in errors_of(
        gpu_overrides(8, **{"actor.ppo_mini_batch_size": 1, "data.train_batch_size": 1, "rollout.n": 2}))


def test_model_dimension_checks_from_dict_callable_or_hf_path(tmp_path):
    moe = gpu_overrides(8, **{"parallel.tp": 8, "parallel.ep": 3, "parallel.pp": 1})
    msg = errors_of(moe, model_info=dict(MOE, num_attention_heads=12))
    assert "parallel.tp = 8 must divide the model's num_attention_heads = 12" in msg
    assert "parallel.ep = 3 must divide the model's 64 routed experts" in msg
    assert "sequence_parallel must be true" in msg
    # ep = 1 with tp > 1: experts must be split over TP too, or their grads miss token slices
    msg = errors_of(gpu_overrides(8, **{"parallel.tp": 2, "parallel.sequence_parallel": True}), model_info=MOE)
    assert "parallel.etp = 1 with ep = 1 and tp = 2: set etp = 2" in msg
    assert load_config(TINY, gpu_overrides(8, **{"parallel.tp": 2, "parallel.etp": 2, "parallel.sequence_parallel":
                                                 True}), available_gpus=8, model_info=MOE)
    seen = []
    msg = errors_of(gpu_overrides(8, **{"parallel.pp": 8}),
                    model_info=lambda m: seen.append(m.hf_config["model_type"]) or MOE)
    assert seen == ["qwen3"] and "parallel.pp = 8 exceeds the model's num_hidden_layers = 4" in msg
    # from hf_path/config.json; kv heads checked for GQA models
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "vocab_size": 32,
                                                      "intermediate_size": 128, "num_attention_heads": 8,
                                                      "num_key_value_heads": 2, "num_hidden_layers": 2}))
    msg = errors_of(gpu_overrides(8, **{"parallel.tp": 4, "model.hf_config": "null",
                                        "model.hf_path": str(tmp_path)}))
    assert "num_key_value_heads = 2" in msg and "num_attention_heads" not in msg
    assert "model.hf_config disagrees with" in errors_of([f"model.hf_path={tmp_path}"])
    assert "set model.hf_path" in errors_of(["model.hf_config=null"])


def test_algorithm_and_batch_checks():
    assert "rollout.n must be >= 2" in errors_of(["rollout.n=1"])
    assert "needs critic.enabled" in errors_of(["algorithm.adv_estimator=gae"])
    assert load_config(TINY, ["algorithm.adv_estimator=gae", "critic.enabled=true"])
    assert "must divide data.train_batch_size" in errors_of(["actor.ppo_mini_batch_size=12"])
    assert "below one full sequence" in errors_of(["actor.use_dynamic_bsz=true",
                                                   "actor.ppo_max_token_len_per_gpu=10"])
    assert "critic.ppo_mini_batch_size = 12 must divide" in errors_of(["critic.enabled=true",
                                                                       "critic.ppo_mini_batch_size=12"])
    assert "critic.ppo_max_token_len_per_gpu = 10 is below" in errors_of(["actor.use_dynamic_bsz=true",
                                                                          "critic.ppo_max_token_len_per_gpu=10"])
    assert "critic.micro_batch_size = 3 must divide" in errors_of(["critic.enabled=true", "critic.micro_batch_size=3"])
    assert "clip_ratio_c must be > 1" in errors_of(["actor.clip_ratio_c=1.0"])
    assert "did you mean 'copy_last'" in errors_of(["data.task=copy_lst"])
    assert "set data.train_files or data.task" in errors_of(["data.task=null"])
    assert "differs from data.max_prompt_length" in errors_of(["rollout.max_prompt_len=99"])


def test_yaml_dump_round_trips(tmp_path):
    cfg = load_config(TINY, ["actor.lr=3e-6", "trainer.logger=[jsonl]"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(str(path)) == cfg
    assert yaml.safe_load(to_yaml(cfg))["actor"]["lr"] == 3e-6


def test_defaults_need_only_a_model_and_data():
    cfg = config_from_dict(apply_overrides({}, ["model.hf_path=/m", "data.train_files=[a.parquet]"]))
    assert validate_config(cfg).trainer.logger == ["console", "jsonl"]


def test_cli_prints_resolved_yaml_or_errors():
    ok = subprocess.run([sys.executable, "-m", "mcore_rl.config", TINY, "rollout.n=4"], capture_output=True,
                        text=True, cwd=ROOT)
    assert ok.returncode == 0 and yaml.safe_load(ok.stdout)["rollout"]["n"] == 4
    bad = subprocess.run([sys.executable, "-m", "mcore_rl.config", TINY, "rollout.m=4"], capture_output=True,
                         text=True, cwd=ROOT)
    assert bad.returncode == 2 and "did you mean 'rollout.n'" in bad.stderr


def test_vllm_engine_refuses_what_its_cpu_kernels_cannot_run():
    tiny = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
    msg = errors_of(["rollout.engine=vllm", "rollout.ep_size=2", "rollout.tp_size=2"], path=tiny)
    assert "need kv_lora_rank 512 and qk_rope_head_dim 64, the model has 16 and 8" in msg
    assert "add model.hf_config.kv_lora_rank=512 model.hf_config.qk_rope_head_dim=64" in msg
    assert "expert parallelism is SGLang's" in msg
    assert "moe_intermediate_size / rollout.tp_size = 16" in msg
    assert load_config(tiny, ["rollout.engine=vllm", "model.hf_config.kv_lora_rank=512",
                              "model.hf_config.qk_rope_head_dim=64"])
    dense = dict(model_type="qwen2", hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    assert "no kernel for head size 16" in errors_of(["rollout.engine=vllm"], path=tiny, model_info=dense)


def test_rollout_correction_and_dapo_settings_checked_up_front():
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny_cpu.yaml", [
            "algorithm.rollout_correction.rollout_rs=seq_mean_k1,token_k2",
            "algorithm.rollout_correction.rollout_rs_threshold=0.9_1.1,0.5_1", "actor.tis_imp_ratio_cap=2",
            "algorithm.rollout_correction.rollout_is=sequence", "reward.overlong_buffer.enable=true"])
    text = str(e.value)
    assert "rollout_rs_threshold of token_k2 takes an upper bound only" in text
    assert "actor.tis_imp_ratio_cap and algorithm.rollout_correction.rollout_is both set" in text
    assert "reward.overlong_buffer.len must be in [1, rollout.max_response_len = 2], got 0" in text
    with pytest.raises(ConfigError, match="actor.policy_loss.loss_mode: expected one of 'vanilla', 'gspo', 'cispo'"):
        load_config("configs/tiny_cpu.yaml", ["actor.policy_loss.loss_mode=gpg"])
    # the defaults leave the loop as it was: no correction, PPO-clip, no shaping, no filter
    cfg = load_config("configs/tiny_cpu.yaml")
    assert cfg.algorithm.rollout_correction.rollout_is is None and cfg.algorithm.rollout_correction.rollout_rs is None
    assert cfg.actor.policy_loss.loss_mode == "vanilla" and not cfg.reward.overlong_buffer.enable
    assert not cfg.algorithm.filter_groups.enable and cfg.trainer.rollout_dump_dir is None


def test_fp8_rollout_turns_token_tis_on_and_says_so():
    from mcore_rl.loop.step_batch import correction_line, correction_settings

    tiny = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
    assert "rollout.weight_dtype=fp8 needs cluster.device gpu: SGLang's CPU engine does not start" in errors_of(
        ["rollout.weight_dtype=fp8"], path=tiny)
    gpu = ["cluster.device=gpu"]  # the tiny model planned for GPUs: the FP8 checks below run there
    # SGLang's FP8 layers need whole 128-row blocks per fused part: the tiny model's 32-wide experts
    # and q_lora_rank are not, so the engine keeps those layers in the model's dtype (test_fp8.py)
    assert load_config(tiny, [*gpu, "rollout.weight_dtype=fp8"]).rollout.weight_dtype == "fp8"
    blocks = ["model.hf_config.moe_intermediate_size=128", "model.hf_config.q_lora_rank=128"]
    bf16, fp8 = load_config(tiny), load_config(tiny, [*gpu, "rollout.weight_dtype=fp8", *blocks])
    assert correction_settings(bf16)["rollout_is"] is None and correction_line(bf16) is None
    assert correction_settings(fp8)["rollout_is"] == "token" and correction_settings(fp8)["rollout_is_threshold"] == 2.0
    assert "rollout correction {'rollout_is': 'token', 'rollout_is_threshold': 2.0}" in correction_line(fp8)
    chosen = load_config(tiny, [*gpu, "rollout.weight_dtype=fp8", *blocks,
                                "algorithm.rollout_correction.rollout_rs=token_k1",
                                "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"])
    assert correction_settings(chosen)["rollout_is"] is None  # a configured correction is kept as it is
    capped = load_config(tiny, [*gpu, "rollout.weight_dtype=fp8", *blocks, "actor.tis_imp_ratio_cap=3"])
    assert correction_settings(capped)["rollout_is_threshold"] == 3
    dense = dict(model_type="qwen2", hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    assert "rollout.weight_dtype=fp8 is wired for DeepSeek-V3-style models, not qwen2" in errors_of(
        [*gpu, "rollout.weight_dtype=fp8"], path=tiny, model_info=dense)
    # Moonlight at engine TP=8: its two shared experts are 2816 rows, 352 per rank, kept in bf16
    moonlight = os.path.join(ROOT, "configs", "moonlight_16b.yaml")
    assert load_config(moonlight, [*gpu, "rollout.weight_dtype=fp8", "rollout.tp_size=8",
                                   "rollout.ep_size=8"]).rollout.tp_size == 8


def test_routing_replay_is_refused_where_no_routes_come_back():
    tiny = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
    assert load_config(tiny, ["actor.routing_replay=true"]).actor.routing_replay
    for overrides, line in (
            (["rollout.engine=vllm"], "the vLLM engine adapter returns no routed experts; use rollout.engine=sglang"),
            (["rollout.engine=embedded"], "the embedded engine routes with the trainer's own routers"),
            (["rollout.return_routed_experts=false"], "needs rollout.return_routed_experts: true"),
            (["model.hf_config.n_routed_experts=0", "parallel.ep=1"], "the model has no routed experts")):
        assert line in errors_of(["actor.routing_replay=true", *overrides], tiny)


def test_sglang_refuses_qwen3_moe_dense_layers():
    """SGLang's Qwen3MoeForCausalLM builds every layer sparse: a checkpoint with dense layers is
    refused before anything starts (the embedded engine samples it)."""
    tiny = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
    qwen = ["model.hf_config.model_type=qwen3_moe", "model.hf_config.num_experts=4"]
    msg = errors_of([*qwen, "model.hf_config.mlp_only_layers=[0]"], path=tiny)
    assert "SGLang's Qwen3MoeForCausalLM makes every layer sparse" in msg and "mlp_only_layers=[0]" in msg
    assert load_config(tiny, qwen) and load_config(tiny, [*qwen, "model.hf_config.mlp_only_layers=[0]",
                                                          "rollout.engine=embedded"])


def test_schema_lists_every_key_and_is_docs_config_md():
    """`python -m mcore_rl.config --schema` names every key with its type and default, and
    docs/config.md is its output (regenerate it with that command), so the docs cannot drift."""
    from mcore_rl.config.sections import Section, schema

    text = schema()
    with open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8") as f:
        assert f.read() == text, "docs/config.md is stale: python -m mcore_rl.config --schema > docs/config.md"

    def rows(section, prefix):
        for name, field in section.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, Section):
                yield from rows(field.annotation, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}", json.dumps(field.get_default(call_default_factory=True))

    keys = list(rows(Config, ""))
    assert len(keys) > 100 and ("actor.lr", "1e-06") in keys and ("trainer.logger", '["console", "jsonl"]') in keys
    for key, default in keys:
        assert f"| `{key}` | " in text and f" | `{default}` | " in text.split(f"| `{key}` | ")[1].split("\n")[0], key
    assert "| `actor.micro_batch_size` | int, >= 1 | `4` | samples per GPU per forward" in text
    assert "| `rollout.top_p` | float, in (0, 1] | `1.0` |" in text
    cli = subprocess.run([sys.executable, "-m", "mcore_rl.config", "--schema"], capture_output=True, text=True, cwd=ROOT)
    assert cli.returncode == 0 and cli.stdout == text


def test_a_band_without_dots_is_a_band_not_a_number(tmp_path):
    """YAML 1.1 and float() both read 0.5_2 as 0.52; verl's "lower_upper" threshold means [0.5, 2],
    in an override and in a YAML file alike."""
    from mcore_rl.algos.rollout_correction import Bounds, parse_is_threshold

    path = tmp_path / "band.yaml"
    path.write_text("algorithm:\n  rollout_correction:\n    rollout_is: token\n    rollout_is_threshold: 0.5_2\n")
    from_file = load_config(str(path), validate=False)
    from_override = load_config(None, ["algorithm.rollout_correction.rollout_is_threshold=0.5_2"], validate=False)
    for cfg in (from_file, from_override):
        assert parse_is_threshold(cfg.algorithm.rollout_correction.rollout_is_threshold) == Bounds(2.0, 0.5)
    assert load_config(None, ["algorithm.rollout_correction.rollout_is_threshold=3"], validate=False) \
        .algorithm.rollout_correction.rollout_is_threshold == 3.0


def test_direct_sync_load_is_refused_where_sglang_derives_state_or_no_ipc_runs():
    from tests.support.sync_checks import BROADCAST, QWEN3_MOE_TINY

    tiny = os.path.join(ROOT, "configs", "tiny_cpu.yaml")  # SGLang colocated: ipc
    qwen3 = ["rollout.sync_load=direct", *QWEN3_MOE_TINY]
    assert load_config(tiny, qwen3).rollout.sync_load == "direct"
    for overrides, line in (
            (["rollout.sync_load=direct"], "rollout.sync_load=direct is checked against SGLang's loader for qwen3_moe, "
                                           "glm4_moe, qwen2 (tests/e2e/test_sglang_sync.py), not deepseek_v3 (MLA: "
                                           "SGLang derives absorbed weights after loading); use sync_load: sglang"),
            ([*qwen3, *BROADCAST], "rollout.sync_load=direct needs SGLang over the ipc transport (colocated), "
                                   "not sglang over broadcast"),
            ([*qwen3, "rollout.engine=vllm"], "rollout.sync_load=direct needs SGLang over the ipc transport "
                                              "(colocated), not vllm over ipc")):
        assert line in errors_of(overrides, path=tiny)
