"""What an executed notebook says about its graded cells, and what the grader did to it.

One reading of "graded cell -> passed / failed" (for grading, executing and feedback alike),
and one wording of each incident the grader records, for the instructor's report and the
student's feedback page.  Cells are numbered from 1, as JupyterLab shows them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import nbformat

# The name a hidden test's failure carries (release.mark_hidden_tests raises it): feedback
# says "failed the hidden tests" and shows nothing of it.
HIDDEN_FAILURE = "HiddenTestFailure"
# A cell the grader did not run (it stopped or hung the kernel on an earlier attempt).
SKIPPED_CELL = "GraderSkippedCell"
# Raised by a check when the notebook replaced library functions the checks rely on.
TAMPERING_MESSAGE = "Your notebook replaced library functions that the checks rely on"

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# A frame of the notebook's own code in an IPython traceback: "Cell In[5], line 3, in slow"
NOTEBOOK_FRAME = re.compile(r"Cell In\[\d+\], line \d+, in (\w+)")


def hung_function(outputs: list) -> str | None:
    """The notebook's own function a cell was running when the time limit interrupted it (the
    innermost of its frames in the interrupt's traceback), or None (a loop at a cell's top level)."""
    for output in outputs:
        if output.get("output_type") == "error" and output.get("ename") == "KeyboardInterrupt":
            names = NOTEBOOK_FRAME.findall(ANSI.sub("", "\n".join(output.get("traceback", []))))
            return names[-1] if names else None
    return None


def uses(source: str, name: str) -> bool:
    """Whether a cell's code names ``name`` (calls it, or hands it to a check)."""
    return re.search(rf"\b{re.escape(name)}\b", source) is not None


def defines(source: str, name: str) -> bool:
    return re.search(rf"^\s*def\s+{re.escape(name)}\s*\(", source, re.MULTILINE) is not None


@dataclass
class GradedCell:
    notebook: str
    grade_id: str
    points: float
    manual: bool                 # a written answer graded by hand (never run)
    source: str
    error: dict | None = None    # the first error output of a code cell ({ename, evalue, traceback})

    @property
    def passed(self) -> bool:
        return not self.manual and self.error is None

    @property
    def ename(self) -> str | None:
        return str(self.error.get("ename")) if self.error else None

    @property
    def evalue(self) -> str:
        return ANSI.sub("", str(self.error.get("evalue", ""))).strip() if self.error else ""

    @property
    def hidden_failure(self) -> bool:
        return self.ename == HIDDEN_FAILURE

    @property
    def tampering(self) -> bool:
        return self.evalue.startswith(TAMPERING_MESSAGE)

    def as_dict(self) -> dict:
        return {"notebook": self.notebook, "grade_id": self.grade_id, "points": self.points,
                "manual": self.manual, "passed": self.passed, "error": self.ename}


def graded_cells(notebook: nbformat.NotebookNode, name: str = "") -> list[GradedCell]:
    """Every graded cell (test cells and written answers) of an executed notebook, in order."""
    cells = []
    for cell in notebook.cells:
        nbgrader = cell.metadata.get("nbgrader", {})
        if not nbgrader.get("grade"):
            continue
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        cells.append(GradedCell(name, nbgrader.get("grade_id"), float(nbgrader.get("points", 0)),
                                manual=cell.cell_type != "code", source=cell.source,
                                error=dict(errors[0]) if errors else None))
    return cells


# --------------------------------------------------------------------------------------
# Incidents: {"kind", "notebook", "cell" (1-based), "grade_id", "detail", "attempt"}
# --------------------------------------------------------------------------------------

# kind: (for the instructor's report, for the student's feedback); "{where}" is the cell.
INCIDENTS = {
    "kernel_died": ("{where}: stopped the kernel; skipped on a restart",
                    "{where} stopped the Python kernel; the grader skipped that cell and graded the rest."),
    "kernel_unresponsive": ("{where}: hung and ignored the interrupt; skipped on a restart",
                            "{where} hung the Python kernel; the grader skipped that cell and graded the rest."),
    "notebook_timeout": ("{where}: the notebook ran past the time limit; skipped on a restart",
                         "{where} kept the notebook running past the time limit; the grader skipped that "
                         "cell and graded the rest."),
    "timeout": ("{where}: ran past the per-cell time limit (interrupted)", None),
    # the cell's own message says it to the student
    "hung_function": ("{where}: not run: it uses {detail}(), which already ran past the time limit", None),
    "output_truncated": ("{where}: output truncated", "{where} printed too much output; it was cut."),
    "tampering": ("{where}: TAMPERING: the notebook replaced {detail} (undone before the test ran)",
                  "Before {where}, the grader undid a replacement of course modules by the notebook."),
    # the check itself refused: its message is on the student's page already
    "replaced_functions": ("{where}: TAMPERING: {detail}", None),
    "bridge_refused": ("{where}: TAMPERING: the kernel kept the grader from calling the answers (no points)",
                       "{where}: your notebook kept the grader from calling your code, so its tests earned nothing."),
    "checker_failed": ("{where}: the grader's checker failed ({detail}); the test was not passed", None),
    # a measurement taken in the kernel that the submitted code itself contradicts (its course package rewritten)
    "measurement_contradicted": ("{where}: TAMPERING? the kernel's measurement disagrees with the submitted code: "
                                 "{detail}", None),
    # what one submission left in its sandbox, and the next one's fresh sandbox (never counted against it)
    "left_in_sandbox": ("its kernels left {detail} MB of memory in the sandbox that no process held (System V "
                        "shared memory, a file of its tmpfs...): the sandbox was restarted for the next submission", None),
    "sandbox_restarted": ("the grader restarted the sandbox before grading it: {detail}; nothing of that was counted "
                          "against this submission", None),
}


def where(incident: dict) -> str:
    return incident.get("grade_id") or f"cell {incident.get('cell')}"


def describe(incident: dict, for_student: bool = False) -> str | None:
    """One line about an incident; None when the student is not told about it."""
    kind = incident.get("kind")
    instructor, student = INCIDENTS.get(kind, ("{where}: " + str(kind), None))
    text = student if for_student else instructor
    return text.format(where=where(incident), detail=incident.get("detail", "")) if text else None
