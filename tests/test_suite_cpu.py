"""benchmarks/suite_cpu.py: the CPU time of the processes a command starts, by kind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import suite_cpu

ROOT = Path(__file__).resolve().parent.parent

# about one second of CPU (process time, so the same on a busy machine)
BURN = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end:\n    pass\n"

# the burner's name, built where it runs: the command lines that start it do not contain it
COURSE_COMMAND = "'-m ' + 'autograder.burn'"

# the command measured starts a burner named as a course command, as a grandchild
GRANDCHILD = ("import subprocess, sys\n"
              f"subprocess.run([sys.executable, '-c', sys.argv[1], {COURSE_COMMAND}], check=True)\n")

# an intermediate process starts the burner and ends at once, leaving it an orphan (as pg_ctl leaves
# its server); the command waits for the orphan through a pipe it holds open
ORPHAN = ("import os, subprocess, sys\n"
          "read, write = os.pipe()\n"
          "start = 'import subprocess, sys; subprocess.Popen([sys.executable, \"-c\", sys.argv[1], "
          f"{COURSE_COMMAND.replace(chr(39), chr(34))}], pass_fds=[int(sys.argv[2])])'\n"
          "subprocess.run([sys.executable, '-c', start, sys.argv[1], str(write)], pass_fds=[write], check=True)\n"
          "os.close(write)\n"
          "os.read(read, 1)\n")


# the burner forked, then run after a pause: the sampler sees it first with its parent's command line
FORKED_THEN_RUN = ("import os, sys, time\n"
                   "pid = os.fork()\n"
                   "if pid == 0:\n"
                   "    time.sleep(0.3)\n"
                   f"    os.execv(sys.executable, [sys.executable, '-c', sys.argv[1], {COURSE_COMMAND}])\n"
                   "os.waitpid(pid, 0)\n")


def course_commands(result: dict) -> dict:
    rows = {row["kind"]: row for row in result["by_kind"]}
    return rows.get("course commands (autograder.*)", {"processes": 0, "cpu_seconds": 0.0})


def test_the_command_s_processes_are_counted_under_their_kind_and_no_other_process_is():
    # a process of the same kind outside the command's tree (another test worker's, as in CI)
    bystander = subprocess.Popen([sys.executable, "-c", BURN.replace("1.0", "30.0"), "-m autograder.bystander"])
    try:
        result = suite_cpu.measure([sys.executable, "-c", GRANDCHILD, BURN], interval=0.05)
    finally:
        bystander.kill()
        bystander.wait()
    assert result["returncode"] == 0
    course = course_commands(result)
    assert course["processes"] == 1 and 0.7 <= course["cpu_seconds"] <= 2.0, result
    assert result["machine_busy_cpu_seconds"] >= course["cpu_seconds"] - 0.1, result
    line = next(line for line in suite_cpu.report(result).splitlines() if line.endswith("course commands (autograder.*)"))
    assert " 1 processes " in line, line


def test_the_command_line_counts_the_orphans_the_command_leaves(tmp_path):
    # the command line is the subreaper of what it measures; run as the command line, in its own process
    completed = subprocess.run([sys.executable, "-m", "benchmarks.suite_cpu", "--interval", "0.05",
                                "--output", str(tmp_path / "cpu.json"), "--", sys.executable, "-c", ORPHAN, BURN],
                               cwd=ROOT, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
    result = json.loads((tmp_path / "cpu.json").read_text())
    course = course_commands(result)
    assert course["processes"] == 1 and course["cpu_seconds"] >= 0.7, result
    assert "course commands (autograder.*)" in completed.stdout


def test_a_child_of_a_process_already_counted_is_counted_after_its_line_to_the_command_broke():
    # pid: (start time, parent pid, state, CPU seconds); the command is 100
    sampler = suite_cpu.Sampler(interval=1.0, root=100, adopting=False)
    sampler.used[(300, 7)] = ["a server started by the command's child", 0.0]  # seen while its parent lived
    processes = {100: (1, 50, "S", 0.0), 300: (7, 1, "S", 0.0),  # its parent ended: now init's
                 301: (9, 300, "R", 0.0),                         # a process it started since
                 400: (9, 1, "R", 0.0)}                           # another process on the machine
    assert sampler.in_tree(301, processes) and sampler.in_tree(100, processes)
    assert not sampler.in_tree(400, processes)
    # the same pid with another start time is another process
    assert not sampler.in_tree(301, {**processes, 300: (8, 1, "S", 0.0)})


def test_kinds_are_told_apart_by_the_most_specific_marker():
    assert suite_cpu.kind_of("python -m autograder.store.nbgrader_cli generate_assignment * --CourseDirectory.db_url="
                             "postgresql://grader@127.0.0.1:5432/x") == "nbgrader generate_assignment"
    assert suite_cpu.kind_of("python -m autograder.grading.grade --db-url postgresql://x") == "course commands (autograder.*)"
    assert suite_cpu.kind_of("python -m ipykernel_launcher -f /root/.local/share/jupyter/runtime/k.json") \
        == "fresh kernels (lab, nbclient, no sandbox)"
    assert suite_cpu.kind_of("/usr/lib/postgresql/15/bin/postgres -D /tmp/x") == "PostgreSQL"
    assert suite_cpu.kind_of("") == suite_cpu.OTHER


def test_a_process_first_seen_between_fork_and_exec_is_counted_under_the_program_it_runs():
    # on a loaded machine the sampler may catch a child before it execs (CI: a burner counted as "other")
    result = suite_cpu.measure([sys.executable, "-c", FORKED_THEN_RUN, BURN], interval=0.05)
    assert result["returncode"] == 0
    course = course_commands(result)
    assert course["processes"] == 1 and 0.7 <= course["cpu_seconds"] <= 2.0, result
