"""The course root's nbgrader gradebook, opened one way by grading, feedback and export.

SQLite in the course root (``gradebook.db``) by default; any database nbgrader's SQLAlchemy
reaches when ``$ATTENTION_LAB_DB_URL`` (``make grade DB_URL=postgresql://...``) or an
explicit ``url`` names one: a PostgreSQL server lets several graders' Formgraders and the
grading pipeline share one gradebook.  Writers take :func:`writer_lock`, so that two grading
runs on one shared gradebook never interleave their writes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
import zlib
from pathlib import Path

from autograder.settings import COURSE_ID, DB_URL_VARIABLE

SQLITE_NAME = "gradebook.db"


def db_url(root: Path, url: str | None = None) -> str:
    """``url``, else ``$ATTENTION_LAB_DB_URL``, else the SQLite file in ``root``."""
    return url or os.environ.get(DB_URL_VARIABLE) or f"sqlite:///{Path(root) / SQLITE_NAME}"


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
    from nbgrader.api import Gradebook

    stamp_in_process()
    # nbgrader's own commands run the `alembic` executable when they create a gradebook: this
    # interpreter's, found on PATH
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    warnings.filterwarnings("ignore", message=".*not in session.*")  # nbgrader's own SQLAlchemy noise
    return Gradebook(db_url(root, url), COURSE_ID)


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
        with engine.connect() as connection:
            connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": key})
            connection.commit()
            try:
                yield
            finally:
                connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": key})
                connection.commit()
    finally:
        engine.dispose()
