"""The course's grading settings: one file in the course root, read by every path that grades.

    python -m autograder.term.course_settings                      # make settings: show them
    python -m autograder.term.course_settings set late_penalty=zero grace_minutes=15
                                                              # make settings LATE_PENALTY=zero GRACE_MINUTES=15
    python -m autograder.term.course_settings extend --student alice --assignment 01_mha_shapes --until 2026-03-08T17:00
                                                              # make extension STUDENT=... ASSIGNMENT=... UNTIL=...
    python -m autograder.term.course_settings extend --student alice --assignment 01_mha_shapes --remove

``course_settings.json`` in the course root holds the late penalty (nbgrader's
``LateSubmissionPlugin`` method: ``none`` or ``zero``), a grace period (minutes after the due
date that do not count as late), per-student extensions (a due date of their own for one
assignment), the course's time zone (an IANA name, ``Europe/Berlin``: a due date or an
extension written without an offset is in it, and so is a time in a zip without a zone) and the
grading limits (seconds per cell, the kernel start-up budget, memory and file size per kernel).  ``make grade`` (any ``STUDENT=``/``ASSIGNMENT=``), Formgrader's
*Autograde* button and ``python -m autograder.grading.grade`` all read it, and the grading report
shows it: a setting set once stays set for the term.  The late penalty, the grace period and the
extensions are rules applied whenever a score is read (:mod:`autograder.term.scores`): a change counts
at once in every export, feedback page and report, and the next ``make grade`` re-scores
nbgrader's own record of the penalty; nothing is executed again.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
import zoneinfo
from dataclasses import dataclass, field
from pathlib import Path

from autograder.command_line import command_line
from autograder.limits import Limits
from autograder.places import COURSE_ROOT, COURSE_SETTINGS_FILE, LATE_PENALTY_METHOD
from autograder.term.due_dates import has_offset, parse_duedate

PENALTY_METHODS = ("none", "zero")
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"   # naive UTC, as nbgrader stores due dates


@dataclass
class CourseSettings:
    late_penalty: str = LATE_PENALTY_METHOD      # nbgrader's LateSubmissionPlugin.penalty_method
    grace_minutes: float = 0.0                   # after the due date, not yet late
    # the limits a course sets for the term (the others, and these defaults: autograder.limits.Limits)
    timeout: int = Limits.timeout                # seconds per cell, from the cell's start
    startup_timeout: int = Limits.startup_timeout  # seconds to start a kernel and run the setup cell
    memory_mb: int = Limits.memory_mb            # memory limit of a student kernel
    file_mb: int = Limits.file_mb                # largest file a student kernel may write
    time_zone: str = "UTC"                       # a date without an offset is in this zone
    extensions: dict[str, str] = field(default_factory=dict)   # "student/assignment": due date (UTC)

    # ------------------------------------------------------------------ values
    def check(self) -> None:
        """Raise ValueError naming the setting that is wrong."""
        if self.late_penalty not in PENALTY_METHODS:
            raise ValueError(f"late_penalty must be one of {', '.join(PENALTY_METHODS)}, not {self.late_penalty!r}")
        if self.grace_minutes < 0:
            raise ValueError(f"grace_minutes must be 0 or more, not {self.grace_minutes:g}")
        for name in ("timeout", "startup_timeout", "memory_mb", "file_mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive number, not {getattr(self, name)}")
        try:
            zoneinfo.ZoneInfo(self.time_zone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"time_zone must be a time zone's name (Europe/Berlin, America/New_York, UTC), "
                             f"not {self.time_zone!r}") from None
        for key, until in self.extensions.items():
            if key.count("/") != 1:
                raise ValueError(f"extension {key!r}: expected student/assignment")
            datetime.datetime.strptime(until, TIME_FORMAT)

    def limits(self, **others) -> Limits:
        """A grading run's limits: the four this course sets, and ``others`` (a run's own flags)."""
        return Limits(timeout=self.timeout, startup_timeout=self.startup_timeout, memory_mb=self.memory_mb,
                      file_mb=self.file_mb, **others)

    @property
    def zone(self) -> zoneinfo.ZoneInfo:
        return zoneinfo.ZoneInfo(self.time_zone)

    def local(self, moment: datetime.datetime) -> str:
        """A naive-UTC time (as the gradebook keeps it) in words: UTC, and the course's time too."""
        text = f"{moment:%Y-%m-%d %H:%M:%S} UTC"
        if self.time_zone != "UTC":
            here = moment.replace(tzinfo=datetime.timezone.utc).astimezone(self.zone)
            text += f" ({here:%Y-%m-%d %H:%M} {self.time_zone})"
        return text

    def extension(self, student: str, assignment: str) -> datetime.datetime | None:
        until = self.extensions.get(f"{student}/{assignment}")
        return datetime.datetime.strptime(until, TIME_FORMAT) if until else None

    def seconds_late(self, student: str, assignment: str, submitted: datetime.datetime | None,
                     duedate: datetime.datetime | None) -> float:
        """Seconds past the student's due date (their extension, if later) and the grace period."""
        if submitted is None or duedate is None:
            return 0.0
        due = max(duedate, self.extension(student, assignment) or duedate)
        return max(0.0, (submitted - due).total_seconds() - self.grace_minutes * 60)

    def describe(self) -> list[str]:
        """The settings in plain words, one per line (the grading report, ``make settings``)."""
        lines = [f"late penalty: {self.late_penalty}"
                 + (" (a late notebook scores 0)" if self.late_penalty == "zero" else " (lateness is recorded only)"),
                 f"grace period: {self.grace_minutes:g} minutes after the due date",
                 f"time limit per cell: {self.timeout} s; kernel start-up and setup cell: {self.startup_timeout} s",
                 f"memory per kernel: {self.memory_mb} MB; largest file a kernel writes: {self.file_mb} MB",
                 f"time zone: {self.time_zone} (a date written without an offset is in it)"]
        if self.extensions:
            lines.append("extensions: " + "; ".join(
                f"{key} due {self.local(datetime.datetime.strptime(until, TIME_FORMAT))}"
                for key, until in sorted(self.extensions.items())))
        else:
            lines.append("extensions: none")
        return lines

    # ------------------------------------------------------------------ the file
    @classmethod
    def load(cls, root: Path = COURSE_ROOT) -> CourseSettings:
        path = Path(root) / COURSE_SETTINGS_FILE
        if not path.exists():
            return cls()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(data) - known)
            if unknown:
                raise ValueError(f"unknown setting {', '.join(unknown)} (known: {', '.join(sorted(known))})")
            settings = cls(**data)
            settings.check()
        except (ValueError, TypeError) as error:
            raise SystemExit(f"{path}: {error}; fix it with `make settings` (see docs/reference.md)") from None
        return settings

    def save(self, root: Path = COURSE_ROOT) -> Path:
        self.check()
        path = Path(root) / COURSE_SETTINGS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(".tmp")
        scratch.write_text(json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True, ensure_ascii=False) + "\n",
                           encoding="utf-8")
        scratch.replace(path)
        return path


