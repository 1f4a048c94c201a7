"""Formgrader on the shared PostgreSQL gradebook, in the browser: the grades the pipeline
wrote are visible, and a grade typed by hand is saved into the server's gradebook (where
the next grading run and every other grader's Formgrader read it)."""

from __future__ import annotations

import re

import pytest

from autograder.grading import grade
from autograder.store import gradebook
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
        outcomes = grade.grade(root, jobs=1, limits=grade.Limits(timeout=30), db_url=url, log=lambda *_: None)
        assert [o.status for o in outcomes] == ["graded", "graded"]
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
            rows.filter(has_text="ada").locator("td.name a:visible").click()
            page.get_by_text("Because six times seven.").first.wait_for()
            set_formgrader_score(page, "why_value", "2")
            screenshots.take(page, "postgres-written-answer-graded")
            page.close()
        assert not (root / "gradebook.db").exists(), "Formgrader opened an SQLite gradebook instead"
        with gradebook.open_gradebook(root, url) as gb:
            assert gb.find_grade("why_value", TINY, TINY, "ada").manual_score == 2.0
            assert gb.find_submission(TINY, "ada").score == 3.0
