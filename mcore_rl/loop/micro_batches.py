"""Mini-batches, micro-batches and padding-free packing of RL samples.

A sample is one row of a left-padded batch: `tokens[i]` = pads, prompt, response (the response
is the last R columns); `attention_mask[i]` is 1 on the prompt's real tokens and on the response
up to and including its first EOS. Micro-batches are packed into one THD sequence with
cu_seqlens (no padding inside), so a sample's log-probs do not depend on what it is batched with:
any split into micro-batches gives the same numbers as one big batch.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch


def mini_batches(n: int, size: int) -> list[range]:
    """Consecutive chunks of `size` samples (the last one may be shorter)."""
    return [range(s, min(n, s + size)) for s in range(0, n, size)]


def fixed_micro_batches(n: int, size: int, min_count: int = 1) -> list[list[int]]:
    """`size` samples each, in order; padded with empty micro-batches up to `min_count`."""
    out = [list(r) for r in mini_batches(n, size)]
    return out + [[] for _ in range(min_count - len(out))]


def balanced_micro_batches(lengths: list[int], max_tokens: int, min_count: int = 1) -> list[list[int]]:
    """Greedy balanced partition (longest first into the lightest micro-batch) with at most
    `max_tokens` tokens per micro-batch and at least `min_count` micro-batches.

    One sample longer than max_tokens gets a micro-batch of its own.
    """
    count = max(min_count, math.ceil(sum(lengths) / max_tokens) if lengths else 0, 1)
    while True:
        heap = [(0, b) for b in range(count)]
        bins: list[list[int]] = [[] for _ in range(count)]
        fits = True
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            load, b = heapq.heappop(heap)
            if load and load + lengths[i] > max_tokens:
                fits = False
                break
            bins[b].append(i)
            heapq.heappush(heap, (load + lengths[i], b))
        if fits:
            return [sorted(b) for b in bins]
        count += 1


@dataclass
class Packed:
    """One micro-batch packed as a THD sequence [1, T] plus where its response tokens are."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    cu_seqlens: torch.Tensor  # [segments + 1] int32
    bounds: tuple[int, ...]  # cu_seqlens on the host: attention splits by it without a device read
    max_seqlen: int
    predictor: torch.Tensor  # [mb, R] packed position whose output predicts each response token
    target: torch.Tensor  # [mb, R] the response token ids
    valid: torch.Tensor  # [mb, R] bool
    last: torch.Tensor  # [mb] packed position of each sample's last token (generation)
    # predictor[valid], target[valid] and where the valid entries sit in [mb * R], selected on the
    # host (on the device a boolean selection, or masked_scatter's backward, waits for the GPU)
    response_rows: torch.Tensor  # [n]
    response_targets: torch.Tensor  # [n]
    response_index: torch.Tensor  # [n]
    # with routed experts (mcore_rl.models.routed_experts): the engine's ids at each packed position [T, MoE layers,
    # top-k] (-1 on the filler), and where each position came from in the batch (row * width + column)
    routes: torch.Tensor | None = None
    source: torch.Tensor | None = None

    def to(self, device) -> "Packed":
        return Packed(**{f: (v.to(device) if isinstance(v, torch.Tensor) else v)
                         for f, v in self.__dict__.items()})

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    def seq_params(self):
        from megatron.core.packed_seq_params import PackedSeqParams

        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                                 max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)
        params.seq_bounds = self.bounds  # read by mcore_rl.models.layers.SDPACoreAttention
        return params

    @property
    def filler(self) -> torch.Tensor:
        """[1, T] True on the filler segment (megatron's padding_mask: MoE routers leave these
        tokens out of the load counts that drive the expert-bias update)."""
        real = self.bounds[self.valid.shape[0]]  # where the samples' segments end
        return (torch.arange(self.length, device=self.input_ids.device) >= real)[None]

    def scatter_responses(self, values: torch.Tensor) -> torch.Tensor:
        """Per-response-token values [n] -> [mb, R] (0 where not valid)."""
        flat = values.new_zeros(self.valid.numel()).index_put((self.response_index,), values)
        return flat.view(self.valid.shape)

    def at_responses(self, out: torch.Tensor) -> torch.Tensor:
        """Per-position outputs [T, ...] -> [mb, R, ...] at the response tokens (0 where not valid)."""
        picked = out[self.predictor]
        mask = self.valid.view(*self.valid.shape, *([1] * (picked.dim() - 2)))
        return torch.where(mask, picked, torch.zeros_like(picked))


