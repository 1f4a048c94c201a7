"""The nbgrader process of a Dask worker: autograde students one after another.

    python -m autograder.grading.nbgrader_process --replies FD [--parent PID --scratch DIR]   # tasks on stdin, a JSON line each

Started by :class:`autograder.grading.task.NbgraderProcess` (on a Dask worker) and kept for every
student that worker grades; it exits with the process that started it (``--parent``), so a
killed Dask worker leaves no nbgrader process and no kernel behind.

Each task is ``nbgrader autograde A --student S`` in that student's own temporary course
root: the real nbgrader app, with the course's nbgrader_config.py, run in this long-lived
process so that each student does not pay for starting Python and importing nbgrader
(about 3 s of CPU, as much as some notebooks take to run).  Student code never runs here:
each notebook gets a new kernel, in the sandbox -- under bubblewrap a fork of this nbgrader process's
kernel server (:mod:`autograder.isolation.kernel_forkserver`), so that each student does not pay for
importing torch either; the server is asked to clear its sandbox before each answer.

nbgrader runs with one change: the Execute preprocessor is :class:`GuardedExecute`, which

* runs every cell in the sandboxed grading kernel (kernelspec written by autograder.grading.grade);
* gives each cell its time limit from the cell's own start, and the generated setup cell
  (which imports torch: slow on a loaded machine) the kernel start-up budget instead, so
  that start-up and imports never eat a cell's budget; an interrupted kernel has
  ``grace`` seconds to answer before it counts as hung;
* records, in the task's ``report`` file, which cell is running (numbered from 1), so that a cell that kills
  the kernel (``os._exit``, a segfault) or hangs past its timeout without answering the
  interrupt can be named, and skipped on the next attempt instead of costing the whole
  notebook;
* skips the cells listed in the task (their outputs become a ``GraderSkippedCell`` error);
* before every graded test cell, removes from ``sys.modules`` anything under
  ``attention_lab`` that is not the real package (a notebook could put a fake check module
  there) and drops the check modules, so the test cell imports its check afresh from the
  read-only file;
* keeps at most ``max_output_bytes`` of output per cell.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from queue import Empty

from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbclient.util import run_sync
from nbformat.notebooknode import NotebookNode
from traitlets import Dict, Integer, Unicode

from nbgrader.preprocessors.execute import Execute, UnresponsiveKernelError

from autograder.command_line import command_line
from autograder.isolation import sandbox
from autograder.store import gradebook
from autograder.grading.trusted import checker_client
from autograder.grading.trusted.checker_client import CheckedOutsideTheKernel
from autograder.isolation.kernel_forkserver import Server
from autograder.store.nbgrader_cli import run_in_process
from autograder.store.results import SKIPPED_CELL, defines, hung_function, uses
from autograder.places import COURSE_ID, SETUP_CELL_ID
from autograder.limits import Limits

# This nbgrader process's kernel server: the sandboxed process its grading kernels are forked from.
_kernel_server = Server()



TAMPER_VARIABLE = "_attention_lab_grader_guard"
GUARD_CODE = f'''
def _attention_lab_grader_check():
    import sys, types, os, builtins, importlib
    report = []
    package = os.path.realpath({str(sandbox.package_dir())!r})
    for name in [n for n in list(sys.modules) if n == "attention_lab" or n.startswith("attention_lab.")]:
        module = sys.modules[name]
        path = getattr(module, "__file__", None) or ""
        genuine = isinstance(module, types.ModuleType) and os.path.realpath(path).startswith(package + os.sep)
        if not genuine:
            report.append(name)
            del sys.modules[name]
        elif name.startswith("attention_lab.checks."):
            del sys.modules[name]  # re-imported from the read-only file by the test cell
    if type(builtins.__import__) is not type(len):
        report.append("builtins.__import__")
        builtins.__import__ = importlib.__import__
    return ",".join(report)
{TAMPER_VARIABLE} = _attention_lab_grader_check()
del _attention_lab_grader_check
'''


class GuardedExecute(CheckedOutsideTheKernel, Execute):
    """nbgrader's Execute, made robust to kernels that die or hang (see the module docstring)."""

    skip_cells = Dict({}, help="{notebook: {cell number: reason}} cells not to run").tag(config=True)
    report_path = Unicode("", help="JSON file recording progress and incidents").tag(config=True)
    max_output_bytes = Integer(Limits.max_output_bytes, help="output kept per cell").tag(config=True)
    unresponsive_grace = Integer(Limits.unresponsive_grace, help="seconds an interrupted kernel has to answer"
                                 ).tag(config=True)
    startup_timeout = Integer(Limits.startup_timeout, help="seconds to start a kernel; also the setup cell's limit"
                              ).tag(config=True)

    def _get_timeout(self, cell):
        """The setup cell (imports) shares the start-up budget; every other cell has ``timeout``."""
        if cell is not None and cell.metadata.get("nbgrader", {}).get("grade_id") == SETUP_CELL_ID:
            return self.startup_timeout
        return super()._get_timeout(cell)

    def preprocess(self, nb, resources=None, km=None):
        self._notebook_name = (resources or {}).get("unique_key", "notebook")
        self.bridge_refused = False
        self._output_bytes: dict[int, int] = {}
        self._hung: set[str] = set()   # the notebook's functions the time limit interrupted
        return super().preprocess(nb, resources, km)

    # -- the report -------------------------------------------------------------------
    def report_incident(self, incident: dict) -> None:
        self._report(incident={**incident, "notebook": self._notebook_name})

    def kernel_died(self, number: int) -> None:
        self._report(dead_cell=number)

    def kernel_hung(self, number: int) -> None:
        self._report(hung_cell=number)

    @property
    def bridge_grace(self) -> int:
        return self.unresponsive_grace

    def _report(self, **update) -> None:
        if not self.report_path:
            return
        path = Path(self.report_path)
        try:
            report = json.loads(path.read_text()) if path.exists() else {}
        except ValueError:
            report = {}
        if "incident" in update:
            report.setdefault("incidents", []).append(update.pop("incident"))
        report.update(update)
        path.write_text(json.dumps(report))

    # -- execution --------------------------------------------------------------------
    async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):
        if cell.cell_type != "code" or not cell.source.strip():
            return await super().async_execute_cell(cell, cell_index, execution_count, store_history)
        number = cell_index + 1  # as JupyterLab numbers cells
        skip = self.skip_cells.get(self._notebook_name, {}).get(str(number))
        if skip is not None:
            cell.outputs = [NotebookNode(output_type="error", ename=SKIPPED_CELL, evalue=skip,
                                         traceback=[f"{SKIPPED_CELL}: {skip}"])]
            return cell
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        # a function that already ran past the time limit is not waited on again (a later
        # definition of it is run, and runs again)
        self._hung -= {name for name in self._hung if defines(cell.source, name)}
        hung = sorted(name for name in self._hung if uses(cell.source, name))
        if hung:
            reason = (f"it uses {hung[0]}(), which already ran past the {self.timeout} s time limit in an earlier "
                      "cell; the grader did not wait for it again")
            cell.outputs = [NotebookNode(output_type="error", ename=SKIPPED_CELL, evalue=reason,
                                         traceback=[f"{SKIPPED_CELL}: {reason}"])]
            self._report(incident={"kind": "hung_function", "notebook": self._notebook_name, "cell": number,
                                   "grade_id": grade_id, "detail": hung[0]})
            return cell
        self._report(notebook=self._notebook_name, cell=number, grade_id=grade_id, started=time.time())
        if checker_client.runs_in_the_checker(cell, self._notebook_name):
            return await self.check_outside_the_kernel(cell, number, grade_id)
        if cell.metadata.get("nbgrader", {}).get("grade"):
            await self._guard(grade_id)
        try:
            cell = await super().async_execute_cell(cell, cell_index, execution_count, store_history)
        except DeadKernelError:
            self._report(dead_cell=number)
            raise
        except CellTimeoutError:  # interrupted, but no sign of the kernel for `iopub_timeout` (= grace)
            self._report(hung_cell=number)
            raise UnresponsiveKernelError() from None
        if any(o.get("output_type") == "error" and o.get("ename") == "CellTimeoutError" for o in cell.outputs):
            self._report(incident={"kind": "timeout", "notebook": self._notebook_name,
                                   "cell": number, "grade_id": grade_id})
            if name := hung_function(cell.outputs):
                self._hung.add(name)
            if not await self._responsive():
                self._report(hung_cell=number)
                raise UnresponsiveKernelError()
        return cell

    execute_cell = run_sync(async_execute_cell)  # nbclient binds the sync wrapper per class

    async def _responsive(self) -> bool:
        """After an interrupt: does the kernel answer a kernel_info request in time?"""
        msg_id = self.kc.kernel_info()
        deadline = time.monotonic() + self.unresponsive_grace
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                msg = await self.kc.shell_channel.get_msg(timeout=remaining)
            except Empty:
                return False
            if msg["parent_header"].get("msg_id") == msg_id:
                return True
        return False

    async def _guard(self, grade_id: str | None) -> None:
        msg_id = self.kc.execute(GUARD_CODE, silent=True, store_history=False,
                                 user_expressions={"guard": TAMPER_VARIABLE})
        deadline = time.monotonic() + max(self.timeout or 60, 10)
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                msg = await self.kc.shell_channel.get_msg(timeout=remaining)
            except Empty:
                return
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            found = msg["content"].get("user_expressions", {}).get("guard", {})
            text = found.get("data", {}).get("text/plain", "''").strip("'\"")
            if text:
                self._report(incident={"kind": "tampering", "notebook": self._notebook_name,
                                       "grade_id": grade_id, "detail": text})
            return

    # -- output size ------------------------------------------------------------------
    def output(self, outs, msg, display_id, cell_index):
        content = msg.get("content", {})
        if msg["msg_type"] == "error":
            content["traceback"] = [line[:2000] for line in content.get("traceback", [])[-60:]]
            content["evalue"] = str(content.get("evalue", ""))[:5000]
            return super().output(outs, msg, display_id, cell_index)
        size = len(content.get("text", "")) + sum(len(str(v)) for v in (content.get("data") or {}).values())
        used = self._output_bytes.get(cell_index, 0)
        self._output_bytes[cell_index] = used + size
        if used + size <= self.max_output_bytes:
            return super().output(outs, msg, display_id, cell_index)
        if used <= self.max_output_bytes:  # first message over the limit: say so once
            self._report(incident={"kind": "output_truncated", "notebook": self._notebook_name,
                                   "cell": cell_index + 1})
            note = NotebookNode(output_type="stream", name="stderr",
                                text=f"\n[output truncated by the grader after {self.max_output_bytes} bytes]\n")
            outs.append(note)
        return None


