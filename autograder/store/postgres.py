"""A PostgreSQL server for the course's shared gradebook, started the one documented way.

    python -m autograder.store.postgres start --data DIR --port 5432     # make postgres-server
    python -m autograder.store.postgres stop --data DIR                   # make postgres-stop

``start`` creates the server's data folder on first use (``initdb``: a role ``grader`` with a
password it generates -- or ``$DB_PASSWORD`` --, password authentication for
every connection, local or remote), starts the server listening on every address at ``--port``,
creates the database ``attention_lab`` owned by ``grader`` when it is missing, and prints the
``DB_URL`` to give to ``make migrate-gradebook``: for this machine, and the address other
machines reach it at.

The password is never printed, nor typed in a command: it goes to PostgreSQL's own password
file, ``~/.pgpass`` (or ``$PGPASSFILE``; mode 600), which every PostgreSQL client -- psycopg,
hence the whole pipeline, and ``psql`` -- reads for a URL without a password. Copy its line
to ``~/.pgpass`` on each machine that connects. Run again, ``start`` starts the same server (the
data and the password stay).  PostgreSQL refuses to run as root: as root, the server runs as
the user ``nobody`` (``runuser``), which then owns the data folder, and so must be able to reach
it (not under ``/root``).
"""

from __future__ import annotations

import glob
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from autograder.command_line import command_line

ROLE = "grader"
DATABASE = "attention_lab"
START_SECONDS = 120
SERVER_USER_AS_ROOT = "nobody"


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
    return ["runuser", "-u", SERVER_USER_AS_ROOT, "--", *argv]


# --------------------------------------------------------------------------------------
# The password: in PostgreSQL's own password file, never on a command line or a terminal
# --------------------------------------------------------------------------------------

def password_file() -> Path:
    """PostgreSQL's password file, as its clients (libpq: psycopg, psql) find it."""
    return Path(os.environ.get("PGPASSFILE") or Path.home() / ".pgpass")


def _escaped(text: str) -> str:
    return text.replace("\\", "\\\\").replace(":", "\\:")


def _entry(port: int) -> str:
    """The password file's line for this server's role, on any host name (``*``): the one line a
    grader's machine copies."""
    return f"*:{port}:*:{ROLE}:"


def saved_password(port: int) -> str | None:
    path = password_file()
    if not path.is_file():
        return None
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith(_entry(port)):
            return re.sub(r"\\(.)", r"\1", line[len(_entry(port)):])   # the file's escapes: \: and \\
    return None


def save_password(port: int, password: str) -> Path:
    """The role's password in the password file (its line for this port replaced), mode 600:
    libpq ignores a password file others can read."""
    path = password_file()
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    lines = [line for line in lines if not line.startswith(_entry(port))] + [_entry(port) + _escaped(password)]
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(path.name + ".new")
    scratch.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.chmod(scratch, 0o600)
    scratch.replace(path)
    return path


def address_for_others() -> str:
    """This machine's address on its network (the one its default route leaves by), else its
    name: what other machines type to reach the server, never ``localhost``."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))   # TEST-NET-1: no packet is sent for a UDP "connect"
            address = probe.getsockname()[0]
        if not address.startswith("127."):
            return address
    except OSError:
        pass
    return socket.getfqdn()


def _reachable_by_server_user(folder: Path) -> str | None:
    """As root, why the server's user cannot reach ``folder``'s parent (then initdb fails), or None."""
    if os.geteuid() != 0:
        return None
    parent = folder.parent
    while not parent.exists():
        parent = parent.parent
    check = subprocess.run(as_server_user(["test", "-x", str(parent), "-a", "-w", str(parent)]), capture_output=True)
    if check.returncode == 0:
        return None
    return (f"as root, the server runs as the user {SERVER_USER_AS_ROOT} (PostgreSQL refuses root), which cannot "
            f"reach {parent}: choose PGDATA in a folder it can reach and write, e.g. /srv/attention-lab-db")


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


def start(data: Path, port: int, password: str = "") -> str:
    """Start (creating on first use) the server in ``data``; its URL, with ``localhost`` for the
    host and no password (the password file has it: :func:`save_password`)."""
    folder = _folder()
    data = data.resolve()
    created = not (data / "PG_VERSION").exists()
    password = password or saved_password(port) or (secrets.token_hex(16) if created else "")
    if not password:
        raise SystemExit(f"the password of the role {ROLE} is not in {password_file()} (the line "
                         f"{_entry(port)}<password>): put it there, or give DB_PASSWORD=<it>")
    if created:
        problem = _reachable_by_server_user(data)
        if problem:
            raise SystemExit(problem)
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
    save_password(port, password)
    url = f"postgresql://{ROLE}@localhost:{port}/{DATABASE}"
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
    parser = command_line(__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    starting = commands.add_parser("start")
    starting.add_argument("--data", type=Path, required=True)
    starting.add_argument("--port", type=int, default=5432)
    starting.add_argument("--password", default=os.environ.get("DB_PASSWORD", ""),
                          help="the role's password (default: $DB_PASSWORD, else the password file's, else a new one "
                               "on first use)")
    stopping = commands.add_parser("stop")
    stopping.add_argument("--data", type=Path, required=True)
    options = parser.parse_args(argv)
    if options.command == "start":
        url = start(options.data, options.port, options.password)
        print(f"PostgreSQL is running (data: {options.data}, port {options.port}), database {DATABASE}, role {ROLE}.\n"
              f"On this machine:   DB_URL={url}\n"
              f"From other machines: DB_URL={url.replace('@localhost:', f'@{address_for_others()}:')}\n"
              f"The password is in {password_file()} (PostgreSQL's password file: its line {_entry(options.port)}...);"
              f" copy that line into ~/.pgpass (mode 600) on each machine that connects. No command needs it typed.")
    else:
        stop(options.data)
        print(f"stopped the server of {options.data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
