"""What a grading run tells the instructor (parent process): console lines and
``reports/grading_report.{md,json}`` (this run's; every run's is kept in ``reports/grading/``,
listed in ``reports/grading_history.md``).

A score is the gradebook's total (hand grades included, the late penalty deducted); one that
still waits for grading by hand says so ("19 / 20, 1 point awaiting hand grading"), in the
console and in the report alike.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from autograder.grading.plan import Outcome
from autograder.grading.trusted.checker_client import CHECKED_OUTSIDE_THE_KERNEL
from autograder.isolation import cgroups, sandbox
from autograder.limits import Limits
from autograder.store import results
from autograder.store.run_reports import keep_report
from autograder.term.course_settings import CourseSettings


def score_text(outcome: Outcome) -> str:
    """``19 / 20``, with what is still missing from it; ``-`` when there is no score."""
    if outcome.score is None or outcome.max_score is None:
        return "-"
    text = f"{outcome.score:g} / {outcome.max_score:g}"
    notes = []
    if outcome.pending:
        notes.append(f"incomplete: {outcome.pending:g} point{'s' if outcome.pending != 1 else ''} "
                     "awaiting hand grading")
    if outcome.late_penalty:
        notes.append(f"late penalty {outcome.late_penalty:g}")
    return text + (f" ({'; '.join(notes)})" if notes else "")


def console_line(outcome: Outcome) -> str:
    score = score_text(outcome) if outcome.score is not None else "NOT GRADED"
    extra = "; ".join(results.describe(i) for i in outcome.incidents)
    seconds = f" ({outcome.seconds:.0f} s)" if outcome.status != "unchanged" else ""
    return (f"  {outcome.status:9s} {outcome.student}/{outcome.assignment}: {score}{seconds}"
            + (f" [{extra}]" if extra else "") + "".join(f" -- {note}" for note in outcome.notes)
            + (f" -- {outcome.error.splitlines()[0]}" if outcome.error else ""))


def summary(outcomes: list[Outcome]) -> str:
    failed = sum(o.status == "failed" for o in outcomes)
    graded = sum(o.status == "graded" for o in outcomes)
    incomplete = sum(bool(o.pending) for o in outcomes if o.status != "failed")
    text = f"graded {graded}, unchanged {len(outcomes) - graded - failed}, failed {failed}"
    if incomplete:
        text += f"; {incomplete} score{'s' if incomplete != 1 else ''} incomplete (awaiting hand grading in Formgrader)"
    return text


def verdicts_line(outcomes: list[Outcome]) -> str:
    """Where the verdicts of this run's notebooks were decided (docs/design.md says why)."""
    notebooks = sorted({test["notebook"] for o in outcomes for test in o.tests} or {o.assignment for o in outcomes})
    outside = [n for n in notebooks if n in CHECKED_OUTSIDE_THE_KERNEL]
    inside = [n for n in notebooks if n not in CHECKED_OUTSIDE_THE_KERNEL]
    parts = []
    if outside:
        parts.append(f"decided by the trusted checker, outside the student's kernel: {', '.join(outside)}")
    if inside:
        parts.append(f"decided inside the student's kernel (a submission's code could forge them): {', '.join(inside)}")
    return "Verdicts " + "; ".join(parts) + "." if parts else "No notebook was graded."


