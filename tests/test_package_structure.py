"""autograder/'s layout: a command moved into a folder still runs by its old name, saying where it went."""

from __future__ import annotations

import contextlib
import importlib
import io
import runpy
import subprocess
import sys

import pytest

from autograder import MOVED_COMMANDS
from autograder.places import REPO_ROOT


def test_a_moved_command_runs_by_its_old_name_and_says_where_it_went():
    result = subprocess.run([sys.executable, "-m", "autograder.grade", "--help"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--submission-timeout" in result.stdout
    assert "`python -m autograder.grade` is now `python -m autograder.grading.grade`" in result.stderr


@pytest.mark.parametrize("old", sorted(MOVED_COMMANDS))
def test_every_moved_command_runs_the_module_it_moved_to(old, monkeypatch):
    """As `python -m <old> --help` runs it (in this process: one Python for all of them)."""
    monkeypatch.setattr(sys, "argv", [old, "--help"])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as exit:
        runpy.run_module(old, run_name="__main__", alter_sys=True)
    assert exit.value.code == 0
    new = MOVED_COMMANDS[old]
    assert printed.getvalue().startswith("usage:"), printed.getvalue()
    assert importlib.import_module(new).__doc__.split("\n")[0].strip() in printed.getvalue()
