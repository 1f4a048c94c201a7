"""Running nbgrader's command line from Python, the one way the pipeline does it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from autograder.settings import AUTOGRADER_DIR, COURSE_ROOT


def nbgrader_environment() -> dict[str, str]:
    """The environment for nbgrader: this interpreter's bin folder first on PATH.

    nbgrader runs the `alembic` executable when it creates a gradebook; outside an
    activated virtual environment that lookup fails unless the venv's bin is on PATH.
    """
    environment = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    environment["PATH"] = bin_dir + os.pathsep + environment.get("PATH", "")
    return environment


def run_nbgrader(*arguments: str, root: Path = COURSE_ROOT, check: bool = True,
                 capture: bool = False) -> subprocess.CompletedProcess:
    """``nbgrader <arguments> --CourseDirectory.root=<root>``, from ``autograder/`` (where its config is)."""
    return subprocess.run(
        [sys.executable, "-m", "nbgrader", *arguments, f"--CourseDirectory.root={root}"],
        cwd=AUTOGRADER_DIR, env=nbgrader_environment(), check=check,
        capture_output=capture, text=True,
    )
