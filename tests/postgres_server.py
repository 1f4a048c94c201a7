"""A real PostgreSQL server for a test: Debian's package (``make postgres`` installs it),
started by the test in a scratch folder on a free port, stopped afterwards.

PostgreSQL refuses to run as root: as root the server runs as ``nobody`` (``runuser``); as
any other user, as that user.  Skipped LOUDLY when the server cannot be found.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import pytest

from autograder.store.postgres import START_SECONDS, as_server_user as _as_server_user, binaries

USER = "grader"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def postgres_server():
    """Yield a function ``database(name) -> URL`` creating a fresh database on a running server."""
    folder = binaries()
    if folder is None:
        message = "POSTGRESQL TESTS NOT RUN: initdb/pg_ctl not found (make postgres installs Debian's postgresql)"
        warnings.warn(message)
        pytest.skip(message)
    scratch = Path(tempfile.mkdtemp(prefix="alg-postgres-"))
    data, sockets = scratch / "data", scratch / "sockets"
    sockets.mkdir()
    if os.geteuid() == 0:
        shutil.chown(scratch, "nobody")
        shutil.chown(sockets, "nobody")
    port = free_port()
    log = scratch / "server.log"
    subprocess.run(_as_server_user([str(folder / "initdb"), "-D", str(data), "-U", USER, "-A", "trust",
                                    "-E", "UTF8", "--no-sync"]), check=True, capture_output=True)
    subprocess.run(_as_server_user([str(folder / "pg_ctl"), "-D", str(data), "-l", str(log), "-w",
                                    "-t", str(START_SECONDS), "-o",
                                    f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off",
                                    "start"]), check=True, capture_output=True)
    base = f"postgresql://{USER}@127.0.0.1:{port}"
    try:
        from sqlalchemy import create_engine, text

        def database(name: str) -> str:
            engine = create_engine(f"{base}/postgres", isolation_level="AUTOCOMMIT")
            with engine.connect() as connection:
                connection.execute(text(f'CREATE DATABASE "{name}"'))
            engine.dispose()
            return f"{base}/{name}"

        yield database
    finally:
        subprocess.run(_as_server_user([str(folder / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]),
                       capture_output=True)
        deadline = time.monotonic() + 30
        while (data / "postmaster.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        shutil.rmtree(scratch, ignore_errors=True)
