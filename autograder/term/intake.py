"""Take in a folder of submissions as an LMS or a shared drive gives it.

    python -m autograder.term.intake DOWNLOADS            # make intake SUBMISSIONS=DOWNLOADS

``DOWNLOADS/<student>/<any file name>`` (files in sub-folders too) becomes
``autograder/course_root/submitted/<student>/<assignment>/<assignment>.ipynb``. The originals
are only read.  Submissions are matched against the release, the student notebooks of
``course/`` (:func:`autograder.publishing.release.released_notebook`), which is what students got.

* **Names students really produce** are recognised: ``Copy of 01_mha_shapes.ipynb``
  (Colab), ``01_mha_shapes (1).ipynb``, ``01 MHA Shapes.ipynb``, other case; a notebook
  whose name says nothing is recognised by its content.
* **Content decides**: a notebook whose cells are those of another assignment than its
  name says is refused (it would score 0 there).
* **Stripped metadata is repaired**: Colab and other editors can drop the nbgrader cell
  metadata; without it nbgrader would not grade the test cells. Each missing graded or
  locked cell is found again by its content (the same source, or its first line), its
  metadata restored, and a test cell the student deleted is put back where it belongs
  (nbgrader restores its code anyway). When a cell cannot be told apart from another the
  notebook is refused, with the reason.
* Invalid JSON, empty files, non-notebooks, unknown files: refused, with the reason.
* If a student has several files for one assignment, the newest is taken.
* **The roster** (``roster.csv`` in the course root, ``make roster``): a student folder not in
  it is refused, with the closest roster names suggested (``alcie`` -> ``alice (Alice
  Liddell)``), unless ``--add-unknown``; a folder that names a student by another spelling
  (case, accents, ``lastfirst``, e-mail, LMS user id) is filed under the roster's id.
* **LMS exports as they come**: Canvas's flat folder (``lastfirst[_LATE]_<user id>_<submission
  id>_<file>``) and Moodle's (``Full Name_<id>_assignsubmission_file_``) are read, the student
  found through the roster's ``lms_user_id`` (or name).
* **Submission times**: the file's modification time (unzip an LMS export keeping its
  times) goes to nbgrader's ``submitted/<student>/<assignment>/timestamp.txt`` (UTC), which
  its late penalty reads.
* **History**: a resubmission replaces the one graded, and the earlier one is kept in
  ``archive/submitted/<student>/<assignment>/<its time>/``.

The report (``reports/intake_report.{md,json}`` in the course root, this run; every run's in
``reports/intake/``, listed in ``reports/intake_history.md``) lists every file as accepted /
repaired / refused with its reasons. Exit status 0 unless the folder is missing.
"""

from __future__ import annotations

import argparse
import ast
import copy
import datetime
import json
import os
import re
import shutil
import sys
import unicodedata
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

from autograder.term.course_settings import CourseSettings
from autograder.term.intake_checks import (due_dates, export_notices, hand_graded, parse_stamp, replacement_refusal,
                                           stamp_text, submission_time)
from autograder.publishing.release import assignment_names, released_notebook
from autograder.term.roster import ROSTER_FILE, Roster, fold, normal_name
from autograder.places import COURSE_DIR, COURSE_ROOT, MAX_NOTEBOOK_BYTES
from autograder.store.run_reports import keep_report

IGNORED = {".DS_Store", "Thumbs.db", "desktop.ini"}
IGNORED_DIRS = {"__MACOSX", ".ipynb_checkpoints", ".git"}
FORBIDDEN_IN_ID = re.compile(r"[/\\*?\[\]\x00-\x1f]")
MIN_CONTENT_MATCH = 0.3


@dataclass
class Entry:
    source: str                 # the file, relative to the submissions folder
    student: str | None
    status: str                 # accepted | repaired | refused | unchanged
    assignment: str | None = None
    destination: str | None = None
    reasons: list[str] = field(default_factory=list)
    submitted_at: str | None = None   # what timestamp.txt says (the file's time, or the LMS's, UTC)
    file_time: str | None = None      # the file's modification time (UTC)


