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
* ``feedback/<assignment>_canvas.zip``: each student's feedback page named as Canvas's bulk
  download ("Download Submissions") named the file the student handed in --
  ``<sortable name>[_LATE]_<user id>_<attachment id>_<page>`` -- which is what Canvas's
  "Re-upload submissions" reads: it takes the first two numbers of each name as the student's
  user id and the id of a file of their submission, and attaches the page to that submission as
  a comment (Canvas names the attachment after the student's own file).  The ids come from the
  intake's receipt of the submission (``submitted/<student>/<assignment>/.received/``): a
  submission taken in from elsewhere has none, and its page is left out (and counted);
* ``feedback/<assignment>_moodle.zip``: each student's feedback page in the folder Moodle's
  *Upload multiple feedback files in a zip* expects (``<Full name>_<participant id>_
  assignsubmission_file_/``, the id being the roster's ``lms_user_id``).

A row per roster student (by last name), a column per assignment with a due date (``make
deadlines``; else every assignment someone submitted).  A score is the gradebook's total less
the late penalty the course's rules give now (:mod:`autograder.term.scores`); a submission never made
is left empty (not 0), and so is a score that still waits for a hand grade: an import leaves
that grade as it is, and the command's last line says how many wait.  The CSV files are
written as ``make export`` writes its own (:func:`autograder.reports.export.write_csv`: no cell a
spreadsheet would evaluate, the file replaced whole or not at all).
"""

from __future__ import annotations

import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from autograder.command_line import command_line
from autograder.places import COURSE_ROOT
from autograder.reports.export import write_csv
from autograder.store import gradebook
from autograder.term import scores
from autograder.term.course_settings import CourseSettings
from autograder.term.intake import CANVAS, receipt
from autograder.term.roster import Roster, Student

FOLDER = "lms"


@dataclass
class Exported:
    files: list[Path]
    pending: int                 # scores left empty: a hand grade is still to be given
    not_from_canvas: int = 0     # feedback pages without a Canvas download's name to attach them by


def class_grades(root: Path) -> tuple[list[str], dict[str, float], dict[tuple[str, str], tuple[float, bool]]]:
    """(assigned notebooks, their points, ``{(student, assignment): (score, incomplete)}``)."""
    settings = CourseSettings.load(root)
    with gradebook.exclusive(root) as gb:
        assignments = sorted(gb.assignments, key=lambda a: a.name)
        assigned = [a for a in assignments if a.duedate] or [a for a in assignments if a.submissions]
        points = {a.name: float(a.max_score) for a in assigned}
        found = {}
        for assignment in assigned:
            for submission in assignment.submissions:
                score = scores.submission_score(submission, settings)
                found[(submission.student.id, assignment.name)] = (score.final, score.pending)
    return [a.name for a in assigned], points, found


def students_of(root: Path, grades: dict) -> list[Student]:
    roster = Roster.of_course(root)
    students = list(roster.students) if roster else []
    known = {s.id for s in students}
    students += [Student(student) for student in sorted({s for s, _ in grades} - known)]
    return sorted(students, key=lambda s: (s.last_name.lower(), s.first_name.lower(), s.id))


def _cell(grades: dict, student: str, assignment: str) -> str:
    """A score as the import takes it: empty where nothing was submitted or a hand grade is due."""
    found = grades.get((student, assignment))
    return "" if found is None or found[1] else f"{found[0]:g}"


def canvas_name(root: Path, student: str, assignment: str, page: str) -> str | None:
    """``page``'s name in Canvas's re-upload zip: the name Canvas's download gave the student's
    file, with ``page`` for the file's own name; None where the submission came from elsewhere."""
    record = receipt(root / "submitted" / student / assignment) or {}
    lms = record.get("lms") or {}
    downloaded = Path(record.get("path_in_export") or "").name
    match = CANVAS.match(downloaded)
    if lms.get("kind") != "Canvas" or not match:
        return None
    return downloaded[:match.start("file")] + page


def write_lms_exports(root: Path = COURSE_ROOT) -> Exported:
    """The files written, and what the instructor must know before uploading them."""
    assigned, points, grades = class_grades(root)
    students = students_of(root, grades)
    folder = root / FOLDER
    (folder / "feedback").mkdir(parents=True, exist_ok=True)
    canvas = folder / "canvas_grades.csv"
    rows = [["    Points Possible", "", "", "", "", *(f"{points[a]:g}" for a in assigned)]]
    for s in students:
        name = f"{s.last_name}, {s.first_name}" if s.last_name and s.first_name else (s.name or s.id)
        rows.append([name, s.lms_user_id, s.id, s.email, "", *(_cell(grades, s.id, a) for a in assigned)])
    write_csv(canvas, ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", *assigned], rows)
    moodle = folder / "moodle_grades.csv"
    write_csv(moodle, ["First name", "Last name", "ID number", "Email address", *assigned],
              [[s.first_name, s.last_name, s.id, s.email, *(_cell(grades, s.id, a) for a in assigned)] for s in students])
    exported = Exported([canvas, moodle], sum(waiting for _, waiting in grades.values()))
    for assignment in assigned:
        pages = {s.id: sorted((root / "feedback" / s.id / assignment).glob("*.html")) for s in students}
        bundle = folder / "feedback" / f"{assignment}_canvas.zip"
        with zipfile.ZipFile(bundle, "w", zipfile.ZIP_DEFLATED) as archive:
            for s in students:
                for page in pages[s.id]:
                    name = canvas_name(root, s.id, assignment, page.name)
                    if name is None:
                        exported.not_from_canvas += 1
                    else:
                        archive.write(page, name)
        bundle = folder / "feedback" / f"{assignment}_moodle.zip"
        with zipfile.ZipFile(bundle, "w", zipfile.ZIP_DEFLATED) as archive:
            for s in students:
                for page in pages[s.id] if s.lms_user_id else []:
                    archive.write(page, f"{s.name or s.id}_{s.lms_user_id}_assignsubmission_file_/{page.name}")
        exported.files += [folder / "feedback" / f"{assignment}_canvas.zip", bundle]
    return exported


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__, course_root=True)
    options = parser.parse_args(argv)
    if not gradebook.exists(options.root):
        print("no gradebook yet: run make grade first", file=sys.stderr)
        return 2
    exported = write_lms_exports(options.root)
    for path in exported.files:
        print(f"wrote {path}")
    if exported.not_from_canvas:
        print(f"{exported.not_from_canvas} feedback page{'s are' if exported.not_from_canvas != 1 else ' is'} not in "
              "the Canvas zips: their submissions did not come from a Canvas download (attach them in SpeedGrader)")
    if exported.pending:
        many = exported.pending != 1
        print(f"NOT UPLOADED: {exported.pending} score{'s' if many else ''} still wait{'' if many else 's'} for a hand "
              f"grade in Formgrader: {'their cells are' if many else 'its cell is'} left empty in canvas_grades.csv and "
              "moodle_grades.csv (an import leaves those grades as they are); grade them, then run make lms-export again")
    return 0


if __name__ == "__main__":
    sys.exit(main())
