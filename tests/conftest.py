"""Shared fixtures: one fresh build of every notebook (source and student release) per test
session, whatever the number of workers; and the session's gates (tests/session_gates.py): hint
coverage (tests/hint_coverage.py) and the documented commands (tests/readme_commands.py)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")
# Every process the suite starts (notebook kernels, JupyterLab servers and their kernels, `make`
# commands) computes on one OpenMP thread, as grading kernels do: `make test` runs three workers
# on two cores, where a kernel's second thread mostly waits for a core (notebook 01's cells took
# 8.3 s with two threads beside one busy process, 6.3 s with one).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402 -- after OMP_NUM_THREADS

from attention_lab.checking import HINT_LOG_ENV_VAR  # noqa: E402
from autograder.publishing import release  # noqa: E402

from tests import hint_coverage, readme_commands, session_gates  # noqa: E402
from tests.bridge_harness import calls_the_checks  # noqa: E402

# Each test process computes on one thread, as each grading kernel and the trusted checker do:
# `make test` runs three xdist workers on two cores, where a torch operation that waits for a
# descheduled OpenMP thread costs many times its work (torch.equal of 64 KiB, which every
# crossing of the bridge does: 4.5 ms with two threads on a busy machine, 0.12 ms with one).
torch.set_num_threads(1)

# Fail a whole-suite run when some hint in the package is never triggered by a test
# (every hint is, today: a new hint comes with the test that reaches it).
HINT_COVERAGE_ENFORCED = True
# Fail a whole-suite run when a documented command (the README, docs/) is run by no test and
# not exempted, with its reason, in readme_commands.NOT_RUN.
README_COMMANDS_ENFORCED = True

REPO_ROOT = release.REPO_ROOT
ASSIGNMENTS = release.assignment_names()

# The browser fixtures live here, once: a session fixture imported into several test modules
# would start one Playwright per module in the same worker, which Playwright refuses.
# Imported after REPO_ROOT, which lab_servers reads.
from tests.lab_servers import browser, chromium_unavailable_reason, screenshots  # noqa: E402,F401 -- fixtures


@dataclass(frozen=True)
class Build:
    """Where a fresh build put the instructor (source) and student (release) notebooks."""

    course_dir: Path
    autograder_dir: Path

    def source(self, assignment: str) -> Path:
        return self.autograder_dir / "source" / assignment / f"{assignment}.ipynb"

    def release(self, assignment: str) -> Path:
        return self.course_dir / f"{assignment}.ipynb"


@pytest.fixture(scope="session")
def fresh_build(tmp_path_factory) -> Build:
    """Every notebook built from solutions/ once per session: under pytest-xdist the first
    worker to need it builds it (nbgrader, 20 s), the others wait and copy it; each worker
    works on its own copy."""
    root = tmp_path_factory.mktemp("build")
    build = Build(course_dir=root / "course", autograder_dir=root / "autograder")
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # one process (pytest-xdist sets it in each worker)
        release.build(ASSIGNMENTS, build.course_dir, build.autograder_dir)
        return build
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / "fresh-build"  # this session's, common to its workers
    with FileLock(f"{shared}.lock"):
        if not (shared / "built").exists():
            shutil.rmtree(shared, ignore_errors=True)
            release.build(ASSIGNMENTS, shared / "course", shared / "autograder")
            (shared / "built").touch()
    shutil.copytree(shared / "course", build.course_dir)
    shutil.copytree(shared / "autograder", build.autograder_dir)
    return build


@pytest.fixture(scope="session")
def forked_kernels(tmp_path_factory):
    """Kernels forked from one sandboxed kernel server per test process, as grading runs them
    (see autograder.grading.execute.ForkedKernels); None (fresh kernels) where bubblewrap is missing."""
    from autograder.isolation import sandbox
    from autograder.grading.execute import ForkedKernels

    if sandbox.bwrap_path() is None:
        yield None
        return
    kernels = ForkedKernels(tmp_path_factory.mktemp("forked-kernels"))
    try:
        yield kernels
    finally:
        kernels.close()


# --------------------------------------------------------------------------------------
# The gates: judged by the process that runs the session, at its end (tests/session_gates.py)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gate:
    """A check of the whole session: a log folder in ``env_var`` for the tests (and every process
    they start) to record into, and ``judge(config, folder)``: (summary lines, fail the run)."""

    title: str
    env_var: str
    judge: Callable[[pytest.Config, str], tuple[list[str], bool]]


def _judge_hint_coverage(config: pytest.Config, folder: str) -> tuple[list[str], bool]:
    """Every hint in the package appears in some test's failure message."""
    hints = hint_coverage.package_hints()
    missing = hint_coverage.untriggered(hints, hint_coverage.read_messages(folder))
    whole = hint_coverage.whole_suite_ran(config.option, config.args)
    why_not_judged = hint_coverage.PART_OF_THE_SUITE
    if whole and torch.cuda.is_available():
        # the tests that need Triton's interpreter (its load watch) skip on a GPU: the hints only they reach cannot appear
        whole, why_not_judged = False, "a CUDA GPU is here: the tests that need Triton's interpreter were skipped"
    lines = hint_coverage.report(missing, len(hints), whole, HINT_COVERAGE_ENFORCED,
                                 hint_coverage.modules_under_test(config.args), why_not_judged)
    return lines, HINT_COVERAGE_ENFORCED and whole and bool(missing)


