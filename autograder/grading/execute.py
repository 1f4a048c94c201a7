"""Execute a notebook top to bottom and report, per cell, what failed.

    python -m autograder.grading.execute autograder/course_root/source/01_mha_shapes/01_mha_shapes.ipynb
    python -m autograder.grading.execute course/01_mha_shapes.ipynb

Used by the tests (solutions pass every check; releases fail only on the blanks), the
benchmarks and instructors checking a notebook by hand. Cells run with the notebook's
folder as the working directory, in a fresh kernel -- or, to run many course notebooks in a
row, in kernels forked from one sandboxed kernel server, as grading runs them
(:class:`ForkedKernels`).
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from autograder.command_line import command_line
from autograder.grading.trusted.checker_client import CheckedOutsideTheKernel, runs_in_the_checker
from autograder.isolation import sandbox
from autograder.isolation.kernel_forkserver import Server
from autograder.store.results import graded_cells

# Generous: this runs course notebooks for tests and instructors (training cells included),
# not student code under grading limits (see autograder.places for those).
EXECUTE_CELL_TIMEOUT = 600


@dataclass
class CellError:
    cell_id: str
    grade_id: str | None
    ename: str
    evalue: str


@dataclass
class ExecutionResult:
    path: Path
    seconds: float
    errors: list[CellError] = field(default_factory=list)
    passed_tests: list[str] = field(default_factory=list)
    failed_tests: list[str] = field(default_factory=list)
    notebook: nbformat.NotebookNode | None = None

    def summary(self) -> str:
        lines = [f"{self.path}: {self.seconds:.1f} s, {len(self.passed_tests)} tests passed, "
                 f"{len(self.failed_tests)} failed, {len(self.errors)} cells raised"]
        for error in self.errors:
            where = error.grade_id or error.cell_id
            lines.append(f"  {where}: {error.ename}: {error.evalue.splitlines()[0] if error.evalue else ''}")
        return "\n".join(lines)


def notebook_client(notebook: nbformat.NotebookNode, working_dir: Path | str,
                    timeout: int = EXECUTE_CELL_TIMEOUT, checked_as: str | None = None) -> NotebookClient:
    """nbclient on ``notebook`` in a fresh ``python3`` kernel, running every cell past errors; with
    ``checked_as`` (the assignment's name), the graded test cells run in the trusted checker, as grading
    runs them, and the kernel is unsandboxed (as ``make grade SANDBOX=off``: on a GPU machine it has the GPU).

    When the run is over the kernel is killed, not asked to shut down (as grading does): every
    output is in by then, and ipykernel 7.4 hangs in about one shutdown in ten -- its control
    thread waits on the IOPub thread that the main thread has already stopped -- until
    jupyter_client's SIGTERM 2.5 s later (benchmarks/kernel_shutdown.py measures it).
    """
    client = (TrustedClient if checked_as else NotebookClient)(
        notebook, timeout=timeout, kernel_name="python3", allow_errors=True, shutdown_kernel="immediate",
        resources={"metadata": {"path": str(working_dir)}})
    if checked_as:
        client.notebook_name = checked_as
    return client


class TrustedClient(CheckedOutsideTheKernel, NotebookClient):
    """nbclient that runs a checked notebook's graded test cells in the trusted checker, as
    grading does (:mod:`autograder.grading.trusted.checker_client`)."""

    notebook_name = ""

    async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):
        if runs_in_the_checker(cell, self.notebook_name):
            return await self.check_outside_the_kernel(cell, cell_index + 1, cell.metadata["nbgrader"].get("grade_id"))
        return await super().async_execute_cell(cell, cell_index, execution_count, store_history)


class ForkedKernels:
    """Course kernels forked from one kernel server in the grading sandbox, as an nbgrader process
    runs them (:mod:`autograder.isolation.kernel_forkserver`): the server has imported ipykernel, torch
    and the course once, so a notebook costs its cells and not a new Python importing them
    (2 to 3 s of CPU). The kernels meet grading's environment (bubblewrap's read-only system,
    one torch thread, Matplotlib's Agg backend) without its memory and file limits; each
    notebook runs in a new folder under ``scratch``. Needs bubblewrap (``sandbox.bwrap_path()``).
    """

    def __init__(self, scratch: Path, threads: int = 1):
        from jupyter_client.kernelspec import KernelSpecManager

        self.workdir_root, self.runtime = scratch / "work", scratch / "runtime"
        for folder in (self.workdir_root, self.runtime):
            folder.mkdir(parents=True, exist_ok=True)
        socket_path = scratch / "server.sock"
        self.server = Server()
        self.server.ensure(sandbox.kernel_server_argv(self.workdir_root, self.runtime), str(socket_path),
                           {**os.environ, **sandbox.kernel_environment(threads)})
        argv = sandbox.kernel_client_argv(socket_path, memory_mb=0, file_mb=0)
        sandbox.write_kernelspec(scratch / "jupyter", argv, threads)
        self.specs = KernelSpecManager(kernel_dirs=[str(scratch / "jupyter" / "kernels")])
        self.runs = itertools.count()

    def execute(self, notebook: nbformat.NotebookNode, timeout: int, name: str = "") -> None:
        """Run every cell of ``notebook`` (past errors) in a kernel forked for it, killed after;
        the graded test cells of a notebook ``name`` that grading checks outside the kernel run
        in the trusted checker, as in grading."""
        from jupyter_client.manager import AsyncKernelManager
        from jupyter_core.utils import run_sync

        run = next(self.runs)
        workdir = self.workdir_root / f"run{run}"
        workdir.mkdir()
        manager = AsyncKernelManager(kernel_spec_manager=self.specs, kernel_name=sandbox.KERNEL_NAME,
                                     transport="ipc", ip=str(self.runtime / f"k{run}"),
                                     connection_file=str(self.runtime / f"k{run}.json"))
        client = TrustedClient(notebook, timeout=timeout, kernel_name=sandbox.KERNEL_NAME, allow_errors=True,
                               shutdown_kernel="immediate", resources={"metadata": {"path": str(workdir)}})
        client.notebook_name = name
        client.km = manager  # a manager given to nbclient is left running: killed below
        try:
            client.execute()
        finally:
            if manager.has_kernel:
                run_sync(manager.shutdown_kernel)(now=True)

    def close(self) -> None:
        self.server.stop()


def execute_notebook(path: Path | str, timeout: int = EXECUTE_CELL_TIMEOUT, working_dir: Path | str | None = None,
                     kernels: ForkedKernels | None = None, checked: bool = False) -> ExecutionResult:
    """Run every cell (continuing past errors) and collect the errors and test outcomes; in a
    kernel of ``kernels`` if given (which then chooses the working folder, and whose graded test cells
    run in the trusted checker); ``checked``: in a fresh kernel, with the graded test cells in the checker."""
    path = Path(path)
    notebook = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    if kernels is None:
        notebook_client(notebook, working_dir or path.parent, timeout, checked_as=path.stem if checked else None).execute()
    else:
        kernels.execute(notebook, timeout, name=path.stem)
    result = ExecutionResult(path=path, seconds=time.perf_counter() - start, notebook=notebook)
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        for output in cell.outputs:
            if output.output_type == "error":
                result.errors.append(CellError(cell.id, grade_id, output.ename, output.evalue))
    for graded in graded_cells(notebook, path.stem):
        if not graded.manual:  # written answers are graded by hand, never run
            (result.passed_tests if graded.passed else result.failed_tests).append(graded.grade_id)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__)
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--timeout", type=int, default=EXECUTE_CELL_TIMEOUT, help="per-cell timeout in seconds")
    options = parser.parse_args(argv)
    failed = False
    for path in options.notebooks:
        result = execute_notebook(path, timeout=options.timeout)
        print(result.summary())
        failed |= bool(result.errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
