"""Chat templates at a multi-turn rollout's turn boundaries (mcore_rl/rollout/chat.py), for the turn
formats of Qwen3, DeepSeek-V3 and GLM-4.5 (their templates in mcore_rl/rollout/chat_templates, small
offline tokenizers with their special tokens in tests/support/chat_tokenizers.py).

A conversation runs through the real multi-turn loop (multiturn.run: the environment loop, its
stop tokens, the observation wrapping, the batch's ids and masks) on an engine that samples
hand-written model turns as their token ids. The reference is independent: transformers'
`apply_chat_template` of the whole conversation as structured messages (reasoning, tool calls,
tool replies), tokenized, with its assistant mask (the templates' generation blocks). The rollout's
prompt + response ids must equal it token for token, and its loss mask must equal the assistant
mask: the model's tokens trained, the tool's and the template's markers not."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mcore_rl.config import sections as C
from mcore_rl.preflight.bad_input import BadInput
from mcore_rl.data.dataset import encode_prompt
from mcore_rl.rollout.base import Completion, SamplingParams
from mcore_rl.rollout.chat import TEMPLATES, TurnFormat, template_text, use_template
from mcore_rl.rollout.multiturn import Conversation, MultiTurnSettings, StepResult, env_conversation, run
from tests.support.chat_tokenizers import chat_tokenizer

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"city": "Paris"}}}
REPLY = "sunny, 21 degrees"

# what the model samples in each turn, as each family's model writes it (thinking on / off)
TURNS = {
    ("qwen3", True): ['<think>\nI should call the tool.\n</think>\n\n<tool_call>\n{"name": "lookup", "arguments": '
                      '{"city": "Paris"}}\n</tool_call><|im_end|>',
                      "<think>\nIt answered.\n</think>\n\nIt is sunny.<|im_end|>"],
    ("qwen3", False): ['<tool_call>\n{"name": "lookup", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                       "It is sunny.<|im_end|>"],
    ("deepseek_v3", True): ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>lookup\n```json\n"
                            '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
                            "It is sunny.<｜end▁of▁sentence｜>"],
    ("glm4_5", True): ["\n<think>I should call the tool.</think>\n<tool_call>lookup\n<arg_key>city</arg_key>\n"
                       "<arg_value>Paris</arg_value>\n</tool_call><|observation|>",
                       "\n<think>It answered.</think>\nIt is sunny.<|user|>"],
    ("glm4_5", False): ["\n<tool_call>lookup\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
                        "<|observation|>", "\nIt is sunny.<|user|>"],
}
# the same conversation as messages: the reference's input
MESSAGES = {
    True: [*PROMPT, {"role": "assistant", "reasoning_content": "I should call the tool.", "content": "",
                     "tool_calls": [CALL]},
           {"role": "tool", "content": REPLY},
           {"role": "assistant", "reasoning_content": "It answered.", "content": "It is sunny."}],
    False: [*PROMPT, {"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": REPLY},
            {"role": "assistant", "content": "It is sunny."}],
}


class ScriptEngine:
    """Samples the scripted turns in order, each up to the first of the request's stop ids or its token cap."""

    label = "script engine"

    def __init__(self, tokenizer, turns: list[str]):
        self.turns = [tokenizer.encode(t, add_special_tokens=False) for t in turns]
        self.stops_asked: list[tuple[int, ...]] = []

    def generate_requests(self, requests):
        out = []
        for r in requests:
            script, ids = self.turns.pop(0), []
            self.stops_asked.append(tuple(r.params.stop_token_ids))
            for t in script[:r.params.max_new_tokens]:
                ids.append(t)
                if t in r.params.stop_token_ids:
                    break
            done = ids[-1] in r.params.stop_token_ids
            out.append(Completion(ids, [-0.5] * len(ids), "stop" if done else "length"))
        return out


