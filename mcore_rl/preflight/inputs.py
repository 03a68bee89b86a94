"""Every input of a run, checked once, up front, before anything is written. The run and
`--dry-run` both call `check_inputs`, so a dry run refuses whatever the run would refuse.

load_config has checked the keys, types, layout and the model's HF config (mcore_rl.config.sections,
mcore_rl.models.checks); this adds what needs the file system: the output directory, the model and
tokenizer directories, the data files (read, checked and tokenized once: the run uses them), and a
named warning for HF-config keys nothing reads. Each failure is a BadInput: one line naming the
file or key, exit code 2.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass

from mcore_rl.config import sections as C
from mcore_rl.config import checks as config_checks
from mcore_rl.preflight.bad_input import BadInput
from mcore_rl.models.checks import unread_keys_warning
from mcore_rl.rollout import engine_kwargs
from mcore_rl.preflight.run_dir import check_resumable, check_same_model, check_unlocked


@dataclass
class Inputs:
    """The prompt sources the run samples from; None where a dry run cannot tokenize here (the
    model's tokenizer lives on the cluster), its data files then checked without tokenizing."""

    train: object | None
    val: object | None


def check_inputs(cfg: C.Config, *, dry_run: bool = False, replay: str | None = None, console=None) -> Inputs:
    """replay: the directory of dumped rollouts the run trains on (it reads no prompts); console: the
    run's StartConsole, which shows the check of an HF checkpoint as a start-up phase (seconds: it
    builds megatron's model on the meta device)."""
    check_output_dir(cfg.trainer)
    check_same_model(os.path.abspath(cfg.trainer.output_dir), config_checks.hf_model_dims(cfg.model))
    if cfg.trainer.resume == "auto":
        check_resumable(os.path.abspath(cfg.trainer.output_dir))
    if cfg.trainer.rollout_dump_dir:
        check_dir_to_write(cfg.trainer.rollout_dump_dir, "trainer.rollout_dump_dir")
    if replay:
        from mcore_rl.loop.rollout_dump import check_replay

        check_replay(replay, config_checks.hf_model_dims(cfg.model))
    _check_multiturn_code(cfg)
    tokenizer_here = _check_model_files(cfg, dry_run, console)
    _warn_unread_hf_keys(cfg.model)
    engine_kwargs.check_known(cfg.rollout.engine, cfg.rollout.engine_kwargs, cfg.cluster.device)
    for line in config_checks.inert_options(cfg):
        print(line, file=sys.stderr, flush=True)
    return Inputs(None, None) if replay else _prompt_sources(cfg, tokenize=tokenizer_here)


def _check_multiturn_code(cfg: C.Config) -> None:
    """rollout.env is an importable class and rollout.generate_fn an importable async function."""
    import inspect

    from mcore_rl.rollout.multiturn import load_object

    r = cfg.rollout
    try:
        if r.env and not inspect.isclass(env := load_object(r.env, "rollout.env")):
            raise ValueError(f"rollout.env: {r.env!r} is a {type(env).__name__}, not a class")
        if r.generate_fn and not inspect.iscoroutinefunction(fn := load_object(r.generate_fn, "rollout.generate_fn")):
            raise ValueError(f"rollout.generate_fn: {r.generate_fn!r} is not an async function ({type(fn).__name__})")
    except ValueError as e:
        raise BadInput(str(e)) from None
    _check_chat_template(cfg.data)


def _check_chat_template(d: C.DataConfig) -> None:
    """data.chat_template names a template of mcore_rl or a file, for prompts a transformers tokenizer renders."""
    if d.chat_template is None:
        return
    from mcore_rl.rollout.chat import template_text

    template_text(d.chat_template)
    if not d.train_files:
        raise BadInput("data.chat_template: applies to data.train_files' prompts, rendered by the model's tokenizer; "
                       "the embedded data.task has a character tokenizer of its own")


def check_dir_to_write(where: str, key: str) -> str:
    """`where` is a directory or can be made one, and can be written; returns its absolute path."""
    path = os.path.abspath(where)
    if os.path.exists(path) and not os.path.isdir(path):
        raise BadInput(f"{where}: {key} is a file, not a directory")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise BadInput(f"{where}: {key} lies under {parent}, which is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BadInput(f"{where}: {key} cannot be written ({parent} is not writable)")
    return path


def check_output_dir(t: C.TrainerConfig) -> None:
    """trainer.output_dir is a directory or can be made one, no other run is using it, its
    checkpoints can be written, and it does not hold a run it may not resume."""
    path = check_dir_to_write(t.output_dir, "trainer.output_dir")
    if not os.path.isdir(path):
        return
    check_unlocked(path)
    ckpts = os.path.join(path, "checkpoints")
    if os.path.isdir(ckpts) and not os.access(ckpts, os.W_OK | os.X_OK):
        raise BadInput(f"{ckpts}: the run's checkpoint directory is not writable (read-only); make it writable "
                       "or choose another trainer.output_dir")
    if t.resume == "disable":
        from mcore_rl.checkpoint import steps as run_ckpt

        if run_ckpt.steps(ckpts) or os.path.exists(os.path.join(path, "metrics.jsonl")):
            raise run_ckpt.CheckpointError(f"{path}: trainer.output_dir already holds a run; resume it "
                                           "(trainer.resume=auto) or choose a new trainer.output_dir")


def _check_model_files(cfg: C.Config, dry_run: bool, console=None) -> bool:
    """The run reads the model and tokenizer directories, which must be here; a dry run plans for
    the cluster it names, where they may live. Returns whether the tokenizer can be loaded here."""
    m = cfg.model
    tokenizer = m.tokenizer_path or m.hf_path
    if not dry_run:
        config_checks.require_model_dirs(cfg)
        from mcore_rl.convert.hf_mcore import checked_hf_checkpoint

        for path in config_checks.initial_weights(cfg).values():
            with console.phase(f"checking {path} against the model's shapes") if console else contextlib.nullcontext():
                checked_hf_checkpoint(path)  # every tensor there, of its shape, from the headers: before anything starts
        if m.tokenizer_path and not os.path.isdir(m.tokenizer_path):
            kind = "not a directory" if os.path.exists(m.tokenizer_path) else "no such directory"
            raise BadInput(f"{m.tokenizer_path}: {kind} (model.tokenizer_path)")
    return tokenizer is None or os.path.isdir(tokenizer)


def _warn_unread_hf_keys(m: C.ModelConfig) -> None:
    """An HF-config key nothing reads is not dropped without a word (the embedded config, else
    hf_path's config.json)."""
    hf = config_checks.hf_model_dims(m)
    if hf is None:
        return
    where = "model.hf_config" if m.hf_config is not None else os.path.join(m.hf_path, "config.json")
    line = unread_keys_warning(hf, where)
    if line:
        print(line, file=sys.stderr, flush=True)


def _prompt_sources(cfg: C.Config, tokenize: bool) -> Inputs:
    from mcore_rl.data.prompts import load_prompt_sources
    from mcore_rl.data.rows import check_row, read_file_rows
    from mcore_rl.data.rewards import require_reward

    d = cfg.data
    if tokenize or not d.train_files:
        return Inputs(*load_prompt_sources(cfg))
    for path in [*d.train_files, *d.val_files]:  # a dry run without the tokenizer: the rows only
        for i, row in enumerate(read_file_rows(path, d.prompt_key)):
            check_row(row, f"{path}: row {i}", d.prompt_key)
            require_reward(row["data_source"], f"{path}: row {i}")
    return Inputs(None, None)
