"""What a graded submission can see, keep and use: the sandbox, through the real pipeline.

Hostile submissions of the tiny assignment (no torch: classes that grade in seconds) are
graded by ``grade.grade`` as ``make grade`` grades them, and each test checks what they got:

* without a working bubblewrap, ``make grade`` refuses to grade and says why, unless the
  instructor turns the sandbox off (``SANDBOX=off``);
* a kernel sees only what the sandbox shows: not a file elsewhere on the machine;
* nothing a kernel writes, even in a folder it made read-only, reaches the next kernel;
* memory, processes, disk and time are limited for a whole submission, and the report says
  which limits hold on this machine.

The grader's environment (a database password) never reaching a kernel is tested in
tests/test_kernel_forkserver.py, for fresh and forked kernels alike.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest

from autograder.grading import grade
from autograder.isolation import cgroups, sandbox
from tests.readme_commands import run_readme_command
from autograder.places import REPO_ROOT
from autograder.places import COURSE_ROOT_VARIABLE, DB_URL_VARIABLE
from tests.grading_helpers import TINY, cell_limit, tiny_course

needs_bwrap = pytest.mark.skipif(sandbox.bwrap_path() is None, reason="bubblewrap unavailable: no sandbox to test")


def graded_order(log: list[str]) -> list[str]:
    return [line.split()[1].split("/")[0] for line in log if line.strip().startswith("graded ")]


def printed(root: Path, student: str) -> str:
    """What the student's answer cell printed in the autograded notebook."""
    notebook = nbformat.read(root / "autograded" / student / TINY / f"{TINY}.ipynb", as_version=4)
    answer = next(c for c in notebook.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "answer")
    return "".join(output.get("text", "") for output in answer.outputs)


def with_cells(root: Path, student: str, sources: list[str]) -> None:
    """Add code cells of the student's own after the answer (students may add cells)."""
    path = root / "submitted" / student / TINY / f"{TINY}.ipynb"
    notebook = nbformat.read(path, as_version=4)
    notebook.cells[1:1] = [nbformat.v4.new_code_cell(source) for source in sources]
    nbformat.write(notebook, str(path))


# --------------------------------------------------------------------------------------
# Fail closed
# --------------------------------------------------------------------------------------

def test_make_grade_refuses_without_a_working_sandbox_unless_the_instructor_turns_it_off(tmp_path, monkeypatch, capsys):
    root = tiny_course(tmp_path / "autograder", {"ann": "value = 42"})
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert grade.main(["--root", str(root), "--jobs", "1"]) == 2
    refusal = capsys.readouterr().err
    assert "refusing to grade" in refusal and "bubblewrap (bwrap) is not installed" in refusal
    assert "SANDBOX=off" in refusal
    assert not (root / "autograded").exists() and not (root / "gradebook.db").exists(), "it graded anyway"
    # the explicit opt-out grades (tests/test_grading.py grades with it) and says so
    said: list[str] = []
    assert grade._isolation(grade.Limits(sandbox="off"), said.append).startswith("none")
    assert "WITHOUT filesystem and network isolation" in said[0]
    # `make grade` says --sandbox on unless SANDBOX=off
    for variable, flag in (([], '--sandbox "on"'), (["SANDBOX=off"], '--sandbox "off"')):
        dry_run = subprocess.run(["make", "-n", "grade", *variable], cwd=REPO_ROOT, capture_output=True, text=True)
        assert flag in dry_run.stdout, dry_run.stdout + dry_run.stderr


def path_without(program: str, scratch: Path) -> str:
    """``$PATH`` on which ``program`` cannot be found: each folder holding it is replaced by a
    scratch folder of links to everything else in it."""
    folders = []
    for number, folder in enumerate(os.environ["PATH"].split(os.pathsep)):
        if not (Path(folder) / program).exists():
            folders.append(folder)
            continue
        mirror = scratch / f"path{number}"
        mirror.mkdir(parents=True)
        for entry in Path(folder).iterdir():
            if entry.name != program:
                (mirror / entry.name).symlink_to(entry)
        folders.append(str(mirror))
    return os.pathsep.join(folders)


