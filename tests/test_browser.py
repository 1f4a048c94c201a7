"""The course in a real browser: headless Debian chromium driven by Playwright.

* a student works through notebook 01 in `make lab` (setup cell, a wrong and a right
  split_heads, the attention explorer's slider, Validate);
* every course notebook opened in `make lab` and saved by JupyterLab keeps its bytes;
* an instructor uses Formgrader (`make formgrader`) on a small graded class: assignments,
  submissions, scores, Manage Students, a failed check read and grades adjusted by hand,
  which the export then reflects; a feedback page keeps the check message's line breaks.

Screenshots of every step are saved under build/browser-screenshots/<test>/ (printed by each
test); they are artifacts to look at, not compared. Without chromium the tests are skipped
with a loud reason (see tests/lab_servers.py).
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from attention_lab.checks.mha_shapes import SPLIT_HEADS_HINTS
from autograder import grade, release
from tests.conftest import ASSIGNMENTS, REPO_ROOT
from tests.lab_servers import browser, copy_course, running_lab, screenshots  # noqa: F401 -- fixtures

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("browser")]

WRONG_SPLIT_HEADS = '''def split_heads(x, num_heads):
    batch, seq_len, d_model = x.shape
    return x.reshape(batch, num_heads, seq_len, d_model // num_heads)
'''
RIGHT_SPLIT_HEADS = '''def split_heads(x, num_heads):
    batch, seq_len, d_model = x.shape
    if d_model % num_heads:
        raise ValueError(f"D = {d_model} is not divisible by H = {num_heads}")
    return x.view(batch, seq_len, num_heads, d_model // num_heads).transpose(1, 2)
'''
RIGHT_ATTENTION_WEIGHTS = '''def attention_weights(q, k, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1)
'''


# --------------------------------------------------------------------------------------
# JupyterLab, as a person uses it
# --------------------------------------------------------------------------------------

def open_notebook(context, server, name: str):
    page = context.new_page()
    page.goto(server.url(f"lab/tree/{name}"))
    page.wait_for_function("document.querySelectorAll('.jp-Notebook .jp-Cell').length > 2")
    wait_until_idle(page)
    return page


def wait_until_idle(page) -> None:
    """The kernel has started (or finished what it was running): the status bar says so."""
    page.get_by_text(re.compile(r"Python 3 \(ipykernel\) \| Idle")).first.wait_for(timeout=300_000)


def cell_index(page, text: str) -> int:
    """Index of the first cell whose text contains ``text``."""
    texts = page.locator(".jp-Notebook .jp-Cell").all_text_contents()
    return next(i for i, cell_text in enumerate(texts) if text in cell_text)


def run_cell(page, index: int) -> str:
    """Select a code cell, Shift+Enter, wait for its new execution count; return its output text."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    prompt = cell.locator(".jp-InputArea-prompt")
    before = prompt.text_content()
    prompt.click()
    page.keyboard.press("Shift+Enter")
    page.wait_for_function(
        """([element, before]) => element.textContent !== before && /\\[\\d+\\]/.test(element.textContent)""",
        arg=[prompt.element_handle(), before], timeout=300_000)
    return cell.locator(".jp-Cell-outputWrapper").inner_text()


def replace_cell_source(page, index: int, source: str) -> None:
    """Type over a cell's code the way a paste does (no auto-indent or auto-closed brackets)."""
    editor = page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".cm-content")
    editor.click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text(source)
    page.keyboard.press("Escape")


def squash(text: str) -> str:
    return " ".join(text.split())


