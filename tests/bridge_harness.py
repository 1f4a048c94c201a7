"""The checks as the trusted checker runs them, inside one test process.

:func:`bridged` connects a :class:`attention_lab.bridge.checker_side.Bridge` to an agent answering from a
thread of this process (a socket pair instead of a kernel's socket), so that a test can hand a
check the proxies grading hands it. :func:`through_the_bridge` wraps a check so that every answer
it is given reaches it that way: a test module that runs its checks both ways proves that each
hint and each accepted style means the same in the lab and in grading.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import socket
import threading
import types
from typing import Any, Callable, Iterable, Iterator

from attention_lab.bridge.kernel_side import Agent, answer_until_done
from attention_lab.bridge.checker_side import Bridge
from attention_lab.checking import _student_namespace

TIMEOUT = 600  # a test cell's limit in grading is 120 s; on a loaded test machine, more


@contextlib.contextmanager
def bridged(namespace: dict[str, Any], code: list[str] | None = None, agent: type[Agent] = Agent) -> Iterator[Bridge]:
    """A bridge to an agent (of class ``agent``) whose notebook globals are ``namespace``; ``code``: the
    submitted notebook's code cells, which the checks then read as the checker does in grading."""
    from attention_lab.code_inspection import SubmittedCode

    checker_end, kernel_end = socket.socketpair()
    thread = threading.Thread(target=answer_until_done, args=(agent(namespace), kernel_end), daemon=True)
    thread.start()
    bridge = Bridge(checker_end, TIMEOUT)
    if code is not None:
        bridge.submitted = SubmittedCode(code)
    try:
        yield bridge
    finally:
        bridge.close()
        thread.join(timeout=TIMEOUT)


def through_the_bridge(check: Callable) -> Callable:
    """``check``, given proxies of the answers it is called with (its positional arguments)."""
    @functools.wraps(check)
    def run(*answers: Any, **kwargs: Any) -> Any:
        names = {f"answer_{index}": answer for index, answer in enumerate(answers)}
        # the notebook: where the first answer was defined (its helpers), and the answers
        namespace = {**(_student_namespace(answers[0]) or {}), **names} if answers else names
        with bridged(namespace) as bridge:
            found = bridge.lookup(list(names))
            return check(*[found.get(name) for name in names], **kwargs)

    return run


class BridgedChecks:
    """A check module whose ``check_*`` functions get their answers through the bridge."""

    def __init__(self, module: Any):
        object.__setattr__(self, "_module", module)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._module, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._module, name)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        return through_the_bridge(value) if name.startswith("check_") and callable(value) else value


def run_both_ways(name: str = "checks"):
    """An autouse fixture for a test module: every test runs with the module global ``name`` (a check
    module) as it is (the lab), then through the bridge (grading) -- where it calls a check at all
    (:func:`calls_the_checks`; tests/conftest.py deselects the other grading runs: they would run
    the same code again)."""
    import pytest

    @pytest.fixture(autouse=True, params=["lab", "grading"])
    def where_checks_run(request, monkeypatch):
        if request.param == "grading":
            monkeypatch.setitem(request.module.__dict__, name, BridgedChecks(request.module.__dict__[name]))
        return request.param

    return where_checks_run


def _global_names(code: types.CodeType) -> set[str]:
    """The names a code object and the code nested in it (lambdas, comprehensions, inner functions) look up."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _global_names(constant)
    return names


def calls_the_checks(test: Callable, module: types.ModuleType, fixturenames: Iterable[str] = (),
                     name: str = "checks", fixture: str = "where_checks_run") -> bool:
    """Does ``test`` (a test function of ``module``) reach the module global ``name``: itself, through
    a function, class or fixture of its module (followed to any depth), or by asking where its checks
    run (``fixture`` among its own arguments)? Conservative: a name of the module that might lead
    there is followed."""
    if fixture in inspect.signature(test).parameters:
        return True
    seen: set[int] = set()

    def reaches(obj: Any) -> bool:
        if id(obj) in seen:
            return False
        seen.add(id(obj))
        if isinstance(obj, (list, tuple, set, frozenset, dict)):  # a table of cases: its functions
            return any(reaches(item) for item in (obj.values() if isinstance(obj, dict) else obj))
        wrapped = getattr(obj, "_get_wrapped_function", None)  # a pytest fixture: its function
        obj = wrapped() if callable(wrapped) else getattr(obj, "__func__", obj)  # static and class methods
        obj = inspect.unwrap(obj) if callable(obj) else obj
        if getattr(obj, "__module__", None) != module.__name__:
            return False  # pytest's, the course's, the standard library's: not the test module's
        if inspect.isclass(obj):
            return any(reaches(member) for member in vars(obj).values())
        code = getattr(obj, "__code__", None)
        if code is None:
            return False
        names = _global_names(code)
        return name in names or any(reaches(module.__dict__[other]) for other in names if other in module.__dict__)

    return reaches(test) or any(reaches(module.__dict__[fixture_name]) for fixture_name in fixturenames
                                if fixture_name in module.__dict__)
