"""The class roster, due dates, and withdrawing a wrongly filed submission.

    python -m autograder.term.roster import students.csv          # make roster ROSTER=students.csv
    python -m autograder.term.roster deadlines [deadlines.csv]    # make deadlines [DEADLINES=...]
    python -m autograder.term.roster withdraw --student S --assignment A   # make withdraw STUDENT=S ASSIGNMENT=A

**Roster.** A CSV in nbgrader's own ``nbgrader db student import`` format: a column ``id``
(the student's id: their folder name under ``submitted/``) and any of ``first_name``,
``last_name``, ``email``, ``lms_user_id`` (the id the LMS puts in its export file names).
A single ``name`` column ("Ada Lovelace") is split into first and last name; ``lms_id`` is
taken for ``lms_user_id``. ``import`` keeps a normalised copy as ``roster.csv`` in the course
root (what ``make intake`` checks student folders against) and imports it into the gradebook
with ``nbgrader db student import`` (Formgrader then shows the names).

**Due dates.** ``deadlines.csv`` (columns ``assignment``, ``duedate``: ISO 8601, with an offset
or in the course's time zone, ``make settings TIME_ZONE=...``) sets each assignment's ``duedate`` in the gradebook, where nbgrader's late
penalty looks for it. Submission times are recorded by
``make intake`` in nbgrader's ``submitted/<student>/<assignment>/timestamp.txt``.

**Withdraw.** Moves ``submitted/<student>/<assignment>/`` to ``archive/withdrawn/<student>/
<assignment>/<time>/`` and removes that one submission's autograded notebook, feedback
page and gradebook entry; nothing else is touched.
"""

from __future__ import annotations

import csv
import datetime
import difflib
import shutil
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from autograder.command_line import command_line
from autograder.places import COURSE_ROOT, REPO_ROOT
from autograder.publishing.release import assignment_names, assignments_with_source
from autograder.store import gradebook
from autograder.store.nbgrader_cli import run_nbgrader
from autograder.term.course_settings import CourseSettings
from autograder.term.due_dates import parse_duedate

ROSTER_FILE = "roster.csv"
COLUMNS = ["id", "first_name", "last_name", "email", "lms_user_id"]
DEADLINES_FILE = REPO_ROOT / "deadlines.csv"


def normal_name(text: str) -> tuple[str, list[str]]:
    """A student's id or name as it is filed: NFKC (``ｂｏｂ`` and ``e`` + combining accent are
    ``bob`` and ``é``), without the invisible format characters (zero-width spaces and joiners,
    right-to-left and other bidirectional controls, soft hyphens) that make one student look
    like two, or one name display as another. Returns (text, what was removed, for the reason)."""
    text = unicodedata.normalize("NFKC", text or "")
    removed = sorted({f"U+{ord(c):04X} {unicodedata.name(c, 'format character')}"
                      for c in text if unicodedata.category(c) == "Cf"})
    return "".join(c for c in text if unicodedata.category(c) != "Cf").strip(), removed


def fold(text: str) -> str:
    """Case, accents and separators folded: ``Núñez, Ana`` -> ``nunezana``."""
    text = unicodedata.normalize("NFKD", text or "")
    return "".join(c for c in text if c.isalnum() and not unicodedata.combining(c)).lower()


@dataclass
class Student:
    id: str
    first_name: str = ""
    last_name: str = ""
    email: str = ""
    lms_user_id: str = ""

    @property
    def name(self) -> str:
        return " ".join(part for part in (self.first_name, self.last_name) if part)

    def keys(self) -> set[str]:
        """Everything a folder or an LMS file name may call this student by (folded)."""
        keys = {fold(self.id), fold(self.lms_user_id), fold(self.email), fold(self.email.split("@")[0])}
        if self.first_name or self.last_name:
            keys |= {fold(self.first_name + self.last_name), fold(self.last_name + self.first_name)}
        return keys - {""}


