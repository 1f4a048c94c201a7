"""Formgrader's own buttons, driven through its HTTP API as its pages do (`make formgrader`):

* Generate Feedback writes the pipeline's feedback page (the real state of each question, the
  grade and comment a TA typed in Formgrader), never the autograded notebook with its hidden tests;
* Autograde grades through `python -m autograder.grading.grade` (sandbox, one writer of the gradebook),
  keeping the other students' hand grades;
* Generate, Release, Collect and Release Feedback are refused with what to run instead;
* the roster's names reach Formgrader's student list;
* and in the browser: clicking *Generate* says to use `make release`, in a whole sentence in view
  (no "Traceback" box), the roster's names are shown, clicking *Generate Feedback* for a
  submission runs the pipeline's feedback;
* a hand grade typed on a late submission keeps its late penalty in every export, and
  Formgrader's pages say their scores are raw (issue #56); `make clean` while Formgrader runs
  leaves it working.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import urllib.request
from pathlib import Path

import nbformat
import pytest

from autograder.publishing import release
from autograder.store import gradebook
from autograder.term import roster
from autograder.term.course_settings import CourseSettings
from autograder.formgrader.pipeline_buttons import REFUSALS
from autograder.publishing.release import mark_hidden_tests
from autograder.places import COURSE_ROOT_VARIABLE
from tests.lab_servers import running_lab, set_formgrader_score
from tests.readme_commands import run_readme_command
from tests.test_browser import TINY, pipeline, tiny_source, tiny_submission

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("formgrader_buttons")]

HIDDEN = "assert double(21) == 42, 'the grader keeps this secret'"
TA_COMMENT = "Your reasoning is missing: say why 2x = x + x."


def hidden_source() -> nbformat.NotebookNode:
    """The tiny assignment, its test cell with a hidden block (as the grader builds it)."""
    source = tiny_source()
    test = source.cells[2]
    test.source = mark_hidden_tests(test.source + f"\n{release.HIDDEN_BEGIN}\n{HIDDEN}\n{release.HIDDEN_END}")
    return source


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("formgrader-buttons") / "course_root"
    source = hidden_source()
    release.write_notebook(source, root / "source" / TINY / f"{TINY}.ipynb")
    plain = tiny_source()  # what students have: no hidden block
    for student, body, written in (("ada", "return 2 * x", "Because 2x = x + x."), ("bob", "return x + 1", "No idea.")):
        release.write_notebook(tiny_submission(plain, body, written), root / "submitted" / student / TINY / f"{TINY}.ipynb")
    (root / "nbgrader_config.py").write_text(f"c = get_config()\nc.CourseDirectory.root = {str(root)!r}\n")
    classlist = root.parent / "class.csv"
    classlist.write_text("id,first_name,last_name,email,lms_user_id\nada,Ada,Lovelace,ada@x.org,1\nbob,Bob,Babbage,,2\n")
    roster.import_roster(classlist, root)
    pipeline("grade", root, "--jobs", "1")
    pipeline("feedback", root)
    return root


@pytest.fixture(scope="module")
def formgrader(graded, tmp_path_factory):
    with running_lab("formgrader", graded, tmp_path_factory.mktemp("formgrader-buttons-lab")) as server:
        yield server


def call(server, method: str, path: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else (b"" if method != "GET" else None)
    request = urllib.request.Request(server.url(path), data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=1200) as response:
        return json.loads(response.read().decode())


def submitted_notebook_id(server, student: str) -> str:
    rows = call(server, "GET", f"formgrader/api/submitted_notebooks/{TINY}/{TINY}")
    return next(row["id"] for row in rows if row["student"] == student)


def every_file_text(folder: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(folder.rglob("*")) if p.is_file())


def test_formgrader_shows_the_rosters_names(formgrader):
    students = {s["id"]: s for s in call(formgrader, "GET", "formgrader/api/students")}
    assert (students["ada"]["first_name"], students["ada"]["last_name"]) == ("Ada", "Lovelace")
    assert students["bob"]["last_name"] == "Babbage"


@pytest.mark.parametrize("route, expected", [
    (f"formgrader/api/assignment/{TINY}/assign", "type `make release`"),
    (f"formgrader/api/assignment/{TINY}/release", "no exchange folder"),
    (f"formgrader/api/assignment/{TINY}/unrelease", "`make release` and `make publish`"),
    (f"formgrader/api/assignment/{TINY}/collect", "type `make intake SUBMISSIONS="),
    (f"formgrader/api/assignment/{TINY}/release_feedback", "send them through"),
    (f"formgrader/api/assignment/{TINY}/bob/release_feedback", "send them through"),
    (f"formgrader/api/submission/{TINY}/nobody/autograde", "make intake"),
])
def test_buttons_that_would_fork_the_pipeline_are_refused_with_what_to_run(formgrader, graded, route, expected):
    def state():
        return {p: p.stat().st_mtime_ns for name in ("source", "release", "exchange", "submitted", "feedback")
                for p in (graded / name).rglob("*")}

    before = state()
    reply = call(formgrader, "POST", route)
    # the sentence is the reply's log: Formgrader shows an `error` under the heading "Traceback"
    assert reply["success"] is False and expected in reply["log"] and not reply["error"], reply
    assert state() == before


def test_generate_feedback_shows_the_hand_grade_and_comment_and_no_hidden_test(formgrader, graded):
    notebook = submitted_notebook_id(formgrader, "bob")
    grades = {g["name"]: g for g in call(formgrader, "GET", f"formgrader/api/grades?submission_id={notebook}")}
    call(formgrader, "PUT", f"formgrader/api/grade/{grades['why_double']['id']}", {"manual_score": 0, "extra_credit": 0})
    comments = {c["name"]: c for c in call(formgrader, "GET", f"formgrader/api/comments?submission_id={notebook}")}
    call(formgrader, "PUT", f"formgrader/api/comment/{comments['why_double']['id']}", {"manual_comment": TA_COMMENT})

    reply = call(formgrader, "POST", f"formgrader/api/assignment/{TINY}/bob/generate_feedback")
    assert reply["success"] is True, reply
    page = (graded / "feedback" / "bob" / TINY / f"{TINY}.html").read_text()
    assert "graded by hand: 0 / 2" in page and TA_COMMENT in page
    assert "data-state='failed'" in page and "likely mistake: adding 1 instead of doubling" in page
    everything = every_file_text(graded / "feedback")
    assert "keeps this secret" not in everything and "double(21)" not in everything
    assert "BEGIN HIDDEN" not in everything and not list((graded / "feedback").rglob("*.ipynb"))

    reply = call(formgrader, "POST", f"formgrader/api/assignment/{TINY}/generate_feedback")  # the whole class
    assert reply["success"] is True, reply
    ada = (graded / "feedback" / "ada" / TINY / f"{TINY}.html").read_text()
    assert "data-state='pending'" in ada and "incomplete" in ada  # her written answer is not graded yet
    assert "keeps this secret" not in every_file_text(graded / "feedback")


def test_autograde_goes_through_the_pipeline_and_keeps_other_hand_grades(formgrader, graded):
    """... and applies the course settings (`make settings LATE_PENALTY=zero`) as `make grade` does."""
    CourseSettings(late_penalty="zero").save(graded)
    roster.set_deadlines({TINY: datetime.datetime(2026, 1, 10, 12, 0)}, graded)
    (graded / "submitted" / "ada" / TINY / "timestamp.txt").write_text("2026-01-11 12:00:00.000000 UTC")
    record = graded / "autograded" / "ada" / TINY / ".grading.json"
    before = record.stat().st_mtime_ns
    bob_notebook = submitted_notebook_id(formgrader, "bob")
    bob_grades = {g["name"]: g for g in call(formgrader, "GET", f"formgrader/api/grades?submission_id={bob_notebook}")}
    call(formgrader, "PUT", f"formgrader/api/grade/{bob_grades['test_double']['id']}", {"manual_score": 1, "extra_credit": 0})

    reply = call(formgrader, "POST", f"formgrader/api/submission/{TINY}/ada/autograde")
    assert reply["success"] is True, reply
    assert "python -m autograder.grading.grade" in reply["log"] and "graded 1" in reply["log"], reply["log"]
    assert record.stat().st_mtime_ns != before  # written by the pipeline's merge, the gradebook's one writer
    report = json.loads((graded / "reports" / "grading_report.json").read_text())
    assert [(s["student"], s["status"]) for s in report["submissions"]] == [("ada", "graded")]
    with gradebook.open_gradebook(graded) as gb:
        assert gb.find_grade("test_double", TINY, TINY, "bob").manual_score == 1
        assert gb.find_submission(TINY, "ada").score == 1.0
        assert gb.find_submission(TINY, "ada").late_submission_penalty == 1.0, "the course's late penalty was not applied"
    assert "- late penalty: zero" in (graded / "reports" / "grading_report.md").read_text()


def test_formgraders_buttons_in_the_browser(formgrader, graded, browser, screenshots):
    page = browser.new_page()
    page.goto(formgrader.url("formgrader"))  # logs in (the token becomes a cookie for Formgrader's API calls)
    page.locator("table").get_by_text(TINY, exact=True).wait_for()
    # Manage Assignments: Generate says to use `make release`, and generates nothing
    source = (graded / "source" / TINY / f"{TINY}.ipynb").stat().st_mtime_ns
    page.locator("table tbody tr").filter(has_text=TINY).locator("td.assign a").click()
    refusal = page.locator("#error-modal")
    refusal.get_by_text("make release").first.wait_for()
    screenshots.take(page, "generate-refused")
    # a sentence, whole and in view (no "Traceback" box cut at the dialog's right edge), in a wide
    # window and in a narrow one
    assert "Traceback" not in refusal.inner_text()
    for width in (1400, 480):
        page.set_viewport_size({"width": width, "height": 1000})
        shown = refusal.locator("pre")
        assert " ".join(shown.inner_text().split()) == REFUSALS["generate"]
        assert shown.evaluate("e => e.scrollWidth <= e.clientWidth && e.scrollHeight <= e.clientHeight"), width
        box, window = shown.bounding_box(), page.viewport_size
        assert box["x"] >= 0 and box["x"] + box["width"] <= window["width"], (box, window)
    screenshots.take(page, "generate-refused-narrow")
    page.set_viewport_size({"width": 1400, "height": 1000})
    assert (graded / "source" / TINY / f"{TINY}.ipynb").stat().st_mtime_ns == source
    page.goto(formgrader.url(f"formgrader/manage_submissions/{TINY}"))
    row = page.locator("table tbody tr").filter(has_text="Babbage")
    row.wait_for()
    assert "None, None" not in page.locator("table").inner_text()  # the roster's names
    before = (graded / "feedback" / "bob" / TINY / f"{TINY}.html").stat().st_mtime_ns
    with page.expect_response(lambda r: r.url.split("?")[0].endswith(f"/{TINY}/bob/generate_feedback")) as response:
        row.locator("td.generate-feedback a").click()
    assert response.value.json()["success"] is True
    dialog = page.locator("#success-modal")
    dialog.get_by_text("Successfully generated feedback").wait_for()
    assert "python -m autograder.reports.feedback" in dialog.inner_text()
    screenshots.take(page, "generate-feedback-through-the-pipeline")
    assert (graded / "feedback" / "bob" / TINY / f"{TINY}.html").stat().st_mtime_ns != before
    page.close()


def test_a_hand_grade_on_a_late_submission_keeps_its_late_penalty_and_formgrader_says_scores_are_raw(
        formgrader, graded, browser, screenshots):
    """Issue #56, "Wrong 1", on SQLite (tests/test_browser_gradebook.py: on PostgreSQL): ada's
    notebook is late under ``LATE_PENALTY=zero`` (test_autograde_... above graded it so); a TA gives
    her written answer full marks in Formgrader, and no `make grade` follows. `make export`, `make
    feedback`, `make lms-export` and `make report`, as written, still give her 0 (raw 3, the late
    penalty 3), and Formgrader's pages say that their scores are raw and list her as late."""
    from autograder.term import scores

    CourseSettings(late_penalty="zero").save(graded)    # (where this test runs alone)
    roster.set_deadlines({TINY: datetime.datetime(2026, 1, 10, 12, 0)}, graded)
    with gradebook.open_gradebook(graded) as gb:
        late = scores.submission_score(gb.find_submission(TINY, "ada"), CourseSettings.load(graded)).late
    if not late:
        (graded / "submitted" / "ada" / TINY / "timestamp.txt").write_text("2026-01-11 12:00:00.000000 UTC")
        assert call(formgrader, "POST", f"formgrader/api/submission/{TINY}/ada/autograde")["success"]
    page = browser.new_page()
    page.goto(formgrader.url("formgrader"))  # logs in (the token becomes a cookie for Formgrader's API calls)
    page.locator("table").get_by_text(TINY, exact=True).wait_for()
    page.goto(formgrader.url(f"formgrader/gradebook/{TINY}/{TINY}"))
    page.locator("table tbody tr").filter(has_text="ada").wait_for()
    note = page.locator("#attention-lab-raw-scores")
    assert "Raw scores." in note.inner_text() and "late penalty zero" in note.inner_text(), note.inner_text()
    assert "ada, 00_tiny: 24.0 hours late; raw 1 / 3, late penalty 1, score 0" in note.inner_text(), note.inner_text()
    screenshots.take(page, "raw-scores-noted")
    page.locator("table tbody tr").filter(has_text="ada").locator("td.name a:visible").click()
    page.get_by_text("Because 2x = x + x.").first.wait_for()
    assert "ada, 00_tiny" in page.locator("#attention-lab-raw-scores").inner_text()   # on the grading page too
    set_formgrader_score(page, "why_double", "2")
    screenshots.take(page, "late-submission-hand-graded")
    page.goto(formgrader.url("formgrader/manage_students/ada"))
    assert "raw 3 / 3, late penalty 3, score 0" in page.locator("#attention-lab-raw-scores").inner_text()
    page.close()

    environment = dict(os.environ, **{COURSE_ROOT_VARIABLE: str(graded)})
    for command in ("make export", "make feedback", "make lms-export", "make report"):
        done = run_readme_command(command, env=environment, timeout=600)
        assert done.returncode == 0, command + done.stdout + done.stderr
    with open(graded / "grades.csv", newline="") as handle:
        ada = next(r for r in csv.DictReader(handle) if r["student_id"] == "ada")
    assert (ada["raw_score"], ada["late_submission_penalty"], ada["score"]) == ("3.0", "3.0", "0.0"), ada
    with open(graded / "grades_by_question.csv", newline="") as handle:
        questions = {r["grade_id"]: (r["raw_score"], r["score"]) for r in csv.DictReader(handle) if r["student"] == "ada"}
    assert questions == {"test_double": ("1", "0"), "why_double": ("2", "0")}, questions
    page = (graded / "feedback" / "ada" / TINY / f"{TINY}.html").read_text()
    assert "<b>0 / 3</b> (3 minus a late penalty of 3)" in page, page
    with open(graded / "lms" / "canvas_grades.csv", newline="") as handle:
        assert next(r for r in csv.reader(handle) if r[2] == "ada")[-1] == "0"
    report = json.loads((graded / "reports" / "class" / TINY / "report.json").read_text())
    assert report["late"] == [{"student": "ada", "late": "24.0 hours", "raw_score": 3.0, "late_penalty": 3.0,
                               "score": 0.0}], report["late"]
    assert "Raw scores:" in (graded / "reports" / "class" / TINY / "index.html").read_text()


def test_make_clean_keeps_what_a_running_formgrader_needs(formgrader, graded, browser, screenshots):
    """`make clean` while Formgrader runs: what it lists assignments from stays (source/, its
    exchange folder), and Manage Assignments still lists the assignment (it vanished)."""
    environment = dict(os.environ, **{COURSE_ROOT_VARIABLE: str(graded)})
    cleaned = run_readme_command("make clean", env=environment, timeout=300)
    assert cleaned.returncode == 0, cleaned.stdout + cleaned.stderr
    assert (graded / "exchange").is_dir() and (graded / "source").is_dir() and not (graded / "feedback").exists()
    assert TINY in {a["name"] for a in call(formgrader, "GET", "formgrader/api/assignments")}
    page = browser.new_page()
    page.goto(formgrader.url("formgrader/manage_assignments"))
    page.locator("table tbody tr").filter(has_text=TINY).wait_for()
    screenshots.take(page, "after-make-clean")
    page.close()