def limits_in_force(limits: Limits) -> list[dict]:
    """Each limit on student code, and whether it holds on this machine (where the embedded
    cluster's workers run): ``{"limit", "holds", "how"}``."""
    sandboxed = limits.sandboxed and sandbox.bwrap_path() is not None
    group = cgroups.available() if sandboxed else None
    no_group = ("no control group here (cgroup v2 delegation or writable cgroup v1 needed)" if sandboxed
                else "no sandbox (--sandbox off)")
    per_process = f"{limits.memory_mb} MB of address space per process"

    def limit(name: str, holds: bool, how: str) -> dict:
        return {"limit": name, "holds": holds, "how": how}

    return [
        limit("memory of the whole sandbox", group is not None,
              f"{limits.memory_mb} MB for all its processes ({group})" if group else f"{no_group}; only {per_process}"),
        limit("memory per process", True, per_process),
        limit("processes", group is not None,
              f"{limits.processes} processes and threads at once ({group})" if group else no_group),
        limit("file size", True, f"{limits.file_mb} MB per file"),
        limit("disk", sandboxed,
              f"{limits.disk_mb} MB of /tmp and of /dev/shm (tmpfs), {limits.disk_mb} MB in its working and socket "
              "folders (checked every second)" if sandboxed else "no sandbox: only the per-file limit"),
        limit("wall-clock time", True, f"{limits.timeout} s a cell, {limits.notebook_timeout} s an attempt, "
              f"{limits.submission_timeout} s a submission (all attempts)"),
        limit("CPU time", group is not None,
              f"{limits.cpu_seconds} s a submission, all its processes and attempts ({group})" if group
              else f"{no_group}; only the wall-clock limits"),
        limit("network", sandboxed, "none in the sandbox" if sandboxed else "no sandbox: the machine's network"),
    ]


def limit_lines(in_force: list[dict]) -> list[str]:
    """The console's lines: the limits that hold on this machine, then one line for each that does not."""
    holding = [item["limit"] for item in in_force if item["holds"]]
    lines = [f"limits that hold here: {', '.join(holding)}"] if holding else []
    return lines + [f"WARNING: limit that does NOT hold here: {item['limit']}: {item['how']}"
                    for item in in_force if not item["holds"]]


def full_error(outcome: Outcome) -> str:
    """A failed submission's error, every line of it, indented under its console line."""
    return "\n".join(f"      {line}" for line in outcome.error.splitlines())


def write_report(root: Path, outcomes: list[Outcome], problems: list[str], run_limits: Limits,
                 isolation: str, engine: str = "", course: CourseSettings | None = None,
                 in_force: list[dict] | None = None) -> Path:
    """This run's report, ``reports/grading_report.{md,json}``, kept with every earlier run's
    (:func:`autograder.store.run_reports.keep_report`): a one-student regrade never wipes the
    record of the class's run."""
    course = course or CourseSettings()
    data = {"isolation": isolation, "engine": engine, "verdicts": verdicts_line(outcomes), "limits": in_force or [],
            "course_settings": dataclasses.asdict(course), "run_limits": dataclasses.asdict(run_limits),
            "problems": problems, "submissions": [o.as_dict() for o in outcomes]}
    lines = ["", f"Isolation: {isolation}", "", verdicts_line(outcomes), ""]
    if in_force:
        lines += ["| limit on student code | holds here | how |", "|---|---|---|"]
        lines += [f"| {item['limit']} | {'yes' if item['holds'] else '**no**'} | {item['how']} |" for item in in_force]
        lines += [""]
    if engine:
        lines += [f"Engine: {engine}", ""]
    lines += ["Course settings (`make settings`):", ""] + [f"- {line}" for line in course.describe()]
    if (run_limits.timeout, run_limits.startup_timeout, run_limits.memory_mb, run_limits.file_mb) != (
            course.timeout, course.startup_timeout, course.memory_mb, course.file_mb):
        lines.append(f"- for this run only: {run_limits.timeout} s per cell, {run_limits.startup_timeout} s start-up, "
                     f"{run_limits.memory_mb} MB memory, {run_limits.file_mb} MB files")
    lines += ["", "| student | assignment | status | score | notes |", "|---|---|---|---|---|"]
    for o in outcomes:
        notes = "; ".join([results.describe(i) for i in o.incidents] + o.notes)
        if o.status == "failed":
            notes = (o.error.splitlines() or ["failed"])[0] + ("; " + notes if notes else "")
        lines.append(f"| {o.student} | {o.assignment} | {o.status} | {score_text(o)} | {notes.replace('|', '/')} |")
    if problems:
        lines += ["", "## Not graded", ""] + [f"- {p}" for p in problems]
    for o in (o for o in outcomes if o.status == "failed"):
        lines += ["", f"## {o.student} / {o.assignment}: could not be graded", "", "```", o.error, "```"]
    return keep_report(root, "grading", "Grading report", lines, data, summary(outcomes))