def autograde_preprocessors() -> list:
    """nbgrader's own autograde preprocessors, with :class:`GuardedExecute` in place of Execute."""
    from nbgrader.converters.autograde import Autograde

    default = Autograde.class_traits()["autograde_preprocessors"].default()
    if Execute not in default:
        raise RuntimeError(f"nbgrader's autograde no longer runs Execute: {default}")
    return [GuardedExecute if preprocessor is Execute else preprocessor for preprocessor in default]


def autograde(task: dict) -> int:
    """``nbgrader autograde`` of one student in one course root, in this process: 0 when it succeeded.

    ``task``: ``root``, ``student``, ``assignment``, ``environment`` (variables set for this
    run: where the grading kernelspec and the kernel's runtime folder are) and the plan:
    ``limits`` (:class:`autograder.limits.Limits` as a dict), ``kernel``, ``report``, ``skip``,
    ``late_penalty``, ``ipc`` (see autograder.grading.task).  nbgrader's app is created
    afresh and reset afterwards (as nbgrader's own test helper does), so one process grades
    any number of students, each with its own kernel.
    """
    from traitlets.config import Config

    config = Config()
    config.Autograde.autograde_preprocessors = autograde_preprocessors()
    execute = config.GuardedExecute
    execute.shutdown_kernel = "immediate"  # no need to wait for the student's atexit
    limits = Limits(**task["limits"])
    execute.timeout = limits.timeout
    execute.startup_timeout = limits.startup_timeout
    execute.unresponsive_grace = limits.grace
    execute.iopub_timeout = limits.grace  # after a reply or an interrupt: the kernel's last outputs
    execute.skip_cells = task["skip"]
    execute.report_path = task["report"]
    execute.max_output_bytes = limits.max_output_bytes
    execute.kernel_name = task["kernel"]
    # nbgrader's late-submission penalty (timestamp.txt against the assignment's due date)
    config.LateSubmissionPlugin.penalty_method = task.get("late_penalty", "none")
    if task.get("ipc"):  # the sandboxed kernel has no network: Unix sockets in its runtime folder
        config.KernelManager.transport = "ipc"
        config.KernelManager.ip = task["ipc"]
        config.KernelManager.connection_file = task["ipc"] + ".json"
    arguments = ["autograde", task["assignment"], "--student", task["student"], "--force",
                 f"--CourseDirectory.root={task['root']}", f"--CourseDirectory.db_url={task_gradebook(task)}",
                 "--log-level=WARN"]
    saved_environment = dict(os.environ)
    os.environ.update(task.get("environment", {}))
    try:
        if task.get("kernel_server"):  # the kernels are forks of it: (re)started when its sandbox changes
            server = task["kernel_server"]
            _kernel_server.ensure(server["argv"], server["socket"], {**os.environ, **server["environment"]})
        if checker_client.checked_outside_the_kernel(task["assignment"]):
            # started now, while nbgrader loads and the kernel starts, not at the first test cell
            checker_client.checker.ensure()
        return run_in_process(*arguments, config=config)
    finally:
        os.environ.clear()
        os.environ.update(saved_environment)


