"""Where the test suite's CPU goes: every process it starts, by kind.

    python -m benchmarks.suite_cpu [--interval S] [-- COMMAND ...]      # default COMMAND: make test

``make test`` is CPU-bound on a 2-core machine (its wall time is about its CPU time over the
cores), so what makes it faster is less CPU, and this says whose: the command runs while
``/proc`` is read every ``--interval`` seconds; each process's CPU time (user + system, what it
used since this started) is kept under the kind its command line names (the test processes,
kernels forked for grading, fresh kernels, chromium, nbgrader processes, ``generate_assignment``,
the trusted checker, ...). A process that starts and ends between two reads is missed: the
sum over kinds is compared with the machine's CPU time (``/proc/stat``) in the report.

Printed, and written to benchmarks/results/suite_cpu.json; never asserted. Linux only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# (kind, what its command line contains), first match wins: the more specific first.
KINDS = [
    ("pytest workers (checks and tests run in-process)", "exec(eval(sys.stdin"),
    ("pytest main process", "-m pytest"),
    ("kernels forked for grading (run the notebooks)", "kernel_forkserver.py serve"),
    ("forked kernels' launchers", "kernel_forkserver.py kernel"),
    ("fresh kernels (lab, nbclient, no sandbox)", "ipykernel_launcher"),
    ("nbgrader generate_assignment", "generate_assignment"),
    ("nbgrader processes (grading)", "nbgrader_process"),
    ("other nbgrader commands", "nbgrader_cli"),
    ("trusted checker", "trusted.checker"),
    ("course commands (autograder.*)", "-m autograder."),
    ("Dask worker processes", "multiprocessing.forkserver"),
    ("Dask command-line scheduler and workers", "dask"),
    ("chromium", "chromium"),
    ("JupyterLab and Formgrader servers", "jupyter"),
    ("Playwright driver", "node"),
    ("PostgreSQL", "postgres"),
    ("bubblewrap", "bwrap"),
    ("load the tests make on purpose (CPU burners, disk writers)", "time.monotonic() < end"),
]
OTHER = "other"


def kind_of(command: str) -> str:
    return next((kind for kind, marker in KINDS if marker in command), OTHER)


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, idle) CPU seconds of the whole machine since boot."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / CLOCK_TICKS, idle / CLOCK_TICKS


class Sampler(threading.Thread):
    """Reads /proc until stopped; ``used[(pid, start)] = (command, CPU seconds since the first read)``."""

    def __init__(self, interval: float):
        super().__init__(daemon=True)
        self.interval, self.stopped = interval, threading.Event()
        self.used: dict[tuple[int, int], list] = {}

    def read(self, first: bool) -> None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    text = handle.read()
                fields = text[text.rindex(")") + 2:].split()
                seconds = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
                key = (int(entry), int(fields[19]))
                if key not in self.used:
                    with open(f"/proc/{entry}/cmdline", "rb") as handle:
                        command = handle.read().replace(b"\0", b" ").decode(errors="replace")
                    # a process older than this run counts from now
                    self.used[key] = [command, 0.0, seconds if first else 0.0]
                self.used[key][1] = seconds - self.used[key][2]
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile

    def run(self) -> None:
        self.read(first=True)
        while not self.stopped.wait(self.interval):
            self.read(first=False)

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        self.read(first=False)


def measure(command: list[str], interval: float) -> dict:
    busy_before, idle_before = machine_cpu_seconds()
    started = time.monotonic()
    sampler = Sampler(interval)
    sampler.start()
    try:
        returncode = subprocess.run(command).returncode
    finally:
        sampler.stop()
    wall = time.monotonic() - started
    busy_after, idle_after = machine_cpu_seconds()
    by_kind, processes = Counter(), Counter()
    for command_line, seconds, _ in sampler.used.values():
        kind = kind_of(command_line)
        by_kind[kind] += seconds
        processes[kind] += 1
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command, "returncode": returncode, "cpus": os.cpu_count(),
        "wall_seconds": round(wall, 1),
        "machine_busy_cpu_seconds": round(busy_after - busy_before, 1),
        "machine_idle_cpu_seconds": round(idle_after - idle_before, 1),
        "sampled_cpu_seconds": round(sum(by_kind.values()), 1),
        "by_kind": [{"kind": kind, "cpu_seconds": round(seconds, 1), "processes": processes[kind]}
                    for kind, seconds in by_kind.most_common()],
    }


def report(result: dict) -> str:
    busy = result["machine_busy_cpu_seconds"]
    lines = [f"{' '.join(result['command'])}: exit {result['returncode']}, {result['wall_seconds']:.0f} s wall on "
             f"{result['cpus']} CPUs; the machine was busy {busy:.0f} CPU-s (idle {result['machine_idle_cpu_seconds']:.0f}), "
             f"{result['sampled_cpu_seconds']:.0f} CPU-s seen in its processes"]
    for row in result["by_kind"]:
        share = row["cpu_seconds"] / busy if busy else 0.0
        lines.append(f"  {row['cpu_seconds']:8.1f} CPU-s  {share:5.1%}  {row['processes']:5d} processes  {row['kind']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between two reads of /proc")
    parser.add_argument("command", nargs="*", default=["make", "test"], help="the command measured (after --)")
    options = parser.parse_args(argv)
    result = measure(options.command, options.interval)
    print(report(result))
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "suite_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {RESULTS_DIR / 'suite_cpu.json'}")
    return result["returncode"]


if __name__ == "__main__":
    sys.exit(main())
