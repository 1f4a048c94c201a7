"""Intake and submission times (issue #35, items 2 and 6; issue #56): Canvas's zip taken as
downloaded, its times known for what they are (the zip's), its late marker deciding; a copy's
times never made into lateness; a zip's times read in the right zone; the export's times
cross-checked in the report with the count of late submissions; the newest submission wins and a
withdrawn one stays withdrawn -- no kernels, fast."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
import zipfile
import zoneinfo
from pathlib import Path

import nbformat

from autograder.term import roster
from autograder.term.course_settings import CourseSettings
from autograder.publishing.release import REPO_ROOT
from autograder.places import COURSE_ROOT_VARIABLE
from tests.canvas import download_name, write_download
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


def canvas_zip(path: Path, late: set[str], built: datetime.datetime) -> Path:
    """Notebook 01 from ann, bob and cy as Canvas's "Download Submissions" zips it (``late``:
    those Canvas marks late), every entry stamped with the time Canvas built it."""
    people = {"ann": ("Lee, Ann", 11), "bob": ("Ray, Bob", 12), "cy": ("Doe, Cy", 13)}
    files = {download_name(name, user, 900 + user, f"{ASSIGNMENT}.ipynb", late=student in late):
             nbformat.writes(notebook(f"\n# {student}")).encode() for student, (name, user) in people.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_download(path, files, built)


def test_canvas_zip_is_taken_as_downloaded_and_its_late_marker_decides(tmp_path):
    """`make intake SUBMISSIONS=<the zip>`: Canvas stamps every entry with the time it built the zip
    (three days after the deadline here), so the times are said not to be submission times and the
    ``_LATE_`` mark decides: 1 s late, not three days; the others at the due date."""
    root = course(tmp_path)
    CourseSettings(late_penalty="zero").save(root)
    canvas_zip(tmp_path / "Downloads" / "submissions.zip", {"bob"}, (DUE + datetime.timedelta(days=3)))
    result = run_readme_command("make intake SUBMISSIONS=~/Downloads/submissions.zip",
                                env=dict(os.environ, HOME=str(tmp_path), **{COURSE_ROOT_VARIABLE: str(root)}))
    assert result.returncode == 0, result.stdout + result.stderr
    assert stamp(root, "ann") == stamp(root, "cy") == "2026-03-01 17:00:00.000000 UTC"
    assert stamp(root, "bob") == "2026-03-01 17:00:01.000000 UTC"
    report = (root / "reports" / "intake_report.md").read_text()
    assert f"1 late submission: bob/{ASSIGNMENT} (late penalty zero" in report, report
    assert "3 file times are not a submission time: Canvas's download stamps each file with the time it built the zip" \
        in report, report
    assert "Canvas marks it late and its download holds no submission time: taken as 1 s late" in report
    # the zip is only read, and each file as Canvas sent it is kept beside the notebook filed
    with zipfile.ZipFile(tmp_path / "Downloads" / "submissions.zip") as download:
        bob = next(n for n in download.namelist() if n.startswith("raybob_LATE_12_912_"))
        assert (root / "submitted" / "bob" / ASSIGNMENT / ".received" / bob).read_bytes() == download.read(bob)


def test_a_copied_canvas_export_never_turns_the_late_mark_into_months_of_lateness(tmp_path):
    """Issue #56, "Wrong 2": a Canvas export copied with plain `cp` -- every file stamped "now",
    a few seconds apart, months after the deadline. Ten minutes late (Canvas marks it) with a
    grace period of 15 minutes: not late, not 0. The report says the times are the copy's."""
    root = course(tmp_path)
    CourseSettings(late_penalty="zero", grace_minutes=15).save(root)
    canvas_zip(tmp_path / "submissions.zip", {"bob"}, DUE + datetime.timedelta(minutes=10))
    copied = tmp_path / "copied"
    with zipfile.ZipFile(tmp_path / "submissions.zip") as download:
        download.extractall(copied)     # extracted, then copied: each file "now", as `cp` leaves it
    for number, path in enumerate(sorted(copied.iterdir())):
        moment = time.time() + number   # a copy's few seconds
        os.utime(path, (moment, moment))
    result = intake_command(copied, root)
    assert result.returncode == 0, result.stdout
    assert stamp(root, "bob") == "2026-03-01 17:00:01.000000 UTC"    # not months: the least the mark allows
    settings = CourseSettings.load(root)
    filed = datetime.datetime(2026, 3, 1, 17, 0, 1)
    assert settings.seconds_late("bob", ASSIGNMENT, filed, DUE) == 0, "inside the grace period: no penalty"
    report = (root / "reports" / "intake_report.md").read_text()
    assert "0 late submissions" in report and "not a submission time" in report, report
    assert "look its time up in SpeedGrader" in report