class ToolEnv:
    """Replies to the first turn with the lookup's result as a tool message (text, or ids: `as_ids`);
    the second turn ends the conversation."""

    def __init__(self, tokenizer=None, as_ids=False, role="tool"):
        self.turns, self.tokenizer, self.as_ids, self.role = 0, tokenizer, as_ids, role

    async def reset(self, sample):
        return None

    async def step(self, turn):
        self.turns += 1
        if self.turns > 1:
            return StepResult(reward=1.0, done=True)
        content = self.tokenizer.encode(REPLY, add_special_tokens=False) if self.as_ids else REPLY
        return StepResult({"role": self.role, "content": content}, reward=0.0)


def rollout(family: str, thinking: bool, max_turn_tokens=None, env=None) -> tuple[list[int], list[int], ScriptEngine]:
    """(prompt + response ids, their loss mask, the engine) of the scripted conversation."""
    tok = chat_tokenizer(family)
    kwargs = {} if thinking else {"enable_thinking": False}
    prompt = encode_prompt(PROMPT, tok, kwargs)
    engine = ScriptEngine(tok, TURNS[family, thinking])
    conv = Conversation(0, prompt, seed=1)
    settings = MultiTurnSettings(max_turns=4, max_turn_tokens=max_turn_tokens, budget=512,
                                 template_kwargs=tuple(kwargs.items()))
    run(engine, env_conversation, dict(params=SamplingParams(max_new_tokens=512), settings=settings, tokenizer=tok,
                                       make_env=lambda: env or ToolEnv(tok)), [conv])
    assert conv.failure is None
    return prompt + conv.tokens, [0] * len(prompt) + conv.loss_mask, engine


def reference(family: str, thinking: bool) -> tuple[list[int], list[int]]:
    tok = chat_tokenizer(family)
    kwargs = {} if thinking else {"enable_thinking": False}
    r = tok.apply_chat_template(MESSAGES[thinking], tokenize=True, return_dict=True,
                                return_assistant_tokens_mask=True, **kwargs)
    return list(r["input_ids"]), list(r["assistant_masks"])


CASES = [("qwen3", True), ("qwen3", False), ("deepseek_v3", True), ("glm4_5", True), ("glm4_5", False)]


@pytest.mark.parametrize("family,thinking", CASES)
def test_a_tool_conversation_is_the_templates_rendering_token_for_token(family, thinking):
    ids, mask, engine = rollout(family, thinking)
    ref_ids, ref_mask = reference(family, thinking)
    tok = chat_tokenizer(family)
    # past the model's last token, the rendering and the rollout differ only by the template's own
    # closing, which no model samples: Qwen3's newline after <|im_end|>, and GLM-4.5's model ending
    # its reply by sampling <|user|>, which the template writes only when a user message follows
    ref_tail, tail = {"qwen3": ("\n", ""), "deepseek_v3": ("", ""), "glm4_5": ("", "<|user|>")}[family]
    tail_ids, ref_tail_ids = (tok.encode(t, add_special_tokens=False) for t in (tail, ref_tail))
    assert ids == ref_ids[:len(ref_ids) - len(ref_tail_ids)] + tail_ids
    assert ref_ids[len(ref_ids) - len(ref_tail_ids):] == ref_tail_ids
    assert mask == ref_mask[:len(ref_ids) - len(ref_tail_ids)] + [1] * len(tail_ids)
    assert not any(ref_mask[len(ref_ids) - len(ref_tail_ids):])
    # the tool's reply and every role marker are context only; the model's end-of-turn markers are trained
    reply = tok.encode(REPLY, add_special_tokens=False)
    at = next(k for k in range(len(ids)) if ids[k:k + len(reply)] == reply)
    assert not any(mask[at:at + len(reply)])
    for marker in ("<|im_start|>", "<｜User｜>", "<｜Assistant｜>", "<｜tool▁outputs▁begin｜>", "<|assistant|>",
                   "<tool_response>", "[gMASK]"):
        if marker in tok.get_added_vocab():
            marker_id = tok.convert_tokens_to_ids(marker)
            assert all(not m for t, m in zip(ids, mask) if t == marker_id), marker
    ends = {"qwen3": ["<|im_end|>"], "deepseek_v3": ["<｜end▁of▁sentence｜>"], "glm4_5": ["<|observation|>", "<|user|>"]}
    for end in ends[family]:
        positions = [k for k, t in enumerate(ids) if t == tok.convert_tokens_to_ids(end) and mask[k]]
        assert positions, end
    # every model turn was asked to stop at the template's end-of-turn markers
    for asked in engine.stops_asked:
        assert set(tok.convert_ids_to_tokens(list(asked))) >= set(ends[family])


