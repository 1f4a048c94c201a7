"""benchmarks/suite_cpu.py: the CPU time of the processes a command starts, by kind."""

from __future__ import annotations

import sys

from benchmarks import suite_cpu

# about one second of CPU (process time, so the same on a busy machine), named as a course command
BURN = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end:\n    pass\n"


def test_a_process_the_command_starts_is_counted_under_the_kind_its_command_line_names():
    result = suite_cpu.measure([sys.executable, "-c", BURN, "-m autograder.burn"], interval=0.05)
    assert result["returncode"] == 0
    rows = {row["kind"]: row for row in result["by_kind"]}
    course = rows["course commands (autograder.*)"]
    assert course["processes"] == 1 and course["cpu_seconds"] >= 0.7, result
    assert result["machine_busy_cpu_seconds"] >= course["cpu_seconds"] - 0.1, result
    line = next(line for line in suite_cpu.report(result).splitlines() if line.endswith("course commands (autograder.*)"))
    assert " 1 processes " in line, line


def test_kinds_are_told_apart_by_the_most_specific_marker():
    assert suite_cpu.kind_of("python -m autograder.nbgrader_cli generate_assignment * --CourseDirectory.db_url="
                             "postgresql://grader@127.0.0.1:5432/x") == "nbgrader generate_assignment"
    assert suite_cpu.kind_of("python -m autograder.grade --db-url postgresql://x") == "course commands (autograder.*)"
    assert suite_cpu.kind_of("python -m ipykernel_launcher -f /root/.local/share/jupyter/runtime/k.json") \
        == "fresh kernels (lab, nbclient, no sandbox)"
    assert suite_cpu.kind_of("/usr/lib/postgresql/15/bin/postgres -D /tmp/x") == "PostgreSQL"
    assert suite_cpu.kind_of("") == suite_cpu.OTHER
