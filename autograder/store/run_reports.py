"""The course root's record of each run that files or grades (``make intake``, ``make grade``).

A run's report is ``reports/<kind>_report.{md,json}`` (the last run's, where the console points),
a copy of each under ``reports/<kind>/`` named by its time, and a line in
``reports/<kind>_history.md``: a one-student regrade or a second intake never wipes the record
of an earlier run.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

REPORTS_DIR = "reports"


def keep_report(root: Path, kind: str, title: str, body: list[str], data: dict, summary: str) -> Path:
    """Write this run's report of ``kind`` (``intake``, ``grading``) and keep a copy; its path.

    The Markdown is ``# <title> (<time>)`` then ``body``'s lines; the JSON is ``data`` after its
    ``generated`` time; the history's line is ``<time>: <summary>`` and a link to the copy."""
    folder = Path(root) / REPORTS_DIR
    history = folder / kind
    history.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now()
    stamp = now.isoformat(timespec="seconds")
    name, suffix = now.strftime("%Y%m%dT%H%M%S"), 1
    while (history / f"{name}.md").exists():
        suffix += 1
        name = f"{now.strftime('%Y%m%dT%H%M%S')}-{suffix}"
    text = "\n".join([f"# {title} ({stamp})", *body]) + "\n"
    json_text = json.dumps({"generated": stamp, **data}, indent=1, ensure_ascii=False)
    (folder / f"{kind}_report.json").write_text(json_text)
    (history / f"{name}.json").write_text(json_text)
    (history / f"{name}.md").write_text(text)
    path = folder / f"{kind}_report.md"
    path.write_text(text)
    index = folder / f"{kind}_history.md"
    if not index.exists():
        index.write_text(f"# {kind.capitalize()} runs (newest last)\n\n")
    with open(index, "a", encoding="utf-8") as handle:
        handle.write(f"- {stamp}: {summary} ([report]({kind}/{name}.md))\n")
    return path
