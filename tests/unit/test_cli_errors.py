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
    Case("tuned MoE tiles missing", CONFIG[:3], ("rollout.moe_config_dir={d}/no_tiles",),
         "rollout.moe_config_dir={d}/no_tiles holds no configs/ folder"),
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
    Case("plan without the model's shapes", ("plan",),
         ("model.hf_config=null", "model.hf_path={d}/nope", "memory.gpu_memory_gb=80"), "needs the model's shapes"),
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
    write_rows(str(d / "good.parquet"), [make_row("x", "abc", "a")])
    write_rows(str(d / "words.parquet"), [make_row("x", "hello world", "a")])
    row = {k: v for k, v in make_row("x", "abc", "a").items() if k != "extra_info"}
    pq.write_table(pa.Table.from_pylist([row]).slice(0, 0), d / "empty.parquet")
    pq.write_table(pa.table({}), d / "nocols.parquet")
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), d / "wrongcols.parquet")
    pq.write_table(pa.table({"data_source": ["x"], "prompt": [5], "reward_model": [{"ground_truth": "a"}]}),
                   d / "intprompt.parquet")
    rows = [make_row("x", "abc", "a"), {**row, "prompt": [{"role": "user", "content": None}]}]
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in r.items() if k != "extra_info"} for r in rows]),
                   d / "intcontent.parquet")
    (d / "garbage.parquet").write_bytes(b"not parquet at all" * 10)
    (d / "zero.parquet").write_bytes(b"")
    (d / "rows.jsonl").write_text(json.dumps(make_row("x", "abc", "a")) + "\n")
    (d / "old_run").mkdir()
    (d / "old_run" / "metrics.jsonl").write_text('{"step": 1}\n')
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

    hf_dir("neox", "llama", model_type="gpt_neox")
    for key, family in (("hidden_size", "llama"), ("kv_lora_rank", "deepseek_v3"), ("vocab_size", "qwen2")):
        hf_dir(f"no_{key}", family, **{key: None})
    hf_dir("no_vocab", "qwen2", vocab_size=None)


def _broken_checkpoints(d) -> None:
    """Real torch_dist checkpoints of a tiny Llama: one with its data file cut in half, one without it."""
    import shutil

    from converters.convert import hf_to_mcore
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
    from mcore_rl import config, plan, train

    if entry == "convert":
        from converters.cli import main

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
    monkeypatch.setenv("MCORE_RL_NO_PROGRESS", "1")
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

    from converters.convert import mcore_to_hf

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

    from mcore_rl.config import load_config
    from mcore_rl.model_checks import hf_config_problems, unread_keys

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
