"""Forward passes across pipeline stages without a training schedule (evaluation, log-probs)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def full_logits(model, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None):
    """Logits [b, s, vocab] gathered over TP, on the last pipeline stage; None on other stages.

    Stages pass activations with point-to-point sends, so this works on gloo and NCCL alike.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    b, s = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, -1)
    cfg = model.config
    if not ps.is_pipeline_first_stage(ignore_virtual=True):
        seq = s // ps.get_tensor_model_parallel_world_size() if cfg.sequence_parallel else s
        hidden = torch.empty(seq, b, cfg.hidden_size, dtype=cfg.params_dtype, device=input_ids.device)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    out = model(input_ids, position_ids, None)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return gather_from_tensor_model_parallel_region(out)