def _judge_readme_commands(config: pytest.Config, folder: str) -> tuple[list[str], bool]:
    """Every documented command (the README, docs/) is run by some test, or exempted."""
    commands = readme_commands.documented_commands()
    ran = readme_commands.read_log(folder)
    missing = readme_commands.not_run(commands, ran)
    whole = session_gates.whole_run(config.option, config.args, session_gates.TESTS_DIR.glob("test_*.py"))
    lines = readme_commands.report(missing, ran, commands, whole, README_COMMANDS_ENFORCED)
    return lines, README_COMMANDS_ENFORCED and whole and bool(missing)


GATES = (Gate("hint coverage", HINT_LOG_ENV_VAR, _judge_hint_coverage),
         Gate("README commands", readme_commands.LOG_ENV_VAR, _judge_readme_commands))


def _is_controller(config: pytest.Config) -> bool:
    """The process that runs the session (not a pytest-xdist worker)."""
    return not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    # Workers, kernels and commands inherit these variables and log into the same folders.
    if _is_controller(config):
        config.stash[_GATE_LOGS] = {}
        for gate in GATES:
            folder = tempfile.mkdtemp(prefix=f"attention-lab-{gate.env_var.lower()}-")
            config.stash[_GATE_LOGS][gate.title] = folder
            os.environ[gate.env_var] = folder


def _test_of(item: pytest.Item) -> tuple[str, str]:
    return item.module.__name__, getattr(item, "originalname", item.name)


# A solution notebook runs top to bottom in a fresh kernel (tests/test_notebooks.py) unless this
# session runs it in JupyterLab, which asserts the same and more (tests/test_browser.py).
SOLUTION_IN_A_KERNEL = ("tests.test_notebooks", "test_solution_notebook_runs_top_to_bottom_and_passes_every_test")
SOLUTION_IN_THE_LAB = ("tests.test_browser", "test_each_notebook_runs_in_the_lab_with_usable_widgets_and_closes_clean")
# What a course cell must never show a student: warnings, and autograd internals in a printout.
NOISE = re.compile(r"\b\w*Warning\b|grad_fn=<")


@pytest.hookimpl(trylast=True)  # after -k and -m: only what this session really runs counts
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The same run is not made twice in one session, and the longest tests start first.

    Not made twice:

    * a check test runs a second time through the bridge (tests/bridge_harness.run_both_ways) only
      where it calls a check: the grading run of a test that calls none (a widget drawn, a property
      of the notebook's maths) would run the same code again;
    * a solution notebook that this session runs in JupyterLab (Chromium present) is not run
      again in a fresh kernel: the lab's run asserts what that one does (every cell runs, every
      test passes, hidden ones included, no warning or autograd noise in an output) and more.

    Started first: the slow tests. pytest-xdist hands out its groups of several tests first, then
    the others (a group of one test among them) in this order, and the last test a worker starts
    decides when the run ends: the sandbox's 35-second limits test, collected among the last, left
    one of the two cores idle for 20 s at the end of `make test`. Grouped slow tests move too: the
    dry run's one-test group (60 s), left behind the quick tests, started at 446 s of a 506-s run."""
    in_the_lab = set()
    if chromium_unavailable_reason() is None:
        in_the_lab = {item.callspec.params["assignment"] for item in items if _test_of(item) == SOLUTION_IN_THE_LAB}
    again = [item for item in items if getattr(item, "callspec", None) is not None
             and ((item.callspec.params.get("where_checks_run") == "grading"
                   and not calls_the_checks(item.function, item.module, item.fixturenames))
                  or (_test_of(item) == SOLUTION_IN_A_KERNEL and item.callspec.params["assignment"] in in_the_lab))]
    if again:
        config.hook.pytest_deselected(items=again)
        dropped = set(map(id, again))
        items[:] = [item for item in items if id(item) not in dropped]
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if not _is_controller(config) or _GATE_LOGS not in config.stash:
        return
    config.stash[_GATE_REPORTS] = {}
    for gate in GATES:
        folder = config.stash[_GATE_LOGS].get(gate.title)
        if folder is None:
            continue
        lines, failed = gate.judge(config, folder)
        config.stash[_GATE_REPORTS][gate.title] = lines
        if failed and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    for title, lines in config.stash.get(_GATE_REPORTS, {}).items():
        if lines:
            terminalreporter.write_sep("-", title)
            for line in lines:
                terminalreporter.write_line(line)


def pytest_unconfigure(config: pytest.Config) -> None:
    for gate in GATES:
        folder = config.stash.get(_GATE_LOGS, {}).get(gate.title)
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
            if os.environ.get(gate.env_var) == folder:
                del os.environ[gate.env_var]


_GATE_LOGS = pytest.StashKey[dict]()      # gate title -> its log folder
_GATE_REPORTS = pytest.StashKey[dict]()   # gate title -> its summary lines