def task_gradebook(task: dict) -> str:
    """The task's own gradebook, the SQLite file in its course root (the template it carried):
    nbgrader grades into it whatever gradebook the course's config names (``make grade
    DB_URL=...`` exports the shared one to every process of the run); the parent alone writes
    that one (see autograder.grading.merge)."""
    return f"sqlite:///{Path(task['root']) / gradebook.SQLITE_NAME}"


def recorded_grades(task: dict) -> dict:
    """What nbgrader wrote into the task's gradebook: per notebook, its grades, comments and
    late penalty; and the submission time.  Read here, where nbgrader is loaded: the Dask
    worker that sent the task never imports it."""
    from nbgrader.api import Gradebook

    notebooks = {}
    with Gradebook(task_gradebook(task), COURSE_ID) as gb:
        submission = gb.find_submission(task["assignment"], task["student"])
        for notebook in submission.notebooks:
            notebooks[notebook.name] = {
                "grades": {g.name: [g.auto_score, bool(g.needs_manual_grade)] for g in notebook.grades},
                "comments": {c.name: c.auto_comment for c in notebook.comments},
                "late_submission_penalty": notebook.late_submission_penalty,
            }
        stamp = submission.timestamp.isoformat() if submission.timestamp else None
    return {"notebooks": notebooks, "timestamp": stamp}


