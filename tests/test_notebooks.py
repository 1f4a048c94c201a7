"""Every notebook of the course: its release is fresh and leaks nothing, its contracts hold,
its solution passes every test (hidden ones included), and its student release fails only
where the student still has to write code."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

from autograder.publishing import release
from autograder.grading.execute import execute_notebook
from tests.conftest import ASSIGNMENTS, NOISE, REPO_ROOT
from tests.curriculum import CONTRACTS

SOLUTION_BLOCK = re.compile(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", re.DOTALL)
HIDDEN_BLOCK = re.compile(r"### BEGIN HIDDEN TESTS\n(.*?)### END HIDDEN TESTS", re.DOTALL)


def _cells(path: Path) -> list[nbformat.NotebookNode]:
    return nbformat.read(path, as_version=4).cells


def _grade_ids(path: Path, kind: str) -> list[str]:
    """grade_ids of the ``answer`` cells (code), autograded ``test`` cells, or hand-graded ``manual`` answers."""
    ids = []
    for cell in _cells(path):
        nbgrader = cell.metadata.get("nbgrader", {})
        manual = cell.cell_type == "markdown" and nbgrader.get("solution") and nbgrader.get("grade")
        if ((kind == "answer" and nbgrader.get("solution") and not manual)
                or (kind == "test" and nbgrader.get("grade") and not manual)
                or (kind == "manual" and manual)):
            ids.append(nbgrader["grade_id"])
    return ids


def _substantive_lines(block: str) -> set[str]:
    """Lines of a solution or hidden test worth looking for: long enough to be distinctive
    (`self.num_heads = num_heads` may appear anywhere; `return x.view(...).permute(0, 2, 1, 3)` may not)."""
    lines = set()
    for line in block.splitlines():
        text = " ".join(line.split())
        if len(text) >= 32 and not text.startswith("#"):
            lines.add(text)
    return lines


def test_the_course_has_notebooks():
    assert ASSIGNMENTS and ASSIGNMENTS[0] == "01_mha_shapes"
    assert set(ASSIGNMENTS) <= set(CONTRACTS), "a notebook that is not in the curriculum"


def test_committed_release_is_what_a_fresh_build_gives(fresh_build):
    """`make release` was run after the last change to solutions/ (a rebuild is byte-identical)."""
    stale = [a for a in ASSIGNMENTS
             if not (REPO_ROOT / "course" / f"{a}.ipynb").exists()
             or fresh_build.release(a).read_bytes() != (REPO_ROOT / "course" / f"{a}.ipynb").read_bytes()]
    assert not stale, f"stale student notebooks, run `make release`: {stale}"
    # (course notebooks are NN_name.ipynb; test_lab's scratch .validate-test.ipynb may be there meanwhile)
    extra = {p.stem for p in (REPO_ROOT / "course").glob("[0-9][0-9]_*.ipynb")} - set(ASSIGNMENTS)
    assert not extra, f"student notebooks without a source in solutions/: {extra}"


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_release_is_normalised(assignment, fresh_build):
    notebook = json.loads(fresh_build.release(assignment).read_text())
    assert notebook["metadata"] == {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                                    "language_info": {"name": "python"}}
    ids = [cell["id"] for cell in notebook["cells"]]
    assert len(ids) == len(set(ids)), "cell ids must be unique"
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_release_leaks_no_solution_and_no_hidden_test(assignment, fresh_build):
    source_text = fresh_build.source(assignment).read_text()
    release_text = fresh_build.release(assignment).read_text()
    for marker in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"):
        assert marker not in release_text
    sources = "\n".join(cell.source for cell in nbformat.reads(source_text, as_version=4).cells)
    released = "\n".join(" ".join(line.split()) for cell in nbformat.reads(release_text, as_version=4).cells
                         for line in cell.source.splitlines())
    secret_blocks = SOLUTION_BLOCK.findall(sources) + HIDDEN_BLOCK.findall(sources)
    assert secret_blocks, "the source notebook should have solutions and hidden tests"
    leaked = sorted(line for block in secret_blocks for line in _substantive_lines(block) if line in released)
    assert not leaked, f"solution or hidden-test lines in the student notebook: {leaked}"


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_notebook_starts_with_title_badge_and_the_generated_setup_cell(assignment, fresh_build):
    cells = _cells(fresh_build.release(assignment))
    repository = release.course_repository()
    assert cells[0].cell_type == "markdown" and cells[0].source.startswith("# ")
    assert release.colab_badge(repository, assignment) in cells[0].source
    assert cells[1].source == release.setup_cell_source(repository)
    assert cells[1].metadata["nbgrader"]["locked"] is True
    others = "\n".join(cell.source for cell in cells[2:])
    assert "pip install" not in others and "!wget" not in others and "drive.mount" not in others


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_answer_and_test_cells_follow_the_curriculum(assignment, fresh_build):
    answers = _grade_ids(fresh_build.release(assignment), "answer")
    tests = _grade_ids(fresh_build.release(assignment), "test")
    missing = [name for name in CONTRACTS[assignment] if name not in answers]
    assert not missing, f"answer cells missing for {missing}"
    for name in answers:
        assert any(t == f"test_{name}" or t.startswith(f"test_{name}_") for t in tests), f"no test cell for {name}"
    points = [cell.metadata["nbgrader"]["points"] for cell in _cells(fresh_build.release(assignment))
              if cell.metadata.get("nbgrader", {}).get("grade")]
    assert all(p > 0 for p in points)
    for cell in _cells(fresh_build.release(assignment)):
        if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("grade"):
            first_line = cell.source.splitlines()[0]
            assert first_line.startswith('"""') and first_line.endswith('"""'), \
                f"test cell {cell.metadata['nbgrader']['grade_id']} must open with a one-line docstring"


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_every_stub_names_its_exercise(assignment, fresh_build):
    stubs = [cell for cell in _cells(fresh_build.release(assignment)) if "NotImplementedError" in cell.source]
    answers = _grade_ids(fresh_build.release(assignment), "answer")
    assert len(stubs) >= len(answers)
    for cell in stubs:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in answers:
            assert re.search(rf'NotImplementedError\("Exercise \d+\.\d+: implement {re.escape(grade_id)}"\)', cell.source)


def _noise(notebook: nbformat.NotebookNode) -> list[str]:
    """Lines of the cells' outputs (streams and plain-text results) that are warnings or autograd noise."""
    found = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            text = output.get("text", "") if output.output_type == "stream" else \
                output.get("data", {}).get("text/plain", "")
            text = "".join(text) if isinstance(text, list) else text
            found += [f"{cell.id}: {line.strip()}" for line in text.splitlines() if NOISE.search(line)]
    return found


