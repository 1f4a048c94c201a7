"""A Canvas download through the real pipeline -- intake, grading, feedback, export, LMS export -- on
the tiny assignment (no torch: a class grades in seconds):

* the accidents nbgrader refuses a whole notebook for are repaired at intake, said in the report,
  and the rest of the notebook is graded, no point forged (issue #51, item 4): a test cell
  duplicated as Jupyter's copy and paste makes it, an answer cell whose metadata says ``grade:
  true, points: 100``, a cell added with grading metadata -- each student gets a row;
* ``submissions.zip`` is taken as Canvas builds it, every entry stamped with the zip's time: the
  times are said not to be submission times, and the ``_LATE_`` mark is 1 s late, not the days
  between the deadline and the download (issue #56, "Wrong 2");
* the file as received is kept byte for byte beside the notebook filed;
* a student taken with ``--add-unknown`` keeps the Canvas user id and name (Formgrader's name, the
  Canvas row's ID);
* the Canvas feedback zip's names are read by Canvas's own rule as the user id and file id of each
  student's download; a score waiting for a hand grade is left empty, and the command says so.
"""

from __future__ import annotations

import copy
import csv
import datetime
import json
import zipfile

import nbformat
import pytest

from autograder.grading import grade
from autograder.reports import export, feedback, lms_export
from autograder.store import gradebook
from autograder.term import intake, roster
from autograder.term.course_settings import CourseSettings
from tests.canvas import download_name, reupload_target, write_download
from tests.grading_helpers import TINY, tiny_course, tiny_notebook

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("intake_pipeline")]

DUE = datetime.datetime(2026, 3, 1, 17, 0)   # naive UTC, as the gradebook keeps it
CLASS = "id,first_name,last_name,email,lms_user_id\nann,Ann,Lee,,11\nbob,Bob,Ray,,12\ncy,Cy,Doe,,13\ndee,Dee,Fox,,14\n"
# (sortable name, user id, attachment id, late)
CANVAS = {"ann": ("Lee, Ann", 11, 9001, False), "bob": ("Ray, Bob", 12, 9002, False), "cy": ("Doe, Cy", 13, 9003, False),
          "dee": ("Fox, Dee", 14, 9004, True), "smithzed": ("Smith, Zed", 99, 9005, False)}   # not on the roster


def accident(student: str) -> nbformat.NotebookNode:
    """What each student handed in: the tiny notebook answered, and one accident each."""
    notebook = tiny_notebook("value = 41" if student == "smithzed" else "value = 42",
                             written="Because six times seven." if student == "ann" else "YOUR ANSWER HERE")
    cells = notebook.cells
    if student == "bob":     # Jupyter's copy and paste: the test cell twice, the same metadata, a new id
        pasted = copy.deepcopy(cells[1])
        pasted.id = "pasted-test"
        cells.insert(2, pasted)
    if student == "cy":      # the answer cell's metadata edited by hand
        cells[0].metadata["nbgrader"].update(grade=True, points=100)
    if student == "dee":     # a cell added with grading metadata (pasted from another notebook)
        extra = nbformat.v4.new_code_cell("bonus = 1", metadata={"nbgrader": {
            "grade_id": "my_bonus", "grade": True, "solution": False, "locked": False, "points": 5, "schema_version": 3}})
        cells.insert(1, extra)
    return notebook


