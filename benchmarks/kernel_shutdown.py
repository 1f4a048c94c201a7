"""What ending a kernel costs: asked to shut down (nbclient's default) against killed (the course's way).

    python -m benchmarks.kernel_shutdown [--runs N]

Runs a one-cell notebook N times each way in a fresh kernel and reports the median run, the
slowest, how many runs took over 2 s and the time in all. With ipykernel 7.4, about one
graceful shutdown in ten hangs until jupyter_client sends SIGTERM 2.5 s later (the kernel's
control thread waits on the IOPub thread that its main thread has already stopped), which is
why autograder.grading.execute, Validate and grading kill the kernel once every cell has run.
Results go to benchmarks/results/kernel_shutdown.json. Reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import nbformat

from autograder.grading.execute import notebook_client

RESULTS_DIR = Path(__file__).resolve().parent / "results"
STALL_SECONDS = 2.0


def run_times(shutdown: str, runs: int, working_dir: Path) -> list[float]:
    times = []
    for _ in range(runs):
        notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('ran')")])
        client = notebook_client(notebook, working_dir, timeout=60)
        client.shutdown_kernel = shutdown
        start = time.perf_counter()
        client.execute()
        times.append(time.perf_counter() - start)
        if notebook.cells[0].outputs[0].get("text") != "ran\n":
            raise SystemExit(f"the cell did not run: {notebook.cells[0].outputs}")
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=60)
    options = parser.parse_args(argv)
    report = {}
    with tempfile.TemporaryDirectory() as scratch:
        for shutdown in ("graceful", "immediate"):
            times = run_times(shutdown, options.runs, Path(scratch))
            report[shutdown] = {"runs": len(times), "median_s": round(statistics.median(times), 3),
                                "max_s": round(max(times), 3), "over_2_s": sum(t > STALL_SECONDS for t in times),
                                "total_s": round(sum(times), 1)}
            print(f"{shutdown:9s}: " + ", ".join(f"{key} {value}" for key, value in report[shutdown].items()))
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "kernel_shutdown.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