@dataclass
class Release:
    assignment: str             # also the name of its one notebook
    cells: list                 # release cells
    lines: set[str]             # distinctive first lines of its cells


# --------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------

def normalise_name(stem: str) -> str:
    """``Copy of 01 MHA Shapes (1)`` -> ``01_mha_shapes``."""
    name = unicodedata.normalize("NFKC", stem).strip().lower()
    previous = None
    while previous != name:
        previous = name
        name = re.sub(r"^(copy of|copie de|kopie von|copia de)\s+", "", name)
        name = re.sub(r"\s*[\(\[]\d+[\)\]]$", "", name)        # " (1)"
        name = re.sub(r"[\s_-]*(-\s*)?copy(\s*\d+)?$", "", name)  # " copy", "-copy 2"
        name = re.sub(r"[\s_-]+v?\d+$", "", name) if re.search(r"[a-z][\s_-]+v?\d+$", name) else name
        name = name.strip(" ._-")
    return re.sub(r"[\s\-.]+", "_", name)


def assignment_from_name(filename: str, assignments: list[str]) -> str | None:
    name = normalise_name(Path(filename).stem)
    lowered = {a.lower(): a for a in assignments}
    if name in lowered:
        return lowered[name]
    number = re.match(r"^(\d{1,2})(?:_|$)", name)
    if number:
        matches = [a for a in assignments if a.split("_")[0].lstrip("0") == number.group(1).lstrip("0")]
        if len(matches) == 1:
            return matches[0]
    return None


def clean_student_id(name: str) -> tuple[str | None, str | None]:
    """(the id a student folder is filed under, None) or (None, why it cannot be): NFKC,
    invisible format characters removed (:func:`autograder.term.roster.normal_name`)."""
    student, _ = normal_name(name)
    if not student or student.startswith("."):
        return None, "empty or hidden student folder name"
    if FORBIDDEN_IN_ID.search(student) or student in {".", ".."}:
        return None, f"student folder name {name!r} contains characters nbgrader cannot use (/ \\ * ? [ ])"
    return student, None


# Canvas: ``lastfirst[_LATE]_<user id>_<submission id>_<file>``; Moodle: ``Full Name_<id>_assignsubmission_file_[<file>]``
CANVAS = re.compile(r"^(?P<name>[^_]+?)(?P<late>_late)?_(?P<lms>\d+)_(?P<sub>\d+)_(?P<file>.+)$", re.IGNORECASE)
MOODLE = re.compile(r"^(?P<name>.+?)_(?P<lms>\d+)_assignsubmission_(?:file|onlinetext)_(?P<file>.*)$", re.IGNORECASE)


def lms_name(name: str) -> dict | None:
    """{name, lms, file, late, kind} of a file (Canvas) or folder (Moodle) named by an LMS export."""
    for kind, pattern in (("Moodle", MOODLE), ("Canvas", CANVAS)):
        match = pattern.match(name)
        if match:
            found = match.groupdict()
            return {"name": found["name"], "lms": found["lms"], "file": found["file"],
                    "late": bool(found.get("late")), "kind": kind}
    return None


