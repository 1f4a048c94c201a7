"""`make help` lists an instructor's targets in the order of a term, each with its variables,
and every target the documentation uses (issue #35, item 15); the README's two commands are
what they say -- fast."""

from __future__ import annotations

import re
import subprocess

from autograder.places import REPO_ROOT
from tests.readme_commands import documented_commands, run_readme_command

TERM = ["release", "roster", "deadlines", "settings", "intake", "grade", "formgrader", "feedback", "export", "report"]


def test_make_help_is_in_the_order_of_a_term_with_every_variable():
    shown = run_readme_command("make help", timeout=60).stdout
    targets = re.findall(r"^  make (\S+)", shown, flags=re.MULTILINE)
    positions = [targets.index(t) for t in TERM]
    assert positions == sorted(positions), targets
    for variable in ("ROSTER=", "DEADLINES=", "LATE_PENALTY=", "GRACE_MINUTES=", "SUBMISSIONS=", "ADD_UNKNOWN=",
                     "JOBS", "FORCE=", "STUDENT=", "SCHEDULER=", "DB_URL=", "FORMGRADER_ARGS=", "UNTIL="):
        assert variable in shown, variable
    used = {command.split()[1] for command in documented_commands()}
    assert used - set(targets) == set(), f"the docs use targets make help does not list: {used - set(targets)}"


def dry(target: str) -> str:
    """What ``make <target>`` would run (make -n), its setup already done."""
    return subprocess.run(["make", "--no-print-directory", "-n", target], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60, check=True).stdout


def test_the_readme_opens_with_its_two_commands_and_each_does_what_it_says():
    readme = (REPO_ROOT / "README.md").read_text()
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in first_block.splitlines()] == ["make lab", "make test"]
    assert len(readme.splitlines()) <= 120, "the README is the front door: the rest lives in docs/"
    # `make lab`: sets up, then JupyterLab on course/ with the students' set-up (Validate, no instructor tools)
    lab = dry("lab")
    assert "cd course && JUPYTER_CONFIG_PATH=" in lab and "autograder/lab/student" in lab and "jupyter lab" in lab
    # `make test`: sets up (the sandbox, the browser, PostgreSQL included), then the whole suite
    test = dry("test")
    assert "-m pytest" in test and "-m \"not slow\"" not in test and "apt-get install -y -qq bubblewrap" in test
    for target in ("lab", "test"):
        assert re.search(rf"^{target}: setup\b", (REPO_ROOT / "Makefile").read_text(), flags=re.MULTILINE), target
