"""Grading on a real Dask cluster: a scheduler and two workers started by the test as
separate processes over TCP (``dask scheduler`` / ``dask worker``, as an instructor would),
from a folder outside the repository (the tasks carry bytes; nothing is read from the
course root on a worker).

* the class grades through the cluster with the same results as through the default
  (the embedded LocalCluster);
* a worker killed in the middle of grading costs nothing: its task is graded by the other
  worker, nothing is lost and nothing is graded twice;
* the command line takes ``--scheduler`` (``make grade SCHEDULER=...``) and one regrade.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest

from autograder.grading import grade
from autograder.store import gradebook
from autograder.places import REPO_ROOT
from tests.grading_helpers import TINY, tiny_course
from tests.readme_commands import run_readme_command, start_readme_command, stop_process_group

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dask_cluster")]

ANSWERS = {"ann": "value = 42", "bob": "value = 41", "cy": "value = 6 * 7", "dee": "raise ValueError('no')",
           "eve": "value = 42", "fay": "import os\nos._exit(1)\nvalue = 42"}
WRITTEN = {"ann": "Because 42.", "bob": "Why not?"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def children_running(parent: int, needle: str) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and needle in command:
            found.append(int(stat.parent.name))
    return found


@pytest.fixture(scope="module")
def dask_cluster(tmp_path_factory):
    """``dask scheduler`` and two ``dask worker`` processes (1 thread each, no nanny) on localhost."""
    from distributed import Client

    elsewhere = tmp_path_factory.mktemp("dask-cwd")   # not the repository: workers import the course
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    address = f"tcp://127.0.0.1:{free_port()}"
    scheduler = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                  "--port", address.rsplit(":", 1)[1], "--no-dashboard"],
                                 cwd=elsewhere, env=environment, stdout=subprocess.DEVNULL,
                                 stderr=open(elsewhere / "scheduler.log", "w"))
    workers = []
    for number in range(2):
        (elsewhere / f"tmp{number}").mkdir()  # each worker's temporary folder: its scratch folder lies there
        workers.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address,
                                         "--nthreads", "1", "--no-nanny", "--no-dashboard",
                                         "--name", f"w{number}", "--memory-limit", "0"],
                                        cwd=elsewhere, env={**environment, "TMPDIR": str(elsewhere / f"tmp{number}")},
                                        stdout=subprocess.DEVNULL,
                                        stderr=open(elsewhere / f"worker{number}.log", "w")))
    try:
        with Client(address, timeout="120s") as client:
            client.wait_for_workers(2, timeout=300)
        yield {"address": address, "workers": workers, "logs": elsewhere}
    finally:
        # The workers first, while the scheduler still answers their goodbye; then the scheduler.
        # A worker that outlived a killed one sometimes does not stop on SIGTERM (seen once in
        # a few runs, Dask's own close); nothing is left to check by then: 10 s, then SIGKILL.
        for group in (workers, [scheduler]):
            for process in group:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            for process in group:
                try:
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
    # A worker stopped as an instructor stops one (SIGTERM) leaves no scratch folder (student files).
    assert scratch_folders(elsewhere) == [], "a stopped Dask worker left its scratch folder"


def scratch_folders(logs: Path, worker: int | None = None) -> list[Path]:
    """The grading scratch folders of the cluster's workers (of one worker if given) that remain."""
    deadline = time.monotonic() + 30   # a worker's nbgrader processes remove it once the worker is gone
    while (found := sorted(logs.glob(f"tmp{'*' if worker is None else worker}/alg-worker-*"))) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def graded_state(root: Path) -> dict:
    """Per student: score, each cell's grade, and each graded cell's outputs' kinds."""
    found = {}
    with gradebook.open_gradebook(root) as gb:
        for submission in gb.find_assignment(TINY).submissions:
            grades = {g.name: (g.auto_score, bool(g.needs_manual_grade)) for n in submission.notebooks for g in n.grades}
            found[submission.student.id] = (submission.score, grades)
    for student in found:
        notebook = nbformat.read(root / "autograded" / student / TINY / f"{TINY}.ipynb", as_version=4)
        errors = [[o.get("ename") for o in c.get("outputs", []) if o.get("output_type") == "error"]
                  for c in notebook.cells if c.cell_type == "code"]
        found[student] += (errors,)
    return found


