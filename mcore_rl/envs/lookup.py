"""A multi-turn task the tiny model can only solve through its tool (configs/tiny_multiturn_cpu.yaml).

Each conversation hides a secret letter, drawn from its seed, that neither the prompt nor anything
before the tool's reply contains. A model turn whose first token is a letter a-h is a well-formed
lookup: the tool answers `j <secret>`. Any other turn gets `k` (an error) and the model may try
again. The turn after a lookup is the answer: reward 1 when its first token is the secret, else 0.
So the model must learn two things: to call the tool, and to copy the secret from its reply. A
random policy scores about 0.05 (a lookup half the time, then a 1-in-16 guess).

Token-level, on the embedded tasks' 16-id character vocabulary (mcore_rl/data/tasks.py).
"""

from __future__ import annotations

import random

from mcore_rl.data.tasks import LETTERS, TOKENIZER
from mcore_rl.rollout.multiturn import SampleInfo, StepResult

LETTER_IDS = tuple(TOKENIZER.encode(LETTERS, add_special_tokens=False))
REPLY_ID, ERROR_ID = TOKENIZER.encode("jk", add_special_tokens=False)


class SecretLookupEnv:
    def __init__(self):
        self.secret, self.looked_up = None, False

    async def reset(self, sample: SampleInfo):
        rng = random.Random(f"secret/{sample.seed}") if sample.seed is not None else random.Random()
        self.secret = rng.choice(LETTER_IDS)
        return None

    async def step(self, model_turn: list[int]) -> StepResult:
        if self.looked_up:  # the answer
            return StepResult(reward=float(bool(model_turn) and model_turn[0] == self.secret), done=True)
        if model_turn and model_turn[0] in LETTER_IDS:
            self.looked_up = True
            return StepResult([REPLY_ID, self.secret], reward=0.0)
        return StepResult([ERROR_ID], reward=0.0)
