"""Take in submissions as an LMS or a shared drive gives them: a folder, or the LMS's zip itself.

    python -m autograder.term.intake DOWNLOADS            # make intake SUBMISSIONS=DOWNLOADS
    python -m autograder.term.intake submissions.zip      # make intake SUBMISSIONS=~/Downloads/submissions.zip

``DOWNLOADS/<student>/<any file name>`` (files in sub-folders too) becomes
``autograder/course_root/submitted/<student>/<assignment>/<assignment>.ipynb``. The originals
are only read: the file as the student handed it in is kept, byte for byte, beside the notebook
filed (``submitted/<student>/<assignment>/.received/``, with ``receipt.json``: where it came
from, its LMS ids, what intake repaired).  Submissions are matched against the release, the
student notebooks of ``course/`` (:func:`autograder.publishing.release.released_notebook`), which is what
students got.

* **Names students really produce** are recognised: ``Copy of 01_mha_shapes.ipynb``
  (Colab), ``01_mha_shapes (1).ipynb``, ``01 MHA Shapes.ipynb``, other case; a notebook
  whose name says nothing is recognised by its content.
* **Content decides**: a notebook whose cells are those of another assignment than its
  name says is refused (it would score 0 there).
* **Grading metadata is repaired**, against the release, so that nbgrader grades the notebook
  instead of refusing it whole: Colab and other editors can drop the nbgrader cell metadata
  (each graded or locked cell is found again by its content -- the same source, or its first
  line -- and a test cell the student deleted is put back where it belongs); Jupyter's copy
  and paste duplicates a cell with its metadata (a locked copy is dropped, an answer's copy
  kept ungraded); metadata changed by hand (``grade: true, points: 100``) is put back as
  released; a cell added with grading metadata is kept, ungraded.  When a cell cannot be told
  apart from another the notebook is refused, with the reason.
* Invalid JSON, empty files, non-notebooks, unknown files: refused, with the reason.
* If a student has several files for one assignment, the newest is taken.
* **The roster** (``roster.csv`` in the course root, ``make roster``): a student folder not in
  it is refused, with the closest roster names suggested (``alcie`` -> ``alice (Alice
  Liddell)``), unless ``--add-unknown`` (which keeps the LMS user id and name the export
  gave); a folder that names a student by another spelling (case, accents, ``lastfirst``,
  e-mail, LMS user id) is filed under the roster's id.
* **LMS exports as they come**: Canvas's ``submissions.zip`` itself, or unzipped (its flat
  files ``lastfirst[_LATE]_<user id>_<attachment id>_<file>``), and Moodle's
  (``Full Name_<id>_assignsubmission_file_``), the student found through the roster's
  ``lms_user_id`` (or name).
* **Submission times** go to nbgrader's ``submitted/<student>/<assignment>/timestamp.txt``
  (UTC), which the late penalty reads: a file's time where it is one, and where it is not --
  Canvas's zip stamps every file with the time it was built, a copy without ``-p`` with its own
  -- only what can be told (:mod:`autograder.term.intake_checks`).  A zip entry's time is its
  extended (UTC) timestamp where the zip has one, else its DOS time, which has no zone: it is
  read in the course's time zone (``make settings TIME_ZONE=``).
* **History**: a resubmission replaces the one graded, and the earlier one (with what was
  received) is kept in ``archive/submitted/<student>/<assignment>/<its time>/``.

The report (``reports/intake_report.{md,json}`` in the course root, this run; every run's in
``reports/intake/``, listed in ``reports/intake_history.md``) lists every file as accepted /
repaired / refused with its reasons. Exit status 0 unless a file was refused or the export is
missing.
"""

from __future__ import annotations

import ast
import copy
import datetime
import json
import re
import shutil
import sys
import unicodedata
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

from autograder.command_line import command_line
from autograder.places import COURSE_DIR, COURSE_ROOT, RECEIVED_FOLDER, TIMESTAMP_FILE
from autograder.publishing.release import assignment_names, released_notebook
from autograder.store.run_reports import keep_report
from autograder.term.course_settings import CourseSettings
from autograder.term.intake_checks import (UTC, copied_together, due_dates, export_notices, hand_graded,
                                      not_a_submission_time, parse_stamp, replacement_refusal, stamp_text,
                                      submission_time)
