"""One submission, graded on a Dask worker: runs on any machine with the course installed.

:func:`grade_submission` gets a task made of bytes (the source notebook, the student's files,
a template gradebook holding only the assignment, the run's limits), builds a temporary course
root from them, autogrades it with nbgrader, and returns bytes and plain data: the
autograded notebooks, the grades and comments nbgrader recorded, the report entry.  Nothing
is read from or written to the instructor's course root: no shared filesystem is assumed,
and the parent process alone writes the gradebook (see :mod:`autograder.grading.merge`).

nbgrader itself runs in an :class:`NbgraderProcess`: a long-lived ``python -m autograder.grading.nbgrader_process``
process per task slot of the worker process, started once and reused for every student
(Python and nbgrader start once per worker, not once per student); each notebook gets a new
kernel, under :mod:`autograder.isolation.sandbox` (under bubblewrap, forked from the nbgrader process's kernel
server, which has imported torch once: :mod:`autograder.isolation.kernel_forkserver`).  An attempt
that runs past ``notebook_timeout`` gets its nbgrader process killed (its kernel dies with it) and
replaced.  Each nbgrader process grades in a course root of its own, emptied before and after each
student; the worker's scratch folder goes with the worker, even a killed one (its nbgrader processes
remove it once the worker is gone).

A kernel that dies (``sys.exit`` is fine, ``os._exit``/segfault is not), hangs past its
timeout without answering the interrupt within the grace time, or writes more than
``disk_mb`` into the folders of the machine it can write (its working and socket folders;
its ``/tmp`` and ``/dev/shm`` are tmpfs of that size) is restarted with that cell skipped
(it earns nothing, the others earn what they earn).  The submission is failed, never
silently scored, after ``attempts`` tries, or once its attempts together ran past
``submission_timeout`` seconds or (where the nbgrader process's sandbox has a control group,
:mod:`autograder.isolation.cgroups`, which also holds the memory and process count of the whole
sandbox) used more than ``cpu_seconds`` of CPU.

Nothing a submission leaves in the sandbox is counted against the next: after each one the memory
the sandbox's group holds beyond its processes is measured (``left_in_sandbox_mb``), and more than
:data:`SANDBOX_LEFT_MB` restarts the sandbox; a sandbox found so before a submission, or one in
which its kernel cannot start, is restarted and the submission graded in the fresh one (the
report says so: ``left_in_sandbox``, ``sandbox_restarted``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from autograder.isolation import cgroups, sandbox
from autograder.store import gradebook, results
from autograder.isolation.kernel_forkserver import empty_folder
from autograder.store.nbgrader_cli import nbgrader_environment
from autograder.places import AUTOGRADER_DIR, SETUP_CELL_ID
from autograder.limits import Limits


# --------------------------------------------------------------------------------------
# The nbgrader processes: one long-lived nbgrader process per task slot of this worker process
# --------------------------------------------------------------------------------------

@dataclass
class Attempt:
    status: int | None      # nbgrader's exit status; None when the nbgrader process died or was killed
    timed_out: bool = False
    log: str = ""           # what the nbgrader process printed during a failed attempt
    recorded: dict | None = None    # what nbgrader recorded, when it succeeded
    stopped: str = ""       # why the watch (see NbgraderProcess.run) stopped it: "disk" or "cpu"


class NbgraderProcess:
    """One ``python -m autograder.grading.nbgrader_process`` process: autogrades the students given to it.

    Started on first use and replaced after it was killed (an attempt that ran past its
    time) or died.  It runs nbgrader, never student code: each notebook gets a new kernel.
    It exits with the process that started it (see :func:`autograder.grading.nbgrader_process.serve`).
    """

    def __init__(self, folder: Path):
        self.folder = folder            # the course root of the student it grades (see course_root)
        self.log_path = folder.with_name(folder.name + ".log")
        self.socket_path = folder.with_name(folder.name + ".sock")  # its kernel server's (hidden in the sandbox)
        self.process: subprocess.Popen | None = None
        self._replies = -1
        self._buffer = b""
        self.last_pid = -1          # the process that ran the last attempt (killed or not)
        self.group: cgroups.Group | None = None     # its kernel server's control group, if any
        self._group_limits: tuple[int, int] | None = None

    def _start(self) -> None:
        read_end, write_end = os.pipe()
        environment = nbgrader_environment()
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "autograder.grading.nbgrader_process", "--replies", str(write_end),
                 "--parent", str(os.getpid()), "--scratch", str(self.folder.parent)],
                cwd=AUTOGRADER_DIR, env=environment, stdin=subprocess.PIPE, stdout=log,
                stderr=subprocess.STDOUT, pass_fds=(write_end,), start_new_session=True)
        os.close(write_end)
        self._replies, self._buffer = read_end, b""
        self.last_pid = self.process.pid

    def sandbox_group(self, memory_mb: int, processes: int) -> cgroups.Group | None:
        """The control group of this nbgrader process's kernel server, with these limits (None where the
        machine offers none): kept while the limits stay, so the server is kept too."""
        if self._group_limits != (memory_mb, processes):
            self.stop()
            self.remove_group()
            self.group, self._group_limits = cgroups.Group.create(memory_mb, processes), (memory_mb, processes)
        return self.group

    def remove_group(self) -> None:
        if self.group is not None:
            self.group.remove()
        self.group, self._group_limits = None, None

    def left_in_sandbox_mb(self) -> float | None:
        """MB of memory the sandbox's control group holds that none of its processes does (see
        :meth:`autograder.isolation.cgroups.Group.unowned_bytes`): what a student's kernels left, which the next
        student's kernels would find missing from the sandbox's limit; None without a control group."""
        left = self.group.unowned_bytes() if self.group is not None else None
        return None if left is None else round(left / 2**20, 1)

    def restart_sandbox(self) -> None:
        """A new nbgrader process, kernel server and control group (the same limits) from the next
        attempt on: the old sandbox's namespaces, and whatever its kernels left in them, go with its
        server."""
        limits = self._group_limits
        self.stop()
        self.remove_group()
        if limits is not None:
            self.sandbox_group(*limits)

    def run(self, task: dict, timeout: float, watch=None) -> Attempt:
        """Autograde one task (see :func:`autograder.grading.nbgrader_process.autograde`); wait at most ``timeout`` s.

        ``watch``: called about every second while it runs; a reason it returns (``"disk"``,
        ``"cpu"``) stops the attempt as a timeout does.
        """
        if self.process is None or self.process.poll() is not None:
            self.stop()
            self._start()
        offset = self.log_path.stat().st_size
        attempt = Attempt(status=None)
        try:
            self.process.stdin.write((json.dumps(task) + "\n").encode())
            self.process.stdin.flush()
            answer = self._read_answer(deadline=time.monotonic() + timeout, watch=watch, attempt=attempt)
        except BrokenPipeError:
            answer = None
        if answer is None:  # late, stopped or dead: kill it (its kernel dies with it); a new one comes next time
            attempt.timed_out = self.process.poll() is None and not attempt.stopped
            self.stop()
        else:
            attempt.status, attempt.recorded = answer["status"], answer.get("recorded")
        if attempt.status != 0:
            with open(self.log_path, "rb") as log:
                log.seek(offset)
                attempt.log = log.read().decode(errors="replace")
        return attempt

    def _read_answer(self, deadline: float, watch=None, attempt: Attempt | None = None) -> dict | None:
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if not select.select([self._replies], [], [], min(remaining, WATCH_INTERVAL))[0]:
                if watch is not None and (reason := watch()):
                    attempt.stopped = reason
                    return None
                continue
            chunk = os.read(self._replies, 4096)
            if not chunk:  # the nbgrader process exited
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def course_root(self) -> Path:
        """This nbgrader process's course root, emptied for the next student.  Its ``autograded`` (every
        kernel's working folder lies in it) and ``rt`` (the kernels' runtime folder) are
        emptied, never replaced: the nbgrader process's kernel server shows these very folders."""
        for folder in (self.folder / KERNEL_WORKDIR_ROOT, self.folder / KERNEL_RUNTIME_DIR):
            folder.mkdir(parents=True, exist_ok=True)
        empty_folder(self.folder, keep=(KERNEL_WORKDIR_ROOT, KERNEL_RUNTIME_DIR))
        return self.folder

    def stop(self) -> None:
        """Kill the nbgrader process (its kernels die with it, see autograder.isolation.sandbox)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process.stdin.close()
            self.process = None
        if self._replies >= 0:
            os.close(self._replies)
            self._replies = -1


KERNEL_WORKDIR_ROOT, KERNEL_RUNTIME_DIR = "autograded", "rt"
WATCH_INTERVAL = 1.0    # seconds between two looks at a running attempt's disk and CPU use
# Memory a sandbox's control group may hold beyond its processes between two students (measured: 0 MB
# once the kernel server has cleaned up); more, and the sandbox is restarted before the next student.
SANDBOX_LEFT_MB = 64


_idle: queue.SimpleQueue[NbgraderProcess] = queue.SimpleQueue()
_processes: list[NbgraderProcess] = []
_lock = threading.RLock()
_scratch: list[Path] = []


def scratch_base() -> Path:
    """This process's scratch folder (every task's course root lives in it; the sandbox hides it)."""
    with _lock:
        if not _scratch:
            _scratch.append(Path(tempfile.mkdtemp(prefix="alg-worker-")))
        return _scratch[0]


@contextlib.contextmanager
def nbgrader_process():
    """A free nbgrader process of this Dask worker (a new one when all are busy)."""
    try:
        free = _idle.get_nowait()
    except queue.Empty:
        with _lock:
            free = NbgraderProcess(scratch_base() / f"nbgrader{len(_processes)}")
            _processes.append(free)
    try:
        yield free
    finally:
        _idle.put(free)


def stop_nbgrader_processes() -> int:
    """Stop every nbgrader process of this process (run on each worker when the grading run ends)."""
    with _lock:
        for each in _processes:
            each.stop()
            each.remove_group()
        stopped = len(_processes)
        _processes.clear()
        while True:
            try:
                _idle.get_nowait()
            except queue.Empty:
                break
        if _scratch:
            shutil.rmtree(_scratch.pop(), ignore_errors=True)
    return stopped


# --------------------------------------------------------------------------------------
# One submission
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


def starts_with_the_setup_cell(source: dict[str, bytes]) -> bool:
    """Whether a notebook of the assignment (``{path: bytes}`` of its source folder) has the
    course's generated setup cell, which imports torch and the course package."""
    import nbformat

    for name, data in source.items():
        if name.endswith(".ipynb") and "/" not in name:
            cells = nbformat.reads(data.decode(), as_version=4).cells
            if any(cell.metadata.get("nbgrader", {}).get("grade_id") == SETUP_CELL_ID for cell in cells):
                return True
    return False


