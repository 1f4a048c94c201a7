"""Autograde every submission, students in parallel, with nbgrader as the engine.

    python -m autograder.grade                 # grade new or changed submissions (make grade)
    python -m autograder.grade --jobs 4        # four students at a time (make grade JOBS=4)
    python -m autograder.grade --force         # regrade everything
    python -m autograder.grade --student "Ana Núñez" --assignment 01_mha_shapes

Layout, in the course root ``autograder/course_root/``: ``submitted/<student>/<assignment>/
<notebook>.ipynb`` (``make intake`` puts them there); ``source/<assignment>/`` (built here
from ``solutions/`` by :func:`ensure_sources`, with the release builder's own function).

How one run works
-----------------
1. The gradebook (``gradebook.db``; grading is its only writer) gets every assignment that
   has submissions (``nbgrader generate_assignment``), then a snapshot of it is taken.
2. Each submission whose fingerprint (its files, the source notebook, the grading settings)
   changed since it was last graded is autograded by ``nbgrader autograde`` in its **own
   temporary course root** (the source, that student's files and a copy of the snapshot),
   so that no two students share a folder or a database.  ``--jobs`` students are graded at
   a time, each job by its own long-lived nbgrader process (an :class:`Engine`, see
   :mod:`autograder.worker`), which grades its students one after another: Python and
   nbgrader start once per job, not once per student.  Every notebook gets a new kernel.
3. As each finishes, **this process alone** copies its grades and comments into the main
   gradebook and its autograded notebook into ``autograded/``: one writer, so
   the gradebook stays consistent.
4. A kernel that dies (``sys.exit`` is fine, ``os._exit``/segfault is not) or hangs past
   its timeout without answering the interrupt within the grace time is restarted, with that cell skipped (it
   earns nothing, the others earn what they earn); after ``--attempts`` tries, or when a
   whole attempt runs past ``--notebook-timeout``, the submission is reported as failed,
   never silently scored.
5. ``reports/grading_report.{md,json}`` says what happened to each submission; its notes
   column flags tampering, and a kernel that could not start is reported with its cause.

Time limits: a cell's limit counts from that cell's start; starting the kernel and the
generated setup cell (imports) share a start-up budget of their own; an interrupted kernel
gets a grace time that grows with the cell limit.  So a loaded machine makes grading
slower, never wrong: a slow but working cell is not mistaken for a hung one.

Student kernels run under the limits and the sandbox of :mod:`autograder.sandbox`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import json
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from autograder import gradebook, release, results, sandbox
from autograder.nbgrader_cli import nbgrader_environment, run_nbgrader
from autograder.settings import (AUTOGRADER_DIR, CELL_TIMEOUT, COURSE_ROOT, KERNEL_STARTUP_TIMEOUT,
                                 MAX_OUTPUT_BYTES, REPO_ROOT, UNRESPONSIVE_GRACE)

STATE_DIR = ".grading"
REPORTS_DIR = "reports"
IGNORED_NAMES = {".ipynb_checkpoints", "__MACOSX", ".DS_Store", "timestamp.txt"}


@dataclass
class Settings:
    timeout: int = CELL_TIMEOUT                            # seconds per cell, from the cell's start
    startup_timeout: int = KERNEL_STARTUP_TIMEOUT          # seconds to start a kernel and run its setup cell
    notebook_timeout: int = 1800                           # seconds per attempt at a whole submission
    memory_mb: int = 4096                                  # address-space limit of a student kernel
    file_mb: int = 256                                     # largest file a student kernel may write
    max_output_bytes: int = MAX_OUTPUT_BYTES               # output kept per cell
    attempts: int = 6                                      # restarts after a kernel died or hung
    unresponsive_grace: int = UNRESPONSIVE_GRACE           # least seconds an interrupted kernel has to answer
    sandbox: str = "auto"                                  # auto | on | off
    threads: int = 1                                       # torch/BLAS threads per kernel

    @property
    def grace(self) -> int:
        """Seconds an interrupted kernel has to answer: a quarter of the cell limit, at least
        ``unresponsive_grace`` (a loaded machine slows the answer as much as the cell)."""
        return max(self.unresponsive_grace, self.timeout // 4)

    def fingerprint(self) -> str:
        values = dataclasses.asdict(self)
        for name in ("notebook_timeout", "startup_timeout", "threads", "unresponsive_grace", "attempts"):
            values.pop(name)
        return json.dumps(values, sort_keys=True)


@dataclass
class Submission:
    student: str
    assignment: str
    folder: Path

    @property
    def key(self) -> str:
        return f"{self.student}/{self.assignment}"


@dataclass
class Outcome:
    student: str
    assignment: str
    status: str                          # graded | unchanged | failed
    seconds: float = 0.0
    attempts: int = 0
    score: float | None = None
    max_score: float | None = None
    tests: list[dict] = field(default_factory=list)
    incidents: list[dict] = field(default_factory=list)
    error: str = ""
    fingerprint: str = ""
    course_root: str = ""                # the temporary course root (merged, then removed)

    def as_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.pop("course_root")
        data.pop("fingerprint")
        return data


# --------------------------------------------------------------------------------------
# Discovery, fingerprints, state
# --------------------------------------------------------------------------------------

def assignments_with_source(root: Path) -> list[str]:
    source = root / "source"
    return sorted(p.name for p in source.iterdir() if p.is_dir() and any(p.glob("*.ipynb"))) if source.is_dir() else []


def notebook_names(root: Path, assignment: str) -> list[str]:
    return sorted(p.stem for p in (root / "source" / assignment).glob("*.ipynb"))


def discover(root: Path, students: list[str] | None = None,
             assignments: list[str] | None = None) -> tuple[list[Submission], list[str]]:
    """Every ``submitted/<student>/<assignment>/`` holding a notebook; problems as text."""
    submissions, problems = [], []
    known = set(assignments_with_source(root))
    submitted = root / "submitted"
    if not submitted.is_dir():
        return [], [f"no submissions folder {submitted}"]
    for student_dir in sorted(submitted.iterdir()):
        if not student_dir.is_dir() or student_dir.name.startswith("."):
            continue
        if students and student_dir.name not in students:
            continue
        for folder in sorted(student_dir.iterdir()):
            if not folder.is_dir() or folder.name.startswith("."):
                continue
            if assignments and folder.name not in assignments:
                continue
            if folder.name not in known:
                problems.append(f"{student_dir.name}/{folder.name}: no such assignment in {root / 'source'}; skipped")
                continue
            if not any(folder.glob("*.ipynb")):
                problems.append(f"{student_dir.name}/{folder.name}: no notebook in the folder; skipped")
                continue
            submissions.append(Submission(student_dir.name, folder.name, folder))
    return submissions, problems


def _hash_tree(digest, folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not (set(path.relative_to(folder).parts) & IGNORED_NAMES):
            digest.update(str(path.relative_to(folder)).encode() + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())


def fingerprint(submission: Submission, root: Path, settings: Settings) -> str:
    digest = hashlib.sha256()
    _hash_tree(digest, submission.folder)
    _hash_tree(digest, root / "source" / submission.assignment)
    digest.update(settings.fingerprint().encode())
    return digest.hexdigest()


def load_state(root: Path) -> dict:
    path = root / STATE_DIR / "state.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def save_state(root: Path, state: dict) -> None:
    path = root / STATE_DIR / "state.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(".tmp")
    scratch.write_text(json.dumps(state, indent=1, sort_keys=True, ensure_ascii=False))
    scratch.replace(path)


@contextlib.contextmanager
def exclusive(root: Path):
    """One grading run per course root at a time."""
    lock_path = root / STATE_DIR / "lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"another grading run holds {lock_path}; wait for it to finish") from None
        yield


# --------------------------------------------------------------------------------------
# The gradebook
# --------------------------------------------------------------------------------------

def ensure_sources(root: Path, assignments: list[str]) -> None:
    """``source/<a>/<a>.ipynb`` rebuilt from ``solutions/`` (the release builder's function),
    written only when it changed; assignments not in ``solutions/`` keep the source they have."""
    known = set(release.assignment_names())
    repository = None
    for assignment in assignments:
        if assignment not in known:
            continue
        repository = repository or release.course_repository()
        path = release.source_path(root, assignment)
        built = release.build_source(assignment, repository)
        with tempfile.TemporaryDirectory() as scratch:  # the same bytes as a written notebook
            fresh = Path(scratch) / path.name
            release.write_notebook(built, fresh)
            if path.exists() and path.read_bytes() == fresh.read_bytes():
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(fresh, path)


def ensure_assignments(root: Path, assignments: list[str], state: dict) -> None:
    """Each assignment in the gradebook, with the cells of its current source notebook."""
    from nbgrader.api import MissingEntry

    sources = state.setdefault("_sources", {})
    for assignment in assignments:
        digest = hashlib.sha256()
        _hash_tree(digest, root / "source" / assignment)
        present = (root / "gradebook.db").exists()
        if present:
            with gradebook.open_gradebook(root) as gb:
                try:
                    present = len(gb.find_assignment(assignment).notebooks) > 0
                except MissingEntry:
                    present = False
        if present and sources.get(assignment) == digest.hexdigest():
            continue
        run_nbgrader("generate_assignment", assignment, "--force", "--log-level=ERROR",
                     root=root, capture=True)
        sources[assignment] = digest.hexdigest()


def merge(outcome: Outcome, root: Path) -> None:
    """Copy one student's grades from its temporary gradebook into the main one (one writer)."""
    scratch = Path(outcome.course_root)
    flagged = {i["notebook"] for i in outcome.incidents if i.get("notebook")}
    with gradebook.open_gradebook(scratch) as source, gradebook.open_gradebook(root) as target:
        graded = source.find_submission(outcome.assignment, outcome.student)
        target.update_or_create_student(outcome.student)
        target.update_or_create_submission(outcome.assignment, outcome.student)
        for notebook in graded.notebooks:
            for grade in notebook.grades:
                mine = target.find_grade(grade.name, notebook.name, outcome.assignment, outcome.student)
                mine.auto_score = grade.auto_score
                mine.needs_manual_grade = grade.needs_manual_grade
            for comment in notebook.comments:
                mine = target.find_comment(comment.name, notebook.name, outcome.assignment, outcome.student)
                mine.auto_comment = comment.auto_comment
            submitted = target.find_submission_notebook(notebook.name, outcome.assignment, outcome.student)
            submitted.flagged = notebook.name in flagged
        target.db.commit()
        final = target.find_submission(outcome.assignment, outcome.student)
        outcome.score, outcome.max_score = final.score, final.max_score
    destination = root / "autograded" / outcome.student / outcome.assignment
    produced = scratch / "autograded" / outcome.student / outcome.assignment
    if destination.exists():
        shutil.rmtree(destination)
    destination.mkdir(parents=True)
    for name in notebook_names(root, outcome.assignment):
        if (produced / f"{name}.ipynb").exists():
            shutil.copyfile(produced / f"{name}.ipynb", destination / f"{name}.ipynb")
    (destination / ".grading.json").write_text(json.dumps(outcome.as_dict(), indent=1, ensure_ascii=False))


# --------------------------------------------------------------------------------------
# The engines: one long-lived nbgrader process per job
# --------------------------------------------------------------------------------------

@dataclass
class Attempt:
    status: int | None      # nbgrader's exit status; None when the engine died or was killed
    timed_out: bool = False
    log: str = ""           # what the engine printed during a failed attempt


class Engine:
    """One job's ``python -m autograder.worker`` process: autogrades the students given to it.

    Started on first use and replaced after it was killed (an attempt that ran past its
    time) or died.  It runs nbgrader, never student code: each notebook gets a new kernel.
    """

    def __init__(self, log_path: Path):
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self._replies = -1
        self._buffer = b""

    def _start(self) -> None:
        read_end, write_end = os.pipe()
        environment = nbgrader_environment()
        environment["PYTHONPATH"] = str(REPO_ROOT)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "autograder.worker", "--replies", str(write_end)],
                cwd=AUTOGRADER_DIR, env=environment, stdin=subprocess.PIPE, stdout=log,
                stderr=subprocess.STDOUT, pass_fds=(write_end,), start_new_session=True)
        os.close(write_end)
        self._replies, self._buffer = read_end, b""

    def run(self, task: dict, timeout: float) -> Attempt:
        """Autograde one task (see :func:`autograder.worker.autograde`); wait at most ``timeout`` s."""
        if self.process is None or self.process.poll() is not None:
            self.stop()
            self._start()
        offset = self.log_path.stat().st_size
        attempt = Attempt(status=None)
        try:
            self.process.stdin.write((json.dumps(task) + "\n").encode())
            self.process.stdin.flush()
            answer = self._read_answer(deadline=time.monotonic() + timeout)
        except BrokenPipeError:
            answer = None
        if answer is None:  # late or dead: kill it (its kernel dies with it); a new one comes next time
            attempt.timed_out = self.process.poll() is None
            self.stop()
        else:
            attempt.status = answer["status"]
        if attempt.status != 0:
            with open(self.log_path, "rb") as log:
                log.seek(offset)
                attempt.log = log.read().decode(errors="replace")
        return attempt

    def _read_answer(self, deadline: float) -> dict | None:
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._replies], [], [], remaining)[0]:
                return None
            chunk = os.read(self._replies, 4096)
            if not chunk:  # the engine exited
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def stop(self) -> None:
        """Kill the engine (its kernels die with it, see autograder.sandbox)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process.stdin.close()
            self.process = None
        if self._replies >= 0:
            os.close(self._replies)
            self._replies = -1


# --------------------------------------------------------------------------------------
# One student
# --------------------------------------------------------------------------------------

KERNEL_START_CAUSE = re.compile(r"^(?:bwrap|sandbox): .*$", re.MULTILINE)


def start_failure_cause(log: str) -> str | None:
    """Why a kernel could not start, as the sandbox said it (nbgrader's own traceback only
    says that the kernel died before replying): e.g. ``bwrap: execvp …: No such file``."""
    causes = list(dict.fromkeys(match.group(0).strip() for match in KERNEL_START_CAUSE.finditer(log)))
    return "; ".join(causes) if causes else None


def tampering_incidents(cells: list[results.GradedCell]) -> list[dict]:
    """Test cells whose check refused because the notebook replaced library functions."""
    return [{"kind": "replaced_functions", "notebook": cell.notebook, "grade_id": cell.grade_id,
             "detail": cell.evalue.splitlines()[0]} for cell in cells if cell.tampering]


def _skip_reason(kind: str, settings: Settings) -> str:
    if kind == "dead":
        return ("this cell stopped the Python kernel (sys.exit()/os._exit(), a crash, or running out "
                f"of memory: the limit is {settings.memory_mb} MB), so the grader skipped it")
    if kind == "hung":
        return (f"this cell ran past the {settings.timeout} s limit and did not stop when "
                "interrupted, so the grader skipped it")
    return "this cell kept the notebook running past the grader's time limit, so the grader skipped it"


def grade_one(submission: Submission, root: Path, template_db: Path, scratch_dir: Path,
              settings: Settings, use_bwrap: bool, index: int, engine: Engine) -> Outcome:
    """Autograde one submission in its own course root, with ``engine`` (runs in a pool thread)."""
    start = time.perf_counter()
    outcome = Outcome(submission.student, submission.assignment, "failed")
    course = Path(tempfile.mkdtemp(prefix=f"s{index}-", dir=scratch_dir))
    outcome.course_root = str(course)
    shutil.copytree(root / "source" / submission.assignment, course / "source" / submission.assignment)
    shutil.copytree(submission.folder, course / "submitted" / submission.student / submission.assignment,
                    ignore=shutil.ignore_patterns(*IGNORED_NAMES))
    shutil.copyfile(template_db, course / "gradebook.db")
    runtime, jupyter = course / "rt", course / "jupyter"
    runtime.mkdir()
    workdir = course / "autograded" / submission.student / submission.assignment
    workdir.mkdir(parents=True)
    argv = sandbox.kernel_argv(workdir, runtime, memory_mb=settings.memory_mb, file_mb=settings.file_mb,
                               sandbox=use_bwrap, hidden=[scratch_dir, root.resolve()])
    kernel = sandbox.write_kernelspec(jupyter, argv, threads=settings.threads)
    report_path = course / "report.json"
    skip: dict[str, dict[str, str]] = {}
    expected = [p.stem for p in (course / "submitted" / submission.student / submission.assignment).glob("*.ipynb")
                if p.stem in notebook_names(root, submission.assignment)]
    for attempt in range(1, settings.attempts + 1):
        outcome.attempts = attempt
        report_path.unlink(missing_ok=True)
        task = {"root": str(course), "student": submission.student, "assignment": submission.assignment,
                "environment": {"JUPYTER_PATH": str(jupyter), "JUPYTER_RUNTIME_DIR": str(runtime)},
                "timeout": settings.timeout, "startup_timeout": settings.startup_timeout, "grace": settings.grace,
                "kernel": kernel, "report": str(report_path), "skip": skip,
                "max_output_bytes": settings.max_output_bytes, "ipc": str(runtime / "k") if use_bwrap else None}
        result = engine.run(task, timeout=settings.notebook_timeout)
        try:
            report = json.loads(report_path.read_text())
        except (OSError, ValueError):
            report = {}
        for incident in report.get("incidents", []):
            incident.setdefault("attempt", attempt)
            if incident not in outcome.incidents:
                outcome.incidents.append(incident)
        produced = all((workdir / f"{name}.ipynb").exists() for name in expected)
        if result.status == 0 and produced and expected:
            outcome.status = "graded"
            break
        if "dead_cell" in report:
            kind, cell = "dead", report["dead_cell"]
        elif "hung_cell" in report:
            kind, cell = "hung", report["hung_cell"]
        elif result.timed_out and "cell" in report:
            kind, cell = "notebook_timeout", report["cell"]
        else:
            cause = start_failure_cause(result.log)
            outcome.error = (("the kernel could not start: " + cause + "\n") if cause else "") + (
                "nbgrader autograde failed" + (" (ran past --notebook-timeout)" if result.timed_out else "")
                + ":\n" + result.log[-3000:])
            break
        notebook = report.get("notebook", expected[0] if expected else "")
        if str(cell) in skip.get(notebook, {}):
            outcome.error = f"cell {cell} of {notebook} was skipped and the kernel still failed"
            break
        skip.setdefault(notebook, {})[str(cell)] = _skip_reason(kind, settings)
        outcome.incidents.append({"kind": {"dead": "kernel_died", "hung": "kernel_unresponsive",
                                           "notebook_timeout": "notebook_timeout"}[kind],
                                  "notebook": notebook, "cell": cell,
                                  "grade_id": report.get("grade_id"), "attempt": attempt})
    else:
        outcome.error = f"gave up after {settings.attempts} attempts"
    if outcome.status == "graded":
        for name in expected:
            cells = results.graded_cells(nbformat.read(workdir / f"{name}.ipynb", as_version=4), name)
            outcome.tests += [cell.as_dict() for cell in cells]
            outcome.incidents += tampering_incidents(cells)
    outcome.seconds = time.perf_counter() - start
    return outcome


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------

def write_report(root: Path, outcomes: list[Outcome], problems: list[str], settings: Settings,
                 isolation: str) -> Path:
    folder = root / REPORTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    data = {"generated": stamp, "isolation": isolation, "settings": dataclasses.asdict(settings),
            "problems": problems, "submissions": [o.as_dict() for o in outcomes]}
    (folder / "grading_report.json").write_text(json.dumps(data, indent=1, ensure_ascii=False))
    lines = [f"# Grading report ({stamp})", "", f"Isolation: {isolation}", "",
             "| student | assignment | status | score | notes |", "|---|---|---|---|---|"]
    for o in outcomes:
        score = f"{o.score:g} / {o.max_score:g}" if o.score is not None and o.max_score is not None else "-"
        notes = "; ".join(results.describe(i) for i in o.incidents)
        if o.status == "failed":
            notes = (o.error.splitlines() or ["failed"])[0] + ("; " + notes if notes else "")
        lines.append(f"| {o.student} | {o.assignment} | {o.status} | {score} | {notes.replace('|', '/')} |")
    if problems:
        lines += ["", "## Not graded", ""] + [f"- {p}" for p in problems]
    failed = [o for o in outcomes if o.status == "failed"]
    for o in failed:
        lines += ["", f"## {o.student} / {o.assignment}: could not be graded", "", "```", o.error[-3000:], "```"]
    path = folder / "grading_report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def grade(root: Path = COURSE_ROOT, *, jobs: int = 2, force: bool = False, settings: Settings | None = None,
          students: list[str] | None = None, assignments: list[str] | None = None,
          log=print) -> list[Outcome]:
    """Grade every new or changed submission under ``root``; return one outcome per submission."""
    settings = settings or Settings()
    jobs = max(1, jobs)
    root = Path(root).resolve()
    use_bwrap = settings.sandbox != "off" and sandbox.bwrap_path() is not None
    if settings.sandbox == "on" and not use_bwrap:
        raise SystemExit(sandbox.isolation_warning())
    warning = None if use_bwrap else (sandbox.isolation_warning() if settings.sandbox == "auto"
                                      else "WARNING: sandbox disabled (--sandbox off)")
    isolation = f"bubblewrap ({sandbox.bwrap_path()})" if use_bwrap else (warning or "none")
    if warning:
        log(warning)
    with exclusive(root):
        state = load_state(root)
        submissions, problems = discover(root, students, assignments)
        for problem in problems:
            log(f"skipped: {problem}")
        todo, outcomes = [], []
        for submission in submissions:
            digest = fingerprint(submission, root, settings)
            previous = state.get(submission.key, {})
            graded_file = root / "autograded" / submission.student / submission.assignment
            if not force and previous.get("fingerprint") == digest and graded_file.is_dir():
                outcomes.append(Outcome(submission.student, submission.assignment, "unchanged",
                                        score=previous.get("score"), max_score=previous.get("max_score"),
                                        fingerprint=digest))
            else:
                todo.append((submission, digest))
        # every assignment, graded or not, so that Formgrader lists them all
        ensure_assignments(root, assignments_with_source(root), state)
        save_state(root, state)
        log(f"{len(todo)} to grade, {len(outcomes)} unchanged, {jobs} at a time")
        with tempfile.TemporaryDirectory(prefix="alg-") as scratch:
            scratch_dir = Path(scratch)
            template = scratch_dir / "template.db"
            if todo:
                shutil.copyfile(root / "gradebook.db", template)
            engines: queue.SimpleQueue[Engine] = queue.SimpleQueue()
            for number in range(jobs):
                engines.put(Engine(scratch_dir / f"engine{number}.log"))

            def grade_with_free_engine(submission: Submission, index: int) -> Outcome:
                engine = engines.get()
                try:
                    return grade_one(submission, root, template, scratch_dir, settings, use_bwrap, index, engine)
                finally:
                    engines.put(engine)

            with contextlib.ExitStack() as cleanup, ThreadPoolExecutor(max_workers=jobs) as pool:
                cleanup.callback(lambda: [engines.get().stop() for _ in range(jobs)])
                pending = {pool.submit(grade_with_free_engine, submission, index): (submission, digest)
                           for index, (submission, digest) in enumerate(todo)}
                while pending:
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        submission, digest = pending.pop(future)
                        try:
                            outcome = future.result()
                        except Exception as error:  # a bug of ours must not stop the class
                            outcome = Outcome(submission.student, submission.assignment, "failed",
                                              error=f"{type(error).__name__}: {error}")
                        outcome.fingerprint = digest
                        if outcome.status == "graded":
                            try:
                                merge(outcome, root)   # the only writer of the main gradebook
                            except Exception as error:
                                outcome.status, outcome.error = "failed", f"merge failed: {type(error).__name__}: {error}"
                        if outcome.status == "graded":
                            state[submission.key] = {"fingerprint": digest, "score": outcome.score,
                                                     "max_score": outcome.max_score,
                                                     "graded": datetime.datetime.now().isoformat(timespec="seconds")}
                            save_state(root, state)
                        else:
                            state.pop(submission.key, None)
                            save_state(root, state)
                        if outcome.course_root:
                            shutil.rmtree(outcome.course_root, ignore_errors=True)
                        outcomes.append(outcome)
                        score = (f"{outcome.score:g}/{outcome.max_score:g}" if outcome.score is not None
                                 else "NOT GRADED")
                        extra = "; ".join(results.describe(i) for i in outcome.incidents)
                        log(f"  {outcome.status:8s} {submission.key}: {score} ({outcome.seconds:.0f} s)"
                            + (f" [{extra}]" if extra else "")
                            + (f" -- {outcome.error.splitlines()[0]}" if outcome.error else ""))
        outcomes.sort(key=lambda o: (o.student, o.assignment))
        report = write_report(root, outcomes, problems, settings, isolation)
        log(f"report: {report}")
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=COURSE_ROOT, help="the course root (default: autograder/course_root/)")
    parser.add_argument("--jobs", "-j", type=int, default=int(os.environ.get("JOBS", 2)),
                        help="students graded at once (default: $JOBS or 2)")
    parser.add_argument("--force", action="store_true", help="regrade unchanged submissions too")
    parser.add_argument("--student", action="append", help="only this student (repeatable)")
    parser.add_argument("--assignment", action="append", help="only this assignment (repeatable)")
    defaults = Settings()
    parser.add_argument("--timeout", type=int, default=defaults.timeout, help="seconds per cell, from its start")
    parser.add_argument("--startup-timeout", type=int, default=defaults.startup_timeout,
                        help="seconds to start a kernel and run the setup cell")
    parser.add_argument("--notebook-timeout", type=int, default=defaults.notebook_timeout,
                        help="seconds per attempt at a whole submission")
    parser.add_argument("--memory-mb", type=int, default=defaults.memory_mb, help="memory limit per kernel")
    parser.add_argument("--file-mb", type=int, default=defaults.file_mb, help="largest file a kernel may write")
    parser.add_argument("--max-output-bytes", type=int, default=defaults.max_output_bytes)
    parser.add_argument("--attempts", type=int, default=defaults.attempts)
    parser.add_argument("--sandbox", choices=("auto", "on", "off"), default="auto",
                        help="bubblewrap isolation: auto (use when available, warn otherwise), on (required), off")
    options = parser.parse_args(argv)
    jobs = max(1, options.jobs)
    settings = Settings(timeout=options.timeout, startup_timeout=options.startup_timeout,
                        notebook_timeout=options.notebook_timeout,
                        memory_mb=options.memory_mb, file_mb=options.file_mb,
                        max_output_bytes=options.max_output_bytes, attempts=options.attempts,
                        sandbox=options.sandbox, threads=max(1, (os.cpu_count() or 1) // jobs))
    # The instructor's course root holds the whole course (Formgrader lists every assignment);
    # any other root (a test, a benchmark) only what was submitted to it.
    whole_course = options.root.resolve() == COURSE_ROOT.resolve()
    submitted = sorted({p.name for p in (options.root / "submitted").glob("*/*") if p.is_dir()})
    ensure_sources(options.root, release.assignment_names() if whole_course else submitted)
    outcomes = grade(options.root, jobs=jobs, force=options.force, settings=settings,
                     students=options.student, assignments=options.assignment)
    failed = [o for o in outcomes if o.status == "failed"]
    graded = [o for o in outcomes if o.status == "graded"]
    print(f"graded {len(graded)}, unchanged {len(outcomes) - len(graded) - len(failed)}, failed {len(failed)}")
    if failed:
        print("could not grade: " + ", ".join(f"{o.student}/{o.assignment}" for o in failed)
              + f" (see {options.root / REPORTS_DIR / 'grading_report.md'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
