"""Peak GPU memory and host memory per phase of the RL loop, sampled in daemon threads.

A reading taken as a phase starts misses what the phase itself allocates (the update's
activations, the checkpoint writer's staging buffers), so threads sample every `interval_s`
(GPU and host each in its own thread: a PSS walk must not starve a short phase of GPU readings)
and keep, per phase, the largest reading taken while that phase was current:

- GPU: NVML used bytes of every GPU of this node (all processes: colocated, the engines and the
  trainer share the GPUs and the plan budgets for both), the max over GPUs. Without NVML there
  are no GPU keys: absent means "not measured", never 0.
- host: the sum of RSS over the watched pids and all their descendants (each process once).
  RSS counts a page shared by several processes in each of them, so forked checkpoint writers,
  which share their parent's pages copy-on-write, make it an upper bound. With `pss=True` the
  sum of PSS is also kept (a shared page split among its sharers, so the sum counts it once); it
  reads /proc/PID/smaps_rollup, which walks the page tables, hence opt-in.

With `roles` ({pid: "trainer" | "engine" | ...}), the reading that sets a phase's GPU peak is
also split by process (NVML's per-process figures on that GPU; each role is its pids and their
descendants): `memory/gpu_at_peak_gib_{phase}_{role}`, and `..._other` for the rest of "used"
(unwatched processes, the driver's own reservation). That says who holds a phase's peak. With
`pss` too, the host PSS reading that sets a phase's peak is split the same way,
`memory/host_pss_at_peak_gib_{phase}_{role}`: the host plan's trainer and engine processes.

Samples taken while no phase is current are dropped, and so is any reading during which the phase
changed: a PSS walk of a large process takes longer than a colocated phase switch, and its
reading would land in the phase that was current when it began (at real width that put the
rollout's GPU peak into the train phase). A child that shares its parent's address space is not
read: a process starting a program vforks (Python's subprocess, glibc's posix_spawn), and until the
exec the child maps the very pages of its parent, so reading it would count the parent twice, in RSS
and in PSS, for a window that a loaded machine stretches without bound. The kernel says which
address space a process has (kcmp KCMP_VM), so the rule holds whatever the child's age; a forked
child has one of its own and counts at once: in PSS the pages it still shares copy-on-write are
split with its parent, so only what it copied (written or DMA-pinned pages: a second copy) adds.
Where kcmp is refused (a seccomp profile without CAP_SYS_PTRACE), a child that has not exec'd counts
once it is `COPY_AGE_S` old on the boot clock. Only pids of this node mean anything: a
pid number from another node names some other process here (`local_pids` keeps this node's Ray
actors). Watching the driver of a local Ray run would take in all of Ray (its raylet is the
driver's child, the workers the raylet's), hence actor pids rather than os.getpid().

    mon = PhaseMonitor(local_pids(actor_handles))
    with mon.phase("train"):
        ...
    metrics.update(mon.take())   # {"memory/gpu_peak_gib_train": ..., "memory/host_rss_peak_gib_train": ...}
    mon.close()
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import threading
import time

import psutil

from mcore_rl.memory.gpus import NvmlUnavailable, all_gpus, process_usage

GiB = 2**30
COPY_AGE_S = 0.5  # where kcmp is refused: how long a child that has not exec'd is taken for a vfork
PF_FORKNOEXEC = 0x40  # /proc/PID/stat flags: forked and not exec'd since
KCMP_VM = 1
_KCMP_NR = {"x86_64": 312, "aarch64": 272, "ppc64le": 354}.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True)


class PhaseMonitor:
    def __init__(self, pids=(), interval_s: float = 0.05, gpu: bool = True, pss: bool = False,
                 roles: dict[int, str] | None = None):
        self.interval_s, self.pss = interval_s, pss
        self._roles = dict(roles or {})
        self.samples = 0  # sampling passes so far, in a phase or not (tests wait on it; shows the thread lives)
        self.last_error: Exception | None = None  # the thread never raises; the last failure is kept here
        self._pids: set[int] = set(pids) | set(self._roles)
        self._phase: str | None = None
        self._entered = 0  # phase switches so far: a reading is kept only if none happened during it
        self._peaks: dict[str, int] = {}  # metric key -> bytes, since the last take()
        self._lock = threading.Lock()
        self._wake, self._gpu_wake, self._stop = threading.Event(), threading.Event(), threading.Event()
        self._gpu = gpu and _nvml_works()
        self.gpu_samples = 0  # GPU sampling passes so far
        # GPU readings in a thread of their own: a PSS walk of a large process takes longer than a
        # colocated phase (the sync: 0.3 s at Moonlight widths), which would otherwise get no reading
        self._threads = [threading.Thread(target=self._run, args=(self._sample_host, self._wake, "samples"),
                                          name="PhaseMonitor", daemon=True)]
        if self._gpu:
            self._threads.append(threading.Thread(target=self._run, args=(self._sample_gpu, self._gpu_wake,
                                                                          "gpu_samples"),
                                                  name="PhaseMonitorGPU", daemon=True))
        for t in self._threads:
            t.start()

    def watch(self, *pids: int) -> None:
        """Also watch these processes (and their children): actors started after the monitor."""
        with self._lock:
            self._pids.update(pids)

    def enter(self, name: str | None) -> None:
        """Make `name` the current phase (None: none); the threads sample at once, so that a
        phase shorter than the interval still gets a reading (unless it ends before that sample
        starts: a phase without a reading has no keys)."""
        with self._lock:
            self._phase = name
            self._entered += 1
        self._wake.set()
        self._gpu_wake.set()

    @contextlib.contextmanager
    def phase(self, name: str):
        prev = self._phase
        self.enter(name)
        try:
            yield self
        finally:
            self.enter(prev)

    def take(self) -> dict[str, float]:
        """GiB peaks of the phases sampled since the last take(), then forgets them."""
        with self._lock:
            peaks, self._peaks = self._peaks, {}
        return {k: v / GiB for k, v in peaks.items()}

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._gpu_wake.set()
        for t in self._threads:
            t.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _run(self, sample, wake: threading.Event, counter: str) -> None:
        while not self._stop.is_set():
            try:
                sample()
            except Exception as e:  # noqa: BLE001 - a monitor must not take the run down
                self.last_error = e
            setattr(self, counter, getattr(self, counter) + 1)
            wake.wait(self.interval_s)
            wake.clear()

    def _sample_gpu(self) -> None:
        with self._lock:
            phase, pids, entered, roles = self._phase, set(self._pids), self._entered, dict(self._roles)
        if phase is None:
            return
        gpus = all_gpus()
        if not gpus:
            return
        tree = _process_tree(pids)
        usage = {g.index: process_usage(g.index) for g in gpus}
        # this run's GPUs are those its processes hold memory on: a fuller GPU of another run on the
        # same node (sessions side by side) is not ours; where NVML names none of them, all count
        ours = {proc.pid for proc in tree}
        top = max([g for g in gpus if ours & usage[g.index].keys()] or gpus, key=lambda g: g.used)
        split = split_by_role(top.used, usage[top.index], roles, tree) if roles else None
        self._keep(phase, entered, {"gpu": top.used}, {"gpu": split} if split else None)

    def _sample_host(self) -> None:
        with self._lock:
            phase, pids, entered, roles = self._phase, set(self._pids), self._entered, dict(self._roles)
        if phase is None:
            return
        reading, pss = {}, {}  # no host keys when no watched process could be read: absent, not 0
        tree = _process_tree(pids)
        for p in tree:
            if p.pid not in pids and _shares_parent_memory(p.pid):
                continue
            try:
                m = p.memory_full_info() if self.pss else p.memory_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):  # exited between listing and reading
                continue
            reading["host_rss"] = reading.get("host_rss", 0) + m.rss
            if self.pss:
                reading["host_pss"] = reading.get("host_pss", 0) + m.pss
                pss[p.pid] = m.pss
        # PSS by role (the host plan's trainer and engine processes), as the GPU's split; every
        # process read is a role's, so no "other"
        split = split_by_role(reading["host_pss"], pss, roles, tree) if roles and pss else None
        if split:
            del split["other"]
        self._keep(phase, entered, reading, {"host_pss": split} if split else None)

    def _keep(self, phase: str, entered: int, reading: dict[str, int],
              splits: dict[str, dict[str, int]] | None = None) -> None:
        """Record `reading` as `phase`'s, unless the phase changed since the sample began; `splits`
        (a reading by role: the GPU's, the host PSS's) replaces the phase's split of that reading
        when the reading is its new peak."""
        with self._lock:
            if self._entered != entered:
                return
            for what, b in reading.items():
                key, split = f"memory/{what}_peak_gib_{phase}", (splits or {}).get(what)
                if split is not None and b > self._peaks.get(key, -1):
                    at = f"memory/{what}_at_peak_gib_{phase}_"
                    for k in [k for k in self._peaks if k.startswith(at)]:
                        del self._peaks[k]
                    self._peaks.update({at + r: v for r, v in split.items()})
                self._peaks[key] = max(self._peaks.get(key, 0), b)


def split_by_role(used: int, per_pid: dict[int, int], roles: dict[int, str],
                  tree: list[psutil.Process]) -> dict[str, int]:
    """`used` bytes of one GPU by role: a process counts to the role of its nearest watched
    ancestor (or itself); what no watched process holds is "other"."""
    role_of: dict[int, str] = {}
    for p in tree:
        try:
            chain = [p.pid] + [a.pid for a in p.parents()]
        except psutil.Error:
            continue
        role = next((roles[c] for c in chain if c in roles), None)
        if role is not None:
            role_of[p.pid] = role
    out = dict.fromkeys(sorted(set(roles.values())), 0)
    for pid, b in per_pid.items():
        if pid in role_of:
            out[role_of[pid]] += b
    out["other"] = max(0, used - sum(out.values()))
    return out


def _process_tree(pids: set[int]) -> list[psutil.Process]:
    """The processes `pids` and their descendants, each once (trees may overlap: the driver of a
    local Ray run is an ancestor of its actors)."""
    seen: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                seen.setdefault(p.pid, p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return list(seen.values())


def _shares_parent_memory(pid: int) -> bool:
    """A child between its vfork and its exec: its memory is its parent's, not a copy (see above)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)", which may hold spaces
    except OSError:
        return False
    ppid, flags, start_ticks = int(fields[1]), int(fields[6]), int(fields[19])
    if not flags & PF_FORKNOEXEC:  # exec'd: an image of its own (most processes: one read, no syscall)
        return False
    same = same_address_space(pid, ppid)
    if same is not None:
        return same
    # psutil's create_time() adds the boot time rounded down to the second (it read new processes
    # as 0.75 s old on CI's machine, so a 0.5 s grace never applied): compare on the boot clock
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK") < COPY_AGE_S


def same_address_space(a: int, b: int) -> bool | None:
    """Whether processes `a` and `b` share one address space (kcmp KCMP_VM); None where the kernel
    will not say (refused, not built in, an architecture not listed, either process gone)."""
    if _KCMP_NR is None:
        return None
    r = _libc.syscall(*(ctypes.c_long(x) for x in (_KCMP_NR, a, b, KCMP_VM, 0, 0)))
    return None if r < 0 else r == 0


def _nvml_works() -> bool:
    try:
        all_gpus()
        return True
    except NvmlUnavailable:
        return False


def local_pids(actors) -> list[int]:
    """Pids of those Ray actors that run on this (the driver's) node: a pid from another node
    would name an unrelated process here."""
    import os

    import ray

    here = ray.get_runtime_context().get_node_id()
    where = ray.get([a.__ray_call__.remote(lambda self: (ray.get_runtime_context().get_node_id(), os.getpid()))
                     for a in actors])
    return [pid for node, pid in where if node == here]
