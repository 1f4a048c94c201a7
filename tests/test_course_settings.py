"""Course settings that stay set (issue #35, items 1 and 7): the late penalty, grace period,
extensions and limits live in the course root's ``course_settings.json``, written by ``make
settings`` / ``make extension``, applied by every path that grades (a plain run, a one-student
regrade as Formgrader's Autograde runs it) and shown in the grading report; a change of them
re-scores the stored results without running a notebook again."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

import pytest

from autograder.grading import grade
from autograder.store import gradebook
from autograder.term import roster
from autograder.term.course_settings import CourseSettings
from autograder.places import REPO_ROOT
from autograder.places import COURSE_ROOT_VARIABLE
from tests.grading_helpers import TINY, tiny_course
from tests.readme_commands import run_readme_command


def make(root: Path, *arguments: str) -> subprocess.CompletedProcess:
    """``make <arguments>`` exactly as typed, on the course root ``root``."""
    return subprocess.run(["make", "--no-print-directory", *arguments], cwd=REPO_ROOT, capture_output=True, text=True,
                          env=dict(os.environ, **{COURSE_ROOT_VARIABLE: str(root)}), timeout=300)


def test_make_settings_keeps_them_and_make_grade_refuses_a_one_run_late_penalty(tmp_path):
    root = tmp_path / "course_root"
    result = make(root, "settings", "LATE_PENALTY=zero", "GRACE_MINUTES=15")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((root / "course_settings.json").read_text())["late_penalty"] == "zero"
    # a flag that would vanish at the next run is refused, with what to type instead
    refused = make(root, "grade", "LATE_PENALTY=zero")
    assert refused.returncode != 0 and "make settings LATE_PENALTY=zero" in refused.stderr, refused.stderr
    # a wrong value is refused and changes nothing
    before = (root / "course_settings.json").read_text()
    wrong = make(root, "settings", "LATE_PENALTY=half")
    assert wrong.returncode != 0 and "late_penalty must be one of none, zero" in wrong.stderr, wrong.stderr
    assert (root / "course_settings.json").read_text() == before
    # the README's commands, as written
    environment = dict(os.environ, **{COURSE_ROOT_VARIABLE: str(root)})
    for command in ("make settings LATE_PENALTY=zero GRACE_MINUTES=15",
                    "make extension STUDENT=alice ASSIGNMENT=01_mha_shapes UNTIL=2026-03-08T17:00+01:00"):
        done = run_readme_command(command, env=environment)
        assert done.returncode == 0, done.stdout + done.stderr
    shown = run_readme_command("make settings", env=environment)
    assert "late penalty: zero" in shown.stdout and "grace period: 15 minutes" in shown.stdout, shown.stdout
    # `make extension` alone says what it needs, and changes nothing
    usage = run_readme_command("make extension", env=environment)
    assert usage.returncode != 0 and "usage: make extension STUDENT=<id> ASSIGNMENT=<name> UNTIL=" in usage.stdout, \
        usage.stdout + usage.stderr
    assert CourseSettings.load(root).extensions == {"alice/01_mha_shapes": "2026-03-08 16:00:00"}
    assert make(root, "extension", "STUDENT=alice", "ASSIGNMENT=01_mha_shapes", "REMOVE=1").returncode == 0
    assert CourseSettings.load(root).extensions == {}


def stamp(root: Path, student: str, moment: datetime.datetime) -> None:
    (root / "submitted" / student / TINY / "timestamp.txt").write_text(moment.strftime("%Y-%m-%d %H:%M:%S.%f UTC"))


@pytest.mark.slow
def test_every_grading_path_applies_the_course_settings_and_a_change_rescores_without_running_again(tmp_path):
    due = datetime.datetime(2026, 1, 10, 12, 0)
    root = tiny_course(tmp_path / "course_root", {"ann": "value = 42", "bob": "value = 42", "cy": "value = 42"})
    stamp(root, "ann", due + datetime.timedelta(minutes=10))   # ten minutes late
    stamp(root, "bob", due + datetime.timedelta(days=1))       # a day late
    stamp(root, "cy", due - datetime.timedelta(hours=1))
    roster.set_deadlines({TINY: due}, root)                    # make deadlines, before the first grading
    CourseSettings(late_penalty="zero", timeout=30).save(root)  # make settings LATE_PENALTY=zero TIMEOUT=30

    # Formgrader's Autograde button runs this one-submission regrade (pipeline_buttons.py)
    assert grade.main(["--root", str(root), "--student", "ann", "--assignment", TINY, "--jobs", "1"]) == 0
    with gradebook.open_gradebook(root) as gb:
        assert gb.find_submission(TINY, "ann").late_submission_penalty == 1.0
    # the next plain run keeps the penalty (ann unchanged), and applies it to bob
    outcomes = {o.student: o for o in grade.grade(root, jobs=1, log=lambda *_: None)}
    assert {s: (o.status, o.score, o.late_penalty) for s, o in outcomes.items()} == {
        "ann": ("unchanged", 0.0, 1.0), "bob": ("graded", 0.0, 1.0), "cy": ("graded", 1.0, 0.0)}
    report = (root / "reports" / "grading_report.md").read_text()
    assert "- late penalty: zero" in report and "- time limit per cell: 30 s" in report, report

    # a grace period and an extension re-score the stored results: nothing runs again
    settings = CourseSettings.load(root)
    settings.grace_minutes = 15
    settings.extensions[f"bob/{TINY}"] = "2026-01-11 13:00:00"
    settings.save(root)
    log: list[str] = []
    outcomes = {o.student: o for o in grade.grade(root, jobs=1, log=log.append)}
    assert {s: (o.status, o.score, o.late_penalty) for s, o in outcomes.items()} == {
        "ann": ("unchanged", 1.0, 0.0), "bob": ("unchanged", 1.0, 0.0), "cy": ("unchanged", 1.0, 0.0)}, log
    assert not any(o.nbgrader_pids for o in outcomes.values()), "a penalty change ran a notebook again"
    assert "re-scored: late penalty 1 -> 0" in "\n".join(log), log
    with gradebook.open_gradebook(root) as gb:   # nbgrader's own record of the extension
        assert gb.find_submission(TINY, "bob").extension == datetime.timedelta(days=1, hours=1)
    report = (root / "reports" / "grading_report.md").read_text()
    assert "grace period: 15 minutes" in report and f"bob/{TINY} due 2026-01-11 13:00:00 UTC" in report, report
    # every run's report is kept, and listed
    history = (root / "reports" / "grading_history.md").read_text().splitlines()
    assert len(list((root / "reports" / "grading").glob("*.md"))) == 3 and len(history) == 2 + 3, history


def test_a_date_without_an_offset_is_in_the_course_time_zone_and_says_so(tmp_path):
    """Issue #56: a due date without an offset was silently UTC. It is in the course's time zone
    (`make settings TIME_ZONE=`), and `make deadlines` and `make extension` print both times."""
    root = tmp_path / "course_root"
    environment = dict(os.environ, **{COURSE_ROOT_VARIABLE: str(root)})
    wrong = make(root, "settings", "TIME_ZONE=Mars/Olympus_Mons")
    assert wrong.returncode != 0 and "time_zone must be a time zone's name" in wrong.stderr, wrong.stderr
    zoned = run_readme_command("make settings TIME_ZONE=Europe/Berlin", env=environment)
    assert zoned.returncode == 0 and "time_zone: UTC -> Europe/Berlin" in zoned.stdout, zoned.stdout + zoned.stderr
    assert "time zone: Europe/Berlin" in make(root, "settings").stdout
    deadlines = tmp_path / "deadlines.csv"
    deadlines.write_text("assignment,duedate\n01_mha_shapes,2026-03-01T17:00\n02_numpy_walkthrough,2026-07-01\n")
    done = run_readme_command("make deadlines", env=dict(environment, DEADLINES=str(deadlines)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "01_mha_shapes: due 2026-03-01 16:00:00 UTC (2026-03-01 17:00 Europe/Berlin)" in done.stdout, done.stdout
    assert "02_numpy_walkthrough: due 2026-07-01 21:59:59 UTC (2026-07-01 23:59 Europe/Berlin)" in done.stdout
    assert "written without an offset are in the course's time zone, Europe/Berlin" in done.stdout
    with gradebook.open_gradebook(root) as gb:
        assert gb.find_assignment("01_mha_shapes").duedate == datetime.datetime(2026, 3, 1, 16, 0)
    extended = make(root, "extension", "STUDENT=alice", "ASSIGNMENT=01_mha_shapes", "UNTIL=2026-03-08T17:00")
    assert "due 2026-03-08 16:00:00 UTC (2026-03-08 17:00 Europe/Berlin)" in extended.stdout, extended.stdout
    assert "read in the course's time zone, Europe/Berlin" in extended.stdout
    offset = make(root, "extension", "STUDENT=bob", "ASSIGNMENT=01_mha_shapes", "UNTIL=2026-03-08T17:00+00:00")
    assert "2026-03-08 17:00:00 UTC" in offset.stdout and "without an offset" not in offset.stdout, offset.stdout
