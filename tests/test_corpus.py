"""Correct answers written in other styles than the solutions must pass every test, through the notebook.

The corpus lives in ``tests/corpus/<assignment>/<style>.py`` (jupytext percent format). Each
``# %% answer="<grade_id>"`` cell of a style file replaces the solution's answer cell with the
same grade_id; answers a style does not give keep the solution. The notebook -- setup cell,
demo cells, widgets, visible *and hidden* tests -- then runs top to bottom and every graded
test must pass. This is what a student who writes correct code in their own way meets: a
demo cell that rebinds a helper name they use, a check that insists on float64 internals, or
a hook that reads ``args[0]`` fails here, not in a student's notebook.

The notebooks run where grading runs them, in kernels forked from a sandboxed kernel server
(fresh kernels where bubblewrap is missing): a correct answer must earn its points there. The
solutions also run in JupyterLab (tests/test_browser.py), or in fresh kernels where Chromium is missing
(tests/test_notebooks.py).

Every answer of every notebook is written in at least ``STYLES_PER_ANSWER`` styles.
"""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat
import pytest

from autograder.publishing import release
from autograder.grading.execute import execute_notebook
from tests.conftest import ASSIGNMENTS

CORPUS_DIR = Path(__file__).parent / "corpus"
STYLES_PER_ANSWER = 3
STYLES = sorted(CORPUS_DIR.glob("[0-9][0-9]_*/*.py"))


def _answers(notebook: nbformat.NotebookNode) -> dict[str, nbformat.NotebookNode]:
    return {cell.metadata["nbgrader"]["grade_id"]: cell for cell in notebook.cells
            if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("solution")}


def _style_answers(path: Path) -> dict[str, str]:
    """grade_id -> replacement source of every answer cell in a style file."""
    cells = jupytext.read(path, fmt="py:percent").cells
    answers = {cell.metadata["answer"]: cell.source for cell in cells if "answer" in cell.metadata}
    assert answers, f"{path.name} replaces no answer cell (mark them `# %% answer=\"name\"`)"
    return answers


def _graded_tests(notebook: nbformat.NotebookNode) -> list[str]:
    return [cell.metadata["nbgrader"]["grade_id"] for cell in notebook.cells
            if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("grade")]


@pytest.mark.slow
@pytest.mark.parametrize("style", STYLES, ids=lambda path: f"{path.parent.name}/{path.stem}")
def test_correct_answers_in_another_style_pass_every_test(style: Path, tmp_path: Path, forked_kernels):
    assignment = style.parent.name
    assert assignment in ASSIGNMENTS, f"{style}: no notebook named {assignment}"
    notebook = release.build_source(assignment, release.course_repository())
    answers = _answers(notebook)
    replacements = _style_answers(style)
    unknown = sorted(set(replacements) - set(answers))
    assert not unknown, f"{style.name} replaces answers the notebook does not have: {unknown}"
    for grade_id, source in replacements.items():
        answers[grade_id].source = source
    path = tmp_path / f"{assignment}.ipynb"
    nbformat.write(notebook, path)
    result = execute_notebook(path, kernels=forked_kernels)
    assert not result.errors, f"{style.name} (answers: {sorted(replacements)}):\n" + result.summary()
    assert sorted(result.passed_tests) == sorted(_graded_tests(notebook))


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_every_answer_is_written_in_several_styles(assignment):
    answers = _answers(release.build_source(assignment, release.course_repository()))
    styles = {grade_id: [] for grade_id in answers}
    for style in (CORPUS_DIR / assignment).glob("*.py"):
        for grade_id in _style_answers(style):
            styles.setdefault(grade_id, []).append(style.stem)
    thin = {grade_id: names for grade_id, names in styles.items() if len(names) < STYLES_PER_ANSWER}
    assert not thin, f"answers written in fewer than {STYLES_PER_ANSWER} styles in tests/corpus/{assignment}/: {thin}"
