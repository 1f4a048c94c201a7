"""A failing check shows its message, not the helper package's traceback (in a notebook and in
nbgrader's Validate), and keeps the frames of the student's own code when that code raised."""

from __future__ import annotations

import io

import nbformat
import pytest

from attention_lab.checking import CheckFailure, call_student
from autograder.grading.execute import notebook_client

SETUP = "import torch\nfrom attention_lab.checks.mha_shapes import check_split_heads"
RAISES = ("def split_heads(x, num_heads):\n"
          "    b, s, d = x.shape\n"
          "    return x @ torch.zeros(3, 4, dtype=x.dtype)  # the student's bug\n")
WRONG_NUMBERS = ("def split_heads(x, num_heads):\n"
                 "    b, s, d = x.shape\n"
                 "    if d % num_heads:\n"
                 "        raise ValueError(f'D={d} is not divisible by H={num_heads}')\n"
                 "    return x.reshape(b, num_heads, s, d // num_heads)\n")
CHECK = "check_split_heads(split_heads, device='cpu')"
# A right answer that makes PyTorch warn (a copy of a tensor made with torch.tensor): nbgrader counts a test cell
# that wrote to stderr as failed, in Validate and in grading, so the check must keep the warning off stderr.
RIGHT_BUT_WARNS = ("def split_heads(x, num_heads):\n"
                   "    b, s, d = x.shape\n"
                   "    if d % num_heads:\n"
                   "        raise ValueError(f'D={d} is not divisible by H={num_heads}')\n"
                   "    x = torch.tensor(x)  # UserWarning: To copy construct from a tensor, ...\n"
                   "    return x.view(b, s, num_heads, d // num_heads).transpose(1, 2)\n")


def _words(text: str) -> str:
    return " ".join(text.split())


def test_the_rendering_is_the_message_the_check_call_and_the_students_frames_only():
    import linecache

    import torch

    # IPython keeps each cell's source in linecache under a name of its own; do the same.
    for name, source in (("<answer cell>", RAISES), ("<test cell>", CHECK)):
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    namespace = {"torch": torch}
    exec(compile(RAISES, "<answer cell>", "exec"), namespace)
    exec(compile(SETUP, "<setup cell>", "exec"), namespace)
    with pytest.raises(CheckFailure) as failure:
        exec(compile(CHECK, "<test cell>", "exec"), namespace)
    lines = failure.value._render_traceback_()
    assert lines[0] == "In your notebook (most recent call last):"
    # (this test's own frame comes first: to the framework, a test file is "the student's code")
    start = lines.index('  File "<test cell>", line 1, in <module>')
    assert lines[start:start + 5] == [
        '  File "<test cell>", line 1, in <module>',
        "    check_split_heads(split_heads, device='cpu')",
        '  File "<answer cell>", line 3, in split_heads',
        "    return x @ torch.zeros(3, 4, dtype=x.dtype)  # the student's bug",
        "",
    ]
    assert not any("attention_lab" in line or "checking.py" in line or "torch/" in line for line in lines)
    message_lines = lines[start + 5:]
    assert _words(" ".join(message_lines)) == _words(f"CheckFailure: {failure.value}")
    assert "raised RuntimeError: mat1 and mat2 shapes cannot be multiplied" in _words(" ".join(message_lines))
    # nbgrader validate cuts lines over 83 (4-space indent, 87); a laptop's notebook column holds 74 (test_browser)
    assert all(len(line) <= 72 for line in message_lines)


def test_a_failure_without_a_cause_renders_as_its_message_lines_intact():
    failure = CheckFailure("f(x) does not match g.\n  Likely mistake: " + "a very long hint " * 12)
    lines = failure._render_traceback_()  # never raised: no frames at all
    assert lines[0] == "CheckFailure: f(x) does not match g."
    assert lines[1].startswith("  Likely mistake: a very long hint")
    assert all(line.startswith("    ") for line in lines[2:])  # continuation lines keep the indent
    assert _words(" ".join(lines)) == _words("CheckFailure: " + str(failure))


def _notebook(*sources: str, nbgrader: bool = False) -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for index, source in enumerate(sources):
        cell = nbformat.v4.new_code_cell(source)
        if nbgrader and source.startswith("check_"):
            cell.metadata["nbgrader"] = {"grade": True, "grade_id": f"test_{index}", "locked": True,
                                         "points": 1, "schema_version": 3, "solution": False, "task": False}
        notebook.cells.append(cell)
    return notebook


def _error_output(cell) -> nbformat.NotebookNode:
    errors = [output for output in cell.outputs if output.output_type == "error"]
    assert len(errors) == 1, cell.outputs
    return errors[0]


@pytest.mark.slow
def test_in_a_notebook_the_traceback_is_the_message_and_the_students_frames(tmp_path):
    notebook = _notebook(SETUP, RAISES, CHECK, WRONG_NUMBERS, CHECK)
    notebook_client(notebook, tmp_path, timeout=300).execute()
    raised, wrong = _error_output(notebook.cells[2]), _error_output(notebook.cells[4])
    for error in (raised, wrong):
        assert error.ename == "CheckFailure"  # autograde and feedback still see what failed
        assert not any("attention_lab" in line for line in error.traceback), error.traceback
        assert _words(f"CheckFailure: {error.evalue}") in _words(" ".join(error.traceback))
    assert "raised RuntimeError" in raised.evalue
    assert raised.traceback[:6] == [
        "In your notebook (most recent call last):",
        "  Cell In[3], line 1, in <module>",  # the check call: the grader's feedback reads this line
        "    check_split_heads(split_heads, device='cpu')",
        "  Cell In[2], line 3, in split_heads",
        "    return x @ torch.zeros(3, 4, dtype=x.dtype)  # the student's bug",
        "",
    ]
    assert wrong.traceback[:4] == ["In your notebook (most recent call last):", "  Cell In[5], line 1, in <module>",
                                   "    check_split_heads(split_heads, device='cpu')", ""]
    assert wrong.traceback[4].startswith("CheckFailure: split_heads(x, num_heads=")
    assert "Likely mistake: you reshaped straight to [B, H, S, d_head]" in wrong.evalue


