"""Due dates as instructors write them: ISO 8601, with an offset or in the course's time zone.

nbgrader keeps a due date as a naive UTC time; :func:`parse_duedate` turns what an instructor
typed (``deadlines.csv``, ``make extension UNTIL=``) into that.
"""

from __future__ import annotations

import datetime


def has_offset(text: str) -> bool:
    """Whether an ISO 8601 date names its offset (``+01:00``, ``Z``)."""
    try:
        return datetime.datetime.fromisoformat(text.strip().replace("Z", "+00:00")).tzinfo is not None
    except ValueError:
        return False


def parse_duedate(text: str, zone: datetime.tzinfo = datetime.timezone.utc) -> datetime.datetime:
    """An ISO 8601 date as naive UTC, as nbgrader stores it. A date without an offset is in
    ``zone`` (the course's time zone); a day alone means its end, 23:59:59 there."""
    text = text.strip()
    value = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    if len(text) == 10:
        value = value.replace(hour=23, minute=59, second=59)
    if value.tzinfo is None:
        value = value.replace(tzinfo=zone)
    return value.astimezone(datetime.timezone.utc).replace(tzinfo=None)
