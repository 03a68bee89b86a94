"""Transport behaviour that needs no engine model: a failing engine call surfaces on the driver."""

from __future__ import annotations

import pytest
import torch

from tests.support import distributed


class RefusingEngine:
    """Answers like SGLangServer when SGLang reports failure: it raises."""

    def begin_weight_update(self):
        pass

    def end_weight_update(self):
        pass

    def update_weights_from_distributed(self, **kwargs):
        raise RuntimeError("SGLang update_weights_from_distributed failed: group not initialised")


def _refused_broadcast(rank):
    from mcore_rl.parallel.groups import free_port
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


class SlowEngine:
    """Loads each bucket in 0.3 s (as SGLang's scheduler would, in its own process) and records
    when; `fail_at` makes that bucket's load raise."""

    def __init__(self, fail_at: int | None = None):
        self.loads, self.fail_at, self.ended = [], fail_at, False

    def begin_weight_update(self):
        pass

    def end_weight_update(self):
        self.ended = True

    def update_weights_from_tensor(self, payloads, load_format=None, flush_cache=True):
        import time

        start = time.monotonic()
        time.sleep(0.3)
        if len(self.loads) == self.fail_at:
            raise RuntimeError(f"SGLang update_weights_from_tensor failed at bucket {self.fail_at}")
        bucket = payloads[0]
        self.loads.append(dict(start=start, end=time.monotonic(), flush=flush_cache,
                               names=[m["name"] for m in bucket["metadata"]]))


def _pipelined(rank, world):
    import time

    import torch.distributed as dist

    from mcore_rl.sync.transports import CudaIpcTransport, by_value

    serializer, meta = by_value()
    engine = SlowEngine()
    transport = CudaIpcTransport(engine, {r: r for r in range(world)}, serializer=serializer, meta_cls=meta)
    transport.begin()
    started = []  # when each bucket's gather began
    for k in range(3):
        started.append(time.monotonic())
        transport.send([(f"w{k}", torch.full((4,), float(k + rank)))], last=k == 2)
    transport.end()
    if rank == 0:
        assert [x["names"] for x in engine.loads] == [["w0"], ["w1"], ["w2"]]
        assert [x["flush"] for x in engine.loads] == [False, False, True] and engine.ended
        # bucket k + 1 was gathered and flattened while the engine still loaded bucket k
        assert all(started[k + 1] < engine.loads[k]["end"] for k in range(2))
        assert transport.engine_wait_s > 0.2  # what the driver waited for beyond that overlap
    dist.barrier()


@pytest.mark.alone  # timing: a 0.3 s load overlapped
def test_ipc_transport_gathers_the_next_bucket_while_the_engine_loads():
    distributed.run(_pipelined, 2, 2)


def _refused_ipc(rank):
    from mcore_rl.sync.transports import CudaIpcTransport, by_value

    serializer, meta = by_value()
    transport = CudaIpcTransport(SlowEngine(fail_at=1), {0: 0}, serializer=serializer, meta_cls=meta)
    transport.begin()
    transport.send([("a", torch.ones(4))], last=False)
    transport.send([("b", torch.ones(4))], last=False)  # bucket 0 loaded: no error yet
    with pytest.raises(RuntimeError, match="failed at bucket 1"):
        transport.end()  # bucket 1's load failed while nothing else was sent: end() must not hide it


def test_engine_failure_of_a_pipelined_load_is_raised_on_the_driver():
    distributed.run(_refused_ipc, 1)
