"""What each notebook promises in its text adds up: the title's points and minutes are the sums
of its exercises', and every exercise header's points are the points of its graded cells."""

from __future__ import annotations

import re

import pytest

from autograder import release
from tests.conftest import ASSIGNMENTS

TITLE_TOTALS = re.compile(r"\*\*(?P<points>\d+) points, about (?P<minutes>\d+) minutes\.\*\*")
EXERCISE = re.compile(r"^#{2,4}\s+Exercise\s+(?P<number>\d+\.\d+)\b(?P<rest>.*)$", re.MULTILINE)
HEADER_POINTS = re.compile(r"\((?P<points>\d+) pts?\b")
HEADER_MINUTES = re.compile(r"~(?P<minutes>\d+) min\b")


def _exercises(assignment: str) -> list[dict]:
    """Each exercise header in order, with the points of the graded cells that follow it."""
    notebook = release.build_source(assignment, release.course_repository())
    exercises: list[dict] = []
    for cell in notebook.cells:
        nbgrader = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "markdown":
            for match in EXERCISE.finditer(cell.source):
                points, minutes = HEADER_POINTS.search(match["rest"]), HEADER_MINUTES.search(match["rest"])
                assert points and minutes, f"{assignment}: header of exercise {match['number']} should say " \
                                           f"'(N pts, ~M min)': {match.group(0)!r}"
                exercises.append({"number": match["number"], "points": int(points["points"]),
                                  "minutes": int(minutes["minutes"]), "graded": 0.0})
        if nbgrader.get("grade"):
            assert exercises, f"{assignment}: graded cell {nbgrader['grade_id']} comes before any exercise header"
            exercises[-1]["graded"] += nbgrader["points"]
    return exercises


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_each_exercise_header_gives_the_points_of_its_graded_cells(assignment):
    exercises = _exercises(assignment)
    assert exercises, f"{assignment} has no exercise"
    wrong = [f"Exercise {e['number']}: header says {e['points']}, graded cells give {e['graded']:g}"
             for e in exercises if e["points"] != e["graded"]]
    assert not wrong, f"{assignment}: " + "; ".join(wrong)


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_title_gives_the_total_points_and_minutes_of_the_exercises(assignment):
    notebook = release.build_source(assignment, release.course_repository())
    match = TITLE_TOTALS.search(notebook.cells[0].source)
    assert match, f"{assignment}: the title cell should say '**P points, about M minutes.**'"
    exercises = _exercises(assignment)
    points = sum(e["graded"] for e in exercises)
    minutes = sum(e["minutes"] for e in exercises)
    assert (int(match["points"]), int(match["minutes"])) == (points, minutes), \
        f"{assignment}: the title says {match['points']} points and {match['minutes']} minutes; " \
        f"the exercises add up to {points:g} points and {minutes} minutes"
