"""The gradebook on a real PostgreSQL server (``make grade DB_URL=postgresql://...``): a
class graded into it, and two grading runs at once (two TAs, two machines' course roots, one
gradebook) that neither corrupt nor duplicate anything."""

from __future__ import annotations

import subprocess
import sys

import pytest

from autograder import grade, gradebook
from autograder.settings import DB_URL_VARIABLE, REPO_ROOT
from tests.grading_helpers import TINY, tiny_course
from tests.postgres_server import postgres_server

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("postgres")]

ANSWERS = {"ann": "value = 42", "bob": "value = 41", "cy": "value = 6 * 7", "dee": "raise ValueError('no')"}
SCORES = {"ann": 1.0, "bob": 0.0, "cy": 1.0, "dee": 0.0}
WRITTEN = {"ann": "Because.", "cy": "The answer."}
# a written answer left as released is not waiting for a grader (nbgrader scores it 0)
PENDING = {"ann": 2.0, "bob": 0.0, "cy": 2.0, "dee": 0.0}


@pytest.fixture(scope="module")
def database():
    with postgres_server() as create:
        yield create


def rows(url: str) -> dict[str, int]:
    """How many rows each table of interest holds."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return {table: connection.execute(text(f"SELECT count(*) FROM {table}")).scalar()
                    for table in ("student", "assignment", "submitted_assignment", "submitted_notebook", "grade",
                                  "comment")}
    finally:
        engine.dispose()


def test_a_class_grades_into_postgresql(database, tmp_path, monkeypatch):
    url = database("one_class")
    root = tiny_course(tmp_path / "course", ANSWERS, written=WRITTEN)
    outcomes = grade.grade(root, jobs=2, settings=grade.Settings(timeout=30), db_url=url, log=lambda *_: None)
    assert {o.student: (o.status, o.score, o.pending) for o in outcomes} == {
        s: ("graded", SCORES[s], PENDING[s]) for s in ANSWERS}
    assert not (root / "gradebook.db").exists(), "the SQLite gradebook was written instead"
    with gradebook.open_gradebook(root, url) as gb:
        assert {s.student.id: s.score for s in gb.find_assignment(TINY).submissions} == SCORES
        written = gb.find_grade("why_value", TINY, TINY, "ann")
        assert written.needs_manual_grade and written.auto_score is None
        written.manual_score, written.needs_manual_grade = 2.0, False   # as Formgrader saves it
        gb.db.commit()
    # The variable `make grade DB_URL=...` sets reaches every reader of the gradebook.
    monkeypatch.setenv(DB_URL_VARIABLE, url)
    assert gradebook.db_url(root) == url and gradebook.exists(root)
    again = grade.grade(root, jobs=2, settings=grade.Settings(timeout=30), log=lambda *_: None)
    assert {o.student: (o.status, o.score, o.pending) for o in again} == {
        **{s: ("unchanged", SCORES[s], PENDING[s]) for s in ANSWERS}, "ann": ("unchanged", 3.0, 0.0)}
    assert rows(url) == {"student": 4, "assignment": 1, "submitted_assignment": 4, "submitted_notebook": 4,
                         "grade": 8, "comment": 8}


def test_two_grading_runs_at_once_neither_corrupt_nor_duplicate(database, tmp_path):
    url = database("two_runs")
    roots = [tiny_course(tmp_path / f"ta{n}", ANSWERS, written=WRITTEN) for n in (1, 2)]
    command = [sys.executable, "-m", "autograder.grade", "--jobs", "1", "--timeout", "30", "--db-url", url]
    runs = [subprocess.Popen(command + ["--root", str(root)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for root in roots]
    results = [(run.wait(), run.stdout.read()) for run in runs]
    for status, output in results:
        assert status == 0 and "graded 4, unchanged 0, failed 0" in output, output
    assert rows(url) == {"student": 4, "assignment": 1, "submitted_assignment": 4, "submitted_notebook": 4,
                         "grade": 8, "comment": 8}
    with gradebook.open_gradebook(roots[0], url) as gb:
        assert {s.student.id: s.score for s in gb.find_assignment(TINY).submissions} == SCORES
        assert sum(len(n.grade_cells) for n in gb.find_assignment(TINY).notebooks) == 2


def test_the_variable_make_grade_sets_grades_new_submissions_into_postgresql(database, tmp_path, monkeypatch):
    """`make grade DB_URL=...` exports the variable to every process of the run, the Dask
    workers' nbgrader engines included: each task still grades into its own gradebook, and
    the parent alone writes the shared one."""
    url = database("from_the_variable")
    monkeypatch.setenv(DB_URL_VARIABLE, url)
    root = tiny_course(tmp_path / "course", ANSWERS, written=WRITTEN)
    outcomes = grade.grade(root, jobs=2, settings=grade.Settings(timeout=30), log=lambda *_: None)
    assert {o.student: (o.status, o.score, o.error[-300:]) for o in outcomes} == {
        s: ("graded", SCORES[s], "") for s in ANSWERS}
    assert not (root / "gradebook.db").exists(), "the SQLite gradebook was written instead"
    assert rows(url) == {"student": 4, "assignment": 1, "submitted_assignment": 4, "submitted_notebook": 4,
                         "grade": 8, "comment": 8}
