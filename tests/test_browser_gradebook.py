"""Formgrader on the shared PostgreSQL gradebook, in the browser: the grades the pipeline
wrote are visible, and a grade typed by hand is saved into the server's gradebook (where
the next grading run and every other grader's Formgrader read it). A late submission keeps its
late penalty after that hand grade, in every export, with no `make grade` between, and
Formgrader's page says its scores are raw (issue #56, "Wrong 1", on PostgreSQL)."""

from __future__ import annotations

import datetime
import re

import pytest

from autograder.grading import grade
from autograder.reports import export, feedback, lms_export
from autograder.store import gradebook
from autograder.term import roster
from autograder.term.course_settings import CourseSettings
from autograder.places import DB_URL_VARIABLE
from tests.grading_helpers import TINY, tiny_course
from tests.lab_servers import running_lab, set_formgrader_score
from tests.postgres_server import postgres_server

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("postgres_browser")]


def test_formgrader_shows_and_saves_grades_in_the_postgresql_gradebook(tmp_path, browser, screenshots):
    with postgres_server() as database:
        url = database("formgrader")
        root = tiny_course(tmp_path / "course_root", {"ada": "value = 42", "bob": "value = 41"},
                           written={"ada": "Because six times seven.", "bob": "No idea."})
        # Formgrader reads autograder/nbgrader_config.py (the gradebook from $ATTENTION_LAB_DB_URL),
        # then this root's own config naming the root.
        (root / "nbgrader_config.py").write_text(f"c = get_config()\nc.CourseDirectory.root = {str(root)!r}\n")
        CourseSettings(late_penalty="zero").save(root)                       # make settings LATE_PENALTY=zero
        (root / "submitted" / "ada" / TINY / "timestamp.txt").write_text("2026-01-11 12:00:00.000000 UTC")
        outcomes = grade.grade(root, jobs=1, limits=grade.Limits(timeout=30), db_url=url, log=lambda *_: None)
        assert [o.status for o in outcomes] == ["graded", "graded"]
        roster.set_deadlines({TINY: datetime.datetime(2026, 1, 10, 12, 0)}, root)   # a day before ada's time
        with running_lab("formgrader", root, tmp_path, extra_env={DB_URL_VARIABLE: url}) as server:
            page = browser.new_page()
            page.goto(server.url("formgrader"))            # logs in with the token, lists the assignments
            page.locator("table").get_by_text(TINY, exact=True).wait_for()
            page.goto(server.url(f"formgrader/gradebook/{TINY}/{TINY}"))
            rows = page.locator("table tbody tr")
            rows.filter(has_text="bob").wait_for()
            screenshots.take(page, "postgres-submissions")
            assert re.search(r"1(\.0+)? / 3", rows.filter(has_text="ada").inner_text())
            assert re.search(r"0(\.0+)? / 3", rows.filter(has_text="bob").inner_text())
            note = page.locator("#attention-lab-raw-scores").inner_text()
            assert "Raw scores." in note and "ada, 00_tiny: 24.0 hours late; raw 1 / 3, late penalty 1, score 0" in note, note
            rows.filter(has_text="ada").locator("td.name a:visible").click()
            page.get_by_text("Because six times seven.").first.wait_for()
            set_formgrader_score(page, "why_value", "2")
            screenshots.take(page, "postgres-written-answer-graded")
            page.close()
        assert not (root / "gradebook.db").exists(), "Formgrader opened an SQLite gradebook instead"
        with gradebook.open_gradebook(root, url) as gb:
            assert gb.find_grade("why_value", TINY, TINY, "ada").manual_score == 2.0
            assert gb.find_submission(TINY, "ada").score == 3.0
        # the readers, with no `make grade` since: the late penalty is the rule's, hand grade included
        columns = export.GRADE_COLUMNS
        ada = next(r for r in export.grade_rows(root) if r[columns.index("student_id")] == "ada")
        assert [ada[columns.index(c)] for c in ("raw_score", "late_submission_penalty", "score")] == ["3.0", "3.0", "0.0"]
        assert lms_export.class_grades(root)[2][("ada", TINY)] == (0.0, False)
        feedback.write_feedback(root)
        assert "<b>0 / 3</b> (3 minus a late penalty of 3)" in (root / "feedback" / "ada" / TINY / f"{TINY}.html").read_text()