def resolve_student(entry: "Entry", folder: str, roster, add_unknown: bool, lms_user_id: str = "",
                    seen: dict[str, str] | None = None) -> str | None:
    """The student id a folder (or LMS export name) stands for; None (entry refused) when unknown.

    Without a roster, ``seen`` (folded name -> student folder already filed or taken in this
    run) catches ``Bob/`` beside ``bob/``."""
    student, problem = clean_student_id(folder)
    if problem:
        entry.reasons.append(problem)
        return None
    removed = normal_name(folder)[1]
    if removed:
        entry.reasons.append(f"removed invisible characters from the student folder name {folder!r} "
                             f"({', '.join(removed)}): taken as {student!r}")
    if roster is None:
        other = (seen or {}).get(fold(student))
        if other is not None and other != student and not add_unknown:
            entry.reasons.append(f"student folder {student!r} differs from {other!r} only in case, accents or "
                                 "separators: the same student? Rename the folder, or run intake with --add-unknown "
                                 "to keep both (a roster, `make roster`, settles names)")
            return None
        if seen is not None:
            seen.setdefault(fold(student), student)
        return student
    known, how = roster.find(student, lms_user_id)
    if known:
        if how:
            entry.reasons.append(how)
        return known.id
    if add_unknown:
        roster.add(student)
        entry.reasons.append(f"{student!r} is not in the roster: added (--add-unknown)")
        return student
    suggestions = roster.suggest(student)
    entry.reasons.append(f"student {student!r} is not in the roster" + (
        f"; did you mean {' or '.join(suggestions)}?" if suggestions else "") +
        " Rename the folder, or run intake with --add-unknown (make intake ADD_UNKNOWN=1) to add them")
    return None


# --------------------------------------------------------------------------------------
# Content
# --------------------------------------------------------------------------------------

def _first_line(source: str) -> str:
    for line in source.splitlines():
        if line.strip():
            return line.strip()
    return ""


def _normal(source: str) -> str:
    return "\n".join(line.rstrip() for line in source.strip().splitlines())


def load_releases(course_dir: Path, assignments: list[str]) -> dict[str, Release]:
    releases = {}
    for assignment in assignments:
        path = released_notebook(assignment, course_dir)
        if not path.exists():
            continue
        notebook = nbformat.read(path, as_version=4)
        lines = {_first_line(c.source) for c in notebook.cells if len(_first_line(c.source)) > 12}
        releases[assignment] = Release(assignment, notebook.cells, lines)
    return releases


def content_match(notebook, release: Release) -> float:
    lines = {_first_line(c.source) for c in notebook.cells}
    ids = {c.metadata.get("nbgrader", {}).get("grade_id") for c in notebook.cells} - {None}
    release_ids = {c.metadata.get("nbgrader", {}).get("grade_id") for c in release.cells} - {None}
    by_lines = len(release.lines & lines) / max(1, len(release.lines))
    by_ids = len(release_ids & ids) / max(1, len(release_ids))
    return max(by_lines, by_ids)


