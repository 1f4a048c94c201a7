"""Wall time to execute each solution notebook top to bottom, against its budget, and the time
its Validate button takes.

    python -m benchmarks.notebooks [--repeat N] [assignment ...]

Builds the instructor notebooks into a scratch folder, runs each one (a fresh kernel per
run, so imports count, as they do for a student), and prints the median time against the
budget below. Beside it, the median time of the student lab's Validate
(``autograder.lab.validate.validate_notebook``, what the button runs) on the student's
notebook with every answer written: the student's wait for the full check (a child process,
nbgrader's validator, a kernel of its own). Results go to benchmarks/results/notebooks.json.
Timings are reported, never asserted: they depend on the machine and on what else runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import nbformat
import torch

from autograder.grading.execute import execute_notebook
from autograder.publishing import release

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Seconds on 2 CPU cores: the whole course (solutions, top to bottom) within 70 s (60 s for the six
# notebooks before 07, which runs in about 7 s); 06 (Triton's interpreter included) and 07 within
# 40 s and 03 (its training included) within 35 s; the others keep the tighter budgets they ran
# well below. About 23 s of the course's time is fixed: each
# notebook's fresh kernel (~0.8 s) and torch's import (~2 s), and torch._dynamo's (~1.5 s) in
# each notebook that builds an optimizer or counts FLOPs (01, 03, 04, 06).
BUDGETS = {
    "01_mha_shapes": 20,
    "02_numpy_walkthrough": 10,
    "03_positions_and_blocks": 35,
    "04_vision_transformer": 60,
    "05_llama_attention": 30,
    "06_efficient_attention": 40,
    "07_inference_attention": 40,
}
COURSE_BUDGET = 70


def solved_release(source: Path, released: Path, destination: Path) -> Path:
    """The student's notebook (``released``) with every answer cell as the solution (``source``) writes it: what
    a student who finished the notebook validates (visible tests only; the hidden ones are not in it)."""
    def answers(notebook: nbformat.NotebookNode) -> dict[str, nbformat.NotebookNode]:
        return {cell.metadata["nbgrader"]["grade_id"]: cell for cell in notebook.cells
                if cell.metadata.get("nbgrader", {}).get("solution")}

    solution = answers(nbformat.read(source, as_version=4))
    student = nbformat.read(released, as_version=4)
    for grade_id, cell in answers(student).items():
        cell.source = solution[grade_id].source
    nbformat.write(student, destination)
    return destination


def validate_seconds(path: Path) -> float:
    """Wall time of the lab's Validate on ``path``, run from the notebook's folder as the lab runs it (the
    course's nbgrader_config.py there); fails loudly if a test failed."""
    from autograder.lab.validate import validate_notebook

    started = time.perf_counter()
    with contextlib.chdir(path.parent):
        answer = asyncio.run(validate_notebook(path))
    seconds = time.perf_counter() - started
    if not answer.get("success") or answer["value"].get("failed") or answer["value"].get("changed"):
        raise SystemExit(f"Validate of the solved {path.name} did not pass: {json.dumps(answer)[:2000]}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("assignments", nargs="*")
    parser.add_argument("--repeat", type=int, default=3)
    options = parser.parse_args(argv)
    assignments = options.assignments or release.assignment_names()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        release.build(assignments, root / "course", root / "autograder")
        shutil.copy(release.COURSE_DIR / "nbgrader_config.py", root / "course" / "nbgrader_config.py")
        for assignment in assignments:
            path = root / "autograder" / "source" / assignment / f"{assignment}.ipynb"
            solved = solved_release(path, release.released_notebook(assignment, root / "course"),
                                    root / "course" / f"solved_{assignment}.ipynb")
            times, validate_times = [], []
            for _ in range(options.repeat):
                result = execute_notebook(path)
                if result.errors:
                    raise SystemExit(result.summary())
                times.append(result.seconds)
                validate_times.append(validate_seconds(solved))
            median, validate_median = statistics.median(times), statistics.median(validate_times)
            budget = BUDGETS.get(assignment, 60)
            rows.append({"assignment": assignment, "median_s": round(median, 2), "runs_s": [round(t, 2) for t in times],
                         "budget_s": budget, "within_budget": median <= budget,
                         "validate_median_s": round(validate_median, 2),
                         "validate_runs_s": [round(t, 2) for t in validate_times]})
            print(f"{assignment:<26} median {median:6.1f} s   budget {budget:>3} s   "
                  f"{'ok' if median <= budget else 'OVER'}   Validate {validate_median:6.1f} s   "
                  f"runs {', '.join(f'{t:.1f}' for t in times)}")
    total = sum(row["median_s"] for row in rows)
    validate_total = sum(row["validate_median_s"] for row in rows)
    print(f"{'whole course':<26} total  {total:6.1f} s   budget {COURSE_BUDGET:>3} s   "
          f"{'ok' if total <= COURSE_BUDGET else 'OVER'}   Validate {validate_total:6.1f} s")
    print(f"A student who runs every notebook waits {total:.0f} s for the cells and {validate_total:.0f} s for "
          "Validate's full check (a fresh kernel and nbgrader's validator on top of the same cells).")
    RESULTS_DIR.mkdir(exist_ok=True)
    report = {"machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "python": platform.python_version(), "torch": torch.__version__},
              "notebooks": rows, "course_total_s": round(total, 2), "course_budget_s": COURSE_BUDGET,
              "course_validate_total_s": round(validate_total, 2)}
    (RESULTS_DIR / "notebooks.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
