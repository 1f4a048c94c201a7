"""A grading run's limits are one dataclass (autograder.limits.Limits), from the course settings to
the nbgrader process that applies them: their defaults and the interrupted kernel's grace once."""

from __future__ import annotations

import dataclasses
import json
import re

from autograder.grading import nbgrader_process
from autograder.limits import Limits
from autograder.term.course_settings import CourseSettings


def test_a_course_without_settings_grades_with_the_default_limits():
    assert CourseSettings().limits() == Limits()
    course = CourseSettings(timeout=30, startup_timeout=90, memory_mb=2048, file_mb=64)
    limits = course.limits(attempts=2, sandbox="off")
    assert (limits.timeout, limits.startup_timeout, limits.memory_mb, limits.file_mb) == (30, 90, 2048, 64)
    assert (limits.attempts, limits.sandbox, limits.disk_mb) == (2, "off", Limits.disk_mb)


def test_an_interrupted_kernel_has_a_quarter_of_the_cell_limit_and_never_less_than_the_least_grace():
    assert Limits(timeout=120).grace == 30
    assert Limits(timeout=20, unresponsive_grace=10).grace == 10


def test_the_fingerprint_of_the_default_limits_is_the_one_earlier_runs_recorded():
    """state.json keeps each submission's fingerprint: a field renamed or a default moved would
    regrade every submission of a term once; the limits that change nothing a notebook does are
    not in it."""
    assert json.loads(Limits().fingerprint()) == {
        "disk_mb": 512, "file_mb": 256, "max_output_bytes": 1000000, "memory_mb": 4096, "processes": 256,
        "sandbox": "on", "timeout": 120}
    assert Limits(attempts=2, threads=4, startup_timeout=9).fingerprint() == Limits().fingerprint()


def test_the_nbgrader_process_applies_the_limits_it_is_given(monkeypatch):
    """The task's limits reach nbgrader's Execute: the cell limit, the start-up budget, the grace
    (the same formula as the worker's) and the output kept."""
    seen = {}
    monkeypatch.setattr(nbgrader_process, "run_in_process", lambda *arguments, config: seen.update(config=config) or 0)
    limits = Limits(timeout=40, startup_timeout=70, unresponsive_grace=3, max_output_bytes=5000)
    task = {"root": "/nowhere", "student": "ann", "assignment": "not_checked", "limits": dataclasses.asdict(limits),
            "kernel": "k", "report": "/nowhere/report.json", "skip": {}}
    assert nbgrader_process.autograde(task) == 0
    execute = seen["config"].GuardedExecute
    assert (execute.timeout, execute.startup_timeout, execute.max_output_bytes) == (40, 70, 5000)
    assert execute.unresponsive_grace == execute.iopub_timeout == limits.grace == 10


def test_the_reference_page_states_every_limit_with_its_default():
    """docs/reference.md's table of limits: one row per field of Limits, with the default it has."""
    from autograder.places import REPO_ROOT

    text = (REPO_ROOT / "docs" / "reference.md").read_text()
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ")]
    rows = [cells for cells in rows if re.fullmatch(r"`\w+`", cells[1].strip())]
    stated = {cells[1].strip().strip("`"): cells[2].strip() for cells in rows}
    assert stated == {field.name: str(field.default) for field in dataclasses.fields(Limits)}
