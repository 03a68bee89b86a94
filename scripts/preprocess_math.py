"""MATH (Hendrycks) -> verl-format parquet (train.parquet, test.parquet) for mcore_rl.

    python scripts/preprocess_math.py --local_dir ~/data/math_raw --output_dir ~/data/math
    python scripts/preprocess_math.py --output_dir ~/data/math          # from the Hub, if reachable

Records need `problem` and either `answer` or a `solution` containing \\boxed{...}
(DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500, or the original jsonl).
"""

from __future__ import annotations

import argparse
import os
import sys

from mcore_rl.data import make_row, write_rows
from mcore_rl.data.sources import load_split
from mcore_rl.data.rewards import MATH_SOURCES, last_boxed

INSTRUCTION = "Reason step by step, and put the final answer in \\boxed{}."


def ground_truth(record: dict) -> str | None:
    return record.get("answer") or last_boxed(record.get("solution", ""))


def to_rows(records: list[dict], split: str, data_source: str) -> tuple[list[dict], int]:
    """Rows for the records that have a ground truth; also the number skipped."""
    rows = []
    for index, record in enumerate(records):
        answer = ground_truth(record)
        if answer is None:
            continue
        extra = {"split": split, "index": index, "level": record.get("level"), "type": record.get("type")}
        rows.append(make_row(data_source, f"{record['problem']} {INSTRUCTION}", answer, ability="math",
                             extra_info=extra))
    return rows, len(records) - len(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_dir", help="local copy of the raw dataset (default: download from the Hub)")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--hub_repo", default="DigitalLearningGmbH/MATH-lighteval")
    parser.add_argument("--data_source", default=None, help="reward dispatch key (default: --hub_repo)")
    parser.add_argument("--splits", nargs="+", default=["train", "test"])
    args = parser.parse_args(argv)
    data_source = args.data_source or args.hub_repo
    if data_source not in MATH_SOURCES:
        parser.error(f"--data_source {data_source!r} has no MATH reward; use one of {MATH_SOURCES}")
    for split in args.splits:
        records = load_split(split, local_dir=args.local_dir, repo_id=args.hub_repo)
        rows, skipped = to_rows(records, split, data_source)
        path = os.path.join(args.output_dir, f"{split}.parquet")
        write_rows(path, rows)
        print(f"{split}: {len(rows)} rows -> {path}" + (f" ({skipped} without a boxed answer skipped)"
                                                        if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
