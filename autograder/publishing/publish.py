"""The students' repository: what students may see, and nothing else (``make publish``).

    python -m autograder.publishing.publish --dest ../attention-lab-students --repository myuni/attention-lab-students [--branch main]

This repository holds ``solutions/`` (every answer and hidden test), the grading pipeline and
its tests: keep it **private**.  ``publish`` writes, into ``--dest`` (a new folder, an empty
one, or an earlier publication, e.g. a clone of the students' repository: its ``.git`` is
kept), only:

* ``course/``: the release -- the files of ``course/`` that git tracks, as they are in the working
  folder (a file git does not track, a zip left there say, is not published: the command names it)
  -- with each notebook's Colab link and setup cell pointing at the students' repository and
  ``--branch``, and the setup cell's nbgrader checksum computed anew, so that Validate trusts the
  notebook as released;
* ``lab/``: the student lab of this repository's ``make lab`` (Validate in a child process, the
  pre-save hook that keeps outputs out of course notebooks, no instructor tools);
* ``Makefile`` (``make lab``: a pinned ``.venv``, then that lab), ``pyproject.toml`` (the helper
  package, its dependencies, the ``lab`` and ``triton`` extras), ``constraints.txt`` (the tested
  versions), ``README.md`` for students, ``LICENSE``, ``.gitignore``.

Then it checks every file in ``--dest`` (:func:`secrets_in`): text only (no archive, no binary: a
file that cannot be read cannot be checked), no line of a hidden test, no line of a model solution
in an answer cell (or in another file, unless the helper package has it itself), no file of this
repository's private folders, and no link to this repository left.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from string import Template

import nbformat

import autograder.lab
from autograder.command_line import command_line
from autograder.places import COURSE_DIR, REPO_ROOT, SETUP_CELL_ID, SOLUTIONS_DIR
from autograder.publishing.release import (DEFAULT_BRANCH, HIDDEN_BEGIN, HIDDEN_END, assignment_names, colab_badge,
                                           colab_url, course_repository, helpers_version, setup_cell_source,
                                           write_notebook)

MARKER = ".published-by-attention-lab"
WRITTEN = ["course", "lab", "Makefile", "pyproject.toml", "constraints.txt", "README.md", "LICENSE", ".gitignore",
           MARKER]
PRIVATE = ["solutions", "autograder", "tests", "benchmarks"]
REPOSITORY = re.compile(r"^[\w.-]+/[\w.-]+$")
BRANCH = re.compile(r"^[\w.-]+(/[\w.-]+)*$")
SOLUTION_BEGIN, SOLUTION_END = "### BEGIN SOLUTION", "### END SOLUTION"
DISTINCTIVE = 20   # characters: shorter lines (``return x``) say nothing about a solution

# The students' own files, kept as files: the Makefile of `make lab` and the README's template.
STUDENT_FILES = Path(__file__).resolve().parent / "student_repository"
# The student lab (autograder/lab/: its modules, and student/, the Jupyter config folder `make lab`
# names) as the students' repository holds it: lab/.
LAB_DIR = Path(autograder.lab.__file__).resolve().parent
LAB_FILES = {"lab/course_notebooks.py": LAB_DIR / "course_notebooks.py", "lab/validate.py": LAB_DIR / "validate.py",
             "lab/student/jupyter_server_config.py": LAB_DIR / "student" / "jupyter_server_config.py",
             "lab/student/labconfig/page_config.json": LAB_DIR / "student" / "labconfig" / "page_config.json"}
LAB_INIT = '"""The student lab: `make lab` (JupyterLab on course/, with Validate and no instructor tools)."""\n'
# What the student lab needs beside the helpers, taken (with their ranges) from the `dev` extra.
STUDENT_LAB_TOOLS = ("jupyterlab", "nbgrader", "ipykernel")
GITIGNORE = ".venv/\n__pycache__/\n*.egg-info/\n.ipynb_checkpoints/\n.virtual_documents/\n"


def student_pyproject(repository: str) -> str:
    """The package's own pyproject.toml: its dependencies, the `lab` extra (the student lab's tools)
    and the `triton` extra, no tools of the instructors."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    quoted = json.dumps   # a JSON string is a TOML basic string
    dependencies = "".join(f"    {quoted(d)},\n" for d in project["dependencies"])
    extras = {name: values for name, values in project.get("optional-dependencies", {}).items() if name != "dev"}
    extras["lab"] = [tool for tool in project["optional-dependencies"]["dev"]
                     if re.match(r"[\w.-]+", tool).group() in STUDENT_LAB_TOOLS]
    optional = "".join(f"{name} = [{', '.join(quoted(v) for v in values)}]\n" for name, values in extras.items())
    return (f'[build-system]\nrequires = ["setuptools>=77"]\nbuild-backend = "setuptools.build_meta"\n\n'
            f'[project]\nname = "{project["name"]}"\nversion = "{helpers_version()}"\n'
            f'description = "{project["description"]}"\nreadme = "README.md"\n'
            f'requires-python = "{project["requires-python"]}"\nlicense = "{project["license"]}"\n'
            f"dependencies = [\n{dependencies}]\n\n[project.optional-dependencies]\n{optional}\n"
            f'[tool.setuptools]\npackage-dir = {{ "" = "course" }}\n\n'
            f'[tool.setuptools.packages.find]\nwhere = ["course"]\ninclude = ["attention_lab*"]\n\n'
            f'[tool.attention_lab]\nrepository = "{repository}"\n')


