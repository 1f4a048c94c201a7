"""Export the grades.

    python -m autograder.export          # make export

* ``autograder/grades.csv``: one row per student and assignment, written by
  ``nbgrader export`` (nbgrader's own CSV: raw_score, late penalty, score, max_score, ...).
* ``autograder/grades_by_question.csv``: student, assignment, notebook, grade_id, score,
  max_score, one row per graded test cell, from the gradebook.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from autograder.nbgrader_cli import AUTOGRADER_DIR, run_nbgrader

QUESTION_COLUMNS = ["student", "assignment", "notebook", "grade_id", "score", "max_score"]


def export_by_question(root: Path, path: Path) -> int:
    from nbgrader.api import Gradebook

    from autograder.grade import COURSE_ID, db_url

    rows = []
    with Gradebook(db_url(root), COURSE_ID) as gb:
        for assignment in gb.assignments:
            for submission in assignment.submissions:
                for notebook in submission.notebooks:
                    for grade in notebook.grades:
                        rows.append([submission.student.id, assignment.name, notebook.name, grade.name,
                                     f"{grade.score:g}", f"{grade.max_score:g}"])
    rows.sort()
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(QUESTION_COLUMNS)
        writer.writerows(rows)
    return len(rows)


def export(root: Path = AUTOGRADER_DIR) -> tuple[Path, Path]:
    root = Path(root).resolve()
    if not (root / "gradebook.db").exists():
        raise SystemExit(f"no gradebook in {root}: run `make grade` first")
    grades = root / "grades.csv"
    run_nbgrader("export", "--to", str(grades), "--log-level=WARN", root=root)
    by_question = root / "grades_by_question.csv"
    export_by_question(root, by_question)
    return grades, by_question


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=AUTOGRADER_DIR)
    options = parser.parse_args(argv)
    for path in export(options.root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
