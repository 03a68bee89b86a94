"""PhaseMonitor on real processes: per-phase host RSS peaks (a helper process, and a child of it,
allocate inside a phase), reset on take(), GPU keys only with NVML, a thread that survives its
processes exiting."""

import os
import subprocess
import sys
import time

import pytest

from mcore_rl.memory.gpus import NvmlUnavailable, all_gpus
from mcore_rl.memory.monitor import GiB, PhaseMonitor

MiB = 2**20
ALLOC = 300 * MiB

# Answers "ok" to each stdin line: "alloc N" holds N written bytes (resident, unlike a calloc'd
# buffer whose zero pages are never touched), "free" drops them, "child N" starts a child
# holding N bytes, "reap" ends it, "spawn N" runs N short programs one after another, "fork"
# forks a child that writes every page of the held bytes (copy-on-write makes them its own: a
# second copy), "unfork" ends it.
HELPER = r"""
import os, signal, subprocess, sys, time
held, child, forked = None, None, None
for line in sys.stdin:
    cmd, *arg = line.split()
    if cmd == "alloc":
        held = bytearray(b"\x01") * int(arg[0])
    elif cmd == "fork":
        r, w = os.pipe()
        forked = os.fork()
        if forked == 0:
            for i in range(0, len(held), 4096):
                held[i] = 2
            os.write(w, b"1")
            time.sleep(600)
            os._exit(0)
        os.read(r, 1)
    elif cmd == "unfork":
        os.kill(forked, signal.SIGKILL); os.waitpid(forked, 0); forked = None
    elif cmd == "free":
        held = None
    elif cmd == "child":
        child = subprocess.Popen([sys.executable, "-c", sys.argv[1], arg[0]],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        child.stdout.readline()
    elif cmd == "spawn":  # programs of their own, each between a vfork and its exec for a moment
        for _ in range(int(arg[0])):
            subprocess.run([sys.executable, "-c", "pass"])
    elif cmd == "reap":
        child.stdin.close(); child.wait(); child = None
    print("ok", flush=True)
"""
CHILD = r"""
import sys
held = b"\x01" * int(sys.argv[1])
print("ok", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def helper():
    p = subprocess.Popen([sys.executable, "-c", HELPER, CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)

    def ask(line):
        p.stdin.write(line + "\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "ok"

    yield p, ask
    p.kill()
    p.wait()


def settle(mon, n=3, timeout=10.0, counter="samples"):
    """Wait until a thread has taken `n` more samples (the state of the moment is in a peak):
    the host thread's, or with counter="gpu_samples" the GPU thread's."""
    target, end = getattr(mon, counter) + n, time.monotonic() + timeout
    while getattr(mon, counter) < target:
        assert time.monotonic() < end, f"no samples (last error: {mon.last_error!r})"
        time.sleep(0.005)


def rss(peaks, phase):
    return peaks[f"memory/host_rss_peak_gib_{phase}"] * GiB


def test_save_peak_over_train_and_reset(helper):
    p, ask = helper
    with PhaseMonitor([p.pid], interval_s=0.02, pss=True) as mon:
        with mon.phase("train"):
            settle(mon)
        with mon.phase("save"):
            ask(f"alloc {ALLOC}")
            settle(mon)
            ask("free")
        settle(mon)  # outside any phase: not sampled, nothing attributed
        peaks = mon.take()
        assert set(peaks) >= {f"memory/{m}_peak_gib_{ph}" for m in ("host_rss", "host_pss")
                              for ph in ("train", "save")}
        assert rss(peaks, "save") - rss(peaks, "train") >= ALLOC
        assert peaks["memory/host_pss_peak_gib_save"] * GiB - peaks["memory/host_pss_peak_gib_train"] * GiB \
            >= 0.95 * ALLOC
        assert mon.take() == {}  # reset, and no phase since
        with mon.phase("save"):  # the freed buffer does not linger in the next peak
            settle(mon)
        again = mon.take()
        assert set(again) == {"memory/host_rss_peak_gib_save", "memory/host_pss_peak_gib_save"}
        assert rss(again, "save") < rss(peaks, "train") + 50 * MiB


def test_children_counted(helper):
    p, ask = helper
    with PhaseMonitor([p.pid], interval_s=0.02) as mon:
        with mon.phase("train"):
            settle(mon)
        with mon.phase("save"):
            ask(f"child {ALLOC}")  # the child, not the watched process, allocates
            settle(mon)
            ask("reap")
        peaks = mon.take()
    assert rss(peaks, "save") - rss(peaks, "train") >= ALLOC


def test_gpu_keys_only_with_nvml(helper):
    p, _ = helper
    try:
        nvml = bool(all_gpus())
    except NvmlUnavailable:
        nvml = False
    with PhaseMonitor([p.pid], interval_s=0.02) as mon:
        with mon.phase("rollout"):
            settle(mon)
        peaks = mon.take()
    assert ("memory/gpu_peak_gib_rollout" in peaks) == nvml
    assert "memory/host_rss_peak_gib_rollout" in peaks


def test_survives_exited_process_and_closes(helper):
    p, _ = helper
    mon = PhaseMonitor([p.pid], interval_s=0.02, gpu=False)
    mon.enter("sync")
    settle(mon)
    p.kill()
    p.wait()
    mon.take()
    settle(mon)  # still sampling: the exited process is skipped, no host key is made up for it
    assert mon.take() == {} and all(t.is_alive() for t in mon._threads)
    mon.close()
    assert not any(t.is_alive() for t in mon._threads)


def test_a_reading_that_spans_a_phase_switch_is_dropped(helper, monkeypatch):
    """A slow host reading (a PSS walk of a large process) begun in one phase must not land in
    it when the next phase has begun meanwhile: it is dropped, and the new phase samples afresh."""
    import mcore_rl.memory.monitor as monitor

    p, ask = helper
    started, release = __import__("threading").Event(), __import__("threading").Event()
    real = monitor._process_tree

    def slow_tree(pids):
        started.set()
        release.wait(5)
        return real(pids)

    with PhaseMonitor([p.pid], interval_s=0.01) as mon:
        monkeypatch.setattr(monitor, "_process_tree", slow_tree)
        mon.enter("train")
        assert started.wait(5)  # a reading of "train" is under way
        ask(f"alloc {ALLOC}")  # what the next phase holds
        mon.enter("rollout")
        release.set()
        monkeypatch.setattr(monitor, "_process_tree", real)
        settle(mon)
        mon.enter(None)
        peaks = mon.take()
    assert "memory/host_rss_peak_gib_train" not in peaks  # its only reading spanned the switch
    assert rss(peaks, "rollout") > ALLOC


@pytest.fixture(params=["kcmp", "kcmp refused"])
def address_spaces(request, monkeypatch):
    """The monitor's two ways to tell a vfork child: the kernel's answer (kcmp), and where a
    seccomp profile refuses it, the child's age on the boot clock."""
    import mcore_rl.memory.monitor as monitor

    if request.param == "kcmp":
        if monitor.same_address_space(os.getpid(), os.getpid()) is None:
            pytest.skip("kcmp is refused here")
    else:
        monkeypatch.setattr(monitor, "same_address_space", lambda a, b: None)
    return request.param


