"""RL prompt data: verl-format parquet rows, a templating prompt dataset, embedded toy tasks."""

from mcore_rl.data.dataset import (PromptDataset, PromptTooLongError, collate_prompts, encode_prompt,
                                   render_plain, truncate)
from mcore_rl.data.rows import check_row, make_row, read_rows, write_rows
from mcore_rl.data.tasks import TASKS, Task, make_task
from mcore_rl.data.tokenizers import ByteTokenizer, CharTokenizer

__all__ = ["PromptDataset", "PromptTooLongError", "collate_prompts", "encode_prompt", "render_plain",
           "truncate", "check_row", "make_row", "read_rows", "write_rows", "TASKS", "Task", "make_task",
           "ByteTokenizer", "CharTokenizer"]
