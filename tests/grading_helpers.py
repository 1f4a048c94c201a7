"""Helpers of the grading tests: time limits measured on this machine, and a machine under load.

Grading tests must not bake in a time limit (a fixed 8 s fails on a loaded machine and
proves nothing on a fast one): they measure how long the generated setup cell (importing
the course and torch, the slowest honest thing a notebook does) takes here, now, and
derive their limits from that.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat

from autograder.grading.execute import notebook_client
from autograder.publishing.release import setup_cell_source
from autograder.places import SETUP_CELL_ID


@functools.lru_cache(maxsize=1)
def setup_cell_seconds() -> float:
    """Wall time of the setup cell in a fresh kernel on this machine (kernel start excluded)."""
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(setup_cell_source("x/y"))])
    client = notebook_client(notebook, Path.cwd(), timeout=600)
    with client.setup_kernel():
        start = time.perf_counter()
        client.execute_cell(notebook.cells[0], 0)
        seconds = time.perf_counter() - start
    errors = [o for o in notebook.cells[0].outputs if o.output_type == "error"]
    assert not errors, f"the setup cell failed: {errors}"
    return seconds


def cell_limit(multiple: float = 3.0, floor: float = 10.0, setup_seconds: float | None = None) -> int:
    """A per-cell limit for honest course cells: a multiple of the setup cell's time (``setup_seconds``,
    measured now when not given), at least ``floor``."""
    seconds = setup_cell_seconds() if setup_seconds is None else setup_seconds
    return int(max(floor, multiple * seconds) + 0.999)


BURN_CPU = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"
# Rewrite one file (bounded size) with fsync, so that reads from disk queue behind the writes.
WRITE_DISK = """import os, time
end = time.monotonic() + {seconds}
block = os.urandom(1 << 20)
while time.monotonic() < end:
    with open({path!r}, "wb") as handle:
        for _ in range({megabytes}):
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
os.remove({path!r})
"""


@contextlib.contextmanager
def loaded_machine(scratch: Path, *, cpu: int = 1, disk: int = 1, megabytes: int = 64, seconds: int = 420):
    """``cpu`` CPU burners and ``disk`` disk writers for the duration of the block (each also stops
    itself after ``seconds``; at most ``disk * megabytes`` MB on disk). What they burn is taken from
    the rest of the suite: with the work under test beside them, one of each keeps a 2-core
    machine's cores busy and its disk syncing."""
    scratch.mkdir(parents=True, exist_ok=True)
    scripts = [BURN_CPU.format(seconds=seconds)] * cpu + [
        WRITE_DISK.format(seconds=seconds, path=str(scratch / f"load{n}.bin"), megabytes=megabytes)
        for n in range(disk)]
    burners = [subprocess.Popen([sys.executable, "-c", script], start_new_session=True) for script in scripts]
    try:
        yield burners
    finally:
        for burner in burners:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(burner.pid, signal.SIGKILL)
            burner.wait()
        for leftover in scratch.glob("load*.bin"):
            leftover.unlink()


def slow_kernel_start(argv_builder, seconds: float):
    """Wrap autograder.isolation.sandbox.kernel_argv or kernel_client_argv (the kernelspec's command):
    the kernel sleeps ``seconds`` before it starts."""
    def argv(*args, **kwargs):
        return ["/bin/sh", "-c", f'sleep {seconds} && exec "$@"', "slow-kernel", *argv_builder(*args, **kwargs)]

    return argv


# --------------------------------------------------------------------------------------
# A tiny assignment (no torch unless asked): classes that grade in seconds
# --------------------------------------------------------------------------------------

TINY = "00_tiny"


def tiny_notebook(answer: str, setup: bool = False, written: str | None = None):
    """A one-exercise nbgrader notebook (no torch unless ``setup``): ``answer`` must define ``value = 42``.

    ``setup``: first the course's generated setup cell (imports the course and torch);
    ``written``: then a written answer graded by hand (2 points) with this text.
    """
    def nbgrader(grade_id, **flags):
        return {"nbgrader": {"grade_id": grade_id, "schema_version": 3, "task": False, "grade": False,
                             "solution": False, "locked": False, **flags}}

    cells = [
        nbformat.v4.new_code_cell(answer, metadata=nbgrader("answer", solution=True)),
        nbformat.v4.new_code_cell("import builtins\n"
                                  "assert not hasattr(builtins, 'left_by_another_student')\n"
                                  "builtins.left_by_another_student = True\n"
                                  "assert value == 42", metadata=nbgrader("test_value", grade=True, locked=True, points=1)),
    ]
    if setup:
        cells.insert(0, nbformat.v4.new_code_cell(setup_cell_source("x/y"), metadata=nbgrader(SETUP_CELL_ID, locked=True)))
    if written is not None:
        cells.append(nbformat.v4.new_markdown_cell(written, metadata=nbgrader("why_value", grade=True, solution=True,
                                                                                points=2)))
    return nbformat.v4.new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})



def tiny_course(root: Path, answers: dict[str, str], setup: bool = False,
                written: dict[str, str] | None = None) -> Path:
    """A course root with the tiny assignment and one submission per ``{student: answer}``."""
    model_answer = "42 is the answer." if written is not None else None
    (root / "source" / TINY).mkdir(parents=True, exist_ok=True)
    nbformat.write(tiny_notebook("### BEGIN SOLUTION\nvalue = 42\n### END SOLUTION", setup, model_answer),
                   str(root / "source" / TINY / f"{TINY}.ipynb"))
    for student, answer in answers.items():
        folder = root / "submitted" / student / TINY
        folder.mkdir(parents=True, exist_ok=True)
        text = written.get(student, "YOUR ANSWER HERE") if written is not None else None
        nbformat.write(tiny_notebook(answer, setup, text), str(folder / f"{TINY}.ipynb"))
    return root