def exit_with(parent: int, scratch: Path | None) -> None:
    """Once ``parent`` (the Dask worker) is gone: kill this nbgrader process's children, remove the
    worker's ``scratch`` folder (a killed worker cannot), and exit."""
    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                leave(scratch)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


# Removes a folder once the process holding the write end of its standard input has exited.
_REMOVER = "import os, shutil, sys; os.read(0, 1); shutil.rmtree(sys.argv[1], ignore_errors=True)"


def leave(scratch: Path | None) -> None:
    """Kill this nbgrader process's children (its kernel server too), remove ``scratch``, exit.

    ``scratch`` is removed once this process is gone, not before: the main thread may be in
    the middle of a student's autograde, writing there, until the very exit (removed while it
    still wrote, a killed worker's folder of student files was sometimes left behind)."""
    sandbox.kill_children()
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
        gone, alive = os.pipe()   # neither end is inherited by a child that execs
        subprocess.Popen([sys.executable, "-c", _REMOVER, str(scratch)], stdin=gone, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os._exit(0)   # closes ``alive``: the remover reads end-of-file and removes what is left


def serve(replies: int, parent: int | None = None, scratch: Path | None = None) -> int:
    """Grade the tasks read from stdin (one JSON object per line); answer each on fd ``replies``.

    The answer is ``{"status": N, "recorded": ...}`` (see :func:`recorded_grades`; None
    unless N is 0) once that student's autograde is over and every process
    its kernels left behind is killed and reaped (see :func:`autograder.isolation.sandbox.adopt_orphans`).
    The grader kills this process (and so its kernel) when an answer is late; it starts a new
    one for the next student.  Anything nbgrader or a kernel prints goes to this process's stdout and
    stderr (the grader's log file), never to the answer channel.
    """
    sandbox.adopt_orphans()
    if parent:
        exit_with(parent, scratch)
    with os.fdopen(replies, "w", buffering=1) as answer:
        for line in sys.stdin:
            if not line.strip():
                continue
            task, recorded = json.loads(line), None
            try:
                status = autograde(task)
                if status == 0:
                    recorded = recorded_grades(task)
            except Exception:  # a bug of ours: report it for this student, keep serving
                traceback.print_exc()
                status = 1
            # nothing of this student's runs on once the answer is given
            sandbox.kill_children(spare=(_kernel_server.pid, checker_client.checker.pid))
            _kernel_server.clean()
            sys.stdout.flush()
            sys.stderr.flush()
            answer.write(json.dumps({"status": status, "recorded": recorded}) + "\n")
    if parent:  # stdin closed: the Dask worker exited (to stop an nbgrader process, it kills it)
        leave(scratch)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__)
    parser.add_argument("--replies", type=int, required=True, help="file descriptor for the answers")
    parser.add_argument("--parent", type=int, default=None, help="exit when this process is gone")
    parser.add_argument("--scratch", type=Path, default=None, help="the parent's scratch folder, removed "
                        "when the parent is gone")
    options = parser.parse_args(argv)
    return serve(options.replies, options.parent, options.scratch)


if __name__ == "__main__":
    sys.exit(main())