# --------------------------------------------------------------------------------------
# Student
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def student_lab(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("browser-student")
    with running_lab("lab", copy_course(scratch / "course"), scratch) as server:
        yield server


def test_a_student_works_through_notebook_01(student_lab, browser, screenshots):  # noqa: F811
    before = {path.name for path in student_lab.root_dir.iterdir()}
    page = open_notebook(browser, student_lab, "01_mha_shapes.ipynb")
    screenshots.take(page, "opened")
    assert page.locator(".jp-Toolbar-item", has_text="Validate").count() == 1, "no Validate button"
    for instructor_tool in ("Formgrader", "Assignment List", "Courses", "Nbgrader"):
        assert page.get_by_text(instructor_tool, exact=True).count() == 0, f"students see {instructor_tool}"

    setup_output = run_cell(page, cell_index(page, "# Setup: the same cell in every notebook"))
    screenshots.take(page, "setup-cell-ran")
    assert "Error" not in setup_output, setup_output
    for index in (cell_index(page, "import math"), cell_index(page, "q_linear = nn.Linear")):
        run_cell(page, index)

    answer, demo, check = (cell_index(page, 'implement split_heads"'),
                           cell_index(page, "Q_heads = split_heads(Q, H)"),
                           cell_index(page, "check_split_heads"))
    replace_cell_source(page, answer, WRONG_SPLIT_HEADS)
    run_cell(page, answer)
    run_cell(page, demo)
    wrong = run_cell(page, check)
    page.locator(".jp-Notebook .jp-Cell").nth(check).scroll_into_view_if_needed()
    screenshots.take(page, "wrong-split-heads-check-message")
    assert squash(SPLIT_HEADS_HINTS["reshape_only"])[:60] in squash(wrong), wrong

    replace_cell_source(page, answer, RIGHT_SPLIT_HEADS)
    run_cell(page, answer)
    right = run_cell(page, check)
    screenshots.take(page, "right-split-heads-check-passes")
    assert "✓" in right and "Likely mistake" not in right, right

    weights = cell_index(page, 'implement attention_weights"')
    replace_cell_source(page, weights, RIGHT_ATTENTION_WEIGHTS)
    run_cell(page, weights)
    run_cell(page, cell_index(page, "attention_explorer(attention_weights"))
    explorer = page.locator(".jp-Notebook .jp-Cell").nth(cell_index(page, "attention_explorer(attention_weights"))
    picture = explorer.locator(".widget-image")
    picture.wait_for()
    explorer.scroll_into_view_if_needed()
    screenshots.take(page, "explorer")
    first_picture = picture.get_attribute("src")
    handle = explorer.locator(".widget-slider .noUi-handle").first
    box = handle.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(box["x"] + 150, box["y"] + box["height"] / 2, steps=10)
    page.mouse.up()
    page.wait_for_function("([image, first]) => image.getAttribute('src') !== first",
                           arg=[picture.element_handle(), first_picture], timeout=120_000)
    wait_until_idle(page)
    screenshots.take(page, "explorer-after-slider")

    page.locator(".jp-Toolbar-item", has_text="Validate").click()
    dialog = page.locator(".jp-Dialog")
    dialog.wait_for(timeout=600_000)
    dialog.get_by_text("Validation Results").wait_for(timeout=600_000)
    screenshots.take(page, "validate")
    # The saved notebook was validated: split_heads passes now, the first blank (merge_heads) fails.
    report = dialog.inner_text()
    assert "check_merge_heads(merge_heads)" in report and "check_split_heads(split_heads)" not in report, report
    page.close()

    # What the lab left in the student's folder besides their notebooks: only what git ignores.
    added = {path.name for path in student_lab.root_dir.iterdir()} - before
    for name in added:
        relative = f"course/{name}/" if (student_lab.root_dir / name).is_dir() else f"course/{name}"
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", relative], cwd=REPO_ROOT)
        assert ignored.returncode == 0, f"the lab wrote course/{name}, which git would commit"


def test_every_course_notebook_opened_and_saved_by_jupyterlab_keeps_its_bytes(student_lab, browser, screenshots):  # noqa: F811
    for assignment in ASSIGNMENTS:
        path = student_lab.root_dir / f"{assignment}.ipynb"
        committed = (REPO_ROOT / "course" / path.name).read_bytes()
        path.write_bytes(committed)  # the student test may have edited 01 (their own work)
        saved_before = path.stat().st_mtime_ns
        page = open_notebook(browser, student_lab, path.name)
        tab = page.locator(".lm-TabBar-tab.jp-mod-current")
        # Autosave (every few seconds here) writes whatever the kernel's connection changed...
        page.wait_for_function("tab => !tab.classList.contains('jp-mod-dirty')", arg=tab.element_handle(),
                               timeout=120_000)
        # ...and a save by hand writes once more, so the comparison never tests an unsaved file.
        page.keyboard.press("Control+s")
        deadline = time.monotonic() + 120
        while path.stat().st_mtime_ns == saved_before and time.monotonic() < deadline:
            page.wait_for_timeout(250)  # polling the file, not waiting for a fixed time
        screenshots.take(page, f"{assignment}-saved")
        page.close()
        assert path.stat().st_mtime_ns != saved_before, f"JupyterLab never saved {path.name}"
        assert path.read_bytes() == committed, f"saving {path.name} in JupyterLab changed it"


# --------------------------------------------------------------------------------------
# Instructor
# --------------------------------------------------------------------------------------

TINY = "00_tiny"
TINY_TEST_MESSAGE = 'double(2) should be 4\\n  got: {double(2)}\\n  likely mistake: adding 1 instead of doubling'


def tiny_source() -> nbformat.NotebookNode:
    """A one-exercise assignment with an autograded test and a written answer graded by hand."""
    cells = [
        nbformat.v4.new_markdown_cell("# 00 — A tiny assignment\n\n**3 points, about 2 minutes.**"),
        nbformat.v4.new_code_cell("def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION",
                                  metadata={"answer": "double"}),
        nbformat.v4.new_code_cell(f'"""double doubles."""\nassert double(2) == 4, f"{TINY_TEST_MESSAGE}"',
                                  metadata={"test": "test_double", "points": 1}),
        nbformat.v4.new_markdown_cell("Doubling adds a number to itself.", metadata={"manual": "why_double", "points": 2}),
    ]
    for cell in cells:
        nbgrader = release.nbgrader_metadata(cell)
        cell.metadata = {"nbgrader": nbgrader} if nbgrader else {}
    return release.normalise(nbformat.v4.new_notebook(cells=cells))


def tiny_submission(source: nbformat.NotebookNode, body: str, written: str) -> nbformat.NotebookNode:
    notebook = nbformat.from_dict(nbformat.reads(nbformat.writes(source), as_version=4))
    notebook.cells[1].source = f"def double(x):\n    {body}"
    notebook.cells[3].source = written
    return notebook


def pipeline(module: str, root: Path, *arguments: str) -> str:
    result = subprocess.run([sys.executable, "-m", f"autograder.{module}", "--root", str(root), *arguments],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, f"autograder.{module} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def graded_class(tmp_path_factory):
    """A course root with the five course assignments and a tiny one, two students graded."""
    root = tmp_path_factory.mktemp("browser-instructor") / "course_root"
    source = tiny_source()
    release.write_notebook(source, root / "source" / TINY / f"{TINY}.ipynb")
    for student, body, written in (("ada", "return 2 * x", "Because 2x = x + x."),
                                   ("bob", "return x + 1", "No idea.")):
        release.write_notebook(tiny_submission(source, body, written),
                               root / "submitted" / student / TINY / f"{TINY}.ipynb")
    # Formgrader reads the one nbgrader config (autograder/nbgrader_config.py) and then the
    # working folder's: this scratch root names itself, as `--root` does for the pipeline.
    (root / "nbgrader_config.py").write_text(f"c = get_config()\nc.CourseDirectory.root = {str(root)!r}\n")
    # `make grade` puts every course assignment in the instructor's course root; a scratch root
    # gets only what was submitted to it, so the five sources are built here the same way.
    grade.ensure_sources(root, release.assignment_names())
    pipeline("grade", root, "--jobs", "1")
    pipeline("feedback", root)
    return root


@pytest.fixture(scope="module")
def instructor_lab(graded_class, tmp_path_factory):
    scratch = tmp_path_factory.mktemp("browser-formgrader")
    with running_lab("formgrader", graded_class, scratch) as server:
        yield server


def set_score(page, grade_id: str, score: str) -> None:
    """Type a score into Formgrader's box for a graded cell; wait until Formgrader stored it."""
    box = page.locator(f"input.score#{grade_id}")
    box.fill(score)
    with page.expect_response(lambda r: "/formgrader/api/grade/" in r.url and r.request.method == "PUT" and r.ok):
        box.press("Tab")


def _by_question(root: Path) -> dict[tuple[str, str], dict]:
    with open(root / "grades_by_question.csv", newline="") as file:
        return {(row["student"], row["grade_id"]): row for row in csv.DictReader(file) if row["assignment"] == TINY}


def test_an_instructor_grades_in_formgrader_and_the_export_reflects_it(instructor_lab, graded_class, browser,  # noqa: F811
                                                                        screenshots):
    page = browser.new_page()
    page.goto(instructor_lab.url("formgrader"))
    table = page.locator("table")
    table.get_by_text(TINY, exact=True).wait_for()
    for assignment in ASSIGNMENTS:
        table.get_by_text(assignment, exact=True).wait_for()
    screenshots.take(page, "manage-assignments")

    page.goto(instructor_lab.url("formgrader/manage_students"))
    page.locator("table").get_by_text("bob", exact=True).wait_for()
    screenshots.take(page, "manage-students")

    page.goto(instructor_lab.url(f"formgrader/gradebook/{TINY}/{TINY}"))
    rows = page.locator("table tbody tr")
    rows.filter(has_text="bob").wait_for()
    screenshots.take(page, "submissions-and-scores")
    assert re.search(r"1(\.0+)? / 3", rows.filter(has_text="ada").inner_text()), rows.filter(has_text="ada").inner_text()
    assert re.search(r"0(\.0+)? / 3", rows.filter(has_text="bob").inner_text()), rows.filter(has_text="bob").inner_text()

    # bob: read the failed check, then give the point by hand (an override of the autograder)
    rows.filter(has_text="bob").locator("td.name a:visible").click()
    page.get_by_text("likely mistake: adding 1 instead of doubling").first.wait_for()
    screenshots.take(page, "bob-failed-check")
    set_score(page, "test_double", "1")
    screenshots.take(page, "bob-adjusted")

    # ada: grade the written answer
    page.goto(instructor_lab.url(f"formgrader/gradebook/{TINY}/{TINY}"))
    page.locator("table tbody tr").filter(has_text="ada").locator("td.name a:visible").click()
    page.get_by_text("Because 2x = x + x.").first.wait_for()
    set_score(page, "why_double", "2")
    screenshots.take(page, "ada-written-answer-graded")

    # The same Formgrader from inside JupyterLab (Nbgrader menu), next to the course root's files.
    page.goto(instructor_lab.url("lab"))
    page.get_by_text("Nbgrader", exact=True).first.click()
    page.get_by_text("Formgrader", exact=True).first.click()
    page.frame_locator("iframe").first.get_by_text(TINY, exact=True).first.wait_for()
    screenshots.take(page, "formgrader-in-jupyterlab")
    page.close()

    pipeline("export", graded_class)
    grades = _by_question(graded_class)
    assert float(grades[("bob", "test_double")]["score"]) == 1.0
    assert float(grades[("ada", "why_double")]["score"]) == 2.0
    assert float(grades[("ada", "test_double")]["score"]) == 1.0


def test_manage_students_works_on_a_new_course_root_without_the_venv_on_path(tmp_path, browser, screenshots):  # noqa: F811
    """Formgrader creates the gradebook through nbgrader's `alembic` executable; `make formgrader`
    must find it even when the shell has no virtual environment activated."""
    root = tmp_path / "course_root"
    root.mkdir()
    (root / "nbgrader_config.py").write_text(f"c = get_config()\nc.CourseDirectory.root = {str(root)!r}\n")
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != venv_bin)
    with running_lab("formgrader", root, tmp_path, extra_env={"PATH": path}) as server:
        page = browser.new_page()
        page.goto(server.url("formgrader"))
        with page.expect_response(lambda r: "/formgrader/api/students" in r.url) as response:
            page.goto(server.url("formgrader/manage_students"))
        assert response.value.status == 200, response.value.text()[-2000:]
        page.get_by_text("Add new student").first.wait_for()
        screenshots.take(page, "manage-students-new-course")
        page.close()
    assert (root / "gradebook.db").exists()


def test_a_feedback_page_keeps_the_check_messages_line_breaks(graded_class, browser, screenshots):  # noqa: F811
    pages = sorted((graded_class / "feedback" / "bob" / TINY).glob("*.html"))
    assert pages, f"no feedback page for bob in {graded_class / 'feedback'}"
    page = browser.new_page()
    page.goto(pages[0].as_uri())
    message = page.get_by_text("double(2) should be 4").first
    message.wait_for()
    screenshots.take(page, "feedback-page")
    shown = message.locator("xpath=ancestor-or-self::*[contains(., 'likely mistake')][1]").inner_text()
    assert re.search(r"should be 4\s*\n\s*got: 3\s*\n\s*likely mistake", shown), shown
    page.close()
