"""A failing check shows its message, not the helper package's traceback (in a notebook and in
nbgrader's Validate), and keeps the frames of the student's own code when that code raised."""

from __future__ import annotations

import io

import nbformat
import pytest
from nbclient import NotebookClient

from attention_lab.checking import CheckFailure, call_student

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


def _words(text: str) -> str:
    return " ".join(text.split())


def test_the_rendering_is_the_message_and_the_students_frames_only():
    import linecache

    import torch

    # IPython keeps each cell's source in linecache under a name of its own; do the same.
    linecache.cache["<student cell>"] = (len(RAISES), None, RAISES.splitlines(True), "<student cell>")
    namespace = {"torch": torch}
    exec(compile(RAISES, "<student cell>", "exec"), namespace)

    with pytest.raises(CheckFailure) as failure:
        call_student(namespace["split_heads"], torch.zeros(2, 5, 8), 2, call="split_heads(x, 2)")
    lines = failure.value._render_traceback_()
    assert lines[0] == "Your code raised this error (most recent call last):"
    assert lines[1] == "  File \"<student cell>\", line 3, in split_heads"
    assert lines[2] == "    return x @ torch.zeros(3, 4, dtype=x.dtype)  # the student's bug"
    assert not any("attention_lab" in line or "checking.py" in line for line in lines)
    rendered_message = _words(" ".join(lines[lines.index("") + 1:]))
    assert rendered_message == _words(f"CheckFailure: {failure.value}")
    message_lines = lines[lines.index("") + 1:]
    assert all(len(line) <= 83 for line in message_lines)  # nbgrader validate cuts longer lines (4-space indent, 87)


def test_a_failure_without_a_cause_renders_as_its_message_lines_intact():
    failure = CheckFailure("f(x) does not match g.\n  Likely mistake: " + "a very long hint " * 12)
    lines = failure._render_traceback_()
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
    NotebookClient(notebook, timeout=300, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    raised, wrong = _error_output(notebook.cells[2]), _error_output(notebook.cells[4])
    for error in (raised, wrong):
        assert error.ename == "CheckFailure"  # autograde and feedback still see what failed
        assert not any("attention_lab" in line for line in error.traceback), error.traceback
        assert _words(f"CheckFailure: {error.evalue}") in _words(" ".join(error.traceback))
    assert "raised RuntimeError" in raised.evalue
    assert "  Cell In[2], line 3, in split_heads" in raised.traceback
    assert "    return x @ torch.zeros(3, 4, dtype=x.dtype)  # the student's bug" in raised.traceback
    assert "Likely mistake: you reshaped straight to [B, H, S, d_head]" in wrong.evalue
    assert raised.traceback[0] == "Your code raised this error (most recent call last):"
    assert wrong.traceback[0].startswith("CheckFailure: split_heads(x, num_heads=")


@pytest.mark.slow
def test_nbgrader_validate_shows_the_message_uncut(tmp_path):
    from nbgrader.validator import Validator

    path = tmp_path / "exercise.ipynb"
    nbformat.write(_notebook(SETUP, WRONG_NUMBERS, CHECK, nbgrader=True), path)
    validator = Validator()
    results = validator.validate(str(path))
    error = results["failed"][0]["raw_error"]
    assert "attention_lab" not in error and "Traceback" not in error, error
    assert "Likely mistake: you reshaped straight to [B, H, S, d_head]" in _words(error)
    printed = io.StringIO()
    validator.stream = printed
    validator.validate_and_print(str(path))
    error_part = printed.getvalue().split("The error was:")[1]
    assert "..." not in error_part.replace("h*d_head ... (h+1)", ""), error_part  # no line cut off
    assert "Likely mistake: you reshaped straight to" in error_part
