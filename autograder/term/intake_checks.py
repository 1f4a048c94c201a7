"""What intake checks beyond a file's contents: when it was submitted, and whether it may replace
what is filed.

**Submission time.**  A file's modification time is the submission time only when the export
kept it (unzipped as downloaded); a plain ``cp`` stamps every file "now".  Where the LMS's
export says more, it wins: Canvas marks a late submission ``_LATE_`` in its file name (a file
marked late whose time is not after the due date is taken as one second late; one not marked
late whose time is after it, as submitted at the due date).  The export as a whole is then
cross-checked (:func:`export_notices`): every file with the same time, every file after its
due date, a time in the future; each said in the intake report, with the count of late
submissions under the course settings (extensions and grace period included).

**Replacing.**  The newest submission wins: a file older than the submission already filed
(an older export taken in again) is refused; so is one identical to a submission withdrawn
with ``make withdraw`` (it stays withdrawn).  A resubmission replacing one a grader graded or
commented by hand says so (:func:`hand_graded`): the next ``make grade`` keeps those grades
for answers that did not change and drops, names and archives the others.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from autograder.store import gradebook
from autograder.term.course_settings import CourseSettings

UTC = datetime.timezone.utc
STAMP_FORMAT = "%Y-%m-%d %H:%M:%S.%f UTC"   # nbgrader's timestamp.txt


def stamp_text(moment: datetime.datetime) -> str:
    return moment.astimezone(UTC).strftime(STAMP_FORMAT)


def parse_stamp(text: str) -> datetime.datetime | None:
    try:
        return datetime.datetime.strptime(text.strip(), STAMP_FORMAT).replace(tzinfo=UTC)
    except ValueError:
        return None


def due_dates(root: Path) -> dict[str, datetime.datetime]:
    """``{assignment: due date}`` (aware, UTC) from the course's gradebook (``make deadlines``)."""
    if not gradebook.exists(root):
        return {}
    with gradebook.exclusive(root) as gb:
        return {a.name: a.duedate.replace(tzinfo=UTC) for a in gb.assignments if a.duedate}


def submission_time(mtime: float, canvas_late: bool | None,
                    due: datetime.datetime | None) -> tuple[datetime.datetime, str | None]:
    """The submission time of a file (its modification time, corrected by Canvas's late
    marker where the two disagree), and why it was corrected."""
    moment = datetime.datetime.fromtimestamp(mtime, UTC)
    if canvas_late is None or due is None:
        return moment, None
    if canvas_late and moment <= due:
        return due + datetime.timedelta(seconds=1), (
            f"Canvas marks it late but its file time ({stamp_text(moment)}) is not after the due date: "
            "taken as 1 s late (Canvas's export gives no exact time)")
    if not canvas_late and moment > due:
        return due, (f"its file time ({stamp_text(moment)}) is after the due date but Canvas does not mark it "
                     "late: taken as submitted at the due date")
    return moment, None


def export_notices(file_times: list[datetime.datetime], due: dict[str, datetime.datetime],
                   filed: list[tuple[str, str, datetime.datetime]], settings: CourseSettings,
                   now: datetime.datetime | None = None) -> list[str]:
    """What the intake report says about this export's times: ``file_times`` of every file
    taken, ``filed`` as ``(student, assignment, submission time)``."""
    now = now or datetime.datetime.now(UTC)
    notices = []
    if len(file_times) > 1 and len(set(file_times)) == 1:
        notices.append(f"all {len(file_times)} files have the same modification time ({stamp_text(file_times[0])}): "
                       "the export was probably copied without its file times (cp without -p, an upload tool); "
                       "unzip the LMS's download itself to keep them, or the late penalties are wrong")
    future = [t for t in file_times if t > now + datetime.timedelta(minutes=5)]
    if future:
        notices.append(f"{len(future)} file time{'s are' if len(future) != 1 else ' is'} in the future "
                       f"(latest {stamp_text(max(future))}): this machine's clock or the export's is wrong")
    dated = [(s, a, t) for s, a, t in filed if a in due]
    if len(dated) > 1 and all(t > due[a] for _, a, t in dated):
        notices.append(f"every one of the {len(dated)} submissions is after its due date: check that the export "
                       "kept the submission times (and the due dates, `make deadlines`)")
    if not due:
        notices.append("no due dates in the gradebook (`make deadlines`): lateness is not known yet")
    else:
        late = [f"{s}/{a}" for s, a, t in dated
                if settings.seconds_late(s, a, t.replace(tzinfo=None), due[a].replace(tzinfo=None)) > 0]
        notices.append(f"{len(late)} late submission{'s' if len(late) != 1 else ''}"
                       + (f": {', '.join(late)}" if late else "")
                       + f" (late penalty {settings.late_penalty}, grace {settings.grace_minutes:g} min)")
    return notices


def replacement_refusal(folder: Path, text: str, when: datetime.datetime, root: Path) -> str | None:
    """Why the notebook ``text`` (submitted at ``when``) must not be filed in ``folder``, or None."""
    stamp = folder / "timestamp.txt"
    filed = parse_stamp(stamp.read_text(encoding="utf-8")) if stamp.is_file() else None
    if filed and when < filed and any(folder.glob("*.ipynb")):
        return (f"older ({stamp_text(when)}) than the submission already filed ({stamp_text(filed)}): "
                "the newest submission wins")
    relative = folder.relative_to(root / "submitted")
    withdrawn = root / "archive" / "withdrawn" / relative
    for earlier in sorted(withdrawn.glob("*/*.ipynb")) if withdrawn.is_dir() else []:
        if earlier.read_text(encoding="utf-8") == text:
            return (f"this submission was withdrawn (kept in {earlier.parent.relative_to(root)}): it stays withdrawn")
    return None


def hand_graded(root: Path) -> dict[tuple[str, str], list[str]]:
    """``{(student, assignment): [cells a grader scored or commented by hand]}`` in the gradebook."""
    if not gradebook.exists(root):
        return {}
    found: dict[tuple[str, str], list[str]] = {}
    with gradebook.exclusive(root) as gb:
        for assignment in gb.assignments:
            for submission in assignment.submissions:
                cells = sorted({g.name for n in submission.notebooks for g in n.grades
                                if g.manual_score is not None or g.extra_credit}
                               | {c.name for n in submission.notebooks for c in n.comments if c.manual_comment})
                if cells:
                    found[(submission.student.id, assignment.name)] = cells
    return found
