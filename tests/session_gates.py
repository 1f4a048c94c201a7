"""What the suite's session-finish gates share (tests/conftest.py runs them): the hint-coverage
gate (tests/hint_coverage.py) and the README-commands gate (tests/readme_commands.py).

Each gate has a log folder for the session, named by an environment variable that the process
running the session (the pytest-xdist controller) sets before any worker starts, so that workers,
the kernels and commands they start inherit it; each process appends JSON lines to a file of its
own there. At the end, the controller reads the folder and judges, but fails the run only when
the whole suite ran: a subset (some files, ``-k``, ``-m``, ``--deselect``, ``--lf``, ``-x``) gets a
note in the summary instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

TESTS_DIR = Path(__file__).resolve().parent


def read_records(folder: Path | str, pattern: str) -> list[Any]:
    """Every JSON line of the files ``pattern`` matches in ``folder`` (all processes)."""
    records = []
    for path in sorted(Path(folder).glob(pattern)):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                records.append(json.loads(line))
    return records


def covers(args: Sequence[str], wanted: Iterable[Path]) -> bool:
    """Do the command-line paths ``args`` collect every file of ``wanted`` whole (a folder
    collects the files under it; ``file::test`` is a part of a file)?"""
    wanted = {path.resolve() for path in wanted}
    covered = set()
    for arg in args:
        if "::" in arg:
            continue
        path = Path(arg).resolve()
        if path.is_dir():
            covered |= {file for file in wanted if path in file.parents}
        elif path in wanted:
            covered.add(path)
    return bool(wanted) and wanted <= covered


def selects_tests(option: Any) -> bool:
    """Does the command line pick some tests of the files it collects (-k, -m, --deselect, --lf, -x),
    or run none (--collect-only)?"""
    return any((getattr(option, "keyword", ""), getattr(option, "markexpr", ""), getattr(option, "deselect", None),
                getattr(option, "lf", False), getattr(option, "exitfirst", False),
                getattr(option, "collectonly", False)))


def whole_run(option: Any, args: Sequence[str], wanted: Iterable[Path]) -> bool:
    """No test selection, and every file of ``wanted`` collected."""
    return not selects_tests(option) and covers(args, wanted)


def judged_session(tmp_path: Path, gate: str, log_name: str, records: Iterable[Any],
                   args: Sequence[str]) -> tuple[Any, list[str]]:
    """For a test of a gate: a session that ran with ``args`` on the command line (no test selected
    by an option) and logged ``records`` as JSON lines in ``log_name`` of that gate's folder, finished
    as tests/conftest.py finishes one. Returns its exit status and that gate's summary lines."""
    from types import SimpleNamespace

    import pytest

    from tests import conftest

    log = tmp_path / "log"
    log.mkdir(parents=True)
    (log / log_name).write_text("".join(json.dumps(record) + "\n" for record in records))
    config = SimpleNamespace(stash=pytest.Stash(), args=args,
                             option=SimpleNamespace(keyword="", markexpr="", deselect=None, lf=False, exitfirst=False))
    config.stash[conftest._GATE_LOGS] = {gate: str(log)}
    session = SimpleNamespace(config=config, exitstatus=pytest.ExitCode.OK)
    conftest.pytest_sessionfinish(session, 0)
    return session.exitstatus, config.stash[conftest._GATE_REPORTS][gate]