def test_make_grade_installs_nothing_and_says_which_command_installs_bubblewrap(tmp_path):
    """Grading never runs apt-get (it depended on `make sandbox`): without bubblewrap,
    `make grade` refuses, naming the command that installs it; `make test` still installs it."""
    planned = subprocess.run(["make", "-n", "grade"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert planned.returncode == 0 and "apt-get" not in planned.stdout, planned.stdout + planned.stderr
    assert "apt-get" in subprocess.run(["make", "-n", "test"], cwd=REPO_ROOT, capture_output=True, text=True,
                                       timeout=60).stdout
    root = tiny_course(tmp_path / "course_root", {"ann": "value = 42"})
    environment = {**os.environ, "PATH": path_without("bwrap", tmp_path / "bin"), COURSE_ROOT_VARIABLE: str(root)}
    assert shutil.which("bwrap", path=environment["PATH"]) is None
    refused = run_readme_command("make grade", env=environment, timeout=300)
    assert refused.returncode != 0, refused.stdout + refused.stderr
    assert "bubblewrap (bwrap) is not installed: `make sandbox` installs it" in refused.stderr, refused.stderr
    assert "apt-get install" not in refused.stdout   # what make would have echoed had it run the install
    assert not (root / "autograded").exists() and not (root / "gradebook.db").exists(), "it graded anyway"
    # `make sandbox` (which `make test` runs first) finds bubblewrap installed, or says it could not install it
    installed = run_readme_command("make sandbox", timeout=600)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert shutil.which("bwrap") or "could not install bubblewrap" in installed.stdout, installed.stdout


# --------------------------------------------------------------------------------------
# What a kernel sees and keeps: one class, graded by one nbgrader process
# --------------------------------------------------------------------------------------

SECRET = "hunter2-db-password"
# Every environment it can read: its own, and any process's in /proc.
THIEF = f"""import glob, os
texts = [repr(dict(os.environ))]
for path in glob.glob('/proc/[0-9]*/environ'):
    try:
        texts.append(open(path, 'rb').read().decode(errors='replace'))
    except OSError:
        pass
found = any({SECRET!r} in text for text in texts)
print('read', len(texts), 'environments:', 'FOUND THE PASSWORD' if found else 'no password')
value = 42 if found else 0"""
# Files elsewhere on the machine: another checkout of the course (its solutions in clear),
# the machine's users and host name; and the solution, run if it can be read.
SPY = """import os, json
targets = [{solution!r}, {checkout!r}, '/etc/passwd', '/etc/hostname', '/var', {repository!r}]
print(json.dumps({{'seen': [t for t in targets if os.path.exists(t)], 'root': sorted(os.listdir('/'))}}))
namespace = {{}}
try:
    exec(open({solution!r}).read(), namespace)
except OSError:
    pass
value = namespace.get('value')"""
# The planter's start-up file: in every later kernel, it copies the answer into a drop
# folder and replaces it with a wrong one.
STARTUP = """import os, IPython
shell = IPython.get_ipython()
def _copy_and_spoil(result):
    if 'value' in shell.user_ns:
        with open('/tmp/drop/loot/answer', 'a') as handle:
            handle.write(repr(shell.user_ns['value']))
        shell.user_ns['value'] = -1
shell.events.register('post_run_cell', _copy_and_spoil)
"""
PLANT = f"""import os
from IPython.core.profiledir import ProfileDir
startup = ProfileDir.create_profile_dir_by_name('/tmp/ipython', 'default').startup_dir
open(startup + '/00-spy.py', 'w').write({STARTUP!r})
os.makedirs('/tmp/drop/loot', exist_ok=True)
os.makedirs('/dev/shm/drop', exist_ok=True)
open('/dev/shm/drop/note', 'w').write('left by the planter')
os.chmod('/tmp/drop/loot', 0o777)
for folder in (startup, '/tmp/drop', '/dev/shm/drop'):
    os.chmod(folder, 0o555)
value = 42"""
COLLECT = """import os, json
places = ['/tmp/drop', '/tmp/ipython/profile_default/startup/00-spy.py', '/dev/shm/drop']
print(json.dumps([place for place in places if os.path.exists(place)]))
value = 42"""


@pytest.fixture(scope="module")
def hostile_class(tmp_path_factory):
    """The planter first, then its victim and a collector, a thief of environments and a spy,
    graded in one run by one nbgrader process (each kernel forked from the same kernel server), with
    the grader's database URL and password exported as `make grade DB_URL=...` exports them."""
    base = tmp_path_factory.mktemp("hostile")
    checkout = Path(tempfile.mkdtemp(prefix="other-checkout-", dir="/var/tmp" if Path("/var/tmp").is_dir() else None))
    solution = checkout / "solutions" / f"{TINY}.py"
    solution.parent.mkdir()
    solution.write_text("value = 42  # the model solution\n")
    spy = SPY.format(solution=str(solution), checkout=str(checkout), repository=str(REPO_ROOT / "solutions"))
    root = tiny_course(base / "autograder", {"a-planter": PLANT, "b-victim": "value = 42", "c-collector": COLLECT,
                                             "spy": spy, "thief": THIEF})
    log: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DB_URL_VARIABLE, f"postgresql://grader:{SECRET}@db.example.org/attention_lab")
        try:
            outcomes = grade.grade(root, jobs=1, limits=grade.Limits(timeout=60), log=log.append,
                                   db_url=f"sqlite:///{root / 'gradebook.db'}")  # (the URL above leads nowhere)
        finally:
            shutil.rmtree(checkout)
    return root, {o.student: o for o in outcomes}, log


@pytest.mark.slow
@needs_bwrap
@pytest.mark.xdist_group("hostile_class")
def test_the_graders_environment_never_reaches_a_submission(hostile_class):
    """`make grade DB_URL=postgresql://grader:<password>@...` exports the URL to every process of
    the run: no kernel finds it, in its environment or any process's it can read."""
    root, outcomes, log = hostile_class
    assert outcomes["thief"].status == "graded" and "environments: no password" in printed(root, "thief"), \
        printed(root, "thief")
    assert outcomes["thief"].score == 0.0


@pytest.mark.slow
@needs_bwrap
@pytest.mark.xdist_group("hostile_class")
def test_a_submission_sees_nothing_of_the_machine_but_what_the_sandbox_shows(hostile_class):
    root, outcomes, log = hostile_class
    facts = json.loads(printed(root, "spy"))
    assert (outcomes["spy"].status, outcomes["spy"].score) == ("graded", 0.0), "it copied the solution from elsewhere"
    assert facts["seen"] == [], facts
    python = (Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), sandbox.package_dir())
    assert set(facts["root"]) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "sys", "dev", "proc",
                                  "tmp", *(path.parts[1] for path in python)}, facts


