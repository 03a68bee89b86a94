"""Embedded generated tasks that a tiny randomly initialised model learns with GRPO in minutes on CPU.

Prompts are BOS + 3..6 random letters from "abcdefgh"; the reward is 1 when the response's
first token is the task's target, else 0. The target is predicted at the prompt's last
position, whose input is the last prompt letter, so "copy_last" and "next_letter" only need a
token -> token map (no attention) and "constant" only a bias: learnable in a few dozen GRPO
steps by a ~1M-parameter model. The vocabulary has 16 ids, so a random policy still hits
the target ~1/16 of the time, which gives GRPO groups of n >= 8 a learning signal.

Everything is a pure function of (name, n, seed).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

from mcore_rl.data.tokenizers import CharTokenizer

LETTERS = "abcdefgh"
TOKENIZER = CharTokenizer(LETTERS + "ijklm")  # 3 specials + 13 characters = 16 ids
MIN_LETTERS, MAX_LETTERS = 3, 6


def _constant(letters: str) -> str:
    return "a"


def _copy_last(letters: str) -> str:
    return letters[-1]


def _next_letter(letters: str) -> str:
    return LETTERS[(LETTERS.index(letters[-1]) + 1) % len(LETTERS)]


TASKS: dict[str, Callable[[str], str]] = {
    "constant": _constant, "copy_last": _copy_last, "next_letter": _next_letter,
}


@dataclass(frozen=True)
class Task:
    name: str
    prompts: list[list[int]]  # token ids, starting with BOS
    targets: list[int]  # the rewarded first response token of each prompt
    tokenizer: CharTokenizer = field(default=TOKENIZER, repr=False)

    @property
    def data_source(self) -> str:
        return f"mcore_rl/{self.name}"

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @staticmethod
    def score(response_ids: Sequence[int], target: int) -> float:
        return 1.0 if len(response_ids) > 0 and int(response_ids[0]) == target else 0.0

    def reward(self, prompt_index: int, response_ids: Sequence[int]) -> float:
        return self.score(response_ids, self.targets[prompt_index])

    def rewards(self, prompt_indices: Sequence[int], responses: Sequence[Sequence[int]]) -> list[float]:
        return [self.reward(i, r) for i, r in zip(prompt_indices, responses, strict=True)]

    def rows(self) -> list[dict]:
        """The task as verl-format rows (rewards.compute_score scores them like `reward`)."""
        from mcore_rl.data.rows import make_row

        decode = self.tokenizer.decode
        return [make_row(self.data_source, decode(p[1:]), ground_truth=decode([t]), ability="toy",
                         extra_info={"index": i})
                for i, (p, t) in enumerate(zip(self.prompts, self.targets))]


def make_task(name: str, n: int, seed: int = 0) -> Task:
    """`n` prompts of task `name` (one of TASKS), deterministic in `seed`."""
    try:
        target_of = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}") from None
    rng = random.Random(f"{name}/{seed}")  # str seeds hash deterministically across runs
    prompts, targets = [], []
    for _ in range(n):
        letters = "".join(rng.choice(LETTERS) for _ in range(rng.randint(MIN_LETTERS, MAX_LETTERS)))
        prompts.append(TOKENIZER.encode(letters))
        targets.append(TOKENIZER.encode(target_of(letters), add_special_tokens=False)[0])
    return Task(name, prompts, targets)
