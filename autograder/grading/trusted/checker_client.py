"""Graded test cells run in the trusted checker, not in the student's kernel.

For a notebook listed in :data:`CHECKED_OUTSIDE_THE_KERNEL`, an nbclient
client with :class:`CheckedOutsideTheKernel` (grading's :class:`autograder.grading.nbgrader_process.GuardedExecute`,
the test suite's :class:`autograder.grading.execute.ForkedKernels`) does not send a graded test cell to
the kernel.  It sends the cell -- nbgrader's copy, hidden tests included -- and the notebook's code
cells before it (data: the checks read an answer's code there themselves) to this nbgrader process's
:data:`checker` (:mod:`autograder.grading.trusted.checker`), which listens on a socket in the kernel's
runtime folder; it then has the kernel run the bridge's agent (silently, outside any cell),
which connects to that socket and answers the checker's requests until the test is over.  The
cell's outputs are the checker's: what the checks printed, and the error when the test failed;
where the kernel's measurements contradicted the code, the report says so.

A kernel that does not run the agent (a submission that rewrites every cell it is given)
keeps the grader out: that test, and every later one of the notebook, earns nothing.  The
checker stops waiting for it as soon as the kernel has finished the request without
connecting; only a kernel that never finishes it costs one wait (``bridge_grace`` + 20 s).
A kernel still busy once the checker is done is interrupted, then counted as hung, as any
cell would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import subprocess
import sys
import time
import uuid
from pathlib import Path
from queue import Empty

from nbclient.exceptions import DeadKernelError
from nbclient.util import ensure_async
from nbformat.notebooknode import NotebookNode

from autograder.grading.trusted.checker import NOT_STARTED
from autograder.limits import Limits

# Notebooks whose graded test cells run in the trusted checker (autograder.grading.trusted.checker), not
# in the student's kernel: their verdicts cannot be forged by the submission's code. A notebook
# left out would still run its test cells in the kernel (the grading report says which).
CHECKED_OUTSIDE_THE_KERNEL = ("01_mha_shapes", "02_numpy_walkthrough", "03_positions_and_blocks", "04_vision_transformer",
                              "05_llama_attention", "06_efficient_attention", "07_inference_attention")

# The code that starts the bridge's agent in the student's kernel (silently: not a cell).
# The folder holding the autograder package: where the checker starts, whatever the caller's folder.
AUTOGRADER_HOME = Path(__file__).resolve().parents[3]
AGENT_CODE = "__import__('attention_lab.bridge.kernel_side', fromlist=['serve']).serve({path!r})"
REFUSED = ("Your notebook's kernel did not let the grader call your code (it did not run the grader's "
           "request): this test earns no points. Code that changes how the notebook's cells run "
           "(input or AST transformers, event hooks) keeps the grader out.")


class Checker:
    """An nbgrader process's trusted checker (:mod:`autograder.grading.trusted.checker`): one process for all its
    students, (re)started when it is missing or stopped answering."""

    def __init__(self):
        self.process: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def ensure(self) -> subprocess.Popen:
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen([sys.executable, "-m", "autograder.grading.trusted.checker"], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True, bufsize=1, cwd=str(AUTOGRADER_HOME))
        return self.process

    def send(self, request: dict) -> None:
        process = self.ensure()
        process.stdin.write(json.dumps(request) + "\n")
        process.stdin.flush()

    def cancel(self) -> None:
        """End the checker's wait for a kernel (it answers that the bridge was not started); a
        checker that is not waiting ignores it."""
        process = self.process
        with contextlib.suppress(AttributeError, OSError, ValueError):  # stopped meanwhile: nothing waits
            process.stdin.write(json.dumps({"cancel": True}) + "\n")
            process.stdin.flush()

    def receive(self, timeout: float) -> dict | None:
        """The checker's next answer, or None (and the checker stopped) when none came in time."""
        process = self.process
        ready = select.select([process.stdout], [], [], max(timeout, 0))[0] if process else []
        line = process.stdout.readline() if ready else ""
        if not line:
            self.stop()
            return None
        return json.loads(line)

    def stop(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            self.process.wait()
            self.process = None


checker = Checker()  # this process's (one per nbgrader process, one per test process)


def checked_outside_the_kernel(notebook_name: str) -> bool:
    """Whether grading decides this notebook's verdicts in the trusted checker."""
    return notebook_name in CHECKED_OUTSIDE_THE_KERNEL


def runs_in_the_checker(cell: NotebookNode, notebook_name: str) -> bool:
    """Which cells go to the trusted checker, the one rule every client follows (grading's
    GuardedExecute, the tests' TrustedClient): a graded test cell -- a code cell nbgrader grades,
    hidden tests and all -- of a notebook checked outside the kernel. Every other cell runs in the
    student's kernel."""
    return (cell.cell_type == "code" and bool(cell.metadata.get("nbgrader", {}).get("grade"))
            and checked_outside_the_kernel(notebook_name))


class CheckedOutsideTheKernel:
    """For nbclient clients (``self.kc``, ``self.km``, ``self.timeout``): run a graded test cell
    in the trusted checker (see the module docstring)."""

    bridge_refused = False  # this kernel kept the grader out once: no second wait
    checked_cells: dict  # grade_id -> {"seconds", "requests"} of each cell the checker ran (benchmarks read it)
    bridge_grace = Limits.unresponsive_grace  # seconds a kernel has to start the agent, and to finish after

    def report_incident(self, incident: dict) -> None:
        """Where incidents go (grading's report); nowhere by default."""

    def kernel_died(self, number: int) -> None:
        """The kernel died during the cell (grading skips the cell on its next attempt); nothing by default."""

    def kernel_hung(self, number: int) -> None:
        """The kernel did not finish after the checker was done, even interrupted (grading skips
        the cell on its next attempt); nothing by default."""

    async def check_outside_the_kernel(self, cell, number: int, grade_id: str | None):
        if not hasattr(self, "checked_cells"):
            self.checked_cells = {}
        if self.bridge_refused:
            return self._refused(cell, number, grade_id)
        path = str(Path(self.km.connection_file).parent / f"bridge-{uuid.uuid4().hex[:12]}.sock")
        limit = float(self.timeout or 120)
        connect = float(self.bridge_grace + 20)
        loop = asyncio.get_running_loop()
        checker.send({"cell": cell.source, "socket": path, "timeout": limit, "connect_timeout": connect,
                      "code": self.submitted_code(number)})
        listening = await loop.run_in_executor(None, checker.receive, 120)
        if not listening or not listening.get("listening"):
            return self._checker_failed(cell, number, grade_id, "the grader's checker did not start")
        msg_id = self.kc.execute(AGENT_CODE.format(path=path), silent=True, store_history=False)
        answering = loop.run_in_executor(None, checker.receive, connect + limit + 30)
        agent_returned = await self._agent_returned_before(answering, msg_id)
        answer = await answering
        if answer is not None and "outputs" in answer:
            cell.outputs = [NotebookNode(output) for output in answer["outputs"]]
            self.checked_cells[grade_id] = {"seconds": answer.get("seconds"), "requests": answer.get("requests")}
            for detail in answer.get("contradictions") or []:
                self.report_incident({"kind": "measurement_contradicted", "cell": number, "grade_id": grade_id,
                                      "detail": str(detail)[:500]})
            if answer.get("kept_out"):  # it dripped a reply in: its later tests would cost their limits too
                self.bridge_refused = True
                self.report_incident({"kind": "bridge_refused", "cell": number, "grade_id": grade_id,
                                      "detail": "it sent an answer a little at a time, past the test's limit"})
        elif NOT_STARTED in (answer or {}).get("error", ""):
            self.bridge_refused = True
            self._refused(cell, number, grade_id, answer["error"])
        else:
            self._checker_failed(cell, number, grade_id, (answer or {}).get("error", "the grader's checker did not answer"))
        if not agent_returned and not await self._agent_returned(msg_id):
            from nbgrader.preprocessors.execute import UnresponsiveKernelError

            if not await ensure_async(self.km.is_alive()):  # the answer killed the kernel while the checker called it
                self.kernel_died(number)
                raise DeadKernelError("the kernel died while the grader called the student's code")

            self.kernel_hung(number)
            raise UnresponsiveKernelError()
        return cell

    def submitted_code(self, number: int) -> list[str]:
        """The code cells of the notebook being graded before cell ``number`` (numbered from 1), as
        submitted: the checker reads an answer's code there itself (``self.nb``: nbclient's notebook)."""
        return [cell.source for cell in self.nb.cells[:number - 1] if cell.cell_type == "code"]

    def _refused(self, cell, number: int, grade_id: str | None, how: str = "it kept the grader out at an earlier test"):
        cell.outputs = [NotebookNode(output_type="error", ename="GraderBridgeError", evalue=REFUSED, traceback=[])]
        self.report_incident({"kind": "bridge_refused", "cell": number, "grade_id": grade_id, "detail": how})
        return cell

    def _checker_failed(self, cell, number: int, grade_id: str | None, detail: str):
        cell.outputs = [NotebookNode(output_type="error", ename="GraderCheckerError", evalue=detail[:2000], traceback=[])]
        self.report_incident({"kind": "checker_failed", "cell": number, "grade_id": grade_id, "detail": detail[:500]})
        return cell

    async def _agent_returned_before(self, answering: asyncio.Future, msg_id: str) -> bool:
        """Whether the kernel finished the agent's request while the checker was at work (its reply
        is taken here). A kernel that finished it without connecting never will: the checker is
        told to stop waiting for it, at once -- a submission that rewrites its cells costs no wait."""
        while not answering.done():
            try:
                msg = await self.kc.shell_channel.get_msg(timeout=0.25)
            except Empty:
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                checker.cancel()  # ignored by a checker already done with this kernel
                return True
        return False

    async def _agent_returned(self, msg_id: str) -> bool:
        """Whether the kernel finished the agent's request (interrupted once if not, in time)."""
        for attempt in range(2):
            deadline = time.monotonic() + self.bridge_grace
            while (remaining := deadline - time.monotonic()) > 0:
                try:
                    msg = await self.kc.shell_channel.get_msg(timeout=remaining)
                except Empty:
                    break
                if msg["parent_header"].get("msg_id") == msg_id:
                    return True
            if attempt == 0:
                await ensure_async(self.km.interrupt_kernel())
        return False
