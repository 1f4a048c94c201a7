"""The course root's nbgrader gradebook, opened one way by grading, feedback and export.

SQLite in the course root (``gradebook.db``) by default; any database nbgrader's SQLAlchemy
reaches when ``$ATTENTION_LAB_DB_URL`` (``make grade DB_URL=postgresql://...``) or an
explicit ``url`` names one: a PostgreSQL server lets several graders' Formgraders and the
grading pipeline share one gradebook.  Writers take :func:`writer_lock`, so that two grading
runs on one shared gradebook never interleave their writes: a command that writes (due dates,
a withdrawal) or must see whole writes (feedback, the class report, the grades exported, a
run's template of an assignment) opens it with :func:`exclusive`.

The course root remembers a gradebook on a server (``gradebook_location.json``, the URL
without its password): every command run on that course uses it, with ``DB_URL`` or without,
the password coming from PostgreSQL's own password file (``~/.pgpass``, which ``make
postgres-server`` writes); a command naming another database is refused instead of writing
there, and none writes into an SQLite file of its own.  A course that has an SQLite gradebook
moves to a server with ``make migrate-gradebook DB_URL=...`` (:func:`migrate`: every table,
the roster, due dates, hand grades and comments included).

    python -m autograder.store.gradebook migrate --to postgresql://...   # make migrate-gradebook DB_URL=...
    python -m autograder.store.gradebook check                           # which gradebook; refused as above
    python -m autograder.store.gradebook url                             # a server's URL, for Formgrader (make formgrader)
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import shutil
import sys
import warnings
import zlib
from pathlib import Path

from autograder.command_line import command_line
from autograder.places import COURSE_ID, DB_URL_VARIABLE

SQLITE_NAME = "gradebook.db"
LOCATION_FILE = "gradebook_location.json"


def remembered(root: Path) -> str | None:
    """The server gradebook this course root uses (its URL without password), if any."""
    path = Path(root) / LOCATION_FILE
    return json.loads(path.read_text(encoding="utf-8"))["url"] if path.exists() else None


def remember(root: Path, url: str) -> None:
    path = Path(root) / LOCATION_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"url": describe(url)}, indent=1) + "\n", encoding="utf-8")


def same_database(url: str, other: str) -> bool:
    """The same server, port, database and role (passwords aside)."""
    from sqlalchemy.engine import make_url

    first, second = make_url(url), make_url(other)
    return ((first.get_backend_name(), first.host, first.port or 5432, first.database, first.username)
            == (second.get_backend_name(), second.host, second.port or 5432, second.database, second.username))


def db_url(root: Path, url: str | None = None) -> str:
    """``url``, else ``$ATTENTION_LAB_DB_URL``, else the server the course root remembers, else the
    SQLite file in ``root``: refused (SystemExit) where a URL names another gradebook than the
    one the course root remembers, or a server for a course whose gradebook is still its
    SQLite file."""
    named = url or os.environ.get(DB_URL_VARIABLE)
    known = remembered(root)
    if known and not named:
        return known   # its password: from ~/.pgpass, as every PostgreSQL client finds it
    if known and not same_database(named, known):
        raise SystemExit(f"DB_URL names {describe(named)}, but this course's gradebook is {known} "
                         f"({Path(root) / LOCATION_FILE}); nothing was written")
    if named and is_server(named) and not known:
        if (Path(root) / SQLITE_NAME).exists():
            raise SystemExit(f"this course's gradebook is the SQLite file {Path(root) / SQLITE_NAME}: move it, with "
                             f"every grade, comment, student and due date, with `make migrate-gradebook "
                             f"DB_URL={describe(named)}` first")
        if Path(root).is_dir():
            remember(root, named)
    return named or f"sqlite:///{Path(root) / SQLITE_NAME}"


def is_server(url: str) -> bool:
    return not url.startswith("sqlite")


def exists(root: Path, url: str | None = None) -> bool:
    """Whether the gradebook has been created (by ``make grade``)."""
    url = db_url(root, url)
    if not is_server(url):
        return (Path(root) / SQLITE_NAME).exists()
    from sqlalchemy import create_engine, inspect

    engine = create_engine(url)
    try:
        with password_explained(url):
            return "assignment" in inspect(engine).get_table_names()
    finally:
        engine.dispose()


def describe(url: str) -> str:
    """The URL without its password, for logs and reports."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


@functools.cache
def alembic_head() -> str:
    """The schema revision nbgrader stamps on a new gradebook, read in this process.

    nbgrader asks for it by running ``alembic heads`` as a subprocess each time it creates a
    gradebook: 2 s, twice per grading run (the course's gradebook the first time, and every
    run's template gradebook).  Same answer, from the same migration scripts.
    """
    import nbgrader
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(Path(nbgrader.__file__).parent / "alembic")).get_current_head()


def stamp_in_process() -> None:
    """nbgrader's ``Gradebook``, in this process, takes a new gradebook's revision from
    :func:`alembic_head` instead of running ``alembic heads``."""
    import nbgrader.api

    nbgrader.api.get_alembic_version = alembic_head


def open_gradebook(root: Path, url: str | None = None):
    """nbgrader's ``Gradebook`` of a course root (use it as a context manager)."""
    return _open(db_url(root, url))


@contextlib.contextmanager
def password_explained(url: str):
    """A server that asks for a password this machine does not have: said in a sentence (what
    to put where), not as a driver's traceback."""
    from sqlalchemy.exc import OperationalError

    try:
        yield
    except OperationalError as error:
        if "password" not in str(error):
            raise
        raise SystemExit(f"{describe(url)} asks for the password of its role, and this machine has none for it: put "
                         "the line `make postgres-server` wrote in ~/.pgpass on the database machine into ~/.pgpass "
                         f"here (mode 600), or $PGPASSFILE ({str(error).strip().splitlines()[-1]})") from None


