"""Streaming access to HuggingFace safetensors checkpoints: a validating reader and a sharded writer."""

from __future__ import annotations

import json
import os
import shutil
import struct
import uuid
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
from safetensors.torch import save_file

from mcore_rl.preflight.bad_input import BadInput, read_json_object

INDEX = "model.safetensors.index.json"
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "tokenizer.model", "special_tokens_map.json", "vocab.json", "merges.txt",
              "added_tokens.json", "chat_template.jinja")


SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
ST_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


class CheckpointError(BadInput):
    pass


def _header(path: str) -> dict:
    """Parse a safetensors header and check the file holds every byte it promises."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise CheckpointError(f"{path}: truncated (header claims {n} bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated: tensors need {8 + n + end} bytes, file has {size}")
    return header


class HFCheckpoint:
    """Tensor-by-tensor reader. Validates every shard up front; dequantizes FP8 block weights."""

    def __init__(self, path: str, block_size: tuple[int, int] | None = None):
        self.path = path
        index = os.path.join(path, INDEX)
        if os.path.exists(index):
            weight_map = read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index}: no \"weight_map\" of tensor name -> shard file")
        else:
            single = os.path.join(path, "model.safetensors")
            if not os.path.exists(single):
                raise CheckpointError(f"{path}: no {INDEX} and no model.safetensors")
            weight_map = {k: "model.safetensors" for k in _header(single) if k != "__metadata__"}
        self.files = sorted(set(weight_map.values()))
        missing = [f for f in self.files if not os.path.exists(os.path.join(path, f))]
        if missing:
            raise CheckpointError(f"{path}: missing safetensors shard(s): {', '.join(missing)}")
        self.meta: dict[str, dict] = {}
        self._data_start: dict[str, int] = {}
        for fname in self.files:
            header = _header(os.path.join(path, fname))
            with open(os.path.join(path, fname), "rb") as f:
                self._data_start[fname] = 8 + struct.unpack("<Q", f.read(8))[0]
            for k, v in header.items():
                if k != "__metadata__":
                    self.meta[k] = {**v, "file": fname}
        absent = sorted(k for k, f in weight_map.items() if k not in self.meta)
        if absent:
            raise CheckpointError(f"{path}: index lists tensors absent from their shard: {absent[:5]}")
        self.block_size = block_size or (128, 128)
        self.bytes_read: dict[str, int] = {}  # tensor name -> bytes of it read so far

    @classmethod
    def of_model(cls, path: str, hf) -> "HFCheckpoint":
        """The checkpoint of HFModel `hf`, read with the FP8 block size its config names."""
        qcfg = hf.get("quantization_config") or {}
        return cls(path, block_size=tuple(qcfg.get("weight_block_size", (128, 128))))

    def names(self) -> list[str]:
        return list(self.meta)

    def __contains__(self, name: str) -> bool:
        return name in self.meta

    def dtype(self, name: str) -> torch.dtype:
        """The dtype get(name) returns: the stored one, bf16 for FP8 block weights (dequantized)."""
        return torch.bfloat16 if self.block_scaled(name) else ST_DTYPES[self.meta[name]["dtype"]]

    def nbytes(self, name: str) -> int:
        a, b = self.meta[name]["data_offsets"]
        return b - a

    def _raw(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The stored tensor, or only its rows [start, stop) along dim 0 (contiguous in the file)."""
        if name not in self.meta:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the checkpoint")
        m = self.meta[name]
        full = list(m["shape"]) or [1]  # a scalar reads as its one row
        start, stop = rows or (0, full[0])
        if not 0 <= start <= stop <= full[0]:
            raise CheckpointError(f"{self.path}: rows {start}:{stop} of {name} (shape {m['shape']})")
        t = torch.empty([stop - start, *full[1:]] if m["shape"] else [], dtype=ST_DTYPES[m["dtype"]])
        a, b = m["data_offsets"]
        row = (b - a) // full[0] if full[0] else 0
        self._read(name, m["file"], self._data_start[m["file"]] + a + start * row,
                   memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        return t

    def _read(self, name: str, fname: str, offset: int, into: memoryview) -> None:
        # a positioned read into a fresh tensor, not an mmap: pages of files already read would
        # stay mapped into this process and its resident memory would grow to the model's size
        with open(os.path.join(self.path, fname), "rb", buffering=0) as f:
            f.seek(offset)
            if f.readinto(into) != len(into):
                raise CheckpointError(f"{self.path}/{fname}: short read of {name}")
        self.bytes_read[name] = self.bytes_read.get(name, 0) + len(into)

    def get(self, name: str) -> torch.Tensor:
        t = self._raw(name)
        if self.block_scaled(name):
            t = dequantize_fp8(t, self._raw(name + "_scale_inv"), self.block_size)
        return t

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along dim 0 of get(name), reading only their bytes (but for block-scaled
        FP8, whose blocks span rows: read whole, then cut)."""
        if self.block_scaled(name):
            return self.get(name)[start:stop]
        return self._raw(name, (start, stop))

    def block_scaled(self, name: str) -> bool:
        """An FP8 weight with block scales: get() dequantizes it."""
        return self.meta.get(name, {}).get("dtype") in ("F8_E4M3", "F8_E5M2") and name + "_scale_inv" in self.meta

    def close(self):
        pass  # no handles are kept open


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """DeepSeek-V3 block-wise FP8: each [bm, bn] block of `w` is multiplied by one scale."""
    from mcore_rl.sync.fp8 import dequantize

    return dequantize(w, scale_inv, block, torch.bfloat16)


@contextmanager
def atomic_dir(out: str):
    """Yield a temporary sibling directory that becomes `out` only if the block completes."""
    out = os.path.abspath(out)
    if os.path.exists(out) and os.listdir(out):
        raise CheckpointError(f"{out} exists and is not empty")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(out):
        os.rmdir(out)
    os.rename(tmp, out)


def copy_side_files(src: str, dst: str) -> list[str]:
    """Copy config, generation config and tokenizer files that exist in `src`."""
    copied = []
    for name in SIDE_FILES:
        p = os.path.join(src, name)
        if os.path.exists(p):
            shutil.copy2(p, os.path.join(dst, name))
            copied.append(name)
    return copied


class ShardedWriter:
    """Write (name, tensor) pairs into size-bounded safetensors shards plus an index.

    Holds at most one shard's worth of tensors; shard names get their final count at close().
    """

    def __init__(self, out: str, max_shard_bytes: int = 5 * 2**30):
        self.out, self.max = out, max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max:
            self._flush()
        self.pending[name] = t.detach().contiguous().cpu()
        self.pending_bytes += nbytes
        self.total += nbytes

    def add_all(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in items:
            self.add(name, t)

    def _flush(self):
        path = os.path.join(self.out, f"part-{len(self.shards):05d}.safetensors")
        save_file(self.pending, path, metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> dict[str, str]:
        if self.pending:
            self._flush()
        n = len(self.shards)
        weight_map = {}
        for i, names in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(os.path.join(self.out, f"part-{i:05d}.safetensors"), os.path.join(self.out, final))
            weight_map.update({k: final for k in names})
        with open(os.path.join(self.out, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)
        return weight_map


def iter_tensors(ckpt: HFCheckpoint, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for n in names:
        yield n, ckpt.get(n)
