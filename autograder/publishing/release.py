"""Build the student release from the one source of each notebook.

    python -m autograder.publishing.release           # solutions/*.py  ->  course/*.ipynb
    python -m autograder.publishing.release --check   # exit 1 if course/ is not what a rebuild gives

Pipeline, per notebook ``solutions/NN_name.py`` (jupytext percent format):

1. **source** (:func:`build_source`): read the cells; turn the short cell markers into
   nbgrader metadata (``# %% answer="split_heads"`` -> an autograded answer cell,
   ``# %% test="test_x" points=2`` -> a locked, graded test cell, ``# %% [markdown]
   manual="x" points=2`` -> a written answer graded by hand); wrap each hidden block so that
   its failure says it is hidden (:func:`mark_hidden_tests`); add the Colab badge and the
   generated setup cell.  The grader builds its ``source/`` with the same function.
2. **release**: ``nbgrader generate_assignment`` strips solutions and hidden tests, in a
   scratch course root of its own (a release never touches the instructor's gradebook).
3. **course**: each stub gets its exercise's message, then the notebook is normalised
   (no outputs, no execution counts, stable cell ids, sorted keys) into ``course/``, so a
   rebuild is byte-identical.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

import jupytext
import nbformat

from autograder.command_line import command_line
from autograder.lab.course_notebooks import COURSE_NOTEBOOK_METADATA
from autograder.store.nbgrader_cli import run_in_process
from autograder.store.results import HIDDEN_FAILURE
from autograder.places import COURSE_DIR, REPO_ROOT, SETUP_CELL_ID, SOLUTIONS_DIR

STUB = "raise NotImplementedError()"
HIDDEN_BEGIN = "### BEGIN HIDDEN TESTS"
HIDDEN_END = "### END HIDDEN TESTS"
EXERCISE_HEADER = re.compile(r"^#{2,4}\s+Exercise\s+(?P<number>\d+\.\d+)\b", re.MULTILINE)
GITHUB_REMOTE = re.compile(r"github\.com[:/](?P<repository>[\w.-]+/[\w.-]+?)(?:\.git)?/?$")
# The branch the Colab links open and the setup cell installs from (`make publish BRANCH=` another).
DEFAULT_BRANCH = "main"


def assignment_names() -> list[str]:
    """Every notebook of the course, in order: ``01_mha_shapes``, ``02_numpy_walkthrough``, ..."""
    return sorted(path.stem for path in SOLUTIONS_DIR.glob("[0-9][0-9]_*.py"))


def assignments_with_source(root: Path) -> list[str]:
    """The assignments with a source notebook in the course root ``root`` (``source/<assignment>/``)."""
    source = root / "source"
    return sorted(p.name for p in source.iterdir() if p.is_dir() and any(p.glob("*.ipynb"))) if source.is_dir() else []


def course_repository() -> str:
    """``owner/name`` of the GitHub repository the Colab badges and setup cells point at.

    The git remote wins when it is on GitHub; otherwise the setting in pyproject.toml.
    """
    try:
        remote = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "remote", "get-url", "origin"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        match = GITHUB_REMOTE.search(remote)
        if match:
            return match.group("repository")
    except (subprocess.CalledProcessError, FileNotFoundError):
        pass
    settings = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    return settings["tool"]["attention_lab"]["repository"]


def helpers_version() -> str:
    """The helpers' release, ``attention_lab.__version__``, read from its source (importing the
    package would import torch): the setup cell of every notebook names it."""
    tree = ast.parse((COURSE_DIR / "attention_lab" / "version.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError("course/attention_lab/version.py does not set __version__")


def colab_url(repository: str, assignment: str, branch: str = DEFAULT_BRANCH) -> str:
    """Where Colab opens ``course/<assignment>.ipynb`` of ``branch`` of the GitHub repository."""
    return f"https://colab.research.google.com/github/{repository}/blob/{branch}/course/{assignment}.ipynb"


def colab_badge(repository: str, assignment: str, branch: str = DEFAULT_BRANCH) -> str:
    """A text link to the notebook on Colab: no image, so it reads the same offline (Colab's
    badge is an image on colab.research.google.com, a broken picture without the network)."""
    return f"**[Open this notebook in Colab]({colab_url(repository, assignment, branch)})**"


def setup_cell_source(repository: str, branch: str = DEFAULT_BRANCH, version: str | None = None) -> str:
    """The first code cell of every notebook (the same everywhere; generated, never edited).

    It installs the helpers from ``branch`` of the GitHub ``repository`` where they are missing or
    older than ``version`` (default: the helpers' own, :func:`helpers_version`), saying what and from
    where; keeps what the runtime has (pip upgrades nothing else it need not: Colab's torch and
    ipywidgets stay); fails with what to check instead of pip's traceback; never waits for a
    password (``GIT_TERMINAL_PROMPT=0``: a private or misspelt repository fails at once). Where the
    helpers are installed and current (the course's own lab, grading) it installs nothing.
    """
    version = version or helpers_version()
    return f'''# Setup: the same cell in every notebook (generated by `make release`; do not edit).
# The course's helpers (the package attention_lab) install from this GitHub repository and branch:
COURSE_REPOSITORY = "{repository}"
COURSE_BRANCH = "{branch}"
HELPERS_VERSION = "{version}"  # the helpers this notebook was released with


def install_course_helpers():
    \"\"\"Install the helpers where they are missing or older than this notebook's; keep the rest.\"\"\"
    import importlib, os, re, subprocess, sys, time

    def release(version):
        return tuple(int(number) for number in re.findall(r"\\d+", version)[:3])

    try:
        import attention_lab
        if release(attention_lab.__version__) >= release(HELPERS_VERSION):
            return
    except ModuleNotFoundError:
        pass
    source = f"git+https://github.com/{{COURSE_REPOSITORY}}@{{COURSE_BRANCH}}"
    print(f"Installing the course's helpers {{HELPERS_VERSION}} with pip from {{source}} (about half "
          "a minute; what this runtime has already, torch and ipywidgets included, is kept) ...",
          flush=True)
    started = time.monotonic()
    command = ["install", "--quiet", "--upgrade", f"attention-lab @ {{source}}"]
    pip = subprocess.run([sys.executable, "-m", "pip", *command], capture_output=True, text=True,
                         env={{**os.environ, "GIT_TERMINAL_PROMPT": "0"}})
    if pip.returncode != 0:
        class CourseSetupFailed(Exception):
            def _render_traceback_(self):  # what Jupyter shows: this message, no traceback
                return str(self).splitlines()

        said = "\\n".join("    " + line for line in pip.stderr.strip().splitlines()[-8:])
        raise CourseSetupFailed(
            f"Could not install the course's helpers from {{source}}. Check:\\n"
            "  * that this runtime reaches the internet (Colab: Runtime > Disconnect and delete "
            "runtime, then run this cell again; your own machine: its network or proxy);\\n"
            f"  * that the repository github.com/{{COURSE_REPOSITORY}} exists, is spelt so, and is "
            f"public (pip cannot log in to a private one), with a branch {{COURSE_BRANCH}}.\\n"
            f"pip said:\\n{{said}}") from None
    print(f"Installed in {{time.monotonic() - started:.0f}} s.")
    for name in [name for name in sys.modules if name.split(".")[0] == "attention_lab"]:
        del sys.modules[name]  # older helpers imported above: the new ones are imported below
    importlib.invalidate_caches()


install_course_helpers()
import attention_lab
# CUDA when there is a GPU; seeds every generator; prints the versions
device = attention_lab.setup()'''


def nbgrader_metadata(cell: nbformat.NotebookNode) -> dict | None:
    """nbgrader metadata for a cell marked ``answer=``, ``test=`` or ``manual=`` in the source.

    ``# %% [markdown] manual="why_positions" points=2`` is a written answer graded by hand
    (in Formgrader): the cell's text is the model answer, which nbgrader replaces with
    "YOUR ANSWER HERE" in the release.
    """
    metadata = cell.metadata
    if "manual" in metadata:
        if cell.cell_type != "markdown" or "points" not in metadata:
            raise ValueError(f"manual answer {metadata['manual']!r} must be a markdown cell with points=")
        return {"grade": True, "grade_id": metadata["manual"], "locked": False,
                "points": metadata["points"], "schema_version": 3, "solution": True, "task": False}
    if "answer" in metadata:
        return {"grade": False, "grade_id": metadata["answer"], "locked": False,
                "schema_version": 3, "solution": True, "task": False}
    if "test" in metadata:
        if "points" not in metadata:
            raise ValueError(f"test cell {metadata['test']!r} has no points=")
        return {"grade": True, "grade_id": metadata["test"], "locked": True,
                "points": metadata["points"], "schema_version": 3, "solution": False, "task": False}
    return None


def mark_hidden_tests(source: str) -> str:
    """Wrap each hidden block of a test cell so that its failure is a ``HiddenTestFailure``.

    Feedback then knows from the error's name, not from where it was raised, that only the
    hidden tests failed (and shows nothing of them).  The wrapper sits between the markers,
    so nbgrader strips it from the release together with the hidden tests.
    """
    lines = source.splitlines()
    marked, index = [], 0
    while index < len(lines):
        line = lines[index]
        marked.append(line)
        index += 1
        if line.strip() != HIDDEN_BEGIN:
            continue
        end = next((i for i in range(index, len(lines)) if lines[i].strip() == HIDDEN_END), None)
        if end is None:
            raise ValueError(f"{HIDDEN_BEGIN} without {HIDDEN_END}")
        body = lines[index:end]
        if any(code.strip() and not code.strip().startswith("#") for code in body):
            indent = line[:len(line) - len(line.lstrip())]
            marked += [f"{indent}try:", *[f"    {code}" if code.strip() else code for code in body],
                       f"{indent}except Exception as hidden_failure:  # named for the grader's feedback",
                       f'{indent}    raise type("{HIDDEN_FAILURE}", (AssertionError,), {{}})(str(hidden_failure)) '
                       "from hidden_failure"]
        else:
            marked += body
        index = end
    return "\n".join(marked)


def build_source(assignment: str, repository: str) -> nbformat.NotebookNode:
    """The instructor notebook (solutions and hidden tests included) with nbgrader metadata."""
    notebook = jupytext.read(SOLUTIONS_DIR / f"{assignment}.py", fmt="py:percent")
    cells = []
    for cell in notebook.cells:
        nbgrader = nbgrader_metadata(cell)
        cell.metadata = {"nbgrader": nbgrader} if nbgrader else {}
        if nbgrader and nbgrader["locked"] and nbgrader["grade"]:
            cell.source = mark_hidden_tests(cell.source)
        cells.append(cell)
    title = cells[0]
    if title.cell_type != "markdown" or not title.source.startswith("# "):
        raise ValueError(f"{assignment}: the first cell must be the markdown title")
    title.source = title.source.rstrip() + "\n\n" + colab_badge(repository, assignment)
    setup = nbformat.v4.new_code_cell(setup_cell_source(repository))
    setup.metadata = {"nbgrader": {"grade": False, "grade_id": SETUP_CELL_ID, "locked": True,
                                   "schema_version": 3, "solution": False, "task": False}}
    cells.insert(1, setup)
    grade_ids = [c.metadata["nbgrader"]["grade_id"] for c in cells if "nbgrader" in c.metadata]
    duplicates = {g for g in grade_ids if grade_ids.count(g) > 1}
    if duplicates:
        raise ValueError(f"{assignment}: duplicate grade_id {sorted(duplicates)}")
    notebook.cells = cells
    return normalise(notebook)


def normalise(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """No outputs, no execution counts, stable ids, minimal metadata: rebuilds are byte-identical."""
    notebook.metadata = {key: dict(value) for key, value in COURSE_NOTEBOOK_METADATA.items()}
    notebook.nbformat, notebook.nbformat_minor = 4, 5
    for index, cell in enumerate(notebook.cells):
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        cell.id = grade_id if grade_id else f"cell-{index:03d}"
        cell.metadata = {key: cell.metadata[key] for key in ("nbgrader",) if key in cell.metadata}
        cell.pop("attachments", None)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return notebook


def name_stubs(notebook: nbformat.NotebookNode, assignment: str) -> None:
    """Give every code stub its exercise: ``NotImplementedError("Exercise 1.3: implement split_heads")``."""
    exercise = None
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            match = None
            for match in EXERCISE_HEADER.finditer(cell.source):
                pass
            exercise = match.group("number") if match else exercise
        elif STUB in cell.source:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id", "this")
            if exercise is None:
                raise ValueError(f"{assignment}: answer cell {grade_id!r} has no '### Exercise N.M' header above it")
            cell.source = cell.source.replace(
                STUB, f'raise NotImplementedError("Exercise {exercise}: implement {grade_id}")'
            )


def write_notebook(notebook: nbformat.NotebookNode, path: Path) -> None:
    """Write byte for byte what JupyterLab's server would write when a student saves it.

    jupyter_server saves with ``nbformat.write`` (sources split into lists of lines, keys
    sorted, one-space indent): writing the release the same way leaves a save nothing to change.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        nbformat.write(notebook, file, version=nbformat.NO_CONVERT)


def source_path(root: Path, assignment: str) -> Path:
    """Where a course root keeps the source (instructor) notebook of an assignment."""
    return root / "source" / assignment / f"{assignment}.ipynb"


def released_notebook(assignment: str, course_dir: Path = COURSE_DIR) -> Path:
    """The release of an assignment: the student notebook students get, and submit back."""
    return course_dir / f"{assignment}.ipynb"


def generate_assignments(assignments: list[str], nbgrader_root: Path, *options: str) -> None:
    """nbgrader's ``generate_assignment --force <options>`` on each of ``assignments`` (its release, and
    its cells in the gradebook), in this process (:func:`autograder.store.nbgrader_cli.run_in_process`);
    nbgrader logs what went wrong."""
    for assignment in assignments:
        arguments = ["generate_assignment", assignment, "--force", *options, f"--CourseDirectory.root={nbgrader_root}"]
        if run_in_process(*arguments) != 0:
            raise RuntimeError(f"nbgrader {' '.join(arguments)} failed (nbgrader's messages are above)")


def generate_releases(assignments: list[str], nbgrader_root: Path) -> dict[str, nbformat.NotebookNode]:
    """Run nbgrader's generate_assignment on the source notebooks of ``assignments``; return their releases."""
    generate_assignments(assignments, nbgrader_root, "--log-level=WARN")
    return {assignment: nbformat.read(nbgrader_root / "release" / assignment / f"{assignment}.ipynb", as_version=4)
            for assignment in assignments}


def build(assignments: list[str], course_dir: Path, nbgrader_root: Path | None = None) -> list[Path]:
    """Build the student notebooks into ``course_dir``; return their paths.

    nbgrader runs in ``nbgrader_root`` (a temporary folder unless given: a caller may keep
    the sources it holds); never in the instructor's course root, whose gradebook and
    ``source/`` only grading writes.
    """
    if nbgrader_root is None:
        with tempfile.TemporaryDirectory(prefix="release-") as scratch:
            return build(assignments, course_dir, Path(scratch))
    repository = course_repository()
    for assignment in assignments:
        write_notebook(build_source(assignment, repository), source_path(nbgrader_root, assignment))
    written = []
    for assignment, release in generate_releases(assignments, nbgrader_root).items():
        name_stubs(release, assignment)
        path = released_notebook(assignment, course_dir)
        write_notebook(normalise(release), path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__)
    parser.add_argument("--check", action="store_true", help="fail if course/ differs from a fresh build")
    parser.add_argument("assignments", nargs="*", help="default: every notebook in solutions/")
    options = parser.parse_args(argv)
    assignments = options.assignments or assignment_names()
    if not options.check:
        for path in build(assignments, COURSE_DIR):
            print(f"released {path.relative_to(REPO_ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        stale = []
        for path in build(assignments, Path(scratch) / "course"):
            committed = COURSE_DIR / path.name
            if not committed.exists() or committed.read_bytes() != path.read_bytes():
                stale.append(path.name)
        if stale:
            print("stale student notebooks (run `make release`): " + ", ".join(stale))
            return 1
    print("course/ is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
