"""Small offline tokenizers carrying the special tokens of Qwen3, DeepSeek-V3 and GLM-4.5, with the
chat templates of mcore_rl/rollout/chat_templates: a byte-level BPE trained in-process on a few
lines (tokenizers library, no downloads), split by a GPT-style pre-tokenizer as those models' are,
so that merges, whitespace runs and the special tokens' splitting behave as a real tokenizer's."""

from __future__ import annotations

import functools

# the special and added tokens of each family (its tokenizer_config's added_tokens), and its bos/eos
FAMILIES = {
    "qwen3": dict(
        tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                "<tool_response>", "</tool_response>"],
        bos=None, eos="<|im_end|>", pad="<|endoftext|>"),
    "deepseek_v3": dict(
        tokens=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                "<｜tool▁output▁end｜>"],
        bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad="<｜end▁of▁sentence｜>"),
    "glm4_5": dict(
        tokens=["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"],
        bos=None, eos="<|endoftext|>", pad="<|endoftext|>"),
}

# GPT-4-style pre-tokenization (letters with a leading non-letter, digits, punctuation runs, newline runs)
_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CORPUS = [
    "The weather in Paris is sunny; the lookup tool answers with a JSON object.",
    '{"name": "lookup", "arguments": {"city": "Paris"}}',
    "I should call the tool first, then answer with what it returns.\n\nThe answer is 42.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Temperature: 21 degrees. Humidity: 40%. Wind: 5 km/h.",
]


@functools.lru_cache(maxsize=None)
def chat_tokenizer(family: str):
    """A transformers tokenizer of `family` (FAMILIES) with mcore_rl's template of that family."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from mcore_rl.rollout.chat import template_text

    spec = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=spec["tokens"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=spec["bos"], eos_token=spec["eos"],
                                  pad_token=spec["pad"], additional_special_tokens=spec["tokens"])
    out.chat_template = template_text(family)
    return out
