"""Every documented command is run by a test, as written (issue #35).

**The documented pages** are the README and every page under ``docs/`` (:func:`pages`): the
students' page, the instructors' pages in the order of a term (publishing, the dry run,
grading, Formgrader, feedback and the LMS, grading at scale), the design, the reference and
the contributors' page.

**Their commands** are the code spans (`` `make grade` ``, a span wrapped over two lines too) and
the lines of their code blocks (fenced, or indented by four spaces) that begin with ``make ``;
whitespace runs count as one space and a trailing shell comment (``make grade  # ...``) is not
part of the command. So every ``make ...`` a reader can copy from a page is a command, and
nothing else is: a list of targets is written as separate spans (`` `make grade` ``,
`` `feedback` ``), never as one span that no shell could run. Each page is read on its own (a
fenced block never spans two).

**Running one**: a test calls :func:`run_readme_command` (or :func:`start_readme_command` for a
server), which first checks that a documented page holds the command verbatim, then runs it
exactly as written, by bash (the pages' blocks are bash) in the repository, as an instructor
types it. What the test needs to be different (a scratch course root, ``HOME``, JupyterLab
options) goes through environment variables, never into the command. The only parts a test may
replace are the :data:`PLACEHOLDERS`: another machine's address, a secret, a port or a folder
shared by every checkout of this machine; each replacement is named in the call. Each command
run is recorded in the folder ``$ATTENTION_LAB_README_COMMAND_LOG`` (one file per process, so
pytest-xdist workers all contribute; tests/conftest.py sets it for the session).

**The gate** (tests/conftest.py, beside the hint-coverage gate, judged as that one is: only when
the whole suite ran): a command that no test ran and that :data:`NOT_RUN` does not exempt, with
its reason, fails the run, and the summary names it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Mapping, Sequence

from autograder.places import REPO_ROOT

DOCS = REPO_ROOT / "docs"
LOG_ENV_VAR = "ATTENTION_LAB_README_COMMAND_LOG"


def pages() -> list[Path]:
    """The documented pages: the README, then docs/ (the instructors' pages in the order of a term)."""
    return [REPO_ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


# The parts of a documented command a test may replace, and why each cannot run as written here.
PLACEHOLDERS = {
    "scheduler-host:8786": "the scheduler machine's address: the test's scheduler, on this machine and a free port",
    "DASK_PORT=8786": "the scheduler's port: a free one (8786 may be taken, by another checkout's tests too)",
    "PGPORT=5432": "the database server's port: a free one (5432 is the machine's own PostgreSQL's)",
    "postgresql://grader@db-host:5432/attention_lab":
        "the URL `make postgres-server` prints: its host and port (its password is in ~/.pgpass)",
    "--port=8890": "Formgrader's port: a free one",
    "<a long random token>": "the token the test's requests carry",
    "../attention-lab-students": "a folder beside the clone, shared by every checkout on the machine: a scratch one",
}

# The documented commands that no test runs, each with the reason. Every other command
# is run by some test (the gate checks it); keep this short and honest.
NOT_RUN = {
    "make setup": "installs the virtual environment; every other command runs it first (each target depends on "
                  "`setup`), and alone it may reinstall the environment the suite runs in",
    "make test": "runs this suite",
    "make test-fast": "runs this suite's part that executes no whole notebook",
    "make browser": "installs chromium for the browser tests; `make test` runs it before every whole run",
    "make bench": "minutes of timing measurements, not a pass/fail check (benchmarks/)",
    "make gpu-check": "needs a CUDA GPU; the machines `make test` runs on have none",
    "make gpu-check GPU_PYTHON=python3": "needs a CUDA GPU and a python3 with a CUDA build of torch",
    "make floors": "downloads several GB of the oldest allowed versions into a second environment",
    "make release": "rewrites the committed course/ while other tests read it; `make release-check` runs the "
                    "same build, as written, and fails unless it equals course/ byte for byte",
}


def normalise(command: str) -> str:
    """One spelling of a command: whitespace runs as one space, no trailing ``# comment``."""
    return " ".join(re.sub(r"\s+#.*$", "", command.strip()).split())


def commands_in(part: str) -> list[str]:
    """The ``make`` commands of a page, each once, in order (see the module docstring)."""
    found = []
    fenced = re.compile(r"^```[^\n]*\n(.*?)^```", flags=re.MULTILINE | re.DOTALL)
    for block in fenced.findall(part):
        found += [line for line in block.splitlines() if line.strip().startswith("make ")]
    prose = fenced.sub("", part)
    found += [line for line in prose.splitlines() if line.startswith("    make ")]   # an indented block
    found += [span for span in re.findall(r"`([^`]+)`", prose) if re.match(r"make\s", span.strip())]
    return list(dict.fromkeys(normalise(command) for command in found))


def documented_text() -> list[str]:
    """The text of each documented page."""
    return [page.read_text(encoding="utf-8") for page in pages()]


def documented_commands() -> list[str]:
    """Every documented page's commands, each once, in the order of the pages."""
    return list(dict.fromkeys(command for text in documented_text() for command in commands_in(text)))


def _as_written(command: str, replace: Mapping[str, str]) -> str:
    """``command`` with the placeholders ``replace`` names filled in, after checking that the
    documented pages hold it verbatim and that only :data:`PLACEHOLDERS` change."""
    assert normalise(command) in documented_commands(), f"not a documented command: {command!r}"
    assert any(" ".join(command.split()) in " ".join(text.split()) for text in documented_text()), \
        f"not in the documented pages verbatim: {command!r}"
    for placeholder, value in replace.items():
        assert placeholder in PLACEHOLDERS, f"{placeholder!r} is not a placeholder a test may replace"
        assert placeholder in command, f"{placeholder!r} is not in {command!r}"
        command = command.replace(placeholder, value)
    return command


def record(command: str) -> None:
    """Note in the session's log that a test ran this documented command."""
    folder = os.environ.get(LOG_ENV_VAR)
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / f"commands-{os.getpid()}.jsonl", "a", encoding="utf-8") as log:
            log.write(json.dumps(normalise(command)) + "\n")


def run_readme_command(command: str, *, env: Mapping[str, str] | None = None, input: str | None = None,
                       timeout: float = 900, replace: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a documented command as written (bash, in the repository), with
    ``env`` as its whole environment (default: this process's); record it; return its result
    (stdout and stderr captured as text). ``replace``: placeholders to fill in (:data:`PLACEHOLDERS`)."""
    line = _as_written(command, replace or {})
    result = subprocess.run(line, shell=True, executable="/bin/bash", cwd=REPO_ROOT, env=env, input=input,
                            capture_output=True, text=True, timeout=timeout)
    record(command)
    return result


def start_readme_command(command: str, *, env: Mapping[str, str] | None = None,
                         replace: Mapping[str, str] | None = None, **popen) -> subprocess.Popen:
    """Start a documented command as written (a server: Formgrader, a Dask
    scheduler or worker) in a process group of its own; record it. ``popen``: stdout, stderr."""
    line = _as_written(command, replace or {})
    process = subprocess.Popen(line, shell=True, executable="/bin/bash", cwd=REPO_ROOT, env=env,
                               start_new_session=True, **popen)
    record(command)
    return process


def stop_process_group(process: subprocess.Popen, grace: float) -> None:
    """End a command started in a process group of its own (:func:`start_readme_command`): SIGTERM
    to the group, SIGKILL to it after ``grace`` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def read_log(folder: Path | str) -> set[str]:
    """The documented commands that tests recorded in ``folder`` (all processes)."""
    from tests.session_gates import read_records

    return set(read_records(folder, "commands-*.jsonl"))


def not_run(commands: Sequence[str], ran: set[str], exempt: Mapping[str, str] = NOT_RUN) -> list[str]:
    """The commands that no test ran and that ``exempt`` does not name."""
    return [command for command in commands if command not in ran and command not in exempt]


def report(missing: Sequence[str], ran: set[str], commands: Sequence[str], whole: bool, enforced: bool) -> list[str]:
    """The lines of the "README commands" section of the test summary."""
    done = sum(command in ran for command in commands)
    if not whole:
        return [f"README commands: not judged (only part of the suite ran); {done} of the {len(commands)} "
                "documented commands ran in this run."]
    if not missing:
        exempt = [command for command in commands if command in NOT_RUN]
        return [f"README commands: {done} of the {len(commands)} documented commands ran as written; "
                f"not run ({len(exempt)}): " + ", ".join(exempt)]
    verdict = "FAILED" if enforced else "(not enforced yet)"
    return [f"README commands {verdict}: {len(missing)} of the {len(commands)} documented commands ran in no "
            "test. Run each with tests.readme_commands.run_readme_command, or give the reason in NOT_RUN:"] + \
        [f"  {command}" for command in missing]
