"""What intake checks beyond a file's contents: when it was submitted, and whether it may replace
what is filed.

**Submission time.**  A file's time is its submission time only when nothing says otherwise
(:func:`not_a_submission_time`, :func:`copied_together`): Canvas's and Moodle's downloads
stamp every file with the time they built the zip; a copy that did not keep the times (``cp``
without ``-p``) stamps them with its own, all within a few seconds and as new as the export;
and no submission comes from the future.  Such a time still comes *after* the submission,
which bounds it: before the due date, the submission was on time; after it, Canvas's
``_LATE_`` mark decides, Moodle's download counts as on time (it tells nothing; the report says
so), and any other file is refused (its lateness cannot be told) -- :func:`submission_time`,
never months of lateness made up from a copy's time.  The intake
report says which times were not submission times and why, every file after its due date, a
time in the future, and the count of late submissions under the course settings
(:func:`export_notices`: extensions and grace period included).

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


COPY_SECONDS = 120                             # a copy (or an LMS building its zip) writes an export within this
FUTURE_SLACK = datetime.timedelta(minutes=5)   # two machines' clocks may differ by this much


def not_a_submission_time(moment: datetime.datetime, export_time: datetime.datetime | None, lms: str | None,
                          now: datetime.datetime, together: str | None = None) -> str | None:
    """Why one file's time cannot be its submission time, or None (then it is); ``lms``: the LMS
    whose download named the file (``Canvas``, ``Moodle``), if any; ``together``: why the whole
    export's times are a copy's (:func:`copied_together`).

    * A file of Canvas's or Moodle's bulk download: each stamps every file of its zip with the
      time it built the zip (Canvas's zipper and Moodle's zip writer give no entry a time of its
      own) and exports no submission time at all; Canvas's ``_LATE_`` mark says whether a
      submission was late, Moodle says nothing.
    * A time after the intake: no submission comes from the future (a wrong clock).
    * A file as new as the export itself (the folder it was copied into, the zip it came in):
      it was written when the export was made -- a copy without its times (``cp`` without
      ``-p``, an upload tool) -- not submitted then."""
    if lms:
        return f"{lms}'s download stamps each file with the time it built the zip, not the submission time"
    if together:
        return together
    if moment > now + FUTURE_SLACK:
        return "its time is in the future: this machine's clock or the export's is wrong"
    if export_time is not None and moment >= export_time - datetime.timedelta(seconds=COPY_SECONDS):
        return (f"its time is that of the export itself ({stamp_text(export_time)}): written by a copy that did not "
                "keep the times (cp without -p, an upload tool), not submitted then")
    return None


def copied_together(times: list[datetime.datetime]) -> str | None:
    """Why an export's times are a copy's, or None: every file written within a copy's few seconds."""
    if len(times) > 1 and max(times) - min(times) <= datetime.timedelta(seconds=COPY_SECONDS):
        return (f"all {len(times)} files were written within {(max(times) - min(times)).total_seconds():.0f} s of one "
                "another: a copy that did not keep the times (cp without -p, an upload tool), not when they were "
                "submitted")
    return None


def submission_time(moment: datetime.datetime, why_not: str | None, due: datetime.datetime | None,
                    lms: str | None = None, late_mark: bool = False) -> tuple[datetime.datetime | None, str | None]:
    """The submission time of a file and what the report says of it; ``(None, why)``: it cannot
    be told (the file is refused, with why).

    ``moment``: the file's time; ``why_not``: why that is not its submission time (None: it is);
    ``lms``: the LMS whose download named the file; ``late_mark``: Canvas's ``_LATE_``.

    * Canvas's mark decides: marked late, 1 s late -- the least the mark allows, never months made
      up from the download's or a copy's time (a grace period excuses it: the report names it); not
      marked, on time (at the due date at the latest).
    * Moodle's download holds no time and no mark: on time (at the due date at the latest), and
      the report says that lateness is not known.
    * Any other file whose time is not its submission time (a copy's): that time still comes
      *after* the submission. At or before the due date, the submission was on time. After it,
      lateness cannot be told, and the file is refused rather than filed late.
    * Without a due date a file is filed with its time; the report says when that time is not a
      submission time (set the due dates first)."""
    if due is None:
        return moment, None if why_not is None else (
            f"its time ({stamp_text(moment)}) is not its submission time ({why_not}) and the assignment has no due "
            "date yet: set the due dates (make deadlines) before taking such an export in, or its lateness will "
            "be wrong")
    if lms == "Canvas" and late_mark:
        return due + datetime.timedelta(seconds=1), (
            "Canvas marks it late and its download holds no submission time: taken as 1 s late, the least the mark "
            "allows (a grace period excuses it: look its time up in SpeedGrader)")
    if lms and moment > due:
        return due, (f"{'Canvas does not mark it late' if lms == 'Canvas' else 'Moodle marks no lateness'} and its "
                     "download holds no submission time: taken as submitted at the due date"
                     + ("" if lms == "Canvas" else " (lateness is not known: Moodle's grading worksheet lists "
                                                   "each submission's time)"))
    if why_not is None or moment <= due:
        return moment, None
    return None, (f"its time ({stamp_text(moment)}) is not its submission time ({why_not}) and is after the due "
                  "date: whether it was late cannot be told. Take the export in as it was downloaded (the zip "
                  "itself, or unzipped; a copy made with cp -p keeps the times)")


def export_notices(untrusted: dict[str, int], due: dict[str, datetime.datetime],
                   filed: list[tuple[str, str, datetime.datetime]], settings: CourseSettings) -> list[str]:
    """What the intake report says about this export's times: ``untrusted`` as ``{why files'
    times are not their submission times: how many}``, ``filed`` as ``(student, assignment,
    submission time)``."""
    notices = [f"{count} file time{'s are' if count != 1 else ' is'} not a submission time: {why} "
               "(each file's line says what was done)" for why, count in sorted(untrusted.items())]
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
