"""Feedback and export say each question's real state, from the gradebook as Formgrader leaves it:
passed / failed / graded by hand with the grade / pending, the grader's comments, incidents in
plain words, a late penalty; grades.csv tells "not submitted" from 0. No kernels: the
gradebook is notebook 01's (``nbgrader generate_assignment``), the executed notebooks are made here."""

from __future__ import annotations

import csv
import datetime
import json
import re
from pathlib import Path

import nbformat
import pytest

from autograder.reports import export, feedback
from autograder.store import gradebook
from autograder.term.course_settings import CourseSettings
from autograder.store.nbgrader_cli import run_nbgrader
from autograder.publishing.release import REPO_ROOT, build_source, course_repository, write_notebook

ASSIGNMENT = "01_mha_shapes"
COMMENT = "Say why .view fails after a transpose: the memory is no longer contiguous."
CODE_COMMENT = "Nice use of einops, but name your axes."


def executed(failures: dict[str, tuple[str, str]]) -> nbformat.NotebookNode:
    notebook = nbformat.read(REPO_ROOT / "course" / f"{ASSIGNMENT}.ipynb", as_version=4)
    for cell in notebook.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in failures:
            ename, evalue = failures[grade_id]
            cell.outputs = [nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=[ename])]
    return notebook


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    root = tmp_path_factory.mktemp("feedback") / "course_root"
    write_notebook(build_source(ASSIGNMENT, course_repository()), root / "source" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb")
    run_nbgrader("generate_assignment", ASSIGNMENT, "--force", "--log-level=ERROR", root=root, capture=True)
    failures = {"ann": {"test_split_heads": ("CheckFailure", "split_heads(x) should have shape [2, 3, 5, 4]")},
                "bob": {"test_merge_heads": ("CellTimeoutError", "")}}
    with gradebook.open_gradebook(root) as gb:
        gb.update_or_create_assignment(ASSIGNMENT, duedate=datetime.datetime(2026, 3, 1, 12, 0))
        for student in ("ann", "bob", "cy"):
            gb.update_or_create_student(student, lms_user_id=f"lms-{student}")
        for student in ("ann", "bob"):
            submission = gb.add_submission(ASSIGNMENT, student)
            for grade in submission.notebooks[0].grades:
                if grade.cell.cell_type == "markdown":
                    grade.needs_manual_grade = True
                else:
                    grade.auto_score = 0.0 if grade.name in failures[student] else grade.max_score
                    grade.needs_manual_grade = False
            folder = root / "autograded" / student / ASSIGNMENT
            folder.mkdir(parents=True)
            nbformat.write(executed(failures[student]), str(folder / f"{ASSIGNMENT}.ipynb"))
        gb.db.commit()
        # What a TA does in Formgrader for bob: grade the written answer 0, a comment on it and on
        # an answer cell, the test that timed out given its points by hand; he was 2 h late.
        gb.find_grade("why_contiguous", ASSIGNMENT, ASSIGNMENT, "bob").manual_score = 0.0
        gb.find_grade("why_contiguous", ASSIGNMENT, ASSIGNMENT, "bob").needs_manual_grade = False
        gb.find_grade("test_split_heads", ASSIGNMENT, ASSIGNMENT, "bob").manual_score = 1.0
        gb.find_comment("why_contiguous", ASSIGNMENT, ASSIGNMENT, "bob").manual_comment = COMMENT
        gb.find_comment("split_heads_einops", ASSIGNMENT, ASSIGNMENT, "bob").manual_comment = CODE_COMMENT
        bob = gb.find_submission(ASSIGNMENT, "bob")
        bob.timestamp = datetime.datetime(2026, 3, 1, 14, 0)
        bob.notebooks[0].late_submission_penalty = 1.0   # what an earlier `make grade` stored: the rule decides
        gb.db.commit()
    CourseSettings(late_penalty="zero").save(root)        # make settings LATE_PENALTY=zero
    (root / "autograded" / "bob" / ASSIGNMENT / ".grading.json").write_text(json.dumps({"incidents": [
        {"kind": "timeout", "notebook": ASSIGNMENT, "cell": 12, "grade_id": "merge_heads", "attempt": 1}]}))
    feedback.write_feedback(root)
    return root


def rows(page: str) -> dict[str, str]:
    """grade_id -> its state, as the page marks it."""
    return {grade_id: state for state, grade_id in re.findall(r"data-state='([^']+)'><td><code>([^<]+)</code>", page)}


def page_of(root: Path, student: str) -> str:
    return (root / "feedback" / student / ASSIGNMENT / f"{ASSIGNMENT}.html").read_text()


def test_each_question_shows_its_real_state(course):
    ann, bob = rows(page_of(course, "ann")), rows(page_of(course, "bob"))
    assert (ann["test_split_heads"], ann["why_contiguous"], ann["test_merge_heads"]) == ("failed", "pending", "passed")
    assert (bob["why_contiguous"], bob["test_split_heads"], bob["test_merge_heads"]) == (
        "graded by hand", "graded by hand", "failed")


def test_a_hand_graded_zero_and_the_graders_comments_reach_the_student(course):
    page = page_of(course, "bob")
    assert "graded by hand: 0 / 1" in page and "passed</td><td class='comment'>Say why" not in page
    assert "graded by hand: 1 / 2 (the automatic check passed)" in page
    assert COMMENT.replace("'", "&#x27;") in page and CODE_COMMENT in page and "split_heads_einops" in page


def bob_raw_score(root) -> float:
    with gradebook.open_gradebook(root) as gb:
        return float(gb.find_submission(ASSIGNMENT, "bob").score)


def test_a_time_limit_and_a_late_penalty_are_said_in_plain_words(course):
    page = page_of(course, "bob")
    assert "merge_heads ran past the time limit and was interrupted" in page
    assert "Stopped: the test ran past the time limit" in page
    raw = bob_raw_score(course)
    assert f"Submitted 2.0 hours after the due date: late penalty {raw:g} points." in page
    assert f"<b>0 / 22</b> ({raw:g} minus a late penalty of {raw:g})" in page
    ann = page_of(course, "ann")
    assert "incomplete: 1 answer still waiting for grading by hand" in ann and "after the due date" not in ann


def test_grades_csv_tells_not_submitted_from_zero_and_marks_incomplete_totals(course):
    grades, _ = export.export(course)
    with open(grades, newline="") as handle:
        table = {row["student_id"]: row for row in csv.DictReader(handle)}
    assert (table["cy"]["status"], table["cy"]["score"], table["cy"]["manual_grading_pending"]) == ("not submitted", "", "")
    assert (table["ann"]["status"], table["bob"]["status"]) == ("incomplete", "complete")
    assert table["bob"]["lms_user_id"] == "lms-bob"
    assert float(table["bob"]["late_submission_penalty"]) == float(table["bob"]["raw_score"]) == bob_raw_score(course)
    assert float(table["bob"]["score"]) == 0.0      # late under LATE_PENALTY=zero, hand grades included


def test_a_submission_that_could_not_be_graded_gets_a_page_saying_so(tmp_path):
    root = tmp_path / "course_root"
    (root / "reports").mkdir(parents=True)
    (root / "reports" / "grading_report.json").write_text(json.dumps({"submissions": [
        {"student": "dee", "assignment": ASSIGNMENT, "status": "failed", "error": "gave up after 6 attempts",
         "incidents": [{"kind": "kernel_died", "notebook": ASSIGNMENT, "cell": 7, "grade_id": "split_heads"}]},
        {"student": "eve", "assignment": ASSIGNMENT, "status": "graded"}]}))
    (page,) = feedback.write_feedback(root)
    text = page.read_text()
    assert page == root / "feedback" / "dee" / ASSIGNMENT / f"{ASSIGNMENT}.html"
    assert "Not graded yet" in text and "stopped or hung the Python kernel again" in text
    assert "split_heads stopped the Python kernel" in text and "attempts" not in text


def test_an_unanswered_written_answer_and_a_loop_outside_an_exercise_are_said_as_a_student_sees_them(course):
    """A written answer left as released (nbgrader scores it 0 and asks nobody) is "not
    answered", not "graded by hand"; a cell the time limit interrupted is named by the heading
    it is under, never by a cell number; an interrupted test says "time limit", not KeyboardInterrupt."""
    notebook = executed({"test_merge_heads": ("KeyboardInterrupt", "")})
    free = next(n for n, c in enumerate(notebook.cells, start=1)
                if c.cell_type == "code" and "nbgrader" not in c.metadata and n > 10)
    heading = next(line.lstrip("#").strip() for c in reversed(notebook.cells[:free]) if c.cell_type == "markdown"
                   for line in c.source.splitlines() if line.startswith("#"))
    with gradebook.open_gradebook(course) as gb:
        gb.update_or_create_student("dee")
        submission = gb.add_submission(ASSIGNMENT, "dee")
        for grade in submission.notebooks[0].grades:
            grade.auto_score = 0.0 if grade.name in ("why_contiguous", "test_merge_heads") else grade.max_score
            grade.needs_manual_grade = False
        gb.db.commit()
    folder = course / "autograded" / "dee" / ASSIGNMENT
    folder.mkdir(parents=True)
    nbformat.write(notebook, str(folder / f"{ASSIGNMENT}.ipynb"))
    (folder / ".grading.json").write_text(json.dumps({"incidents": [
        {"kind": "timeout", "notebook": ASSIGNMENT, "cell": free, "attempt": 1}]}))
    feedback.write_feedback(course, students=["dee"])
    page = page_of(course, "dee")
    assert rows(page)["why_contiguous"] == "not answered" and "not answered (left as released): 0 / 1" in page
    assert "graded by hand: " not in page
    assert f"the cell under “{heading}” ran past the time limit" in page, page
    assert f"cell {free}" not in page and "KeyboardInterrupt" not in page
    assert "Stopped: the test ran past the time limit" in page
