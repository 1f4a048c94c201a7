"""`make clean` removes only what the pipeline rebuilds; the whole course root goes only through
a separately named command, after the word "erase" is typed (issue #35, item 5)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from autograder.places import COURSE_ROOT_VARIABLE
from tests.readme_commands import run_readme_command

KEPT = ["gradebook.db", "roster.csv", "course_settings.json", "submitted/ann/01_mha_shapes/01_mha_shapes.ipynb",
        "archive/withdrawn/bob/01_mha_shapes/20260301T120000/01_mha_shapes.ipynb",
        "archive/submitted/ann/01_mha_shapes/20260228T120000/01_mha_shapes.ipynb",
        "reports/intake_report.md", "reports/intake/20260301T120000.md", "reports/grading_report.md",
        "reports/grading_history.md", "autograded/ann/01_mha_shapes/01_mha_shapes.ipynb",
        "exchange/.keep", "source/01_mha_shapes/01_mha_shapes.ipynb"]   # what a running Formgrader needs
# (tests/test_formgrader_buttons.py runs `make clean` under one)
REBUILT = ["release/01_mha_shapes/01_mha_shapes.ipynb",
           "feedback/ann/01_mha_shapes/01_mha_shapes.html", "reports/class/01_mha_shapes/index.html", "grades.csv",
           "grades_by_question.csv"]


def make(root: Path, target: str, answer: str) -> subprocess.CompletedProcess:
    """The README's `make <target>`, on the course root ``root``, ``answer`` typed at its prompt."""
    return run_readme_command(f"make {target}", input=answer, env=dict(os.environ, **{COURSE_ROOT_VARIABLE: str(root)}),
                              timeout=300)


def test_make_clean_keeps_what_was_typed_or_received_and_erasing_needs_the_typed_word(tmp_path):
    root = tmp_path / "course_root"
    for name in KEPT + REBUILT:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)
    (root / "roster.csv").write_text("id,first_name\nann,Ann\nbob,Bob\n")
    cleaned = make(root, "clean", "")
    assert cleaned.returncode == 0, cleaned.stdout + cleaned.stderr
    assert [n for n in KEPT if not (root / n).exists()] == [], "make clean deleted what nobody can rebuild"
    assert [n for n in REBUILT if (root / n).exists()] == []
    # erasing: nothing without the word typed
    for answer in ("", "yes\n", "ERASE it\n"):
        refused = make(root, "erase-course-root", answer)
        assert refused.returncode != 0 and "nothing deleted" in refused.stdout, refused.stdout
        assert all((root / n).exists() for n in KEPT)
    assert "the roster (roster.csv): 2 students" in refused.stdout and "1 submissions" in refused.stdout
    erased = make(root, "erase-course-root", "erase\n")
    assert erased.returncode == 0 and not root.exists(), erased.stdout + erased.stderr