def release_files(course_dir: Path = COURSE_DIR) -> tuple[list[str], list[str]]:
    """The release, the files of ``course_dir`` that git tracks, and the files there that git neither
    tracks nor ignores (never published): paths relative to ``course_dir``."""
    def listed(*options: str) -> list[str]:
        result = subprocess.run(["git", "-C", str(course_dir), "ls-files", "-z", *options, "--", "."],
                                capture_output=True)
        if result.returncode != 0:
            raise SystemExit(f"{course_dir} is not in a git checkout ({result.stderr.decode().strip()}): make publish "
                             "publishes what git tracks in course/")
        return sorted(name for name in result.stdout.decode().split("\0") if name)

    tracked = listed()
    missing = [name for name in tracked if not (course_dir / name).is_file()]
    if missing:
        raise SystemExit(f"tracked by git but missing from course/: {', '.join(missing)} (run `make release`, "
                         "or `git checkout course/`)")
    return tracked, listed("--others", "--exclude-standard")


def retargeted(path: Path, private: str, repository: str, branch: str) -> nbformat.NotebookNode:
    """A released notebook with its Colab link and setup cell pointing at ``repository``'s ``branch``, and the
    setup cell's nbgrader checksum computed anew (nbgrader's Validate compares it with the cell's content)."""
    from nbgrader.utils import compute_checksum

    notebook = nbformat.read(path, as_version=4)
    assignment = path.stem
    title, setup = notebook.cells[0], notebook.cells[1]
    badge = colab_badge(private, assignment)
    if not title.source.endswith(badge) or setup.get("id") != SETUP_CELL_ID or setup.source != setup_cell_source(private):
        raise SystemExit(f"course/{path.name}: its Colab link or setup cell is not what `make release` writes now: "
                         "run `make release`, commit course/, then publish")
    title.source = title.source[:-len(badge)] + colab_badge(repository, assignment, branch)
    setup.source = setup_cell_source(repository, branch)
    setup.metadata.nbgrader["checksum"] = compute_checksum(setup)
    return notebook


def helpers_digest(course_dir: Path, tracked: list[str]) -> str:
    """A fingerprint of the helper package as released: what changes when any of its files does."""
    digest = hashlib.sha256()
    for name in tracked:
        if name.startswith("attention_lab/"):
            digest.update(name.encode() + b"\0" + (course_dir / name).read_bytes() + b"\0")
    return digest.hexdigest()


