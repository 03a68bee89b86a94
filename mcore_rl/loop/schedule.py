"""Forward (and backward) passes over packed micro-batches with megatron-core's own schedule.

One code path for every layout: with one pipeline stage megatron's schedule is a plain loop over
the micro-batches; with more it is 1F1B, each stage sending its activations forward and their
grads back point to point (gloo on CPU, NCCL on GPU). Per-position outputs, losses and stats
exist on the last stage only: there the callbacks run and their results come back, in
micro-batch order; other stages get an empty list.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.profiler import record_function

from mcore_rl.loop.micro_batches import Packed

# (per-position output [T, V] or [T, 1], micro-batch index) -> result
OnOutput = Callable[[torch.Tensor, int], object]


# called with a micro-batch's index just before its forward (routing replay sets its routes)
BeforeForward = Callable[[int], None]


def forward(model, micro_batches: list[Packed], fn: OnOutput, tp_gather: bool,
            before_forward: BeforeForward | None = None) -> list:
    """fn's result for each micro-batch (forward only, e.g. under torch.no_grad)."""
    return _run(model, micro_batches, fn, tp_gather, forward_only=True, before_forward=before_forward)


def forward_backward(model, micro_batches: list[Packed], loss_fn: OnOutput, tp_gather: bool,
                     before_forward: BeforeForward | None = None) -> list[dict]:
    """Backward of each micro-batch's loss (grads accumulate in the model's buffers); returns the
    stats of each. loss_fn returns (loss, stats) with the loss already normalised over the whole
    mini-batch, so the micro-batch losses simply add up."""
    n = len(micro_batches)

    def loss(out, k):
        value, stats = loss_fn(out, k)
        # megatron divides each micro-batch's loss by their number (a mean over micro-batches):
        # undo it. The zero term keeps backward (and its collectives) going on empty micro-batches.
        return value * n + 0.0 * out.sum(), stats

    return _run(model, micro_batches, loss, tp_gather, forward_only=False, before_forward=before_forward)


def _run(model, micro_batches: list[Packed], on_last_stage: OnOutput, tp_gather: bool, forward_only: bool,
         before_forward: BeforeForward | None = None) -> list:
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.core.utils import get_model_config

    # Packed micro-batches differ in length, so P2P sends each activation's shape first (one schedule
    # call, no padding). megatron's config check refuses this beside the allgather MoE dispatcher only
    # because EP ranks could then differ in token counts; the actor's plan gives them equal lengths.
    config = get_model_config(model)
    config.variable_seq_lengths = True
    # with overlapped grad reduction (mcore_rl.parallel.optimizer.wrap) megatron's DDP reduces a bucket as soon as
    # backward fills it: only on the last micro-batch, the others run inside no_sync. Set per call:
    # the policy, its reference and the critic may share one config.
    ddp = getattr(model, "ddp_config", None)
    config.no_sync_func = model.no_sync if ddp is not None and ddp.overlap_grad_reduce else None

    def step(data, model):
        k, packed = next(data)
        if before_forward is not None:
            before_forward(k)
        with record_function("model/forward"):  # named ranges: benchmarks/actor_bench.py breakdown()
            out = model(packed.input_ids, packed.position_ids, None, packed_seq_params=packed.seq_params(),
                        padding_mask=packed.filler)

        def on_output(out, non_loss_data=False):  # last stage only
            with record_function("model/loss"):
                out = gather_from_tensor_model_parallel_region(out) if tp_gather else out
                return on_last_stage(out[0], k)

        return out, on_output

    return get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter(enumerate(micro_batches)), model=model,
        num_microbatches=len(micro_batches), seq_length=max(p.length for p in micro_batches),
        micro_batch_size=1, forward_only=forward_only, collect_non_loss_data=forward_only)
