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

REQUIRED = ("data_source", "prompt", "reward_model")


def make_row(data_source: str, prompt: str | list[dict], ground_truth, *, ability: str = "",
             style: str = "rule", extra_info: dict | None = None) -> dict:
    """A row; a plain-string prompt becomes one user message."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return {"data_source": data_source, "prompt": messages, "ability": ability,
            "reward_model": {"style": style, "ground_truth": ground_truth}, "extra_info": extra_info or {}}


def check_row(row: dict, where: str = "row", prompt_key: str = "prompt") -> None:
    missing = [k for k in (*REQUIRED[:1], prompt_key, *REQUIRED[2:]) if k not in row]
    if missing:
        raise ValueError(f"{where}: missing column(s) {missing}; has {sorted(row)}")
    messages = row[prompt_key]
    if not isinstance(messages, list) or not all(isinstance(m, dict) and {"role", "content"} <= set(m)
                                                 for m in messages):
        raise ValueError(f"{where}: {prompt_key!r} must be a list of {{role, content}} messages, "
                         f"got {messages!r:.200}")
    if not isinstance(row["reward_model"], dict) or "ground_truth" not in row["reward_model"]:
        raise ValueError(f"{where}: reward_model must be a dict with a ground_truth")


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


def read_rows(paths: str | Iterable[str]) -> list[dict]:
    """Read and concatenate parquet files of rows, in order."""
    rows: list[dict] = []
    for path in [paths] if isinstance(paths, str) else paths:
        rows.extend(pq.read_table(path).to_pylist())
    for row in rows:
        row.setdefault("extra_info", {})
    return rows