@pytest.mark.slow
@needs_bwrap
@pytest.mark.xdist_group("hostile_class")
def test_nothing_a_kernel_writes_reaches_the_next_even_in_folders_made_read_only(hostile_class):
    """The victim keeps full marks and the collector finds nothing (the planter's drop folder,
    its start-up file, its note in /dev/shm, the victim's answer)."""
    root, outcomes, log = hostile_class
    assert graded_order(log)[0] == "a-planter", f"the planter was not graded first: {log}"
    assert len({pid for o in outcomes.values() for pid in o.nbgrader_pids}) == 1, "not one nbgrader process: nothing to show"
    assert {s: (o.status, o.score) for s, o in outcomes.items() if s[1] == "-"} == {
        "a-planter": ("graded", 1.0), "b-victim": ("graded", 1.0), "c-collector": ("graded", 1.0)}, "\n".join(log)
    assert outcomes["b-victim"].incidents == []
    assert json.loads(printed(root, "c-collector")) == [], "the collector found what the planter left"


# --------------------------------------------------------------------------------------
# Limits for a whole submission
# --------------------------------------------------------------------------------------

# Three processes, each holding 400 MB (within the 1024 MB each may have), in a sandbox of 1024 MB.
HOG = """import subprocess, sys
hold = "import time; block = b'x' * (400 * 2**20); time.sleep(2)"
children = [subprocess.Popen([sys.executable, '-c', hold]) for _ in range(3)]
codes = [child.wait() for child in children]
print('exit codes', codes)
value = 42 if codes == [0, 0, 0] else 0"""
# More processes than the sandbox may hold.
FORKS = """import subprocess
started = []
try:
    for _ in range(120):
        started.append(subprocess.Popen(['sleep', '300']))
except OSError as error:
    print('stopped at', len(started), type(error).__name__)
for child in started:
    child.kill()
    child.wait()
value = 42 if len(started) == 120 else 0"""
# More than the disk quota, in the tmpfs (refused) and in the working folder (stopped).
FILL_TMPFS = """written = 0
for folder in ('/tmp', '/dev/shm'):
    for n in range(8):
        try:
            with open(f'{folder}/fill{n}', 'wb') as handle:
                handle.write(b'x' * (6 * 2**20))
            written += 1
        except OSError as error:
            print(folder, 'refused', type(error).__name__)
            break
value = 42 if written == 16 else 0"""
FILL_WORKDIR = """import time
for n in range(8):
    with open(f'fill{n}', 'wb') as handle:
        handle.write(b'x' * (6 * 2**20))
time.sleep(5)
value = 42"""