def test_a_child_between_fork_and_exec_is_not_counted_as_a_copy(helper, address_spaces, monkeypatch):
    """A process that starts a program (megatron's writer-results Manager, a compile worker)
    vforks: until its exec the child shares its parent's memory, and read then it would double
    the parent's RSS and PSS. Readings every 1 ms land in those windows (each as long as a loaded
    machine makes it: beside an e2e stack, longer than a reading)."""
    import mcore_rl.memory.monitor as monitor

    if address_spaces != "kcmp":
        # the fallback skips a child younger than its grace: what is under test is that rule, not
        # how long a vfork window lasts on a machine at load 13 (one outlived 0.5 s there, 2026-11-28)
        monkeypatch.setattr(monitor, "COPY_AGE_S", 5.0)
    p, ask = helper
    with PhaseMonitor([p.pid], interval_s=0.001, pss=True) as mon:
        ask(f"alloc {ALLOC}")
        with mon.phase("spawn"):
            ask("spawn 40")
        peaks = mon.take()
    for what in ("rss", "pss"):
        held = peaks[f"memory/host_{what}_peak_gib_spawn"] * GiB
        assert held < ALLOC + 150 * MiB, f"host {what} {held / MiB:.0f} MiB for {ALLOC / MiB:.0f} held"


def test_a_forked_copy_is_counted(helper, address_spaces):
    """A forked child that has not exec'd but made the parent's pages its own (it wrote them; a
    fork copies DMA-pinned pages at once) is a second copy: counted, in RSS and PSS, at once where
    the kernel tells a fork from a vfork, after the grace where it does not."""
    from mcore_rl.memory.monitor import COPY_AGE_S

    p, ask = helper
    with PhaseMonitor([p.pid], interval_s=0.01, pss=True) as mon:
        ask(f"alloc {ALLOC}")
        with mon.phase("held"):
            settle(mon)
        ask("fork")
        if address_spaces != "kcmp":
            time.sleep(COPY_AGE_S)
        with mon.phase("copied"):
            settle(mon)
        ask("unfork")
        peaks = mon.take()
    for what in ("rss", "pss"):
        grew = (peaks[f"memory/host_{what}_peak_gib_copied"] - peaks[f"memory/host_{what}_peak_gib_held"]) * GiB
        assert grew >= 0.95 * ALLOC, f"host {what} grew {grew / MiB:.0f} MiB with a second {ALLOC / MiB:.0f} MiB copy"


