"""The release builder's own rules: repository setting, cell markers, stub messages."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

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


def test_badge_and_setup_cell_point_at_the_repository_and_branch():
    badge = release.colab_badge("me/course", "01_x")
    assert "colab.research.google.com/github/me/course/blob/main/course/01_x.ipynb" in badge
    assert "/github/me/course/blob/stable/course/01_x.ipynb" in release.colab_badge("me/course", "01_x", "stable")
    # a text link, no image from the network (a broken picture offline)
    assert "![" not in badge and "<img" not in badge and "Colab" in badge
    setup = release.setup_cell_source("me/course")
    assert 'COURSE_REPOSITORY = "me/course"' in setup and 'COURSE_BRANCH = "main"' in setup
    assert f'HELPERS_VERSION = "{release.helpers_version()}"' in setup
    assert 'COURSE_BRANCH = "stable"' in release.setup_cell_source("me/course", "stable")
    assert "attention_lab.setup()" in setup
    compile(setup, "setup", "exec")


def test_the_helpers_version_is_written_once():
    """attention_lab.__version__ is the helpers' release: the setup cells name it and the package's metadata is it."""
    from importlib import metadata

    import attention_lab

    assert release.helpers_version() == attention_lab.__version__ == metadata.version("attention-lab")
    assert "version" not in tomllib.loads((release.REPO_ROOT / "pyproject.toml").read_text())["project"]


# The setup cell in a Python of its own, without this environment's packages (-S): the course's helpers are
# a package of the test's (``attention_lab`` with a version, whose setup() says so), and pip is a stand-in
# that records its command and either "installs" the helpers of the notebook's release or fails as pip
# fails on a private repository.
SETUP_CELL_RUNNER = r"""
import json, pathlib, subprocess, sys
helpers, outcome = pathlib.Path(sys.argv[1]), sys.argv[2]

def write_helpers(version):
    (helpers / "attention_lab").mkdir(parents=True, exist_ok=True)
    (helpers / "attention_lab" / "__init__.py").write_text(
        f"__version__ = {version!r}\ndef setup():\n    print('helpers', __version__, 'set up')\n    return 'cpu'\n")

if outcome.startswith("installed "):
    write_helpers(outcome.split()[1])
sys.path.insert(0, str(helpers))
calls = []

def pip(command, **options):
    calls.append({"command": command, "prompt": options["env"].get("GIT_TERMINAL_PROMPT")})
    if outcome == "private":
        return subprocess.CompletedProcess(command, 1, "", "Cloning https://github.com/o/r (to revision stable)\n"
                                           "fatal: could not read Username for 'https://github.com': terminal prompts "
                                           "disabled\nerror: subprocess-exited-with-error\n")
    write_helpers("0.1.0")
    return subprocess.CompletedProcess(command, 0, "", "")

subprocess.run = pip
shown = None
try:
    exec(compile(sys.stdin.read(), "setup cell", "exec"), {})
except Exception as error:
    shown = {"name": type(error).__name__, "lines": error._render_traceback_()}
print(json.dumps({"calls": calls, "shown": shown}))
"""


def _run_setup_cell(tmp_path, outcome: str) -> tuple[str, dict]:
    cell = release.setup_cell_source("o/r", "stable", version="0.1.0")
    # -B: no bytecode, whose cache would take the rewritten helpers (same size, same second) for the old ones
    ran = subprocess.run([sys.executable, "-S", "-B", "-c", SETUP_CELL_RUNNER, str(tmp_path / "helpers"), outcome],
                         input=cell, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    *printed, last = ran.stdout.splitlines()
    return "\n".join(printed), json.loads(last)


@pytest.mark.parametrize("installed", ["0.1.0", "0.2.0"])
def test_the_setup_cell_installs_nothing_where_the_helpers_are_current(tmp_path, installed):
    printed, outcome = _run_setup_cell(tmp_path, f"installed {installed}")
    assert outcome == {"calls": [], "shown": None}
    assert printed == f"helpers {installed} set up"


@pytest.mark.parametrize("installed", [None, "0.0.9"])
def test_the_setup_cell_installs_missing_or_older_helpers_saying_what_and_from_where(tmp_path, installed):
    printed, outcome = _run_setup_cell(tmp_path, f"installed {installed}" if installed else "missing")
    (call,) = outcome["calls"]
    assert call["command"][-1] == "attention-lab @ git+https://github.com/o/r@stable"
    assert "--upgrade" in call["command"] and call["prompt"] == "0"  # a password prompt would wait forever
    lines = printed.splitlines()
    assert lines[0].startswith("Installing the course's helpers 0.1.0 with pip from git+https://github.com/o/r@stable")
    assert "is kept" in lines[0] and lines[1].startswith("Installed in ")
    assert lines[2] == "helpers 0.1.0 set up"  # the new helpers, even where older ones had been imported


def test_a_failed_install_says_what_to_check_without_a_traceback(tmp_path):
    printed, outcome = _run_setup_cell(tmp_path, "private")
    assert outcome["shown"]["name"] == "CourseSetupFailed" and len(outcome["calls"]) == 1
    message = "\n".join(outcome["shown"]["lines"])
    assert message.startswith("Could not install the course's helpers from git+https://github.com/o/r@stable.")
    for advice in ("reaches the internet", "github.com/o/r exists", "is public", "a branch stable",
                   "terminal prompts disabled"):
        assert advice in message, advice
    assert "Traceback" not in message and "CalledProcessError" not in message
    assert "set up" not in printed


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