def test_a_class_grades_on_the_cluster_as_on_the_default_engine(dask_cluster, tmp_path):
    limits = grade.Limits(timeout=30, attempts=3)
    local = tiny_course(tmp_path / "local", ANSWERS, written=WRITTEN)
    remote = tiny_course(tmp_path / "remote", ANSWERS, written=WRITTEN)
    by_default = grade.grade(local, jobs=2, limits=limits, log=lambda *_: None)
    log: list[str] = []
    on_cluster = grade.grade(remote, limits=limits, scheduler=dask_cluster["address"], log=log.append)
    assert [(o.student, o.status, o.score, o.pending) for o in on_cluster] == \
           [(o.student, o.status, o.score, o.pending) for o in by_default], "\n".join(log)
    assert {o.student: o.score for o in on_cluster} == {"ann": 1.0, "bob": 0.0, "cy": 1.0, "dee": 0.0,
                                                        "eve": 1.0, "fay": 0.0}
    assert [i["kind"] for i in next(o for o in on_cluster if o.student == "fay").incidents] == ["kernel_died"]
    assert graded_state(remote) == graded_state(local)
    workers = {str(w.pid) for w in dask_cluster["workers"]}
    assert {o.worker.rsplit(":", 1)[1] for o in on_cluster} == workers, "both workers of the cluster graded"
    assert any(line.startswith(f"engine: Dask cluster at {dask_cluster['address']}") for line in log)
    report = json.loads((remote / "reports" / "grading_report.json").read_text())
    assert report["engine"].startswith("Dask cluster at")


def test_the_command_line_grades_one_submission_on_the_cluster(dask_cluster, tmp_path):
    root = tiny_course(tmp_path / "course", {"ann": "value = 42", "bob": "value = 41"})
    command = [sys.executable, "-m", "autograder.grading.grade", "--root", str(root), "--timeout", "30",
               "--scheduler", dask_cluster["address"]]
    first = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    assert first.returncode == 0 and "graded 2, unchanged 0, failed 0" in first.stdout, first.stdout + first.stderr
    # One regrade (what Formgrader's Autograde button runs): that submission only, unchanged or not.
    again = subprocess.run(command + ["--student", "bob", "--assignment", TINY], cwd=REPO_ROOT,
                           capture_output=True, text=True)
    assert again.returncode == 0 and "graded 1, unchanged 0, failed 0" in again.stdout, again.stdout + again.stderr
    assert "bob/00_tiny: 0 / 1" in again.stdout
    unknown = subprocess.run(command + ["--student", "bobb", "--assignment", TINY], cwd=REPO_ROOT,
                             capture_output=True, text=True)
    assert unknown.returncode == 2 and "no submission of bobb" in unknown.stderr and "ann, bob" in unknown.stderr


def test_a_worker_killed_mid_grading_costs_nothing(dask_cluster, tmp_path):
    """Each answer sleeps, so that both workers are busy; one is killed while it grades."""
    answers = {f"s{n}": f"import time\ntime.sleep(4)\nvalue = {42 if n % 2 == 0 else 41}" for n in range(6)}
    root = tiny_course(tmp_path / "course", answers)
    victim = dask_cluster["workers"][0]
    killed: list[int] = []

    def kill_when_busy() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            processes = children_running(victim.pid, "autograder.grading.nbgrader_process")
            # the nbgrader process is grading once a kernel runs under it (a fork of its kernel server, whose
            # client is the nbgrader process's child; a kernel of its own without bubblewrap)
            if processes and any(children_running(e, "kernel_forkserver.py\0kernel") or children_running(e, "ipykernel")
                               for e in processes):
                killed.extend(processes)
                victim.send_signal(signal.SIGKILL)
                return
            time.sleep(0.1)

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    log: list[str] = []
    outcomes = grade.grade(root, limits=grade.Limits(timeout=60), scheduler=dask_cluster["address"],
                           log=log.append)
    killer.join()
    assert victim.poll() is not None and killed, "the worker was not killed while grading"
    assert sorted(o.student for o in outcomes) == sorted(answers), "\n".join(log)
    assert {o.student: (o.status, o.score) for o in outcomes} == {
        s: ("graded", 1.0 if int(s[1:]) % 2 == 0 else 0.0) for s in answers}, "\n".join(log)
    survivor = str(dask_cluster["workers"][1].pid)
    assert any(o.worker.endswith(":" + survivor) for o in outcomes)
    with gradebook.open_gradebook(root) as gb:
        submissions = gb.find_assignment(TINY).submissions
        assert sorted(s.student.id for s in submissions) == sorted(answers)   # one each, none twice
    deadline = time.monotonic() + 30   # the killed worker's nbgrader process exits once its worker is gone
    while any(Path(f"/proc/{pid}").exists() for pid in killed) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(Path(f"/proc/{pid}").exists() for pid in killed), "the killed worker's nbgrader process lives on"
    assert scratch_folders(dask_cluster["logs"], worker=0) == [], "the killed worker's scratch folder is left"


