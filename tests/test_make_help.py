"""`make help` lists an instructor's targets in the order of a term, each with its variables,
and every target the README's instructor part uses (issue #35, item 15) -- fast."""

from __future__ import annotations

import re
import subprocess

from autograder.places import REPO_ROOT

TERM = ["release", "roster", "deadlines", "settings", "intake", "grade", "formgrader", "feedback", "export", "report"]


def test_make_help_is_in_the_order_of_a_term_with_every_variable():
    shown = subprocess.run(["make", "--no-print-directory", "help"], cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=60).stdout
    targets = re.findall(r"^  make (\S+)", shown, flags=re.MULTILINE)
    positions = [targets.index(t) for t in TERM]
    assert positions == sorted(positions), targets
    for variable in ("ROSTER=", "DEADLINES=", "LATE_PENALTY=", "GRACE_MINUTES=", "SUBMISSIONS=", "ADD_UNKNOWN=",
                     "JOBS", "FORCE=", "STUDENT=", "SCHEDULER=", "DB_URL=", "FORMGRADER_ARGS=", "UNTIL="):
        assert variable in shown, variable
    readme = (REPO_ROOT / "README.md").read_text()
    instructors = readme.split("## For instructors", 1)[1].split("## For contributors", 1)[0]
    used = set(re.findall(r"`make ([a-z][a-z-]*)", instructors)) | set(re.findall(r"^make ([a-z][a-z-]*)", instructors,
                                                                                   flags=re.MULTILINE))
    assert used - set(targets) == set(), f"the README uses targets make help does not list: {used - set(targets)}"
