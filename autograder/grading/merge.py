"""The gradebook and ``autograded/`` (parent process: their only writer).

* :func:`ensure_sources`: ``source/<a>/<a>.ipynb`` built from ``solutions/``;
* :func:`ensure_assignments`: every assignment in the gradebook (``nbgrader generate_assignment``);
* :func:`template`: the bytes of a small SQLite gradebook holding one assignment (its cells,
  its due date), which each task carries: nbgrader on a worker grades into it;
* :func:`merge`: what a worker returned, into the gradebook and ``autograded/``: grades,
  comments, the submission time and late penalty; hand grades given earlier are kept for
  every answer that did not change (and dropped, to be given again, where it changed);
* :func:`apply_late_policy`: nbgrader's own record of a submission's late penalty and extension
  (computed by :mod:`autograder.term.scores`, which every reader calls again when it reads);
* :func:`rescore`: the late penalties of stored results again, after a change of the course
  settings or a due date (nothing is re-executed), and what the gradebook says they score now.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import nbformat

from autograder.publishing import release
from autograder.store import gradebook
from autograder.term import scores
from autograder.term.course_settings import CourseSettings
from autograder.grading.plan import Outcome, _hash_tree, notebook_names
from autograder.term.roster import Roster

def ensure_sources(root: Path, assignments: list[str]) -> None:
    """``source/<a>/<a>.ipynb`` rebuilt from ``solutions/`` (the release builder's function),
    written only when it changed; assignments not in ``solutions/`` keep the source they have."""
    known = set(release.assignment_names())
    repository = None
    for assignment in assignments:
        if assignment not in known:
            continue
        repository = repository or release.course_repository()
        path = release.source_path(root, assignment)
        built = release.build_source(assignment, repository)
        with tempfile.TemporaryDirectory() as scratch:  # the same bytes as a written notebook
            fresh = Path(scratch) / path.name
            release.write_notebook(built, fresh)
            if path.exists() and path.read_bytes() == fresh.read_bytes():
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(fresh, path)


def ensure_assignments(root: Path, assignments: list[str], state: dict, url: str | None = None) -> None:
    """Each assignment in the gradebook, with the cells of its current source notebook."""
    from nbgrader.api import MissingEntry

    url = gradebook.db_url(root, url)
    sources = state.setdefault("_sources", {})
    with gradebook.writer_lock(root, url):
        stale = {}
        for assignment in assignments:
            digest = hashlib.sha256()
            _hash_tree(digest, root / "source" / assignment)
            with gradebook.open_gradebook(root, url) as gb:
                try:
                    present = len(gb.find_assignment(assignment).notebooks) > 0
                except MissingEntry:
                    present = False
            if not (present and sources.get(assignment) == digest.hexdigest()):
                stale[assignment] = digest.hexdigest()
        release.generate_assignments(list(stale), root, "--log-level=ERROR", f"--CourseDirectory.db_url={url}")
        sources.update(stale)


def template(root: Path, assignment: str, url: str | None = None) -> bytes:
    """An SQLite gradebook holding only ``assignment`` (cells and due date), as bytes: read
    between another run's writes (:func:`gradebook.exclusive`)."""
    with tempfile.TemporaryDirectory(prefix="alg-template-") as scratch:
        with gradebook.exclusive(root, url) as main, \
                gradebook.open_gradebook(Path(scratch), f"sqlite:///{scratch}/t.db") as copy:
            found = main.find_assignment(assignment)
            copy.update_or_create_assignment(assignment, duedate=found.duedate)
            for notebook in found.notebooks:
                copy.update_or_create_notebook(notebook.name, assignment)
                for cell in notebook.grade_cells:
                    copy.add_grade_cell(cell.name, notebook.name, assignment, max_score=cell.max_score,
                                        cell_type=cell.cell_type)
                for cell in notebook.task_cells:
                    copy.add_task_cell(cell.name, notebook.name, assignment, max_score=cell.max_score,
                                       cell_type=cell.cell_type)
                for cell in notebook.solution_cells:
                    copy.add_solution_cell(cell.name, notebook.name, assignment)
                for cell in notebook.source_cells:
                    copy.add_source_cell(cell.name, notebook.name, assignment, cell_type=cell.cell_type,
                                         locked=cell.locked, source=cell.source, checksum=cell.checksum)
            copy.db.commit()
        return (Path(scratch) / "t.db").read_bytes()


def answers(notebook: nbformat.NotebookNode) -> dict[str, str]:
    """``{grade_id: source}`` of the answer (solution) cells of a notebook."""
    return {c.metadata["nbgrader"]["grade_id"]: c.source for c in notebook.cells
            if c.metadata.get("nbgrader", {}).get("solution") and c.metadata["nbgrader"].get("grade_id")}


def _read(data: bytes | None) -> nbformat.NotebookNode | None:
    if data is None:
        return None
    try:
        return nbformat.reads(data.decode("utf-8"), as_version=4)
    except Exception:  # an unreadable earlier notebook: nothing to compare with
        return None


def apply_late_policy(book, assignment: str, student: str, policy: CourseSettings) -> float:
    """nbgrader's own record of one submission's lateness, for nbgrader's tools: each notebook's
    ``late_submission_penalty`` and the submission's ``extension``, as :mod:`autograder.term.scores`
    computes them now (every reader of this course computes them again when it reads: a hand
    grade or a due date changed later counts); the submission's penalty, in the session (the
    caller commits)."""
    submission = book.find_submission(assignment, student)
    due = submission.assignment.duedate
    until = policy.extension(student, assignment)
    submission.extension = (until - due) if (until and due and until > due) else None
    _reload(book)
    submission = book.find_submission(assignment, student)
    late = scores.seconds_late(submission, policy)
    for submitted in submission.notebooks:
        penalty = scores.notebook_penalty(submitted, student, policy, late)
        submitted.late_submission_penalty = penalty if late > 0 else None
    _reload(book)
    return scores.submission_score(book.find_submission(assignment, student), policy).penalty


def rescore(root: Path, keys: list[tuple[str, str]], policy: CourseSettings,
            url: str | None = None) -> dict[tuple[str, str], tuple[tuple, float]]:
    """The late penalty of each stored ``(student, assignment)`` under ``policy`` (a changed
    penalty method, grace period, extension or due date re-scores; nothing runs again);
    ``{key: (totals now, the penalty before)}`` of those in the gradebook."""
    from nbgrader.api import MissingEntry

    found = {}
    if not keys:
        return found
    with gradebook.exclusive(root, url) as book:
        try:
            for student, assignment in keys:
                try:
                    before = float(book.find_submission(assignment, student).late_submission_penalty or 0.0)
                except MissingEntry:
                    continue
                apply_late_policy(book, assignment, student, policy)
                found[(student, assignment)] = (_totals(book.find_submission(assignment, student), policy), before)
            book.db.commit()
        except BaseException:
            book.db.rollback()
            raise
    return found


def merge(outcome: Outcome, result: dict, root: Path, book, url: str | None = None,
          policy: CourseSettings | None = None) -> None:
    """One student's grades (as a worker returned them) into the gradebook ``book`` (nbgrader's
    ``Gradebook`` of ``root``/``url``, open for the whole run), and the autograded notebooks
    into ``autograded/`` (the one writer of both).

    An earlier hand grade (a manual score, extra credit, a grader's comment) is kept when
    the answer it graded did not change: a written answer's own text for its cell; every
    answer of the notebook for a test cell whose automatic score a grader overrode (one
    dropped because the answer changed is said in ``outcome.notes``).  The late penalty
    (the course settings ``policy``) is computed here, on the score the gradebook now holds.  The
    grades, comments and penalties are one transaction: a merge that fails leaves none of
    them behind, neither in the gradebook nor in the next student's merge.
    """
    destination = root / "autograded" / outcome.student / outcome.assignment
    with gradebook.writer_lock(root, url):
        try:
            _student(book, outcome.student, Roster.of_course(root))
            totals, dropped = _record(book, outcome, result, destination, policy or CourseSettings())
        except BaseException:
            book.db.rollback()
            raise
    outcome.score, outcome.max_score, outcome.pending, outcome.late_penalty = totals
    if dropped:
        kept = _archive_hand_grades(root, outcome, dropped)
        outcome.notes.append(f"hand grade dropped, the answer changed: {', '.join(d['cell'] for d in dropped)} "
                             f"(grade it again in Formgrader; the old grade and comment are in {kept})")
    scratch = destination.with_name(f".{destination.name}.new")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    for name in notebook_names(root, outcome.assignment):
        if name in result["notebooks"]:
            (scratch / f"{name}.ipynb").write_bytes(result["notebooks"][name])
    (scratch / ".grading.json").write_text(json.dumps(outcome.as_dict(), indent=1, ensure_ascii=False))
    if destination.exists():
        shutil.rmtree(destination)
    scratch.rename(destination)


def _student(target, student: str, roster: Roster | None) -> None:
    """The student's row in the gradebook, created if new, with what the roster says of them
    where the gradebook says nothing: a student intake took in with ``--add-unknown`` has the
    LMS's user id and name there (Formgrader then shows the name, the LMS export the id); a
    name a grader typed in Formgrader stays."""
    from nbgrader.api import MissingEntry

    person = roster.by_id.get(student) if roster else None
    known = {name: getattr(person, name) for name in ("first_name", "last_name", "email", "lms_user_id")
             if person is not None and getattr(person, name)}
    try:
        row = target.find_student(student)
    except MissingEntry:
        target.add_student(student, **known)
        return
    missing = {name: value for name, value in known.items() if not getattr(row, name)}
    if missing:
        target.update_or_create_student(student, **missing)


def _archive_hand_grades(root: Path, outcome: Outcome, dropped: list[dict]) -> str:
    """The hand grades and comments a resubmission dropped, kept beside the archived submission."""
    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    path = root / "archive" / "hand_grades" / outcome.student / outcome.assignment / f"{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dropped, indent=1, ensure_ascii=False), encoding="utf-8")
    return str(path.relative_to(root))


def _record(target, outcome: Outcome, result: dict, destination: Path, policy: CourseSettings) -> tuple:
    """:func:`merge`'s gradebook part, committed at its end; the submission's new totals, and
    the hand grades and comments it dropped (an answer they graded changed)."""
    from nbgrader.api import Comment, Grade
    from sqlalchemy.orm import joinedload

    flagged = {i["notebook"] for i in outcome.incidents if i.get("notebook")}
    dropped: dict[tuple[str, str], dict] = {}
    stamp = result.get("timestamp")   # (nbgrader commits the submission itself)
    if stamp:
        target.update_or_create_submission(outcome.assignment, outcome.student,
                                           timestamp=datetime.datetime.fromisoformat(stamp))
    else:
        target.update_or_create_submission(outcome.assignment, outcome.student)
    for name, recorded in result["grades"].items():
        before = _read((destination / f"{name}.ipynb").read_bytes() if (destination / f"{name}.ipynb").exists()
                       else None)
        after = _read(result["notebooks"].get(name))
        old, new = (answers(before) if before is not None else None), (answers(after) if after is not None else {})
        changed = set(new) if old is None else {g for g in set(old) | set(new) if old.get(g) != new.get(g)}
        # the notebook's grades and comments, each with its cell, in two queries (not four per cell)
        submitted = target.find_submission_notebook(name, outcome.assignment, outcome.student)
        grades = {grade.name: grade for grade in target.db.query(Grade).options(joinedload(Grade.cell))
                  .filter(Grade.notebook_id == submitted.id)}
        comments = {comment.name: comment for comment in target.db.query(Comment).options(joinedload(Comment.cell))
                    .filter(Comment.notebook_id == submitted.id)}
        for cell, (auto_score, needs_manual_grade) in recorded["grades"].items():
            mine = grades[cell]
            keep = (cell not in changed) if cell in new else not changed
            graded_by_hand = mine.manual_score is not None or bool(mine.extra_credit)
            if graded_by_hand and not keep:
                dropped[(name, cell)] = {"notebook": name, "cell": cell, "manual_score": mine.manual_score,
                                         "extra_credit": mine.extra_credit}
                mine.manual_score, mine.extra_credit = None, None
            mine.auto_score = auto_score
            mine.needs_manual_grade = bool(needs_manual_grade) and not (graded_by_hand and keep
                                                                          and mine.manual_score is not None)
        for cell, auto_comment in recorded["comments"].items():
            mine = comments[cell]
            mine.auto_comment = auto_comment
            if mine.manual_comment and cell in changed:
                dropped.setdefault((name, cell), {"notebook": name, "cell": cell})["comment"] = mine.manual_comment
                mine.manual_comment = None
        submitted.flagged = name in flagged
    _reload(target)  # the scores are sums the database computes: read them again
    apply_late_policy(target, outcome.assignment, outcome.student, policy)
    totals = _totals(target.find_submission(outcome.assignment, outcome.student), policy)
    target.db.commit()
    return totals, list(dropped.values())


def _reload(target) -> None:
    """Write what the session holds to the database (in its transaction) and forget what it read."""
    target.db.flush()
    target.db.expire_all()


def _totals(submission, policy: CourseSettings) -> tuple[float, float, float, float]:
    """(score with the late penalty deducted, max score, points waiting for hand grading, penalty)."""
    pending = sum(g.max_score for n in submission.notebooks for g in n.grades if g.needs_manual_grade)
    score = scores.submission_score(submission, policy)
    return score.final, score.max_score, float(pending), score.penalty
