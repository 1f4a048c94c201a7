"""The documented-commands gate: which commands the README and docs/ hold, how a test runs one, and
when the run fails (tests/readme_commands.py, the gates in tests/conftest.py) -- fast."""

from __future__ import annotations

import re

import pytest

from autograder.places import REPO_ROOT
from tests import readme_commands, session_gates
from tests.readme_commands import NOT_RUN, PLACEHOLDERS, commands_in, documented_commands, run_readme_command

SAMPLE = """# Grading

Start with `make roster ROSTER=class.csv`, then `make
grade STUDENT=ann ASSIGNMENT=01` and `make report`; the targets `grade`, `export`.

```bash
make intake SUBMISSIONS=export   # a comment
# a comment line
.venv/bin/python -m autograder.grading.grade --help
```

    make formgrader FORMGRADER_ARGS="--port=8890"

### A subsection

`make report` again, and `python -m autograder.isolation.sandbox`.
"""


def test_a_pages_commands_are_its_make_spans_and_lines_and_the_pages_are_the_readme_and_docs():
    assert commands_in(SAMPLE) == [
        "make intake SUBMISSIONS=export",
        'make formgrader FORMGRADER_ARGS="--port=8890"',
        "make roster ROSTER=class.csv",
        "make grade STUDENT=ann ASSIGNMENT=01",
        "make report",
    ]
    pages = [page.relative_to(REPO_ROOT).as_posix() for page in readme_commands.pages()]
    assert pages[0] == "README.md" and "docs/instructors/3-grading.md" in pages and "docs/contributing.md" in pages
    instructors = [page for page in pages if page.startswith("docs/instructors/")]
    assert [page.split("/")[-1].split("-")[0] for page in instructors] == [str(n) for n in range(1, len(instructors) + 1)]


def test_every_command_names_makefile_targets_and_no_exemption_or_placeholder_is_stale():
    targets = set(re.findall(r"^([a-z][a-z-]*):", (REPO_ROOT / "Makefile").read_text(), flags=re.MULTILINE))
    commands = documented_commands()
    for command in commands:
        words = command.split()[1:]
        named = words[:next((i for i, word in enumerate(words) if "=" in word), len(words))]   # targets, then VAR=
        assert named and set(named) <= targets, f"{command!r} names no target of the Makefile"
    assert set(NOT_RUN) <= set(commands), f"exempted, but not documented: {set(NOT_RUN) - set(commands)}"
    for placeholder in PLACEHOLDERS:
        assert any(placeholder in command for command in commands), f"placeholder in no command: {placeholder!r}"


def test_a_command_runs_only_as_the_readme_writes_it_and_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv(readme_commands.LOG_ENV_VAR, str(tmp_path))
    with pytest.raises(AssertionError, match="not a documented command"):
        run_readme_command("make settings LATE_PENALTY=none")
    with pytest.raises(AssertionError, match="is not a placeholder a test may replace"):
        run_readme_command("make dask-worker SCHEDULER=tcp://scheduler-host:8786", replace={"make": "echo"})
    assert readme_commands.read_log(tmp_path) == set()
    # (`make roster` alone prints its usage and runs nothing)
    usage = run_readme_command("make roster")
    assert usage.returncode == 2 and "usage: make roster ROSTER=<csv>" in usage.stdout
    assert readme_commands.read_log(tmp_path) == {"make roster"}


def _judged(tmp_path, ran, args):
    return session_gates.judged_session(tmp_path, "README commands", "commands-1.jsonl", ran, args)


def test_the_gate_fails_a_whole_run_where_a_command_ran_in_no_test_and_names_it(tmp_path, monkeypatch):
    from tests import conftest

    run = [command for command in documented_commands() if command not in NOT_RUN]
    whole = [str(readme_commands.REPO_ROOT / "tests")]
    for case, (enforced, ran, args, expected) in enumerate([
        (True, run, whole, pytest.ExitCode.OK),
        (True, run[1:], whole, pytest.ExitCode.TESTS_FAILED),
        (True, [], [str(readme_commands.REPO_ROOT / "tests" / "test_roster.py")], pytest.ExitCode.OK),  # a subset
        (False, [], whole, pytest.ExitCode.OK),
    ]):
        monkeypatch.setattr(conftest, "README_COMMANDS_ENFORCED", enforced)
        status, report = _judged(tmp_path / str(case), ran, args)
        assert status == expected, (enforced, len(ran), args)
        if expected == pytest.ExitCode.TESTS_FAILED:
            assert report[0].startswith("README commands FAILED: 1 of") and report[1] == f"  {run[0]}", report
    # a command added to an instructors' page fails the run until a test runs it
    page = tmp_path / "3-grading.md"
    page.write_text((readme_commands.DOCS / "instructors" / "3-grading.md").read_text() + "\nThen `make grade JOBS=8`.\n")
    documented = readme_commands.pages()
    monkeypatch.setattr(readme_commands, "pages", lambda: [*documented, page])
    monkeypatch.setattr(conftest, "README_COMMANDS_ENFORCED", True)
    status, report = _judged(tmp_path / "added", run, whole)
    assert status == pytest.ExitCode.TESTS_FAILED
    assert report[1:] == ["  make grade JOBS=8"]


def test_the_session_log_variable_is_set_for_every_test():
    import os

    assert os.environ.get(readme_commands.LOG_ENV_VAR), "conftest should point the README command log at a folder"
