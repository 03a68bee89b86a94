"""Prompt dataset: rows -> chat-templated prompt token ids, with overlong filtering/truncation."""

from __future__ import annotations

import random
from typing import Iterator, Literal, Sequence

import torch

from mcore_rl.preflight.bad_input import BadInput
from mcore_rl.data.rows import check_row, read_file_rows
from mcore_rl.data.tokenizers import ByteTokenizer, CharTokenizer

Truncation = Literal["error", "left", "right"]


class PromptTooLongError(BadInput):
    pass


class UnencodablePrompt(BadInput):
    """A prompt the tokenizer cannot encode (a character outside a small alphabet)."""


def render_plain(messages, add_generation_prompt: bool = True) -> str:
    """A readable template for tokenizers without a chat template: 'role: content' lines."""
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + "assistant:" if add_generation_prompt else text


def encode_prompt(messages: list[dict], tokenizer, template_kwargs: dict | None = None) -> list[int]:
    """Token ids of the prompt as the policy sees it, ending where the response starts;
    template_kwargs: the chat template's (data.chat_template_kwargs)."""
    if isinstance(tokenizer, CharTokenizer) or getattr(tokenizer, "chat_template", None):
        kwargs = {} if isinstance(tokenizer, CharTokenizer) else template_kwargs or {}  # the tasks' takes none
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(render_plain(messages), add_special_tokens=True))


def truncate(ids: list[int], max_len: int, policy: Truncation, where: str = "prompt") -> list[int]:
    if len(ids) <= max_len:
        return ids
    if policy == "left":  # keep the end, next to where the response starts
        return ids[-max_len:]
    if policy == "right":
        return ids[:max_len]
    raise PromptTooLongError(f"{where} has {len(ids)} tokens > max_prompt_length {max_len} "
                             f"(set data.truncation to left/right, or data.filter_overlong_prompts)")


class PromptDataset:
    """Rows (or parquet paths) -> items {input_ids, raw_prompt, data_source, ground_truth, extra_info, index}.

    tokenizer: a transformers tokenizer (its chat template is applied when it has one, else
    plain 'role: content' lines), a tokenizer from mcore_rl.data.tokenizers, or None for bytes.
    Overlong prompts are dropped at construction when filter_overlong_prompts, else truncated
    per `truncation`. `index` is the row's position in the source, stable across filtering.
    """

    def __init__(self, source: str | Sequence[str] | list[dict], tokenizer=None, *, prompt_key: str = "prompt",
                 max_prompt_length: int = 512, filter_overlong_prompts: bool = True,
                 truncation: Truncation = "error", rewarded: bool = False, template_kwargs: dict | None = None):
        """rewarded: every row's data_source must have a reward function (a training source);
        template_kwargs: passed to the tokenizer's chat template (data.chat_template_kwargs)."""
        from mcore_rl.data.rewards import require_reward

        is_rows = isinstance(source, list) and all(isinstance(r, dict) for r in source)
        paths = [source] if isinstance(source, str) else source
        # errors name the row as "row I" among given rows, "FILE: row I" (I within FILE) among files
        parts = [("row", source)] if is_rows else [(f"{p}: row", read_file_rows(p, prompt_key)) for p in paths]
        self.tokenizer = tokenizer or ByteTokenizer()
        self.prompt_key, self.max_prompt_length = prompt_key, max_prompt_length
        self.items: list[dict] = []
        self.num_filtered = 0
        rows = [(f"{label} {i}", row) for label, part in parts for i, row in enumerate(part)]
        for index, (where, row) in enumerate(rows):
            check_row(row, where, prompt_key)
            if rewarded:
                require_reward(row["data_source"], where)
            try:
                ids = encode_prompt(row[prompt_key], self.tokenizer, template_kwargs)
            except ValueError as e:
                raise UnencodablePrompt(f"{where}: the tokenizer cannot encode the prompt: {e}") from None
            if filter_overlong_prompts and len(ids) > max_prompt_length:
                self.num_filtered += 1
                continue
            self.items.append({
                "input_ids": truncate(ids, max_prompt_length, truncation, where),
                "raw_prompt": row[prompt_key], "data_source": row["data_source"],
                "ground_truth": row["reward_model"]["ground_truth"],
                "extra_info": row.get("extra_info") or {}, "index": index,
            })

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    def batches(self, batch_size: int, *, epoch: int = 0, shuffle: bool = True, seed: int = 0,
                drop_last: bool = True) -> Iterator[list[dict]]:
        """The batches of one epoch; the order depends only on (seed, epoch), so a resumed run
        can skip the steps it already took."""
        order = list(range(len(self)))
        if shuffle:
            random.Random(f"{seed}/{epoch}").shuffle(order)
        stop = len(order) - len(order) % batch_size if drop_last else len(order)
        for start in range(0, stop, batch_size):
            yield [self.items[i] for i in order[start:start + batch_size]]


def collate_prompts(items: Sequence[dict], pad_token_id: int) -> dict:
    """Left-pad prompts into tensors for generation: input_ids, attention_mask, position_ids [B, L]."""
    width = max(len(it["input_ids"]) for it in items)
    input_ids = torch.full((len(items), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, it in enumerate(items):  # one slice copy per prompt, not per token
        n = len(it["input_ids"])
        input_ids[row, width - n:] = torch.as_tensor(it["input_ids"], dtype=torch.long)
        attention_mask[row, width - n:] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    for key in ("data_source", "ground_truth", "extra_info", "index", "raw_prompt"):
        batch[key] = [it.get(key) for it in items]
    return batch
