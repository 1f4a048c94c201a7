"""What the trust boundary costs: one crossing, and each graded test cell of the notebooks it covers.

    python -m benchmarks.bridge [--calls N] [assignment ...]

* **One crossing**: a call of the student's code with a [2, 5, 16] float64 tensor and its result
  back (encode, send, decode, the memory kept equal on both sides, the random state), between a
  checker and an agent in two threads of this process (``tests/bridge_harness.py``), median of N.
* **Each test cell**: the solution notebook runs in a kernel forked as grading forks them, twice:
  its test cells in the trusted checker (seconds and requests per cell, as the checker reports
  them), then in the kernel (seconds from nbclient's timing). The busiest cell is named.

Printed, and written to benchmarks/results/bridge.json; never asserted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path

import nbformat
import torch

from autograder.grading.execute import ForkedKernels, TrustedClient
from autograder.grading.trusted.checker_client import CHECKED_OUTSIDE_THE_KERNEL
from autograder.publishing import release

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def crossing_seconds(calls: int) -> float:
    from tests.bridge_harness import bridged

    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with bridged({"identity": lambda tensor: tensor * 1.0}) as bridge:
        identity = bridge.lookup(["identity"])["identity"]
        identity(x)  # the first call shares x's memory; the others find it shared
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            identity(x)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cell_seconds(cell) -> float | None:
    timing = cell.metadata.get("execution", {})
    start, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
    if not (start and end):
        return None
    parse = datetime.datetime.fromisoformat
    return (parse(end.replace("Z", "+00:00")) - parse(start.replace("Z", "+00:00"))).total_seconds()


def test_cells(assignment: str, kernels: ForkedKernels) -> dict:
    """Per graded test cell: seconds in the checker (and its requests), seconds in the kernel."""
    measured: dict[str, dict] = {}
    for where in ("checker", "kernel"):
        notebook = release.build_source(assignment, release.course_repository())
        clients: list[TrustedClient] = []
        original = TrustedClient.async_execute_cell

        async def recording(self, *args, **kwargs):
            if self not in clients:
                clients.append(self)
            return await original(self, *args, **kwargs)

        TrustedClient.async_execute_cell = recording
        try:
            kernels.execute(notebook, timeout=600, name=assignment if where == "checker" else "")
        finally:
            TrustedClient.async_execute_cell = original
        for cell in notebook.cells:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            if not cell.metadata.get("nbgrader", {}).get("grade") or cell.cell_type != "code":
                continue
            entry = measured.setdefault(grade_id, {})
            if where == "checker":
                found = getattr(clients[0], "checked_cells", {}).get(grade_id, {}) if clients else {}
                entry.update(checker_seconds=found.get("seconds"), requests=found.get("requests"))
            else:
                entry["kernel_seconds"] = _cell_seconds(cell)
    return measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("assignments", nargs="*", default=list(CHECKED_OUTSIDE_THE_KERNEL))
    options = parser.parse_args(argv)
    result = {"crossing_seconds": crossing_seconds(options.calls), "notebooks": {}}
    print(f"one crossing (call with a [2, 5, 16] float64 tensor, result back): "
          f"{result['crossing_seconds'] * 1e6:.0f} µs (median of {options.calls})")
    with tempfile.TemporaryDirectory() as scratch:
        kernels = ForkedKernels(Path(scratch))
        try:
            for assignment in options.assignments:
                cells = test_cells(assignment, kernels)
                result["notebooks"][assignment] = cells
                total = {key: sum(c.get(key) or 0 for c in cells.values()) for key in ("checker_seconds", "kernel_seconds")}
                busiest = max(cells, key=lambda g: cells[g].get("checker_seconds") or 0)
                print(f"{assignment}: test cells {total['checker_seconds']:.1f} s in the checker, "
                      f"{total['kernel_seconds']:.1f} s in the kernel; busiest: {busiest} "
                      f"({cells[busiest].get('checker_seconds')} s, {cells[busiest].get('requests')} requests; "
                      f"{cells[busiest].get('kernel_seconds') or 0:.2f} s in the kernel)")
        finally:
            kernels.close()
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "bridge.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
