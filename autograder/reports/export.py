"""Export the grades.

    python -m autograder.reports.export          # make export

* ``autograder/course_root/grades.csv``: one row per student and assignment, with nbgrader's
  own columns (``nbgrader export``'s: due date, submission time, raw_score, late penalty,
  score, max_score, ...; the late penalty is the course's rule applied now,
  :mod:`autograder.term.scores`), plus ``manual_grading_pending`` (``yes`` while a written
  answer of that submission still awaits grading by hand, in Formgrader), ``status``
  (``not submitted`` -- its scores are left empty, never 0 --, ``incomplete`` while hand
  grading is pending, ``complete``) and ``lms_user_id`` (from the roster, for the LMS upload).
* ``autograder/course_root/grades_by_question.csv``: student, assignment, notebook,
  grade_id, raw_score, score (after the late penalty: a late notebook's penalty shared out over
  its questions, :func:`autograder.term.scores.question_scores`), max_score, manual_grading_pending,
  one row per graded cell.

Both are written with the csv module's quoting (a name with a comma or a quote stays one
cell), each file whole or not at all (a temporary file renamed over the old one), and a
cell that a spreadsheet or an LMS import would read as a formula (``=2+5``, ``@SUM(1+1)``,
a leading ``+``, ``-``, tab or carriage return: a student chooses their folder name) starts
with a ``'``, the OWASP rule; numbers, negative ones too, stay numbers.

Scores are the gradebook's: a score or extra credit set by hand (Formgrader) counts, and the
late penalty is taken from it as the course settings say when the export is written.
"""

from __future__ import annotations

import csv
import os
import re
import sys
import tempfile
from pathlib import Path

from autograder.command_line import command_line
from autograder.places import COURSE_ROOT
from autograder.store import gradebook
from autograder.term import scores
from autograder.term.course_settings import CourseSettings

PENDING = "manual_grading_pending"
QUESTION_COLUMNS = ["student", "assignment", "notebook", "grade_id", "raw_score", "score", "max_score", PENDING]
STATUS = "status"
LMS_ID = "lms_user_id"
# nbgrader export's columns (its CsvExportPlugin), then the pipeline's own
NBGRADER_COLUMNS = ["assignment", "duedate", "timestamp", "student_id", "last_name", "first_name", "email",
                    "raw_score", "late_submission_penalty", "score", "max_score"]
GRADE_COLUMNS = [*NBGRADER_COLUMNS, PENDING, STATUS, LMS_ID]

# --------------------------------------------------------------------------------------
# Writing a CSV file that a spreadsheet or an LMS opens safely
# --------------------------------------------------------------------------------------

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def spreadsheet_safe(value) -> str:
    """The text of one CSV cell that no spreadsheet evaluates: one starting like a formula
    (=, +, -, @, tab, carriage return) gets a leading ``'`` (OWASP's CSV-injection rule);
    a number (``-1.5``) is left a number."""
    text = "" if value is None else str(value)
    if text.startswith(FORMULA_START) and not NUMBER.fullmatch(text):
        return "'" + text
    return text


def write_csv(path: Path, header: list[str], rows: list[list]) -> None:
    """``path`` with ``header`` and ``rows``, quoted by the csv module, every cell
    :func:`spreadsheet_safe`; written to a temporary file beside it, then renamed over it, so
    that a failure never leaves a truncated file (the previous one stays)."""
    path = Path(path)
    handle = tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
                                         newline="", encoding="utf-8", delete=False)
    try:
        with handle:
            writer = csv.writer(handle)
            writer.writerow(header)
            writer.writerows([spreadsheet_safe(value) for value in row] for row in rows)
        os.chmod(handle.name, 0o644)
        os.replace(handle.name, path)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------------------
# The exports
# --------------------------------------------------------------------------------------

def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def export_by_question(root: Path, path: Path) -> int:
    settings = CourseSettings.load(root)
    rows = []
    with gradebook.exclusive(root) as gb:
        for assignment in gb.assignments:
            for submission in assignment.submissions:
                student = submission.student.id
                late = scores.seconds_late(submission, settings)
                for notebook in submission.notebooks:
                    shared = scores.question_scores(notebook, student, settings, late)
                    for grade in notebook.grades:
                        raw, score = shared[grade.name]
                        rows.append([student, assignment.name, notebook.name, grade.name, f"{raw:g}",
                                     f"{score:g}", f"{grade.max_score:g}", _yes_no(grade.needs_manual_grade)])
    rows.sort()
    write_csv(path, QUESTION_COLUMNS, rows)
    return len(rows)


def _text(value) -> str:
    """A value as nbgrader export writes it (None: empty)."""
    return "" if value is None else str(value)


def grade_rows(root: Path) -> list[list[str]]:
    """grades.csv's rows (GRADE_COLUMNS), in nbgrader export's order: each assignment, each
    student of the gradebook. A student who submitted nothing gets empty scores, not 0, and
    ``not submitted``; ``incomplete`` while a written answer waits for a hand grade."""
    settings = CourseSettings.load(root)
    rows = []
    with gradebook.exclusive(root) as gb:
        for assignment in gb.assignments:
            submitted = {s.student.id: s for s in assignment.submissions}
            for student in gb.students:
                row = {"assignment": assignment.name, "duedate": _text(assignment.duedate),
                       "student_id": student.id, "last_name": _text(student.last_name),
                       "first_name": _text(student.first_name), "email": _text(student.email),
                       "max_score": _text(assignment.max_score), LMS_ID: _text(student.lms_user_id)}
                submission = submitted.get(student.id)
                if submission is None:
                    row.update(timestamp="", raw_score="", late_submission_penalty="", score="",
                               **{PENDING: "", STATUS: "not submitted"})
                else:
                    score = scores.submission_score(submission, settings)
                    row.update(timestamp=_text(submission.timestamp), raw_score=_text(score.raw),
                               late_submission_penalty=_text(score.penalty), score=_text(score.final),
                               **{PENDING: _yes_no(score.pending), STATUS: "incomplete" if score.pending else "complete"})
                rows.append([row[column] for column in GRADE_COLUMNS])
    return rows


def export(root: Path = COURSE_ROOT) -> tuple[Path, Path]:
    root = Path(root).resolve()
    if not gradebook.exists(root):
        raise SystemExit(f"no gradebook in {root}: run `make grade` first")
    grades = root / "grades.csv"
    write_csv(grades, GRADE_COLUMNS, grade_rows(root))
    by_question = root / "grades_by_question.csv"
    export_by_question(root, by_question)
    return grades, by_question


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__, course_root=True)
    options = parser.parse_args(argv)
    for path in export(options.root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
