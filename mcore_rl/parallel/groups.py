"""Process groups: torch.distributed (gloo on CPU, NCCL on GPU) plus megatron's model-parallel state."""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp


# Ports we pick for others to listen on lie above Ray's worker ports (10002-19999) and below the
# kernel's ephemeral range: the kernel gives ephemeral ports to outgoing connections, and one of
# those once took SGLang's rendezvous port between its pick and its bind (EADDRINUSE in CI).
LISTEN_PORTS = (20000, 30000)


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1", tries: int = 256) -> int:
    """A port free on `host` now, from LISTEN_PORTS (below the ephemeral range) when it can be;
    concurrent callers start at random points of the range."""
    lo, hi = LISTEN_PORTS[0], min(LISTEN_PORTS[1], _ephemeral_start())
    if hi > lo:
        start = random.SystemRandom().randrange(lo, hi)
        for i in range(min(tries, hi - lo)):
            port = lo + (start - lo + i) % (hi - lo)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # no room below the ephemeral range (or all taken): any free port
        s.bind((host, 0))
        return s.getsockname()[1]


def node_rendezvous() -> tuple[str, int]:
    """(this node's address, a port free on it): run on the node that will listen."""
    import ray

    addr = ray.util.get_node_ip_address()
    return addr, free_port(addr)


def rendezvous_on(pg, bundle: int) -> tuple[str, int]:
    """node_rendezvous() on the node of placement-group bundle `bundle` (not on the driver's)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    on = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)
    return ray.get(ray.remote(num_cpus=0)(node_rendezvous).options(scheduling_strategy=on).remote())


def init_distributed(layout: Layout = Layout(), *, rank: int | None = None,
                     world_size: int | None = None, init_method: str | None = None,
                     backend: str | None = None, seed: int | None = 1234) -> None:
    """Initialise torch.distributed (if needed) and megatron's parallel state for `layout`, and seed
    megatron's CUDA RNG tracker (seed None: not seeded; seeding opens a CUDA context on a GPU host)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from mcore_rl import patches

    patches.apply()
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                                world_size=world_size)
    world = dist.get_world_size()
    if world % layout.model_parallel:
        raise ValueError(f"world size {world} is not divisible by TP*PP = {layout.model_parallel}")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp)
    if seed is not None:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
