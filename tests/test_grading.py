"""The nbgrader flow itself (course config + real ``nbgrader autograde``), the nbgrader
processes on the Dask workers (on a tiny assignment), and the pieces of the pipeline that need no kernel
(feedback wording, fingerprints, discovery)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from autograder.grading import grade
from autograder.isolation import cgroups, sandbox
from autograder.reports import feedback
from autograder.store import gradebook, results
from autograder.term.course_settings import CourseSettings
from autograder.reports.export import export
from autograder.store.nbgrader_cli import run_nbgrader
from autograder.places import REPO_ROOT
from autograder.publishing.release import (build_source, course_repository, generate_assignments, mark_hidden_tests,
                                           write_notebook)
from autograder.places import COURSE_ROOT_VARIABLE
from tests.grading_helpers import (TINY, cell_limit, loaded_machine, setup_cell_seconds, slow_kernel_start, tiny_course,
                                   tiny_notebook)
from tests.readme_commands import run_readme_command

ASSIGNMENT = "01_mha_shapes"


def solved_from(source_path: Path):
    """The release notebook with the solution cells' sources spliced in (no hidden tests)."""
    source = nbformat.read(source_path, as_version=4)
    solutions = {c.metadata["nbgrader"]["grade_id"]: c.source for c in source.cells
                 if c.metadata.get("nbgrader", {}).get("solution")}
    notebook = nbformat.read(REPO_ROOT / "course" / f"{ASSIGNMENT}.ipynb", as_version=4)
    for cell in notebook.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in solutions:
            cell.source = solutions[grade_id]
    return notebook


