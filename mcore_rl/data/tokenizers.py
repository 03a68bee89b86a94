"""Tokenizer-free fallbacks with the small interface the data pipeline uses.

Both put three specials first (pad=0, bos=1, eos=2) and expose encode/decode like a
transformers tokenizer. ByteTokenizer has no chat template (PromptDataset renders plain
'role: content' lines for it); CharTokenizer's template is BOS + the message contents.
"""

from __future__ import annotations

PAD, BOS, EOS = 0, 1, 2
NUM_SPECIALS = 3


class _SpecialsMixin:
    pad_token_id, bos_token_id, eos_token_id = PAD, BOS, EOS


class ByteTokenizer(_SpecialsMixin):
    """UTF-8 bytes shifted past the specials (vocab 259); the plain fallback for any text."""

    vocab_size = 256 + NUM_SPECIALS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + NUM_SPECIALS for b in text.encode("utf-8")]
        return [BOS, *ids] if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes(i - NUM_SPECIALS for i in ids if i >= NUM_SPECIALS)
        return data.decode("utf-8", errors="replace")


class CharTokenizer(_SpecialsMixin):
    """One id per character of a fixed alphabet; for the embedded tasks and ~1M-parameter models.

    The specials are written '_', '^', '$' in text, so that character i of a decoded text is
    token i and encode(decode(ids)) == ids.
    """

    SPECIAL_CHARS = "_^$"

    def __init__(self, alphabet: str):
        if len(set(alphabet)) != len(alphabet) or set(alphabet) & set(self.SPECIAL_CHARS):
            raise ValueError(f"alphabet must be distinct characters without {self.SPECIAL_CHARS!r}")
        self.alphabet = alphabet
        self.vocab_size = NUM_SPECIALS + len(alphabet)
        self._chars = self.SPECIAL_CHARS + alphabet
        self._ids = {c: i for i, c in enumerate(self._chars)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            ids = [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the alphabet {self.alphabet!r}") from None
        return [BOS, *ids] if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        chars = (self._chars[i] for i in ids if not (skip_special_tokens and i < NUM_SPECIALS))
        return "".join(chars)

    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = True):
        """The tasks' "template": BOS followed by the message contents, no role markers."""
        text = self.SPECIAL_CHARS[BOS] + "".join(m["content"] for m in messages)
        return self.encode(text, add_special_tokens=False) if tokenize else text