def _defined_names(source: str) -> set[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set(re.findall(r"^(?:def|class)\s+(\w+)", source, re.MULTILINE))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def repair(notebook, release: Release) -> tuple[object, list[str], str | None]:
    """Restore the nbgrader metadata of ``notebook`` from the release.

    Returns (notebook, what was repaired, refusal reason or None).
    """
    notebook = copy.deepcopy(notebook)
    notes: list[str] = []
    present = {c.metadata.get("nbgrader", {}).get("grade_id") for c in notebook.cells} - {None}
    wanted = [(i, c) for i, c in enumerate(release.cells) if "nbgrader" in c.metadata]
    if all(c.metadata["nbgrader"]["grade_id"] in present for _, c in wanted):
        return notebook, notes, None
    cells = notebook.cells
    # Where each release cell sits in the submission (exact content, or its nbgrader id).
    position: dict[int, int] = {}
    used: set[int] = set()
    for r, cell in enumerate(release.cells):
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        for s, mine in enumerate(cells):
            if s in used:
                continue
            if (grade_id and mine.metadata.get("nbgrader", {}).get("grade_id") == grade_id) or (
                    not mine.metadata.get("nbgrader") and mine.cell_type == cell.cell_type
                    and _normal(mine.source) == _normal(cell.source) and _normal(cell.source)):
                position[r] = s
                used.add(s)
                break

    def anchor(r: int) -> int:
        """Submission index after which release cell r belongs (-1: at the start)."""
        for earlier in range(r - 1, -1, -1):
            if earlier in position:
                return position[earlier]
        return -1

    inserts: list[tuple[int, object]] = []
    for r, cell in wanted:
        meta = cell.metadata["nbgrader"]
        grade_id = meta["grade_id"]
        if r in position:
            target = cells[position[r]]
            if "nbgrader" not in target.metadata:
                target.metadata["nbgrader"] = copy.deepcopy(meta)
                notes.append(f"restored the nbgrader metadata of cell {grade_id!r} (identical content)")
            continue
        free = [s for s, c in enumerate(cells) if s not in used and c.cell_type == cell.cell_type
                and not c.metadata.get("nbgrader")]
        if meta.get("locked"):
            first = _first_line(cell.source)
            candidates = [s for s in free if first and first in cells[s].source]
            if len(candidates) > 1:
                return notebook, notes, (f"cannot tell which cell is {grade_id!r}: cells "
                                         f"{', '.join(str(s + 1) for s in candidates)} all look like it")
            if candidates:
                s = candidates[0]
                cells[s].metadata["nbgrader"] = copy.deepcopy(meta)
                position[r] = s
                used.add(s)
                notes.append(f"restored the nbgrader metadata of cell {grade_id!r} (matched by its first line)")
            else:
                restored = copy.deepcopy(cell)
                inserts.append((anchor(r), restored))
                notes.append(f"put back the deleted cell {grade_id!r}")
        else:  # an answer cell: find the one cell defining the same names
            names = _defined_names(cell.source)
            if names:
                candidates = [s for s in free if names & _defined_names(cells[s].source)]
            else:
                after = anchor(r) + 1
                candidates = [after] if after in free else []
            if len(candidates) == 1:
                s = candidates[0]
                cells[s].metadata["nbgrader"] = copy.deepcopy(meta)
                position[r] = s
                used.add(s)
                notes.append(f"restored the nbgrader metadata of answer cell {grade_id!r}")
            elif len(candidates) > 1:
                return notebook, notes, (f"cannot tell which cell is the answer {grade_id!r}: cells "
                                         f"{', '.join(str(s + 1) for s in candidates)} all define "
                                         f"{', '.join(sorted(names)) or 'it'}")
            else:
                notes.append(f"answer cell {grade_id!r} not found (its tests will run against whatever "
                             "the notebook defines)")
    restored = [n.split("'")[1] for n in notes if n.startswith("restored the nbgrader metadata")]
    if restored:
        others = [n for n in notes if not n.startswith("restored the nbgrader metadata")]
        notes[:] = [f"restored the nbgrader metadata of {len(restored)} cells by matching them to the release "
                    f"({', '.join(restored)})"] + others
    for after, cell in sorted(inserts, key=lambda item: item[0], reverse=True):
        cells.insert(after + 1, cell)
    # nbgrader needs unique cell ids
    seen: set[str] = set()
    for index, cell in enumerate(cells):
        if not cell.get("id") or cell.id in seen:
            cell.id = f"intake-{index:03d}"
        seen.add(cell.id)
    return notebook, notes, None


# --------------------------------------------------------------------------------------
# The intake
# --------------------------------------------------------------------------------------

def read_notebook(path: Path):
    """(notebook, None) or (None, why it is refused)."""
    data = path.read_bytes()
    if not data.strip():
        return None, "empty file"
    try:
        raw = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError) as error:
        return None, f"not valid JSON ({str(error)[:120]}): the file is damaged or not a notebook"
    if not isinstance(raw, dict) or "cells" not in raw and "worksheets" not in raw:
        return None, "valid JSON but not a Jupyter notebook (no cells)"
    try:
        notebook = nbformat.reads(json.dumps(raw), as_version=4)
    except Exception as error:  # nbformat raises many kinds
        return None, f"not a readable Jupyter notebook ({type(error).__name__}: {str(error)[:120]})"
    for cell in notebook.cells:
        if cell.cell_type not in ("code", "markdown", "raw") or not isinstance(cell.get("source"), str):
            return None, "a cell is malformed (the notebook was edited by hand?)"
        cell.setdefault("metadata", {})
    return notebook, None


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
    size = path.stat().st_size
    if size > MAX_NOTEBOOK_BYTES:
        return (f"{size / 1e6:.1f} MB, over the limit of {MAX_NOTEBOOK_BYTES / 1e6:g} MB for one submitted file "
                "(MAX_NOTEBOOK_BYTES in autograder/places.py): the student can clear its outputs and submit it again")
    return None


