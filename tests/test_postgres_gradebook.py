"""The gradebook on a real PostgreSQL server (``make grade DB_URL=postgresql://...``): a
class graded into it, and two grading runs at once (two TAs, two machines' course roots, one
gradebook) that neither corrupt nor duplicate anything."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from autograder.grading import grade
from autograder.grading import merge
from autograder.reports import class_report, export, feedback, lms_export
from autograder.store import gradebook
from autograder.term import roster
from autograder.places import DB_URL_VARIABLE, REPO_ROOT
from tests.grading_helpers import TINY, tiny_course
from tests.lab_servers import http_get, running_lab
from tests.postgres_server import postgres_server
from tests.readme_commands import run_readme_command

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
    outcomes = grade.grade(root, jobs=2, limits=grade.Limits(timeout=30), db_url=url, log=lambda *_: None)
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
    again = grade.grade(root, jobs=2, limits=grade.Limits(timeout=30), log=lambda *_: None)
    assert {o.student: (o.status, o.score, o.pending) for o in again} == {
        **{s: ("unchanged", SCORES[s], PENDING[s]) for s in ANSWERS}, "ann": ("unchanged", 3.0, 0.0)}
    assert rows(url) == {"student": 4, "assignment": 1, "submitted_assignment": 4, "submitted_notebook": 4,
                         "grade": 8, "comment": 8}


def test_two_grading_runs_at_once_neither_corrupt_nor_duplicate(database, tmp_path):
    url = database("two_runs")
    roots = [tiny_course(tmp_path / f"ta{n}", ANSWERS, written=WRITTEN) for n in (1, 2)]
    command = [sys.executable, "-m", "autograder.grading.grade", "--jobs", "1", "--timeout", "30", "--db-url", url]
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


def test_reads_see_an_assignments_cells_only_between_another_runs_writes(database, tmp_path, monkeypatch):
    """Another run (another TA) writing the assignment's cells one commit at a time, as
    generate_assignment does: the template a run builds meanwhile, and the grades `make export`
    and `make lms-export` read, wait for the writer lock and see every cell (read in between, a
    run once failed on a cell being replaced: "Deferred loader for attribute 'max_score' failed
    to populate correctly"; an export would have given the assignment 0 points). `make feedback`
    and `make report` read, and `make deadlines` writes, in their turn too."""
    url = database("reads_while_writing")
    monkeypatch.setenv(DB_URL_VARIABLE, url)
    root = tiny_course(tmp_path / "ta", {}, written={})
    merge.ensure_assignments(root, [TINY], {}, url)
    with gradebook.open_gradebook(root, url) as gb:
        gb.update_or_create_assignment(TINY, duedate="2026-03-02 17:00:00")
        gb.add_student("ann")
        cells = [(c.name, c.max_score, c.cell_type) for c in gb.find_notebook(TINY, TINY).grade_cells]
        points = gb.find_assignment(TINY).max_score
    assert len(cells) == 2 and points > 0, (cells, points)
    removed, may_finish, read, finished = threading.Event(), threading.Event(), {}, {}

    def other_run():
        with gradebook.writer_lock(root, url), gradebook.open_gradebook(root, url) as gb:
            for cell in gb.find_notebook(TINY, TINY).grade_cells:
                gb.db.delete(cell)
            gb.db.commit()
            removed.set()
            may_finish.wait(timeout=300)
            for name, max_score, cell_type in cells:
                gb.add_grade_cell(name, TINY, TINY, max_score=max_score, cell_type=cell_type)
            gb.db.commit()
            finished["the other run"] = time.monotonic()

    reads = {"template": lambda: merge.template(root, TINY, url), "export": lambda: export.grade_rows(root),
             "lms-export": lambda: lms_export.class_grades(root), "feedback": lambda: feedback.write_feedback(root),
             "report": lambda: class_report.write_reports(root),
             "deadlines": lambda: roster.set_deadlines({TINY: datetime.datetime(2026, 3, 9, 17)}, root, [TINY])}

    def turn(name, run):
        read[name] = run()
        finished[name] = time.monotonic()

    writer = threading.Thread(target=other_run)
    writer.start()
    try:
        assert removed.wait(timeout=300)
        readers = [threading.Thread(target=turn, args=item) for item in reads.items()]
        for reader in readers:
            reader.start()
        readers[0].join(timeout=10)   # reads that do not wait would be over by now, cells missing
    finally:
        may_finish.set()
        writer.join(timeout=300)
    for reader in readers:
        reader.join(timeout=300)
    copy = tmp_path / "template.db"
    copy.write_bytes(read["template"])
    with gradebook.open_gradebook(tmp_path, f"sqlite:///{copy}") as gb:
        assert sorted((c.name, c.max_score) for c in gb.find_notebook(TINY, TINY).grade_cells) == \
            sorted((name, max_score) for name, max_score, _ in cells)
    (row,) = read["export"]
    assert float(row[export.GRADE_COLUMNS.index("max_score")]) == points, row
    assert read["lms-export"][1] == {TINY: points}, read["lms-export"]
    assert set(finished) == {"the other run", *reads}, f"a command failed: {set(reads) - set(finished)}"
    assert all(finished[name] > finished["the other run"] for name in reads), finished
    with gradebook.open_gradebook(root, url) as gb:
        assert gb.find_assignment(TINY).duedate == datetime.datetime(2026, 3, 9, 17)


def test_the_variable_make_grade_sets_grades_new_submissions_into_postgresql(database, tmp_path, monkeypatch):
    """`make grade DB_URL=...` exports the variable to every process of the run, the Dask
    workers' nbgrader engines included: each task still grades into its own gradebook, and
    the parent alone writes the shared one."""
    url = database("from_the_variable")
    monkeypatch.setenv(DB_URL_VARIABLE, url)
    root = tiny_course(tmp_path / "course", ANSWERS, written=WRITTEN)
    outcomes = grade.grade(root, jobs=2, limits=grade.Limits(timeout=30), log=lambda *_: None)
    assert {o.student: (o.status, o.score, o.error[-300:]) for o in outcomes} == {
        s: ("graded", SCORES[s], "") for s in ANSWERS}
    assert not (root / "gradebook.db").exists(), "the SQLite gradebook was written instead"
    assert rows(url) == {"student": 4, "assignment": 1, "submitted_assignment": 4, "submitted_notebook": 4,
                         "grade": 8, "comment": 8}


# --------------------------------------------------------------------------------------
# The README's path for instructors: a server, the course's gradebook moved there, and a
# course that remembers it
# --------------------------------------------------------------------------------------

README_URL = "postgresql://grader@db-host:5432/attention_lab"
SERVER_COMMAND = "make postgres-server PGDATA=$HOME/attention-lab-db PGPORT=5432"
MIGRATE_COMMAND = f"make migrate-gradebook DB_URL={README_URL}"
STOP_COMMAND = "make postgres-stop PGDATA=$HOME/attention-lab-db"


def shell(command: str, environment: dict) -> subprocess.CompletedProcess:
    return subprocess.run(command, shell=True, cwd=REPO_ROOT, env=environment, capture_output=True, text=True,
                          timeout=900)


def test_the_readmes_postgresql_path_moves_a_course_with_everything_in_it(tmp_path, monkeypatch):
    """... and no password is ever printed or typed: `make postgres-server` keeps it in PostgreSQL's
    own password file (~/.pgpass) and prints the address other machines use; after the move every
    command on the course uses the server without DB_URL (issue #56)."""
    import datetime
    import os
    import re
    import shutil
    import stat
    import tempfile

    from autograder.term import roster
    from autograder.places import COURSE_ROOT_VARIABLE
    from autograder.term.course_settings import CourseSettings
    from tests.postgres_server import binaries, free_port

    installed = run_readme_command("make postgres")   # installs Debian's server where it is missing
    assert installed.returncode == 0, installed.stdout + installed.stderr
    if binaries() is None:
        pytest.skip("POSTGRESQL TESTS NOT RUN: initdb/pg_ctl not found (make postgres installs Debian's postgresql)")
    # a course graded on SQLite: roster, due date, a hand grade and a comment
    root = tiny_course(tmp_path / "course_root", {"ann": "value = 42", "bob": "value = 41"},
                       written={"ann": "Because.", "bob": "No idea."})
    (tmp_path / "class.csv").write_text("id,first_name,last_name,email,lms_user_id\nann,Ann,Lee,,11\nbob,Bob,Ray,,12\n")
    roster.import_roster(tmp_path / "class.csv", root)
    roster.set_deadlines({TINY: datetime.datetime(2026, 1, 10, 12, 0)}, root)
    CourseSettings(timeout=30).save(root)   # make settings TIMEOUT=30: every later run grades the same
    grade.grade(root, jobs=1, log=lambda *_: None)
    with gradebook.open_gradebook(root) as gb:
        written = gb.find_grade("why_value", TINY, TINY, "ann")
        written.manual_score, written.needs_manual_grade = 1.5, False
        gb.find_comment("why_value", TINY, TINY, "ann").manual_comment = "Say more."
        gb.db.commit()

    home = Path(tempfile.mkdtemp(prefix="alg-pg-home-"))   # the server's user (nobody, as root) reaches it
    if os.geteuid() == 0:
        shutil.chown(home, "nobody")
    port = free_port()
    environment = {**os.environ, "HOME": str(home), COURSE_ROOT_VARIABLE: str(root)}
    for variable in (DB_URL_VARIABLE, "PGPASSFILE"):
        environment.pop(variable, None)
    usage = run_readme_command("make migrate-gradebook", env=environment)   # alone: says what it needs
    assert usage.returncode != 0 and "usage: make migrate-gradebook DB_URL=postgresql://" in usage.stdout, usage.stdout
    try:
        started = run_readme_command(SERVER_COMMAND, env=environment, replace={"PGPORT=5432": f"PGPORT={port}"})
        assert started.returncode == 0, started.stdout + started.stderr
        url = re.search(r"On this machine: +DB_URL=(\S+)", started.stdout).group(1)
        elsewhere = re.search(r"From other machines: DB_URL=postgresql://grader@([^:/]+):(\d+)/", started.stdout)
        assert elsewhere and elsewhere.group(1) not in ("localhost", "127.0.0.1") and elsewhere.group(2) == str(port)
        # the password: in ~/.pgpass, readable by no one else, and never on the terminal or in a command
        pgpass = home / ".pgpass"
        assert stat.S_IMODE(pgpass.stat().st_mode) == 0o600
        (line,) = [entry for entry in pgpass.read_text().splitlines() if entry.startswith(f"*:{port}:*:grader:")]
        password = line.rsplit(":", 1)[1]
        assert len(password) >= 32 and password not in started.stdout + started.stderr and password not in url
        monkeypatch.setenv("PGPASSFILE", str(pgpass))   # this test's own reads of the server, as the instructor's machine
        again = run_readme_command(SERVER_COMMAND, env=environment, replace={"PGPORT=5432": f"PGPORT={port}"})
        assert again.returncode == 0 and pgpass.read_text().count(f"*:{port}:*:grader:{password}") == 1, again.stdout
        server = {README_URL: url}
        # before the move: naming the server for an SQLite course is refused
        early = shell(f"make grade DB_URL={url}", environment)
        assert early.returncode != 0 and "make migrate-gradebook" in early.stderr, early.stdout + early.stderr
        moved = run_readme_command(MIGRATE_COMMAND, env=environment, replace=server)
        assert moved.returncode == 0, moved.stdout + moved.stderr
        assert not (root / "gradebook.db").exists() and list((root / "archive").glob("gradebook-before-*.db"))
        with gradebook.open_gradebook(root, url) as gb:
            assert {s.id: (s.first_name, s.last_name) for s in gb.students} == {"ann": ("Ann", "Lee"),
                                                                                 "bob": ("Bob", "Ray")}
            assert gb.find_assignment(TINY).duedate == datetime.datetime(2026, 1, 10, 12, 0)
            assert gb.find_grade("why_value", TINY, TINY, "ann").manual_score == 1.5
            assert gb.find_comment("why_value", TINY, TINY, "ann").manual_comment == "Say more."
        # from then on the course's own commands use the server: no DB_URL, no password typed
        graded = run_readme_command("make grade", env=environment)
        assert graded.returncode == 0 and "graded 0, unchanged 2, failed 0" in graded.stdout, graded.stdout + graded.stderr
        assert "ann/00_tiny: 2.5 / 3" in graded.stdout, graded.stdout   # the hand grade, from the server
        exported = run_readme_command("make export", env=environment)
        assert exported.returncode == 0 and "ann" in (root / "grades.csv").read_text(), exported.stderr
        # another database's URL is refused, and nothing writes an SQLite file
        refused = shell(f"make grade DB_URL={url}x", environment)
        assert refused.returncode != 0 and "this course's gradebook is" in refused.stderr, refused.stdout + refused.stderr
        # a machine whose ~/.pgpass lacks the password is told what to do
        stranger = {**environment, "HOME": str(tmp_path / "another-machine")}
        denied = run_readme_command("make export", env=stranger)
        assert denied.returncode != 0 and "put the line `make postgres-server` wrote in ~/.pgpass" in denied.stderr, \
            denied.stdout + denied.stderr
        assert not (root / "gradebook.db").exists(), "a command wrote an SQLite gradebook"
        # Formgrader, started as written, shows the server's gradebook: the roster's names, the hand grade
        (tmp_path / "formgrader").mkdir()
        with running_lab("formgrader", root, tmp_path / "formgrader", {COURSE_ROOT_VARIABLE: str(root), "HOME": str(home)},
                         command="make formgrader") as formgrader:
            def shown(path: str) -> list[dict]:
                return json.loads(http_get(formgrader.url(f"formgrader/api/{path}")))

            students = {s["id"]: (s["first_name"], s["last_name"]) for s in shown("students")}
            assert students == {"ann": ("Ann", "Lee"), "bob": ("Bob", "Ray")}, students
            scores = {n["student"]: n["score"] for n in shown(f"submitted_notebooks/{TINY}/{TINY}")}
            assert scores == {"ann": 2.5, "bob": 0.0}, scores
        assert not (root / "gradebook.db").exists(), "make formgrader wrote an SQLite gradebook"
    finally:
        stopped = run_readme_command(STOP_COMMAND, env=environment)
        shutil.rmtree(home, ignore_errors=True)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr


def test_as_root_a_data_folder_the_server_user_cannot_reach_is_refused_saying_why(tmp_path):
    """The README: PostgreSQL refuses root, so as root the server runs as nobody, which must reach PGDATA."""
    import os

    from autograder.store import postgres
    from tests.postgres_server import binaries

    if os.geteuid() != 0 or binaries() is None:
        pytest.skip("runs as root, with PostgreSQL's server installed")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(SystemExit, match="runs as the user nobody .* cannot reach"):
        postgres.start(private / "db", 5999)
    assert not (private / "db").exists()
