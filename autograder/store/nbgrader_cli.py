"""Running nbgrader's command line from Python: in a process of its own, or in this one.

    python -m autograder.store.nbgrader_cli <nbgrader arguments>   # what run_nbgrader starts

That is ``nbgrader`` itself, started through this package so that it skips the import
``autograder/__init__.py`` explains (a second of CPU per command), and stamps a gradebook
it creates without running ``alembic heads`` (see :func:`autograder.store.gradebook.alembic_head`).

:func:`run_in_process` runs the same command in the calling process, as that command would run
it (from ``autograder/``, with its nbgrader_config.py): the pipeline's processes that have
nbgrader loaded anyway (the grading run, each worker's nbgrader process, a release build) do not
start Python and import nbgrader again for each command (about 1.2 s of CPU each; the command's
own work, generating a notebook's cells in the gradebook, takes a tenth of a second).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from autograder.places import AUTOGRADER_DIR, COURSE_ROOT, REPO_ROOT
from autograder.store.gradebook import stamp_in_process


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
        [sys.executable, "-m", "autograder.store.nbgrader_cli", *arguments, f"--CourseDirectory.root={root}"],
        cwd=AUTOGRADER_DIR, env=nbgrader_environment(), check=check,
        capture_output=capture, text=True,
    )


def run_in_process(*arguments: str, config=None) -> int:
    """``nbgrader <arguments>`` in this process; nbgrader's exit status (0: it succeeded).

    ``config``: traitlets configuration given to nbgrader's app before its config files (which
    override it, as they override a command line's defaults). The app is created afresh and reset
    afterwards (as nbgrader's own test helper does), and the working folder, ``sys.path`` (which
    nbgrader extends) and environment are restored: one process runs any number of commands.
    Not thread-safe (the working folder is the process's): a process runs one at a time."""
    from jupyter_core.application import NoStart
    from traitlets.config import Config

    from nbgrader.apps.nbgraderapp import NbGraderApp

    if NbGraderApp.initialized():
        raise RuntimeError("an nbgrader app is already running in this process")
    stamp_in_process()
    saved_folder, saved_path, saved_environment = os.getcwd(), list(sys.path), dict(os.environ)
    app = NbGraderApp.instance(config=config or Config())
    try:
        os.chdir(AUTOGRADER_DIR)   # where the command runs: nbgrader reads the working folder's config
        app.initialize(list(arguments))
        app.start()
        return 0
    except NoStart:  # how Jupyter's app says that its subcommand ran
        return 0
    except SystemExit as error:  # nbgrader exits 1 when the command failed
        return error.code if isinstance(error.code, int) else 1
    finally:
        app.reset()
        os.chdir(saved_folder)
        sys.path[:] = saved_path
        os.environ.clear()
        os.environ.update(saved_environment)


if __name__ == "__main__":
    from nbgrader.apps.nbgraderapp import main

    stamp_in_process()
    main()
