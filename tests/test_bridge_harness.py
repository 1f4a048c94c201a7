"""tests/bridge_harness.calls_the_checks: which check tests run a second time, through the bridge."""

from __future__ import annotations

import sys
import textwrap
import types

import pytest

from tests.bridge_harness import calls_the_checks

TEST_MODULE = textwrap.dedent('''
    import pytest

    checks = object()  # the check module a test module runs both ways

    def helper(answer):
        return checks.check_it(answer)

    class Runner:
        def run(self):
            return helper(1)

    @pytest.fixture
    def checked():
        return checks.check_it

    def draw():
        return 1

    class Cases:
        @staticmethod
        def wrong():
            return checks.check_it(0)

    CASES = [("right", lambda: 1), ("wrong", lambda: checks.check_it(0))]

    def test_direct():
        checks.check_it(1)

    def test_through_a_helper():
        helper(1)

    def test_through_a_class():
        Runner().run()

    def test_in_a_comprehension():
        [checks.check_it(n) for n in range(2)]

    def test_through_a_fixture(checked):
        pass

    def test_asks_where(where_checks_run):
        pass

    def test_through_a_static_method():
        Cases.wrong()

    def test_through_a_table_of_cases():
        for label, case in CASES:
            case()

    def test_a_widget():
        draw()

    def test_arithmetic():
        assert sum(range(3)) == 3
''')


@pytest.fixture(scope="module")
def module():
    module = types.ModuleType("harness_example")
    sys.modules[module.__name__] = module
    try:
        exec(compile(TEST_MODULE, "harness_example.py", "exec"), module.__dict__)
        yield module
    finally:
        del sys.modules[module.__name__]


@pytest.mark.parametrize("test, fixtures", [("test_direct", ()), ("test_through_a_helper", ()),
                                            ("test_through_a_class", ()), ("test_in_a_comprehension", ()),
                                            ("test_through_a_static_method", ()), ("test_through_a_table_of_cases", ()),
                                            ("test_through_a_fixture", ("checked",)),
                                            ("test_asks_where", ("where_checks_run",))])
def test_a_test_that_reaches_a_check_runs_both_ways(module, test, fixtures):
    assert calls_the_checks(getattr(module, test), module, ("where_checks_run", *fixtures))


@pytest.mark.parametrize("test", ["test_a_widget", "test_arithmetic"])
def test_a_test_that_calls_no_check_runs_in_the_lab_only(module, test):
    assert not calls_the_checks(getattr(module, test), module, ("where_checks_run",))
