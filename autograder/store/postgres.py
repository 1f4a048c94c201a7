"""A PostgreSQL server for the course's shared gradebook, started the one documented way.

    python -m autograder.store.postgres start --data DIR --port 5432 --password SECRET   # make postgres-server
    python -m autograder.store.postgres stop --data DIR                                   # make postgres-stop

``start`` creates the server's data folder on first use (``initdb``: a role ``grader`` with
that password, password authentication for every connection, local or remote), starts the
server listening on every address at ``--port``, creates the database ``attention_lab``
owned by ``grader`` when it is missing, and prints the ``DB_URL`` to give to every command.
Run again, it starts the same server (the data stay).  PostgreSQL refuses to run as root: as
root, the server runs as the user ``nobody`` (``runuser``), which then owns the data folder.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROLE = "grader"
DATABASE = "attention_lab"
START_SECONDS = 120


def binaries() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl`` (Debian keeps them out of PATH)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def as_server_user(argv: list[str]) -> list[str]:
    """``argv`` as the user the server runs as (``nobody`` when this is root)."""
    if os.geteuid() != 0:
        return argv
    return ["runuser", "-u", "nobody", "--", *argv]


def _folder() -> Path:
    folder = binaries()
    if folder is None:
        raise SystemExit("PostgreSQL's server is not installed: `make postgres` installs Debian's "
                         "(or your system's package postgresql)")
    return folder


def _run(argv: list[str], what: str) -> None:
    result = subprocess.run(as_server_user(argv), capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{what} failed:\n{result.stdout}{result.stderr}")


def start(data: Path, port: int, password: str) -> str:
    """Start (creating on first use) the server in ``data``; its URL, with ``localhost`` for the host."""
    if not password:
        raise SystemExit("a password for the role `grader` is needed: DB_PASSWORD=<a long random password>")
    folder = _folder()
    data = data.resolve()
    if not (data / "PG_VERSION").exists():
        data.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(data, "nobody")
        with tempfile.NamedTemporaryFile("w", prefix="alg-pw-", delete=False) as handle:
            handle.write(password + "\n")
        os.chmod(handle.name, 0o644)   # readable by the server's user; removed right after
        try:
            _run([str(folder / "initdb"), "-D", str(data), "-U", ROLE, f"--pwfile={handle.name}",
                  "-A", "scram-sha-256", "-E", "UTF8"], "initdb")
        finally:
            os.unlink(handle.name)
        with open(data / "pg_hba.conf", "a", encoding="utf-8") as hba:   # the TAs' and workers' machines
            hba.write("\n# Attention Lab: graders connect from other machines, with the password\n"
                      "host all all 0.0.0.0/0 scram-sha-256\nhost all all ::/0 scram-sha-256\n")
    running = subprocess.run(as_server_user([str(folder / "pg_ctl"), "-D", str(data), "status"]),
                             capture_output=True).returncode == 0
    if not running:
        _run([str(folder / "pg_ctl"), "-D", str(data), "-l", str(data / "server.log"), "-w", "-t", str(START_SECONDS),
              "-o", f"-p {port} -k {data} -c listen_addresses=*", "start"], "starting the server")
    url = f"postgresql://{ROLE}:{password}@localhost:{port}/{DATABASE}"
    from sqlalchemy import create_engine, text

    engine = create_engine(url.rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            if not connection.execute(text("SELECT 1 FROM pg_database WHERE datname = :d"), {"d": DATABASE}).scalar():
                connection.execute(text(f'CREATE DATABASE "{DATABASE}" OWNER "{ROLE}"'))
    finally:
        engine.dispose()
    return url


def stop(data: Path) -> None:
    _run([str(_folder() / "pg_ctl"), "-D", str(data.resolve()), "-m", "fast", "-w", "stop"], "stopping the server")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    starting = commands.add_parser("start")
    starting.add_argument("--data", type=Path, required=True)
    starting.add_argument("--port", type=int, default=5432)
    starting.add_argument("--password", default="")
    stopping = commands.add_parser("stop")
    stopping.add_argument("--data", type=Path, required=True)
    options = parser.parse_args(argv)
    if options.command == "start":
        url = start(options.data, options.port, options.password)
        host = socket.getfqdn()
        print(f"PostgreSQL is running (data: {options.data}, port {options.port}), database {DATABASE}, role {ROLE}.\n"
              f"On this machine:   DB_URL={url}\n"
              f"From other machines: DB_URL={url.replace('@localhost:', f'@{host}:')}")
    else:
        stop(options.data)
        print(f"stopped the server of {options.data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