def test_a_canvas_download_with_students_accidents_is_graded_whole(tmp_path):
    root = tiny_course(tmp_path / "course_root", {}, written={})
    course = tmp_path / "course"   # the release students got
    course.mkdir()
    nbformat.write(tiny_notebook("raise NotImplementedError()", written="YOUR ANSWER HERE"), str(course / f"{TINY}.ipynb"))
    (root / roster.ROSTER_FILE).write_text(CLASS)
    roster.set_deadlines({TINY: DUE}, root, [TINY])                       # make deadlines
    CourseSettings(late_penalty="zero", timeout=30).save(root)            # make settings LATE_PENALTY=zero
    names = {student: download_name(name, user, attachment, f"{TINY}.ipynb", late)
             for student, (name, user, attachment, late) in CANVAS.items()}
    received = {student: nbformat.writes(accident(student)).encode() for student in CANVAS}
    # Canvas builds the zip three days after the deadline: every entry carries that time
    download = write_download(tmp_path / "submissions.zip", {names[s]: received[s] for s in CANVAS},
                              built=DUE + datetime.timedelta(days=3))

    entries = {e.student: e for e in intake.intake(download, root, course, assignments=[TINY], add_unknown=True)}
    notices = intake.time_notices(list(entries.values()), root)
    report = intake.write_report(list(entries.values()), root, download, notices).read_text()
    status = {s: e.status for s, e in entries.items()}
    assert status == {"ann": "accepted", "bob": "repaired", "cy": "repaired", "dee": "repaired", "smithzed": "accepted"}, \
        {s: e.reasons for s, e in entries.items()}
    said = {s: " ".join(e.reasons) for s, e in entries.items()}
    assert "second copy of the locked cell 'test_value' (copy and paste): dropped" in said["bob"]
    assert "cell 'answer': grading metadata put back as released (grade: false, solution: true" in said["cy"]
    assert "it said grade: true, solution: true, locked: false, task: false, points: 100" in said["cy"]
    assert "has grading metadata (grade: true, solution: false, locked: false, points: 5) but is no cell of the " \
           "release: kept, not graded" in said["dee"]
    for repaired in ("second copy of the locked cell 'test_value'", "grading metadata put back as released",
                     "is no cell of the release: kept, not graded"):
        assert repaired in report, report
    # Canvas's times are the zip's: the mark decides, one second late -- not three days
    assert any("not a submission time: Canvas's download stamps each file with the time it built the zip" in n
               for n in notices), notices
    stamps = {s: (root / "submitted" / s / TINY / "timestamp.txt").read_text().strip() for s in CANVAS}
    assert stamps["dee"] == "2026-03-01 17:00:01.000000 UTC" and stamps["ann"] == "2026-03-01 17:00:00.000000 UTC"
    # the file as received, byte for byte, beside the repaired copy that was filed
    for student in CANVAS:
        folder = root / "submitted" / student / TINY
        assert (folder / ".received" / names[student]).read_bytes() == received[student]
        assert json.loads((folder / ".received" / "receipt.json").read_text())["lms"]["attachment"] == \
            str(CANVAS[student][2])
    filed_bob = nbformat.read(root / "submitted" / "bob" / TINY / f"{TINY}.ipynb", as_version=4)
    assert [c.metadata.get("nbgrader", {}).get("grade_id") for c in filed_bob.cells] == ["answer", "test_value",
                                                                                          "why_value"]
    # --add-unknown kept the Canvas user id and the name the file gave
    zed = roster.Roster.of_course(root).by_id["smithzed"]
    assert (zed.last_name, zed.lms_user_id) == ("smithzed", "99"), zed

    outcomes = {o.student: o for o in grade.grade(root, jobs=1, log=lambda *_: None)}
    assert {s: o.status for s, o in outcomes.items()} == dict.fromkeys(CANVAS, "graded"), \
        {s: o.error[-500:] for s, o in outcomes.items()}
    feedback.write_feedback(root)
    grades_csv, _ = export.export(root)
    with open(grades_csv, newline="") as handle:
        rows = {r["student_id"]: r for r in csv.DictReader(handle)}
    assert set(rows) == set(CANVAS), rows
    scores = {s: (float(r["raw_score"]), float(r["score"]), float(r["max_score"]), r["status"]) for s, r in rows.items()}
    assert scores == {"ann": (1.0, 1.0, 3.0, "incomplete"), "bob": (1.0, 1.0, 3.0, "complete"),
                      "cy": (1.0, 1.0, 3.0, "complete"), "dee": (1.0, 0.0, 3.0, "complete"),
                      "smithzed": (0.0, 0.0, 3.0, "complete")}, scores     # no points forged; dee late, LATE_PENALTY=zero
    with gradebook.open_gradebook(root) as gb:   # Formgrader shows the name Canvas gave, not "None, None"
        shown = gb.find_student("smithzed")
        assert (shown.last_name, shown.lms_user_id) == ("smithzed", "99")
        assert gb.find_student("ann").first_name == "Ann"

    exported = lms_export.write_lms_exports(root)
    with open(root / "lms" / "canvas_grades.csv", newline="") as handle:
        canvas = {row[2]: row for row in csv.reader(handle)}
    assert canvas["smithzed"][:2] == ["smithzed", "99"] and canvas["smithzed"][-1] == "0"
    assert canvas["ann"][-1] == "" and canvas["dee"][-1] == "0"      # ann's written answer waits: left empty
    assert exported.pending == 1 and exported.not_from_canvas == 0
    with zipfile.ZipFile(root / "lms" / "feedback" / f"{TINY}_canvas.zip") as bundle:
        uploaded = bundle.namelist()
    # Canvas's re-upload attaches each page to the submission of the file the download named
    assert sorted(reupload_target(name) for name in uploaded) == sorted((user, attachment) for _, user, attachment, _
                                                                        in CANVAS.values())
    assert all(name.endswith(f"_{TINY}.html") for name in uploaded), uploaded
    dee_page = next(n for n in uploaded if reupload_target(n) == (14, 9004))
    assert dee_page.startswith("foxdee_LATE_14_9004_"), dee_page
