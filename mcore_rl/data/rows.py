"""verl-compatible RL prompt rows and their parquet files.

A row is a dict:
    data_source   str            selects the reward function (rewards.compute_score)
    prompt        list[{role, content}]  chat messages
    ability       str            e.g. "math"
    reward_model  {style: "rule", ground_truth: str}
    extra_info    dict           free-form (split, index, original answer, ...)
"""

from __future__ import annotations

import os
from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from mcore_rl.preflight.bad_input import BadInput

REQUIRED = ("data_source", "prompt", "reward_model")


def make_row(data_source: str, prompt: str | list[dict], ground_truth, *, ability: str = "",
             style: str = "rule", extra_info: dict | None = None) -> dict:
    """A row; a plain-string prompt becomes one user message."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return {"data_source": data_source, "prompt": messages, "ability": ability,
            "reward_model": {"style": style, "ground_truth": ground_truth}, "extra_info": extra_info or {}}


def _columns(prompt_key: str) -> tuple[str, ...]:
    return (*REQUIRED[:1], prompt_key, *REQUIRED[2:])


def check_row(row: dict, where: str = "row", prompt_key: str = "prompt") -> None:
    missing = [k for k in _columns(prompt_key) if k not in row]
    if missing:
        raise BadInput(f"{where}: missing column(s) {missing}; has {sorted(row)}")
    messages = row[prompt_key]
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise BadInput(f"{where}: {prompt_key!r} must be a list of {{role, content}} messages with string "
                       f"content, got {messages!r:.200}")
    if not isinstance(row["reward_model"], dict) or "ground_truth" not in row["reward_model"]:
        raise BadInput(f"{where}: reward_model must be a dict with a ground_truth")


def write_rows(path: str, rows: Iterable[dict]) -> int:
    """Write rows to a parquet file (directories created); returns the number written."""
    rows = list(rows)
    for i, row in enumerate(rows):
        check_row(row, f"row {i}")
    if not any(row.get("extra_info") for row in rows):  # parquet cannot store a struct with no fields
        rows = [{k: v for k, v in row.items() if k != "extra_info"} for row in rows]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return len(rows)


def read_rows(paths: str | Iterable[str], prompt_key: str = "prompt") -> list[dict]:
    """Read and concatenate parquet files of rows, in order."""
    rows: list[dict] = []
    for path in [paths] if isinstance(paths, str) else paths:
        rows.extend(read_file_rows(path, prompt_key))
    return rows


# the script that writes the data files of the shipped configs, by the folder they go to
MAKERS = {"gsm8k": "scripts/preprocess_gsm8k.py", "math": "scripts/preprocess_math.py"}


def _maker_hint(path: str) -> str:
    folder = os.path.dirname(path)
    script = MAKERS.get(os.path.basename(folder))
    return f" (make it with: python {script} --output_dir {folder})" if script else ""


def read_file_rows(path: str, prompt_key: str = "prompt") -> list[dict]:
    """The rows of one parquet file; a file that is missing, not parquet, empty or lacks a verl
    column is refused with one line naming it (rows themselves are checked by check_row)."""
    if os.path.isdir(path):
        raise BadInput(f"{path}: is a directory, not a parquet file")
    if not os.path.exists(path):
        raise BadInput(f"{path}: no such file{_maker_hint(path)}")
    try:
        table = pq.read_table(path)
    except OSError as e:
        raise BadInput(f"{path}: cannot be read ({e.strerror or e})") from None
    except (pa.ArrowException, ValueError) as e:
        hint = " (data files are verl-format parquet; convert JSON records to it first)" \
            if path.endswith((".json", ".jsonl")) else ""
        first = (str(e).splitlines() or [type(e).__name__])[0].split("': ", 1)[-1]  # drop arrow's path echo
        raise BadInput(f"{path}: not a parquet file: {first}{hint}") from None
    missing = [k for k in _columns(prompt_key) if k not in table.column_names]
    if missing:
        raise BadInput(f"{path}: missing column(s) {missing}; has {table.column_names} "
                       f"(verl format: {', '.join(_columns(prompt_key))})")
    if table.num_rows == 0:
        raise BadInput(f"{path}: no rows")
    rows = table.to_pylist()
    for row in rows:
        row.setdefault("extra_info", {})
    return rows
