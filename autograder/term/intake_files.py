"""The files of an export as ``make intake`` reads them: a folder, or a zip as downloaded (Canvas's
``submissions.zip``), never extracted -- each file with its own time and the reason it is refused
before it is read (a link, anything but a regular file, a file over MAX_NOTEBOOK_BYTES, a zip
path that leaves the zip).

A zip entry's time is its extended timestamp where the zip has one (Info-ZIP's ``UT`` field, or
the NTFS field: UTC, exact); otherwise its DOS time, the local time of the machine that wrote the
zip, which names no zone: it is read in the course's time zone (``make settings TIME_ZONE=``).
Canvas writes no extended timestamp: its download's times are the time Canvas built the zip
(autograder.term.intake_checks says what intake makes of them).
"""

from __future__ import annotations

import datetime
import os
import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable

from autograder.term.intake_checks import UTC
from autograder.places import MAX_NOTEBOOK_BYTES

IGNORED = {".DS_Store", "Thumbs.db", "desktop.ini"}
IGNORED_DIRS = {"__MACOSX", ".ipynb_checkpoints", ".git"}


@dataclass
class ExportFile:
    relative: PurePosixPath             # inside the export
    time: datetime.datetime | None      # its own time (aware, UTC)
    read: Callable[[], bytes]
    problem: str | None = None          # refused before it is read (a link, too big, ...)


@dataclass
class Export:
    path: Path
    files: list[ExportFile]
    time: datetime.datetime             # when the export itself was made here: the folder's or the zip's time
    close: Callable[[], None] = lambda: None


def utc_time(seconds: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(seconds, UTC)


def skipped(relative: PurePosixPath) -> bool:
    """System files and hidden files or folders (never a submission)."""
    return (relative.name in IGNORED or bool(set(relative.parts) & IGNORED_DIRS)
            or any(part.startswith(".") for part in relative.parts))


def unreadable_file(submissions: Path, relative: Path) -> str | None:
    """Why ``submissions/relative`` is refused before it is read, or None.

    * A link (file or folder, as unzipping an archive restores it) could point anywhere on the
      instructor's machine -- at the course's own source notebook, say -- and be filed as the
      student's work: never followed.
    * Anything but a regular file (a FIFO would block the intake) is refused.
    * A notebook over MAX_NOTEBOOK_BYTES is refused before it is read (it would be parsed here
      and shipped to every grading worker)."""
    path = submissions
    for part in relative.parts:
        path = path / part
        if path.is_symlink():
            what = "folder" if path.is_dir() else "file"
            where = "" if path == submissions / relative else f" ({path.relative_to(submissions)})"
            return (f"a {what} link{where} to {os.readlink(path)}: links are not followed (a submission "
                    "must be the file itself: unpack archives without their links)")
    path = submissions / relative
    if not path.is_file():
        return "not a regular file"
    return too_big(path.stat().st_size)


def too_big(size: int) -> str | None:
    if size > MAX_NOTEBOOK_BYTES:
        return (f"{size / 1e6:.1f} MB, over the limit of {MAX_NOTEBOOK_BYTES / 1e6:g} MB for one submitted file "
                "(MAX_NOTEBOOK_BYTES in autograder/places.py): the student can clear its outputs and submit it again")
    return None


def folder_export(submissions: Path) -> Export:
    files = []
    for path in sorted(submissions.rglob("*")):
        relative = path.relative_to(submissions)
        if skipped(PurePosixPath(*relative.parts)) or (path.is_dir() and not path.is_symlink()):
            continue
        problem = unreadable_file(submissions, relative)
        time = None if problem else utc_time(path.stat().st_mtime)
        files.append(ExportFile(PurePosixPath(*relative.parts), time, path.read_bytes, problem))
    return Export(submissions, files, utc_time(submissions.stat().st_mtime))


def extended_timestamp(extra: bytes) -> datetime.datetime | None:
    """The UTC modification time a zip entry's extra field holds, if any: Info-ZIP's extended
    timestamp (0x5455, written by ``zip`` on Unix) or the NTFS field (0x000a, Windows, 7-Zip)."""
    offset = 0
    while offset + 4 <= len(extra):
        tag, size = int.from_bytes(extra[offset:offset + 2], "little"), int.from_bytes(extra[offset + 2:offset + 4], "little")
        data = extra[offset + 4:offset + 4 + size]
        if tag == 0x5455 and len(data) >= 5 and data[0] & 1:
            return utc_time(int.from_bytes(data[1:5], "little", signed=True))
        if tag == 0x000A and len(data) >= 32 and int.from_bytes(data[4:6], "little") == 1:
            ticks = int.from_bytes(data[8:16], "little")   # 100 ns since 1601-01-01 UTC
            return datetime.datetime(1601, 1, 1, tzinfo=UTC) + datetime.timedelta(microseconds=ticks // 10)
        offset += 4 + size
    return None


def zip_entry_time(info: zipfile.ZipInfo, zone: datetime.tzinfo) -> datetime.datetime:
    """A zip entry's time: its extended (UTC) timestamp where it has one; else its DOS time, which
    is the local time of the machine that wrote the zip and names no zone: read in ``zone``,
    the course's time zone (Canvas's times are never submission times, whatever their zone)."""
    exact = extended_timestamp(info.extra)
    if exact is not None:
        return exact
    return datetime.datetime(*info.date_time, tzinfo=zone).astimezone(UTC)


def zip_export(path: Path, zone: datetime.tzinfo) -> Export:
    """The entries of a zip (Canvas's ``submissions.zip``, a zipped folder), never extracted:
    each is read into memory, at most MAX_NOTEBOOK_BYTES + 1 bytes of it."""
    archive = zipfile.ZipFile(path)
    files = []
    for info in archive.infolist():
        relative = PurePosixPath(info.filename.replace("\\", "/"))
        if info.is_dir() or skipped(relative):
            continue
        mode = info.external_attr >> 16
        problem = None
        if relative.is_absolute() or ".." in relative.parts:
            problem = "a path that leaves the zip (absolute, or with ..): refused"
        elif stat.S_ISLNK(mode):
            problem = "a link inside the zip: links are not followed (a submission must be the file itself)"
        elif stat.S_IFMT(mode) and not stat.S_ISREG(mode):   # (many zips give no file type: a file)
            problem = "not a regular file"
        else:
            problem = too_big(info.file_size)

        def read(info=info) -> bytes:
            with archive.open(info) as handle:
                data = handle.read(MAX_NOTEBOOK_BYTES + 1)
            if too_big(len(data)):   # a header that lied about the size
                raise ValueError(too_big(len(data)))
            return data

        files.append(ExportFile(relative, zip_entry_time(info, zone), read, problem))
    return Export(path, sorted(files, key=lambda f: str(f.relative)), utc_time(path.stat().st_mtime), archive.close)


def open_export(submissions: Path, zone: datetime.tzinfo) -> Export:
    """The files of an export: a folder, or a zip file (``SUBMISSIONS=~/Downloads/submissions.zip``)."""
    if submissions.is_dir():
        return folder_export(submissions)
    if zipfile.is_zipfile(submissions):
        return zip_export(submissions, zone)
    raise SystemExit(f"{submissions}: neither a folder nor a zip file (make intake SUBMISSIONS=<folder or .zip>)")


