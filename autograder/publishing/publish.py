"""The students' repository: what students may see, and nothing else (``make publish``).

    python -m autograder.publishing.publish --dest ../attention-lab-students --repository myuni/attention-lab-students

This repository holds ``solutions/`` (every answer and hidden test), the grading pipeline and
its tests: keep it **private**.  ``publish`` writes, into ``--dest`` (a new folder, an empty
one, or an earlier publication, e.g. a clone of the students' repository: its ``.git`` is
kept), only:

* ``course/``: the student notebooks as ``make release`` built them, their Colab link and
  setup cell (``pip install attention-lab @ git+https://github.com/<repository>``) pointing at
  the students' repository, the helper package ``attention_lab`` and the Validate config;
* ``pyproject.toml``: the package and its dependencies (what that ``pip install`` reads);
* ``README.md`` for students.

Then it checks the result (:func:`secrets_in`): no line of a hidden test, no line of a model
solution in an answer cell (or in another file, unless the helper package has it itself), no
file of this repository's private folders, and no link to this repository left.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tomllib
from pathlib import Path

from autograder.command_line import command_line
from autograder.publishing.release import HIDDEN_BEGIN, HIDDEN_END, assignment_names, course_repository
from autograder.places import COURSE_DIR, REPO_ROOT, SOLUTIONS_DIR

MARKER = ".published-by-attention-lab"
WRITTEN = ["course", "pyproject.toml", "README.md", MARKER]
PRIVATE = ["solutions", "autograder", "tests", "benchmarks", "Makefile"]
REPOSITORY = re.compile(r"^[\w.-]+/[\w.-]+$")
SOLUTION_BEGIN, SOLUTION_END = "### BEGIN SOLUTION", "### END SOLUTION"
DISTINCTIVE = 20   # characters: shorter lines (``return x``) say nothing about a solution

STUDENT_README = """# Attention Lab

An interactive course on how attention works: six Jupyter notebooks with exercises that check
themselves as you go.

## On Colab

Open a notebook from `course/` and click **Open this notebook in Colab** at its top (or open
`https://colab.research.google.com/github/{repository}/blob/main/course/01_mha_shapes.ipynb`).
Its first cell installs the course's helper package; a GPU runtime is optional.

## On your computer

```bash
python3 -m venv .venv
.venv/bin/pip install -e . jupyterlab nbgrader
cd course && ../.venv/bin/jupyter lab
```

Run each notebook from the top. Each exercise stops at `raise NotImplementedError(...)`:
replace it with your code and run the test cell below it, which tells you what is wrong.

## Handing in

Upload each notebook as it is (`01_mha_shapes.ipynb`; on Colab *File -> Download -> Download
.ipynb*) to the assignment of the same name in the course's LMS. Your work is graded with
further tests than those you see.
"""


def student_pyproject(repository: str) -> str:
    """The package's own pyproject.toml: its dependencies, no tools of the instructors."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    quoted = json.dumps   # a JSON string is a TOML basic string
    dependencies = "".join(f"    {quoted(d)},\n" for d in project["dependencies"])
    extras = {name: values for name, values in project.get("optional-dependencies", {}).items() if name != "dev"}
    optional = "".join(f"{name} = [{', '.join(quoted(v) for v in values)}]\n" for name, values in extras.items())
    return (f'[build-system]\nrequires = ["setuptools>=77"]\nbuild-backend = "setuptools.build_meta"\n\n'
            f'[project]\nname = "{project["name"]}"\nversion = "{project["version"]}"\n'
            f'description = "{project["description"]}"\nreadme = "README.md"\n'
            f'requires-python = "{project["requires-python"]}"\nlicense = "{project["license"]}"\n'
            f"dependencies = [\n{dependencies}]\n\n[project.optional-dependencies]\n{optional}\n"
            f'[tool.setuptools]\npackage-dir = {{ "" = "course" }}\n\n'
            f'[tool.setuptools.packages.find]\nwhere = ["course"]\ninclude = ["attention_lab*"]\n\n'
            f'[tool.attention_lab]\nrepository = "{repository}"\n')


def publish(dest: Path, repository: str) -> list[str]:
    """Write the students' repository into ``dest``; the problems :func:`secrets_in` found (none)."""
    if not REPOSITORY.match(repository):
        raise SystemExit(f"REPO={repository!r}: expected the students' GitHub repository as owner/name")
    private = course_repository()
    if repository == private:
        raise SystemExit(f"REPO={repository} is this (private) repository: name the students' repository")
    dest = dest.resolve()
    if dest == REPO_ROOT or REPO_ROOT in dest.parents:
        raise SystemExit(f"{dest} is inside this repository: publish outside it (e.g. DEST=../attention-lab-students)")
    if dest.exists() and any(p.name != ".git" for p in dest.iterdir()) and not (dest / MARKER).exists():
        raise SystemExit(f"{dest} holds files that `make publish` did not write: name a new or empty folder, "
                         "or an earlier publication")
    for name in WRITTEN:
        path = dest / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(COURSE_DIR, dest / "course", ignore=shutil.ignore_patterns("__pycache__", "*.pyc",
                                                                              ".ipynb_checkpoints"))
    for notebook in sorted((dest / "course").glob("*.ipynb")):
        text = notebook.read_text(encoding="utf-8")
        notebook.write_text(text.replace(f"github/{private}/blob/", f"github/{repository}/blob/")
                            .replace(f'COURSE_REPOSITORY = \\"{private}\\"', f'COURSE_REPOSITORY = \\"{repository}\\"'),
                            encoding="utf-8")
    (dest / "pyproject.toml").write_text(student_pyproject(repository), encoding="utf-8")
    (dest / "README.md").write_text(STUDENT_README.format(repository=repository), encoding="utf-8")
    (dest / MARKER).write_text(f"published for {repository}; rewritten by each `make publish`\n", encoding="utf-8")
    return secrets_in(dest, private)


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


def secrets_in(dest: Path, private: str) -> list[str]:
    """What must not be in the students' repository and is, as sentences (none: empty): a
    private folder; a line of a hidden test anywhere; a line of a model solution in an answer
    cell of a notebook, or in any other file unless the helper package has it itself (its
    checks and widgets are the students' anyway); a link to this repository."""
    import nbformat

    problems = [f"{name} is there" for name in PRIVATE if (dest / name).exists()]
    solutions, hidden = secret_lines()
    package = "\n".join(p.read_text(encoding="utf-8") for p in sorted((COURSE_DIR / "attention_lab").rglob("*.py")))
    for path in sorted(p for p in dest.rglob("*") if p.is_file() and ".git" not in p.relative_to(dest).parts):
        text = path.read_text(encoding="utf-8", errors="replace")
        name = path.relative_to(dest)
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
        problems.append(f"course/ holds {notebooks}, not the course's notebooks {assignment_names()}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__)
    parser.add_argument("--dest", type=Path, required=True, help="the students' repository (a folder outside this one)")
    parser.add_argument("--repository", required=True, help="its GitHub name, owner/name")
    options = parser.parse_args(argv)
    problems = publish(options.dest, options.repository)
    if problems:
        print("NOT PUBLISHABLE, fix before pushing:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return 1
    print(f"published the students' repository in {options.dest} (course/, pyproject.toml, README.md; links to "
          f"{options.repository}); checked: no solution, no hidden test. Push it to github.com/{options.repository}; "
          "keep this repository private")
    return 0


if __name__ == "__main__":
    sys.exit(main())