def test_a_turn_cut_before_its_end_marker_gets_the_templates_marker_as_context():
    """Qwen3, the first turn capped one token short of its <|im_end|>: the rollout inserts the
    marker as the template does (ids unchanged), but as context: the model did not sample it.
    The second turn, shorter than the cap, ends with its own sampled <|im_end|>."""
    tok = chat_tokenizer("qwen3")
    first, second = (len(tok.encode(t, add_special_tokens=False)) for t in TURNS["qwen3", True])
    assert second < first - 1
    ids, mask, _ = rollout("qwen3", True, max_turn_tokens=first - 1)
    ref_ids, ref_mask = reference("qwen3", True)
    cut = len(encode_prompt(PROMPT, tok)) + first - 1  # where the first turn's <|im_end|> stands
    assert ids == ref_ids[:-1] and ids[cut] == tok.convert_tokens_to_ids("<|im_end|>")
    assert ref_mask[cut] == 1 and mask[cut] == 0
    assert mask[:cut] + mask[cut + 1:] == ref_mask[:cut] + ref_mask[cut + 1:-1]


def test_a_tool_reply_given_as_ids_is_wrapped_as_its_text_would_be():
    tok = chat_tokenizer("qwen3")
    as_text, mask_text, _ = rollout("qwen3", True)
    as_ids, mask_ids, _ = rollout("qwen3", True, env=ToolEnv(tok, as_ids=True))
    assert as_ids == as_text and mask_ids == mask_text


def test_glm_model_ending_its_reply_where_a_tool_would_answer_ends_the_conversation():
    """GLM-4.5's model samples <|user|> (its reply is over) while the environment still has a tool
    reply: no rendering of the template holds both, so the conversation ends at the model's turn."""
    tok = chat_tokenizer("glm4_5")
    turn = TURNS["glm4_5", True][0].replace("<|observation|>", "<|user|>")
    prompt = encode_prompt(PROMPT, tok)
    conv = Conversation(0, prompt, seed=1)
    run(ScriptEngine(tok, [turn]), env_conversation,
        dict(params=SamplingParams(max_new_tokens=512), settings=MultiTurnSettings(budget=512), tokenizer=tok,
             make_env=lambda: ToolEnv(tok)), [conv])
    assert conv.tokens == tok.encode(turn, add_special_tokens=False) and all(conv.loss_mask)
    assert conv.turns == 1 and conv.failure is None


def test_an_environment_answering_as_the_user_gets_the_user_markers():
    """DeepSeek-V3, the environment's reply as a user message: <｜end▁of▁sentence｜> (the model's),
    then <｜User｜>TEXT<｜Assistant｜>, as the template renders a user turn, all context."""
    tok = chat_tokenizer("deepseek_v3")
    ids, mask, _ = rollout("deepseek_v3", True, env=ToolEnv(tok, role="user"))
    messages = [*PROMPT, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "user", "content": REPLY}, {"role": "assistant", "content": "It is sunny."}]
    r = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == list(r["input_ids"]) and mask == list(r["assistant_masks"])


