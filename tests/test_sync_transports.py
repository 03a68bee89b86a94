"""Transport behaviour that needs no engine model: a failing engine call surfaces on the driver."""

from __future__ import annotations

import pytest
import torch

from tests import distributed


class RefusingEngine:
    """Answers like SGLangServer when SGLang reports failure: it raises."""

    def begin_weight_update(self):
        pass

    def end_weight_update(self):
        pass

    def update_weights_from_distributed(self, **kwargs):
        raise RuntimeError("SGLang update_weights_from_distributed failed: group not initialised")


def _refused_broadcast(rank):
    from mcore_rl.parallel import free_port
    from mcore_rl.sync.transports import NcclBroadcastTransport, update_group

    group = update_group("127.0.0.1", free_port(), world_size=1, backend="gloo")  # the driver alone
    transport = NcclBroadcastTransport(RefusingEngine(), group)
    transport.begin()
    with pytest.raises(RuntimeError, match="group not initialised"):
        transport.send([("w", torch.ones(4))], last=True)


def test_engine_failure_during_broadcast_is_raised_on_the_driver():
    distributed.run(_refused_broadcast, 1)


def test_update_group_refuses_unknown_backends():
    from mcore_rl.sync.transports import update_group

    with pytest.raises(ValueError, match="backend='mpi'"):
        update_group("127.0.0.1", 1, 2, backend="mpi")
