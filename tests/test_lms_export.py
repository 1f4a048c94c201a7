"""The LMS-ready export (issue #35, item 13): a row per roster student, a column per assigned
notebook, in Canvas's and Moodle's import formats, and Moodle's feedback zip -- no kernels."""

from __future__ import annotations

import csv
import datetime
import os
import zipfile
from pathlib import Path

from autograder.store import gradebook
from autograder.term.roster import ROSTER_FILE
from autograder.places import COURSE_ROOT_VARIABLE
from tests.readme_commands import run_readme_command

ROSTER = ("id,first_name,last_name,email,lms_user_id\nzed,Zed,Adams,zed@u.example,3\nann,Ann,Lee,ann@u.example,1\n"
          "bob,Bob,Ray,bob@u.example,2\n")


def rows(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.reader(handle))


def test_lms_export_has_a_row_per_student_and_a_column_per_assigned_notebook(tmp_path):
    root = tmp_path / "course_root"
    root.mkdir()
    (root / ROSTER_FILE).write_text(ROSTER)
    with gradebook.open_gradebook(root) as gb:
        for name, due in (("01_mha_shapes", datetime.datetime(2026, 3, 1)), ("02_numpy_walkthrough", None)):
            gb.update_or_create_assignment(name, duedate=due)
            gb.update_or_create_notebook(name, name)
            gb.add_grade_cell("test_a", name, name, max_score=4, cell_type="code")
        for student, score in (("ann", 4.0), ("bob", 3.0)):
            gb.update_or_create_student(student)
            submission = gb.add_submission("01_mha_shapes", student)
            submission.notebooks[0].grades[0].auto_score = score
            submission.notebooks[0].grades[0].needs_manual_grade = False
            if student == "bob":
                submission.notebooks[0].late_submission_penalty = 1.0
        gb.db.commit()
    page = root / "feedback" / "ann" / "01_mha_shapes" / "01_mha_shapes.html"
    page.parent.mkdir(parents=True)
    page.write_text("<html>ann</html>")
    result = run_readme_command("make lms-export", timeout=300, env=dict(os.environ, **{COURSE_ROOT_VARIABLE: str(root)}))
    assert result.returncode == 0, result.stdout + result.stderr
    canvas = rows(root / "lms" / "canvas_grades.csv")
    assert canvas[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "01_mha_shapes"]
    assert canvas[1][0].strip() == "Points Possible" and canvas[1][-1] == "4"
    assert canvas[2:] == [["Adams, Zed", "3", "zed", "zed@u.example", "", ""],      # not submitted: empty, not 0
                          ["Lee, Ann", "1", "ann", "ann@u.example", "", "4"],
                          ["Ray, Bob", "2", "bob", "bob@u.example", "", "2"]]       # the late penalty deducted
    moodle = rows(root / "lms" / "moodle_grades.csv")
    assert moodle[0] == ["First name", "Last name", "ID number", "Email address", "01_mha_shapes"]
    assert [r[-1] for r in moodle[1:]] == ["", "4", "2"]
    names = zipfile.ZipFile(root / "lms" / "feedback" / "01_mha_shapes_moodle.zip").namelist()
    assert names == ["Ann Lee_1_assignsubmission_file_/01_mha_shapes.html"]
