"""Data: parquet rows, prompt dataset (templates, filtering, truncation), collation, embedded tasks."""

import pytest
import torch

from mcore_rl.algos import grpo_advantage, policy_loss
from mcore_rl.data import (ByteTokenizer, CharTokenizer, PromptDataset, PromptTooLongError, TASKS,
                           collate_prompts, make_row, make_task, read_rows, write_rows)
from mcore_rl.data.rewards import compute_score

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "two plus two"}]


def hf_tokenizer(with_template=True):
    """A real transformers tokenizer built locally (word level), optionally with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "be", "brief", "two",
             "plus", "system:", "user:", "assistant:"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                 unk_token="<unk>")
    if with_template:
        hf.chat_template = ("{{ bos_token }} {% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
                            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return hf


def rows_with_lengths(*contents):
    return [make_row("openai/gsm8k", c, str(i), extra_info={"index": i}) for i, c in enumerate(contents)]


def test_rows_round_trip_through_parquet(tmp_path):
    rows = [make_row("openai/gsm8k", "What is 6*7?", "42", ability="math", extra_info={"split": "train"}),
            make_row("lighteval/MATH", MESSAGES, "\\frac{1}{2}", extra_info={"index": 3})]
    path = tmp_path / "sub" / "train.parquet"
    assert write_rows(str(path), rows) == 2
    back = read_rows(str(path))
    assert [r["prompt"] for r in back] == [[{"role": "user", "content": "What is 6*7?"}], MESSAGES]
    assert back[1]["reward_model"] == {"style": "rule", "ground_truth": "\\frac{1}{2}"}
    assert back[0]["extra_info"] == {"split": "train", "index": None}  # parquet unions struct fields
    assert read_rows([str(path), str(path)])[2] == back[0]
    write_rows(str(tmp_path / "bare.parquet"), [make_row("s", "hi", "1")])  # no extra_info at all
    assert read_rows(str(tmp_path / "bare.parquet"))[0]["extra_info"] == {}
    with pytest.raises(ValueError, match="reward_model"):
        write_rows(str(tmp_path / "bad.parquet"), [{"data_source": "s", "prompt": MESSAGES}])
    with pytest.raises(ValueError, match="list of {role, content}"):
        write_rows(str(tmp_path / "bad.parquet"), [dict(rows[0], prompt="raw text")])


def test_transformers_chat_template_is_applied():
    tok = hf_tokenizer()
    ds = PromptDataset([make_row("s", MESSAGES, "4")], tok, max_prompt_length=64)
    # <s> <|system|> be brief <|user|> two plus two <|assistant|>
    assert ds[0]["input_ids"] == [1, 4, 7, 8, 5, 9, 10, 9, 6]
    assert ds[0]["ground_truth"] == "4" and ds[0]["raw_prompt"] == MESSAGES


def test_plain_fallback_without_template():
    ids = PromptDataset([make_row("s", MESSAGES, "4")], hf_tokenizer(with_template=False))[0]["input_ids"]
    assert ids == [11, 7, 8, 12, 9, 10, 9, 13]  # "system: be brief / user: two plus two / assistant:"
    byte_ids = PromptDataset([make_row("s", "hi", "4")])[0]["input_ids"]  # no tokenizer: bytes
    assert ByteTokenizer().decode(byte_ids) == "user: hi\nassistant:" and byte_ids[0] == 1


def test_overlong_prompts_filtered_or_truncated():
    tok = CharTokenizer("abcdefgh")  # template: BOS + content
    rows = rows_with_lengths("abc", "abcdefgh", "ab")
    ds = PromptDataset(rows, tok, max_prompt_length=4)
    assert [it["index"] for it in ds] == [0, 2] and ds.num_filtered == 1
    left = PromptDataset(rows, tok, max_prompt_length=4, filter_overlong_prompts=False, truncation="left")
    assert tok.decode(left[1]["input_ids"]) == "efgh"
    right = PromptDataset(rows, tok, max_prompt_length=4, filter_overlong_prompts=False, truncation="right")
    assert tok.decode(right[1]["input_ids"]) == "^abc"
    with pytest.raises(PromptTooLongError, match="row 1 has 9 tokens > max_prompt_length 4"):
        PromptDataset(rows, tok, max_prompt_length=4, filter_overlong_prompts=False, truncation="error")


def test_collate_left_pads_and_batches_are_deterministic(tmp_path):
    tok = CharTokenizer("abcdefgh")
    write_rows(str(tmp_path / "t.parquet"), rows_with_lengths("abc", "a", "abcde", "ab", "b"))
    ds = PromptDataset(str(tmp_path / "t.parquet"), tok, max_prompt_length=16)
    batch = collate_prompts([ds[0], ds[1]], tok.pad_token_id)
    assert batch["input_ids"].tolist() == [[1, 3, 4, 5], [0, 0, 1, 3]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 0, 0, 1]]
    assert batch["ground_truth"] == ["0", "1"] and batch["index"] == [0, 1]
    epoch0 = [[it["index"] for it in b] for b in ds.batches(2, epoch=0, seed=3)]
    assert epoch0 == [[it["index"] for it in b] for b in ds.batches(2, epoch=0, seed=3)]
    assert len(epoch0) == 2 and len({i for b in epoch0 for i in b}) == 4  # drop_last, no repeats
    orders = {tuple(it["index"] for b in ds.batches(1, epoch=e, seed=3) for it in b) for e in range(6)}
    assert len(orders) > 1  # epochs reshuffle
    assert [len(b) for b in ds.batches(2, shuffle=False, drop_last=False)] == [2, 2, 1]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_tasks_are_deterministic_and_rows_score_like_ids(name):
    task = make_task(name, 64, seed=5)
    assert task == make_task(name, 64, seed=5) and task.prompts != make_task(name, 64, seed=6).prompts
    assert all(p[0] == 1 and 4 <= len(p) <= 7 and max(p) < task.vocab_size for p in task.prompts)
    gen = torch.Generator().manual_seed(0)
    responses = torch.randint(0, task.vocab_size, (64, 3), generator=gen).tolist()
    responses[0][0] = task.targets[0]
    by_ids = task.rewards(range(64), responses)
    by_text = [compute_score(row["data_source"], task.tokenizer.decode(resp), row["reward_model"]["ground_truth"])
               for row, resp in zip(task.rows(), responses)]
    assert by_ids == by_text and by_ids[0] == 1.0 and 0 < sum(by_ids) < 64
    assert task.reward(0, []) == 0.0


def test_task_targets_follow_their_rule():
    dec = make_task("copy_last", 8).tokenizer.decode
    for name, rule in [("constant", lambda s: "a"), ("copy_last", lambda s: s[-1]),
                       ("next_letter", lambda s: "abcdefgha"["abcdefgh".index(s[-1]) + 1])]:
        task = make_task(name, 20, seed=1)
        assert [dec([t]) for t in task.targets] == [rule(dec(p[1:])) for p in task.prompts]
    with pytest.raises(ValueError, match="copy_last"):
        make_task("copy", 1)


class TinyCausalLM(torch.nn.Module):
    """~0.1M-parameter causal transformer over the task vocabulary (left-padded inputs)."""

    def __init__(self, vocab: int, dim: int = 64):
        super().__init__()
        self.emb, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(16, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.body, self.head = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), \
            torch.nn.Linear(dim, vocab)

    def forward(self, ids, pad):
        causal = torch.nn.Transformer.generate_square_subsequent_mask(ids.shape[1]) == float("-inf")
        pos = ((~pad).long().cumsum(-1) - 1).clamp(min=0)
        return self.head(self.body(self.emb(ids) + self.pos(pos), mask=causal, src_key_padding_mask=pad))


def sample(model, prompts, new_tokens, greedy=False):
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
    pad = ids == 0
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(ids, torch.cat([pad, torch.zeros_like(ids[:, pad.shape[1]:], dtype=torch.bool)], 1))
            nxt = logits[:, -1].argmax(-1) if greedy else torch.distributions.Categorical(
                logits=logits[:, -1]).sample()
            ids = torch.cat([ids, nxt[:, None]], 1)
    return ids, pad, width


@pytest.fixture
def one_thread():
    # tiny matmuls: a second thread only adds contention on a shared 2-core machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["copy_last", "next_letter"])
def test_tiny_random_model_learns_task_with_grpo(name, one_thread):
    """The point of the embedded tasks: GRPO signal from scratch within a few dozen steps."""
    torch.manual_seed(0)
    task, held_out = make_task(name, 512, seed=0), make_task(name, 128, seed=1)
    model = TinyCausalLM(task.vocab_size)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    prompts_per_step, n, response_len = 16, 8, 2

    def greedy_accuracy():
        ids, _, width = sample(model, held_out.prompts, 1, greedy=True)
        return sum(held_out.rewards(range(128), ids[:, width:].tolist())) / 128

    before = greedy_accuracy()
    for _ in range(40):
        index = torch.randint(0, len(task.prompts), (prompts_per_step,)).repeat_interleave(n)
        ids, pad, width = sample(model, [task.prompts[i] for i in index.tolist()], response_len)
        responses = ids[:, width:]
        scores = torch.zeros(responses.shape)
        scores[:, -1] = torch.tensor(task.rewards(index.tolist(), responses.tolist()))
        mask = torch.ones(responses.shape)
        adv, _ = grpo_advantage(scores, mask, index=index)
        full_pad = torch.cat([pad, torch.zeros_like(responses, dtype=torch.bool)], 1)[:, :-1]
        logits = model(ids[:, :-1], full_pad)[:, width - 1:]
        logp = torch.log_softmax(logits, -1).gather(-1, responses[..., None])[..., 0]
        loss, _ = policy_loss(logp.detach(), logp, adv, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert before < 0.4 and greedy_accuracy() > 0.9
