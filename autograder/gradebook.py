"""The course root's nbgrader gradebook, opened one way by grading, feedback and export."""

from __future__ import annotations

import warnings
from pathlib import Path

from autograder.settings import COURSE_ID


def db_url(root: Path) -> str:
    return f"sqlite:///{Path(root) / 'gradebook.db'}"


def open_gradebook(root: Path):
    """nbgrader's ``Gradebook`` of a course root (use it as a context manager)."""
    from nbgrader.api import Gradebook

    warnings.filterwarnings("ignore", message=".*not in session.*")  # nbgrader's own SQLAlchemy noise
    return Gradebook(db_url(root), COURSE_ID)