def assign(settings: CourseSettings, assignment_text: str) -> str:
    """Apply one ``name=value`` (``make settings`` passes its variables so); what changed, as text."""
    name, equals, value = assignment_text.partition("=")
    name = name.strip().lower()
    fields = {f.name: f for f in dataclasses.fields(CourseSettings) if f.name != "extensions"}
    if not equals or name not in fields:
        raise SystemExit(f"{assignment_text!r}: expected name=value, name one of {', '.join(fields)}")
    before = getattr(settings, name)
    kind = type(getattr(CourseSettings(), name))
    try:
        new = kind(value.strip())
    except ValueError:
        raise SystemExit(f"{name}={value!r}: expected a {kind.__name__}") from None
    setattr(settings, name, new)
    try:
        settings.check()
    except ValueError as error:
        raise SystemExit(str(error)) from None
    return f"{name}: {before} -> {new}" if before != new else f"{name}: {new} (unchanged)"


def zone_note(text: str, settings: CourseSettings) -> str:
    """What a date typed without an offset was read as (said, never silently UTC)."""
    if has_offset(text):
        return ""
    return (f" (written without an offset: read in the course's time zone, {settings.time_zone}; "
            "`make settings TIME_ZONE=<zone>` sets it)")


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__, course_root=True)
    commands = parser.add_subparsers(dest="command")
    setting = commands.add_parser("set", help="set name=value ...")
    setting.add_argument("values", nargs="+")
    extending = commands.add_parser("extend", help="a due date of its own for one student's assignment")
    extending.add_argument("--student", required=True)
    extending.add_argument("--assignment", required=True)
    extending.add_argument("--until", help="ISO date (2026-03-08T17:00+01:00; without an offset: the course's "
                                           "time zone; a day alone means 23:59:59)")
    extending.add_argument("--remove", action="store_true", help="take the extension back")
    options = parser.parse_args(argv)
    settings = CourseSettings.load(options.root)
    if options.command == "set":
        for value in options.values:
            print(assign(settings, value))
        print(f"saved in {settings.save(options.root)}: every later grading run uses it")
    elif options.command == "extend":
        key = f"{options.student}/{options.assignment}"
        if options.remove:
            if settings.extensions.pop(key, None) is None:
                raise SystemExit(f"no extension for {key}")
            print(f"extension for {key} removed")
        else:
            if not options.until:
                raise SystemExit("usage: --until <ISO date> (or --remove)")
            try:
                until = parse_duedate(options.until, settings.zone)
            except ValueError:
                raise SystemExit(f"{options.until!r} is not an ISO date (2026-03-08 or 2026-03-08T17:00+01:00)") from None
            settings.extensions[key] = until.strftime(TIME_FORMAT)
            print(f"{key}: due {settings.local(until)}" + zone_note(options.until, settings))
        print(f"saved in {settings.save(options.root)}: `make grade` re-scores (nothing is re-executed)")
    else:
        print(f"course settings ({Path(options.root) / COURSE_SETTINGS_FILE}):")
        for line in settings.describe():
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