class Roster:
    def __init__(self, students: list[Student], notes: list[str] | None = None):
        self.students = students
        self.by_id = {s.id: s for s in students}
        self.notes = notes or []  # what reading it changed (invisible characters removed)

    @classmethod
    def read(cls, path: Path) -> Roster:
        with open(path, newline="", encoding="utf-8-sig") as handle:
            rows = list(csv.DictReader(handle))
        students, notes = [], []
        for number, row in enumerate(rows, start=2):
            row = {(k or "").strip().lower(): (v or "").strip() for k, v in row.items()}
            for key in ("id", "first_name", "last_name", "name"):
                if row.get(key):
                    row[key], removed = normal_name(row[key])
                    if removed:
                        notes.append(f"{path.name}, line {number}: removed invisible characters from {key} "
                                     f"({', '.join(removed)}): {row[key]!r}")
            if not row.get("id"):
                raise SystemExit(f"{path}, line {number}: no id (the roster needs a column `id`)")
            first, last = row.get("first_name", ""), row.get("last_name", "")
            if not (first or last) and row.get("name"):
                first, _, last = row["name"].rpartition(" ") if " " in row["name"] else ("", "", row["name"])
            students.append(Student(row["id"], first, last, row.get("email", ""),
                                    row.get("lms_user_id") or row.get("lms_id", "")))
        duplicates = sorted({s.id for s in students if sum(t.id == s.id for t in students) > 1})
        if duplicates:
            raise SystemExit(f"{path}: these ids appear twice: {', '.join(duplicates)}")
        return cls(students, notes)

    @classmethod
    def of_course(cls, root: Path) -> Roster | None:
        path = Path(root) / ROSTER_FILE
        return cls.read(path) if path.exists() else None

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(COLUMNS)
            for s in self.students:
                writer.writerow([s.id, s.first_name, s.last_name, s.email, s.lms_user_id])

    def find(self, name: str, lms_user_id: str = "") -> tuple[Student | None, str]:
        """The roster's student for a folder name (or an LMS export's name and user id):
        (student, how it was matched) or (None, "")."""
        if name in self.by_id:
            return self.by_id[name], ""
        if lms_user_id:
            matches = [s for s in self.students if s.lms_user_id and s.lms_user_id == lms_user_id]
            if len(matches) == 1:
                return matches[0], f"LMS user id {lms_user_id} is {matches[0].id!r} in the roster"
        key = fold(name)
        matches = [s for s in self.students if key and key in s.keys()]
        if len(matches) == 1:
            return matches[0], f"{name!r} is {matches[0].id!r} in the roster"
        return None, ""

    def suggest(self, name: str, count: int = 3) -> list[str]:
        """The closest roster entries to an unknown name, as ``id (First Last)``."""
        candidates: dict[str, Student] = {}
        for student in self.students:
            for key in student.keys():
                candidates.setdefault(key, student)
        close = difflib.get_close_matches(fold(name), list(candidates), n=count * 3, cutoff=0.6)
        chosen = list(dict.fromkeys(candidates[key].id for key in close))[:count]
        return [f"{i} ({self.by_id[i].name})" if self.by_id[i].name else i for i in chosen]

    def add(self, student_id: str, **known: str) -> None:
        """A student the roster did not have, with what is ``known`` of them (names, e-mail,
        LMS user id: what an LMS export gave)."""
        if student_id not in self.by_id:
            student = Student(student_id, **known)
            self.students.append(student)
            self.by_id[student_id] = student


# --------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------

def import_roster(source: Path, root: Path = COURSE_ROOT) -> Roster:
    """Keep ``source`` (normalised) as the course's roster.csv and import it into the gradebook."""
    roster = Roster.read(source)
    url = gradebook.db_url(root)   # refused before anything is written where it is not the course's
    path = Path(root) / ROSTER_FILE
    roster.write(path)
    result = run_nbgrader("db", "student", "import", str(path.resolve()), "--log-level=WARN",
                          f"--CourseDirectory.db_url={url}", root=Path(root).resolve(), capture=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"nbgrader db student import failed:\n{result.stdout}{result.stderr}")
    return roster


def read_deadlines(path: Path, zone: datetime.tzinfo = datetime.timezone.utc) -> dict[str, datetime.datetime]:
    """``{assignment: due date}`` (naive UTC) of a deadlines CSV; a date without an offset is in ``zone``."""
    with open(path, newline="", encoding="utf-8-sig") as handle:
        rows = list(csv.DictReader(handle))
    deadlines = {}
    for number, row in enumerate(rows, start=2):
        row = {(k or "").strip().lower(): (v or "").strip() for k, v in row.items()}
        if not row.get("assignment") or not row.get("duedate"):
            raise SystemExit(f"{path}, line {number}: needs `assignment` and `duedate`")
        try:
            deadlines[row["assignment"]] = parse_duedate(row["duedate"], zone)
        except ValueError:
            raise SystemExit(f"{path}, line {number}: {row['duedate']!r} is not an ISO date "
                             "(2026-03-01 or 2026-03-01T17:00+01:00)") from None
    return deadlines