def test_copied_times_after_the_deadline_are_refused_unless_an_lms_mark_decides(tmp_path):
    """A plain folder (no LMS mark) copied without its times: a copy made before the due date proves
    the submissions on time; one made after it cannot tell, and the files are refused, saying why
    -- never filed as months late. A time in the future is not a submission time either."""
    root = course(tmp_path)
    copied = export(tmp_path / "copied", {f"{s}/01_mha_shapes.ipynb": (notebook(s), datetime.datetime.now(UTC))
                                          for s in ("ann", "bob", "cy")})
    result = intake_command(copied, root)
    assert result.returncode != 0 and not (root / "submitted").exists(), result.stdout
    report = (root / "reports" / "intake_report.md").read_text()
    assert "3 file times are not a submission time: all 3 files were written within" in report, report
    assert "is after the due date: whether it was late cannot be told" in report and "cp -p" in report
    # one file copied alone: as new as the folder it was copied into
    alone = export(tmp_path / "alone", {"ann/01_mha_shapes.ipynb": (notebook("ann"), datetime.datetime.now(UTC))})
    assert intake_command(alone, root).returncode != 0
    assert "its time is that of the export itself" in (root / "reports" / "intake_report.md").read_text()
    # the same copy, made before a due date still to come: on time
    roster.set_deadlines({ASSIGNMENT: datetime.datetime.now() + datetime.timedelta(days=7)}, root)
    assert intake_command(copied, root).returncode == 0
    assert (root / "submitted" / "ann" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb").exists()
    future = datetime.datetime.now(UTC) + datetime.timedelta(days=3)
    later = export(tmp_path / "future", {"ann/01_mha_shapes.ipynb": (notebook("\n# again"), future)})
    intake_command(later, root)
    assert "not a submission time: its time is in the future" in (root / "reports" / "intake_report.md").read_text()


def test_a_moodle_download_is_on_time_and_says_that_lateness_is_not_known(tmp_path):
    """Moodle's zip writer stamps every file with the time it built the zip, and Moodle marks no
    lateness: filed at the due date, saying so -- not a day late for the day the download waited."""
    root = course(tmp_path)
    archive = tmp_path / "moodle.zip"
    built = (DUE + datetime.timedelta(days=1)).timetuple()[:6]
    with zipfile.ZipFile(archive, "w") as handle:
        handle.writestr(zipfile.ZipInfo("Ann Lee_11_assignsubmission_file_/01_mha_shapes.ipynb", date_time=built),
                        nbformat.writes(notebook()))
    assert intake_command(archive, root).returncode == 0
    assert stamp(root, "ann") == "2026-03-01 17:00:00.000000 UTC"
    report = (root / "reports" / "intake_report.md").read_text()
    assert "Moodle marks no lateness and its download holds no submission time" in report, report
    assert "0 late submissions" in report


def test_zip_entry_times_are_read_as_the_zip_wrote_them(tmp_path):
    """A zip's DOS times have no zone: read in the course's time zone; an extended (UTC) timestamp,
    where the zip has one, is exact."""
    from autograder.term.intake_files import zip_entry_time

    berlin = zoneinfo.ZoneInfo("Europe/Berlin")
    plain = zipfile.ZipInfo("ann/x.ipynb", date_time=(2026, 3, 1, 18, 0, 0))   # 18:00 in Berlin, winter
    assert zip_entry_time(plain, berlin) == datetime.datetime(2026, 3, 1, 17, 0, tzinfo=UTC)
    exact = datetime.datetime(2026, 3, 1, 16, 59, 58, tzinfo=UTC)
    stamped = zipfile.ZipInfo("ann/x.ipynb", date_time=(2026, 3, 1, 12, 0, 0))
    stamped.extra = (0x5455).to_bytes(2, "little") + (5).to_bytes(2, "little") + bytes([1]) + \
        int(exact.timestamp()).to_bytes(4, "little")                          # Info-ZIP's "UT" field
    assert zip_entry_time(stamped, berlin) == exact
    # through the intake: a zipped folder of submissions, its time read in the course's zone
    root = course(tmp_path)
    settings = CourseSettings.load(root)
    settings.time_zone = "Europe/Berlin"
    settings.save(root)
    archive = tmp_path / "handed-in.zip"
    with zipfile.ZipFile(archive, "w") as handle:
        handle.writestr(zipfile.ZipInfo("ann/01_mha_shapes.ipynb", date_time=(2026, 3, 1, 17, 30, 0)),
                        nbformat.writes(notebook()))
    assert intake_command(archive, root).returncode == 0
    assert stamp(root, "ann") == "2026-03-01 16:30:00.000000 UTC"     # on time: 17:30 in Berlin is 16:30 UTC


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
