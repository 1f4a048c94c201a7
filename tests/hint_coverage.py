"""Every hint in the helper package must be reachable: some test must see it in a failure message.

Where hints live: every hint text is a value of a module-level dict named ``HINTS`` or
``<SOMETHING>_HINTS`` in ``attention_lab.checking`` or a module of ``attention_lab.checks``
(nested dicts, lists and tuples of strings count too). A hint may contain ``str.format``
fields (``{d_head}``): they match any text.

How the suite checks it: ``tests/conftest.py`` points ``ATTENTION_LAB_HINT_LOG`` at a fresh
folder for the session; the check framework appends there every failure message a check (or
``expect_*`` / ``diagnose`` called directly) produces, one file per process, so pytest-xdist
workers and notebook kernels all contribute. When the whole suite ran, the summary lists the
hints no failure message ever contained, with their module, dict and key; with the gate on
(``HINT_COVERAGE_ENFORCED`` in conftest) the run then fails. A subset run (a few files,
``-k``, ``-m``) is not judged: it prints a note listing the untriggered hints of the check
modules whose ``tests/test_checks_<module>.py`` ran.

To see which hints are untested: run the whole suite (``make test``), or just one notebook's
check tests (``.venv/bin/python -m pytest tests/test_checks_mha_shapes.py``), and read the
"hint coverage" section at the end of the summary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

# One reading of "this hint is in this message", and one list of the package's hints, shared
# with the class report's mistake counts.
from attention_lab.hint_catalog import MESSAGE_SEPARATOR, Hint, _normalise, catalog, hint_pattern

from tests.session_gates import TESTS_DIR, covers, read_records, whole_run


def package_hints() -> list[Hint]:
    """The hints of ``attention_lab.checking`` and of every module of ``attention_lab.checks``."""
    return list(catalog())


def read_messages(folder: Path | str) -> list[str]:
    """Every failure message recorded in ``folder`` (all processes)."""
    return read_records(folder, "failures-*.jsonl")


def untriggered(hints: Iterable[Hint], messages: Sequence[str]) -> list[Hint]:
    """The hints that appear in none of ``messages``."""
    corpus = MESSAGE_SEPARATOR.join(_normalise(message).replace(MESSAGE_SEPARATOR, " ") for message in messages)
    return [hint for hint in hints if not hint_pattern(hint.text).search(corpus)]


def check_test_files(tests_dir: Path = TESTS_DIR) -> list[Path]:
    """Every ``tests/test_checks_*.py`` file, and ``tests/test_checking.py`` (the framework's own hints)."""
    return [path for pattern in ("test_checks_*.py", "test_checking.py") for path in tests_dir.glob(pattern)]


def covers_every_check_test(args: Sequence[str], tests_dir: Path = TESTS_DIR) -> bool:
    """Do the command-line paths ``args`` collect every check test file whole?"""
    return covers(args, check_test_files(tests_dir))


def whole_suite_ran(option: Any, args: Sequence[str], tests_dir: Path = TESTS_DIR) -> bool:
    """No test selection (-k, -m, --deselect, --lf, -x) and every check test file collected."""
    return whole_run(option, args, check_test_files(tests_dir))


def modules_under_test(args: Sequence[str], tests_dir: Path = TESTS_DIR) -> set[str]:
    """The check modules whose test files ``args`` name, e.g. ``tests/test_checks_mha_shapes.py``
    -> ``attention_lab.checks.mha_shapes`` (a folder names all of them)."""
    files = set()
    for arg in args:
        path = Path(arg.split("::")[0]).resolve()
        files |= set(path.glob("**/test_checks_*.py")) if path.is_dir() else {path}
    return {f"attention_lab.checks.{file.stem.removeprefix('test_checks_')}" for file in files
            if file.name.startswith("test_checks_") and file.suffix == ".py"}


PART_OF_THE_SUITE = "only part of the suite ran"  # why a run is not judged, unless another reason is given


def report(missing: Sequence[Hint], total: int, whole: bool, enforced: bool, modules: Iterable[str] = (),
           why_not_judged: str = PART_OF_THE_SUITE) -> list[str]:
    """The lines of the "hint coverage" section of the test summary.

    A subset run (or one where some tests cannot run: ``why_not_judged``) is not judged; it lists the hints of
    ``modules`` (those whose test files ran) that it did not trigger, so a contributor can work on one notebook's
    checks at a time.
    """
    if not whole:
        lines = [f"hint coverage: not judged ({why_not_judged}); {total - len(missing)} of {total} "
                 "hints appeared in a failure message in this run."]
        modules = set(modules)
        nearby = [hint for hint in missing if hint.module in modules]
        if nearby:
            lines.append(f"  not triggered by this run, in the check modules whose tests ran ({len(nearby)}):")
            lines += [_hint_line(hint) for hint in nearby]
        return lines
    if not missing:
        return [f"hint coverage: all {total} hints appeared in a failure message."]
    verdict = "FAILED" if enforced else "(not enforced yet)"
    lines = [f"hint coverage {verdict}: {len(missing)} of {total} hints never appeared in a failure message. "
             "Add a test whose wrong answer triggers each, or remove the hint:"]
    return lines + [_hint_line(hint) for hint in missing]


def _hint_line(hint: Hint) -> str:
    text = _normalise(hint.text)
    return f"  {hint.where()}: {text[:100]}{'…' if len(text) > 100 else ''}"
