"""The late penalty is a rule of the course, applied whenever a score is read (issue #56, "Wrong 1";
autograder/term/scores.py), on SQLite and on PostgreSQL -- the gradebook built through nbgrader's API
as `make grade` leaves it, no kernels.

`make grade` graded a late submission (1 point autograded) under ``LATE_PENALTY=zero`` and
stored nbgrader's penalty of that moment, 1 point. Then, with no `make grade` between:

* a TA's hand grade (21 more points, as Formgrader saves it): every reader still gives 0, never
  the "22 minus a late penalty of 1" the stored number gave;
* the due date moved past the submission (`make deadlines`): every reader gives the full 22;
* an extension (`make extension`), and a grace period (`make settings GRACE_MINUTES=`): the same.

The readers: grades.csv and grades_by_question.csv (`make export`), the LMS export, the class
report, Formgrader's note on raw scores, and the grading run's own totals. The feedback page is
checked in the browser tests (tests/test_formgrader_buttons.py, tests/test_browser_gradebook.py),
after a hand grade typed in Formgrader.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import pytest

from autograder.reports import class_report, export, lms_export
from autograder.store import gradebook
from autograder.term import roster, scores
from autograder.term.course_settings import CourseSettings
from autograder.grading import merge
from autograder.formgrader import raw_scores
from autograder.places import DB_URL_VARIABLE

ASSIGNMENT = "a1"
DUE = datetime.datetime(2026, 3, 1, 17, 0)
SUBMITTED = {"ann": DUE + datetime.timedelta(hours=2), "bob": DUE - datetime.timedelta(hours=1)}


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=[pytest.mark.slow,
                                                                     pytest.mark.xdist_group("postgres")])])
def course_root(request, tmp_path, monkeypatch):
    """A course root whose gradebook is SQLite, or a PostgreSQL server's (`DB_URL=`)."""
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    root = tmp_path / "course_root"
    root.mkdir()
    if request.param == "postgresql":
        from tests.postgres_server import postgres_server

        server = postgres_server()
        database = server.__enter__()
        request.addfinalizer(lambda: server.__exit__(None, None, None))
        monkeypatch.setenv(DB_URL_VARIABLE, database("late_penalty"))
    return root


def graded(root: Path, policy: CourseSettings) -> None:
    """The gradebook as `make grade` leaves it: 22 points possible, 1 autograded, 21 written
    (waiting for a hand grade), the late penalty of that moment stored (merge.apply_late_policy)."""
    with gradebook.open_gradebook(root) as gb:
        gb.update_or_create_assignment(ASSIGNMENT, duedate=DUE)
        gb.update_or_create_notebook(ASSIGNMENT, ASSIGNMENT)
        gb.add_grade_cell("test_x", ASSIGNMENT, ASSIGNMENT, max_score=1, cell_type="code")
        gb.add_grade_cell("why_x", ASSIGNMENT, ASSIGNMENT, max_score=21, cell_type="markdown")
        for student, when in SUBMITTED.items():
            gb.update_or_create_student(student)
            gb.add_submission(ASSIGNMENT, student, timestamp=when)
            gb.find_grade("test_x", ASSIGNMENT, ASSIGNMENT, student).auto_score = 1.0
            written = gb.find_grade("why_x", ASSIGNMENT, ASSIGNMENT, student)
            written.needs_manual_grade = True
            gb.db.commit()
            merge.apply_late_policy(gb, ASSIGNMENT, student, policy)
            gb.db.commit()


def hand_grade(root: Path, student: str, points: float) -> None:
    """As Formgrader saves a score typed in its box."""
    with gradebook.open_gradebook(root) as gb:
        written = gb.find_grade("why_x", ASSIGNMENT, ASSIGNMENT, student)
        written.manual_score, written.needs_manual_grade = points, False
        gb.db.commit()