from autograder.term.intake_files import Export, ExportFile, open_export, utc_time
from autograder.term.roster import ROSTER_FILE, Roster, fold, normal_name

FORBIDDEN_IN_ID = re.compile(r"[/\\*?\[\]\x00-\x1f]")
MIN_CONTENT_MATCH = 0.3
RECEIPT = "receipt.json"


@dataclass
class Entry:
    source: str                 # the file, relative to the export (folder or zip)
    student: str | None
    status: str                 # accepted | repaired | refused
    assignment: str | None = None
    destination: str | None = None
    reasons: list[str] = field(default_factory=list)
    submitted_at: str | None = None   # what timestamp.txt says (UTC)
    file_time: str | None = None      # the file's own time (UTC)
    time_not_submission: str | None = None   # why the file's time is not its submission time


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


# Canvas's bulk download ("Download Submissions": ContentZipper in Canvas's source) names each file
# ``<sortable name>[_LATE]_<user id>_<attachment id>_<file name>``: the sortable name ("Liddell, Alice")
# lower-cased with every non-word character removed (``liddellalice``), ``LATE`` when Canvas counts
# it late, the file's own id in Canvas, and the name the student uploaded it under.
# Moodle: ``Full Name_<participant id>_assignsubmission_file_[<file>]``
CANVAS = re.compile(r"^(?P<name>[^_]+?)(?P<late>_late)?_(?P<lms>\d+)_(?P<attachment>\d+)_(?P<file>.+)$", re.IGNORECASE)
MOODLE = re.compile(r"^(?P<name>.+?)_(?P<lms>\d+)_assignsubmission_(?:file|onlinetext)_(?P<file>.*)$", re.IGNORECASE)


def lms_name(name: str) -> dict | None:
    """{name, lms, file, late, kind, attachment} of a file (Canvas) or folder (Moodle) named by an
    LMS export (``attachment``: Canvas's id of the file, which its "Re-upload submissions" reads)."""
    for kind, pattern in (("Moodle", MOODLE), ("Canvas", CANVAS)):
        match = pattern.match(name)
        if match:
            found = match.groupdict()
            return {"name": found["name"], "lms": found["lms"], "file": found["file"],
                    "late": bool(found.get("late")), "kind": kind, "attachment": found.get("attachment")}
    return None


def names_from_export(lms: dict | None) -> dict[str, str]:
    """What an LMS export says of a student the roster does not know (``--add-unknown`` keeps it):
    the LMS user id, and the name -- Moodle's full name, split as the roster splits a ``name``;
    Canvas's sortable name without its separators (``liddellalice``), as the last name."""
    if lms is None:
        return {}
    if lms["kind"] == "Moodle":
        first, _, last = lms["name"].strip().rpartition(" ")
        return {"first_name": first, "last_name": last, "lms_user_id": lms["lms"]}
    return {"last_name": lms["name"], "lms_user_id": lms["lms"]}




def resolve_student(entry: "Entry", folder: str, roster, add_unknown: bool, lms: dict | None = None,
                    seen: dict[str, str] | None = None) -> str | None:
    """The student id a folder (or an LMS export's name, ``lms``) stands for; None (entry
    refused) when unknown.

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
    known, how = roster.find(student, lms["lms"] if lms else "")
    if known:
        if how:
            entry.reasons.append(how)
        return known.id
    if add_unknown:
        roster.add(student, **names_from_export(lms))
        entry.reasons.append(f"{student!r} is not in the roster: added (--add-unknown)"
                             + (f", with {lms['kind']} user id {lms['lms']}" if lms else ""))
        return student
    suggestions = roster.suggest(student)
    who = (f"{lms['kind']} export's student {student!r} ({lms['kind']} user id {lms['lms']})" if lms
           else f"student folder {student!r}")
    fix = ("Add them to the roster with their lms_user_id (make roster ROSTER=<csv>)" if lms
           else "Rename the folder")
    entry.reasons.append(f"{who} is not in the roster" + (f"; did you mean {' or '.join(suggestions)}?" if suggestions
                                                           else ".")
                         + f" {fix}, or run intake with --add-unknown (make intake ADD_UNKNOWN=1) to add them.")
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


def _grading(cell) -> dict:
    """A cell's nbgrader metadata ({} when it has none, or something that is not a dict)."""
    meta = cell.metadata.get("nbgrader")
    return meta if isinstance(meta, dict) else {}


