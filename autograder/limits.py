"""The limits of one grading run, defined once: their defaults and the grace of an interrupted kernel.

A course sets four of them for the term (``make settings``: :class:`autograder.term.course_settings.CourseSettings`,
whose :meth:`~autograder.term.course_settings.CourseSettings.limits` gives a run its limits);
``python -m autograder.grading.grade --help`` overrides any for one run.  The parent process
fingerprints them (a change of those that change what a notebook does re-executes it), and each task
carries them, as this dataclass, to the Dask worker and on to its nbgrader process, where they hold.

``timeout`` is a cell's, as everywhere in the course (``make settings TIMEOUT=``, ``--timeout``,
nbgrader's ``Execute.timeout``); the others say what they limit.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass


@dataclass
class Limits:
    timeout: int = 120                 # seconds a cell may run, counted from the cell's own start
    startup_timeout: int = 300         # seconds to start a kernel and run the setup cell (imports torch)
    notebook_timeout: int = 1800       # seconds per attempt at a whole submission
    submission_timeout: int = 3600     # seconds for a submission, all its attempts together
    cpu_seconds: int = 3600            # CPU seconds of a submission's sandbox, all attempts
    memory_mb: int = 4096              # memory of a kernel, and of its whole sandbox
    file_mb: int = 256                 # largest file a student kernel may write
    disk_mb: int = 512                 # what a kernel may write: /tmp, /dev/shm, its folders
    processes: int = 256               # processes (and threads) in a sandbox at once
    max_output_bytes: int = 1_000_000  # output kept per cell
    attempts: int = 6                  # restarts after a kernel died or hung
    unresponsive_grace: int = 10       # least seconds an interrupted kernel has to answer
    sandbox: str = "on"                # on (refuses without bubblewrap) | off
    threads: int = 1                   # torch/BLAS threads per kernel

    @property
    def sandboxed(self) -> bool:
        """Whether student code runs in the sandbox (``make grade SANDBOX=off`` says it does not)."""
        return self.sandbox != "off"

    @property
    def grace(self) -> int:
        """Seconds an interrupted kernel has to answer: a quarter of the cell limit, at least
        ``unresponsive_grace`` (a loaded machine slows the answer as much as the cell)."""
        return max(self.unresponsive_grace, self.timeout // 4)

    def fingerprint(self) -> str:
        """The limits that change what a notebook does when it runs (a change regrades it)."""
        values = dataclasses.asdict(self)
        for name in ("notebook_timeout", "submission_timeout", "cpu_seconds", "startup_timeout", "threads",
                     "unresponsive_grace", "attempts"):
            values.pop(name)
        return json.dumps(values, sort_keys=True)
