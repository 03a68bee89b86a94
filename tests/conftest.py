"""Time as a budget (tests/README.md): every test's setup + call + teardown seconds are added up;
at the end of a run the tests over BUDGET_S that tests/README.md does not list are named (a note,
never a failure). MCORE_RL_TEST_DURATIONS=path also writes them all, slowest first, as JSON."""

import json
import os
from collections import defaultdict

import pytest

BUDGET_S = 120

# Ray reads its settings from the environment when first imported, here and in every run and worker
# the tests start: a GCS that answers after Ray's 5 s connect timeout (a busy machine) is waited for, up
# to 60 s, instead of failing the run's start ("Failed to get cluster ID from GCS server", seen at load
# 30 and more beside other suites)
os.environ.setdefault("RAY_gcs_rpc_server_connect_timeout_s", "60")
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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n 2` (CI): one worker runs the whole e2e tier in order, one stack at a time as a plain run
    does, and the other the unit tier beside it (a stack leaves much of the second core idle). Each
    tier is one xdist scope, so a worker takes a tier whole."""
    from xdist.scheduler import LoadScopeScheduling

    class ByTier(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return tier(nodeid)

    return ByTier(config, log)
