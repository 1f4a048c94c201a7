"""The checks as the trusted checker runs them, inside one test process.

:func:`bridged` connects a :class:`attention_lab.bridge.remote.Bridge` to an agent answering from a
thread of this process (a socket pair instead of a kernel's socket), so that a test can hand a
check the proxies grading hands it. :func:`through_the_bridge` wraps a check so that every answer
it is given reaches it that way: a test module that runs its checks both ways proves that each
hint and each accepted style means the same in the lab and in grading.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
from typing import Any, Callable, Iterator

from attention_lab.bridge.agent import Agent, answer_until_done
from attention_lab.bridge.remote import Bridge
from attention_lab.checking import _student_namespace

TIMEOUT = 600  # a test cell's limit in grading is 120 s; on a loaded test machine, more


@contextlib.contextmanager
def bridged(namespace: dict[str, Any]) -> Iterator[Bridge]:
    """A bridge to an agent whose notebook globals are ``namespace``."""
    checker_end, kernel_end = socket.socketpair()
    thread = threading.Thread(target=answer_until_done, args=(Agent(namespace), kernel_end), daemon=True)
    thread.start()
    bridge = Bridge(checker_end, TIMEOUT)
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
    module) as it is (the lab), then through the bridge (grading)."""
    import pytest

    @pytest.fixture(autouse=True, params=["lab", "grading"])
    def where_checks_run(request, monkeypatch):
        if request.param == "grading":
            monkeypatch.setitem(request.module.__dict__, name, BridgedChecks(request.module.__dict__[name]))
        return request.param

    return where_checks_run