def refuse_after_error(entry: Entry, error: Exception, chosen: dict) -> None:
    """One file that made the intake fail (too deeply nested to parse, say) is refused, alone."""
    if isinstance(error, RecursionError):
        why = "its JSON is nested too deeply to be a notebook"
    else:
        why = f"{type(error).__name__}: {str(error)[:200]}"
    for key, (_, other, _) in list(chosen.items()):
        if other is entry:
            del chosen[key]
    entry.status = "refused"
    entry.reasons.append(f"could not be taken in ({why})")


def _timestamp(mtime: float) -> str:
    """nbgrader's timestamp.txt format (UTC)."""
    moment = datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S.%f UTC")


def archive_previous(folder: Path, root: Path) -> Path:
    """Keep an earlier submission: ``archive/submitted/<student>/<assignment>/<its time>/``."""
    stamp_file = folder / "timestamp.txt"
    stamp = (stamp_file.read_text().strip() if stamp_file.exists() else
             _timestamp(max(p.stat().st_mtime for p in folder.iterdir())))
    name = re.sub(r"[^0-9T]", "", stamp.replace(" ", "T"))[:15] or "earlier"
    relative = folder.relative_to(root / "submitted")
    target = root / "archive" / "submitted" / relative / name
    suffix = 1
    while target.exists():
        suffix += 1
        target = target.with_name(f"{name}-{suffix}")
    shutil.copytree(folder, target)
    return target


