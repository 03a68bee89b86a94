"""tests/conftest.py's time budget: the slow tests it names at the end of a run."""

from tests.conftest import BUDGET_S, over_budget


def test_over_budget_names_the_slow_tests_the_readme_does_not_list():
    seconds = {"tests/e2e/test_a.py::test_slow[x]": BUDGET_S + 80, "tests/e2e/test_a.py::Cls::test_listed": 300,
               "tests/e2e/test_a.py::test_on_time": BUDGET_S - 1, "tests/unit/test_b.py::test_fast": 3}
    readme = "| `test_a.py::Cls::test_listed` | two stack starts |"
    assert over_budget(seconds, readme) == [("tests/e2e/test_a.py::test_slow[x]", BUDGET_S + 80)]


def test_work_order_starts_one_worker_on_e2e_and_the_other_on_unit_then_slowest_files_first():
    from tests.conftest import E2E_FIRST, scope, work_order

    assert scope("tests/e2e/test_async.py::test_x[a]") == "tests/e2e/test_async.py"
    assert scope("tests/e2e/test_rollout_vllm.py::TestEngineContract::test_y") == "tests/e2e/test_rollout_vllm.py"
    assert scope("tests/unit/test_z.py::test_z") == "unit" and scope("tests/gpu/test_g.py::test_g") == "gpu"
    first, later = (f"tests/e2e/{n}" for n in E2E_FIRST[:2])
    scopes = ["gpu", "tests/e2e/test_b.py", later, "unit", "tests/e2e/test_a.py", first]
    assert work_order(scopes) == [first, "unit", later, "tests/e2e/test_a.py", "tests/e2e/test_b.py", "gpu"]
    assert work_order(["unit"]) == ["unit"] and work_order(["tests/e2e/test_b.py"]) == ["tests/e2e/test_b.py"]


def test_an_alone_test_holds_the_stack_lock_by_itself_and_is_not_kept_out(tmp_path):
    import contextlib
    import fcntl
    import threading
    import time

    from tests.conftest import StackLock

    path = str(tmp_path / "stacks.lock")
    lock, inside, leave = StackLock(path), [], threading.Event()

    def hold(name, exclusive):
        with lock.hold(exclusive):
            inside.append(name)
            if exclusive:
                leave.wait(10)

    def turnstile_taken():
        with open(path + ".turnstile", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False

    def wait_for(cond):
        deadline = time.monotonic() + 10
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.01)
        return cond()

    with contextlib.ExitStack() as first, contextlib.ExitStack() as second:
        first.enter_context(lock.hold(exclusive=False))
        second.enter_context(lock.hold(exclusive=False))  # two stacks side by side
        alone = threading.Thread(target=hold, args=("alone", True))
        alone.start()
        assert wait_for(turnstile_taken)  # the alone test waits, holding the turnstile
        later = threading.Thread(target=hold, args=("later", False))
        later.start()  # a stack asked for after it waits behind it
        first.close()
        time.sleep(0.2)
        assert inside == []  # one stack still runs
    assert wait_for(lambda: inside == ["alone"])
    time.sleep(0.2)
    assert inside == ["alone"]  # the later stack waits until the alone test is done
    leave.set()
    assert wait_for(lambda: inside == ["alone", "later"])
    alone.join(10), later.join(10)
