"""The dry run (docs/instructors/2-dry-run.md), command by command as written, on a scratch course root: the example
class goes through roster, deadlines, settings, intake, grading, feedback and export, and is
erased (issue #35, item 17); on the way, the grading page's one-submission regrade keeps the late
penalty and `make report` writes the class report."""

from __future__ import annotations

import csv
import json
import os
import shutil

import pytest

from autograder.store import gradebook
from autograder.places import REPO_ROOT
from autograder.publishing.release import assignment_names
from autograder.places import COURSE_ROOT_VARIABLE
from tests.readme_commands import run_readme_command

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("example_class")]


def readme_dry_run() -> list[str]:
    text = (REPO_ROOT / "docs" / "instructors" / "2-dry-run.md").read_text()
    block = text.split("\n## A dry run\n", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip()]


def test_the_readmes_dry_run_grades_the_example_class(tmp_path):
    root = tmp_path / "course_root"
    # one grading worker: four notebooks need no second kernel server and checker
    environment = {**os.environ, COURSE_ROOT_VARIABLE: str(root), "JOBS": "1"}
    outputs = {}
    try:
        for command in readme_dry_run():
            target = command.split()[1]
            if target == "export":   # the grading page's regrade of one submission, then the grades
                regraded = run_readme_command("make grade STUDENT=nunez ASSIGNMENT=01_mha_shapes", env=environment)
                assert regraded.returncode == 0, regraded.stdout + regraded.stderr
                assert "graded 1, unchanged 0, failed 0" in regraded.stdout, regraded.stdout
            result = run_readme_command(command, env=environment,
                                        input="erase\n" if target == "erase-course-root" else None)
            assert result.returncode == 0, f"{command}:\n{result.stdout}{result.stderr}"
            outputs[target] = result.stdout
            if target == "grade":   # every assignment is in the gradebook (Formgrader lists them all)
                with gradebook.open_gradebook(root) as gb:
                    assigned = sorted(a.name for a in gb.assignments)
            if target == "export":
                with open(root / "grades.csv", newline="") as handle:
                    rows = {r["student_id"]: r for r in csv.DictReader(handle) if r["assignment"] == "01_mha_shapes"}
                reported = run_readme_command("make report", env=environment)   # step 8, on the graded class
                assert reported.returncode == 0, reported.stdout + reported.stderr
                class_report = json.loads((root / "reports" / "class" / "01_mha_shapes" / "report.json").read_text())
    finally:
        shutil.rmtree(REPO_ROOT / "example-class", ignore_errors=True)
    assert "4 accepted" in outputs["intake"] and "1 late submission: nunez/01_mha_shapes" in outputs["intake"], \
        outputs["intake"]
    scores = {s: (float(r["score"]), float(r["late_submission_penalty"] or 0)) for s, r in rows.items()}
    assert scores["bob"][0] == 0 < scores["dan"][0] < scores["alice"][0], scores
    assert rows["alice"]["status"] == "incomplete"   # the written answer waits for Formgrader
    assert scores["nunez"] == (0.0, scores["alice"][0]), scores   # as solved as alice, late, LATE_PENALTY=zero
    assert assigned == assignment_names(), assigned
    assert class_report["students"] == 4, class_report
    assert not root.exists(), "make erase-course-root (erase typed) left the course root"
    assert "sandbox" in outputs, "the dry run starts with the sandbox"
