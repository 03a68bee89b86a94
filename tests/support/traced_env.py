"""The lookup task's environment (mcore_rl/envs/lookup.py) with a trace of its conversations, for a
test that must kill a run while conversations are in flight (tests/e2e/test_multiturn.py): each
conversation appends "start" to the trace file when it begins and "end" when it closes, and its tool
takes `delay_s`, so that conversations stay open long enough to be caught."""

from __future__ import annotations

import asyncio

from mcore_rl.envs.lookup import SecretLookupEnv


class TracedLookupEnv(SecretLookupEnv):
    def __init__(self, trace: str, delay_s: float = 0.0):
        super().__init__()
        self.trace, self.delay_s = trace, delay_s

    def _note(self, what: str) -> None:
        with open(self.trace, "a") as f:
            f.write(what + "\n")

    async def reset(self, sample):
        self._note("start")
        return await super().reset(sample)

    async def step(self, model_turn):
        await asyncio.sleep(self.delay_s)
        return await super().step(model_turn)

    async def close(self):
        self._note("end")


def open_conversations(trace: str) -> int:
    """Conversations started and not yet closed, by the trace."""
    try:
        with open(trace) as f:
            lines = f.read().split()
    except FileNotFoundError:
        return 0
    return lines.count("start") - lines.count("end")