@pytest.mark.slow
@needs_bwrap
def test_memory_processes_disk_and_time_are_limited_for_a_whole_submission(tmp_path):
    limit = cell_limit()
    answers = {"honest": "value = 42", "tmpfs": FILL_TMPFS, "workdir": FILL_WORKDIR, "sleeper": "value = 42"}
    group = cgroups.available()
    if group:  # limits only a control group holds
        answers |= {"hog": HOG, "forks": FORKS, "burner": "value = 42"}
    root = tiny_course(tmp_path / "autograder", answers)
    # every cell of its own just under the cell limit: each attempt would run past the notebook limit
    with_cells(root, "sleeper", [f"import time\ntime.sleep({0.8 * limit:.1f})"] * 6)
    if group:
        with_cells(root, "burner", [f"import time\nend = time.monotonic() + {0.8 * limit:.1f}\n"
                                    "while time.monotonic() < end:\n    pass"] * 6)
    limits = grade.Limits(timeout=limit, notebook_timeout=2 * limit, submission_timeout=3 * limit, attempts=3,
                              cpu_seconds=max(5, limit // 2), memory_mb=1024, file_mb=8, disk_mb=24, processes=64)
    log: list[str] = []
    outcomes = {o.student: o for o in grade.grade(root, jobs=2, limits=limits, log=log.append)}
    report = "\n".join(log)
    assert (outcomes["honest"].status, outcomes["honest"].score, outcomes["honest"].incidents) == ("graded", 1.0, []), report
    # disk: the sandbox's /tmp and /dev/shm are full at the quota; the working folder is watched
    assert (outcomes["tmpfs"].status, outcomes["tmpfs"].score) == ("graded", 0.0), report
    assert printed(root, "tmpfs").count("refused OSError") == 2, printed(root, "tmpfs")
    assert (outcomes["workdir"].status, outcomes["workdir"].score) == ("graded", 0.0), report
    assert [i["kind"] for i in outcomes["workdir"].incidents] == ["disk_quota"], outcomes["workdir"].incidents
    # time: all attempts together, not each
    sleeper = outcomes["sleeper"]
    assert sleeper.status == "failed" and "--submission-timeout" in sleeper.error, sleeper
    assert sleeper.attempts == 2, "the submission's time was not shared by its attempts"
    if group:
        hog = printed(root, "hog")                                          # not 1200 MB in a 1024 MB sandbox
        assert outcomes["hog"].score == 0.0 and "-9" in hog and outcomes["hog"].incidents == [], (hog, report)
        assert outcomes["forks"].score == 0.0 and "stopped at" in printed(root, "forks")
        burner = outcomes["burner"]
        assert burner.status == "failed" and "--cpu-seconds" in burner.error, burner
    # the report says which limits hold here
    table = (root / "reports" / "grading_report.md").read_text()
    assert "| memory of the whole sandbox | " + ("yes" if group else "**no**") in table
    assert "| disk | yes |" in table


def test_the_report_says_which_limits_do_not_hold_without_a_control_group(monkeypatch):
    from autograder.grading.run_report import limit_lines, limits_in_force

    monkeypatch.setattr(cgroups, "available", lambda: None)
    limits = {item["limit"]: item for item in limits_in_force(grade.Limits())}
    assert not limits["memory of the whole sandbox"]["holds"] and not limits["processes"]["holds"]
    assert not limits["CPU time"]["holds"] and limits["memory per process"]["holds"]
    lines = limit_lines(list(limits.values()))
    assert any(line.startswith("WARNING: limit that does NOT hold here: processes") for line in lines)
    off = {item["limit"]: item["holds"] for item in limits_in_force(grade.Limits(sandbox="off"))}
    assert not off["network"] and not off["disk"]