def test_gpu_peak_split_by_role(helper, monkeypatch):
    """The reading that sets a phase's GPU peak is split by process: a watched process's child
    counts to its role, what no watched process holds is "other"; a lower reading leaves the split
    of the peak alone. NVML is replaced by readings of these real processes (no GPU on CI)."""
    import psutil

    import mcore_rl.memory.monitor as monitor
    from mcore_rl.memory.gpus import GpuMemory

    p, ask = helper
    ask("child 1000")
    child = psutil.Process(p.pid).children()[0].pid
    engine = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    now = {}

    def reading(used, trainer_child, engine_b):
        now.update(used=used * GiB, procs={p.pid: 1 * GiB, child: trainer_child * GiB, engine.pid: engine_b * GiB,
                                           2**22 + 7: 1 * GiB})  # a pid no role watches

    monkeypatch.setattr(monitor, "_nvml_works", lambda: True)
    monkeypatch.setattr(monitor, "all_gpus", lambda: [GpuMemory("GPU-0", 0, 80 * GiB, now["used"], 0),
                                                      GpuMemory("GPU-1", 1, 80 * GiB, 1 * GiB, 0)])
    monkeypatch.setattr(monitor, "process_usage", lambda index: dict(now["procs"]) if index == 0 else {})
    try:
        reading(10, 3, 2)
        with PhaseMonitor(interval_s=0.01, roles={p.pid: "trainer", engine.pid: "engine"}) as mon:
            mon.enter("sync")
            settle(mon, counter="gpu_samples")
            reading(8, 1, 1)  # lower: the peak's split stays
            settle(mon, counter="gpu_samples")
            peaks = mon.take()
            reading(12, 3, 6)  # a new peak after take(): a split of its own
            settle(mon, counter="gpu_samples")
            later = mon.take()
    finally:
        engine.kill()
        engine.wait()
    at = "memory/gpu_at_peak_gib_sync_"
    assert peaks["memory/gpu_peak_gib_sync"] == 10
    assert {k[len(at):]: v for k, v in peaks.items() if k.startswith(at)} == {"trainer": 4, "engine": 2, "other": 4}
    assert {k[len(at):]: v for k, v in later.items() if k.startswith(at)} == {"trainer": 4, "engine": 6, "other": 2}


def test_gpu_peak_is_read_on_this_runs_gpus_only(helper, monkeypatch):
    """Two runs side by side on one node, a GPU each: the fuller GPU, held by the other run's
    processes, is not this run's peak; with no watched process on any GPU, every GPU counts."""
    import mcore_rl.memory.monitor as monitor
    from mcore_rl.memory.gpus import GpuMemory

    p, _ = helper
    procs = {0: {2**22 + 7: 70 * GiB}, 1: {p.pid: 20 * GiB}}  # GPU 0: another run's engine
    monkeypatch.setattr(monitor, "_nvml_works", lambda: True)
    monkeypatch.setattr(monitor, "all_gpus", lambda: [GpuMemory("GPU-0", 0, 80 * GiB, 71 * GiB, 0),
                                                      GpuMemory("GPU-1", 1, 80 * GiB, 21 * GiB, 0)])
    monkeypatch.setattr(monitor, "process_usage", lambda index: dict(procs[index]))
    with PhaseMonitor(interval_s=0.01, roles={p.pid: "trainer"}) as mon:
        mon.enter("train")
        settle(mon, counter="gpu_samples")
        ours = mon.take()
        procs[1] = {}  # NVML names none of ours (a container's pid namespace): the fullest GPU, as before
        settle(mon, counter="gpu_samples")
        fallback = mon.take()
    assert ours["memory/gpu_peak_gib_train"] == 21 and ours["memory/gpu_at_peak_gib_train_trainer"] == 20
    assert fallback["memory/gpu_peak_gib_train"] == 71


def test_host_pss_peak_split_by_role(helper):
    """The host PSS reading that sets a phase's peak is split by role, as the GPU's: a trainer whose
    child holds ALLOC, an engine holding ALLOC / 3; the roles add up to the peak (real processes,
    their own /proc readings)."""
    p, ask = helper
    ask(f"child {ALLOC}")
    engine = subprocess.Popen([sys.executable, "-c", HELPER, CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        engine.stdin.write(f"alloc {ALLOC // 3}\n")
        engine.stdin.flush()
        assert engine.stdout.readline().strip() == "ok"
        with PhaseMonitor(interval_s=0.01, pss=True, gpu=False, roles={p.pid: "trainer", engine.pid: "engine"}) as mon:
            with mon.phase("train"):
                settle(mon)
            peaks = mon.take()
    finally:
        engine.kill()
        engine.wait()
    at = "memory/host_pss_at_peak_gib_train_"
    split = {k[len(at):]: v * GiB for k, v in peaks.items() if k.startswith(at)}
    assert split["trainer"] > ALLOC and ALLOC // 3 < split["engine"] < ALLOC
    assert sum(split.values()) == pytest.approx(peaks["memory/host_pss_peak_gib_train"] * GiB)
