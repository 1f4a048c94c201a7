"""Intake and submission times (issue #35, items 2 and 6): the LMS's late marker wins over a
file time, the export's times are cross-checked in the report with the count of late
submissions, the newest submission wins and a withdrawn one stays withdrawn -- no kernels, fast."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import nbformat

from autograder.term import intake, roster
from autograder.term.course_settings import CourseSettings
from autograder.places import REPO_ROOT
from autograder.places import COURSE_ROOT_VARIABLE
from tests.readme_commands import run_readme_command

ASSIGNMENT = "01_mha_shapes"
ROSTER = "id,first_name,last_name,email,lms_user_id\nann,Ann,Lee,,11\nbob,Bob,Ray,,12\ncy,Cy,Doe,,13\n"
DUE = datetime.datetime(2026, 3, 1, 17, 0)    # naive UTC, as the gradebook keeps it
UTC = datetime.timezone.utc


def notebook(mark: str = ""):
    released = nbformat.read(REPO_ROOT / "course" / f"{ASSIGNMENT}.ipynb", as_version=4)
    released.cells[-1].source += mark
    return released


def export(folder: Path, files: dict[str, tuple[object, datetime.datetime]]) -> Path:
    for name, (content, moment) in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(content, str(path))
        os.utime(path, (moment.timestamp(), moment.timestamp()))
    return folder


def course(tmp_path: Path) -> Path:
    root = tmp_path / "course_root"
    root.mkdir()
    (root / roster.ROSTER_FILE).write_text(ROSTER)
    roster.set_deadlines({ASSIGNMENT: DUE}, root)    # make deadlines
    return root


def intake_command(folder: Path, root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autograder.term.intake", str(folder), "--root", str(root)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def stamp(root: Path, student: str) -> str:
    return (root / "submitted" / student / ASSIGNMENT / "timestamp.txt").read_text().strip()


def at(hours: float) -> datetime.datetime:
    return (DUE + datetime.timedelta(hours=hours)).replace(tzinfo=UTC)


def test_canvas_late_marker_wins_over_file_times_and_the_report_counts_late_submissions(tmp_path):
    root = course(tmp_path)
    CourseSettings(late_penalty="zero").save(root)
    folder = export(tmp_path / "Downloads" / "lms-export", {
        "leeann_11_901_01_mha_shapes.ipynb": (notebook(), at(-2)),            # on time
        "raybob_LATE_12_902_01_mha_shapes.ipynb": (notebook(), at(-1)),       # marked late, file time not
        "doecy_13_903_01_mha_shapes.ipynb": (notebook(), at(30)),             # not marked late, file time late
    })
    result = run_readme_command("make intake SUBMISSIONS=~/Downloads/lms-export",
                                env=dict(os.environ, HOME=str(tmp_path), **{COURSE_ROOT_VARIABLE: str(root)}))
    assert result.returncode == 0, result.stdout + result.stderr
    assert stamp(root, "ann") == "2026-03-01 15:00:00.000000 UTC"
    assert stamp(root, "bob") == "2026-03-01 17:00:01.000000 UTC"
    assert stamp(root, "cy") == "2026-03-01 17:00:00.000000 UTC"
    report = (root / "reports" / "intake_report.md").read_text()
    assert f"1 late submission: bob/{ASSIGNMENT} (late penalty zero" in report, report
    assert "Canvas marks it late but its file time" in report and "Canvas does not mark it late" in report


def test_copied_export_times_are_flagged_all_identical_all_late_and_in_the_future(tmp_path):
    root = course(tmp_path)
    copied = datetime.datetime(2026, 12, 1, 9, 0, tzinfo=UTC)     # nine months later: `cp` without -p
    folder = export(tmp_path / "copied", {f"{s}/01_mha_shapes.ipynb": (notebook(), copied) for s in ("ann", "bob", "cy")})
    result = intake_command(folder, root)
    report = (root / "reports" / "intake_report.md").read_text()
    assert "all 3 files have the same modification time" in report, report
    assert "every one of the 3 submissions is after its due date" in report
    assert "3 late submissions" in report and "NOTE: all 3 files" in result.stdout
    future = datetime.datetime.now(UTC) + datetime.timedelta(days=3)
    later = export(tmp_path / "future", {"ann/01_mha_shapes.ipynb": (notebook("\n# again"), future)})
    intake_command(later, root)
    assert "1 file time is in the future" in (root / "reports" / "intake_report.md").read_text()


def test_the_newest_submission_wins_and_a_withdrawn_one_stays_withdrawn(tmp_path):
    root = course(tmp_path)
    newer = export(tmp_path / "newer", {"ann/01_mha_shapes.ipynb": (notebook("\n# second try"), at(-1)),
                                        "bob/01_mha_shapes.ipynb": (notebook("\n# bob"), at(-1))})
    older = export(tmp_path / "older", {"ann/01_mha_shapes.ipynb": (notebook("\n# first try"), at(-5)),
                                        "bob/01_mha_shapes.ipynb": (notebook("\n# bob"), at(-1))})
    assert intake_command(newer, root).returncode == 0
    filed = (root / "submitted" / "ann" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb").read_text()
    roster.withdraw("bob", ASSIGNMENT, root)                              # make withdraw STUDENT=bob ...
    # `make intake`, the export's folder in SUBMISSIONS
    again = run_readme_command("make intake", env=dict(os.environ, SUBMISSIONS=str(older),
                                                       **{COURSE_ROOT_VARIABLE: str(root)}))
    assert again.returncode != 0, "make intake must fail when it refused files"
    assert (root / "submitted" / "ann" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb").read_text() == filed
    assert stamp(root, "ann") == "2026-03-01 16:00:00.000000 UTC"
    assert not (root / "submitted" / "bob").exists(), "a withdrawn submission came back"
    assert "the newest submission wins" in again.stdout and "it stays withdrawn" in again.stdout, again.stdout


def test_a_resubmission_replacing_a_hand_graded_one_says_so(tmp_path):
    from autograder.store import gradebook

    root = course(tmp_path)
    first = export(tmp_path / "first", {"ann/01_mha_shapes.ipynb": (notebook("\n# one"), at(-5))})
    assert intake_command(first, root).returncode == 0
    with gradebook.open_gradebook(root) as gb:   # a TA graded her written answer in Formgrader
        gb.update_or_create_notebook(ASSIGNMENT, ASSIGNMENT)
        gb.add_grade_cell("why_contiguous", ASSIGNMENT, ASSIGNMENT, max_score=1, cell_type="markdown")
        gb.update_or_create_student("ann")
        gb.add_submission(ASSIGNMENT, "ann")
        gb.find_grade("why_contiguous", ASSIGNMENT, ASSIGNMENT, "ann").manual_score = 1.0
        gb.db.commit()
    second = export(tmp_path / "second", {"ann/01_mha_shapes.ipynb": (notebook("\n# two"), at(-1))})
    result = intake_command(second, root)
    assert result.returncode == 0, result.stdout
    assert "graded or commented by hand (why_contiguous)" in result.stdout, result.stdout
    assert "graded or commented by hand (why_contiguous)" in (root / "reports" / "intake_report.md").read_text()
