"""Shared fixtures: one fresh build of every notebook (source and student release) per test session."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

from autograder import release  # noqa: E402

REPO_ROOT = release.REPO_ROOT
ASSIGNMENTS = release.assignment_names()


@dataclass(frozen=True)
class Build:
    """Where a fresh build put the instructor (source) and student (release) notebooks."""

    course_dir: Path
    autograder_dir: Path

    def source(self, assignment: str) -> Path:
        return self.autograder_dir / "source" / assignment / f"{assignment}.ipynb"

    def release(self, assignment: str) -> Path:
        return self.course_dir / f"{assignment}.ipynb"


@pytest.fixture(scope="session")
def fresh_build(tmp_path_factory) -> Build:
    root = tmp_path_factory.mktemp("build")
    build = Build(course_dir=root / "course", autograder_dir=root / "autograder")
    release.build(ASSIGNMENTS, build.course_dir, build.autograder_dir)
    return build
