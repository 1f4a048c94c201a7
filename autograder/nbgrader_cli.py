"""Running nbgrader's command line from Python, the one way the pipeline does it.

    python -m autograder.nbgrader_cli <nbgrader arguments>   # what run_nbgrader starts

That is ``nbgrader`` itself, started through this package so that it skips the import
``autograder/__init__.py`` explains (a second of CPU per command), and stamps a gradebook
it creates without running ``alembic heads`` (see :func:`autograder.gradebook.alembic_head`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from autograder.settings import AUTOGRADER_DIR, COURSE_ROOT, REPO_ROOT


def nbgrader_environment() -> dict[str, str]:
    """The environment for nbgrader and the pipeline's commands: this interpreter's bin folder
    first on PATH, the repository first on PYTHONPATH.

    nbgrader runs the `alembic` executable when it creates a gradebook; outside an
    activated virtual environment that lookup fails unless the venv's bin is on PATH.
    ``autograder`` is not an installed package: a command run from elsewhere finds it there.
    """
    environment = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    environment["PATH"] = bin_dir + os.pathsep + environment.get("PATH", "")
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environment.get("PYTHONPATH")]))
    return environment


def run_nbgrader(*arguments: str, root: Path = COURSE_ROOT, check: bool = True,
                 capture: bool = False) -> subprocess.CompletedProcess:
    """``nbgrader <arguments> --CourseDirectory.root=<root>``, from ``autograder/`` (where its config is)."""
    return subprocess.run(
        [sys.executable, "-m", "autograder.nbgrader_cli", *arguments, f"--CourseDirectory.root={root}"],
        cwd=AUTOGRADER_DIR, env=nbgrader_environment(), check=check,
        capture_output=capture, text=True,
    )


if __name__ == "__main__":
    from nbgrader.apps.nbgraderapp import main

    from autograder.gradebook import stamp_in_process

    stamp_in_process()
    main()
