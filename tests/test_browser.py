"""The course in a real browser: headless Debian chromium driven by Playwright.

* a student works through notebook 01 in `make lab` (setup cell, a wrong and a right
  split_heads, the attention explorer's slider, Validate);
* every course notebook opened in `make lab` is not marked modified, saved by JupyterLab keeps
  its bytes, and closes without asking;
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
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from attention_lab.checks.mha_shapes import SPLIT_HEADS_HINTS
from autograder.grading import grade
from autograder.publishing import release
from tests.conftest import ASSIGNMENTS, NOISE, REPO_ROOT
from tests.lab_servers import POLL_MS, copy_course, running_lab, set_formgrader_score, wait_until

pytestmark = [pytest.mark.slow]
# One group per server the tests share, so that the three run side by side on two workers
# and each server starts once.
ON_THE_STUDENT_LAB = pytest.mark.xdist_group("browser_student_lab")
ON_THE_SOLVED_LAB = pytest.mark.xdist_group("browser_solved_lab")
ON_THE_GRADED_CLASS = pytest.mark.xdist_group("browser_graded_class")

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


@ON_THE_STUDENT_LAB  # its browser
def test_the_browser_reaches_nothing_off_the_machine(browser):
    """A page's request to another host (a name, an IPv4 or an IPv6 address) is refused at once by
    the browser (tests/lab_servers.off_the_network); it never waits on the network."""
    from playwright.sync_api import Error as PlaywrightError

    for url in ("https://cdnjs.cloudflare.com/ajax/libs/mathjax/", "http://1.1.1.1/", "http://[2606:4700::1111]/"):
        page = browser.new_page()  # one page each: a third goto from a page showing an error hung here
        try:
            with pytest.raises(PlaywrightError, match="ERR_PROXY_CONNECTION_FAILED"):
                page.goto(url, timeout=60_000)
        finally:
            page.close()


# --------------------------------------------------------------------------------------
# JupyterLab, as a person uses it
# --------------------------------------------------------------------------------------

def open_notebook(context, server, name: str):
    """A new page showing only ``name``: ``?reset`` starts from an empty workspace, so no tab an
    earlier page left open (or closed just before its workspace was saved) is restored beside it
    and takes the keyboard, the menus or the current tab."""
    page = context.new_page()
    page.goto(server.url(f"lab/tree/{name}?reset"))
    wait_until(page, "document.querySelectorAll('.jp-Notebook .jp-Cell').length > 2")
    wait_until_idle(page)
    return page


def open_from_path(page, name: str) -> None:
    """Open ``name`` in the page's lab, as File > Open from Path… does, and wait until it is the
    current tab, shown, with its kernel started (the page's other tabs should be closed first)."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^File$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Open from Path")).click()
    path_box = page.locator(".jp-Dialog input")
    path_box.fill(name)
    path_box.press("Enter")
    wait_until(page, """(name) => {
        const tab = document.querySelector('.lm-TabBar-tab.jp-mod-current .lm-TabBar-tabLabel');
        return tab !== null && tab.textContent === name
            && document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell').length > 2;
    }""", arg=name)
    wait_until_idle(page)


def showing_only(pages: dict, browser, server, name: str):
    """The page that the tests of one lab share (``pages``, a fixture of theirs), showing ``name``
    as its only notebook: opened with the first notebook, then each from File > Open from Path…
    (loading JupyterLab costs Chromium about 3 s of CPU a page). A page that a failed test left
    with a notebook or a dialog open is closed and a new one opened."""
    page = pages.get("page")
    if page is not None and (page.locator(".jp-Dialog").count() or page.locator(".jp-NotebookPanel").count()):
        page.close()
        page = None
    if page is None:
        pages["page"] = page = open_notebook(browser, server, name)
    else:
        open_from_path(page, name)
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
    wait_until(
        page, """([element, before]) => element.textContent !== before && /\\[\\d+\\]/.test(element.textContent)""",
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


def wait_until_saved(page, timeout_ms: int = 120_000) -> None:
    """The notebook's tab no longer shows unsaved changes (the tests' lab autosaves every few seconds)."""
    wait_until(page, "() => !document.querySelector('.lm-TabBar-tab.jp-mod-current.jp-mod-dirty')",
               timeout=timeout_ms)


def validate(page) -> str:
    """Click Validate; return the text of its results dialog.

    Only once the notebook is saved: Validate saves it first, and an autosave that starts at
    the same moment makes two saves of one file overlap, which JupyterLab takes for a change on
    disk ("File Changed": overwrite or revert?). Validate's results would then wait, hidden,
    behind that dialog. A dialog other than Validate's results fails at once, with its text.
    """
    wait_until_saved(page)
    # the toolbar's overflow popup holds a copy of each button: the visible one
    page.locator(".jp-Toolbar-item:visible", has_text="Validate").first.click()
    dialog = page.locator(".jp-Dialog").first
    # Validate answers within its own limit (stretched by the machine's load): see autograder/lab/validate.py.
    dialog.wait_for(timeout=RUN_ALL_MS)
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        dialog.get_by_text("Validation Results").wait_for(timeout=10_000)
    except PlaywrightTimeout:
        raise AssertionError(f"JupyterLab showed another dialog than Validate's results: "
                             f"{squash(dialog.inner_text())}") from None
    return dialog.inner_text()


# --------------------------------------------------------------------------------------
# Student
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def student_lab(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("browser-student")
    with running_lab("lab", copy_course(scratch / "course"), scratch) as server:
        yield server


@ON_THE_STUDENT_LAB
def test_a_student_works_through_notebook_01(student_lab, browser, screenshots):
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
    wait_until(page, "([image, first]) => image.getAttribute('src') !== first",
               arg=[picture.element_handle(), first_picture], timeout=120_000)
    wait_until_idle(page)
    screenshots.take(page, "explorer-after-slider")

    report = validate(page)
    screenshots.take(page, "validate")
    # The saved notebook was validated: split_heads passes now, the first blank (merge_heads) fails.
    assert "check_merge_heads(merge_heads)" in report and "check_split_heads(split_heads)" not in report, report
    page.close()

    # What the lab left in the student's folder besides their notebooks: only what git ignores.
    added = {path.name for path in student_lab.root_dir.iterdir()} - before
    for name in added:
        relative = f"course/{name}/" if (student_lab.root_dir / name).is_dir() else f"course/{name}"
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", relative], cwd=REPO_ROOT)
        assert ignored.returncode == 0, f"the lab wrote course/{name}, which git would commit"


@ON_THE_STUDENT_LAB
def test_each_course_notebook_opens_unmodified_saves_its_own_bytes_and_closes_without_asking(
        student_lab, browser, screenshots):
    """Opening is not editing: no dirty marker once the kernel has started (no save has
    happened yet: autosave writes only a modified notebook); a save by hand writes the
    committed bytes back; closing then asks nothing. One page opens them one after the other,
    as a student does from the lab's File menu."""
    page = None
    try:
        for assignment in ASSIGNMENTS:
            path = student_lab.root_dir / f"{assignment}.ipynb"
            committed = (REPO_ROOT / "course" / path.name).read_bytes()
            path.write_bytes(committed)  # the student test may have edited 01 (their own work)
            saved_before = path.stat().st_mtime_ns
            if page is None:
                page = open_notebook(browser, student_lab, path.name)
            else:
                open_from_path(page, path.name)
            assert not is_dirty(page), f"{path.name} is marked modified as soon as it opens"
            page.keyboard.press("Control+s")
            deadline = time.monotonic() + 120
            while path.stat().st_mtime_ns == saved_before and time.monotonic() < deadline:
                page.wait_for_timeout(POLL_MS)  # polling the file, not waiting for a fixed time
            screenshots.take(page, f"{assignment}-saved")
            assert path.stat().st_mtime_ns != saved_before, f"JupyterLab never saved {path.name}"
            assert path.read_bytes() == committed, f"saving {path.name} in JupyterLab changed it"
            assert not close_current_tab(page), f"closing the untouched {path.name} asked to save"
            assert path.read_bytes() == committed
    finally:
        if page is not None:
            page.close()


# --------------------------------------------------------------------------------------
# Every notebook, as a student sees it: run, widgets, two screen sizes, closed clean
# --------------------------------------------------------------------------------------

# The widths a student's screen gives the lab: a laptop with the file browser open, a small screen.
SCREEN_SIZES = {"1400x900": {"width": 1400, "height": 900}, "1024x768": {"width": 1024, "height": 768}}
# A slider's track shorter than this cannot be dragged to a value between its ends.
SLIDER_TRACK_MIN_PX = 150
WIDGET_REDRAW_MS = 120_000
RUN_ALL_MS = 900_000


@pytest.fixture(scope="module")
def solved_lab(tmp_path_factory, fresh_build):
    """The lab on the solution-filled notebooks (the student release stops at its first blank),
    under the course's names, so the lab treats them as course notebooks."""
    scratch = tmp_path_factory.mktemp("browser-solved")
    course = copy_course(scratch / "course")
    for assignment in ASSIGNMENTS:
        shutil.copy(fresh_build.source(assignment), course / f"{assignment}.ipynb")
    with running_lab("lab", course, scratch) as server:
        yield server


@pytest.fixture(scope="module")
def solved_lab_pages(solved_lab, browser):
    """The page the tests of the solved lab take turns on (see :func:`showing_only`)."""
    pages: dict = {}
    yield pages
    if pages.get("page") is not None:
        pages["page"].close()


def is_dirty(page) -> bool:
    return "jp-mod-dirty" in (page.locator(".lm-TabBar-tab.jp-mod-current").get_attribute("class") or "")


def run_all(page) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    # Every code cell has its execution count -- or a cell failed (JupyterLab stops there) and
    # nothing runs any more ("[*]"): either way the run is over.
    wait_until(page, r"""() => {
        const prompts = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputArea-prompt')];
        const done = prompts.length > 0 && prompts.every(p => /\[\d+\]/.test(p.textContent));
        const outputs = [...document.querySelectorAll(
            '.jp-Notebook .jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')].map(o => o.innerText);
        const failed = outputs.some(t => t.includes('Traceback') || /^\w*(Error|Failure)\b/m.test(t));
        const stopped = failed && !prompts.some(p => p.textContent.includes('*'));
        return done || stopped;
    }""", timeout=RUN_ALL_MS)
    wait_until_idle(page)
    prompts = page.locator(".jp-Notebook .jp-CodeCell .jp-InputArea-prompt").all_text_contents()
    not_run = [index for index, prompt in enumerate(prompts) if not re.search(r"\[\d+\]", prompt)]
    assert not not_run, f"Run All stopped before code cell {not_run[0]}: {errors_in_outputs(page)}"


def close_current_tab(page) -> bool:
    """Close the notebook's tab; True when JupyterLab asked whether to save.

    Done when that tab is gone (or a dialog asks): other notebooks the workspace restored may
    stay open, so "no notebook visible" is not the sign."""
    title = page.locator(".lm-TabBar-tab.jp-mod-current .lm-TabBar-tabLabel").first.inner_text()
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^File$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Close Tab$")).click()
    wait_until(page, """(title) => document.querySelector('.jp-Dialog') !== null
        || ![...document.querySelectorAll('.lm-TabBar-tab .lm-TabBar-tabLabel')].some(l => l.textContent === title)""",
               arg=title)
    return page.locator(".jp-Dialog").count() > 0


def errors_in_outputs(page) -> list[str]:
    """Errors and failed checks shown by the notebook (stderr outputs; a demo that prints an
    error message on purpose writes to stdout)."""
    texts = page.locator('.jp-Notebook .jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'
                         ).all_inner_texts()
    return [text[:400] for text in texts if "Traceback" in text or re.search(r"^\w*(Error|Failure)\b", text, re.M)]


def noise_in_outputs(page) -> list[str]:
    """Lines of the notebook's printed output and results that are warnings or autograd noise
    (conftest.NOISE): what tests/test_notebooks.py looks for when it runs a notebook itself."""
    texts = page.locator(".jp-Notebook .jp-OutputArea-output:is([data-mime-type='application/vnd.jupyter.stdout'], "
                         "[data-mime-type='application/vnd.jupyter.stderr'], [data-mime-type='text/plain'])"
                         ).all_inner_texts()
    return [line.strip() for text in texts for line in text.splitlines() if NOISE.search(line)]


def live_figures(page):
    """Each LiveFigure in the notebook: the widget box holding its controls and its picture."""
    return page.locator(".jp-OutputArea-output .widget-vbox:has(> .widget-image)")


def controls_of(figure):
    return figure.locator(".widget-hbox").first.locator(
        "> .widget-slider, > .widget-dropdown, > .widget-toggle-buttons, > .widget-checkbox")


def narrow_controls(figure) -> list[str]:
    """Controls narrower than the course's minimum, sliders whose track is too short, pictures upscaled."""
    from attention_lab.widgets.live import CONTROL_MIN_WIDTH_PX

    problems = []
    for index in range(controls_of(figure).count()):
        control = controls_of(figure).nth(index)
        width = control.bounding_box()["width"]
        label = squash(control.inner_text())[:40]
        if width < CONTROL_MIN_WIDTH_PX - 1:
            problems.append(f"control {label!r} is {width:.0f} px wide")
        track = control.locator(".slider-container")
        if track.count() and track.bounding_box()["width"] < SLIDER_TRACK_MIN_PX:
            problems.append(f"slider {label!r} has a {track.bounding_box()['width']:.0f} px track")
    picture = figure.locator("> .widget-image")
    natural, shown = picture.evaluate("img => [img.naturalWidth, img.clientWidth]")
    if shown > natural + 1:
        problems.append(f"picture upscaled from {natural} px to {shown} px (soft)")
    return problems


def wait_for_new_picture(page, figure, before: str) -> str:
    picture = figure.locator("> .widget-image")
    wait_until(page, "([image, before]) => image.getAttribute('src') !== before",
               arg=[picture.element_handle(), before], timeout=WIDGET_REDRAW_MS)
    return picture.get_attribute("src")


def drag_slider_to(page, slider, end: str) -> None:
    """Drag the handle to one end of its track (past it: the slider stops at its limit)."""
    handle = slider.locator(".noUi-handle").first
    track = slider.locator(".slider-container").bounding_box()
    box = handle.bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] / 2, y)
    page.mouse.down()
    target = track["x"] + track["width"] + 20 if end == "max" else track["x"] - 20
    page.mouse.move(target, y, steps=8)
    page.mouse.up()


def exercise_controls(page, figure) -> list[str]:
    """Every control of one LiveFigure, used as a student would: each slider dragged end to
    end, each dropdown set to its last option and back, each toggle switched. Returns what
    was done; fails when the picture does not change or an error appears."""
    done = []
    picture = figure.locator("> .widget-image")
    src = picture.get_attribute("src")
    for index in range(controls_of(figure).count()):
        control = controls_of(figure).nth(index)
        label = squash(control.inner_text())[:30]
        classes = control.get_attribute("class") or ""
        control.scroll_into_view_if_needed()
        if "mod-disabled" in classes or control.locator(":disabled").count():
            continue
        if "widget-slider" in classes:
            for end in ("max", "min"):
                drag_slider_to(page, control, end)
                src = wait_for_new_picture(page, figure, src)
                done.append(f"slider {label} to its {end}")
        elif "widget-dropdown" in classes:
            select = control.locator("select")
            values = [option.get_attribute("value") for option in select.locator("option").all()]
            original = select.input_value()
            other = values[-1] if values[-1] != original else values[0]
            for value in (other, original):  # the last option (or the first), then back
                select.select_option(value)
                src = wait_for_new_picture(page, figure, src)
                done.append(f"dropdown {label} = {select.locator('option:checked').inner_text()}")
        elif "widget-toggle-buttons" in classes:
            buttons = control.locator("button")
            for button in range(buttons.count()):
                if "mod-active" not in (buttons.nth(button).get_attribute("class") or ""):
                    buttons.nth(button).click()
                    src = wait_for_new_picture(page, figure, src)
                    done.append(f"toggle {label}: {squash(buttons.nth(button).inner_text())}")
        elif "widget-checkbox" in classes:
            for _ in range(2):
                control.locator("input").click()
                src = wait_for_new_picture(page, figure, src)
            done.append(f"checkbox {label} on and off")
    return done


@ON_THE_SOLVED_LAB
@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_each_notebook_runs_in_the_lab_with_usable_widgets_and_closes_clean(assignment, solved_lab, solved_lab_pages,
                                                                           browser, screenshots):
    path = solved_lab.root_dir / f"{assignment}.ipynb"
    released = path.read_bytes()
    page = showing_only(solved_lab_pages, browser, solved_lab, path.name)
    page.set_viewport_size(SCREEN_SIZES["1400x900"])
    # Opening is not editing: no dirty marker once the kernel has started.
    assert not is_dirty(page), f"{path.name} is marked modified as soon as it opens"
    try:
        run_all(page)
    finally:
        screenshots.take(page, "ran-all")
    assert not errors_in_outputs(page), errors_in_outputs(page)
    noise = noise_in_outputs(page)
    assert not noise, f"{path.name}: a course cell printed a warning or autograd noise:\n" + "\n".join(noise)
    cells = page.locator(".jp-Notebook .jp-CodeCell")
    for index in range(cells.count()):
        source = cells.nth(index).locator(".jp-InputArea-editor").inner_text()
        if re.search(r"^check_\w+\(", source, re.M):
            output = cells.nth(index).locator(".jp-OutputArea").inner_text()
            assert "✓" in output, f"{path.name}: the check in cell {index} printed no ✓:\n{source}\n{output}"

    figures = live_figures(page)
    interactions = []
    for index in range(figures.count()):
        figure = figures.nth(index)
        figure.scroll_into_view_if_needed()
        for size_name, size in SCREEN_SIZES.items():
            page.set_viewport_size(size)
            figure.scroll_into_view_if_needed()
            screenshots.take(page, f"widget{index}-{size_name}")
            problems = narrow_controls(figure)
            assert not problems, f"{path.name}, widget {index} at {size_name}: " + "; ".join(problems)
        page.set_viewport_size(SCREEN_SIZES["1400x900"])
        interactions += exercise_controls(page, figure)
        figure.scroll_into_view_if_needed()
        screenshots.take(page, f"widget{index}-after-controls")
        assert not errors_in_outputs(page), errors_in_outputs(page)
    print(f"{path.name}: {figures.count()} widget(s); " + "; ".join(interactions))

    # Autosave writes the run (outputs dropped by the lab's pre-save hook): then closing asks nothing.
    wait_until_saved(page)
    wait_until_idle(page)
    asked = close_current_tab(page)
    screenshots.take(page, "closed")
    assert not asked, f"closing {path.name} asked to save: {page.locator('.jp-Dialog').inner_text()}"
    assert path.read_bytes() == released, f"opening, running and closing {path.name} changed the file"


WARNING_THEN_WRONG_SPLIT_HEADS = """def split_heads(x, num_heads):
    import warnings
    print("debugging: x has shape", tuple(x.shape))
    warnings.warn("overflow encountered in matmul", RuntimeWarning)
    batch, seq_len, d_model = x.shape
    return x.reshape(batch, num_heads, seq_len, d_model // num_heads)
"""


@ON_THE_SOLVED_LAB
def test_validate_shows_the_checks_message_even_after_a_warning(solved_lab, solved_lab_pages, browser, screenshots):
    """One wrong answer whose code prints and warns before its check fails: Validate's dialog
    shows that check's message (first), the warning after it."""
    notebook = nbformat.read(solved_lab.root_dir / "01_mha_shapes.ipynb", as_version=4)
    answer = next(cell for cell in notebook.cells if cell.metadata.get("nbgrader", {}).get("grade_id") == "split_heads")
    answer.source = WARNING_THEN_WRONG_SPLIT_HEADS
    release.write_notebook(notebook, solved_lab.root_dir / "wrong_split_heads.ipynb")
    page = showing_only(solved_lab_pages, browser, solved_lab, "wrong_split_heads.ipynb")
    report = squash(validate(page))   # its dialog stays open: the next test on the page opens a new one
    screenshots.take(page, "validate-dialog")
    message = squash(SPLIT_HEADS_HINTS["reshape_only"])[:60]
    assert message in report, report
    assert "check_split_heads(split_heads)" in report, report
    assert "RuntimeWarning" in report and report.index(message) < report.index("RuntimeWarning"), report


@ON_THE_STUDENT_LAB
def test_a_checks_message_is_not_wrapped_again_at_1024x768(student_lab, browser, screenshots):
    """A failure's lines are wrapped at word boundaries by the check framework; JupyterLab's output area wraps a
    line too long for it again, anywhere in a word (issue #34: at 85 columns, at 1024×768). Each line of the
    message takes one line on the page, with the file browser open."""
    page = open_notebook(browser, student_lab, "01_mha_shapes.ipynb")
    try:
        page.set_viewport_size(SCREEN_SIZES["1024x768"])
        index = cell_index(page, "round trip exact:")
        replace_cell_source(page, index, "from attention_lab.checking import CheckFailure\n"
                            "words = 'did not give back the tokens it was given ' * 6\n"
                            "hint = 'the heads were merged in the wrong order of axes ' * 5\n"
                            "message = 'merge_heads(x): ' + words + '\\n  Likely mistake: ' + hint\n"
                            "raise CheckFailure(message)")
        run_cell(page, index)
        shown = page.locator(".jp-Notebook .jp-Cell").nth(index).locator(
            ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'] pre").first
        lines, rows = shown.evaluate("""pre => {
            const lines = pre.textContent.replace(/\\n+$/, '').split('\\n').length;
            const height = pre.getBoundingClientRect().height;
            return [lines, Math.round(height / parseFloat(getComputedStyle(pre).lineHeight))];
        }""")
        screenshots.take(page, "message-at-1024x768")
    finally:
        page.close()
    assert lines >= 8 and rows == lines, f"{lines} lines of text take {rows} lines on the page"


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


def _by_question(root: Path) -> dict[tuple[str, str], dict]:
    with open(root / "grades_by_question.csv", newline="") as file:
        return {(row["student"], row["grade_id"]): row for row in csv.DictReader(file) if row["assignment"] == TINY}


@ON_THE_GRADED_CLASS
def test_an_instructor_grades_in_formgrader_and_the_export_reflects_it(instructor_lab, graded_class, browser,
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
    set_formgrader_score(page, "test_double", "1")
    screenshots.take(page, "bob-adjusted")

    # ada: grade the written answer
    page.goto(instructor_lab.url(f"formgrader/gradebook/{TINY}/{TINY}"))
    page.locator("table tbody tr").filter(has_text="ada").locator("td.name a:visible").click()
    page.get_by_text("Because 2x = x + x.").first.wait_for()
    set_formgrader_score(page, "why_double", "2")
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


@ON_THE_GRADED_CLASS
def test_manage_students_works_on_a_new_course_root_without_the_venv_on_path(tmp_path, browser, screenshots):
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


@ON_THE_GRADED_CLASS
def test_a_feedback_page_keeps_the_check_messages_line_breaks(graded_class, browser, screenshots):
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