GRADING_KEYS = ("grade", "solution", "locked", "task", "points")   # what decides how nbgrader grades a cell


def _described(meta: dict) -> str:
    shown = {key: meta[key] for key in GRADING_KEYS if key in meta}
    return ", ".join(f"{key}: {json.dumps(value)}" for key, value in shown.items()) or "none"


def _unique_cell_ids(cells) -> None:
    """nbgrader needs unique cell ids: a duplicate (or missing) one gets a new one."""
    seen: set[str] = set()
    for index, cell in enumerate(cells):
        if not cell.get("id") or cell.id in seen:
            cell.id = f"intake-{index:03d}"
        seen.add(cell.id)


def restore_grading_metadata(notebook, release: Release) -> list[str]:
    """Make the grading metadata of ``notebook`` (in place) the release's, cell by cell, where an
    accident changed it; what was done, for the report.  nbgrader's autograde refuses a whole
    notebook for any of these, and the student would have no grade at all:

    * a locked cell (a test, a read-only cell) twice, as Jupyter's copy and paste makes it (same
      metadata): the copy is dropped (nbgrader restores a locked cell's code from the source anyway);
    * an answer cell twice: the first stays the answer, the copy keeps its code and loses its
      grading metadata (both run, in order);
    * a cell of the release whose metadata differs from the release's (an answer cell saying
      ``grade: true, points: 100``): the release's metadata is put back -- no point is forged;
    * a cell with grading metadata that names no cell of the release (added, or pasted from
      elsewhere): its code stays, its grading metadata goes.

    Cells whose metadata was stripped are left to :func:`repair`."""
    released = {_grading(c)["grade_id"]: _grading(c) for c in release.cells if _grading(c).get("grade_id")}
    notes, kept, seen = [], [], set()
    for number, cell in enumerate(notebook.cells, start=1):
        meta = _grading(cell)
        grade_id = meta.get("grade_id")
        if not meta:
            if "nbgrader" in cell.metadata:   # not a dict, or empty: nothing nbgrader can read
                del cell.metadata["nbgrader"]
            kept.append(cell)
            continue
        if grade_id not in released:
            del cell.metadata["nbgrader"]
            notes.append(f"cell {number} has grading metadata ({_described(meta)}) but is no cell of the release: "
                         "kept, not graded")
        elif grade_id in seen and released[grade_id].get("locked"):
            notes.append(f"cell {number} is a second copy of the locked cell {grade_id!r} (copy and paste): dropped")
            continue
        elif grade_id in seen:
            del cell.metadata["nbgrader"]
            notes.append(f"cell {number} is a second copy of the answer cell {grade_id!r} (copy and paste): its code "
                         "is kept and runs, the first copy is the one graded")
        elif meta != released[grade_id]:
            cell.metadata["nbgrader"] = copy.deepcopy(released[grade_id])
            if any(meta.get(key) != released[grade_id].get(key) for key in GRADING_KEYS):
                notes.append(f"cell {grade_id!r}: grading metadata put back as released "
                             f"({_described(released[grade_id])}; it said {_described(meta)})")
        seen.add(grade_id)
        kept.append(cell)
    notebook.cells = kept
    return notes


def repair(notebook, release: Release) -> tuple[object, list[str], str | None]:
    """Restore the nbgrader metadata of ``notebook`` from the release: what an accident changed
    (:func:`restore_grading_metadata`), then what an editor stripped.

    Returns (a repaired copy, what was repaired, refusal reason or None).
    """
    notebook = copy.deepcopy(notebook)
    notes = restore_grading_metadata(notebook, release)
    present = {c.metadata.get("nbgrader", {}).get("grade_id") for c in notebook.cells} - {None}
    wanted = [(i, c) for i, c in enumerate(release.cells) if "nbgrader" in c.metadata]
    if all(c.metadata["nbgrader"]["grade_id"] in present for _, c in wanted):
        _unique_cell_ids(notebook.cells)
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
    _unique_cell_ids(cells)
    return notebook, notes, None




# --------------------------------------------------------------------------------------
# The intake, step by step
# --------------------------------------------------------------------------------------

def read_notebook(data: bytes):
    """(notebook, None) or (None, why it is refused)."""
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


