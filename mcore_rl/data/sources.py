"""Raw dataset records from local files in the HF datasets layout, or from the Hub when reachable.

Local layouts found by `find_split_files(root, "train", subset="main")`:
    root/main/train-00000-of-00001.parquet   (HF hub parquet export)
    root/train.jsonl, root/data/test.json   (jsonl / json records)
"""

from __future__ import annotations

import glob
import json
import os

import pyarrow.parquet as pq

EXTENSIONS = (".parquet", ".jsonl", ".json")


def find_split_files(root: str, split: str, subset: str | None = None) -> list[str]:
    """Files under `root` whose name starts with `split` ("train-0000…", "test.jsonl"), sorted."""
    if os.path.isfile(root):
        return [root]
    found = []
    for path in sorted(glob.glob(os.path.join(root, "**", "*"), recursive=True)):
        name = os.path.basename(path)
        rel_parts = os.path.relpath(path, root).split(os.sep)[:-1]
        if (name.endswith(EXTENSIONS) and (name.startswith(split + "-") or name.startswith(split + "."))
                and (subset is None or subset in rel_parts)):
            found.append(path)
    return found


def read_records(paths: list[str]) -> list[dict]:
    records: list[dict] = []
    for path in paths:
        if path.endswith(".parquet"):
            records.extend(pq.read_table(path).to_pylist())
        elif path.endswith(".jsonl"):
            with open(path) as f:
                records.extend(json.loads(line) for line in f if line.strip())
        else:
            with open(path) as f:
                data = json.load(f)
            records.extend(data if isinstance(data, list) else [data])
    return records


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def download_dataset(repo_id: str) -> str:
    """Snapshot the data files of a Hub dataset (cached); raises RuntimeError when offline/unreachable."""
    if hub_offline():
        raise RuntimeError(f"HF_HUB_OFFLINE is set: pass --local_dir with a copy of {repo_id}")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, repo_type="dataset",
                                 allow_patterns=[f"*{ext}" for ext in EXTENSIONS])
    except Exception as e:  # noqa: BLE001 - network/auth errors all mean "use a local copy"
        raise RuntimeError(f"cannot download {repo_id} from the Hub ({type(e).__name__}: {e}); "
                           f"pass --local_dir with a local copy") from e


def load_split(split: str, *, local_dir: str | None, repo_id: str, subset: str | None = None) -> list[dict]:
    """Records of `split` from `local_dir`, else from the Hub dataset `repo_id`."""
    root = local_dir or download_dataset(repo_id)
    paths = find_split_files(root, split, subset)
    if not paths:
        where = f"{root}" + (f" (subset {subset!r})" if subset else "")
        raise FileNotFoundError(f"no {split} files ({'/'.join(EXTENSIONS)}) under {where}")
    return read_records(paths)
