"""Chat templates at the turn boundaries of a multi-turn rollout.

`data.chat_template` names the template the prompts are rendered with and the conversations
continue in: one shipped with mcore_rl (`TEMPLATES`: qwen3, deepseek_v3, glm4_5, written here
from those models' turn formats), a path to a Jinja file, or null for the tokenizer's own.
`data.chat_template_kwargs` go to every rendering (e.g. enable_thinking: false for Qwen3 or GLM-4.5).

An environment that answers with a message (`{"role": "tool", "content": text}`, or role user)
has it wrapped by the template: `TurnFormat.observation_ids` renders the message after a stand-in
assistant turn, takes the text from the end of that turn's content to the end of the next
generation prompt (the end-of-turn marker, the message's markers and content, the next
assistant header) and encodes it once. That text starts at a special token, where any tokenizer
splits, so its ids are the ones the whole conversation rendered by the template has there: the
rollout is token-exact against `apply_chat_template` of the conversation (tests/unit/test_chat_turns.py
checks it for the three templates). The model's own tokens are kept as sampled, never re-encoded.

The model's turn ends at the marker the template writes after an assistant message (Qwen3's
<|im_end|>, DeepSeek-V3's <｜end▁of▁sentence｜>, GLM-4.5's <|observation|> or <|user|>, which there
open the next message): `stop_token_ids` holds them. Where the model sampled that marker it is the
model's token (trained); where its turn ran out of tokens first, the marker is the template's
(context, not trained). A model that ended its turn with the marker of another message than the
environment's (GLM-4.5: <|user|> where the tool answers) has ended the conversation: no template
rendering holds both.

Templates that drop the reasoning of assistant turns before the last user message (Qwen3, GLM-4.5)
render a history differently from what the model saw once an environment answers as the user;
the rollout keeps what the model saw. With tool replies the two agree token for token. The one
place the qwen3 template departs from Qwen3's own: with enable_thinking=false every assistant turn
since the last user message keeps the empty think block its generation prompt had (Qwen3's own keeps
it on the last turn only, so its rendering of a tool conversation is not the context the model saw).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from typing import Any, Sequence

from mcore_rl.preflight.bad_input import BadInput

TEMPLATES = ("qwen3", "deepseek_v3", "glm4_5")
_ASSISTANT, _CONTENT = "@@mcore_rl_assistant_turn@@", "@@mcore_rl_observation@@"


def template_text(spec: str) -> str:
    """data.chat_template -> the Jinja text: a shipped template's name, or a file."""
    if spec in TEMPLATES:
        return resources.files("mcore_rl.rollout").joinpath("chat_templates", f"{spec}.jinja").read_text()
    if os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            return f.read()
    raise BadInput(f"data.chat_template: {spec!r} is neither a template of mcore_rl ({', '.join(TEMPLATES)}) "
                   f"nor a file")


def use_template(tokenizer, spec: str | None):
    """The tokenizer with data.chat_template set as its chat template (None: its own, unchanged)."""
    if spec is None:
        return tokenizer
    if not hasattr(tokenizer, "apply_chat_template") or not hasattr(tokenizer, "chat_template"):
        raise BadInput(f"data.chat_template: {spec!r} needs a transformers tokenizer (model.tokenizer_path or "
                       f"model.hf_path), not {type(tokenizer).__name__}")
    tokenizer.chat_template = template_text(spec)
    return tokenizer


def is_message(observation) -> bool:
    return isinstance(observation, dict) and "role" in observation


@dataclass
class TurnFormat:
    """The turn boundaries of `tokenizer`'s chat template, rendered with `kwargs`."""

    tokenizer: Any
    kwargs: dict

    def __post_init__(self):
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("a message observation needs a chat template: set data.chat_template, or use a "
                             "tokenizer that has one")
        ends = {role: self._after_turn({"role": role, "content": _CONTENT})[:1] for role in ("tool", "user")}
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.stop_token_ids = tuple(dict.fromkeys([*(i for ids in ends.values() for i in ids),
                                                   *([eos] if eos is not None else [])]))

    def _render_after_turn(self, message: dict) -> str:
        """The template's text from the end of an assistant turn's content to the end of the next
        generation prompt, with `message` in between."""
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _ASSISTANT}, message]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **self.kwargs)
        head, sep, tail = text.partition(_ASSISTANT)
        if not sep:
            raise ValueError("the chat template does not render an assistant message's content")
        return tail

    def _after_turn(self, message: dict) -> list[int]:
        tail = self._render_after_turn(message)
        ids = self.tokenizer.encode(tail, add_special_tokens=False)
        first = self.tokenizer.convert_ids_to_tokens(ids[:1])
        if not ids or not tail.startswith(first[0]) or first[0] not in self._added_tokens():
            raise ValueError(f"the chat template's text after an assistant turn ({tail[:40]!r}) must start with a "
                             f"special token, which ends the model's turn")
        return ids

    def _added_tokens(self) -> set[str]:
        return set(self.tokenizer.get_added_vocab())

    def observation_ids(self, model_turn: Sequence[int], message: dict, content_ids: Sequence[int] | None = None
                        ) -> list[int] | None:
        """The ids to append after `model_turn` for the environment's `message`, up to the next
        generation prompt; None: the model ended its turn with another message's marker.
        content_ids: the message's content as token ids (then its `content` is not used)."""
        if content_ids is None:
            ids = self._after_turn(message)
        else:
            tail = self._render_after_turn({**message, "content": _CONTENT})
            before, _, after = tail.partition(_CONTENT)
            encode = self.tokenizer.encode
            ids = [*encode(before, add_special_tokens=False), *map(int, content_ids),
                   *encode(after, add_special_tokens=False)]
        last = model_turn[-1] if model_turn else None
        if last == ids[0]:  # the model sampled the end-of-turn marker: it is in its turn already
            return ids[1:]
        if last in self.stop_token_ids:
            return None
        return ids  # the turn ran out of tokens: the template closes it