def _skip_reason(kind: str, limits: Limits) -> str:
    if kind == "dead":
        return ("this cell stopped the Python kernel (sys.exit()/os._exit(), a crash, or running out "
                f"of memory: the limit is {limits.memory_mb} MB), so the grader skipped it")
    if kind == "hung":
        return (f"this cell ran past the {limits.timeout} s limit and did not stop when "
                "interrupted, so the grader skipped it")
    if kind == "disk":
        return (f"this cell wrote more than the {limits.disk_mb} MB of files a notebook may write, "
                "so the grader skipped it")
    return "this cell kept the notebook running past the grader's time limit, so the grader skipped it"


def disk_usage(*folders: Path) -> int:
    """Bytes of disk that the files under ``folders`` take (what a kernel wrote there; a file
    counts once per link, and what it spared by seeking counts as nothing)."""
    total = 0
    pending = [str(folder) for folder in folders]
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except OSError:
            continue
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
                else:
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


def _write_tree(folder: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = (folder / name).resolve()
        if not path.is_relative_to(folder.resolve()):
            raise ValueError(f"a file outside its folder: {name}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def grade_submission(task: dict) -> dict:
    """Autograde one submission from its bytes; return its outcome, notebooks and grades.

    ``task``: ``student``, ``assignment``, ``index``, ``source`` and ``files`` (``{path:
    bytes}`` of the assignment's source folder and of the student's folder, ``timestamp.txt``
    included), ``template`` (the bytes of an SQLite gradebook holding the assignment),
    ``limits`` (:class:`autograder.limits.Limits`), ``hide`` (folders of
    the parent's machine the sandbox hides as well, when the worker shares it).

    Returns ``{"outcome": {...}, "notebooks": {name: bytes}, "grades": {...}, "timestamp"}``.
    """
    start = time.perf_counter()
    limits: Limits = task["limits"]
    student, assignment = task["student"], task["assignment"]
    outcome = {"status": "failed", "attempts": 0, "incidents": [], "tests": [], "error": "", "nbgrader_pids": [],
               "worker": f"{socket.gethostname()}:{os.getpid()}", "seconds": 0.0}
    answer = {"outcome": outcome, "notebooks": {}, "grades": {}, "timestamp": None}
    if limits.sandboxed and sandbox.bwrap_path() is None:  # fail closed: --sandbox off is the instructor's to say
        outcome["error"] = f"worker {outcome['worker']}: {sandbox.refusal()}"
        return answer
    outcome["isolation"] = "bubblewrap" if limits.sandboxed else "none"
    with nbgrader_process() as free:
        try:
            course = free.course_root()
            _write_tree(course / "source" / assignment, task["source"])
            submitted = course / "submitted" / student / assignment
            _write_tree(submitted, task["files"])
            (course / gradebook.SQLITE_NAME).write_bytes(task["template"])
            recorded = _grade(course, task, limits, free, outcome)
            workdir = course / KERNEL_WORKDIR_ROOT / student / assignment
            if outcome["status"] == "graded":
                for path in sorted(workdir.glob("*.ipynb")):
                    answer["notebooks"][path.stem] = path.read_bytes()
                answer["grades"], answer["timestamp"] = recorded["notebooks"], recorded["timestamp"]
        except Exception as error:  # a bug of ours must not stop the class: this submission fails
            outcome["status"], outcome["error"] = "failed", f"{type(error).__name__}: {error}"
        finally:
            empty_folder(free.folder, keep=(KERNEL_WORKDIR_ROOT, KERNEL_RUNTIME_DIR))
            outcome["seconds"] = time.perf_counter() - start
    return answer


class _Sandbox:
    """One submission's sandbox: its nbgrader process's kernel server (its command, its control group),
    the CPU the submission's attempts used in it, restarts, and what the submission left in it."""

    def __init__(self, free: NbgraderProcess, task: dict, limits: Limits, course: Path):
        self.free, self.task, self.limits, self.course = free, task, limits, course
        self.restarts = 0
        self.cpu_before = 0.0   # CPU seconds used in the groups of earlier restarts
        self._start()

    def _start(self) -> None:
        limits, course = self.limits, self.course
        self.group = self.free.sandbox_group(limits.memory_mb, limits.processes)
        self.cpu_start = self.group.cpu_seconds() if self.group else 0.0
        hidden = [course.parent, *(Path(p) for p in self.task.get("hide", []))]
        self.server = {"argv": sandbox.kernel_server_argv(course / KERNEL_WORKDIR_ROOT, course / KERNEL_RUNTIME_DIR,
                                                          hidden, course=starts_with_the_setup_cell(self.task["source"]),
                                                          disk_mb=limits.disk_mb,
                                                          cgroup=self.group.procs_files if self.group else None),
                       "socket": str(self.free.socket_path), "environment": sandbox.kernel_environment(limits.threads)}

    def cpu_seconds(self) -> float:
        """CPU time of this submission's attempts so far (every process of its sandbox, restarts included)."""
        return self.cpu_before + (self.group.cpu_seconds() - self.cpu_start if self.group else 0.0)

    def restart(self, reason: str, outcome: dict) -> None:
        """A fresh sandbox (nothing this submission did is counted against it); the report says why."""
        self.cpu_before = self.cpu_seconds()
        self.free.restart_sandbox()
        self._start()
        self.restarts += 1
        outcome["incidents"].append({"kind": "sandbox_restarted", "detail": reason})

    def measure_what_was_left(self, outcome: dict) -> None:
        """Once the submission's kernels are gone: the memory its sandbox still holds that no process does
        (``left_in_sandbox_mb``); more than :data:`SANDBOX_LEFT_MB`, and the sandbox is restarted now."""
        left = outcome["left_in_sandbox_mb"] = self.free.left_in_sandbox_mb()
        if left is not None and left > SANDBOX_LEFT_MB:
            outcome["incidents"].append({"kind": "left_in_sandbox", "detail": f"{left:.0f}"})
            self.free.restart_sandbox()


def _grade(course: Path, task: dict, limits: Limits, free: NbgraderProcess, outcome: dict) -> dict | None:
    """The attempts at one submission (``outcome`` records them): each runs every notebook; a cell
    that killed or hung the kernel is skipped on the next, until one attempt grades them all or a
    budget runs out. What nbgrader recorded (see
    :func:`autograder.grading.nbgrader_process.recorded_grades`) when it ends graded."""
    workdir = course / KERNEL_WORKDIR_ROOT / task["student"] / task["assignment"]
    workdir.mkdir(parents=True)
    box = _Sandbox(free, task, limits, course) if limits.sandboxed else None
    if box is not None and (left := free.left_in_sandbox_mb()) is not None and left > SANDBOX_LEFT_MB:
        # an earlier submission's: never this one's to pay
        box.restart(f"it held {left:.0f} MB of memory that an earlier submission left", outcome)
    job = _job(course, task, limits, free, box)
    expected = _expected_notebooks(course, task)
    watch = _watch(course, limits, box)
    deadline = time.monotonic() + limits.submission_timeout
    for attempt in range(1, limits.attempts + 1):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            outcome["error"] = _over_budget(limits)
            break
        outcome["attempts"] = attempt
        job["kernel_server"] = box and box.server  # a restart's sandbox has a server of its own
        result, report = _attempt(course, job, free, attempt, timeout=min(limits.notebook_timeout, remaining),
                                  watch=watch)
        outcome["nbgrader_pids"].append(free.last_pid)
        _take_incidents(outcome, report, attempt)
        if result.status == 0 and expected and all((workdir / f"{name}.ipynb").exists() for name in expected):
            outcome["status"] = "graded"
            break
        failed = _failed_cell(result, report, limits, deadline)
        if failed == NOT_STARTED:
            if box is not None and not box.restarts:
                # no cell ran: the kernel did not start, which nothing in this submission can cause (its cells
                # run only once it has): what earlier submissions left could, so a fresh sandbox tries again
                cause = start_failure_cause(result.log) or "nbgrader autograde failed before the first cell"
                box.restart(f"the kernel could not start in it ({cause})", outcome)
                continue
            failed = _autograde_failure(result)
        if isinstance(failed, str):
            outcome["error"] = failed
            break
        kind, cell = failed
        notebook = report.get("notebook", expected[0] if expected else "")
        if str(cell) in job["skip"].get(notebook, {}):
            outcome["error"] = f"cell {cell} of {notebook} was skipped and the kernel still failed"
            break
        job["skip"].setdefault(notebook, {})[str(cell)] = _skip_reason(kind, limits)
        outcome["incidents"].append({"kind": SKIPPED_KINDS[kind], "notebook": notebook, "cell": cell,
                                     "grade_id": report.get("grade_id"), "attempt": attempt})
    else:
        outcome["error"] = f"gave up after {limits.attempts} attempts"
    if box is not None:
        box.measure_what_was_left(outcome)
    if outcome["status"] != "graded":
        return None
    _take_tests(outcome, workdir, expected)
    return result.recorded


# Why a cell was skipped on the next attempt, as the incident that records it.
SKIPPED_KINDS = {"dead": "kernel_died", "hung": "kernel_unresponsive", "notebook_timeout": "notebook_timeout",
                 "disk": "disk_quota"}


def _job(course: Path, task: dict, limits: Limits, free: NbgraderProcess, box: _Sandbox | None) -> dict:
    """What the nbgrader process is asked to do at every attempt (see
    :func:`autograder.grading.nbgrader_process.autograde`; its ``skip`` grows from one attempt to
    the next), with the kernelspec its kernels start from: under bubblewrap a fork of the nbgrader
    process's sandboxed kernel server (:mod:`autograder.isolation.kernel_forkserver`), in the
    sandbox's control group if there is one; without it a kernel started afresh."""
    workdir = course / KERNEL_WORKDIR_ROOT / task["student"] / task["assignment"]
    runtime, jupyter = course / KERNEL_RUNTIME_DIR, course / "jupyter"
    if box is not None:
        argv = sandbox.kernel_client_argv(free.socket_path, memory_mb=limits.memory_mb, file_mb=limits.file_mb)
    else:
        argv = sandbox.kernel_argv(workdir, runtime, memory_mb=limits.memory_mb, file_mb=limits.file_mb, sandbox=False)
    kernel = sandbox.write_kernelspec(jupyter, argv, threads=limits.threads)
    return {"root": str(course), "student": task["student"], "assignment": task["assignment"],
            "environment": {"JUPYTER_PATH": str(jupyter), "JUPYTER_RUNTIME_DIR": str(runtime)},
            "limits": dataclasses.asdict(limits), "kernel": kernel, "report": str(course / "report.json"), "skip": {},
            # (the late penalty: the parent's merge)
            "ipc": str(runtime / "k") if box else None, "kernel_server": box and box.server}


def _expected_notebooks(course: Path, task: dict) -> list[str]:
    """The notebooks of the student's folder that the assignment has: each must come back graded."""
    names = {Path(name).stem for name in task["source"] if name.endswith(".ipynb") and "/" not in name}
    submitted = course / "submitted" / task["student"] / task["assignment"]
    return sorted(p.stem for p in submitted.glob("*.ipynb") if p.stem in names)


def _watch(course: Path, limits: Limits, box: _Sandbox | None):
    """What stops an attempt as its time limit would, looked at about every second: the sandbox's
    CPU past ``cpu_seconds`` over all the submission's attempts, restarts included (``"cpu"``), or
    its kernels' folders past ``disk_mb`` (``"disk"``)."""
    quota = limits.disk_mb * 2**20

    def watch() -> str | None:
        if box is not None and box.cpu_seconds() > limits.cpu_seconds:
            return "cpu"
        return "disk" if disk_usage(course / KERNEL_WORKDIR_ROOT, course / KERNEL_RUNTIME_DIR) > quota else None

    return watch


def _attempt(course: Path, job: dict, free: NbgraderProcess, attempt: int, timeout: float, watch) -> tuple[Attempt, dict]:
    """One attempt at every notebook, on files the last attempt's kernels no longer hold: how it
    ended, and the report the nbgrader process wrote (which cell ran last, what went wrong)."""
    report_path = Path(job["report"])
    report_path.unlink(missing_ok=True)
    if attempt > 1:  # what the last attempt's kernels wrote goes (it would count against the disk quota)
        empty_folder(course / KERNEL_WORKDIR_ROOT)
        empty_folder(course / KERNEL_RUNTIME_DIR)
        (course / KERNEL_WORKDIR_ROOT / job["student"] / job["assignment"]).mkdir(parents=True, exist_ok=True)
    result = free.run(job, timeout=timeout, watch=watch)
    try:
        report = json.loads(report_path.read_text())
    except (OSError, ValueError):
        report = {}
    return result, report


def _take_incidents(outcome: dict, report: dict, attempt: int) -> None:
    """The attempt's incidents (a cell past its time limit, tampering...), each once over the attempts."""
    for incident in report.get("incidents", []):
        incident.setdefault("attempt", attempt)
        if incident not in outcome["incidents"]:
            outcome["incidents"].append(incident)


def _over_budget(limits: Limits) -> str:
    return (f"its attempts together ran past the {limits.submission_timeout} s a submission "
            "may take (--submission-timeout), so the grader gave up")


def _failed_cell(result: Attempt, report: dict, limits: Limits, deadline: float) -> tuple[str, int] | str:
    """Why an attempt failed: the cell to skip on the next attempt, as ``(kind, cell number)``
    (``dead``, ``hung``, ``disk``, ``notebook_timeout``); :data:`NOT_STARTED` where no cell ran (a
    fresh sandbox may do better); or, where no attempt can do better, why the grader gives up (text)."""
    if result.timed_out and time.monotonic() >= deadline:  # (whichever cell it was in: no time to retry)
        return _over_budget(limits)
    if result.stopped == "cpu":
        return (f"its sandbox used more than the {limits.cpu_seconds} s of CPU a submission "
                "may use (--cpu-seconds), so the grader gave up")
    if result.stopped == "disk" and "cell" in report:
        return "disk", report["cell"]
    if "dead_cell" in report:
        return "dead", report["dead_cell"]
    if "hung_cell" in report:
        return "hung", report["hung_cell"]
    if result.timed_out and "cell" in report:
        return "notebook_timeout", report["cell"]
    if "cell" not in report:
        return NOT_STARTED
    return _autograde_failure(result)


# An attempt in which no cell ran: its kernel did not start.
NOT_STARTED = ("not_started", None)


def _autograde_failure(result: Attempt) -> str:
    """Why the grader gives up on an attempt nothing else explains: nbgrader's own words."""
    cause = start_failure_cause(result.log)
    return (("the kernel could not start: " + cause + "\n") if cause else "") + (
        "nbgrader autograde failed" + (" (ran past --notebook-timeout)" if result.timed_out else "")
        + ":\n" + result.log[-3000:])


def _take_tests(outcome: dict, workdir: Path, expected: list[str]) -> None:
    """A graded submission's tests, and the tampering its checks refused, from its graded notebooks."""
    import nbformat

    for name in expected:
        cells = results.graded_cells(nbformat.read(workdir / f"{name}.ipynb", as_version=4), name)
        outcome["tests"] += [cell.as_dict() for cell in cells]
        outcome["incidents"] += tampering_incidents(cells)
