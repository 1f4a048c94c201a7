"""Emptying the course root: what can be rebuilt, and (asked for by name, confirmed) everything.

    python -m autograder.term.housekeeping clean    # make clean: what the pipeline rebuilds as it was
    python -m autograder.term.housekeeping erase    # make erase-course-root: everything, after a typed "erase"

``clean`` removes only what the next ``make grade`` / ``make feedback`` / ``make export`` /
``make report`` rebuild from what is kept: nbgrader's ``release/``, the feedback pages, the
class reports and the exports.  Kept: everything an instructor typed or received (the gradebook
with every hand grade and comment, the roster, the course settings, the submissions and the
archive of earlier and withdrawn ones, the intake and grading reports), the autograded
notebooks (a resubmission keeps the hand grades of answers it did not change by comparing with
them), and what a running Formgrader needs: the sources (``source/``, which ``make grade``
builds from ``solutions/``: Formgrader lists the assignments it finds there) and its (empty)
``exchange/`` folder, which it creates when it starts -- removed under it, every assignment
vanished from its pages until the next ``make grade`` and a restart.

``erase`` deletes the whole course root, after listing what it holds and reading the word
``erase`` typed on standard input; anything else (or no input) deletes nothing.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from autograder.command_line import command_line

REBUILT = ["release", "feedback", "reports/class", "grades.csv", "grades_by_question.csv"]
CONFIRMATION = "erase"


def clean(root: Path) -> list[str]:
    """Remove what the pipeline rebuilds; the paths removed, relative to ``root``."""
    removed = []
    for name in REBUILT:
        path = root / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def inventory(root: Path) -> list[str]:
    """What the course root holds that nobody can rebuild, in words."""
    def count(pattern: str) -> int:
        return sum(1 for p in root.glob(pattern) if p.is_dir())

    lines = []
    if (root / "gradebook.db").exists():
        lines.append("the gradebook (gradebook.db): every grade, hand grade and comment")
    if (root / "roster.csv").exists():
        rows = (root / "roster.csv").read_text(encoding="utf-8").count("\n") - 1
        lines.append(f"the roster (roster.csv): {max(rows, 0)} students")
    lines.append(f"{count('submitted/*/*')} submissions (submitted/)")
    lines.append(f"{count('archive/*/*/*/*')} earlier and withdrawn submissions (archive/)")
    if (root / "course_settings.json").exists():
        lines.append("the course settings (course_settings.json)")
    return lines


def erase(root: Path, answer: str) -> bool:
    if answer.strip() != CONFIRMATION:
        return False
    shutil.rmtree(root)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__, course_root=True)
    parser.add_argument("command", choices=("clean", "erase"))
    options = parser.parse_args(argv)
    root = options.root
    if not root.is_dir():
        print(f"{root}: no course root, nothing to do")
        return 0
    if options.command == "clean":
        removed = clean(root)
        print(f"removed from {root}: {', '.join(removed) or 'nothing'} (rebuilt by make grade / feedback / export / "
              "report); kept: the gradebook, roster, settings, submissions, archive, reports, autograded notebooks "
              "and what Formgrader lists assignments from, source/ and exchange/ (a running Formgrader keeps working)")
        return 0
    print(f"This deletes the course root {root} and everything in it, for good:")
    for line in inventory(root):
        print(f"  - {line}")
    print(f"Type {CONFIRMATION} to delete it (anything else keeps it): ", end="", flush=True)
    answer = sys.stdin.readline()
    if not erase(root, answer):
        print("\nnothing deleted")
        return 1
    print(f"deleted {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
