"""The per-test budgets of tests/conftest.py: a test past its tier's fails, with the numbers."""

import pathlib

import conftest

TESTS = pathlib.Path(__file__).parent


def test_a_test_within_its_budget_passes():
    assert conftest.over_budget(conftest.BUDGET_SEC["make test"], "make test") is None
    assert conftest.over_budget(conftest.BUDGET_SEC["make test"] + 1, "ci") is None  # ci's is larger


def test_a_test_past_its_budget_fails_with_the_numbers():
    budget = conftest.BUDGET_SEC["make test"]
    assert conftest.over_budget(budget + 1, "make test").startswith(
        f"took {budget + 1:.1f} s, past the {budget} s budget of a `make test` test")
    assert conftest.over_budget(conftest.BUDGET_SEC["ci"] + 1, "ci") is not None


def test_the_suite_fails_a_test_past_its_budget(pytester, monkeypatch):
    """The real conftest in a pytest run of its own, its budgets scaled down to 0.06 s."""
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.syspathinsert(str(TESTS))  # conftest imports xla_flags from here
    pytester.makepyfile(test_timed="import time\n\ndef test_slow():\n    time.sleep(0.5)\n\n"
                                   "def test_fast():\n    pass\n")
    monkeypatch.setenv("MAXLM_TEST_BUDGET_SCALE", str(0.06 / conftest.BUDGET_SEC["make test"]))
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    result = pytester.runpytest_subprocess("-p", "no:xdist", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_slow (call) took 0.5 s, past the 0.06 s budget of a `make test` test*"])
