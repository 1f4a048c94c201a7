"""The roster (intake checks student folders against it), LMS exports, submission times, history,
due dates and withdrawing a wrongly filed submission -- no kernels, fast."""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import nbformat
import pytest

from autograder.store import gradebook
from autograder.term import intake, roster
from autograder.places import REPO_ROOT
from autograder.places import COURSE_ROOT_VARIABLE
from tests.readme_commands import run_readme_command

ASSIGNMENT = "01_mha_shapes"
ROSTER = """id,first_name,last_name,email,lms_user_id
alice,Alice,Liddell,alice@uni.example,12345
bob,Bob,Builder,bob@uni.example,23456
nunez,Ana,Núñez,ana.nunez@uni.example,34567
"""


def release():
    return nbformat.read(REPO_ROOT / "course" / f"{ASSIGNMENT}.ipynb", as_version=4)


@pytest.fixture
def course(tmp_path):
    root = tmp_path / "course_root"
    root.mkdir()
    (root / roster.ROSTER_FILE).write_text(ROSTER)
    return root


def downloads(tmp_path: Path, files: dict[str, object], mtime: float | None = None) -> Path:
    folder = tmp_path / "downloads"
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(content, str(path)) if not isinstance(content, str) else path.write_text(content)
        if mtime is not None:
            os.utime(path, (mtime, mtime))
    return folder


def run(folder: Path, root: Path, **options):
    entries = intake.intake(folder, root, REPO_ROOT / "course", assignments=[ASSIGNMENT], **options)
    return {e.source: e for e in entries}


