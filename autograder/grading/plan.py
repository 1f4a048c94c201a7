"""What a grading run has to do (parent process): submissions, fingerprints, state.

A submission is regraded when its fingerprint changed since it was last graded: its files,
its submission time (``timestamp.txt``, written by intake), the source notebook and the
limits that change what a notebook does when it runs (:meth:`autograder.limits.Limits.fingerprint`).  The due date, the late
penalty, the grace period and extensions are not in it: a change of them re-scores the stored
results (:func:`autograder.grading.merge.rescore`), it re-executes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from autograder.limits import Limits
from autograder.places import RECEIVED_FOLDER, TIMESTAMP_FILE
from autograder.publishing.release import assignments_with_source

STATE_DIR = ".grading"
IGNORED_NAMES = {".ipynb_checkpoints", "__MACOSX", ".DS_Store", TIMESTAMP_FILE, RECEIVED_FOLDER}


@dataclass
class Submission:
    student: str
    assignment: str
    folder: Path

    @property
    def key(self) -> str:
        return f"{self.student}/{self.assignment}"


@dataclass
class Outcome:
    student: str
    assignment: str
    status: str                          # graded | unchanged | failed
    seconds: float = 0.0
    attempts: int = 0
    score: float | None = None           # the gradebook's total (hand grades included), late penalty deducted
    max_score: float | None = None
    pending: float = 0.0                 # points that still wait for grading by hand
    late_penalty: float = 0.0
    notes: list[str] = field(default_factory=list)   # for the instructor: a re-scored penalty, a dropped hand grade
    tests: list[dict] = field(default_factory=list)
    incidents: list[dict] = field(default_factory=list)
    error: str = ""
    fingerprint: str = ""
    nbgrader_pids: list[int] = field(default_factory=list)   # pid of the nbgrader process of each attempt
    worker: str = ""                     # the Dask worker that graded it
    left_in_sandbox_mb: float | None = None  # memory its sandbox held beyond its processes once it was graded

    def as_dict(self) -> dict:
        data = dataclasses.asdict(self)
        for private in ("fingerprint", "nbgrader_pids", "worker"):
            data.pop(private)
        return data


# --------------------------------------------------------------------------------------
# Discovery
# --------------------------------------------------------------------------------------

def notebook_names(root: Path, assignment: str) -> list[str]:
    return sorted(p.stem for p in (root / "source" / assignment).glob("*.ipynb"))


def submitted_folders(root: Path) -> list[Path]:
    """Every ``submitted/<student>/<assignment>/`` folder (quick: nothing is read)."""
    submitted = root / "submitted"
    if not submitted.is_dir():
        return []
    return sorted(p for p in submitted.glob("*/*") if p.is_dir() and not p.name.startswith(".")
                  and not p.parent.name.startswith("."))


def discover(root: Path, students: list[str] | None = None,
             assignments: list[str] | None = None) -> tuple[list[Submission], list[str]]:
    """Every ``submitted/<student>/<assignment>/`` holding a notebook; problems as text."""
    submissions, problems = [], []
    known = set(assignments_with_source(root))
    submitted = root / "submitted"
    if not submitted.is_dir():
        return [], [f"no submissions folder {submitted}"]
    for student_dir in sorted(submitted.iterdir()):
        if not student_dir.is_dir() or student_dir.name.startswith("."):
            continue
        if students and student_dir.name not in students:
            continue
        for folder in sorted(student_dir.iterdir()):
            if not folder.is_dir() or folder.name.startswith("."):
                continue
            if assignments and folder.name not in assignments:
                continue
            if folder.name not in known:
                problems.append(f"{student_dir.name}/{folder.name}: no such assignment in {root / 'source'}; skipped")
                continue
            if not any(folder.glob("*.ipynb")):
                problems.append(f"{student_dir.name}/{folder.name}: no notebook in the folder; skipped")
                continue
            submissions.append(Submission(student_dir.name, folder.name, folder))
    return submissions, problems


# --------------------------------------------------------------------------------------
# Fingerprints, the files a task carries
# --------------------------------------------------------------------------------------

def tree_files(folder: Path, ignored: set[str] = IGNORED_NAMES) -> dict[str, bytes]:
    """``{relative path: bytes}`` of every file under ``folder`` (noise such as checkpoints left out)."""
    if not folder.is_dir():
        return {}
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file() and not (set(path.relative_to(folder).parts) & ignored)}


def hash_files(digest, files: dict[str, bytes]) -> None:
    for name in sorted(files):
        digest.update(name.encode() + b"\0")
        digest.update(hashlib.sha256(files[name]).digest())


def _hash_tree(digest, folder: Path) -> None:
    hash_files(digest, tree_files(folder))


def submission_timestamp(submission: Submission) -> str:
    path = submission.folder / TIMESTAMP_FILE
    return path.read_text(encoding="utf-8").strip() if path.is_file() else ""


def fingerprint(submission: Submission, root: Path, limits: Limits) -> str:
    digest = hashlib.sha256()
    _hash_tree(digest, submission.folder)
    _hash_tree(digest, root / "source" / submission.assignment)
    digest.update(limits.fingerprint().encode())
    digest.update(f"\0submitted {submission_timestamp(submission)}".encode())
    return digest.hexdigest()


# --------------------------------------------------------------------------------------
# State and the run's lock
# --------------------------------------------------------------------------------------

def load_state(root: Path) -> dict:
    path = root / STATE_DIR / "state.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def save_state(root: Path, state: dict) -> None:
    path = root / STATE_DIR / "state.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(".tmp")
    scratch.write_text(json.dumps(state, indent=1, sort_keys=True, ensure_ascii=False))
    scratch.replace(path)


@contextlib.contextmanager
def exclusive(root: Path):
    """One grading run per course root at a time (runs on other roots sharing a PostgreSQL
    gradebook are serialised by the gradebook's own lock, see autograder.store.gradebook)."""
    lock_path = root / STATE_DIR / "lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"another grading run holds {lock_path}; wait for it to finish") from None
        yield