def largest(packs: list[Packed]) -> list[int]:
    """[packed tokens, log-prob rows, longest sequence] of the largest of `packs`, each its own max
    (the memory plan's inputs for a step: mcore_rl.memory.planner.Plan.train_at). The longest is
    the longest segment attention runs over: a filler that pads a rank to the others' length is one."""
    return [max(p.length for p in packs), max(p.response_rows.numel() for p in packs),
            max(p.max_seqlen for p in packs)]


def sample_lengths(attention_mask: torch.Tensor) -> list[int]:
    return attention_mask.sum(1).tolist()


def pack(tokens: torch.Tensor, attention_mask: torch.Tensor, response_len: int, rows: list[int],
         pad_to: int = 0, pad_id: int = 0, routes: torch.Tensor | None = None) -> Packed:
    """Pack `rows` of a batch without their padding; a filler segment makes T = max(T, pad_to).
    routes: the batch's [B, L, MoE layers, top-k] (mcore_rl.models.routed_experts), packed beside the tokens."""
    R, L = response_len, tokens.shape[1]
    ids, starts, pred = [], [0], torch.zeros(len(rows), R, dtype=torch.long)
    valid = attention_mask[rows, L - R:].bool()
    for k, i in enumerate(rows):
        seq = tokens[i][attention_mask[i].bool()]
        r = int(valid[k].sum())
        prompt = len(seq) - r
        if prompt < 1 or not bool(valid[k, :r].all()):
            raise ValueError(f"sample {i}: needs >= 1 prompt token and a contiguous response mask")
        pred[k, :r] = starts[-1] + prompt - 1 + torch.arange(r)
        ids.append(seq)
        starts.append(starts[-1] + len(seq))
    if pad_to > starts[-1] or not ids:  # filler: its own segment, so real tokens never see it
        ids.append(torch.full((max(pad_to - starts[-1], 1),), pad_id, dtype=tokens.dtype))
        starts.append(starts[-1] + len(ids[-1]))
    last = torch.tensor(starts[1:len(rows) + 1], dtype=torch.long) - 1
    lens = [b - a for a, b in zip(starts, starts[1:])]
    flat = torch.cat(ids)
    routed = _packed_routes(routes, attention_mask, rows, len(flat)) if routes is not None else {}
    return Packed(**routed, input_ids=flat[None],
                  position_ids=torch.cat([torch.arange(n) for n in lens])[None],
                  cu_seqlens=torch.tensor(starts, dtype=torch.int32), bounds=tuple(starts), max_seqlen=max(lens),
                  predictor=pred, target=tokens[rows, L - R:], valid=valid, last=last,
                  response_rows=pred[valid], response_targets=tokens[rows, L - R:][valid],
                  response_index=valid.flatten().nonzero().squeeze(1))


def _packed_routes(routes: torch.Tensor, attention_mask: torch.Tensor, rows: list[int], length: int) -> dict:
    """Packed.routes and Packed.source: each sample's routes at its real tokens, in packing order."""
    L = attention_mask.shape[1]
    cols = [attention_mask[i].bool().nonzero().squeeze(1) for i in rows]
    source = torch.cat([i * L + c for i, c in zip(rows, cols)] + [torch.zeros(0, dtype=torch.long)])
    out = torch.full((length, *routes.shape[2:]), -1, dtype=routes.dtype)
    out[:len(source)] = routes.flatten(0, 1)[source]
    return {"routes": out, "source": torch.cat([source, source.new_full((length - len(source),), -1)])}
