"""Does the course work on the oldest versions pyproject.toml says it supports?

    python -m benchmarks.floors constraints   # the floors, as a pip constraints file
    python -m benchmarks.floors run           # inside the floors venv: notebooks + check tests

`make floors` ties the two together: it creates `.venv-floors-<X.Y>/` for `FLOORS_PYTHON`
(by default the interpreter `.venv` is made with; `FLOORS_PYTHON=python3.10` tries the
oldest Python too), installs the course there with every runtime dependency at the lower
bound of its range in pyproject.toml (`numpy>=1.24` installs numpy 1.24.0) and the notebook
and test tools as pip resolves them beside those, then runs `run` in it. `run` executes
every solution notebook in a fresh kernel and every `tests/test_checks_*.py`, and reports
per notebook and per test file. A notebook fails the floors when a cell raises, when a check
fails, when a cell prints to stderr (warnings: no course cell may print one), or when a
figure comes out as its text form (`<Figure size 640x480 with 1 Axes>`) instead of a
picture.

It lives beside the benchmarks because, like them, it measures the course on an environment
rather than testing the code, and is far too slow (a multi-GB install) for `make test`.
Results go to benchmarks/results/floors-py<X.Y>.json (one per Python tried).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
LOWER_BOUND = re.compile(r"^(?P<name>[A-Za-z0-9._-]+)\s*>=\s*(?P<version>[0-9][0-9.]*)\s*(?:;.*)?$")
FIGURE_AS_TEXT = re.compile(r"^<Figure size [^>]* with \d+ Axes>$")
# What the report names in its header: the floors, plus what decides how figures are shown.
REPORTED = ("torch", "numpy", "matplotlib", "ipywidgets", "scikit-learn", "einops", "tqdm",
            "ipython", "ipykernel", "matplotlib-inline")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def floor_pins(requirements: list[str]) -> dict[str, str]:
    """``["numpy>=1.24", ...]`` -> ``{"numpy": "1.24"}``; every runtime dependency needs a floor."""
    pins = {}
    for requirement in requirements:
        match = LOWER_BOUND.match(requirement.strip())
        if match is None:
            raise ValueError(f"{requirement!r} has no plain lower bound (name>=version): no floor to test")
        pins[_normalise(match["name"])] = match["version"]
    return pins


def floors_constraints(pyproject_text: str) -> str:
    """The runtime dependencies at their floors, as ``name==version`` lines.

    The tools (nbclient, ipykernel, pytest, ...) are left free: pip picks the newest that
    installs beside the floors on this interpreter (on the interpreter .venv uses, that is
    what constraints.txt pins; older Pythons get the newest release that supports them).
    """
    floors = floor_pins(tomllib.loads(pyproject_text)["project"]["dependencies"])
    return "".join(f"{name}=={version}\n" for name, version in floors.items())


@dataclass
class NotebookOutcome:
    assignment: str
    seconds: float
    passed_tests: int
    problems: list[str] = field(default_factory=list)


@dataclass
class TestFileOutcome:
    path: str
    seconds: float
    returncode: int
    summary: str


def notebook_problems(notebook) -> list[str]:
    """What a student would see go wrong: errors, failed checks, stderr, figures shown as text."""
    problems = []
    for number, cell in enumerate(notebook.cells, start=1):
        if cell.cell_type != "code":
            continue
        where = cell.metadata.get("nbgrader", {}).get("grade_id") or f"cell {number}"
        for output in cell.get("outputs", []):
            if output.output_type == "error":
                problems.append(f"{where}: {output.ename}: {output.evalue.splitlines()[0] if output.evalue else ''}")
            elif output.output_type == "stream" and output.name == "stderr" and output.text.strip():
                problems.append(f"{where}: printed to stderr: {output.text.strip().splitlines()[0][:120]}")
            elif output.output_type in ("display_data", "execute_result"):
                text = output.get("data", {}).get("text/plain", "")
                if FIGURE_AS_TEXT.match(text.strip()) and "image/png" not in output.get("data", {}):
                    problems.append(f"{where}: a figure came out as text: {text.strip()}")
    return problems


def run_notebooks(assignments: list[str]) -> list[NotebookOutcome]:
    from autograder.grading.execute import execute_notebook
    from autograder.publishing import release

    os.environ.pop("MPLBACKEND", None)  # kernels pick their backend as a student's would
    outcomes = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        release.build(assignments, root / "course", root / "autograder")
        for assignment in assignments:  # one at a time: each kernel gets the whole machine
            result = execute_notebook(root / "autograder" / "source" / assignment / f"{assignment}.ipynb")
            outcome = NotebookOutcome(assignment, round(result.seconds, 1), len(result.passed_tests),
                                      notebook_problems(result.notebook))
            outcome.problems += [f"{name}: check failed" for name in result.failed_tests
                                 if not any(problem.startswith(f"{name}:") for problem in outcome.problems)]
            print(f"  {assignment:<28} {'ok' if not outcome.problems else 'FAIL':<4} {outcome.seconds:6.1f} s"
                  f"   {outcome.passed_tests} tests passed", flush=True)
            for problem in outcome.problems:
                print(f"      {problem}", flush=True)
            outcomes.append(outcome)
    return outcomes


def run_check_tests(paths: list[Path]) -> list[TestFileOutcome]:
    outcomes = []
    for path in paths:
        start = time.perf_counter()
        completed = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path.relative_to(REPO_ROOT))],
            cwd=REPO_ROOT, capture_output=True, text=True,
        )
        lines = completed.stdout.strip().splitlines()
        outcome = TestFileOutcome(str(path.relative_to(REPO_ROOT)), round(time.perf_counter() - start, 1),
                                  completed.returncode, lines[-1] if lines else completed.stderr.strip()[-200:])
        print(f"  {outcome.path:<44} {'ok' if outcome.returncode == 0 else 'FAIL':<4} {outcome.seconds:6.1f} s"
              f"   {outcome.summary}", flush=True)
        if completed.returncode != 0:  # the failing tests' names and their one-line reasons
            for line in lines:
                if line.startswith(("FAILED", "ERROR")):
                    print(f"      {line[:220]}", flush=True)
        outcomes.append(outcome)
    return outcomes


def installed_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in REPORTED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def run(assignments: list[str], test_paths: list[Path]) -> int:
    versions = installed_versions()
    print("Floors: " + ", ".join(f"{name} {version}" for name, version in versions.items()), flush=True)
    print("Solution notebooks (fresh kernel each):", flush=True)
    notebooks = run_notebooks(assignments)
    print("Check tests:", flush=True)
    tests = run_check_tests(test_paths)
    failed = [n.assignment for n in notebooks if n.problems] + [t.path for t in tests if t.returncode != 0]
    print(f"Floors {'hold' if not failed else 'BROKEN'}: {len(notebooks)} notebooks, {len(tests)} test files"
          + (f"; failing: {', '.join(failed)}" if failed else ""), flush=True)
    RESULTS_DIR.mkdir(exist_ok=True)
    report = {"versions": versions, "notebooks": [asdict(n) for n in notebooks],
              "check_tests": [asdict(t) for t in tests], "failing": failed}
    python = ".".join(platform.python_version_tuple()[:2])
    (RESULTS_DIR / f"floors-py{python}.json").write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("constraints", help="print the floors as a pip constraints file")
    runner = commands.add_parser("run", help="run the notebooks and check tests on what is installed")
    runner.add_argument("assignments", nargs="*", help="default: every notebook")
    options = parser.parse_args(argv)
    if options.command == "constraints":
        sys.stdout.write(floors_constraints((REPO_ROOT / "pyproject.toml").read_text()))
        return 0
    from autograder.publishing import release

    assignments = options.assignments or release.assignment_names()
    return run(assignments, sorted((REPO_ROOT / "tests").glob("test_checks_*.py")))


if __name__ == "__main__":
    raise SystemExit(main())