@dataclass
class Candidate:
    """A file taken in: who and what it is, the notebook to file, and what was received."""
    entry: Entry
    student: str
    assignment: str
    notebook: object            # repaired where needed
    data: bytes                 # the file as received
    file: ExportFile
    lms: dict | None
    repairs: list[str]          # what intake changed in the notebook, for the report and the receipt


class Intake:
    """One run of ``make intake``: each step a method, in the order :meth:`run` calls them."""

    def __init__(self, submissions: Path, root: Path, course_dir: Path, assignments: list[str], roster,
                 add_unknown: bool):
        self.submissions, self.root, self.assignments = submissions, root, assignments
        self.releases = load_releases(course_dir, assignments)
        self.roster, self.add_unknown = roster, add_unknown
        self.roster_size = len(roster.students) if roster else 0
        self.settings = CourseSettings.load(root)
        self.entries: list[Entry] = []
        self.seen: dict[str, str] = {}   # without a roster: folded name -> the spelling filed
        if roster is None and (root / "submitted").is_dir():
            self.seen = {fold(p.name): p.name for p in sorted((root / "submitted").iterdir()) if p.is_dir()}

    def run(self) -> list[Entry]:
        export = open_export(self.submissions, self.settings.zone)
        try:
            candidates = [c for c in map(self.take_in, export.files) if c is not None]
        finally:
            export.close()
        chosen = self.newest(candidates)
        self.file_all(chosen, export)
        self.keep_new_students()
        return self.entries

    # ---- step 1: each file, on its own: who, which assignment, its notebook repaired
    def take_in(self, file: ExportFile) -> Candidate | None:
        relative = file.relative
        entry = Entry(str(relative), relative.parts[0] if len(relative.parts) > 1 else None, "refused")
        self.entries.append(entry)
        if file.problem:
            entry.reasons.append(file.problem)
            return None
        try:
            return self._identify(file, entry)
        except Exception as error:  # whatever one file does, it is that file's refusal
            refuse_after_error(entry, error)
            return None

    def _identify(self, file: ExportFile, entry: Entry) -> Candidate | None:
        relative = file.relative
        filename = relative.name
        lms = lms_name(relative.parts[0])
        if len(relative.parts) < 2 and not lms:
            entry.reasons.append("not inside a student folder (expected <student>/<file>, "
                                 "or an LMS export's lastfirst_<id>_<id>_<file>)")
            return None
        if lms:
            entry.reasons.append(f"{lms['kind']} export: {lms['name']}, LMS user id {lms['lms']}"
                                 + (" (marked late)" if lms["late"] else ""))
            if self.roster is None:
                entry.student = lms["name"]
                entry.reasons.append("an LMS export needs the roster to know its students "
                                     "(make roster ROSTER=<csv> with their lms_user_id)")
                return None
            if len(relative.parts) < 2:
                filename = lms["file"]
            student = resolve_student(entry, lms["name"], self.roster, self.add_unknown, lms)
        else:
            student = resolve_student(entry, relative.parts[0], self.roster, self.add_unknown, seen=self.seen)
        entry.student = student or (lms["name"] if lms else relative.parts[0])
        if student is None:
            return None
        if relative.suffix.lower() != ".ipynb":
            entry.reasons.append(f"not a notebook ({relative.suffix or 'no extension'}): unknown file")
            return None
        data = file.read()
        notebook, problem = read_notebook(data)
        if problem:
            entry.reasons.append(problem)
            return None
        assignment = self._assignment(notebook, filename, entry)
        if assignment is None:
            return None
        repaired, notes, refusal = repair(notebook, self.releases[assignment])
        entry.assignment = assignment
        if refusal:
            entry.reasons.append("nbgrader metadata missing and cannot be repaired: " + refusal)
            return None
        entry.reasons += notes
        entry.status = "repaired" if notes else "accepted"
        return Candidate(entry, student, assignment, repaired, data, file, lms, notes)

    def _assignment(self, notebook, filename: str, entry: Entry) -> str | None:
        """Which assignment a notebook is: its content decides, its name breaks ties."""
        by_name = assignment_from_name(filename, self.assignments)
        scores = {a: content_match(notebook, r) for a, r in self.releases.items()}
        best = max(scores, key=scores.get) if scores else None
        if best is None or scores[best] < MIN_CONTENT_MATCH:
            entry.reasons.append("its cells are not those of any notebook of this course"
                                 + (f" (the name says {by_name})" if by_name else ""))
            return None
        if by_name and by_name != best and scores.get(by_name, 0) < MIN_CONTENT_MATCH:
            entry.reasons.append(f"named like {by_name} but its cells are those of {best}: "
                                 "the wrong notebook was submitted")
            return None
        assignment = by_name if by_name and scores.get(by_name, 0) >= MIN_CONTENT_MATCH else best
        if not by_name:
            entry.reasons.append(f"recognised by its content as {assignment}")
        elif normalise_name(Path(filename).stem) != assignment.lower() or filename != f"{assignment}.ipynb":
            entry.reasons.append(f"file name {filename!r} taken as {assignment}")
        return assignment

    # ---- step 2: one file per student and assignment, the newest
    @staticmethod
    def newest(candidates: list[Candidate]) -> list[Candidate]:
        chosen: dict[tuple[str, str], Candidate] = {}
        for candidate in candidates:
            key = (candidate.student, candidate.assignment)
            other = chosen.get(key)
            if other is not None:
                older, newer = (other, candidate) if other.file.time <= candidate.file.time else (candidate, other)
                older.entry.status = "refused"
                older.entry.reasons.append(f"superseded by the newer file {newer.entry.source!r}")
                candidate = newer
            chosen[key] = candidate
        return list(chosen.values())

    # ---- step 3: each chosen file's submission time, and its filing
    def file_all(self, chosen: list[Candidate], export: Export) -> None:
        due = due_dates(self.root)
        by_hand = hand_graded(self.root) if chosen else {}
        together = copied_together([c.file.time for c in chosen])
        now = datetime.datetime.now(UTC)
        for candidate in chosen:
            lms = candidate.lms["kind"] if candidate.lms else None
            why_not = not_a_submission_time(candidate.file.time, export.time, lms, now, together)
            candidate.entry.time_not_submission = why_not
            try:
                self.file(candidate, why_not, due.get(candidate.assignment), by_hand)
            except Exception as error:
                refuse_after_error(candidate.entry, error)

    def file(self, candidate: Candidate, why_not: str | None, due: datetime.datetime | None,
             by_hand: dict[tuple[str, str], list[str]]) -> None:
        """File one submission: a copy of the notebook (repaired where needed) where nbgrader looks
        for it, its time, and the file as received beside it; the one it replaces archived."""
        entry, student, assignment = candidate.entry, candidate.student, candidate.assignment
        folder = self.root / "submitted" / student / assignment
        target = folder / f"{assignment}.ipynb"
        text = json.dumps(candidate.notebook, indent=1, ensure_ascii=False) + "\n"
        lms = candidate.lms or {}
        when, said = submission_time(candidate.file.time, why_not, due, lms.get("kind"), lms.get("late", False))
        entry.file_time = stamp_text(candidate.file.time)
        if said:
            entry.reasons.append(said)
        if when is None:
            entry.status = "refused"
            return
        entry.destination = str(target.relative_to(self.root))
        entry.submitted_at = stamp_text(when)
        if target.exists() and target.read_text(encoding="utf-8") == text:
            entry.reasons.append("already in place, unchanged")
            if receipt(folder) is None:   # filed by an intake that kept no receipt
                keep_received(folder, candidate, self.submissions)
            return
        refusal = replacement_refusal(folder, text, when, self.root)
        if refusal:
            entry.status, entry.destination = "refused", None
            entry.reasons.append(refusal)
            return
        if target.exists():
            kept = archive_previous(folder, self.root)
            entry.reasons.append(f"replaces the previous submission (kept in {kept.relative_to(self.root)})")
            if (student, assignment) in by_hand:
                entry.reasons.append(f"the previous one was graded or commented by hand "
                                     f"({', '.join(by_hand[student, assignment])}): make grade keeps that for answers "
                                     "that did not change and names the others")
            for old in folder.glob("*.ipynb"):
                old.unlink()
            shutil.rmtree(folder / RECEIVED_FOLDER, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        (folder / TIMESTAMP_FILE).write_text(entry.submitted_at + "\n")
        keep_received(folder, candidate, self.submissions)
        if entry.status == "repaired":
            entry.reasons.append(f"the file as received is kept in {(folder / RECEIVED_FOLDER).relative_to(self.root)}")

    # ---- step 4: students the run added to the roster (--add-unknown)
    def keep_new_students(self) -> None:
        if self.roster is not None and self.add_unknown and len(self.roster.students) > self.roster_size:
            self.roster.write(self.root / ROSTER_FILE)


def intake(submissions: Path, root: Path = COURSE_ROOT, course_dir: Path = COURSE_DIR,
           assignments: list[str] | None = None, roster=None, add_unknown: bool = False) -> list[Entry]:
    """File every submission of ``submissions`` (a folder or a zip); ``roster``: the course's
    (roster.csv of the course root) when not given, checked against unless ``add_unknown``."""
    if roster is None:
        roster = Roster.of_course(root)
    return Intake(Path(submissions), Path(root), Path(course_dir), assignments or assignment_names(), roster,
                  add_unknown).run()


def refuse_after_error(entry: Entry, error: Exception) -> None:
    """One file that made the intake fail (too deeply nested to parse, say) is refused, alone."""
    if isinstance(error, RecursionError):
        why = "its JSON is nested too deeply to be a notebook"
    else:
        why = f"{type(error).__name__}: {str(error)[:200]}"
    entry.status, entry.destination = "refused", None
    entry.reasons.append(f"could not be taken in ({why})")


def _timestamp(mtime: float) -> str:
    """nbgrader's timestamp.txt format (UTC)."""
    return stamp_text(utc_time(mtime))


SAFE_FILE_NAME = re.compile(r"[^\w .()+,=@-]")


def keep_received(folder: Path, candidate: Candidate, submissions: Path) -> None:
    """The file as the student handed it in, byte for byte, in ``<submission>/.received/``, and
    ``receipt.json``: where it came from, the LMS's ids (Canvas's re-upload of feedback needs
    them: autograder.reports.lms_export), the times, and what intake repaired."""
    received = folder / RECEIVED_FOLDER
    received.mkdir(parents=True, exist_ok=True)
    name = SAFE_FILE_NAME.sub("_", candidate.file.relative.name).strip(". ") or "received.ipynb"
    (received / name).write_bytes(candidate.data)
    entry, lms = candidate.entry, candidate.lms
    receipt = {"file": name, "export": str(submissions), "path_in_export": str(candidate.file.relative),
               "file_time": entry.file_time, "submitted_at": entry.submitted_at,
               "time_not_submission": entry.time_not_submission,
               "repaired": candidate.repairs,
               "lms": None if lms is None else {key: lms[key] for key in ("kind", "name", "lms", "attachment", "late", "file")},
               "received": stamp_text(datetime.datetime.now(UTC))}
    (received / RECEIPT).write_text(json.dumps(receipt, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def receipt(folder: Path) -> dict | None:
    """What intake recorded of the submission in ``folder`` (:func:`keep_received`), if anything."""
    try:
        return json.loads((folder / RECEIVED_FOLDER / RECEIPT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def archive_previous(folder: Path, root: Path) -> Path:
    """Keep an earlier submission (and what was received): ``archive/submitted/<student>/<assignment>/<its time>/``."""
    stamp_file = folder / TIMESTAMP_FILE
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


# --------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------

def time_notices(entries: list[Entry], root: Path) -> list[str]:
    """The intake report's notices on this export's submission times (see autograder.term.intake_checks)."""
    untrusted: dict[str, int] = {}
    for entry in entries:
        if entry.time_not_submission:
            why = re.sub(r" \(\d{4}-\d\d-\d\d [^)]*\)", "", entry.time_not_submission)   # one line per kind of reason
            untrusted[why] = untrusted.get(why, 0) + 1
    filed = [(e.student, e.assignment, parse_stamp(e.submitted_at)) for e in entries
             if e.submitted_at and e.status != "refused"]
    return export_notices(untrusted, due_dates(root), filed, CourseSettings.load(root))


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
    parser = command_line(__doc__, course_root=True)
    parser.add_argument("submissions", type=Path, help="a folder laid out as <student>/<file> or as an LMS exports it, "
                                                        "or the LMS's zip itself")
    parser.add_argument("--course", type=Path, default=COURSE_DIR, help="the student release notebooks")
    parser.add_argument("--add-unknown", action="store_true",
                        help="accept students missing from the roster (and add them to it, with the LMS's id and name)")
    options = parser.parse_args(argv)
    if not options.submissions.exists():
        print(f"{options.submissions}: no such folder or zip (make intake SUBMISSIONS=<folder or .zip>)")
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