def intake(submissions: Path, root: Path = COURSE_ROOT, course_dir: Path = COURSE_DIR,
           assignments: list[str] | None = None, roster=None, add_unknown: bool = False) -> list[Entry]:
    """File every submission of ``submissions``; ``roster``: the course's (roster.csv of the
    course root) when not given, checked against unless ``add_unknown``."""
    assignments = assignments or assignment_names()
    releases = load_releases(course_dir, assignments)
    if roster is None:
        roster = Roster.of_course(root)
    roster_size = len(roster.students) if roster else 0
    seen: dict[str, str] = {}  # without a roster: folded name -> the spelling filed
    if roster is None and (root / "submitted").is_dir():
        seen = {fold(p.name): p.name for p in sorted((root / "submitted").iterdir()) if p.is_dir()}
    entries: list[Entry] = []
    chosen: dict[tuple[str, str], tuple[float, Entry, object]] = {}
    canvas_late: dict[tuple[str, str], bool] = {}   # Canvas's _LATE_ marker of the file chosen
    for path in sorted(submissions.rglob("*")):
        relative = path.relative_to(submissions)
        if path.name in IGNORED or set(relative.parts) & IGNORED_DIRS:
            continue
        if any(part.startswith(".") for part in relative.parts):
            continue
        if path.is_dir() and not path.is_symlink():
            continue
        entry = Entry(str(relative), relative.parts[0] if len(relative.parts) > 1 else None, "refused")
        entries.append(entry)
        problem = unreadable_file(submissions, relative)
        if problem:
            entry.reasons.append(problem)
            continue
        try:
            filename = path.name
            lms = lms_name(relative.parts[0])
            if len(relative.parts) < 2 and not lms:
                entry.reasons.append("not inside a student folder (expected <student>/<file>, "
                                     "or an LMS export's lastfirst_<id>_<id>_<file>)")
                continue
            if lms:
                entry.reasons.append(f"{lms['kind']} export: {lms['name']}, LMS user id {lms['lms']}"
                                     + (" (marked late)" if lms["late"] else ""))
                if roster is None:
                    entry.student = lms["name"]
                    entry.reasons.append("an LMS export needs the roster to know its students "
                                         "(make roster ROSTER=<csv> with their lms_user_id)")
                    continue
                if len(relative.parts) < 2:
                    filename = lms["file"]
                student = resolve_student(entry, lms["name"], roster, add_unknown, lms["lms"])
            else:
                student = resolve_student(entry, relative.parts[0], roster, add_unknown, seen=seen)
            entry.student = student or (lms["name"] if lms else relative.parts[0])
            if student is None:
                continue
            if path.suffix.lower() != ".ipynb":
                entry.reasons.append(f"not a notebook ({path.suffix or 'no extension'}): unknown file")
                continue
            notebook, problem = read_notebook(path)
            if problem:
                entry.reasons.append(problem)
                continue
            by_name = assignment_from_name(filename, assignments)
            scores = {a: content_match(notebook, r) for a, r in releases.items()}
            best = max(scores, key=scores.get) if scores else None
            if best is None or scores[best] < MIN_CONTENT_MATCH:
                entry.reasons.append("its cells are not those of any notebook of this course"
                                     + (f" (the name says {by_name})" if by_name else ""))
                continue
            if by_name and by_name != best and scores.get(by_name, 0) < MIN_CONTENT_MATCH:
                entry.reasons.append(f"named like {by_name} but its cells are those of {best}: "
                                     "the wrong notebook was submitted")
                continue
            assignment = by_name if by_name and scores.get(by_name, 0) >= MIN_CONTENT_MATCH else best
            if not by_name:
                entry.reasons.append(f"recognised by its content as {assignment}")
            elif normalise_name(Path(filename).stem) != assignment.lower() or filename != f"{assignment}.ipynb":
                entry.reasons.append(f"file name {filename!r} taken as {assignment}")
            repaired, notes, refusal = repair(notebook, releases[assignment])
            entry.assignment = assignment
            if refusal:
                entry.reasons.append("nbgrader metadata missing and cannot be repaired: " + refusal)
                continue
            entry.reasons += notes
            entry.status = "repaired" if notes else "accepted"
            key = (student, assignment)
            mtime = path.stat().st_mtime
            if key in chosen:
                other_mtime, other, _ = chosen[key]
                older, newer = (other, entry) if other_mtime <= mtime else (entry, other)
                older.status = "refused"
                older.reasons.append(f"superseded by the newer file {newer.source!r}")
                if newer is other:
                    continue
            chosen[key] = (mtime, entry, repaired)
            if lms and lms["kind"] == "Canvas":
                canvas_late[key] = lms["late"]
        except Exception as error:  # whatever one file does, it is that file's refusal
            refuse_after_error(entry, error, chosen)
    due = due_dates(root)
    by_hand = hand_graded(root) if chosen else {}
    for (student, assignment), (mtime, entry, notebook) in chosen.items():
        folder = root / "submitted" / student / assignment
        target = folder / f"{assignment}.ipynb"
        text = json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"
        when, corrected = submission_time(mtime, canvas_late.get((student, assignment)), due.get(assignment))
        entry.destination = str(target.relative_to(root))
        entry.file_time = _timestamp(mtime)
        entry.submitted_at = stamp_text(when)
        if corrected:
            entry.reasons.append(corrected)
        if target.exists() and target.read_text(encoding="utf-8") == text:
            entry.reasons.append("already in place, unchanged")
            continue
        refusal = replacement_refusal(folder, text, when, root)
        if refusal:
            entry.status, entry.destination = "refused", None
            entry.reasons.append(refusal)
            continue
        if target.exists():
            kept = archive_previous(folder, root)
            entry.reasons.append(f"replaces the previous submission (kept in {kept.relative_to(root)})")
            if (student, assignment) in by_hand:
                entry.reasons.append(f"the previous one was graded or commented by hand ({', '.join(by_hand[student, assignment])}): "
                                     "make grade keeps that for answers that did not change and names the others")
            for old in folder.glob("*.ipynb"):
                old.unlink()
        folder.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        (folder / "timestamp.txt").write_text(entry.submitted_at + "\n")
    if roster is not None and add_unknown and len(roster.students) > roster_size:
        roster.write(root / ROSTER_FILE)
    return entries


