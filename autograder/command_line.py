"""What every ``python -m autograder...`` command's command line shares: its module docstring as its
description (the usage lines kept as written) and, for a command on the course root, ``--root``."""

from __future__ import annotations

import argparse
from pathlib import Path

from autograder.places import COURSE_ROOT, COURSE_ROOT_VARIABLE


def command_line(description: str | None, *, course_root: bool = False) -> argparse.ArgumentParser:
    """The parser of a command described by ``description`` (its module's ``__doc__``)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if course_root:
        parser.add_argument("--root", type=Path, default=COURSE_ROOT,
                            help=f"the course root (default: autograder/course_root/, or ${COURSE_ROOT_VARIABLE})")
    return parser
