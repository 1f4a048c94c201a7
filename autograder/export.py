"""Export the grades.

    python -m autograder.export          # make export

* ``autograder/course_root/grades.csv``: one row per student and assignment, written by
  ``nbgrader export`` (nbgrader's own CSV: due date, submission time, raw_score, late
  penalty, score, max_score, ...), plus ``manual_grading_pending`` (``yes`` while a written
  answer of that submission still awaits grading by hand, in Formgrader), ``status``
  (``not submitted`` -- its scores are left empty, never 0 --, ``incomplete`` while hand
  grading is pending, ``complete``) and ``lms_user_id`` (from the roster, for the LMS upload).
* ``autograder/course_root/grades_by_question.csv``: student, assignment, notebook,
  grade_id, score, max_score, manual_grading_pending, one row per graded cell.

Scores are the gradebook's: a score or extra credit set by hand (Formgrader) counts.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from autograder import gradebook
from autograder.nbgrader_cli import run_nbgrader
from autograder.settings import COURSE_ROOT

PENDING = "manual_grading_pending"
QUESTION_COLUMNS = ["student", "assignment", "notebook", "grade_id", "score", "max_score", PENDING]


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def export_by_question(root: Path, path: Path) -> int:
    rows = []
    with gradebook.open_gradebook(root) as gb:
        for assignment in gb.assignments:
            for submission in assignment.submissions:
                for notebook in submission.notebooks:
                    for grade in notebook.grades:
                        rows.append([submission.student.id, assignment.name, notebook.name, grade.name,
                                     f"{grade.score:g}", f"{grade.max_score:g}",
                                     _yes_no(grade.needs_manual_grade)])
    rows.sort()
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(QUESTION_COLUMNS)
        writer.writerows(rows)
    return len(rows)


STATUS = "status"
LMS_ID = "lms_user_id"


def add_pending_column(root: Path, path: Path) -> None:
    """Complete nbgrader's own grades.csv: ``manual_grading_pending`` (yes / no), ``status``
    (``not submitted``, ``incomplete``: a written answer waits for a hand grade, or ``complete``)
    and the roster's ``lms_user_id``. A student who submitted nothing gets empty scores, not 0."""
    with gradebook.open_gradebook(root) as gb:
        pending = {(s.student.id, a.name): s.needs_manual_grade for a in gb.assignments for s in a.submissions}
        lms = {s.id: s.lms_user_id or "" for s in gb.students}
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        return
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=[*rows[0].keys(), PENDING, STATUS, LMS_ID])
        writer.writeheader()
        for row in rows:
            key = (row["student_id"], row["assignment"])
            submitted = key in pending
            waiting = pending.get(key, False)
            if not submitted:
                row.update(raw_score="", late_submission_penalty="", score="")
            status = "not submitted" if not submitted else ("incomplete" if waiting else "complete")
            writer.writerow({**row, PENDING: _yes_no(waiting) if submitted else "", STATUS: status,
                             LMS_ID: lms.get(row["student_id"], "")})


def export(root: Path = COURSE_ROOT) -> tuple[Path, Path]:
    root = Path(root).resolve()
    if not gradebook.exists(root):
        raise SystemExit(f"no gradebook in {root}: run `make grade` first")
    grades = root / "grades.csv"
    run_nbgrader("export", "--to", str(grades), "--log-level=WARN", root=root)
    add_pending_column(root, grades)
    by_question = root / "grades_by_question.csv"
    export_by_question(root, by_question)
    return grades, by_question


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=COURSE_ROOT)
    options = parser.parse_args(argv)
    for path in export(options.root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
