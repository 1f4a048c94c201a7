"""Canvas's own rules for the files it exchanges with an instructor, as Canvas's source code has them
(canvas-lms, AGPL: rewritten here, not copied), so that tests check the course against Canvas:

* **the bulk download** ("Download Submissions", ``lib/content_zipper.rb``): each file of a
  submission is named ``<user name>[_LATE]_<user id>_<attachment id>_<display name>``, where the
  user name is the sortable name ("Liddell, Alice") lower-cased, with ``_<digits>_`` collapsed
  and every non-word character removed, ``LATE`` marks a submission Canvas counts late, the
  attachment id is the file's own id, and the display name has ``\\0 / \\ : * ? " < > |`` made
  ``_``; every entry of the zip carries the time the zip was built (rubyzip's default: the
  server's local time, as a DOS time without a zone), not the submission time;
* **"Re-upload submissions"** (``Assignment#infer_comment_context_from_filename``): a file of
  the uploaded zip is split on ``_``; its first two all-digit parts are the user id and the id
  of a file of that user's submission, and it is attached to that submission as a comment; a
  name without both is ignored.
"""

from __future__ import annotations

import datetime
import re
import zipfile
from pathlib import Path


def download_name(sortable_name: str, user_id: int, attachment_id: int, display_name: str, late: bool = False) -> str:
    """The name Canvas's bulk download gives one file of a submission."""
    user = re.sub(r"_(\d+)_", r"\1", sortable_name).lower()
    prefix = re.sub(r"[^\w]", "", "_".join([user, *(["LATE"] if late else []), str(user_id)]))
    shown = re.sub(r'[\x00/\\:*?"<>|]+', "_", display_name)
    return f"{prefix}_{attachment_id}_{shown}"


def reupload_target(file_name: str) -> tuple[int, int] | None:
    """(user id, attachment id) that Canvas's "Re-upload submissions" reads from a file's name, or
    None: Canvas ignores the file."""
    name = Path(file_name).name
    numbers = [part for part in name.split("_") if re.fullmatch(r"\d+", part)][:2]
    if len(numbers) < 2 or name.split("_")[-1].startswith("link") or name.startswith("._"):
        return None
    return int(numbers[0]), int(numbers[1])


def write_download(path: Path, files: dict[str, bytes], built: datetime.datetime) -> Path:
    """``submissions.zip`` as Canvas builds it: ``{name: content}``, every entry stamped with the
    time ``built`` (the zip's build time, local time of Canvas's server, no zone), no folders."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, content in files.items():
            info = zipfile.ZipInfo(name, date_time=built.timetuple()[:6])
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, content)
    return path