@pytest.fixture
def course_root(tmp_path):
    root = tmp_path / "autograder"
    write_notebook(build_source(ASSIGNMENT, course_repository()), root / "source" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb")
    return root


@pytest.mark.slow
def test_plain_nbgrader_autograde_gives_full_marks_and_zero(course_root):
    """The course's nbgrader_config through the real `nbgrader autograde`, one student at a time."""
    source_path = course_root / "source" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
    solved = solved_from(source_path)
    assert "BEGIN HIDDEN TESTS" not in "".join(c.source for c in solved.cells)
    for student, notebook in (("solver", solved),
                              ("blank", nbformat.read(REPO_ROOT / "course" / f"{ASSIGNMENT}.ipynb", as_version=4))):
        path = course_root / "submitted" / student / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
        path.parent.mkdir(parents=True)
        nbformat.write(notebook, str(path))
    run_nbgrader("generate_assignment", ASSIGNMENT, "--force", "--log-level=ERROR", root=course_root, capture=True)
    result = run_nbgrader("autograde", ASSIGNMENT, "--log-level=ERROR", root=course_root, capture=True, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    with gradebook.open_gradebook(course_root) as gb:
        scores = {s.student.id: (s.score, s.max_score) for s in gb.find_assignment(ASSIGNMENT).submissions}
    # Every point but the written answers', which wait for a hand grade (they count 0 until then).
    cells = results.graded_cells(nbformat.read(source_path, as_version=4))
    possible, autograded = sum(c.points for c in cells), sum(c.points for c in cells if not c.manual)
    assert possible > autograded > 0
    assert scores == {"solver": (autograded, possible), "blank": (0.0, possible)}


def test_nbgrader_run_in_this_process_leaves_it_as_it_was_and_a_failure_names_the_command(tmp_path):
    """The grading run generates the gradebook's cells with nbgrader in its own process: the same
    cells as the command, and the process's working folder, path and environment as they were
    (nbgrader's first import extends the path: measured after it); a source nbgrader refuses stops
    the run with the command named."""
    root = tiny_course(tmp_path / "autograder", {})
    folder = os.getcwd()
    generate_assignments([TINY], root, "--log-level=ERROR")
    with gradebook.open_gradebook(root) as gb:
        assert [cell.name for cell in gb.find_notebook(TINY, TINY).grade_cells] == ["test_value"]
    before = (folder, list(sys.path), dict(os.environ))
    generate_assignments([TINY], root, "--log-level=ERROR")
    assert (os.getcwd(), sys.path, dict(os.environ)) == before
    source = root / "source" / TINY / f"{TINY}.ipynb"
    source.write_text(source.read_text().replace('"grade_id": "answer"', '"grade_id": "test_value"'))  # two cells, one id
    with pytest.raises(RuntimeError, match=f"nbgrader generate_assignment {TINY} --force .* failed"):
        generate_assignments([TINY], root, "--log-level=ERROR")
    assert (os.getcwd(), sys.path, dict(os.environ)) == before


def test_discovery_skips_unknown_assignments_and_empty_folders(course_root):
    for folder in ("ann/01_mha_shapes", "ann/99_unknown", "bob/01_mha_shapes"):
        (course_root / "submitted" / folder).mkdir(parents=True)
    (course_root / "submitted" / "ann" / "01_mha_shapes" / "01_mha_shapes.ipynb").write_text("{}")
    (course_root / "submitted" / "ann" / "99_unknown" / "x.ipynb").write_text("{}")
    submissions, problems = grade.discover(course_root)
    assert [s.key for s in submissions] == ["ann/01_mha_shapes"]
    assert any("99_unknown" in p for p in problems) and any("bob/01_mha_shapes" in p for p in problems)


def test_fingerprint_changes_with_submission_source_and_limits(course_root):
    folder = course_root / "submitted" / "ann" / ASSIGNMENT
    folder.mkdir(parents=True)
    (folder / f"{ASSIGNMENT}.ipynb").write_text("{}")
    submission = grade.Submission("ann", ASSIGNMENT, folder)
    limits = grade.Limits()
    first = grade.fingerprint(submission, course_root, limits)
    assert grade.fingerprint(submission, course_root, limits) == first
    (folder / ".ipynb_checkpoints").mkdir()
    (folder / ".ipynb_checkpoints" / "x.ipynb").write_text("noise")
    assert grade.fingerprint(submission, course_root, limits) == first
    assert grade.fingerprint(submission, course_root, grade.Limits(timeout=5)) != first
    (folder / f"{ASSIGNMENT}.ipynb").write_text('{"changed": 1}')
    assert grade.fingerprint(submission, course_root, limits) != first


# --------------------------------------------------------------------------------------
# What feedback may say
# --------------------------------------------------------------------------------------

TEST_SOURCE = mark_hidden_tests('''"""split_heads: shapes and values."""
from attention_lab.checks.mha_shapes import check_split_heads

check_split_heads(split_heads)
### BEGIN HIDDEN TESTS
check_split_heads(split_heads, seed=1101, device="cpu")
### END HIDDEN TESTS''')


def failed(evalue: str = "expected [2, 3] got [3, 2]", ename: str = "CheckFailure") -> results.GradedCell:
    """A failed test cell; the traceback names a line of the hidden block, which must not matter."""
    error = {"ename": ename, "evalue": evalue,
             "traceback": ["\x1b[0;31m----\x1b[0m", "Cell \x1b[0;32mIn[12], line 7\x1b[0m\n      1 x\n",
                           "File /x/checks.py:10, in check_split_heads", f"{ename}: {evalue}"]}
    return results.GradedCell("01", "test_split_heads", 2.0, manual=False, source=TEST_SOURCE, error=error)


def run_test_cell(split_heads) -> results.GradedCell:
    """Run TEST_SOURCE (as built for the grader) with a stand-in check; the cell as graded."""
    def check_split_heads(answer, seed=0, device=None):
        answer(seed)

    module = type(os)("attention_lab.checks.mha_shapes")
    module.check_split_heads = check_split_heads
    namespace = {"split_heads": split_heads}
    saved = {name: sys.modules.get(name) for name in ("attention_lab", "attention_lab.checks",
                                                      "attention_lab.checks.mha_shapes")}
    sys.modules["attention_lab.checks.mha_shapes"] = module
    try:
        exec(TEST_SOURCE, namespace)
        error = None
    except Exception as raised:
        error = {"ename": type(raised).__name__, "evalue": str(raised), "traceback": []}
    finally:
        for name, value in saved.items():
            if value is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = value
    return results.GradedCell("01", "test_split_heads", 2.0, manual=False, source=TEST_SOURCE, error=error)


def test_hidden_tests_report_their_failure_as_hidden():
    """The grader's copy of a test cell names a hidden failure itself (no traceback reading)."""
    def fails_on_other_seeds(seed):
        if seed:
            raise ValueError(f"wrong on seed {seed}")

    def always_fails(seed):
        raise ValueError("wrong everywhere")

    hidden = run_test_cell(fails_on_other_seeds)
    assert hidden.ename == results.HIDDEN_FAILURE and hidden.hidden_failure
    visible = run_test_cell(always_fails)
    assert visible.ename == "ValueError" and not visible.hidden_failure
    assert run_test_cell(lambda seed: None).passed


def test_visible_check_failure_shows_its_message():
    assert feedback.explain(failed(), TEST_SOURCE) == "CheckFailure: expected [2, 3] got [3, 2]"


def test_hidden_failure_says_so_and_nothing_more():
    text = feedback.explain(failed(evalue="seed=1101 device cpu mismatch", ename=results.HIDDEN_FAILURE), TEST_SOURCE)
    assert "hidden tests" in text and "1101" not in text and results.HIDDEN_FAILURE not in text


def test_message_quoting_hidden_code_is_withheld():
    text = feedback.explain(failed(evalue='check_split_heads(split_heads, seed=1101, device="cpu")'), TEST_SOURCE)
    assert "withheld" in text and "1101" not in text


def test_grader_reasons_are_explained():
    assert "time limit" in feedback.explain(failed(ename="CellTimeoutError", evalue=""), TEST_SOURCE)
    assert "out of memory" in feedback.explain(failed(ename="MemoryError", evalue=""), TEST_SOURCE)
    skipped = feedback.explain(failed(ename=results.SKIPPED_CELL, evalue="this cell stopped the kernel"), TEST_SOURCE)
    assert skipped == "Not run: this cell stopped the kernel."


def test_render_escapes_and_totals():
    rows = [{"grade_id": "test_a", "checks": "<b>a</b>", "score": 1.0, "max_score": 2.0, "passed": False,
             "message": "<script>x</script>"},
            {"grade_id": "test_b", "checks": "b", "score": 3.0, "max_score": 3.0, "passed": True, "message": ""}]
    page = feedback.render("Zoë", "01", "01", rows, [])
    assert "<script>" not in page and "&lt;script&gt;" in page and "4 / 5" in page and "Zoë" in page


def test_render_keeps_the_lines_of_a_message_and_names_the_notebook_once():
    rows = [{"grade_id": "test_a", "checks": "a", "score": 0.0, "max_score": 2.0, "passed": False,
             "message": "CheckFailure: split_heads(x)\nexpected shape [2, 4, 5, 3]\ngot [2, 5, 4, 3]"}]
    page = feedback.render("ann", "01_mha_shapes", "01_mha_shapes", rows, [])
    assert "split_heads(x)\nexpected shape [2, 4, 5, 3]\ngot" in page and "white-space:pre-wrap" in page
    assert "<h1>01_mha_shapes</h1>" in page and page.count("01_mha_shapes") == 2  # heading and title only


# --------------------------------------------------------------------------------------
# The nbgrader processes: one long-lived nbgrader process per job, a new kernel per notebook
# --------------------------------------------------------------------------------------

@pytest.fixture
def tiny_class(tmp_path):
    """A course root with the tiny assignment and a few students (``{student: answer}`` to fill)."""
    root = tmp_path / "autograder"

    def submit(answers: dict[str, str], setup: bool = False, written: dict[str, str] | None = None):
        return tiny_course(root, answers, setup, written)

    return submit


def nbgrader_pids(outcomes) -> set[int]:
    """The nbgrader processes (on the Dask workers) that graded these outcomes."""
    return {pid for o in outcomes for pid in o.nbgrader_pids}


def wait_until_gone(pids: set[int], seconds: float = 30) -> set[int]:
    """The pids still running after ``seconds`` (an nbgrader process exits once its Dask worker is gone)."""
    deadline = time.monotonic() + seconds
    while (alive := {pid for pid in pids if Path(f"/proc/{pid}").exists()
                     and "autograder.grading.nbgrader_process" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")}) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def test_a_leaving_nbgrader_process_removes_its_scratch_folder_even_while_it_still_writes(tmp_path):
    """A Dask worker killed mid-grading: its nbgrader process leaves (see nbgrader_process.leave)
    while its main thread may still be writing a student's files into the worker's scratch folder.
    Removed before that process is gone, the folder was left behind, student files and all."""
    scratch = tmp_path / "alg-worker-x"
    scratch.mkdir()
    leaving = f"""
import pathlib, threading
from autograder.grading import nbgrader_process
scratch, writing = pathlib.Path({str(scratch)!r}), threading.Event()
def write():
    for n in range(10**9):
        try:
            folder = scratch / "nbgrader0" / "autograded" / str(n % 50)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "out.ipynb").write_text("x" * 1000)
            writing.set()
        except OSError:
            pass
threading.Thread(target=write, daemon=True).start()
writing.wait()
nbgrader_process.leave(scratch)
"""
    subprocess.run([sys.executable, "-c", leaving], check=True, cwd=REPO_ROOT)
    deadline = time.monotonic() + 60
    while scratch.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not scratch.exists(), f"left: {sorted(p.name for p in scratch.rglob('*'))[:5]}"


def processes_running(*argv: str, parent: int | None = None) -> list[int]:
    """Processes whose command line holds ``argv`` (in a row), children of ``parent`` if given."""
    needle = b"\0" + "\0".join(argv).encode() + b"\0"
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = b"\0" + (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if needle in command and parent in (None, ppid):
            found.append(int(stat.parent.name))
    return found


# the tests reading the class below, on one worker, so that it is graded once
ON_THE_TINY_GRADED_CLASS = pytest.mark.xdist_group("tiny_graded")


@pytest.fixture(scope="module")
def tiny_graded(tmp_path_factory):
    """One class graded once by one worker (jobs=1), shared by the tests that only read it (the
    last one, grading by hand, writes its gradebook)."""
    root = tiny_course(tmp_path_factory.mktemp("tiny-graded") / "autograder",
                       {"ann": "value = 42", "bob": "value = 41", "cy": "value = 42", "dee": "value = 42"},
                       written={"ann": "Because.", "bob": "Why not."})
    outcomes = grade.grade(root, jobs=1, limits=grade.Limits(timeout=30), log=lambda *_: None)
    return root, outcomes


@pytest.mark.slow
@ON_THE_TINY_GRADED_CLASS
def test_one_nbgrader_process_grades_a_job_students_each_in_a_fresh_kernel(tiny_graded):
    root, outcomes = tiny_graded
    # A kernel shared between students would fail the second one's test (the builtins marker).
    assert {o.student: o.score for o in outcomes} == {"ann": 1.0, "bob": 0.0, "cy": 1.0, "dee": 1.0}
    assert len(nbgrader_pids(outcomes)) == 1, "the worker's nbgrader process should grade all four students"
    assert len({o.worker for o in outcomes}) == 1 and str(os.getpid()) not in outcomes[0].worker, \
        "graded by one Dask worker process, not this one"
    assert wait_until_gone(nbgrader_pids(outcomes)) == set(), "the nbgrader process outlived the run"


@pytest.mark.slow
def test_nbgrader_process_past_the_notebook_timeout_is_replaced_and_the_class_goes_on(tiny_class):
    # long enough to start an nbgrader process and a kernel on this machine now, far shorter than the sleep
    notebook_timeout = int(max(15, 4 * setup_cell_seconds()))
    root = tiny_class({"ann": "import time\ntime.sleep(600)\nvalue = 42", "bob": "value = 42"})
    limits = grade.Limits(timeout=300, notebook_timeout=notebook_timeout, attempts=2)
    outcomes = {o.student: o for o in grade.grade(root, jobs=1, limits=limits, log=lambda *_: None)}
    assert outcomes["ann"].status == "graded" and outcomes["ann"].score == 0.0, outcomes["ann"].error
    assert [i["kind"] for i in outcomes["ann"].incidents] == ["notebook_timeout"]
    assert outcomes["bob"].score == 1.0
    outcomes = list(outcomes.values())
    assert len(nbgrader_pids(outcomes)) == 2, "the killed nbgrader process should be replaced by exactly one new one"
    assert wait_until_gone(nbgrader_pids(outcomes)) == set()


# Without bubblewrap only the explicit "off" grades.
SANDBOX_MODES = ["on", "off"] if sandbox.bwrap_path() is not None else ["off"]


@pytest.mark.slow
@pytest.mark.parametrize("isolation, seconds", [(m, f"417{n}") for n, m in enumerate(SANDBOX_MODES, 1)])
def test_processes_a_student_detaches_do_not_outlive_their_grading(tiny_class, isolation, seconds):
    """Under bubblewrap the sandbox's end takes them; without it the nbgrader process adopts and kills them.
    Without it, grading is the README's `make grade SANDBOX=off`, which says so in the console and report."""
    root = tiny_class({"ann": f"import subprocess\nsubprocess.Popen(['sleep', '{seconds}'], start_new_session=True)\n"
                              "value = 42"})
    if isolation == "on":
        outcomes = grade.grade(root, jobs=1, limits=grade.Limits(timeout=30), log=lambda *_: None)
        assert [o.score for o in outcomes] == [1.0]
    else:
        CourseSettings(timeout=30).save(root)   # make settings TIMEOUT=30
        unisolated = run_readme_command("make grade SANDBOX=off", env=dict(os.environ, JOBS="1",
                                                                            **{COURSE_ROOT_VARIABLE: str(root)}))
        assert unisolated.returncode == 0 and "ann/00_tiny: 1 / 1" in unisolated.stdout, \
            unisolated.stdout + unisolated.stderr
        assert "WITHOUT filesystem and network isolation" in unisolated.stdout + unisolated.stderr
        assert "Isolation: none: the sandbox was turned off" in (root / "reports" / "grading_report.md").read_text()
    assert processes_running("sleep", seconds) == [], "a process the student started is still running"


# What the first student plants for the next one: an IPython start-up file that defines the
# answer (in the sandbox's /tmp, IPYTHONDIR), a file in /dev/shm, a detached process that
# keeps planting the start-up file; System V IPC objects and a POSIX message queue carrying the
# answer (a covert channel the similarity report never sees), the shared memory segments
# (LEFT_MB, written: charged to the sandbox's memory) never removed; and a SIGKILL for PID 1 of
# the sandbox (the kernel server its kernel was forked from), whose memory it also tries to open
# (to trace it).
LEFT_MB = 256
IPC_PLANTER = f"""import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
for n in range({LEFT_MB} // 32):
    segment = libc.shmget(0x4173 + n, 32 << 20, 0o1000 | 0o666)
    address = libc.shmat(segment, None, 0)
    ctypes.memmove(address, b"value = 42", 10)
    ctypes.memset(address + 10, 1, (32 << 20) - 10)
    libc.shmdt(ctypes.c_void_p(address))
class Message(ctypes.Structure):
    _fields_ = [("mtype", ctypes.c_long), ("text", ctypes.c_char * 16)]
queue = libc.msgget(0x4173, 0o1000 | 0o666)
assert libc.msgsnd(queue, ctypes.byref(Message(1, b"value = 42")), 16, 0) == 0
assert libc.semget(0x4173, 3, 0o1000 | 0o666) >= 0
assert libc.mq_open(b"/value-42", os.O_CREAT | os.O_RDWR, 0o666, None) >= 0
"""
# What the next students look at: nothing of it is there (the ids and names of their IPC namespace).
IPC_LOOK = """import ctypes
libc = ctypes.CDLL(None, use_errno=True)
left = {kind: open('/proc/sysvipc/' + kind).read().splitlines()[1:] for kind in ('shm', 'msg', 'sem')}
left['mq'] = os.listdir('/dev/mqueue')
assert not any(left.values()), f'left in the IPC namespace: {left}'
assert libc.shmget(0x4173, 0, 0) == -1 and libc.msgget(0x4173, 0) == -1, 'the planted keys still answer'
"""
PLANTER = ("import os, time\n"
           "while True:\n"
           "    os.makedirs('/tmp/ipython/profile_default/startup', exist_ok=True)\n"
           "    open('/tmp/ipython/profile_default/startup/00-value.py', 'w').write('value = 42')\n"
           "    time.sleep(0.02)\n")
ATTACK = f"""import os, signal, subprocess, sys, time
subprocess.Popen([sys.executable, '-c', {PLANTER!r}, 'planter-4173'], start_new_session=True)
open('/dev/shm/left-by-a', 'w').write('x')
exec({IPC_PLANTER!r})
time.sleep(0.5)
os.kill(1, signal.SIGKILL)
assert os.path.exists('/tmp/ipython/profile_default/startup/00-value.py')
try:
    open('/proc/1/mem', 'rb').close()
except PermissionError:
    value = 42"""
LOOK = "assert not os.path.exists('/dev/shm/left-by-a'), 'left in /dev/shm'\n" + IPC_LOOK


@pytest.mark.slow
@pytest.mark.skipif(sandbox.bwrap_path() is None, reason="kernels are forked from a server only under bubblewrap")
def test_nothing_a_student_leaves_in_the_sandbox_reaches_the_next_student(tiny_class):
    """One nbgrader process grades a, b, c in turn, each kernel forked from the same kernel server:
    b defines no value, so b earns nothing unless a's start-up file reached b's kernel; b and c fail
    their test if anything of a's IPC namespace is there, and the memory a's segments held is no
    longer charged to the sandbox once a is graded (measured: the engine records it)."""
    root = tiny_class({"a": ATTACK, "b": "import os\n" + LOOK + "pass", "c": "import os\n" + LOOK + "value = 42"})
    log: list[str] = []
    outcomes = {o.student: o for o in grade.grade(root, jobs=1, limits=grade.Limits(timeout=30), log=log.append)}
    graded = [line.split()[1].split("/")[0] for line in log if line.strip().startswith("graded ")]
    assert graded == ["a", "b", "c"], f"graded in another order, so a could not reach b: {log}"
    assert {s: (o.status, o.score) for s, o in outcomes.items()} == {
        "a": ("graded", 1.0), "b": ("graded", 0.0), "c": ("graded", 1.0)}, "\n".join(log)
    assert outcomes["a"].incidents == [] and len(set(outcomes["a"].nbgrader_pids + outcomes["c"].nbgrader_pids)) == 1, \
        "the kernel server (and so its nbgrader process) did not survive a's SIGKILL"  # (a earns 1 only if it cannot trace it)
    test_b = next(t for t in outcomes["b"].tests if t["grade_id"] == "test_value")
    assert test_b["error"] == "NameError", test_b
    if cgroups.available():  # (a's shared memory, once charged to the sandbox's group: LEFT_MB)
        assert all(o.left_in_sandbox_mb is not None and o.left_in_sandbox_mb < LEFT_MB / 4 for o in outcomes.values()), \
            {s: o.left_in_sandbox_mb for s, o in outcomes.items()}
    assert processes_running(sys.executable, "-c", PLANTER, "planter-4173") == []


@pytest.mark.slow
@pytest.mark.skipif(sandbox.bwrap_path() is None or cgroups.available() is None,
                    reason="the sandbox's memory is measured in its control group")
def test_what_an_earlier_submission_left_is_never_blamed_on_the_next(tiny_class, monkeypatch):
    """The engine's safety net behind the kernel server's clean-up: memory the sandbox's group still holds
    that no process does (here said by the group: 1 GiB after a, and again before b) restarts the sandbox,
    and a kernel that cannot start (a's first, here) is tried again in a fresh one; each student is
    graded on their own work, and the report says what happened to whom."""
    from autograder.isolation import cgroups as groups

    measured = groups.Group.unowned_bytes
    calls = []

    def unowned(group):  # a-before, a-after (1 GiB: a's), b-before (1 GiB: never b's), then as measured
        calls.append(1)
        return 2**30 if len(calls) in (2, 3) else measured(group)

    def fails_once(builder):
        def argv(*args, **kwargs):
            argv = builder(*args, **kwargs)
            if not fails_once.failed:
                fails_once.failed = True
                argv[argv.index(str(sandbox.KERNEL_SERVER)) - 1] = "/nonexistent/python3"
            return argv
        return argv

    fails_once.failed = False
    monkeypatch.setattr(groups.Group, "unowned_bytes", unowned)
    monkeypatch.setattr(sandbox, "kernel_server_argv", fails_once(sandbox.kernel_server_argv))
    root = tiny_class({"a": "value = 42", "b": "value = 42", "c": "value = 42"})
    log: list[str] = []
    outcomes = {o.student: o for o in grade.grade(root, jobs=1, limits=grade.Limits(timeout=30), log=log.append,
                                                  processes=False)}  # (the Dask worker: a thread of this process)
    assert {s: (o.status, o.score) for s, o in outcomes.items()} == {
        "a": ("graded", 1.0), "b": ("graded", 1.0), "c": ("graded", 1.0)}, "\n".join(log)
    kinds = {s: [(i["kind"], i["detail"]) for i in o.incidents] for s, o in outcomes.items()}
    assert [kind for kind, _ in kinds["a"]] == ["sandbox_restarted", "left_in_sandbox"], kinds
    assert "could not start" in kinds["a"][0][1] and "/nonexistent/python3" in kinds["a"][0][1], kinds
    assert kinds["b"] == [("sandbox_restarted", "it held 1024 MB of memory that an earlier submission left")], kinds
    assert kinds["c"] == [], kinds
    report = (root / "reports" / "grading_report.md").read_text()
    assert "restarted the sandbox before grading it: it held 1024 MB" in report and "left 1024 MB" in report
    pids = {s: set(o.nbgrader_pids) for s, o in outcomes.items()}
    assert len(pids["a"]) == 2 and not pids["a"] & pids["b"] and pids["b"] == pids["c"], pids  # each restart: a new one


# --------------------------------------------------------------------------------------
# A loaded machine, a slow kernel start, a symlinked environment, a kernel that cannot start
# --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_under_load_and_a_slow_kernel_start_honest_work_is_graded_and_loops_are_still_caught(
        tiny_class, tmp_path, monkeypatch):
    """A CPU burner and a disk writer run beside the two grading jobs (more busy processes than a
    2-core machine has cores, and reads queued behind synced writes), and every kernel sleeps
    longer than a cell's limit before it starts: slow honest cells are graded as working, an
    endless loop as a timeout."""
    baseline = setup_cell_seconds()               # the setup cell here, now, without the burners
    # Half of what the setup cell needs: were imports on a cell's budget, every honest
    # student would time out; the honest cells themselves take milliseconds.
    limit = max(3, int(baseline / 2))
    for builder in ("kernel_argv", "kernel_client_argv"):  # without bubblewrap, and with it
        monkeypatch.setattr(sandbox, builder, slow_kernel_start(getattr(sandbox, builder), seconds=limit + 3))
    root = tiny_class({"ann": "value = 42",
                       "bob": f"import time\ntime.sleep({limit / 3:.1f})  # slow but working\nvalue = 42",
                       "cy": "while True:\n    pass\nvalue = 42"}, setup=True)
    limits = grade.Limits(timeout=limit, unresponsive_grace=5, attempts=3)
    log: list[str] = []
    with loaded_machine(tmp_path / "load"):
        # the kernel start is slowed in this process: the workers are threads of it
        outcomes = {o.student: o for o in grade.grade(root, jobs=2, limits=limits, log=log.append,
                                                      processes=False)}
    report = "\n".join(log) + f"\n(cell limit {limit} s, setup cell {baseline:.1f} s unloaded)"
    assert {s: (o.status, o.score) for s, o in outcomes.items()} == {
        "ann": ("graded", 1.0), "bob": ("graded", 1.0), "cy": ("graded", 0.0)}, report
    assert outcomes["ann"].incidents == [] and outcomes["bob"].incidents == [], report
    assert [(i["kind"], i["grade_id"]) for i in outcomes["cy"].incidents] == [("timeout", "answer")], report
    assert all(o.attempts == 1 for o in outcomes.values()), report


def test_the_sandboxed_kernel_is_named_through_the_resolved_environment(tmp_path, monkeypatch):
    link = tmp_path / "linked-venv"
    link.symlink_to(Path(sys.prefix).resolve(), target_is_directory=True)
    monkeypatch.setattr(sys, "prefix", str(link))
    monkeypatch.setattr(sys, "executable", str(link / "bin" / "python"))
    assert sandbox.kernel_python() == str(Path(sys.prefix).resolve() / "bin" / "python")
    argv = sandbox.kernel_argv(tmp_path, tmp_path, memory_mb=0, file_mb=0, sandbox=False)
    assert argv[argv.index("-m", 3) - 1] == str(link / "bin" / "python")  # no sandbox: as started


def test_the_guard_trusts_the_package_the_kernel_imports():
    """Where the package is installed is what the sandbox shows and the guard trusts (no false tampering)."""
    import attention_lab

    from autograder.grading import nbgrader_process

    assert sandbox.package_dir() == Path(attention_lab.__file__).resolve().parent
    assert repr(str(sandbox.package_dir())) in nbgrader_process.GUARD_CODE


@pytest.mark.slow
@pytest.mark.skipif(sandbox.bwrap_path() is None, reason="bubblewrap unavailable: only the sandbox hides the link")
def test_a_symlinked_virtual_environment_grades_in_the_sandbox(tiny_class, tmp_path):
    """``.venv`` a link into a tree the sandbox hides (here /tmp): every submission still graded."""
    link = tmp_path / "linked-venv"
    link.symlink_to(Path(sys.prefix).resolve(), target_is_directory=True)
    root = tiny_class({"ann": "value = 42", "bob": "value = 41"})
    result = subprocess.run([str(link / "bin" / "python"), "-m", "autograder.grading.grade", "--root", str(root),
                             "--sandbox", "on", "--jobs", "1", "--timeout", "60"],
                            cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    with gradebook.open_gradebook(root) as gb:
        assert {s.student.id: s.score for s in gb.find_assignment(TINY).submissions} == {"ann": 1.0, "bob": 0.0}


@pytest.mark.slow
@pytest.mark.parametrize("isolation", SANDBOX_MODES)
def test_a_kernel_that_cannot_start_is_reported_with_its_cause(tiny_class, monkeypatch, isolation):
    def missing_interpreter(builder, interpreter_before):
        def argv(*args, **kwargs):
            argv = builder(*args, **kwargs)
            # the kernel's (or the kernel server's) interpreter, not the launcher's
            argv[argv.index(interpreter_before, 3) - 1] = "/nonexistent/python3"
            return argv
        return argv

    monkeypatch.setattr(sandbox, "kernel_argv", missing_interpreter(sandbox.kernel_argv, "-m"))
    monkeypatch.setattr(sandbox, "kernel_server_argv",
                        missing_interpreter(sandbox.kernel_server_argv, str(sandbox.KERNEL_SERVER)))
    root = tiny_class({"ann": "value = 42"})
    (outcome,) = grade.grade(root, jobs=1, limits=grade.Limits(timeout=30, sandbox=isolation), log=lambda *_: None,
                             processes=False)  # the Dask worker is a thread of this (monkeypatched) process
    assert outcome.status == "failed"
    first_line = outcome.error.splitlines()[0]
    assert first_line.startswith("the kernel could not start: ") and "/nonexistent/python3" in first_line
    assert "No such file" in first_line
    notes = (root / "reports" / "grading_report.md").read_text()
    assert "| ann | 00_tiny | failed | - | the kernel could not start: " in notes


# --------------------------------------------------------------------------------------
# Written answers: left for grading by hand; export and feedback follow the gradebook
# --------------------------------------------------------------------------------------

def read_csv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
@ON_THE_TINY_GRADED_CLASS
def test_written_answers_wait_for_manual_grading_and_export_follows_the_gradebook(tiny_graded):
    root, outcomes = tiny_graded
    assert [o.status for o in outcomes] == ["graded"] * 4
    with gradebook.open_gradebook(root) as gb:
        written = gb.find_grade("why_value", TINY, TINY, "ann")
        assert written.needs_manual_grade and written.auto_score is None  # autograding left it alone
    grades_csv, by_question_csv = export(root)
    assert {(r["student_id"], r["score"], r["manual_grading_pending"]) for r in read_csv(grades_csv)
            if r["student_id"] in ("ann", "bob")} == {
        ("ann", "1.0", "yes"), ("bob", "0.0", "yes")}
    pending = {(r["student"], r["grade_id"]): r["manual_grading_pending"] for r in read_csv(by_question_csv)
               if r["student"] in ("ann", "bob")}
    assert pending == {("ann", "test_value"): "no", ("ann", "why_value"): "yes",
                       ("bob", "test_value"): "no", ("bob", "why_value"): "yes"}
    feedback.write_feedback(root)
    page = (root / "feedback" / "ann" / TINY / f"{TINY}.html").read_text()
    assert "awaiting grading by hand" in page

    # The instructor grades ann's answer in Formgrader (nbgrader's Gradebook API underneath)
    # and gives bob a point of extra credit on the test.
    with gradebook.open_gradebook(root) as gb:
        written = gb.find_grade("why_value", TINY, TINY, "ann")
        written.manual_score, written.needs_manual_grade = 1.5, False
        gb.find_grade("test_value", TINY, TINY, "bob").extra_credit = 1.0
        gb.db.commit()
    grades_csv, by_question_csv = export(root)
    assert {(r["student_id"], r["score"], r["manual_grading_pending"]) for r in read_csv(grades_csv)
            if r["student_id"] in ("ann", "bob")} == {
        ("ann", "2.5", "no"), ("bob", "1.0", "yes")}
    scores = {(r["student"], r["grade_id"]): r["score"] for r in read_csv(by_question_csv)
               if r["student"] in ("ann", "bob")}
    assert scores == {("ann", "test_value"): "1", ("ann", "why_value"): "1.5",
                      ("bob", "test_value"): "1", ("bob", "why_value"): "0"}
    feedback.write_feedback(root)
    page = (root / "feedback" / "ann" / TINY / f"{TINY}.html").read_text()
    assert "awaiting grading by hand" not in page and "1.5 / 2" in page


# --------------------------------------------------------------------------------------
# A resubmission, hand grades, a due date (SQLite; the same code serves PostgreSQL)
# --------------------------------------------------------------------------------------

def resubmit(root: Path, student: str, answer: str, written: str, submitted_at: str | None = None) -> None:
    folder = root / "submitted" / student / TINY
    nbformat.write(tiny_notebook(answer, written=written), str(folder / f"{TINY}.ipynb"))
    if submitted_at:
        (folder / "timestamp.txt").write_text(submitted_at)


@pytest.mark.slow
def test_a_resubmission_keeps_hand_grades_of_unchanged_answers_and_is_penalised_when_late(tiny_class):
    import datetime

    root = tiny_class({"ann": "value = 42", "bob": "value = 41", "cy": "value = 42"},
                      written={"ann": "Because.", "bob": "Why not.", "cy": "It is."})
    limits = grade.Limits(timeout=30)
    CourseSettings(late_penalty="zero").save(root)    # make settings LATE_PENALTY=zero
    log: list[str] = []
    first = {o.student: o for o in grade.grade(root, jobs=2, limits=limits, log=log.append)}
    # every total still waits for the written answer: the console says so
    assert all(o.pending == 2.0 for o in first.values())
    assert any("ann/00_tiny: 1 / 3 (incomplete: 2 points awaiting hand grading)" in line for line in log), log
    with gradebook.open_gradebook(root) as gb:      # the TAs grade in Formgrader
        for student, score in (("ann", 1.5), ("bob", 0.5), ("cy", 2.0)):
            written = gb.find_grade("why_value", TINY, TINY, student)
            written.manual_score, written.needs_manual_grade = score, False
        gb.find_grade("test_value", TINY, TINY, "bob").manual_score = 1.0     # an override of the test
        gb.find_comment("why_value", TINY, TINY, "bob").manual_comment = "Say why."
        gb.db.commit()
    # unchanged rows show the gradebook's score, hand grades included
    log.clear()
    second = {o.student: o for o in grade.grade(root, jobs=2, limits=limits, log=log.append)}
    assert {s: (o.status, o.score, o.pending) for s, o in second.items()} == {
        "ann": ("unchanged", 2.5, 0.0), "bob": ("unchanged", 1.5, 0.0), "cy": ("unchanged", 3.0, 0.0)}, log
    assert any(line.strip() == "unchanged ann/00_tiny: 2.5 / 3" for line in log), log
    with gradebook.open_gradebook(root) as gb:   # the due date (the instructors' tools record it)
        gb.update_or_create_assignment(TINY, duedate=datetime.datetime(2026, 1, 10, 12, 0))
        gb.db.commit()
    # ann changes her code only, a day late; bob rewrites his written answer; cy sends the same again
    resubmit(root, "ann", "value = 6 * 7", "Because.", "2026-01-11 12:00:00.000000 UTC")
    resubmit(root, "bob", "value = 41", "Now I know why.", "2026-01-09 12:00:00.000000 UTC")
    resubmit(root, "cy", "value = 42", "It is.", "2026-01-10 11:59:00.000000 UTC")
    log.clear()
    third = {o.student: o for o in grade.grade(root, jobs=2, limits=limits, log=log.append)}
    assert {s: o.status for s, o in third.items()} == {"ann": "graded", "bob": "graded", "cy": "graded"}, log
    with gradebook.open_gradebook(root) as gb:
        ann = gb.find_grade("why_value", TINY, TINY, "ann")
        assert (ann.manual_score, ann.needs_manual_grade) == (1.5, False), "ann's unchanged answer lost its grade"
        bob = gb.find_grade("why_value", TINY, TINY, "bob")
        assert (bob.manual_score, bob.needs_manual_grade) == (None, True), "bob's new answer kept the old grade"
        assert gb.find_grade("test_value", TINY, TINY, "bob").manual_score is None
        assert gb.find_comment("why_value", TINY, TINY, "bob").manual_comment is None
        assert gb.find_grade("why_value", TINY, TINY, "cy").manual_score == 2.0
        late = gb.find_submission(TINY, "ann")
        assert late.total_seconds_late == 24 * 3600 and late.late_submission_penalty == 2.5
        assert gb.find_submission(TINY, "cy").late_submission_penalty == 0.0
    assert (third["ann"].score, third["ann"].late_penalty) == (0.0, 2.5)      # nbgrader's "zero" method
    assert (third["bob"].score, third["bob"].pending) == (0.0, 2.0)
    # bob's dropped hand grades and the TA's comment are said, and kept
    assert third["bob"].notes and "why_value" in third["bob"].notes[0] and "test_value" in third["bob"].notes[0]
    kept = list((root / "archive" / "hand_grades" / "bob" / TINY).glob("*.json"))
    assert len(kept) == 1 and "Say why." in kept[0].read_text(), kept
    assert not third["ann"].notes and not third["cy"].notes
    assert (third["cy"].score, third["cy"].pending) == (3.0, 0.0)
    assert any("ann/00_tiny: 0 / 3 (late penalty 2.5)" in line for line in log), log
    report = (root / "reports" / "grading_report.md").read_text()
    assert "| bob | 00_tiny | graded | 0 / 3 (incomplete: 2 points awaiting hand grading) | hand grade dropped" in report
    assert "- late penalty: zero" in report


@pytest.mark.slow
def test_a_merge_that_fails_leaves_nothing_half_written_and_the_class_goes_on(tiny_class, monkeypatch):
    """The parent keeps one gradebook session for a whole run: a merge that fails halfway (here
    nbgrader's late-penalty rule raises for ann, once her grades are written in the session)
    is rolled back, not committed with the next student's merge."""
    from autograder.term import scores

    root = tiny_class({"ann": "value = 42", "bob": "value = 42", "cy": "value = 41"})
    late_penalty = scores.late_penalty

    def failing_for_ann(method, student, score, seconds_late):
        if student == "ann":
            raise RuntimeError("the gradebook went away")
        return late_penalty(method, student, score, seconds_late)

    monkeypatch.setattr(scores, "late_penalty", failing_for_ann)
    log: list[str] = []
    # the merges run in this process either way: the Dask worker may be a thread of it
    outcomes = {o.student: o for o in grade.grade(root, jobs=1, limits=grade.Limits(timeout=30), log=log.append,
                                                  processes=False)}
    assert outcomes["ann"].status == "failed", outcomes["ann"]
    assert "merge failed: RuntimeError: the gradebook went away" in outcomes["ann"].error
    assert (outcomes["bob"].score, outcomes["cy"].score) == (1.0, 0.0)
    merged = [line for line in log if f"/{TINY}" in line]
    assert "ann/" in merged[0], f"ann's merge should come first, before another could commit it: {merged}"
    with gradebook.open_gradebook(root) as gb:
        assert gb.find_grade("test_value", TINY, TINY, "ann").auto_score is None, "ann's half-merged grade was kept"
        assert gb.find_grade("test_value", TINY, TINY, "bob").auto_score == 1.0
    assert not (root / "autograded" / "ann").exists()
    # the next run grades ann again (her failed merge left no fingerprint), and only her
    monkeypatch.setattr(scores, "late_penalty", late_penalty)
    again = {o.student: o for o in grade.grade(root, jobs=1, limits=grade.Limits(timeout=30), log=lambda *_: None,
                                               processes=False)}
    assert {s: o.status for s, o in again.items()} == {"ann": "graded", "bob": "unchanged", "cy": "unchanged"}
    assert again["ann"].score == 1.0


def test_grading_before_any_intake_says_what_to_do_first(tmp_path):
    result = subprocess.run([sys.executable, "-m", "autograder.grading.grade", "--root", str(tmp_path / "course")],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "make intake SUBMISSIONS=" in result.stderr, result.stderr
    assert "graded" not in result.stdout


def test_a_new_gradebook_is_stamped_with_the_schema_revision_nbgraders_alembic_names(tmp_path):
    """open_gradebook reads the revision in-process instead of through `alembic heads`: the
    stamp must stay what nbgrader's own command line gives (its upgrades start from it)."""
    from nbgrader.dbutil import _temp_alembic_ini
    from sqlalchemy import create_engine, text

    with _temp_alembic_ini("sqlite:///unused.db") as ini:
        heads = subprocess.run([str(Path(sys.executable).parent / "alembic"), "-c", ini, "heads"],
                               capture_output=True, text=True, check=True).stdout
    with gradebook.open_gradebook(tmp_path):
        pass
    engine = create_engine(f"sqlite:///{tmp_path / gradebook.SQLITE_NAME}")
    with engine.connect() as connection:
        stamped = connection.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    engine.dispose()
    assert stamped == [heads.split()[0]]


@pytest.mark.slow
def test_a_function_that_ran_past_the_time_limit_is_not_waited_on_again(tiny_class):
    """One endless loop in an answer costs one cell's time limit: later cells that use the
    function are not run (and say why), a later cell that defines it again runs."""
    def cell(kind: str, source: str, grade_id: str, **flags):
        metadata = {"nbgrader": {"grade_id": grade_id, "schema_version": 3, "task": False, "grade": False,
                                 "solution": False, "locked": False, **flags}}
        return (nbformat.v4.new_code_cell if kind == "code" else nbformat.v4.new_markdown_cell)(source, metadata=metadata)

    def notebook(answer: str):
        return nbformat.v4.new_notebook(cells=[
            cell("code", answer, "answer", solution=True),
            cell("code", "assert forty_two() == 42", "test_one", grade=True, locked=True, points=1),
            cell("code", "assert forty_two() + 0 == 42", "test_two", grade=True, locked=True, points=1),
            cell("code", "def forty_two():\n    return 42\nassert forty_two() == 42", "test_three", grade=True,
                 locked=True, points=1),
        ], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})

    root = tiny_class({})
    nbformat.write(notebook("### BEGIN SOLUTION\ndef forty_two():\n    return 42\n### END SOLUTION"),
                   str(root / "source" / TINY / f"{TINY}.ipynb"))
    folder = root / "submitted" / "ann" / TINY
    folder.mkdir(parents=True)
    # an endless loop that sleeps: the time limit is under test here, not the CPU it would burn (the
    # under-load test's loop spins)
    nbformat.write(notebook("def forty_two():\n    import time\n    while True:\n        time.sleep(0.05)"),
                   str(folder / f"{TINY}.ipynb"))
    (outcome,) = grade.grade(root, jobs=1, limits=grade.Limits(timeout=cell_limit()), log=lambda *_: None)
    assert [(i["kind"], i.get("grade_id")) for i in outcome.incidents] == [
        ("timeout", "test_one"), ("hung_function", "test_two")], outcome.incidents
    assert outcome.score == 1.0   # test_three, which defines its own forty_two, ran
    graded = nbformat.read(root / "autograded" / "ann" / TINY / f"{TINY}.ipynb", as_version=4)
    (error,) = [o for o in graded.cells[2].outputs if o.get("output_type") == "error"]
    assert error["ename"] == results.SKIPPED_CELL and "forty_two(), which already ran past" in error["evalue"]