@pytest.mark.slow
def test_the_graders_feedback_still_tells_a_visible_failure_from_a_hidden_one(tmp_path):
    """The rendered failure keeps what feedback reads: a visible check's message, and the
    HiddenTestFailure the grader's source raises when only the hidden block fails."""
    from autograder.store import results
    from autograder.reports.feedback import explain
    from autograder.publishing.release import mark_hidden_tests

    def run(test_source: str) -> results.GradedCell:
        notebook = _notebook(SETUP, WRONG_NUMBERS, mark_hidden_tests(test_source))
        notebook.cells[2].metadata["nbgrader"] = {"grade": True, "grade_id": "test_split_heads", "locked": True,
                                                  "points": 1, "schema_version": 3, "solution": False, "task": False}
        notebook_client(notebook, tmp_path, timeout=300).execute()
        [cell] = results.graded_cells(notebook)
        return cell

    test_cell = CHECK + "\n### BEGIN HIDDEN TESTS\ncheck_split_heads(split_heads, seed=3, device='cpu')\n### END HIDDEN TESTS\n"
    visible = run(test_cell)
    assert not visible.hidden_failure
    assert explain(visible, test_cell).startswith("CheckFailure: split_heads(x, num_heads=")
    hidden_only = test_cell.replace(CHECK, "pass")  # the visible line passes trivially; the hidden one fails
    hidden = run(hidden_only)
    assert hidden.hidden_failure
    assert "passed the visible check but failed the hidden tests" in explain(hidden, hidden_only)


@pytest.mark.slow
def test_nbgrader_validate_shows_the_message_uncut(tmp_path):
    from nbgrader.validator import Validator

    path = tmp_path / "exercise.ipynb"
    nbformat.write(_notebook(SETUP, WRONG_NUMBERS, CHECK, RIGHT_BUT_WARNS, CHECK, nbgrader=True), path)
    validator = Validator()
    results = validator.validate(str(path))
    assert len(results["failed"]) == 1, results  # the right answer that warned passes Validate (issue #52)
    error = results["failed"][0]["raw_error"]
    assert "attention_lab" not in error and "Traceback" not in error, error
    assert "Likely mistake: you reshaped straight to [B, H, S, d_head]" in _words(error)
    printed = io.StringIO()
    validator.stream = printed
    validator.validate_and_print(str(path))
    error_part = printed.getvalue().split("The error was:")[1]
    # no line cut off (the message's own "h*d_head ... (h+1)" may be wrapped across two lines)
    assert "..." not in " ".join(error_part.split()).replace("h*d_head ... (h+1)", ""), error_part
    assert "Likely mistake: you reshaped straight to" in error_part


WARNS_THEN_WRONG = ("def split_heads(x, num_heads):\n"
                    "    import warnings\n"
                    "    print('debugging: x is', tuple(x.shape))\n"
                    "    warnings.warn('overflow encountered in matmul', RuntimeWarning)\n"
                    "    b, s, d = x.shape\n"
                    "    return x.reshape(b, num_heads, s, d // num_heads)\n")


@pytest.mark.slow
def test_what_the_code_printed_or_warned_never_hides_the_checks_message(tmp_path):
    """A student's code warns and prints before its check fails: the feedback page explains the
    failure by the check's message, and the lab's Validate shows that message first, the warning
    after it. A right answer that warns earns its point (issue #52)."""
    from nbgrader.utils import determine_grade

    from autograder.reports.feedback import explain
    from autograder.store import results
    from autograder.lab.validate import failure_text

    notebook = _notebook(SETUP, WARNS_THEN_WRONG, CHECK, RIGHT_BUT_WARNS, CHECK)
    for index in (2, 4):
        notebook.cells[index].metadata["nbgrader"] = {"grade": True, "grade_id": f"test_{index}", "locked": True,
                                                      "points": 1, "schema_version": 3, "solution": False,
                                                      "task": False}
    notebook_client(notebook, tmp_path, timeout=300).execute()
    outputs = notebook.cells[2].outputs
    wrong, right = results.graded_cells(notebook)
    explained = explain(wrong, CHECK)
    assert explained.startswith("CheckFailure: split_heads(x, num_heads="), explained
    assert "Likely mistake: you reshaped straight to" in _words(explained)
    shown = failure_text(outputs)
    assert "Likely mistake: you reshaped straight to" in _words(shown)
    assert "RuntimeWarning: overflow encountered in matmul" in _words(shown), shown  # it did warn, after the message
    assert _words(shown).index("Likely mistake") < _words(shown).index("RuntimeWarning"), shown
    assert not [o for o in notebook.cells[4].outputs if o.get("name") == "stderr"], notebook.cells[4].outputs
    assert "✓ split_heads" in "".join(o.get("text", "") for o in notebook.cells[4].outputs)
    assert right.passed and determine_grade(notebook.cells[4]) == (1, 1)  # nbgrader's own rule (stderr: 0 points)
