"""The release builder's own rules: repository setting, cell markers, stub messages."""

from __future__ import annotations

import subprocess

import nbformat
import pytest

from autograder.publishing import release
from tests.readme_commands import run_readme_command


@pytest.mark.parametrize("remote, expected", [
    ("https://github.com/someone/attention-lab.git", "someone/attention-lab"),
    ("git@github.com:some-org/attention.lab.git", "some-org/attention.lab"),
    ("https://github.com/someone/attention-lab", "someone/attention-lab"),
])
def test_repository_comes_from_a_github_remote(remote, expected, monkeypatch):
    def fake_run(*args, **kwargs):
        return subprocess.CompletedProcess(args, 0, stdout=remote + "\n", stderr="")

    monkeypatch.setattr(release.subprocess, "run", fake_run)
    assert release.course_repository() == expected


def test_repository_falls_back_to_the_pyproject_setting_off_github(monkeypatch):
    def fake_run(*args, **kwargs):
        return subprocess.CompletedProcess(args, 0, stdout="/srv/git/attention-lab\n", stderr="")

    monkeypatch.setattr(release.subprocess, "run", fake_run)
    assert release.course_repository() == "attention-lab/attention-lab"


def test_badge_and_setup_cell_point_at_the_repository():
    badge = release.colab_badge("me/course", "01_x")
    assert "colab.research.google.com/github/me/course/blob/main/course/01_x.ipynb" in badge
    # a text link, no image from the network (a broken picture offline)
    assert "![" not in badge and "<img" not in badge and "Colab" in badge
    setup = release.setup_cell_source("me/course")
    assert 'COURSE_REPOSITORY = "me/course"' in setup
    assert "attention_lab.setup()" in setup
    compile(setup, "setup", "exec")


def test_markers_become_nbgrader_metadata():
    answer = nbformat.v4.new_code_cell("x = 1", metadata={"answer": "split_heads"})
    test = nbformat.v4.new_code_cell("pass", metadata={"test": "test_split_heads", "points": 2})
    assert release.nbgrader_metadata(answer) == {"grade": False, "grade_id": "split_heads", "locked": False,
                                                 "schema_version": 3, "solution": True, "task": False}
    assert release.nbgrader_metadata(test)["points"] == 2 and release.nbgrader_metadata(test)["locked"] is True
    assert release.nbgrader_metadata(nbformat.v4.new_code_cell("y = 2")) is None
    with pytest.raises(ValueError, match="has no points"):
        release.nbgrader_metadata(nbformat.v4.new_code_cell("pass", metadata={"test": "test_x"}))


def _notebook(*cells):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = list(cells)
    return notebook


def test_stubs_are_named_after_the_exercise_above_them():
    notebook = _notebook(
        nbformat.v4.new_markdown_cell("### Exercise 2.3 — np_softmax (2 pts)"),
        nbformat.v4.new_code_cell("def np_softmax(x):\n    raise NotImplementedError()",
                                  metadata={"nbgrader": {"grade_id": "np_softmax"}}),
    )
    release.name_stubs(notebook, "02_x")
    assert 'raise NotImplementedError("Exercise 2.3: implement np_softmax")' in notebook.cells[1].source


def test_a_stub_without_an_exercise_header_is_an_error():
    notebook = _notebook(nbformat.v4.new_code_cell("raise NotImplementedError()",
                                                   metadata={"nbgrader": {"grade_id": "f"}}))
    with pytest.raises(ValueError, match="no '### Exercise N.M' header"):
        release.name_stubs(notebook, "02_x")


def test_normalise_strips_outputs_and_sets_stable_ids():
    cell = nbformat.v4.new_code_cell("1 + 1", execution_count=3,
                                     outputs=[nbformat.v4.new_output("execute_result", {"text/plain": "2"})],
                                     metadata={"nbgrader": {"grade_id": "g"}, "collapsed": True})
    notebook = release.normalise(_notebook(nbformat.v4.new_markdown_cell("# T"), cell))
    assert [c.id for c in notebook.cells] == ["cell-000", "g"]
    assert notebook.cells[1].outputs == [] and notebook.cells[1].execution_count is None
    assert notebook.cells[1].metadata == {"nbgrader": {"grade_id": "g"}}


def test_the_benchmark_validates_the_students_notebook_with_every_answer_written(fresh_build, tmp_path):
    """`make bench` times Validate on what a student who finished validates: the release with the solution's
    answers, visible tests only (issue #34)."""
    from benchmarks.notebooks import solved_release

    assignment = "02_numpy_walkthrough"
    path = solved_release(fresh_build.source(assignment), release.released_notebook(assignment, fresh_build.course_dir),
                          tmp_path / "solved.ipynb")
    solved, source = nbformat.read(path, as_version=4), nbformat.read(fresh_build.source(assignment), as_version=4)
    text = "\n".join(cell.source for cell in solved.cells)
    assert "raise NotImplementedError" not in text and "BEGIN HIDDEN TESTS" not in text
    answers = [cell.source for cell in source.cells if cell.metadata.get("nbgrader", {}).get("solution")]
    assert answers and all(answer in text for answer in answers)


@pytest.mark.slow
def test_make_release_check_passes_on_the_committed_course():
    """The README's `make release-check`, as written: the committed course/ is what `make release`
    builds from solutions/ (a fresh build in a scratch folder, compared byte for byte)."""
    checked = run_readme_command("make release-check")
    assert checked.returncode == 0 and "course/ is up to date" in checked.stdout, checked.stdout + checked.stderr