def test_turn_format_refuses_a_template_whose_turns_end_without_a_special_token():
    tok = chat_tokenizer("qwen3")
    plain = tok.__class__(tokenizer_object=tok.backend_tokenizer, eos_token="<|im_end|>")
    plain.chat_template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                           "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ValueError, match="must start with a special token"):
        TurnFormat(plain, {})


def test_the_shipped_templates_and_a_template_file(tmp_path):
    for name in TEMPLATES:
        assert "generation" in template_text(name)
    path = tmp_path / "mine.jinja"
    path.write_text("{{ messages[0].content }}")
    assert template_text(str(path)) == "{{ messages[0].content }}"
    with pytest.raises(BadInput, match="neither a template of mcore_rl"):
        template_text("qwen9")
    from mcore_rl.data.tasks import TOKENIZER

    with pytest.raises(BadInput, match="needs a transformers tokenizer"):
        use_template(TOKENIZER, "qwen3")


def test_data_chat_template_renders_the_prompts_of_a_run(tmp_path):
    """data.chat_template names the template the run's prompts are rendered with (kwargs too), over
    the tokenizer's own; null keeps the tokenizer's own."""
    from mcore_rl.data.prompts import load_prompt_sources

    tok = chat_tokenizer("glm4_5")
    tok_dir = tmp_path / "tok"
    own = tok.__class__(tokenizer_object=tok.backend_tokenizer, eos_token="<|endoftext|>",
                        additional_special_tokens=list(tok.get_added_vocab()))
    own.chat_template = template_text("qwen3")  # the tokenizer's own template: another family's, to tell them apart
    own.save_pretrained(tok_dir)
    rows = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": PROMPT, "data_source": "openai/gsm8k",
                                          "reward_model": {"ground_truth": "42"}}]), rows)
    base = ["model.hf_config=null", f"model.tokenizer_path={tok_dir}", f"data.train_files={rows}",
            "data.train_batch_size=1"]
    for overrides, want in [([], ("qwen3", {})),
                            (["data.chat_template=glm4_5", "data.chat_template_kwargs.enable_thinking=false"],
                             ("glm4_5", {"enable_thinking": False}))]:
        source, _ = load_prompt_sources(C.load_config(None, base + overrides, validate=False))
        family, kwargs = want
        text = chat_tokenizer(family).apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True, **kwargs)
        assert source.prompts[0] == tok.encode(text, add_special_tokens=False), overrides


def test_a_template_without_tool_turns_leaves_id_observations_alone_and_refuses_messages():
    """A tokenizer whose template cannot render a tool turn: observations as ids go in as they are,
    a message observation is a clear error."""
    tok = chat_tokenizer("qwen3")
    strict = tok.__class__(tokenizer_object=tok.backend_tokenizer, eos_token="<|im_end|>")
    strict.chat_template = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}"
                            "{% endif %}{{ m.content }}{% endfor %}")
    ids = tok.encode(REPLY, add_special_tokens=False)

    class IdsEnv(ToolEnv):
        async def step(self, turn):
            result = await super().step(turn)
            if self.as_ids and result.observation:
                result.observation = result.observation["content"]
            return result

    for env, failure in ((IdsEnv(tok, as_ids=True), None), (ToolEnv(tok), "the chat template cannot wrap")):
        conv = Conversation(0, [1, 2], seed=1)
        engine = ScriptEngine(tok, ["It is.<|im_end|>", "Done.<|im_end|>"])
        args = dict(params=SamplingParams(max_new_tokens=512, stop_token_ids=(tok.eos_token_id,)),  # EOS, as a run's
                    settings=MultiTurnSettings(budget=512), tokenizer=strict, make_env=lambda env=env: env)
        if failure is None:
            run(engine, env_conversation, args, [conv])
            first = len(tok.encode("It is.<|im_end|>", add_special_tokens=False))
            assert conv.tokens[first:first + len(ids)] == ids and not any(conv.loss_mask[first:first + len(ids)])
        else:
            with pytest.raises(ValueError, match=failure):
                run(engine, env_conversation, args, [conv])