def test_roster_reads_nbgraders_format_and_a_single_name_column(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("id,name,email,lms_id\nada,Ada King Lovelace,ada@x.org,99\n")
    (student,) = roster.Roster.read(path).students
    assert (student.id, student.first_name, student.last_name, student.lms_user_id) == ("ada", "Ada King", "Lovelace", "99")
    path.write_text(ROSTER)
    assert [s.id for s in roster.Roster.read(path).students] == ["alice", "bob", "nunez"]
    path.write_text("id,first_name\nx,1\nx,2\n")
    with pytest.raises(SystemExit, match="appear twice: x"):
        roster.Roster.read(path)


def test_a_misspelt_student_folder_is_refused_with_the_closest_names(tmp_path, course):
    entries = run(downloads(tmp_path, {"alcie/01_mha_shapes.ipynb": release()}), course)
    entry = entries["alcie/01_mha_shapes.ipynb"]
    assert entry.status == "refused"
    assert ("student folder 'alcie' is not in the roster; did you mean alice (Alice Liddell)? Rename the folder, or run "
            "intake with --add-unknown (make intake ADD_UNKNOWN=1) to add them.") in entry.reasons, entry.reasons
    assert not (course / "submitted").exists()


def on(root: Path, **variables: str) -> dict:
    """The environment of a README command run on the course root ``root``."""
    return dict(os.environ, **{COURSE_ROOT_VARIABLE: str(root)}, **variables)


def test_add_unknown_accepts_and_adds_to_the_roster(tmp_path, course):
    folder = downloads(tmp_path, {"zoe/01_mha_shapes.ipynb": release()})
    refused = run(folder, course)["zoe/01_mha_shapes.ipynb"]
    assert refused.status == "refused" and not (course / "submitted").exists()
    accepted = run_readme_command("make intake ADD_UNKNOWN=1", env=on(course, SUBMISSIONS=str(folder)))
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert (course / "submitted" / "zoe" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb").exists()
    assert "zoe" in roster.Roster.of_course(course).by_id


def test_other_spellings_of_a_roster_student_are_filed_under_their_id(tmp_path, course):
    entries = run(downloads(tmp_path, {"Bob/01_mha_shapes.ipynb": release(),
                                       "Ana Nunez/01_mha_shapes.ipynb": release()}), course)
    assert entries["Bob/01_mha_shapes.ipynb"].student == "bob"
    assert entries["Ana Nunez/01_mha_shapes.ipynb"].student == "nunez"
    assert sorted(p.name for p in (course / "submitted").iterdir()) == ["bob", "nunez"]


def test_without_a_roster_folders_are_taken_as_they_are(tmp_path):
    root = tmp_path / "course_root"
    entries = run(downloads(tmp_path, {"anyone/01_mha_shapes.ipynb": release()}), root)
    assert entries["anyone/01_mha_shapes.ipynb"].status == "accepted"


def test_a_canvas_flat_export_is_mapped_through_the_lms_user_id(tmp_path, course):
    folder = downloads(tmp_path, {"liddellalice_12345_777_01_mha_shapes.ipynb": release(),
                                  "builderbob_LATE_23456_778_Copy of 01_mha_shapes-1.ipynb": release(),
                                  "strangerx_99999_779_01_mha_shapes.ipynb": release()})
    entries = run(folder, course)
    assert entries["liddellalice_12345_777_01_mha_shapes.ipynb"].student == "alice"
    late = entries["builderbob_LATE_23456_778_Copy of 01_mha_shapes-1.ipynb"]
    assert late.student == "bob" and late.status == "accepted" and "marked late" in " ".join(late.reasons)
    stranger = entries["strangerx_99999_779_01_mha_shapes.ipynb"]
    assert stranger.status == "refused"
    # a sentence, with its full stop, that speaks of the file's LMS id, not of a folder
    assert ("Canvas export's student 'strangerx' (Canvas user id 99999) is not in the roster. Add them to the roster "
            "with their lms_user_id (make roster ROSTER=<csv>), or run intake with --add-unknown (make intake "
            "ADD_UNKNOWN=1) to add them.") in stranger.reasons, stranger.reasons
    assert sorted(p.name for p in (course / "submitted").iterdir()) == ["alice", "bob"]
    # taken with --add-unknown: the Canvas user id and the name the file gave are kept
    added = run(folder, course, add_unknown=True)["strangerx_99999_779_01_mha_shapes.ipynb"]
    assert added.status == "accepted" and "added (--add-unknown), with Canvas user id 99999" in " ".join(added.reasons)
    kept = roster.Roster.of_course(course).by_id["strangerx"]
    assert (kept.last_name, kept.lms_user_id) == ("strangerx", "99999")


def test_a_moodle_export_folder_is_mapped(tmp_path, course):
    folder = downloads(tmp_path, {"Ana Núñez_34567_assignsubmission_file_/01_mha_shapes.ipynb": release()})
    entries = run(folder, course)
    assert next(iter(entries.values())).student == "nunez"
    # a Moodle student the roster does not know keeps the full name Moodle gave, split as the roster splits it
    assert intake.names_from_export({"kind": "Moodle", "name": "Ana María Núñez", "lms": "7"}) == {
        "first_name": "Ana María", "last_name": "Núñez", "lms_user_id": "7"}


def test_submission_time_goes_to_nbgraders_timestamp_file(tmp_path, course):
    when = datetime.datetime(2026, 3, 1, 17, 30, tzinfo=datetime.timezone.utc).timestamp()
    run(downloads(tmp_path, {"alice/01_mha_shapes.ipynb": release()}, mtime=when), course)
    stamp = (course / "submitted" / "alice" / ASSIGNMENT / "timestamp.txt").read_text().strip()
    assert stamp == "2026-03-01 17:30:00.000000 UTC"
    from nbgrader.utils import parse_utc  # nbgrader reads it back as the same time
    assert parse_utc(stamp) == datetime.datetime(2026, 3, 1, 17, 30)


def test_a_resubmission_keeps_the_earlier_one_and_reports_accumulate(tmp_path, course):
    first = release()
    run(downloads(tmp_path / "one", {"alice/01_mha_shapes.ipynb": first}, mtime=1_700_000_000), course)
    intake.write_report([], course, tmp_path / "one")
    second = release()
    second.cells[-1].source += "\n# changed"
    entries = run(downloads(tmp_path / "two", {"alice/01_mha_shapes.ipynb": second}, mtime=1_700_100_000), course)
    intake.write_report(list(entries.values()), course, tmp_path / "two")
    assert "kept in archive/submitted/alice/01_mha_shapes/" in " ".join(entries["alice/01_mha_shapes.ipynb"].reasons)
    (kept,) = (course / "archive" / "submitted" / "alice" / ASSIGNMENT).iterdir()
    assert nbformat.read(kept / f"{ASSIGNMENT}.ipynb", as_version=4).cells[-1].source == first.cells[-1].source
    current = course / "submitted" / "alice" / ASSIGNMENT
    assert nbformat.read(current / f"{ASSIGNMENT}.ipynb", as_version=4).cells[-1].source.endswith("# changed")
    assert sorted(p.name for p in current.iterdir()) == [".received", f"{ASSIGNMENT}.ipynb", "timestamp.txt"]
    # each file as received, byte for byte, beside the notebook filed (and archived with it)
    for folder, export in ((current, "two"), (kept, "one")):
        received = (tmp_path / export / "downloads" / "alice" / f"{ASSIGNMENT}.ipynb").read_bytes()
        assert (folder / ".received" / f"{ASSIGNMENT}.ipynb").read_bytes() == received
        assert json.loads((folder / ".received" / "receipt.json").read_text())["path_in_export"] == \
            f"alice/{ASSIGNMENT}.ipynb"
    assert len(list((course / "reports" / "intake").glob("*.json"))) == 2
    assert (course / "reports" / "intake_history.md").read_text().count("([report](intake/") == 2


@pytest.fixture
def venv_on_path(monkeypatch):
    """nbgrader runs `alembic` from PATH when it creates a gradebook."""
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])


