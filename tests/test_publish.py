"""`make publish`: the students' repository as a learner meets it (issues #35 item 16, #51 item 5, #56, #57).

It holds the release only (what git tracks in course/), every file checked and nothing secret; its
notebooks' Colab links and setup cell point at it and at the branch publish was told, and nbgrader's
Validate trusts them as published; it has the students' own `make lab`, a README for a learner alone
and a LICENSE. Its notebooks run in a fresh environment whose helpers their own setup cell installs
from it, as on Colab: git's URL for GitHub is rewritten to the published folder, and the environment
has Colab's ipywidgets (7.7.1), which the install keeps.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import urllib.request
import warnings
import zipfile
from pathlib import Path

import nbformat
import pytest

from autograder.places import REPO_ROOT
from autograder.publishing import publish
from autograder.publishing.release import assignment_names, colab_url, course_repository, helpers_version
from tests.lab_servers import http_get, running_lab
from tests.readme_commands import run_readme_command

REPO = "myuni/attention-lab-students"
PUBLISH = "make publish DEST=../attention-lab-students REPO=myuni/attention-lab-students"
COLAB_IPYWIDGETS = "7.7.1"  # what Colab's runtimes ship (github.com/googlecolab/backend-info, pip-freeze.txt)
ON_THE_PUBLISHED_REPOSITORY = pytest.mark.xdist_group("published_repository")


def _git(folder: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(folder), "-c", "user.name=Test", "-c", "user.email=test@example.org", *args],
                   check=True, capture_output=True)


def _commit_all(folder: Path, branch: str = "main") -> None:
    if not (folder / ".git").exists():
        _git(folder, "init", "-q", "-b", branch)
    _git(folder, "add", "-A")
    _git(folder, "commit", "-q", "-m", "release")


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    """The students' repository, published once and committed on ``main``, where a rewritten GitHub URL
    finds it: ``<root>/github/myuni/attention-lab-students``. Tests that change it work on a copy."""
    dest = tmp_path_factory.mktemp("published") / "github" / REPO
    assert publish.publish(dest, REPO) == []
    _commit_all(dest)
    return dest


def _notebook(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def test_make_publish_writes_a_students_repository_with_no_secret(tmp_path):
    dest = tmp_path / "students"
    result = run_readme_command(PUBLISH, replace={"../attention-lab-students": str(dest)}, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in dest.iterdir()) == sorted(publish.WRITTEN)
    assert sorted(p.stem for p in (dest / "course").glob("*.ipynb")) == assignment_names()
    tracked = subprocess.run(["git", "-C", str(REPO_ROOT / "course"), "ls-files"], capture_output=True, text=True,
                             check=True).stdout.split()
    assert sorted(str(p.relative_to(dest / "course")) for p in (dest / "course").rglob("*") if p.is_file()) == \
        sorted(tracked), "course/ of the students' repository is not the release git tracks"
    first = _notebook(dest / "course" / "01_mha_shapes.ipynb")
    assert colab_url(REPO, "01_mha_shapes", "main") in first.cells[0].source
    assert 'COURSE_REPOSITORY = "myuni/attention-lab-students"' in first.cells[1].source
    assert 'COURSE_BRANCH = "main"' in first.cells[1].source
    assert f'HELPERS_VERSION = "{helpers_version()}"' in first.cells[1].source
    everything = "".join(p.read_text() for p in dest.rglob("*") if p.is_file() and ".git" not in p.parts)
    assert course_repository() not in everything
    pyproject = tomllib.loads((dest / "pyproject.toml").read_text())
    assert pyproject["tool"]["attention_lab"]["repository"] == REPO
    assert pyproject["project"]["version"] == helpers_version()
    # the students' lab: the tools of this repository's `make lab`, with its ranges, and nothing of the instructors'
    lab_tools = sorted(re.match(r"[\w.-]+", tool).group() for tool in pyproject["project"]["optional-dependencies"]["lab"])
    assert lab_tools == ["ipykernel", "jupyterlab", "nbgrader"]
    assert (dest / "constraints.txt").read_text() == (REPO_ROOT / "constraints.txt").read_text()
    assert (dest / "Makefile").read_text() == (publish.STUDENT_FILES / "Makefile").read_text()
    for name, source in publish.LAB_FILES.items():
        assert (dest / name).read_bytes() == source.read_bytes(), name
    # MIT, as pyproject.toml says, in the repository and in what pip installs from it
    assert pyproject["project"]["license"] == "MIT" and (dest / "LICENSE").read_text().startswith("MIT License")
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                            "-w", str(tmp_path / "wheel"), str(dest)], capture_output=True, text=True, timeout=600)
    assert wheel.returncode == 0, wheel.stdout + wheel.stderr
    (built,) = (tmp_path / "wheel").glob("*.whl")
    names = zipfile.ZipFile(built).namelist()
    assert "attention_lab/checking.py" in names and "attention_lab/progress.py" in names
    assert not any(n.startswith(("solutions", "autograder", "lab/")) for n in names)
    assert any(n.endswith("licenses/LICENSE") for n in names), names
    # publishing again into the same folder, a clone of the students' repository, keeps its .git
    (dest / ".git").mkdir()
    (dest / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    again = run_readme_command("make publish", env=dict(os.environ, DEST=str(dest), REPO=REPO, BRANCH="stable"),
                               timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (dest / ".git" / "HEAD").read_text() == "ref: refs/heads/main\n"
    assert sorted(p.stem for p in (dest / "course").glob("*.ipynb")) == assignment_names()
    # BRANCH=: every link and every setup cell names that branch, and the README says which
    first = _notebook(dest / "course" / "01_mha_shapes.ipynb")
    assert colab_url(REPO, "01_mha_shapes", "stable") in first.cells[0].source
    assert 'COURSE_BRANCH = "stable"' in first.cells[1].source
    readme = (dest / "README.md").read_text()
    assert "branch `stable`" in readme and "/blob/main/" not in readme
    assert readme.count("/blob/stable/course/") == len(assignment_names())


@ON_THE_PUBLISHED_REPOSITORY
def test_the_readme_speaks_to_a_learner_alone_and_names_what_they_may_lack(published):
    readme = (published / "README.md").read_text()
    # the notebooks in their order, each with its Colab link on the branch published
    positions = [readme.index(f"(course/{name}.ipynb)") for name in assignment_names()]
    assert positions == sorted(positions)
    assert all(colab_url(REPO, name, "main") in readme for name in assignment_names())
    assert "branch `main`" in readme
    studying = readme.split("## Studying on your own", 1)[1].split("\n## ", 1)[0]
    assert "all the feedback there is" in studying            # the visible checks are the whole feedback
    assert "Colab has no Validate button" in studying and "Run all" in studying
    assert "`B` batch" in studying and "True = may" in studying  # the notation
    assert "torch>=2.5" in readme
    assert "make lab" in readme and "constraints.txt" in readme
    # where Triton is missing, the check's message and the README name the same extra, which the package has
    from attention_lab.triton_kernels import TRITON_MISSING

    extra = 'pip install -e ".[triton]"'
    assert extra in readme and extra in TRITON_MISSING
    assert "make setup" not in TRITON_MISSING and "Colab" in TRITON_MISSING
    assert "triton" in tomllib.loads((published / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "## In a class" in readme and "## License" in readme


@ON_THE_PUBLISHED_REPOSITORY
def test_validate_trusts_every_untouched_published_notebook(published):
    """nbgrader's Validate compares each locked cell with its checksum: publishing rewrites the setup cell, so
    its checksum is computed anew (the release's own would report the cell as changed)."""
    from nbgrader.utils import compute_checksum
    from nbgrader.validator import Validator

    for name in assignment_names():
        notebook = _notebook(published / "course" / f"{name}.ipynb")
        assert Validator()._get_changed_cells(notebook) == [], name
        released = _notebook(REPO_ROOT / "course" / f"{name}.ipynb")
        setup, released_setup = notebook.cells[1], released.cells[1]
        assert setup.metadata.nbgrader["checksum"] == compute_checksum(setup) != \
            released_setup.metadata.nbgrader["checksum"], name


def _private_copy(tmp_path: Path) -> Path:
    """course/ in a git repository of its own, committed: a private repository a test may change."""
    root = tmp_path / "private"
    shutil.copytree(REPO_ROOT / "course", root / "course",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", ".ipynb_checkpoints"))
    _commit_all(root)
    return root / "course"


def test_only_what_git_tracks_is_published_and_an_archive_is_refused(tmp_path, capsys):
    course = _private_copy(tmp_path)
    archive = course / "solutions-01.zip"   # an instructor's zip of a solution, left in course/
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.write(REPO_ROOT / "solutions" / "01_mha_shapes.py", "01_mha_shapes.py")
    dest = tmp_path / "students"
    assert publish.publish(dest, REPO, course_dir=course) == []
    assert not (dest / "course" / archive.name).exists()
    assert f"not published: course/{archive.name} (git does not track it" in capsys.readouterr().out
    # committed by mistake, it is part of what git tracks: copied, then refused, since nothing can check it
    _commit_all(course.parent)
    problems = publish.publish(dest, REPO, course_dir=course)
    assert any(p.startswith(f"course/{archive.name} is not a text file") for p in problems), problems
    # the helpers changed and their version did not: Colab runtimes would keep the old ones
    archive.unlink()
    with open(course / "attention_lab" / "device.py", "a") as helper:
        helper.write("# a fix\n")
    _commit_all(course.parent)
    capsys.readouterr()
    assert publish.publish(dest, REPO, course_dir=course) == []
    assert f"the helpers (course/attention_lab) changed since the last publication, and their version is still " \
           f"{helpers_version()}" in capsys.readouterr().out


@ON_THE_PUBLISHED_REPOSITORY
def test_the_check_finds_a_solution_a_hidden_test_a_binary_or_a_private_folder(published, tmp_path):
    dest = tmp_path / "students"
    shutil.copytree(published, dest, ignore=shutil.ignore_patterns(".git"))
    solutions, hidden = publish.secret_lines()
    notebook = _notebook(dest / "course" / "01_mha_shapes.ipynb")
    answer = next(c for c in notebook.cells if c.metadata.get("nbgrader", {}).get("solution") and c.cell_type == "code")
    own = next(line for line in sorted(solutions) if line not in answer.source)
    answer.source += "\n" + own
    notebook.cells[-1].source += "\n" + sorted(hidden)[0]
    nbformat.write(notebook, str(dest / "course" / "01_mha_shapes.ipynb"))
    shutil.copytree(REPO_ROOT / "solutions", dest / "solutions")
    (dest / "lab" / "notes.pyc").write_bytes(b"\xa7\r\r\n\0\0\0\0compiled")
    problems = publish.secrets_in(dest, course_repository())
    assert "solutions is there" in problems
    assert any(p.startswith("course/01_mha_shapes.ipynb holds solution or hidden-test code") for p in problems)
    assert any(p.startswith("solutions/") and "holds solution" in p for p in problems), problems
    assert any(p.startswith("lab/notes.pyc is not a text file") for p in problems), problems
    # a publication into a folder of other files is refused
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="did not write"):
        publish.publish(other, REPO)


# --- the published notebooks in a fresh environment, installed as on Colab ------------------------------------

def _fresh_environment(root: Path) -> Path:
    """A virtual environment that sees this one's packages (a path, so none of its .pth files runs: the course's
    editable install stays out of it) and has Colab's ipywidgets of its own; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, capture_output=True)
    python = root / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "the-course-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run([str(python), "-m", "pip", "install", "--quiet", f"ipywidgets=={COLAB_IPYWIDGETS}"],
                               capture_output=True, text=True, timeout=600)
    if installed.returncode != 0:
        message = f"FRESH-ENVIRONMENT TEST NOT RUN: pip could not install Colab's ipywidgets: {installed.stderr[-500:]}"
        warnings.warn(message)
        pytest.skip(message)
    return python


def _kernel_environment(root: Path, python: Path, published: Path) -> dict:
    """What the notebooks run with: their kernel is ``python``'s (the notebooks' own kernel name, ``python3``,
    found first in JUPYTER_PATH); git finds github.com/<REPO> in the published folder; pip installs offline
    (every dependency is there already) with the environment's own setuptools."""
    config = root / "gitconfig"
    config.write_text(f'[url "file://{published.parents[1]}/"]\n\tinsteadOf = https://github.com/\n')
    kernel = root / "jupyter" / "kernels" / "python3" / "kernel.json"
    kernel.parent.mkdir(parents=True)
    kernel.write_text(json.dumps({"argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                                  "display_name": "Python 3", "language": "python"}))
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith(("PYTHON", "PIP_", "GIT_", "JUPYTER"))}
    return dict(environment, JUPYTER_PATH=str(root / "jupyter"), GIT_CONFIG_GLOBAL=str(config),
                GIT_CONFIG_NOSYSTEM="1", PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0", MPLBACKEND="Agg")


def _run(python: Path, notebook: Path, environment: dict, timeout: int = 600) -> nbformat.NotebookNode:
    """``notebook`` executed top to bottom (past errors) in a kernel of ``python``; the executed notebook."""
    executed = notebook.with_name(notebook.stem + "-run.ipynb")
    ran = subprocess.run([str(python), "-m", "nbconvert", "--to", "notebook", "--execute", "--allow-errors",
                          "--output", executed.name, notebook.name], cwd=notebook.parent, env=environment,
                         capture_output=True, text=True, timeout=timeout)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return _notebook(executed)


def _validate(python: Path, notebook: Path, environment: dict) -> str:
    ran = subprocess.run([str(python), "-m", "nbgrader", "validate", notebook.name], cwd=notebook.parent,
                         env=environment, capture_output=True, text=True, timeout=600)
    return ran.stdout + ran.stderr


def _text(cell: nbformat.NotebookNode) -> str:
    return "".join(output.get("text", "") for output in cell.outputs if output.output_type == "stream")


@pytest.mark.slow
@ON_THE_PUBLISHED_REPOSITORY
def test_published_notebooks_install_their_helpers_in_a_fresh_environment_and_validate(published, tmp_path,
                                                                                        fresh_build):
    from benchmarks.notebooks import solved_release

    python = _fresh_environment(tmp_path / "fresh")
    environment = _kernel_environment(tmp_path, python, published)
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(published / "course" / "nbgrader_config.py", work)
    blank = shutil.copy(published / "course" / "01_mha_shapes.ipynb", work / "blank.ipynb")
    solved = solved_release(fresh_build.source("01_mha_shapes"), blank, work / "solved.ipynb")
    # a learner's first cells on Colab, in a runtime without the helpers: the setup cell, a widget, a progress bar
    first = _notebook(blank)
    first.cells = first.cells[:2] + [nbformat.v4.new_code_cell(
        "from attention_lab.widgets import attention_explorer\nfrom tqdm.auto import tqdm\n"
        "for _ in tqdm(range(3), desc='steps'):\n    pass\n"
        "attention_explorer(lambda q, k, mask=None: (q @ k.transpose(-2, -1)).softmax(-1), list('abc'), num_heads=2)")]
    nbformat.write(first, work / "first.ipynb")
    ran = _run(python, work / "first.ipynb", environment)
    setup = _text(ran.cells[1])
    assert f"Installing the course's helpers {helpers_version()} with pip from git+https://github.com/{REPO}@main" \
        in setup, setup
    assert re.search(rf"Attention Lab {re.escape(helpers_version())} \| .* \| ipywidgets {COLAB_IPYWIDGETS} \|", setup)
    errors = [output for cell in ran.cells[1:] for output in cell.outputs if output.output_type == "error"]
    assert not errors, [(error.ename, error.evalue[:300]) for error in errors]
    # on Colab's ipywidgets: the progress bar's last text, and the live widget with its picture
    progress, widget = (output.data for output in ran.cells[2].outputs if output.output_type != "stream")
    assert progress["text/plain"].startswith("steps: 100%")
    assert "application/vnd.jupyter.widget-view+json" in widget and "image/png" in widget
    installed = subprocess.run([str(python), "-c", "import attention_lab, ipywidgets; "
                                "print(ipywidgets.__version__, attention_lab.__file__)"],
                               env=environment, capture_output=True, text=True, check=True).stdout.split()
    assert installed[0] == COLAB_IPYWIDGETS, "installing the course upgraded the runtime's ipywidgets"
    assert installed[1].startswith(str(tmp_path / "fresh")), installed
    # nbgrader's Validate, on the untouched notebooks, in that runtime: the blank one stops at its blanks (the
    # first is split_heads), the solved one passes every visible test
    blank_verdict = _validate(python, blank, environment)
    assert "VALIDATION FAILED ON" in blank_verdict, blank_verdict
    assert blank_verdict.index("check_split_heads(split_heads)") < blank_verdict.index("check_merge_heads")
    solved_verdict = _validate(python, solved, environment)
    assert "Success! Your notebook passes all the tests." in solved_verdict, solved_verdict
    assert "HAVE CHANGED" not in blank_verdict + solved_verdict


# --- the students' `make lab` ---------------------------------------------------------------------------------

@pytest.mark.slow
@ON_THE_PUBLISHED_REPOSITORY
def test_the_published_make_lab_is_the_student_lab(published, tmp_path):
    """The students' `make lab`, on this environment (its .venv taken as already set up): JupyterLab on course/,
    Validate served beside the server, instructor tools off, course notebooks saved without outputs."""
    from nbgrader import __version__ as nbgrader_version

    from tests.test_lab import _as_run_in_jupyterlab, _status

    clone = tmp_path / "clone"
    shutil.copytree(published, clone, ignore=shutil.ignore_patterns(".git"))
    (clone / ".venv").symlink_to(REPO_ROOT / ".venv")
    with running_lab("lab", clone / "course", tmp_path, students_repository=clone) as lab:
        assert "01_mha_shapes.ipynb" in {item["name"] for item in lab.api("contents")["content"]}
        page = http_get(lab.url("lab"))
        assert "@jupyter/nbgrader" in page and "@jupyter-widgets/jupyterlab-manager" in page
        for plugin in ("formgrader", "create-assignment", "assignment-list", "course-list", "menu"):
            assert f'"@jupyter/nbgrader:{plugin}"' in page.split('"disabledExtensions"')[1].split("]")[0], plugin
        assert _status(lab.url("formgrader")) == 404, "Formgrader's server extension runs in the students' lab"
        # the lab's own Validate (lab/validate.py, a child process) answers the button's version check
        assert json.loads(http_get(lab.url(f"nbgrader_version?version={nbgrader_version}"))) == {"success": True}
        # a course notebook saved after a run is its released self: git pull of a new release merges cleanly
        path = clone / "course" / "01_mha_shapes.ipynb"
        released = path.read_bytes()
        body = json.dumps({"type": "notebook", "format": "json",
                           "content": _as_run_in_jupyterlab(json.loads(released))}).encode()
        request = urllib.request.Request(lab.url("api/contents/01_mha_shapes.ipynb"), data=body, method="PUT",
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=60).close()
        assert path.read_bytes() == released