def earlier_publication(dest: Path) -> dict:
    """What the marker of an earlier publication in ``dest`` recorded (nothing for an older marker)."""
    try:
        return json.loads((dest / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def student_readme(notebooks: dict[str, nbformat.NotebookNode], repository: str, branch: str) -> str:
    """README.md for students: the notebooks in order (their titles), Colab and the local lab, studying alone."""
    lines = []
    for number, (assignment, notebook) in enumerate(notebooks.items(), start=1):
        title = notebook.cells[0].source.splitlines()[0].lstrip("# ").strip()
        lines.append(f"{number}. [{title}](course/{assignment}.ipynb) · "
                     f"[Open in Colab]({colab_url(repository, assignment, branch)})")
    template = Template((STUDENT_FILES / "README.md").read_text(encoding="utf-8"))
    return template.substitute(count=len(notebooks), notebooks="\n".join(lines), repository=repository, branch=branch)


def publish(dest: Path, repository: str, branch: str = DEFAULT_BRANCH, course_dir: Path = COURSE_DIR) -> list[str]:
    """Write the students' repository into ``dest``; the problems :func:`secrets_in` found (none)."""
    if not REPOSITORY.match(repository):
        raise SystemExit(f"REPO={repository!r}: expected the students' GitHub repository as owner/name")
    if not BRANCH.match(branch):
        raise SystemExit(f"BRANCH={branch!r}: expected a git branch name (main)")
    private = course_repository()
    if repository == private:
        raise SystemExit(f"REPO={repository} is this (private) repository: name the students' repository")
    dest = dest.resolve()
    if dest == REPO_ROOT or REPO_ROOT in dest.parents:
        raise SystemExit(f"{dest} is inside this repository: publish outside it (e.g. DEST=../attention-lab-students)")
    if dest.exists() and any(p.name != ".git" for p in dest.iterdir()) and not (dest / MARKER).exists():
        raise SystemExit(f"{dest} holds files that `make publish` did not write: name a new or empty folder, "
                         "or an earlier publication")
    tracked, untracked = release_files(course_dir)
    notebooks = {Path(name).stem: retargeted(course_dir / name, private, repository, branch)
                 for name in tracked if "/" not in name and name.endswith(".ipynb")}
    earlier = earlier_publication(dest)
    for name in WRITTEN:
        path = dest / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    dest.mkdir(parents=True, exist_ok=True)
    for name in tracked:
        target = dest / "course" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if Path(name).stem in notebooks and "/" not in name:
            write_notebook(notebooks[Path(name).stem], target)
        else:
            shutil.copyfile(course_dir / name, target)
    for name, source in LAB_FILES.items():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest / name)
    (dest / "lab" / "__init__.py").write_text(LAB_INIT, encoding="utf-8")
    shutil.copyfile(STUDENT_FILES / "Makefile", dest / "Makefile")
    shutil.copyfile(REPO_ROOT / "constraints.txt", dest / "constraints.txt")
    shutil.copyfile(REPO_ROOT / "LICENSE", dest / "LICENSE")
    (dest / ".gitignore").write_text(GITIGNORE, encoding="utf-8")
    (dest / "pyproject.toml").write_text(student_pyproject(repository), encoding="utf-8")
    (dest / "README.md").write_text(student_readme(notebooks, repository, branch), encoding="utf-8")
    version, digest = helpers_version(), helpers_digest(course_dir, tracked)
    (dest / MARKER).write_text(json.dumps({"repository": repository, "branch": branch, "helpers_version": version,
                                           "helpers_digest": digest}, indent=1) + "\n", encoding="utf-8")
    for name in untracked:
        print(f"not published: course/{name} (git does not track it; the release is what git tracks in course/)")
    if earlier.get("helpers_version") == version and earlier.get("helpers_digest") not in (None, digest):
        print(f"warning: the helpers (course/attention_lab) changed since the last publication, and their version is "
              f"still {version}: a Colab runtime that installed them keeps the old ones. Raise __version__ in "
              "course/attention_lab/version.py, run `make release`, commit course/, and publish again.")
    return secrets_in(dest, private, course_dir)


def secret_lines() -> tuple[set[str], set[str]]:
    """Distinctive lines of the model solutions and of the hidden tests in ``solutions/``."""
    solutions, hidden = set(), set()
    for path in sorted(SOLUTIONS_DIR.glob("[0-9][0-9]_*.py")):
        inside = None
        for line in path.read_text(encoding="utf-8").splitlines():
            stripped = line.strip()
            if stripped in (SOLUTION_BEGIN, HIDDEN_BEGIN):
                inside = solutions if stripped == SOLUTION_BEGIN else hidden
            elif stripped in (SOLUTION_END, HIDDEN_END):
                inside = None
            elif inside is not None and len(stripped) >= DISTINCTIVE and not stripped.startswith("#"):
                inside.add(stripped)
    return solutions, hidden


def as_text(data: bytes) -> str | None:
    """``data`` as UTF-8 text, or None for an archive or another binary (a NUL byte, or not UTF-8)."""
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def secrets_in(dest: Path, private: str, course_dir: Path = COURSE_DIR) -> list[str]:
    """What must not be in the students' repository and is, as sentences (none: empty): a file that is
    not text (an archive, a binary: it cannot be checked); a private folder; a line of a hidden test
    anywhere; a line of a model solution in an answer cell of a notebook, or in any other file unless
    the helper package has it itself (its checks and widgets are the students' anyway); a link to this
    repository."""
    problems = [f"{name} is there" for name in PRIVATE if (dest / name).exists()]
    solutions, hidden = secret_lines()
    package = "\n".join(p.read_text(encoding="utf-8") for p in sorted((course_dir / "attention_lab").rglob("*.py")))
    for path in sorted(p for p in dest.rglob("*") if p.is_file() and ".git" not in p.relative_to(dest).parts):
        name = path.relative_to(dest)
        text = as_text(path.read_bytes())
        if text is None:
            problems.append(f"{name} is not a text file (an archive or another binary): the students' repository "
                            "holds the release's text files, each one checked; remove it")
            continue
        if path.suffix == ".ipynb":
            cells = nbformat.reads(text, as_version=4).cells
            answers = "\n".join(c.source for c in cells if c.metadata.get("nbgrader", {}).get("solution"))
            found = sorted(line for line in solutions if line in answers)
            found += sorted(line for line in hidden if any(line in c.source for c in cells))
        else:
            found = sorted(line for line in solutions | hidden if line in text and line not in package)
        if found:
            problems.append(f"{name} holds solution or hidden-test code: {found[0]!r}")
        if private in text:
            problems.append(f"{name} still points at this repository ({private})")
    notebooks = sorted(p.stem for p in (dest / "course").glob("*.ipynb"))
    if notebooks != assignment_names():
        problems.append(f"course/ holds {notebooks}, not the course's notebooks {assignment_names()} (git tracks the "
                        "release: commit course/ after `make release`)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__)
    parser.add_argument("--dest", type=Path, required=True, help="the students' repository (a folder outside this one)")
    parser.add_argument("--repository", required=True, help="its GitHub name, owner/name")
    parser.add_argument("--branch", default=DEFAULT_BRANCH,
                        help=f"the branch students' Colab links open and notebooks install from (default {DEFAULT_BRANCH})")
    options = parser.parse_args(argv)
    problems = publish(options.dest, options.repository, options.branch)
    if problems:
        print("NOT PUBLISHABLE, fix before pushing:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return 1
    print(f"published the students' repository in {options.dest} (course/, lab/, Makefile, pyproject.toml, "
          f"constraints.txt, README.md, LICENSE; links to the branch {options.branch} of {options.repository}); "
          f"checked every file: text only, no solution, no hidden test. Push it to the branch {options.branch} of "
          f"github.com/{options.repository}; keep this repository private")
    return 0


if __name__ == "__main__":
    sys.exit(main())
