"""Wall time to execute each solution notebook top to bottom, against its budget.

    python -m benchmarks.notebooks [--repeat N] [assignment ...]

Builds the instructor notebooks into a scratch folder, runs each one (a fresh kernel per
run, so imports count, as they do for a student), and prints the median time against the
budget below. Results go to benchmarks/results/notebooks.json.
Timings are reported, never asserted: they depend on the machine and on what else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

import torch

from autograder import release
from autograder.execute import execute_notebook

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Seconds on 2 CPU cores: the whole course (solutions, top to bottom) within 90 s, 06 (Triton's
# interpreter included) within 40 s and 03 (its training included) within 35 s; the others keep
# the tighter budgets they ran well below.
BUDGETS = {
    "01_mha_shapes": 20,
    "02_numpy_walkthrough": 10,
    "03_positions_and_blocks": 35,
    "04_vision_transformer": 60,
    "05_llama_attention": 30,
    "06_efficient_attention": 40,
}
COURSE_BUDGET = 90


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
        for assignment in assignments:
            path = root / "autograder" / "source" / assignment / f"{assignment}.ipynb"
            times = []
            for _ in range(options.repeat):
                result = execute_notebook(path)
                if result.errors:
                    raise SystemExit(result.summary())
                times.append(result.seconds)
            median = statistics.median(times)
            budget = BUDGETS.get(assignment, 60)
            rows.append({"assignment": assignment, "median_s": round(median, 2), "runs_s": [round(t, 2) for t in times],
                         "budget_s": budget, "within_budget": median <= budget})
            print(f"{assignment:<26} median {median:6.1f} s   budget {budget:>3} s   "
                  f"{'ok' if median <= budget else 'OVER'}   runs {', '.join(f'{t:.1f}' for t in times)}")
    total = sum(row["median_s"] for row in rows)
    print(f"{'whole course':<26} total  {total:6.1f} s   budget {COURSE_BUDGET:>3} s   "
          f"{'ok' if total <= COURSE_BUDGET else 'OVER'}")
    RESULTS_DIR.mkdir(exist_ok=True)
    report = {"machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "python": platform.python_version(), "torch": torch.__version__},
              "notebooks": rows, "course_total_s": round(total, 2), "course_budget_s": COURSE_BUDGET}
    (RESULTS_DIR / "notebooks.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
