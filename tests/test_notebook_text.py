"""What each notebook promises in its text adds up: the title's points and minutes are the sums
of its exercises', and every exercise header's points are the points of its graded cells; code
lines fit the cell; the link to Colab reads offline."""

from __future__ import annotations

import re

import nbformat
import pytest

from autograder.publishing import release
from tests.conftest import ASSIGNMENTS

TITLE_TOTALS = re.compile(r"\*\*(?P<points>\d+) points, about (?P<minutes>\d+) minutes\.\*\*")
EXERCISE = re.compile(r"^#{2,4}\s+Exercise\s+(?P<number>\d+\.\d+)\b(?P<rest>.*)$", re.MULTILINE)
HEADER_POINTS = re.compile(r"\((?P<points>\d+) pts?\b")
HEADER_MINUTES = re.compile(r"~(?P<minutes>\d+) min\b")


def _exercises(assignment: str) -> list[dict]:
    """Each exercise header in order, with the points of the graded cells that follow it."""
    notebook = release.build_source(assignment, release.course_repository())
    exercises: list[dict] = []
    for cell in notebook.cells:
        nbgrader = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "markdown":
            for match in EXERCISE.finditer(cell.source):
                points, minutes = HEADER_POINTS.search(match["rest"]), HEADER_MINUTES.search(match["rest"])
                assert points and minutes, f"{assignment}: header of exercise {match['number']} should say " \
                                           f"'(N pts, ~M min)': {match.group(0)!r}"
                exercises.append({"number": match["number"], "points": int(points["points"]),
                                  "minutes": int(minutes["minutes"]), "graded": 0.0})
        if nbgrader.get("grade"):
            assert exercises, f"{assignment}: graded cell {nbgrader['grade_id']} comes before any exercise header"
            exercises[-1]["graded"] += nbgrader["points"]
    return exercises


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_each_exercise_header_gives_the_points_of_its_graded_cells(assignment):
    exercises = _exercises(assignment)
    assert exercises, f"{assignment} has no exercise"
    wrong = [f"Exercise {e['number']}: header says {e['points']}, graded cells give {e['graded']:g}"
             for e in exercises if e["points"] != e["graded"]]
    assert not wrong, f"{assignment}: " + "; ".join(wrong)


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_title_gives_the_total_points_and_minutes_of_the_exercises(assignment):
    notebook = release.build_source(assignment, release.course_repository())
    match = TITLE_TOTALS.search(notebook.cells[0].source)
    assert match, f"{assignment}: the title cell should say '**P points, about M minutes.**'"
    exercises = _exercises(assignment)
    points = sum(e["graded"] for e in exercises)
    minutes = sum(e["minutes"] for e in exercises)
    assert (int(match["points"]), int(match["minutes"])) == (points, minutes), \
        f"{assignment}: the title says {match['points']} points and {match['minutes']} minutes; " \
        f"the exercises add up to {points:g} points and {minutes} minutes"


# Code lines a student reads without scrolling sideways (JupyterLab at a laptop's width).
MAX_CODE_LINE = 100


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_no_code_line_of_a_released_notebook_is_wider_than_the_cell(assignment):
    notebook = nbformat.read(release.released_notebook(assignment), as_version=4)
    long_lines = [f"cell {index} ({cell.get('id')}): {len(line)} chars: {line[:60]}..."
                  for index, cell in enumerate(notebook.cells) if cell.cell_type == "code"
                  for line in cell.source.splitlines() if len(line) > MAX_CODE_LINE]
    assert not long_lines, f"{assignment}: {len(long_lines)} code line(s) over {MAX_CODE_LINE} characters:\n" \
                           + "\n".join(long_lines[:10])


def test_the_colab_link_is_text_that_reads_offline():
    """The title's link to Colab is not an image fetched from the network."""
    for assignment in ASSIGNMENTS:
        title = nbformat.read(release.released_notebook(assignment), as_version=4).cells[0].source
        assert "colab.research.google.com/github/" in title, f"{assignment}: no link to Colab in the title"
        assert "![" not in title and "<img" not in title, f"{assignment}: the title shows an image: {title[-200:]}"


# Names a student's answer may import or define for itself: a demo or check cell that rebinds one breaks a
# later exercise, blamed on the wrong answer (issue #34: 03 bound `stack = Transformer(...)`, and an answer that
# did `from torch import stack` then failed in sinusoidal_positions' exercise). Imports that bind a name to the
# library's own object (`import numpy as np`, `from torch import stack`) are harmless and allowed.
LIBRARY_NAMES = frozenset({
    "stack", "cat", "concat", "concatenate", "einsum", "softmax", "log_softmax", "mask", "F", "np", "torch", "nn",
    "math", "einops", "rearrange", "repeat", "reduce", "plt", "tl", "triton", "functools", "partial", "sqrt", "exp",
    "log", "tensor", "Tensor", "zeros", "ones", "full", "empty", "arange", "rand", "randn", "matmul", "where", "tril",
    "triu", "masked_fill", "linear", "dropout", "relu", "gelu", "layer_norm", "scaled_dot_product_attention",
    "chunk", "split", "transpose", "permute",
})


