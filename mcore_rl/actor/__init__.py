"""The Megatron actor: one process per GPU (gloo process on CPU) holding a shard of the policy,
and, colocated in the same process like verl's default, the frozen reference policy and the critic.

Ranks of one group run every method together (the model's collectives span them); each rank
works on its data-parallel slice of a batch and the results are gathered by the driver.
Micro-batches are packed without padding (mcore_rl.loop.micro_batches); every rank runs the same number
of micro-batches of the same packed length, because MoE token dispatch and TP/SP collectives
need the ranks in lockstep. Forward and backward passes run through megatron's own schedule
(mcore_rl.loop.schedule), so with pipeline parallelism outputs, losses and stats exist on the last
stage, whose TP rank 0 reports them.

`MegatronActor` is one class (one Ray actor, its methods called as before) composed of a mixin
per concern; they share the state `core` builds (self.cfg, self.ps, self.model, ...):

    core.py           construction, the parts it holds, what rollout engines call (run, where, sync)
    lockstep.py       data-parallel slices, the reporting rank, micro-batch plans equal on all ranks
    logprobs.py       token_logprobs; log-probs of the policy and the reference, the critic's values
    routes.py         routing replay: engine routes into the routers, the trainer's own choice back
    update.py         policy and critic updates: PPO epochs, optimizer steps, losses
    memory.py         training states to host memory and back, their size, allocator peaks
    checkpoint_io.py  save (in the background or not), finish_save, load
"""

from mcore_rl.metrics import console

console.quiet_fallback_warnings()  # before megatron is imported: rank 0 names what is missing once

from mcore_rl.actor.core import MegatronActor  # noqa: E402
from mcore_rl.actor.logprobs import token_logprobs  # noqa: E402

__all__ = ["MegatronActor", "token_logprobs"]
