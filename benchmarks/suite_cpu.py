"""Where the test suite's CPU goes: every process it starts, by kind.

    python -m benchmarks.suite_cpu [--interval S] [-- COMMAND ...]      # default COMMAND: make test

``make test`` is CPU-bound on a 2-core machine (its wall time is about its CPU time over the
cores), so what makes it faster is less CPU, and this says whose: the command runs while
``/proc`` is read every ``--interval`` seconds; the CPU time (user + system) of each process of
the command's tree is kept under the kind its command line names (the test processes, kernels
forked for grading, fresh kernels, chromium, nbgrader processes, ``generate_assignment``, the
trusted checker, ...). The tree is the command's descendants and, this process being their
subreaper, the orphans they leave (a server that daemonizes); other processes on the machine are
not counted. A process that starts and ends between two reads is missed: the sum over kinds is
compared with the machine's CPU time (``/proc/stat``) in the report.

Printed, and written to benchmarks/results/suite_cpu.json (``--output``); never asserted. Linux only.
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
    """Reads /proc until stopped; ``used[(pid, start)] = [command line, CPU seconds]`` for the
    processes of the tree under ``root`` (the command), and, where ``adopting``, for every child of
    this process: an orphan of the tree (a server that daemonizes, as pg_ctl's does) is re-parented
    here once this process is the tree's subreaper, and is reaped here when it ends."""

    def __init__(self, interval: float, root: int, adopting: bool):
        super().__init__(daemon=True)
        self.interval, self.stopped = interval, threading.Event()
        self.root, self.adopting, self.own_pid = root, adopting, os.getpid()
        self.used: dict[tuple[int, int], list] = {}

    def snapshot(self) -> dict[int, tuple[int, int, str, float]]:
        """pid: (start time, parent pid, state, CPU seconds) of every process now."""
        processes = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    text = handle.read()
                fields = text[text.rindex(")") + 2:].split()
                processes[int(entry)] = (int(fields[19]), int(fields[1]), fields[0],
                                         (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
        return processes

    def in_tree(self, pid: int, processes: dict) -> bool:
        seen = set()
        while pid in processes and pid not in seen:
            if pid == self.root or (pid, processes[pid][0]) in self.used:
                return True
            seen.add(pid)
            parent = processes[pid][1]
            if self.adopting and parent == self.own_pid:
                return True
            pid = parent
        return False

    @staticmethod
    def command_line(pid: int) -> str:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                return handle.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return ""

    def read(self) -> None:
        processes = self.snapshot()
        for pid, (start, parent, state, seconds) in processes.items():
            key = (pid, start)
            if key not in self.used:
                if not self.in_tree(pid, processes):
                    continue
                self.used[key] = [self.command_line(pid), 0.0]
            elif self.used[key][0] == self.used.get((parent, processes.get(parent, (None,))[0]), [None])[0]:
                # first seen between fork and exec, with its parent's command line: read it again, until
                # the program it runs names itself (a loaded machine makes that window long)
                self.used[key][0] = self.command_line(pid) or self.used[key][0]
            self.used[key][1] = seconds
            if state == "Z" and parent == self.own_pid and pid != self.root:
                os.waitpid(pid, os.WNOHANG)  # an adopted orphan that ended: its CPU is read

    def run(self) -> None:
        self.read()
        while not self.stopped.wait(self.interval):
            self.read()

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        self.read()


def become_subreaper() -> bool:
    """Make this process the subreaper of its descendants (Linux prctl PR_SET_CHILD_SUBREAPER):
    their orphans are re-parented here, not to init, so they stay in the tree measured. For good:
    the command line only, never a process that starts other children (a test worker)."""
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def measure(command: list[str], interval: float, adopting: bool = False) -> dict:
    """Run ``command`` and sum the CPU time of its process tree by kind. ``adopting``: this
    process is the tree's subreaper (``become_subreaper``), so its children are the tree's orphans."""
    busy_before, idle_before = machine_cpu_seconds()
    started = time.monotonic()
    process = subprocess.Popen(command)
    sampler = Sampler(interval, process.pid, adopting)
    sampler.start()
    try:
        returncode = process.wait()
    finally:
        sampler.stop()
    wall = time.monotonic() - started
    busy_after, idle_after = machine_cpu_seconds()
    by_kind, processes = Counter(), Counter()
    for command_line, seconds in sampler.used.values():
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
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "suite_cpu.json", help="the JSON written")
    parser.add_argument("command", nargs="*", default=["make", "test"], help="the command measured (after --)")
    options = parser.parse_args(argv)
    result = measure(options.command, options.interval, adopting=become_subreaper())
    print(report(result))
    options.output.parent.mkdir(parents=True, exist_ok=True)
    options.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {options.output}")
    return result["returncode"]


if __name__ == "__main__":
    sys.exit(main())