def every_reader(root: Path) -> dict[str, dict[str, float]]:
    """Each reader's score of each student (after the late penalty)."""
    rows = {r[3]: r for r in export.grade_rows(root)}
    score = export.GRADE_COLUMNS.index("score")
    by_question = root / "by_question.csv"
    export.export_by_question(root, by_question)
    lines = [line.split(",") for line in by_question.read_text().splitlines()[1:]]
    _, _, lms = lms_export.class_grades(root)
    with gradebook.exclusive(root) as gb:
        report = class_report.build(root, ASSIGNMENT, gb)
        late = raw_scores.late_submissions(gb, CourseSettings.load(root), {"assignment": ASSIGNMENT})
        totals = {s: merge._totals(gb.find_submission(ASSIGNMENT, s), CourseSettings.load(root))[0] for s in SUBMITTED}
    listed = {r["student"]: r["score"] for r in report["late"]}
    return {
        "grades.csv": {s: float(rows[s][score]) for s in SUBMITTED},
        "grades_by_question.csv": {s: sum(float(line[5]) for line in lines if line[0] == s) for s in SUBMITTED},
        "lms export": {s: lms[(s, ASSIGNMENT)][0] for s in SUBMITTED},
        "class report": {s: listed.get(s, next(r["score"] for r in report["scores"] if r["student"] == s))
                         for s in SUBMITTED},
        "formgrader note": {s: next((sc.final for st, _, sc in late if st == s),
                                    next(r["score"] for r in report["scores"] if r["student"] == s)) for s in SUBMITTED},
        "grading totals": totals,
    }


def test_no_order_of_commands_skips_the_late_penalty(course_root):
    root = course_root
    CourseSettings(late_penalty="zero").save(root)
    graded(root, CourseSettings.load(root))
    with gradebook.open_gradebook(root) as gb:   # what was stored at grading time: the penalty of 1 point
        assert gb.find_submission(ASSIGNMENT, "ann").late_submission_penalty == 1.0

    hand_grade(root, "ann", 21)                  # a TA grades the written answer in Formgrader
    hand_grade(root, "bob", 21)
    for reader, found in every_reader(root).items():
        assert found == {"ann": 0.0, "bob": 22.0}, (reader, found)
    rows = {r[3]: r for r in export.grade_rows(root)}
    columns = export.GRADE_COLUMNS
    assert (rows["ann"][columns.index("raw_score")], rows["ann"][columns.index("late_submission_penalty")]) == \
        ("22.0", "22.0")

    roster.set_deadlines({ASSIGNMENT: DUE + datetime.timedelta(days=1)}, root, [ASSIGNMENT])   # the due date moves
    for reader, found in every_reader(root).items():
        assert found == {"ann": 22.0, "bob": 22.0}, (reader, found)

    roster.set_deadlines({ASSIGNMENT: DUE}, root, [ASSIGNMENT])                                 # and back
    settings = CourseSettings.load(root)
    settings.extensions[f"ann/{ASSIGNMENT}"] = "2026-03-01 20:00:00"                             # make extension
    settings.save(root)
    assert every_reader(root)["grades.csv"] == {"ann": 22.0, "bob": 22.0}
    settings.extensions.clear()
    settings.grace_minutes = 180                                                                 # a grace period
    settings.save(root)
    assert every_reader(root)["lms export"] == {"ann": 22.0, "bob": 22.0}
    settings.grace_minutes = 0
    settings.save(root)
    assert every_reader(root)["class report"] == {"ann": 0.0, "bob": 22.0}


def test_a_late_notebooks_penalty_is_shared_out_over_its_questions():
    """grades_by_question.csv: a late notebook's penalty taken from its questions in proportion, so
    that they add up to its score (``zero``: every question 0; ``none``: untouched)."""
    class Grade:
        def __init__(self, name, score):
            self.name, self.score = name, score

    class Notebook:
        score = 3.0
        grades = [Grade("q1", 1.0), Grade("q2", 2.0)]

    late = 3600.0
    assert scores.question_scores(Notebook, "ann", CourseSettings(late_penalty="zero"), late) == {
        "q1": (1.0, 0.0), "q2": (2.0, 0.0)}
    assert scores.question_scores(Notebook, "ann", CourseSettings(late_penalty="none"), late) == {
        "q1": (1.0, 1.0), "q2": (2.0, 2.0)}
    assert scores.question_scores(Notebook, "ann", CourseSettings(late_penalty="zero"), 0.0) == {
        "q1": (1.0, 1.0), "q2": (2.0, 2.0)}