def unknown_assignments(names: list[str], known: list[str]) -> list[str]:
    """Each name of ``names`` the course does not have, with the closest names it has."""
    problems = []
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=2, cutoff=0.5)
            problems.append(f"{name!r} is not an assignment of this course"
                            + (f"; did you mean {' or '.join(close)}?" if close else f" ({', '.join(known)})"))
    return problems


def set_deadlines(deadlines: dict[str, datetime.datetime], root: Path = COURSE_ROOT,
                  known: list[str] | None = None) -> None:
    """Each assignment's due date in the gradebook (nbgrader's Assignment.duedate); names the
    course does not have (``known``, default: the assignments of ``solutions/`` and those with a
    source in the course root) are refused, all of them, before anything is written."""
    if known is None:
        known = sorted(set(assignment_names()) | set(assignments_with_source(Path(root))))
    problems = unknown_assignments(list(deadlines), known)
    if problems:
        raise SystemExit("due dates not set: " + "; ".join(problems))

    with gradebook.exclusive(Path(root)) as gb:
        for assignment, duedate in deadlines.items():
            gb.update_or_create_assignment(assignment, duedate=duedate)


def withdraw(student: str, assignment: str, root: Path = COURSE_ROOT) -> list[str]:
    """Take one wrongly filed submission out (archived, never deleted); what was done, as text."""
    root = Path(root)
    folder = root / "submitted" / student / assignment
    done = []
    if not folder.is_dir():
        raise SystemExit(f"no submission {folder}: nothing to withdraw")
    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    archive = root / "archive" / "withdrawn" / student / assignment / stamp
    archive.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(folder), str(archive))
    done.append(f"moved {folder.relative_to(root)} to {archive.relative_to(root)}")
    if not any((root / "submitted" / student).iterdir()):
        (root / "submitted" / student).rmdir()
    for generated in (root / "autograded" / student / assignment, root / "feedback" / student / assignment):
        if generated.exists():
            shutil.rmtree(generated)
            done.append(f"removed {generated.relative_to(root)}")
    if gradebook.exists(root):
        from nbgrader.api import MissingEntry

        with gradebook.exclusive(root) as gb:
            try:
                gb.remove_submission(assignment, student)
                done.append(f"removed {student}/{assignment} from the gradebook")
            except MissingEntry:
                pass
            if forget_student_without_submissions(gb, student, root):
                done.append(f"removed {student} from the gradebook (not in the roster, no other submission)")
    return done


def forget_student_without_submissions(gb, student: str, root: Path) -> bool:
    """After a withdrawal: a student the roster does not name and who has no submission left
    (a wrongly named folder, say) leaves the gradebook, so no export or Formgrader list shows
    them; a roster student stays (``not submitted``). Whether they were removed."""
    from nbgrader.api import MissingEntry

    listed = Roster.of_course(root)
    if listed is not None and student in listed.by_id:
        return False
    try:
        if gb.find_student(student).submissions:
            return False
    except MissingEntry:
        return False
    gb.remove_student(student)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__, course_root=True)
    commands = parser.add_subparsers(dest="command", required=True)
    importing = commands.add_parser("import", help="import a roster CSV")
    importing.add_argument("csv", type=Path)
    deadlines = commands.add_parser("deadlines", help="set due dates from a CSV (assignment, duedate)")
    deadlines.add_argument("csv", type=Path, nargs="?", default=DEADLINES_FILE)
    withdrawing = commands.add_parser("withdraw", help="take one wrongly filed submission out")
    withdrawing.add_argument("--student", required=True)
    withdrawing.add_argument("--assignment", required=True)
    options = parser.parse_args(argv)
    if options.command in ("import", "deadlines") and not options.csv.is_file():
        columns = COLUMNS if options.command == "import" else ["assignment", "duedate"]
        print(f"{options.csv}: no such file (columns: {','.join(columns)})")
        return 2
    if options.command == "import":
        roster = import_roster(options.csv, options.root)
        for note in roster.notes:
            print(note)
        print(f"{len(roster.students)} students in {options.root / ROSTER_FILE} and in the gradebook")
    elif options.command == "deadlines":
        settings = CourseSettings.load(options.root)
        values = read_deadlines(options.csv, settings.zone)
        set_deadlines(values, options.root)
        for assignment, duedate in values.items():
            print(f"{assignment}: due {settings.local(duedate)}")
        print(f"dates written without an offset are in the course's time zone, {settings.time_zone} "
              "(`make settings TIME_ZONE=<zone>` sets it; then run `make deadlines` again)")
    else:
        for line in withdraw(options.student, options.assignment, options.root):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