def test_withdraw_takes_out_one_submission_and_nothing_else(tmp_path, course, venv_on_path):
    for student in ("alice", "bob"):
        for name in ("autograded", "feedback", "submitted"):
            folder = course / name / student / ASSIGNMENT
            folder.mkdir(parents=True)
            (folder / "x.txt").write_text(f"{name} of {student}")
    with gradebook.open_gradebook(course) as gb:
        gb.add_assignment(ASSIGNMENT)
        for student in ("alice", "bob"):
            gb.add_student(student)
            gb.add_submission(ASSIGNMENT, student)
    others = {p: p.read_bytes() for p in course.rglob("*") if p.is_file() and "bob" not in p.parts
              and p.name != "gradebook.db"}
    command = "make withdraw STUDENT=bob ASSIGNMENT=01_mha_shapes"
    done = run_readme_command(command, env=on(course))
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (course / "submitted" / "bob").exists() and not (course / "autograded" / "bob" / ASSIGNMENT).exists()
    (archived,) = (course / "archive" / "withdrawn" / "bob" / ASSIGNMENT).iterdir()
    assert (archived / "x.txt").read_text() == "submitted of bob"
    assert {p: p.read_bytes() for p in others} == others
    with gradebook.open_gradebook(course) as gb:
        assert [s.student.id for s in gb.find_assignment(ASSIGNMENT).submissions] == ["alice"]
        assert {s.id for s in gb.students} == {"alice", "bob"}
    again = run_readme_command(command, env=on(course))
    assert again.returncode != 0 and "nothing to withdraw" in again.stderr, again.stdout + again.stderr


def test_import_fills_the_names_formgrader_shows_and_deadlines_set_the_due_date(tmp_path, course, venv_on_path):
    usage = run_readme_command("make roster", env=on(course))   # alone: says what it needs
    assert usage.returncode != 0 and "usage: make roster ROSTER=<csv>" in usage.stdout, usage.stdout + usage.stderr
    (tmp_path / "Downloads").mkdir()
    (tmp_path / "Downloads" / "class.csv").write_text(ROSTER)
    imported = run_readme_command("make roster ROSTER=~/Downloads/class.csv", env=on(course, HOME=str(tmp_path)))
    assert imported.returncode == 0, imported.stdout + imported.stderr
    with gradebook.open_gradebook(course) as gb:
        alice = gb.find_student("alice")
        assert (alice.first_name, alice.last_name, alice.lms_user_id) == ("Alice", "Liddell", "12345")
    deadlines = tmp_path / "deadlines.csv"
    deadlines.write_text(f"assignment,duedate\n{ASSIGNMENT},2026-03-01T17:00+01:00\n02_numpy_walkthrough,2026-03-08\n")
    done = run_readme_command("make deadlines", env=on(course, DEADLINES=str(deadlines)))   # DEADLINES= as a variable
    assert done.returncode == 0, done.stdout + done.stderr
    with gradebook.open_gradebook(course) as gb:
        assert gb.find_assignment(ASSIGNMENT).duedate == datetime.datetime(2026, 3, 1, 16, 0)
        assert gb.find_assignment("02_numpy_walkthrough").duedate == datetime.datetime(2026, 3, 8, 23, 59, 59)


