"""Bad input at every entry point (train, plan, config, converters and their merge): one line on
stderr naming the path, exit code 2, no traceback, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")


@pytest.fixture
def bad_files(tmp_path):
    """name -> (path, what the error line must say about it)."""
    (tmp_path / "broken.yaml").write_text("model: {dtype: fp32\nparallel: [1\n")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "scalar.yaml").write_text("just some words\n")
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00\x81")
    (tmp_path / "a_dir.yaml").mkdir()
    (tmp_path / "file").write_text("x")
    return {
        "missing": (tmp_path / "missing.yaml", "no such file"),
        "not yaml": (tmp_path / "broken.yaml", "not valid YAML at line"),
        "list": (tmp_path / "list.yaml", "a YAML mapping (key: value lines) is needed, found a list"),
        "scalar": (tmp_path / "scalar.yaml", "is needed, found a str"),
        "binary": (tmp_path / "binary.yaml", "not a YAML file (not UTF-8 text)"),
        "directory": (tmp_path / "a_dir.yaml", "is a directory"),
        "unreadable": (tmp_path / "file" / "x.yaml", "cannot be read (Not a directory)"),
    }


def _one_clean_line(err: str, path) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and str(path) in lines[0], err
    return lines[0]


def _check(main, argv, capsys, path, says, written=()):
    assert main(argv) == 2
    line = _one_clean_line(capsys.readouterr().err, path)
    assert says in line, line
    for p in written:
        assert not os.path.exists(p), f"{p} written"


def test_train_plan_and_config_refuse_bad_config_files(bad_files, tmp_path, capsys):
    from mcore_rl import config, plan, train

    out = tmp_path / "run"
    for path, says in bad_files.values():
        _check(train.main, ["--config", str(path), f"trainer.output_dir={out}"], capsys, path, says, [out])
        _check(plan.main, ["--config", str(path)], capsys, path, says)
        _check(config.main, [str(path)], capsys, path, says)


def test_unreadable_permissions(tmp_path, capsys):
    from mcore_rl import train

    if os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    p = tmp_path / "secret.yaml"
    p.write_text("model: {}\n")
    p.chmod(0)
    _check(train.main, ["--config", str(p)], capsys, p, "cannot be read (Permission denied)")


def test_train_refuses_a_missing_model_directory_before_writing(tmp_path, capsys):
    from mcore_rl import train

    out = tmp_path / "run"
    common = ["--config", TINY, f"trainer.output_dir={out}", "model.hf_config=null"]
    _check(train.main, common + [f"model.hf_path={tmp_path / 'nope'}"], capsys, tmp_path / "nope",
           "no such directory", [out])
    (tmp_path / "empty").mkdir()
    _check(train.main, common + [f"model.hf_path={tmp_path / 'empty'}"], capsys, tmp_path / "empty",
           "no config.json", [out])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    _check(train.main, common + [f"model.hf_path={tmp_path / 'bad'}"], capsys,
           tmp_path / "bad" / "config.json", "not valid JSON", [out])


def test_plan_names_the_model_directory_it_cannot_read(tmp_path, capsys):
    from mcore_rl import plan

    _check(plan.main, ["--config", TINY, "model.hf_config=null", f"model.hf_path={tmp_path / 'nope'}",
                       "memory.gpu_memory_gb=80"], capsys, tmp_path / "nope", "needs the model's shapes")


def test_converters_refuse_bad_model_and_checkpoint_paths(tmp_path, capsys):
    from converters.cli import main

    out = tmp_path / "out"
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("[1, 2]")
    (tmp_path / "manifest.json").write_text("{\"ranks\": ")
    cases = [
        (["hf-to-mcore", "--hf", str(tmp_path / "nope")], tmp_path / "nope", "no such directory"),
        (["hf-to-mcore", "--hf", str(tmp_path / "empty")], tmp_path / "empty", "no config.json"),
        (["hf-to-mcore", "--hf", str(tmp_path / "bad")], tmp_path / "bad" / "config.json",
         "a JSON object is needed, found a list"),
        (["mcore-to-hf", "--ckpt", str(tmp_path / "nope")], tmp_path / "nope", "no such checkpoint directory"),
        (["mcore-to-hf", "--ckpt", str(tmp_path / "empty"), "--hf-config", str(tmp_path / "bad")],
         tmp_path / "bad" / "config.json", "a JSON object is needed"),
        (["merge", "--backend", "megatron", "--local-dir", str(tmp_path / "nope")], tmp_path / "nope",
         "not a directory"),
        (["merge", "--backend", "fsdp", "--manifest", str(tmp_path / "manifest.json")],
         tmp_path / "manifest.json", "not valid JSON"),
        (["merge", "--backend", "fsdp", "--manifest", str(tmp_path / "absent.json")],
         tmp_path / "absent.json", "no such file"),
    ]
    for argv, path, says in cases:
        flag = "--target-dir" if argv[0] == "merge" else "--out"
        _check(main, argv + [flag, str(out)], capsys, path, says, [out])
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []


def test_python_m_train_missing_config_exit_code(tmp_path):
    """As a user sees it: `python -m mcore_rl.train --config configs/missing.yaml`."""
    r = subprocess.run([sys.executable, "-m", "mcore_rl.train", "--config", "configs/missing.yaml"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert _one_clean_line(r.stderr, "configs/missing.yaml").endswith("configs/missing.yaml: no such file")
