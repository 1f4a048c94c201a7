"""The LMS-ready export (issue #35, item 13; issue #56): a row per roster student, a column per
assigned notebook, in Canvas's and Moodle's import formats -- the late penalty the course's rule
gives now, a score waiting for a hand grade left empty and said in the command's last line, no cell
a spreadsheet would evaluate -- and the feedback zips: Moodle's, and Canvas's re-upload zip named as
Canvas's download named each student's file -- no kernels."""

from __future__ import annotations

import csv
import datetime
import json
import os
import re
import zipfile
from pathlib import Path

from autograder.store import gradebook
from autograder.term.roster import ROSTER_FILE
from autograder.places import COURSE_ROOT_VARIABLE
from tests.canvas import download_name, reupload_target
from tests.readme_commands import run_readme_command

ROSTER = ("id,first_name,last_name,email,lms_user_id\nzed,Zed,Adams,zed@u.example,3\nann,Ann,Lee,ann@u.example,1\n"
          "bob,Bob,Ray,bob@u.example,2\ncy,=HYPERLINK(\"http://x\"),Cole,cy@u.example,4\n")


def rows(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.reader(handle))


def test_lms_export_has_a_row_per_student_and_a_column_per_assigned_notebook(tmp_path):
    from autograder.term.course_settings import CourseSettings

    root = tmp_path / "course_root"
    root.mkdir()
    (root / ROSTER_FILE).write_text(ROSTER)
    CourseSettings(late_penalty="zero").save(root)
    due = datetime.datetime(2026, 3, 1)
    with gradebook.open_gradebook(root) as gb:
        for name, date in (("01_mha_shapes", due), ("02_numpy_walkthrough", None)):
            gb.update_or_create_assignment(name, duedate=date)
            gb.update_or_create_notebook(name, name)
            gb.add_grade_cell("test_a", name, name, max_score=4, cell_type="code")
            gb.add_grade_cell("why_a", name, name, max_score=2, cell_type="markdown")
        for student, score, hours in (("ann", 4.0, -1), ("bob", 3.0, 5), ("cy", 2.0, -2)):
            gb.update_or_create_student(student)
            submission = gb.add_submission("01_mha_shapes", student, timestamp=due + datetime.timedelta(hours=hours))
            test, written = sorted(submission.notebooks[0].grades, key=lambda g: g.name)
            test.auto_score, test.needs_manual_grade = score, False
            written.manual_score, written.needs_manual_grade = (None, True) if student == "cy" else (1.0, False)
            if student == "bob":   # what `make grade` stored before bob's written answer was graded by hand
                submission.notebooks[0].late_submission_penalty = 3.0
        gb.db.commit()
    page = root / "feedback" / "ann" / "01_mha_shapes" / "01_mha_shapes.html"
    page.parent.mkdir(parents=True)
    page.write_text("<html>ann</html>")
    bob_page = root / "feedback" / "bob" / "01_mha_shapes" / "01_mha_shapes.html"
    bob_page.parent.mkdir(parents=True)
    bob_page.write_text("<html>bob</html>")
    # ann's submission came from Canvas's download (intake's receipt keeps its name); bob's did not
    canvas_file = download_name("Lee, Ann", 1, 7001, "Copy of 01_mha_shapes.ipynb")
    received = root / "submitted" / "ann" / "01_mha_shapes" / ".received"
    received.mkdir(parents=True)
    (received / "receipt.json").write_text(json.dumps({"path_in_export": canvas_file, "lms": {"kind": "Canvas"}}))
    result = run_readme_command("make lms-export", timeout=300, env=dict(os.environ, **{COURSE_ROOT_VARIABLE: str(root)}))
    assert result.returncode == 0, result.stdout + result.stderr
    canvas = rows(root / "lms" / "canvas_grades.csv")
    assert canvas[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "01_mha_shapes"]
    assert canvas[1][0].strip() == "Points Possible" and canvas[1][-1] == "6"
    assert canvas[2:] == [["Adams, Zed", "3", "zed", "zed@u.example", "", ""],      # not submitted: empty, not 0
                          ["Cole, =HYPERLINK(\"http://x\")", "4", "cy", "cy@u.example", "", ""],   # waits: empty
                          ["Lee, Ann", "1", "ann", "ann@u.example", "", "5"],
                          ["Ray, Bob", "2", "bob", "bob@u.example", "", "0"]]       # late, LATE_PENALTY=zero
    moodle = rows(root / "lms" / "moodle_grades.csv")
    assert moodle[0] == ["First name", "Last name", "ID number", "Email address", "01_mha_shapes"]
    assert [r[-1] for r in moodle[1:]] == ["", "", "5", "0"]
    assert moodle[2][0] == "'=HYPERLINK(\"http://x\")"   # a first name a spreadsheet would run: made text
    printed = [line for line in result.stdout.splitlines() if not re.match(r"make(\[\d+\])?: ", line)]   # make -w's own
    assert printed[-1].startswith("NOT UPLOADED: 1 score still waits for a hand grade"), result.stdout
    assert "1 feedback page is not in the Canvas zips" in result.stdout
    names = zipfile.ZipFile(root / "lms" / "feedback" / "01_mha_shapes_moodle.zip").namelist()
    assert names == ["Ann Lee_1_assignsubmission_file_/01_mha_shapes.html", "Bob Ray_2_assignsubmission_file_/01_mha_shapes.html"]
    (uploaded,) = zipfile.ZipFile(root / "lms" / "feedback" / "01_mha_shapes_canvas.zip").namelist()
    assert uploaded == "leeann_1_7001_01_mha_shapes.html" and reupload_target(uploaded) == (1, 7001)
