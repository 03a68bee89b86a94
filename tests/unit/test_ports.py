"""Rendezvous ports (torch.distributed, SGLang's nccl_port, multi-node dist_init_addr) are picked
below the kernel's ephemeral range, so no outgoing connection can take one before it is bound."""

from __future__ import annotations

import socket
from contextlib import ExitStack

from mcore_rl.parallel import groups as parallel


def _listen(stack: ExitStack, port: int) -> None:
    s = stack.enter_context(socket.socket())
    s.bind(("127.0.0.1", port))
    s.listen()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    lo, hi = parallel.LISTEN_PORTS
    ephemeral = parallel._ephemeral_start()
    for _ in range(20):
        port = parallel.free_port()
        assert lo <= port < min(hi, ephemeral), (port, ephemeral)
        with ExitStack() as stack:
            _listen(stack, port)


def test_ports_in_use_are_skipped_and_a_full_range_falls_back(monkeypatch):
    lo, _ = parallel.LISTEN_PORTS
    base = next(p for p in range(lo, lo + 5000, 3) if all(_bindable(p + i) for i in range(3)))
    monkeypatch.setattr(parallel, "LISTEN_PORTS", (base, base + 3))
    with ExitStack() as stack:
        _listen(stack, base)
        _listen(stack, base + 2)
        assert {parallel.free_port() for _ in range(10)} == {base + 1}
        _listen(stack, base + 1)
        assert parallel.free_port() >= parallel._ephemeral_start()  # the kernel's pick