def time_notices(entries: list[Entry], root: Path) -> list[str]:
    """The intake report's notices on this export's submission times (see autograder.term.intake_checks)."""
    taken = [e for e in entries if e.file_time]
    filed = [(e.student, e.assignment, parse_stamp(e.submitted_at)) for e in taken if e.status != "refused"]
    return export_notices([parse_stamp(e.file_time) for e in taken], due_dates(root), filed,
                          CourseSettings.load(root))


def write_report(entries: list[Entry], root: Path, submissions: Path, notices: list[str] | None = None) -> Path:
    """``reports/intake_report.{md,json}`` (this run) and a copy of each under ``reports/intake/``
    named by its time: earlier runs' reports are kept, and ``reports/intake_history.md`` lists them all."""
    data = {"submissions": str(submissions), "files": [asdict(e) for e in entries]}
    counts = {s: sum(e.status == s for e in entries) for s in ("accepted", "repaired", "refused")}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    lines = ["", f"From `{submissions}`: " + summary, ""]
    lines += [f"- {notice}" for notice in notices or []] + ([""] if notices else [])
    lines += ["| file | student | status | assignment | submitted (UTC) | reasons |", "|---|---|---|---|---|---|"]
    for e in sorted(entries, key=lambda e: (e.status != "refused", e.source)):
        reasons = "; ".join(e.reasons).replace("|", "/")
        lines.append(f"| {e.source} | {e.student or '-'} | {e.status} | {e.assignment or '-'} | "
                     f"{(e.submitted_at or '-').replace(' UTC', '')} | {reasons} |")
    return keep_report(root, "intake", "Intake report", lines, data, f"`{submissions}`: {summary}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("submissions", type=Path, help="folder laid out as <student>/<file>")
    parser.add_argument("--root", type=Path, default=COURSE_ROOT, help="course root (default: autograder/course_root/)")
    parser.add_argument("--course", type=Path, default=COURSE_DIR, help="the student release notebooks")
    parser.add_argument("--add-unknown", action="store_true",
                        help="accept students missing from the roster (and add them to it)")
    options = parser.parse_args(argv)
    if not options.submissions.is_dir():
        print(f"{options.submissions}: no such folder (make intake SUBMISSIONS=<folder>)")
        return 2
    roster = Roster.of_course(options.root)
    if roster is None:
        print(f"no roster ({options.root / ROSTER_FILE}): student folder names are taken as they are; "
              "`make roster ROSTER=<csv>` checks them")
    entries = intake(options.submissions, options.root, options.course, roster=roster,
                     add_unknown=options.add_unknown)
    notices = time_notices(entries, options.root)
    report = write_report(entries, options.root, options.submissions, notices)
    for entry in entries:
        where = f" -> {entry.destination}" if entry.destination else ""
        print(f"{entry.status:9s} {entry.source}{where}" + (f"  ({'; '.join(entry.reasons)})" if entry.reasons else ""))
    for notice in notices:
        print(f"NOTE: {notice}")
    counts = {s: sum(e.status == s for e in entries) for s in ("accepted", "repaired", "refused")}
    print(", ".join(f"{n} {s}" for s, n in counts.items()) + f"; report: {report}")
    # refused files need the instructor (make intake fails, so that a script notices)
    return 1 if counts["refused"] else 0


if __name__ == "__main__":
    sys.exit(main())