# A tqdm bar's text short of 100%: what a page without widgets shows of a bar whose text stopped there.
STALE_PROGRESS = re.compile(r"(?<!\d)\d{1,2}%\|")


def _stale_progress(notebook: nbformat.NotebookNode) -> list[str]:
    """Outputs that show a progress bar short of its end (attention_lab.progress keeps a bar's text current)."""
    return [f"{cell.id}: {output.data['text/plain']}" for cell in notebook.cells if cell.cell_type == "code"
            for output in cell.outputs if STALE_PROGRESS.search(output.get("data", {}).get("text/plain", ""))]


def test_noise_detector_sees_warnings_and_grad_fn():
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x")])
    notebook.cells[0].outputs = [
        nbformat.v4.new_output("stream", name="stderr", text="/x.py:3: UserWarning: Converting a tensor\n"),
        nbformat.v4.new_output("execute_result", data={"text/plain": "tensor(0.5, grad_fn=<RoundBackward1>)"}),
        nbformat.v4.new_output("stream", name="stdout", text="✓ split_heads: shapes and values (cpu)\n"),
    ]
    assert len(_noise(notebook)) == 2


def test_stale_progress_detector_sees_a_bar_short_of_its_end():
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x")])
    notebook.cells[0].outputs = [nbformat.v4.new_output("display_data", data={"text/plain": text}) for text in
                                 ("fitting:   0%|          | 0/300 [00:00<?, ?it/s]", "kept: 100%|██████████| 5/5", "")]
    assert len(_stale_progress(notebook)) == 1


def test_a_finished_run_kills_its_kernel_instead_of_waiting_for_its_shutdown(tmp_path):
    """Once every cell has run, the kernel is killed (a graceful shutdown can hang 2.5 s, see
    autograder.grading.execute.notebook_client): the exit hooks a cell registered never run."""
    ran_at_exit = tmp_path / "exit-hook-ran"
    path = tmp_path / "exit_hook.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        f"import atexit, pathlib\natexit.register(pathlib.Path({str(ran_at_exit)!r}).write_text, 'ran')")]), path)
    result = execute_notebook(path)
    assert not result.errors, result.summary()
    assert not ran_at_exit.exists(), "the kernel was shut down gracefully, not killed"


@pytest.mark.slow
@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_solution_notebook_runs_top_to_bottom_and_passes_every_test(assignment, fresh_build):
    """Deselected where this session runs the notebook in JupyterLab (conftest.SOLUTION_IN_THE_LAB)."""
    result = execute_notebook(fresh_build.source(assignment))
    assert not result.errors, result.summary()
    assert sorted(result.passed_tests) == sorted(_grade_ids(fresh_build.source(assignment), "test"))
    noise = _noise(result.notebook)
    assert not noise, "a course cell printed a warning or autograd noise:\n" + "\n".join(noise)
    stale = _stale_progress(result.notebook)
    assert not stale, "a progress bar's output is left short of its end, as a page without widgets shows it:\n" + \
        "\n".join(stale)


@pytest.mark.slow
@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_release_notebook_fails_only_on_the_blanks(assignment, fresh_build, forked_kernels):
    """In a kernel forked as grading forks them (a fresh one where bubblewrap is missing)."""
    result = execute_notebook(fresh_build.release(assignment), kernels=forked_kernels)
    unexpected = [error for error in result.errors
                  if not (error.ename == "NotImplementedError"
                          or (error.ename == "CheckFailure" and "not implemented yet" in error.evalue))]
    assert not unexpected, result.summary()
    assert not result.passed_tests, f"a test passes on the blank notebook: {result.passed_tests}"
    assert result.failed_tests, "the blank notebook should fail its tests"
