"""The PPO critic: megatron's GPTModel with its vocabulary projection replaced by a value head.

The trunk (embeddings, decoder, final norm) is the policy's architecture and starts from the
same weights; the head maps each position's final hidden state to one scalar and starts at
zero, so the first values are 0 and the first advantages are plain discounted returns.
"""

from __future__ import annotations

import torch

HEAD = "output_layer."


class ValueHead(torch.nn.Module):
    """Stands in for GPTModel.output_layer: (hidden [s, b, h], weight=..., ...) -> ([s, b, 1], None).

    The head is replicated on every TP rank. Under sequence parallelism each rank holds a slice
    of the sequence, so the values are gathered along it (the backward only splits) and the
    head's grads are summed over TP like the SP norms' (`sequence_parallel` attribute).
    """

    def __init__(self, hidden_size: int, sequence_parallel: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.weight.sequence_parallel = sequence_parallel
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        values = torch.nn.functional.linear(hidden_states, self.weight)
        if self.sequence_parallel:
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def build_critic(hf, tcfg):
    """A GPTModel of `hf` (untied: the head must not share the embedding) with a value head."""
    from mcore_rl.models.config import HFModel
    from mcore_rl.models.builder import build_model

    untied = HFModel.from_dict({**hf.cfg, "tie_word_embeddings": False})
    model = build_model(untied, tcfg)
    if model.post_process:  # only the last pipeline stage has (and checkpoints) a head
        device = next(model.parameters()).device  # build_model has already moved the trunk to its GPU
        model.output_layer = ValueHead(tcfg.hidden_size, tcfg.sequence_parallel, tcfg.params_dtype).to(device)
    return model


def copy_trunk(src: torch.nn.Module, critic: torch.nn.Module) -> None:
    """Initialise the critic's trunk from a policy of the same layout (the head is kept)."""
    trunk = {k: v for k, v in src.state_dict().items() if not k.startswith(HEAD)}
    missing, unexpected = critic.load_state_dict(trunk, strict=False)
    missing = [k for k in missing if not k.startswith(HEAD) and not k.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(f"critic/policy trunk mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