def _global_bindings(source: str) -> list[tuple[str, int]]:
    """(name, line) of every module-level name a cell binds by assignment, loop, with, def or class -- not by
    import, and not inside a function, class body, lambda or comprehension (their names are local)."""
    import ast

    local_scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.ListComp, ast.SetComp,
                    ast.DictComp, ast.GeneratorExp)
    tree = ast.parse("\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()))
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.append((child.name, child.lineno))
            elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                found.append((child.id, child.lineno))
            if not isinstance(child, local_scopes):
                visit(child)

    visit(tree)
    return found


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_no_cell_but_an_answer_binds_a_name_a_student_imports(assignment):
    import builtins

    notebook = nbformat.read(release.released_notebook(assignment), as_version=4)
    clobbered = [f"cell {index}, line {line}: {name}" for index, cell in enumerate(notebook.cells)
                 if cell.cell_type == "code" and not cell.metadata.get("nbgrader", {}).get("solution")
                 for name, line in _global_bindings(cell.source)
                 if name in LIBRARY_NAMES or hasattr(builtins, name)]
    assert not clobbered, f"{assignment}: a cell that is not an answer binds a global a student may import or " \
                          "use (give it a name of its own):\n" + "\n".join(clobbered)


def test_the_global_binding_scan_sees_assignments_loops_and_definitions_but_not_local_names():
    source = ("stack = 1\nfor mask, other in []:\n    pass\nwith open('x') as F:\n    pass\ndef cat():\n    einsum = 2\n"
              "total = [softmax for softmax in range(3)]\nimport numpy as np\nfrom torch import stack as stack\n"
              "%matplotlib inline\n")
    assert [name for name, _ in _global_bindings(source)] == ["stack", "mask", "other", "F", "cat", "total"]


# What a check expects, written as the phrases that would give it away. A student reads every
# cell of a released notebook (a closing summary, the cell under a check, a test cell's docstring,
# a demo's code) before answering, so none may contain them; an answer's explanation goes into the
# check's success message instead (tests/test_checks_<module>.py shows it appears only once the
# answer is right).
ANSWER_PHRASES: dict[str, dict[str, tuple[str, ...]]] = {
    "01_mha_shapes": {
        "attention_layer_flops": ("8·B·S·D²", "4·B·S²·D"),
        "ANSWER_ATTENTION_CROSSOVER": ("4,608", "4608", "6·D", "S > 2·D", "2·D:", "1536", "1,536"),
        "block_flops": ("16·B·S·D²", "4·B·S·D·hidden"),
    },
    "02_numpy_walkthrough": {
        "np_attention_backward": ("Pᵀ @ dout", "dS @ K", "dSᵀ @ Q", "softmax_backward(P, dout @ Vᵀ)"),
        "derive_delta": ("dout_i · out_i", "rowsum(dout ∘ out)", "Σ_c dout_ic · out_ic"),
    },
    "03_positions_and_blocks": {
        "ANSWER_NO_POSITIONS": ("1/(S - 1) = 1/7", "right with probability", "The ceiling.", "beats 1/(S-1)"),
        "ANSWER_NOPE_CAUSAL": ("most recent one it can see", "can find the previous token"),
        "what_one_head_does": ("puts almost all its weight", "previous-token head), stays"),
    },
    "06_efficient_attention": {
        "ANSWER_BACKWARD_FLOPS": ("2.5×", "3.5×", "2.5x", "3.5x", "five products", "seven products"),
    },
}


def _cells_giving_answers(notebook: nbformat.NotebookNode, phrases: dict[str, tuple[str, ...]]) -> list:
    return [f"cell {index} ({cell.cell_type}): {phrase!r} gives away {answer}"
            for index, cell in enumerate(notebook.cells)
            for answer, answer_phrases in phrases.items() for phrase in answer_phrases if phrase in cell.source]


@pytest.mark.parametrize("assignment", sorted(ANSWER_PHRASES))
def test_no_released_cell_gives_away_an_answer(assignment):
    notebook = nbformat.read(release.released_notebook(assignment), as_version=4)
    answers = {cell.metadata.get("nbgrader", {}).get("grade_id") for cell in notebook.cells}
    unknown = set(ANSWER_PHRASES[assignment]) - answers
    assert not unknown, f"{assignment} has no answer cell {sorted(unknown)}: update ANSWER_PHRASES"
    leaks = _cells_giving_answers(notebook, ANSWER_PHRASES[assignment])
    assert not leaks, f"{assignment}: " + "; ".join(leaks)
