"""Time as a budget (tests/README.md): every test's setup + call + teardown seconds are added up;
at the end of a run the tests over BUDGET_S that tests/README.md does not list are named (a note,
never a failure). MCORE_RL_TEST_DURATIONS=path also writes them all, slowest first, as JSON."""

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections import defaultdict

import pytest

BUDGET_S = 120

# Ray reads its settings from the environment when first imported, here and in every run and worker
# the tests start: a GCS that answers after Ray's 5 s connect timeout (a busy machine, two stacks
# starting side by side) is waited for, up to 60 s, instead of failing the run's start ("Failed to get
# cluster ID from GCS server", seen at load 30 and more beside other suites)
os.environ.setdefault("RAY_gcs_rpc_server_connect_timeout_s", "60")
# The CPU machines' disk is shared and its free space swings (80 GB to under 1 GB seen; 8.8 GB of 252
# on the CI run of stop 56). Past 95 % full every raylet writes an out-of-disk error into its driver's
# console every 10 s, which the console checks then count as the stack's own lines. A threshold of 1
# turns Ray's disk monitor off in the stacks the tests start; a run a user starts keeps Ray's default.
os.environ.setdefault("RAY_local_fs_capacity_threshold", "1")
README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")
_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    _seconds[report.nodeid] += report.duration


def over_budget(seconds: dict[str, float], listed: str) -> list[tuple[str, float]]:
    """(test, seconds) over BUDGET_S whose id, less its parameters, `listed` (the README) does not name."""
    return [(t, s) for t, s in sorted(seconds.items(), key=lambda kv: -kv[1])
            if s > BUDGET_S and t.split("[")[0].split("/")[-1] not in listed]


def pytest_terminal_summary(terminalreporter):
    if not _seconds:
        return
    path = os.environ.get("MCORE_RL_TEST_DURATIONS")
    if path:
        with open(path, "w") as f:
            json.dump(dict(sorted(_seconds.items(), key=lambda kv: -kv[1])), f, indent=1)
    with open(README) as f:
        listed = f.read()
    late = over_budget(_seconds, listed)
    if late:
        terminalreporter.write_sep("-", f"over the {BUDGET_S} s budget, not listed in tests/README.md")
        for test, s in late:
            terminalreporter.write_line(f"{s:7.1f}s {test}")


def tier(nodeid: str) -> str:
    """tests/<tier>/... -> <tier> (unit, e2e, gpu)."""
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]


# e2e files, slowest first (tests/README.md, "Time as a budget"): under `-n 2` each worker takes the
# next file when it is done with one, so the long files start early and the short ones even out the
# end. The files holding `alone` tests lead, to run while the unit tier keeps the other worker busy.
# A file not named here comes after them, in file order; a stale name changes the order, nothing else.
E2E_FIRST = ("test_rollout_sglang.py", "test_rollout_vllm.py", "test_sync_transports.py", "test_async.py",
             "test_checkpoints.py", "test_train_vllm.py", "test_train_sglang.py", "test_multiturn.py",
             "test_train.py", "test_multinode_rollout.py", "test_train_algos.py", "test_cluster_ray.py",
             "test_actor_pp.py", "test_replay.py", "test_actor_bench.py", "test_optim.py", "test_resume_check.py",
             "test_parity.py")


def scope(nodeid: str) -> str:
    """What one worker takes whole: a tier, or for e2e a file (its module fixtures stay on one worker)."""
    return nodeid.split("::")[0] if tier(nodeid) == "e2e" else tier(nodeid)


def work_order(scopes: list[str]) -> list[str]:
    """The order workers take scopes in: the first e2e file (E2E_FIRST's order, then file order), the
    unit tier (so the second worker starts on it), the other e2e files, the rest."""
    def rank(s: str) -> tuple:
        name = s.split("/")[-1]
        return E2E_FIRST.index(name) if name in E2E_FIRST else len(E2E_FIRST), s
    e2e = sorted((s for s in scopes if tier(s) == "e2e"), key=rank)
    rest = sorted((s for s in scopes if tier(s) != "e2e"), key=lambda s: s != "unit")
    return e2e[:1] + rest[:1] + e2e[1:] + rest[1:]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n 2` (CI): one worker starts on the e2e tier and the other on the unit tier; when done with
    a scope a worker takes the next (work_order), so after the unit tier both run e2e files, a stack
    each. Tests marked `alone` run with no other stack beside them (StackLock)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByScope(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return scope(nodeid)

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the first assignment: the queue holds every scope, in file order
                for s in reversed(work_order(list(self.workqueue))):
                    self.workqueue.move_to_end(s, last=False)
                self.ordered = True
            super()._assign_work_unit(node)

        def _reschedule(self, node) -> None:
            # a worker runs a test once it knows the next: with one left it is idle, so only then give
            # it a scope (xdist's default gives one at two left, and a long last test delays a whole file)
            if self.workqueue and not node.shutting_down and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    return ByScope(config, log)


class StackLock:
    """Between the workers of one `-n` run: an e2e test holds it shared, one marked `alone` (it asserts
    on timing that a second stack beside it would stretch) exclusive. A flock, so a worker that dies
    lets go; a turnstile ahead of it, so the other worker's next tests cannot keep an `alone` one out."""

    def __init__(self, path: str):
        self.path = path

    @contextlib.contextmanager
    def hold(self, exclusive: bool):
        with open(self.path + ".turnstile", "a") as gate, open(self.path, "a") as lock:
            fcntl.flock(gate, fcntl.LOCK_EX)
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: under -n, no other e2e test runs beside this one (StackLock)")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist, on the controller: the path of the workers' StackLock, in a directory removed at the end."""
    config = node.config
    if not hasattr(config, "stack_lock_dir"):
        config.stack_lock_dir = tempfile.mkdtemp(prefix="mcore_rl_stacks_")
        config.add_cleanup(lambda: shutil.rmtree(config.stack_lock_dir, ignore_errors=True))
    node.workerinput["stack_lock"] = os.path.join(config.stack_lock_dir, "lock")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = getattr(item.config, "workerinput", {}).get("stack_lock")  # on xdist's workers only
    if path is None or tier(item.nodeid) != "e2e":
        yield
        return
    with StackLock(path).hold(exclusive=item.get_closest_marker("alone") is not None):
        yield
