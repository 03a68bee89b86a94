"""Megatron torch_dist checkpoints (our trainer's `step_N/model`) -> HF, through the shared
mappings (`convert.mcore_to_hf`). A checkpoint saved by several nodes without a shared file system
has its `__R_0.distcp` files spread over the nodes' directories; rank 0's holds `.metadata`."""

from __future__ import annotations

import os

from mcore_rl.convert.hf_io import CheckpointError
from mcore_rl.convert.merge.locate import check_dirs, locate_once

DCP_METADATA = ".metadata"


def locate_checkpoint(dirs: list[str]) -> tuple[str, dict[str, str]]:
    """(directory with the metadata, data file -> directory); every file present exactly once
    and long enough for every tensor the metadata places in it."""
    from torch.distributed.checkpoint import FileSystemReader

    dirs = check_dirs(dirs)
    primary = locate_once(dirs, [DCP_METADATA], "DCP metadata file")[DCP_METADATA]
    if not os.path.exists(os.path.join(primary, "metadata.json")):
        raise CheckpointError(f"{primary}: has {DCP_METADATA} but no metadata.json (not megatron torch_dist)")
    try:
        md = FileSystemReader(primary).read_metadata()
    except Exception as e:  # noqa: BLE001 - report any unreadable metadata with its path
        raise CheckpointError(f"{os.path.join(primary, DCP_METADATA)}: unreadable ({e})") from None
    need: dict[str, int] = {}
    for info in md.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    where = locate_once(dirs, sorted(need), "checkpoint data file")
    for name, end in need.items():
        path = os.path.join(where[name], name)
        if os.path.getsize(path) < end:
            raise CheckpointError(f"{path}: truncated: the metadata needs {end} bytes, "
                                  f"file has {os.path.getsize(path)}")
    return primary, {**where, DCP_METADATA: primary}
