"""grades.csv and grades_by_question.csv open safely in a spreadsheet or an LMS import, whatever
the students called their folders: real CSV quoting, no cell read as a formula, never a truncated
file; a withdrawn student who has nothing else leaves the export. No kernels: the gradebook is
built through nbgrader's API."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest

from autograder.reports import export
from autograder.store import gradebook
from autograder.term import roster

ASSIGNMENT = "a1"
HOSTILE = ["=2+5", "@SUM(1+1)", "+1-1", "-2+3", "\tTAB", "\rCR", "Doe, Jane", 'Quote "Q" Man', "plain"]


@pytest.fixture
def venv_on_path(monkeypatch):
    """nbgrader runs `alembic` from PATH when it creates a gradebook."""
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])


def gradebook_with(root: Path, students: list[str]) -> None:
    with gradebook.open_gradebook(root) as gb:
        gb.add_assignment(ASSIGNMENT)
        gb.add_notebook(ASSIGNMENT, ASSIGNMENT)
        gb.add_grade_cell("q1", ASSIGNMENT, ASSIGNMENT, max_score=2, cell_type="code")
        for student in students:
            gb.add_student(student, first_name="=HYPERLINK(\"http://x\")" if student == "plain" else None)
            submission = gb.add_submission(ASSIGNMENT, student)
            submission.notebooks[0].grades[0].auto_score = 1.0
        gb.db.commit()


def read(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_every_cell_a_spreadsheet_would_evaluate_is_neutralised_and_names_stay_one_cell(tmp_path, venv_on_path):
    root = tmp_path / "course_root"
    root.mkdir()
    gradebook_with(root, HOSTILE)
    grades, by_question = export.export(root)
    rows = read(grades)
    assert all(None not in row for row in rows)  # no row split by a comma into extra fields
    ids = {row["student_id"] for row in rows}
    assert ids == {"'=2+5", "'@SUM(1+1)", "'+1-1", "'-2+3", "'\tTAB", "'\rCR", "Doe, Jane", 'Quote "Q" Man', "plain"}
    assert {row["student"] for row in read(by_question)} == ids
    plain = next(row for row in rows if row["student_id"] == "plain")
    assert plain["first_name"] == "'=HYPERLINK(\"http://x\")" and plain["score"] == "1.0"
    for path in (grades, by_question):
        for row in read(path):
            for value in row.values():
                assert not value.startswith(export.FORMULA_START) or export.NUMBER.fullmatch(value), (path.name, value)


def test_numbers_stay_numbers():
    assert [export.spreadsheet_safe(v) for v in (-1.5, "-2", "+3", 0.0, "1e-3", "-inf", "-", None)] == [
        "-1.5", "-2", "+3", "0.0", "1e-3", "'-inf", "'-", ""]


def test_a_failed_export_leaves_the_previous_file_whole(tmp_path, venv_on_path, monkeypatch):
    root = tmp_path / "course_root"
    root.mkdir()
    gradebook_with(root, ["ann", "bob"])
    grades, _ = export.export(root)
    before = grades.read_bytes()
    real = export.spreadsheet_safe

    def failing(value):
        if value == "bob":
            raise RuntimeError("the disk filled up halfway")
        return real(value)

    monkeypatch.setattr(export, "spreadsheet_safe", failing)
    with pytest.raises(RuntimeError, match="halfway"):
        export.export(root)
    assert grades.read_bytes() == before
    assert sorted(p.name for p in root.iterdir() if p.name.endswith(".tmp")) == []


def test_a_withdrawn_student_with_nothing_else_leaves_the_export(tmp_path, venv_on_path):
    """A wrongly named folder (``Doe, Jane``, not in the roster) withdrawn: no row left; a roster
    student withdrawn stays, ``not submitted``."""
    root = tmp_path / "course_root"
    root.mkdir()
    (root / roster.ROSTER_FILE).write_text("id\nann\njane\n")
    gradebook_with(root, ["ann", "Doe, Jane"])
    for student in ("ann", "Doe, Jane"):
        (root / "submitted" / student / ASSIGNMENT).mkdir(parents=True)
    assert "removed Doe, Jane from the gradebook (not in the roster, no other submission)" in roster.withdraw(
        "Doe, Jane", ASSIGNMENT, root)
    roster.withdraw("ann", ASSIGNMENT, root)
    grades, _ = export.export(root)
    assert [(row["student_id"], row["status"]) for row in read(grades)] == [("ann", "not submitted")]
