"""What the RL loop samples prompts from: verl parquet files (data.train_files / val_files) scored
by the rule reward of each row's data_source, or an embedded generated task (data.task).

Both expose `prompts` (token ids), `tokenizer` (pad/eos ids) and `rewards(indices, responses)`.
"""

from __future__ import annotations

from mcore_rl.preflight.bad_input import BadInput
from mcore_rl.data.dataset import PromptDataset, UnencodablePrompt
from mcore_rl.data.tasks import TOKENIZER as TASK_TOKENIZER
from mcore_rl.data.tasks import make_task
from mcore_rl.data.tokenizers import ByteTokenizer


class DatasetPrompts:
    """A PromptDataset as a prompt source; responses are decoded and scored by data_source."""

    def __init__(self, dataset: PromptDataset):
        self.dataset, self.tokenizer = dataset, dataset.tokenizer
        self.prompts = [item["input_ids"] for item in dataset.items]

    def rewards(self, indices, responses) -> list[float]:
        from mcore_rl.data.rewards import compute_score

        out = []
        for i, resp in zip(indices, responses, strict=True):
            item = self.dataset[i]
            text = self.tokenizer.decode(resp, skip_special_tokens=True)
            out.append(compute_score(item["data_source"], text, item["ground_truth"], item["extra_info"]))
        return out


def load_tokenizer(model) -> object:
    """The model's HF tokenizer; an embedded (hf_config) model uses the tasks' character tokenizer
    when its vocabulary is that small, else the byte tokenizer."""
    path = model.tokenizer_path or model.hf_path
    if path:
        import transformers

        return transformers.AutoTokenizer.from_pretrained(path)
    vocab = (model.hf_config or {}).get("vocab_size", 0)
    return TASK_TOKENIZER if vocab < ByteTokenizer.vocab_size else ByteTokenizer()


def _tokenizer_hint(tokenizer) -> str:
    if tokenizer is TASK_TOKENIZER:
        return (f" (an embedded model with vocab_size < {ByteTokenizer.vocab_size} uses the generated tasks' "
                f"{tokenizer.vocab_size}-id character tokenizer: set model.hf_config.vocab_size >= "
                f"{ByteTokenizer.vocab_size} for the byte tokenizer, or model.tokenizer_path)")
    return ""


def _dataset(files, tokenizer, d) -> DatasetPrompts:
    try:
        ds = PromptDataset(files, tokenizer, prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length,
                           filter_overlong_prompts=d.filter_overlong_prompts, truncation=d.truncation,
                           rewarded=True, template_kwargs=d.chat_template_kwargs)
    except UnencodablePrompt as e:
        raise UnencodablePrompt(f"{e}{_tokenizer_hint(tokenizer)}") from None
    if len(ds) == 0:  # every file has rows (read_file_rows): all were longer than allowed
        raise BadInput(f"{', '.join(files)}: no prompts left: all {ds.num_filtered} are longer than "
                       f"data.max_prompt_length = {d.max_prompt_length} tokens")
    if ds.num_filtered:
        print(f"{files}: filtered {ds.num_filtered} prompts longer than {d.max_prompt_length} tokens", flush=True)
    return DatasetPrompts(ds)


def load_prompt_sources(cfg):
    """(train, validation or None) for cfg.data; parquet files take precedence over data.task."""
    d, seed = cfg.data, cfg.trainer.seed
    if d.train_files:
        from mcore_rl.rollout.chat import use_template

        tok = use_template(load_tokenizer(cfg.model), d.chat_template)
        return _dataset(d.train_files, tok, d), (_dataset(d.val_files, tok, d) if d.val_files else None)
    return make_task(d.task, d.task_train_size, seed=seed), make_task(d.task, d.task_val_size, seed=seed + 1)
