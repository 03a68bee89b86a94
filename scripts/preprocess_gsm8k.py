"""GSM8K -> verl-format parquet (train.parquet, test.parquet) for mcore_rl.

    python scripts/preprocess_gsm8k.py --local_dir ~/data/gsm8k_raw --output_dir ~/data/gsm8k
    python scripts/preprocess_gsm8k.py --output_dir ~/data/gsm8k        # from the Hub, if reachable

--local_dir: a copy of the Hub dataset (main/train-*.parquet) or jsonl files (train.jsonl, test.jsonl).
"""

from __future__ import annotations

import argparse
import os
import sys

from mcore_rl.data import make_row, write_rows
from mcore_rl.data.sources import load_split
from mcore_rl.data.rewards import GSM8K_SOURCES, gsm8k_extract

INSTRUCTION = 'Solve the problem step by step. Write the final numeric answer after "#### " on the last line.'


def to_row(record: dict, split: str, index: int) -> dict:
    answer = gsm8k_extract(record["answer"], "strict")
    if answer is None:
        raise ValueError(f"{split} record {index}: no '#### <number>' in answer {record['answer'][-80:]!r}")
    return make_row(GSM8K_SOURCES[0], f"{record['question']} {INSTRUCTION}", answer, ability="math",
                    extra_info={"split": split, "index": index, "question": record["question"],
                                "answer": record["answer"]})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_dir", help="local copy of the raw dataset (default: download from the Hub)")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--hub_repo", default="openai/gsm8k")
    parser.add_argument("--subset", default="main", help="Hub config directory; ignored if absent locally")
    parser.add_argument("--splits", nargs="+", default=["train", "test"])
    args = parser.parse_args(argv)
    for split in args.splits:
        try:
            records = load_split(split, local_dir=args.local_dir, repo_id=args.hub_repo, subset=args.subset)
        except FileNotFoundError:  # a flat jsonl copy has no subset directory
            records = load_split(split, local_dir=args.local_dir, repo_id=args.hub_repo)
        path = os.path.join(args.output_dir, f"{split}.parquet")
        n = write_rows(path, (to_row(r, split, i) for i, r in enumerate(records)))
        print(f"{split}: {n} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
