"""A small example class for a dry run of a term (``make example-class``).

    python -m autograder.term.example_class [--dest example-class]

Writes, from the current release in ``course/`` and the answers of ``solutions/`` (so it is
never stale, and no answer is committed twice):

* ``roster.csv``: four students, with the ids Canvas puts in its file names;
* ``deadlines.csv``: a due date for every assignment;
* ``submissions.zip``: notebook 01 handed in by each, as Canvas's *Download Submissions* gives it
  (``<sortable name>[_LATE]_<user id>_<file id>_<file name>``, every file stamped with the time
  Canvas built the zip): Alice solved everything, on time; Bob answered nothing; Ana solved
  everything a day late (Canvas marks it ``_LATE_``); Dan answered the first half (code and
  written answers), and his file is a Colab copy (``Copy of 01_mha_shapes.ipynb``).

The folder is git-ignored; the dry run (docs/instructors/2-dry-run.md) takes it through roster, deadlines, settings,
intake and grading.
"""

from __future__ import annotations

import datetime
import shutil
import sys
import zipfile
from pathlib import Path

import nbformat

from autograder.command_line import command_line
from autograder.places import REPO_ROOT
from autograder.publishing.release import assignment_names, build_source, course_repository, released_notebook

ASSIGNMENT = "01_mha_shapes"
FIRST_DUE = datetime.datetime(2026, 3, 2, 17, 0, tzinfo=datetime.timezone.utc)
ROSTER = """id,first_name,last_name,email,lms_user_id
alice,Alice,Liddell,alice@uni.example,1001
bob,Bob,Builder,bob@uni.example,1002
nunez,Ana,Núñez,ana.nunez@uni.example,1003
dan,Dan,Smith,dan@uni.example,1004
"""


def handed_in(answered: float) -> nbformat.NotebookNode:
    """Notebook 01 as released, with the first ``answered`` fraction of its answer cells solved."""
    solutions = {c.metadata["nbgrader"]["grade_id"]: c.source for c in build_source(ASSIGNMENT, course_repository()).cells
                 if c.metadata.get("nbgrader", {}).get("solution")}
    notebook = nbformat.read(released_notebook(ASSIGNMENT), as_version=4)
    answers = [c for c in notebook.cells if c.metadata.get("nbgrader", {}).get("grade_id") in solutions]
    for cell in answers[:round(len(answers) * answered)]:
        cell.source = solutions[cell.metadata["nbgrader"]["grade_id"]]
    return notebook


def write(dest: Path) -> Path:
    """The example class in ``dest``; the path of its Canvas download."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    (dest / "roster.csv").write_text(ROSTER, encoding="utf-8")
    lines = ["assignment,duedate"] + [f"{name},{(FIRST_DUE + datetime.timedelta(weeks=n)).isoformat()}"
                                      for n, name in enumerate(assignment_names())]
    (dest / "deadlines.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    files = {"liddellalice_1001_5001_01_mha_shapes.ipynb": 1.0,
             "builderbob_1002_5002_01_mha_shapes.ipynb": 0.0,
             "nunezana_LATE_1003_5003_01_mha_shapes.ipynb": 1.0,
             "smithdan_1004_5004_Copy of 01_mha_shapes.ipynb": 0.5}
    built = FIRST_DUE + datetime.timedelta(days=2)   # Canvas's server time when it built the zip (no zone)
    download = dest / "submissions.zip"
    with zipfile.ZipFile(download, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, answered in files.items():
            info = zipfile.ZipInfo(name, date_time=built.timetuple()[:6])
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, nbformat.writes(handed_in(answered)))
    return download


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__)
    parser.add_argument("--dest", type=Path, default=REPO_ROOT / "example-class")
    options = parser.parse_args(argv)
    write(options.dest)
    print(f"example class in {options.dest}: roster.csv, deadlines.csv, submissions.zip (a Canvas download: four "
          "students, notebook 01)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
