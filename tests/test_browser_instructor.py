"""The instructor's pages in a real browser (headless Debian chromium, see tests/lab_servers.py):

* the class report of a generated class (tests/test_report.py): its figures load, the most
  frequent mistake is named with its count, the copied pair is flagged;
* a feedback page (tests/test_feedback.py) shows a hand-graded 0, the TA's comment and the
  time limit in plain words.

Formgrader's buttons in the browser are in tests/test_formgrader_buttons.py, beside their
API tests, on the same server.
"""

from __future__ import annotations

import pytest

from tests.test_feedback import ASSIGNMENT as FEEDBACK_ASSIGNMENT
from tests.test_feedback import COMMENT
from tests.test_feedback import course as feedback_course  # noqa: F401 -- fixture
from tests.test_report import generated_class, written  # noqa: F401 -- fixtures

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("browser_instructor_pages")]


def test_the_class_report_opens_with_its_figures_and_names_the_mistakes(written, browser, screenshots):
    path, _ = written
    page = browser.new_page()
    page.goto(path.as_uri())
    page.get_by_role("heading", name="Most frequent mistakes").wait_for()
    loaded = page.evaluate("Array.from(document.images).map(i => i.complete && i.naturalWidth > 0)")
    assert loaded and all(loaded), loaded
    first = page.locator("table#mistakes tr").nth(1)
    assert "mha_shapes.split_heads/reshape_only" in first.inner_text() and first.locator("td").last.inner_text() == "4"
    assert "s07 and s08" in page.locator("table#similar").inner_text()
    assert "make grade" in page.locator("table#not-graded").inner_text()
    screenshots.take(page, "class-report")
    page.close()


def test_a_feedback_page_shows_the_hand_grade_the_comment_and_the_time_limit(feedback_course, browser, screenshots):
    page = browser.new_page()
    page.goto((feedback_course / "feedback" / "bob" / FEEDBACK_ASSIGNMENT / f"{FEEDBACK_ASSIGNMENT}.html").as_uri())
    row = page.locator("tr", has=page.locator("code", has_text="why_contiguous"))
    assert "graded by hand: 0 / 1" in row.inner_text() and COMMENT in row.inner_text()
    assert "ran past the time limit" in page.locator("ul.incidents").inner_text()
    screenshots.take(page, "feedback-hand-graded")
    page.close()
