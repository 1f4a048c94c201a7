"""Grades and feedback in the shapes an LMS imports (``make lms-export``).

    python -m autograder.reports.lms_export

``grades.csv`` (``make export``) is nbgrader's: a row per student and assignment, every
notebook.  An LMS's gradebook import wants a row per student and a column per assignment;
this writes, in the course root's ``lms/``:

* ``canvas_grades.csv``: Canvas's gradebook import (``Student, ID, SIS User ID, SIS Login ID,
  Section``, then a column per assigned notebook, and Canvas's "Points Possible" row; ``ID``
  is the roster's ``lms_user_id``);
* ``moodle_grades.csv``: Moodle's grade import (matched on ``Email address``; a column per
  assigned notebook);
* ``feedback/<assignment>_moodle.zip``: each student's feedback page in the folder Moodle's
  *Upload multiple feedback files in a zip* expects (``<Full name>_<participant id>_
  assignsubmission_file_/``, the id being the roster's ``lms_user_id``).

A row per roster student (by last name), a column per assignment with a due date (``make
deadlines``; else every assignment someone submitted).  A score is the gradebook's total with
the late penalty deducted; a submission never made is left empty (not 0); a score that still
waits for a hand grade is written and counted in the console, so that nothing incomplete is
uploaded unnoticed.
"""

from __future__ import annotations

import argparse
import csv
import sys
import zipfile
from pathlib import Path

from autograder.store import gradebook
from autograder.term.roster import Roster, Student
from autograder.places import COURSE_ROOT

FOLDER = "lms"


def class_grades(root: Path) -> tuple[list[str], dict[str, float], dict[tuple[str, str], tuple[float, bool]]]:
    """(assigned notebooks, their points, ``{(student, assignment): (score, incomplete)}``)."""
    with gradebook.exclusive(root) as gb:
        assignments = sorted(gb.assignments, key=lambda a: a.name)
        assigned = [a for a in assignments if a.duedate] or [a for a in assignments if a.submissions]
        points = {a.name: float(a.max_score) for a in assigned}
        scores = {}
        for assignment in assigned:
            for submission in assignment.submissions:
                penalty = float(submission.late_submission_penalty or 0.0)
                scores[(submission.student.id, assignment.name)] = (
                    max(0.0, float(submission.score) - penalty), bool(submission.needs_manual_grade))
    return [a.name for a in assigned], points, scores


def students_of(root: Path, scores: dict) -> list[Student]:
    roster = Roster.of_course(root)
    students = list(roster.students) if roster else []
    known = {s.id for s in students}
    students += [Student(student) for student in sorted({s for s, _ in scores} - known)]
    return sorted(students, key=lambda s: (s.last_name.lower(), s.first_name.lower(), s.id))


def _cell(scores: dict, student: str, assignment: str) -> str:
    found = scores.get((student, assignment))
    return "" if found is None else f"{found[0]:g}"


def write_lms_exports(root: Path = COURSE_ROOT) -> tuple[list[Path], int]:
    """The files written, and the number of scores still waiting for a hand grade."""
    assigned, points, scores = class_grades(root)
    students = students_of(root, scores)
    folder = root / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    canvas = folder / "canvas_grades.csv"
    with open(canvas, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["Student", "ID", "SIS User ID", "SIS Login ID", "Section", *assigned])
        writer.writerow(["    Points Possible", "", "", "", "", *(f"{points[a]:g}" for a in assigned)])
        for s in students:
            name = f"{s.last_name}, {s.first_name}" if s.last_name and s.first_name else (s.name or s.id)
            writer.writerow([name, s.lms_user_id, s.id, s.email, "", *(_cell(scores, s.id, a) for a in assigned)])
    moodle = folder / "moodle_grades.csv"
    with open(moodle, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["First name", "Last name", "ID number", "Email address", *assigned])
        for s in students:
            writer.writerow([s.first_name, s.last_name, s.id, s.email, *(_cell(scores, s.id, a) for a in assigned)])
    written = [canvas, moodle]
    for assignment in assigned:
        bundle = folder / "feedback" / f"{assignment}_moodle.zip"
        bundle.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(bundle, "w", zipfile.ZIP_DEFLATED) as archive:
            for s in students:
                pages = sorted((root / "feedback" / s.id / assignment).glob("*.html"))
                for page in pages if s.lms_user_id else []:
                    archive.write(page, f"{s.name or s.id}_{s.lms_user_id}_assignsubmission_file_/{page.name}")
        written.append(bundle)
    incomplete = sum(waiting for _, waiting in scores.values())
    return written, incomplete


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=COURSE_ROOT)
    options = parser.parse_args(argv)
    if not gradebook.exists(options.root):
        print("no gradebook yet: run make grade first", file=sys.stderr)
        return 2
    written, incomplete = write_lms_exports(options.root)
    for path in written:
        print(f"wrote {path}")
    if incomplete:
        print(f"NOTE: {incomplete} score{'s' if incomplete != 1 else ''} still wait{'' if incomplete != 1 else 's'} "
              "for a hand grade in Formgrader: they are written as they stand")
    return 0


if __name__ == "__main__":
    sys.exit(main())
