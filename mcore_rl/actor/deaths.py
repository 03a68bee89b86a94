"""A trainer rank that died (driver side): which rank, during what, and the end of its stderr.

A native crash (glibc's "malloc(): unaligned tcache chunk detected", a segfault) ends the process
with its cause only on its own stderr: Ray keeps that in the worker's log file and forwards it to
the driver's console prefixed "(MegatronActor pid=...)", late or not at all as the run ends, mixed
with every other worker's lines. The driver's error then said only that the actor died. It now
carries the tail of that file: glibc's message, Ray's native stack and Python's stacks of every
thread (the actor enables faulthandler for all of them)."""

from __future__ import annotations

import glob
import os

TAIL_LINES = 60


class TrainerDied(RuntimeError):
    pass


def ray_logs_dir() -> str | None:
    """This node's Ray session log folder, where each worker's stderr is worker-*-<pid>.err."""
    try:
        import ray

        return ray._private.worker.global_worker.node.get_logs_dir_path()
    except Exception:  # noqa: BLE001 - no session here, or Ray's private layout moved: no tail, not a second error
        return None


def stderr_tail(pid: int, logs: str | None, lines: int = TAIL_LINES) -> str | None:
    """The last `lines` of the stderr of Ray worker `pid` in `logs`, or None where there is no such
    file (a worker of another node)."""
    if logs is None:
        return None
    found = glob.glob(os.path.join(logs, f"worker-*-{pid}.err"))
    if not found:
        return None
    with open(max(found, key=os.path.getmtime), errors="replace") as f:
        return "".join(f.readlines()[-lines:]).rstrip()


def trainer_died(error, method: str, actors: list, pids: list[int], logs: str | None = None) -> TrainerDied:
    """The error to raise for Ray's `error` (a RayActorError) from a call of `method` on `actors`,
    whose process ids are `pids`; `logs`: the Ray log folder (default: this node's session's)."""
    ranks = [i for i, a in enumerate(actors) if a._actor_id.hex() == getattr(error, "actor_id", None)]
    cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if not ranks:
        return TrainerDied(f"a trainer rank died during {method}: {cause}")
    rank = ranks[0]
    message = f"trainer rank {rank} (pid {pids[rank]}) died during {method}: {cause}"
    tail = stderr_tail(pids[rank], logs or ray_logs_dir())
    if tail:
        message += f"\nthe end of its stderr:\n{tail}"
    return TrainerDied(message)