def test_a_typo_in_deadlines_is_refused_with_the_closest_name_and_sets_nothing(tmp_path):
    root = tmp_path / "course_root"
    deadlines = tmp_path / "deadlines.csv"
    deadlines.write_text("assignment,duedate\n01_mha_shapes,2026-03-01\n02_numpy_walktrough,2026-03-08\n")
    result = run_readme_command("make deadlines", env=on(root, DEADLINES=str(deadlines)))
    assert result.returncode != 0, result.stdout
    assert "'02_numpy_walktrough' is not an assignment of this course; did you mean 02_numpy_walkthrough?" \
        in result.stderr, result.stderr
    assert not (root / gradebook.SQLITE_NAME).exists(), "a phantom assignment (or any due date) was written"


def test_without_a_roster_a_folder_differing_only_in_case_is_refused(tmp_path):
    root = tmp_path / "course_root"
    (root / "submitted" / "bob" / ASSIGNMENT).mkdir(parents=True)
    entries = run(downloads(tmp_path, {"Bob/01_mha_shapes.ipynb": release(), "ana/01_mha_shapes.ipynb": release()}), root)
    assert entries["Bob/01_mha_shapes.ipynb"].status == "refused"
    assert "'Bob' differs from 'bob' only in case" in " ".join(entries["Bob/01_mha_shapes.ipynb"].reasons)
    assert entries["ana/01_mha_shapes.ipynb"].status == "accepted"
    entries = run(downloads(tmp_path / "again", {"Bob/01_mha_shapes.ipynb": release()}), root, add_unknown=True)
    assert entries["Bob/01_mha_shapes.ipynb"].status == "accepted"


def test_invisible_characters_in_the_roster_are_removed_and_said(tmp_path):
    """A zero-width space or a right-to-left override in a roster id or name is removed (NFKC,
    no format characters), with a note; two ids that differ only by them are one id twice."""
    path = tmp_path / "r.csv"
    path.write_text("id,first_name,last_name\nal\u200bice,Al\u202eice,Liddell\n\uff42ob,Bob,B\u00ADuilder\n",
                    encoding="utf-8")
    read = roster.Roster.read(path)
    assert [(s.id, s.first_name, s.last_name) for s in read.students] == [("alice", "Alice", "Liddell"),
                                                                         ("bob", "Bob", "Builder")]
    assert any("U+200B ZERO WIDTH SPACE" in note and "line 2" in note for note in read.notes)
    assert any("U+202E RIGHT-TO-LEFT OVERRIDE" in note for note in read.notes)
    path.write_text("id\nalice\nal\u200bice\n", encoding="utf-8")
    with pytest.raises(SystemExit, match="appear twice: alice"):
        roster.Roster.read(path)


@pytest.mark.parametrize("command, columns", [("import", "id,first_name,last_name,email,lms_user_id"),
                                               ("deadlines", "assignment,duedate")])
def test_a_csv_that_is_not_there_is_named_with_its_columns_and_nothing_is_written(tmp_path, capsys, command, columns):
    root = tmp_path / "course_root"
    assert roster.main(["--root", str(root), command, str(tmp_path / "clas.csv")]) == 2
    said = capsys.readouterr().out
    assert f"{tmp_path / 'clas.csv'}: no such file (columns: {columns})" in said
    assert not root.exists(), "a file that could not be read created a course root"