def _open(url: str):
    """nbgrader's ``Gradebook`` at ``url``, whichever course it belongs to."""
    from nbgrader.api import Gradebook

    stamp_in_process()
    # nbgrader's own commands run the `alembic` executable when they create a gradebook: this
    # interpreter's, found on PATH
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    warnings.filterwarnings("ignore", message=".*not in session.*")  # nbgrader's own SQLAlchemy noise
    with password_explained(url):
        return Gradebook(url, COURSE_ID)


@contextlib.contextmanager
def writer_lock(root: Path, url: str | None = None):
    """Exclusive right to write the gradebook, across machines when it is on a server.

    PostgreSQL: a session advisory lock named after the course, held for the block (two
    grading runs sharing the gradebook take turns for each write; creating the tables is
    one of them).  SQLite: a no-op (one run per course root holds the root's lock, and
    SQLite locks its file for each transaction).
    """
    url = db_url(root, url)
    if not url.startswith("postgresql"):
        yield
        return
    from sqlalchemy import create_engine, text

    engine = create_engine(url, poolclass=None)
    key = zlib.crc32(f"attention-lab gradebook {COURSE_ID}".encode())
    try:
        with password_explained(url), engine.connect() as connection:
            connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": key})
            connection.commit()
            try:
                yield
            finally:
                connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": key})
                connection.commit()
    finally:
        engine.dispose()


@contextlib.contextmanager
def exclusive(root: Path, url: str | None = None):
    """nbgrader's ``Gradebook`` held under the writer lock (:func:`writer_lock`), for a write
    and for a read that must see whole writes: taken between two writers' turns. On a shared
    PostgreSQL gradebook another grading run may be writing an assignment's cells one commit at
    a time (``generate_assignment``): a read in between saw the assignment half-built, or failed
    on a cell being replaced ("Deferred loader for attribute 'max_score' failed")."""
    with writer_lock(root, url), open_gradebook(root, url) as book:
        yield book


def migrate(root: Path, url: str) -> dict[str, int]:
    """Copy the course's SQLite gradebook, every table and row, to the empty database ``url``;
    the course root then remembers it, and the SQLite file is kept in ``archive/`` (never
    deleted).  ``{table: rows copied}``."""
    from nbgrader.api import Base
    from sqlalchemy import create_engine, func, select

    root = Path(root)
    source_path = root / SQLITE_NAME
    if remembered(root):
        raise SystemExit(f"this course's gradebook is already on {remembered(root)}")
    if not is_server(url):
        raise SystemExit(f"{describe(url)} is not a database server (postgresql://role:password@host/database)")
    if not source_path.exists():
        raise SystemExit(f"no SQLite gradebook {source_path} to move")
    with _open(url):   # nbgrader creates the tables and stamps the schema revision
        pass
    source, target = create_engine(f"sqlite:///{source_path}"), create_engine(url)
    copied = {}
    try:
        with source.connect() as reading, target.begin() as writing:
            tables = Base.metadata.sorted_tables
            # (opening a gradebook writes its course's row: the copy brings the same one)
            filled = [t.name for t in tables if t.name != "course"
                      and writing.execute(select(func.count()).select_from(t)).scalar()]
            if filled:
                raise SystemExit(f"{describe(url)} already holds a gradebook (rows in {', '.join(filled)}); "
                                 "name an empty database")
            for table in tables:
                if table.name == "course":
                    writing.execute(table.delete())
                rows = [dict(row._mapping) for row in reading.execute(select(table))]
                if rows:
                    writing.execute(table.insert(), rows)
                copied[table.name] = len(rows)
            for table in tables:   # the same rows, table by table, before anything is switched over
                there = writing.execute(select(func.count()).select_from(table)).scalar()
                if there != copied[table.name]:
                    raise SystemExit(f"{table.name}: {copied[table.name]} rows read, {there} written; nothing switched")
    finally:
        source.dispose()
        target.dispose()
    kept = root / "archive" / f"gradebook-before-{datetime.datetime.now().strftime('%Y%m%dT%H%M%S')}.db"
    kept.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(source_path), str(kept))
    remember(root, url)
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__, course_root=True)
    commands = parser.add_subparsers(dest="command", required=True)
    moving = commands.add_parser("migrate", help="copy the SQLite gradebook to a database server")
    moving.add_argument("--to", required=True, help="postgresql://role:password@host/database (an empty database)")
    commands.add_parser("check", help="say which gradebook this course uses (refused where it is not the one named)")
    commands.add_parser("url", help="print the URL of the server gradebook this course uses, nothing for its SQLite "
                                    "file (refused as check is)")
    options = parser.parse_args(argv)
    if options.command == "migrate":
        if not options.to:
            raise SystemExit("usage: make migrate-gradebook DB_URL=postgresql://role:password@host/database")
        copied = migrate(options.root, options.to)
        print("copied " + ", ".join(f"{n} {t}" for t, n in copied.items() if n))
        print(f"this course's gradebook is now {describe(options.to)}: every command on this course uses it, no "
              f"DB_URL needed (the SQLite file is kept in {options.root / 'archive'})")
    elif options.command == "url":
        url = db_url(options.root)
        print(url if is_server(url) else "")
    else:
        print(f"gradebook: {describe(db_url(options.root))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
