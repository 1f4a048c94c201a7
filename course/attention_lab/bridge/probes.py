"""Measurements taken where the student's code runs, read where the verdict is made.

Some checks need more than a call's result: which PyTorch functions the answer called (a
"from scratch" exercise), which inputs it changed in place, which of the student's helpers
ran, how many FLOPs a module counts.  A :class:`Probe` is a context manager around one call of
the student's code; its findings are plain data.  In the lab the check enters it around the
call in the student's own kernel; in grading the checker sends ``(module, class, parameters)``
and the kernel's copy of the same class measures the call there and sends its findings back
(:meth:`Probe.findings`), which the checker's probe takes in (:meth:`Probe.accept`).  Each method
of :class:`Probe` is marked with the side it runs on in grading (:func:`in_the_kernel`,
:func:`in_the_checker`; an override runs where the method it overrides runs); in the lab both
sides are the student's kernel.

What a measurement can be lied to about: it runs in the student's process, so a student who
rewrites the course package in their kernel can make it report anything.  What that buys
them is at most the test whose check reads it (a "from scratch" rule, a note), never the
numbers of their answer, which the checker compares itself, and never another test's or
another student's points.
"""

from __future__ import annotations

import importlib
from typing import Any

from attention_lab.bridge import wire

MAX_FINDINGS = 10_000  # entries of a list of findings


def in_the_kernel(method):
    """Marks a probe method that runs where the student's code runs, in the kernel's copy of the
    probe: what it returns is that process's word, untrusted data once it crosses."""
    method.side = "kernel"
    return method


def in_the_checker(method):
    """Marks a probe method that runs where the verdict is made, in the checker's copy of the probe."""
    method.side = "checker"
    return method


class Probe:
    """A measurement around one call of the student's code (see the module docstring).

    Subclasses set :attr:`parameters` (data: what the kernel's copy is built from), implement
    ``__enter__``/``__exit__``, :meth:`findings` and, when findings need checking, :meth:`accept`.
    """

    def __init__(self, **parameters: Any):   # on both sides: each copy is built from the parameters
        self.parameters = parameters
        self.result: Any = None

    @in_the_kernel
    def __enter__(self) -> "Probe":
        return self

    @in_the_kernel
    def __exit__(self, *exc: Any) -> None:
        self.result = self.findings()

    @in_the_kernel
    def findings(self) -> Any:
        raise NotImplementedError

    @in_the_kernel
    def returned(self, result: Any, args: tuple) -> None:
        """Where the call ran, once it returned: its result and the arguments it was given (a probe that
        measures what a call returned: what an autograd Function saved for its backward)."""

    @in_the_checker
    def accept(self, findings: Any) -> None:
        """Take in the findings the kernel's copy of this probe sent (data, untrusted)."""
        self.result = findings

    @in_the_kernel
    def bind(self, agent: Any) -> None:
        """The agent answering (its namespace, its handles), before the call."""

    @in_the_checker
    def failure(self) -> Exception | None:
        """The check's failure that what this probe saw earns (a forbidden call), or None; the call's
        own outcome comes after it."""
        return None

    @in_the_kernel
    def measure(self, obj: Any) -> Any:
        """A probe that measures an object itself (its code) rather than a call: its findings."""
        raise NotImplementedError(f"{type(self).__name__} measures calls, not objects")


def spec(probe: Probe) -> list:
    cls = type(probe)
    return [cls.__module__, cls.__qualname__, probe.parameters]


def from_requests(requests: Any, agent: Any) -> list[Probe]:
    """The kernel's probes for a call: classes of the course package only, by name."""
    if not isinstance(requests, list):
        raise wire.WireError("malformed probes")
    probes = []
    for item in requests:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and isinstance(item[1], str)
                and (item[0] == "attention_lab" or item[0].startswith("attention_lab.")) and item[1].isidentifier()):
            raise wire.WireError("a probe that is not one of the course's")
        try:
            cls = getattr(importlib.import_module(item[0]), item[1])
        except (ImportError, AttributeError):
            raise wire.WireError(f"no probe {item[0]}.{item[1]}") from None
        if not (isinstance(cls, type) and issubclass(cls, Probe)):
            raise wire.WireError(f"{item[0]}.{item[1]} is not a probe")
        parameters = agent.decode(item[2], agent.current_buffers)
        if not isinstance(parameters, dict) or not all(isinstance(k, str) for k in parameters):
            raise wire.WireError("malformed probe parameters")
        probe = cls(**parameters)
        probe.bind(agent)
        probes.append(probe)
    return probes


def strings(findings: Any, limit: int = MAX_FINDINGS) -> list[str]:
    """``findings`` checked to be a list of short strings."""
    if not isinstance(findings, (list, tuple)) or len(findings) > limit or \
            not all(isinstance(item, str) and len(item) < 500 for item in findings):
        raise wire.WireError("malformed findings")
    return list(findings)