# --------------------------------------------------------------------------------------
# The README's commands, as an instructor types them
# --------------------------------------------------------------------------------------

SCHEDULER_COMMAND = "make dask-scheduler DASK_PORT=8786"
WORKER_COMMAND = "make dask-worker SCHEDULER=tcp://scheduler-host:8786"
GRADE_COMMAND = "make grade SCHEDULER=tcp://scheduler-host:8786"


def this_scheduler(command: str, port: int) -> dict[str, str]:
    """The README's scheduler address or port in ``command``, replaced by this test's."""
    return ({"DASK_PORT=8786": f"DASK_PORT={port}"} if command == SCHEDULER_COMMAND
            else {"scheduler-host:8786": f"127.0.0.1:{port}"})


def free_port_pair() -> int:
    """A free port whose next port (the scheduler's dashboard) is free too."""
    while True:
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


@contextlib.contextmanager
def started(command: str, log: Path, environment: dict, port: int | None = None):
    """A command started by the shell in the repository (a process group, ended on exit): the
    README's, with this test's scheduler ``port``, or (no port) one of the test's own."""
    output = open(log, "w")
    if port is None:
        process = subprocess.Popen(command, shell=True, cwd=REPO_ROOT, env=environment, start_new_session=True,
                                   stdout=output, stderr=subprocess.STDOUT)
    else:
        process = start_readme_command(command, env=environment, replace=this_scheduler(command, port), stdout=output,
                                       stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        stop_process_group(process, grace=30)
        output.close()


def test_the_readmes_cluster_commands_grade_a_class_and_a_scheduler_without_the_course_is_refused(tmp_path):
    from distributed import Client

    port = free_port_pair()
    root = tiny_course(tmp_path / "course_root", {"ann": "value = 42", "bob": "value = 41"})
    environment = {**os.environ, "ATTENTION_LAB_COURSE_ROOT": str(root), "JOBS": "1"}
    environment.pop("PYTHONPATH", None)
    # `make dask-worker` alone says what it needs
    usage = run_readme_command("make dask-worker", env=environment)
    assert usage.returncode != 0 and "usage: make dask-worker SCHEDULER=tcp://" in usage.stdout, usage.stdout
    # typed literally, the README's placeholder host: "not found", not Dask's "Nanny failed to start"
    for literal in (WORKER_COMMAND, GRADE_COMMAND):
        unknown = run_readme_command(literal, env=environment, timeout=300)
        assert unknown.returncode != 0 and "the host 'scheduler-host' was not found" in unknown.stderr, \
            literal + unknown.stdout + unknown.stderr
        assert "Nanny failed" not in unknown.stdout + unknown.stderr
    with started(SCHEDULER_COMMAND, tmp_path / "scheduler.log", environment, port), \
            started(WORKER_COMMAND, tmp_path / "worker.log", environment, port):
        with Client(f"tcp://127.0.0.1:{port}", timeout="120s") as client:
            client.wait_for_workers(1, timeout=300)
        graded = run_readme_command(GRADE_COMMAND, env=environment, replace=this_scheduler(GRADE_COMMAND, port))
    logs = "\n".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert graded.returncode == 0 and "graded 2, unchanged 0, failed 0" in graded.stdout, \
        graded.stdout + graded.stderr + logs
    assert "ModuleNotFoundError" not in logs

    # the README's earlier command: a scheduler started outside the clone's PYTHONPATH
    port = free_port_pair()
    plain = f"{REPO_ROOT}/.venv/bin/dask scheduler --port {port} --dashboard-address :{port + 1}"
    with started(plain, tmp_path / "plain-scheduler.log", environment):
        refused = subprocess.run([sys.executable, "-m", "autograder.grading.grade", "--root", str(root), "--force",
                                  "--scheduler", f"tcp://127.0.0.1:{port}"], cwd=REPO_ROOT, env=environment,
                                 capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0, refused.stdout
    assert "cannot import the course: ModuleNotFoundError: No module named 'autograder'" in refused.stderr, refused.stderr
    assert "make dask-scheduler" in refused.stderr
