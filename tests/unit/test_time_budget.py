"""tests/conftest.py's time budget: the slow tests it names at the end of a run."""

from tests.conftest import BUDGET_S, over_budget


def test_over_budget_names_the_slow_tests_the_readme_does_not_list():
    seconds = {"tests/e2e/test_a.py::test_slow[x]": BUDGET_S + 80, "tests/e2e/test_a.py::Cls::test_listed": 300,
               "tests/e2e/test_a.py::test_on_time": BUDGET_S - 1, "tests/unit/test_b.py::test_fast": 3}
    readme = "| `test_a.py::Cls::test_listed` | two stack starts |"
    assert over_budget(seconds, readme) == [("tests/e2e/test_a.py::test_slow[x]", BUDGET_S + 80)]
