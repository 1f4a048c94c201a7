"""Everything a student can submit, through the real pipeline (intake -> parallel autograde
-> feedback -> export), in a temporary course root.

One module-scoped run grades the whole "class" below (two students at a time, cell limits
derived from how long the setup cell takes on this machine now); the tests then check each
student got exactly what their working cells earn, that nothing else was affected, and what
the reports say.  All its tests share one xdist group, so that run happens once.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import nbformat
import pytest

from autograder.grading import grade
from autograder.isolation import sandbox
from autograder.reports import feedback
from autograder.store import gradebook, results
from autograder.term import intake
from autograder.reports.export import export
from autograder.places import REPO_ROOT
from autograder.publishing.release import build_source, course_repository, write_notebook
from autograder.places import COURSE_ROOT
from tests.grading_helpers import cell_limit, setup_cell_seconds

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("adversarial_class")]

ASSIGNMENT = "01_mha_shapes"
GRADED_CELLS = results.graded_cells(build_source(ASSIGNMENT, course_repository()))
FULL = sum(c.points for c in GRADED_CELLS if not c.manual)      # what autograding can give
POSSIBLE = sum(c.points for c in GRADED_CELLS)                  # written answers included
LAST = "split_heads_einops"           # answer cell of a 1-point exercise nothing else uses
LAST_TEST = "test_split_heads_einops"
REAL_GRADEBOOK = COURSE_ROOT / "gradebook.db"


def measured_limits() -> grade.Limits:
    """Short limits, but a multiple of what an honest cell needs on this machine now (one measurement)."""
    seconds = setup_cell_seconds()
    return grade.Limits(timeout=cell_limit(setup_seconds=seconds), notebook_timeout=int(max(400, 80 * seconds)),
                          memory_mb=3072, file_mb=64, max_output_bytes=200_000, attempts=5,
                          unresponsive_grace=5, sandbox="on")


# --------------------------------------------------------------------------------------
# Building submissions
# --------------------------------------------------------------------------------------

def release_notebook():
    return nbformat.read(REPO_ROOT / "course" / f"{ASSIGNMENT}.ipynb", as_version=4)


def solved_notebook(source_path: Path):
    """What a student who solved everything submits: the release with the solutions spliced in."""
    source = nbformat.read(source_path, as_version=4)
    solutions = {c.metadata["nbgrader"]["grade_id"]: c.source for c in source.cells
                 if c.metadata.get("nbgrader", {}).get("solution")}
    notebook = release_notebook()
    for cell in notebook.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in solutions:
            cell.source = "\n".join(line for line in solutions[grade_id].splitlines()
                                    if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION"))
    return notebook


def cell(notebook, grade_id):
    return next(c for c in notebook.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


def with_answer(base, grade_id, prefix="", body=None):
    """Copy of ``base`` whose answer ``grade_id`` gets ``prefix`` lines before it, or a new body."""
    notebook = copy.deepcopy(base)
    target = cell(notebook, grade_id)
    if body is not None:
        header = target.source.split('"""')
        target.source = '"""'.join(header[:2]) + '"""\n' + "\n".join("    " + line for line in body.splitlines()) + "\n"
    if prefix:
        target.source = prefix.rstrip() + "\n" + target.source
    return notebook


def write(path: Path, notebook) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, str(path))


def sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


# --------------------------------------------------------------------------------------
# The class
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    base = tmp_path_factory.mktemp("course")
    root, downloads = base / "autograder", base / "downloads"
    source_path = root / "source" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
    write_notebook(build_source(ASSIGNMENT, course_repository()), source_path)
    solved = solved_notebook(source_path)
    blank = release_notebook()
    victim_file = root / "submitted" / "victim" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
    gradebook_file = root / "gradebook.db"
    sub = {}

    sub["Zoë Ångström Núñez"] = ("Copy of 01_mha_shapes.ipynb", solved, FULL)
    sub["blank"] = ("01_mha_shapes.ipynb", blank, 0.0)
    # an infinite loop in an answer: its demo cell and its test time out; 2 points lost
    # ... and the test of block_flops, whose answer calls it (it is not run again: not waited on twice).
    # It sleeps: interrupted the same way as a spinning one (the agent runs answers in the kernel's
    # main thread), without burning two time limits of CPU; the under-load test's loop spins.
    sub["loop"] = ("01_mha_shapes (1).ipynb", with_answer(solved, "attention_layer_flops", body=(
        "import time\nwhile True:\n    time.sleep(0.05)")), FULL - 4)
    # ... and one that ignores the interrupt: the kernel is restarted without that cell
    sub["stubborn"] = ("01_MHA_shapes.ipynb", with_answer(solved, LAST, body=(
        "import time\nwhile True:\n    try:\n        time.sleep(0.05)\n    except BaseException:\n        pass")), FULL - 1)
    sub["sysexit"] = ("01_mha_shapes.ipynb", with_answer(solved, LAST, body="import sys\nsys.exit()"), FULL - 1)
    sub["osexit"] = ("01_mha_shapes.ipynb", with_answer(solved, LAST, prefix="import os\nos._exit(1)"), FULL - 1)
    sub["crash"] = ("01_mha_shapes.ipynb", with_answer(solved, LAST, body="import ctypes\nreturn ctypes.string_at(0)"), FULL - 1)
    sub["memory"] = ("01_mha_shapes.ipynb", with_answer(solved, LAST, body=(
        "hog = []\nwhile True:\n    hog.append(bytearray(256 * 2**20))")), FULL - 1)
    sub["chatty"] = ("01_mha_shapes.ipynb", with_answer(solved, LAST, prefix="print('x' * (30 * 2**20))"), FULL)
    edited = with_answer(solved, LAST, body="return 0")                     # wrong answer ...
    cell(edited, LAST_TEST).source = "pass  # trust me"                     # ... and its test emptied
    edited.cells.remove(cell(edited, "test_split_heads"))                   # a test cell deleted
    sub["edited tests"] = ("01_mha_shapes.ipynb", edited, FULL - 1)
    stripped = copy.deepcopy(solved)
    for c in stripped.cells:
        c.metadata = {}
    sub["colab"] = ("Copy of 01_mha_shapes (2).ipynb", stripped, FULL)
    sub["rebinds"] = ("01_mha_shapes.ipynb", with_answer(solved, LAST, body="return 0", prefix=(
        "import sys, types, torch, builtins\n"
        "fake = types.ModuleType('attention_lab.checks.mha_shapes')\n"
        "fake.check_split_heads_einops = lambda *a, **k: print('all good')\n"
        "sys.modules['attention_lab.checks.mha_shapes'] = fake\n"
        "check_split_heads_einops = fake.check_split_heads_einops\n"
        "torch.allclose = lambda *a, **k: True\n")), FULL - 1)
    attack = (
        "import os, socket\n"
        f"targets = [{str(gradebook_file)!r}, {str(victim_file)!r}, {str(REAL_GRADEBOOK)!r}, {str(source_path)!r}]\n"
        "for target in targets:\n"
        "    try:\n"
        "        with open(target, 'w') as handle:\n"
        "            handle.write('pwned')\n"
        "    except OSError as error:\n"
        "        print('blocked', type(error).__name__)\n"
        "try:\n"
        "    socket.create_connection(('1.1.1.1', 80), timeout=2)\n"
        "    print('NETWORK REACHABLE')\n"
        "except OSError as error:\n"
        "    print('no network', type(error).__name__)\n")
    if sandbox.bwrap_path() is not None:  # without the sandbox this attack would succeed (see README)
        sub["attacker"] = ("01_mha_shapes.ipynb", with_answer(solved, LAST, prefix=attack), FULL)
    for student, (name, notebook, _) in sub.items():
        write(downloads / student / name, notebook)
    (downloads / "broken").mkdir()
    (downloads / "broken" / "01_mha_shapes.ipynb").write_text('{"cells": [')
    (downloads / "broken" / "Copy of 01_mha_shapes.ipynb").write_text("")
    (downloads / "broken" / "notes.pdf").write_bytes(b"%PDF-1.4")
    other = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 03 — something else entirely"),
                                            nbformat.v4.new_code_cell("print('hello world, a different notebook')")])
    write(downloads / "wrong" / "01_mha_shapes.ipynb", other)
    write(victim_file, solved)  # already submitted by an earlier intake

    originals = {p: sha(p) for p in downloads.rglob("*") if p.is_file()}
    entries = intake.intake(downloads, root, REPO_ROOT / "course", assignments=[ASSIGNMENT])
    intake.write_report(entries, root, downloads)
    real_before = sha(REAL_GRADEBOOK)
    victim_before = sha(victim_file)
    source_before = sha(source_path)
    log: list[str] = []
    limits = measured_limits()
    outcomes = grade.grade(root, jobs=2, limits=limits, log=log.append)
    feedback.write_feedback(root)
    grades_csv, by_question_csv = export(root)
    return {
        "root": root, "downloads": downloads, "sub": sub, "entries": entries, "outcomes": outcomes,
        "log": log, "originals": originals, "real_before": real_before, "victim_before": victim_before,
        "victim_file": victim_file, "source_before": source_before, "source_path": source_path,
        "grades_csv": grades_csv, "by_question_csv": by_question_csv, "limits": limits,
    }


def scores(root: Path) -> dict[str, float]:
    with gradebook.open_gradebook(root) as gb:
        return {s.student.id: s.score for s in gb.find_assignment(ASSIGNMENT).submissions}


def outcome(graded, student) -> grade.Outcome:
    return next(o for o in graded["outcomes"] if o.student == student)


# --------------------------------------------------------------------------------------
# Scores
# --------------------------------------------------------------------------------------

def test_every_student_gets_what_their_working_cells_earn(graded):
    got = scores(graded["root"])
    expected = {student: points for student, (_, _, points) in graded["sub"].items()}
    expected["victim"] = FULL
    assert {s: got.get(s) for s in expected} == expected, "\n".join(graded["log"])
    assert all(o.status == "graded" for o in graded["outcomes"]), "\n".join(graded["log"])


def test_killed_and_hung_kernels_are_restarted_without_the_guilty_cell(graded):
    for student, kind in (("osexit", "kernel_died"), ("crash", "kernel_died"), ("stubborn", "kernel_unresponsive")):
        kinds = [i["kind"] for i in outcome(graded, student).incidents]
        assert kind in kinds, (student, kinds)
        assert outcome(graded, student).attempts >= 2
    loop = outcome(graded, "loop")
    assert [i["kind"] for i in loop.incidents].count("timeout") >= 1 and loop.attempts == 1
    honest = [o for o in graded["outcomes"] if o.student in ("Zoë Ångström Núñez", "blank", "colab", "victim")]
    assert all(o.incidents == [] and o.attempts <= 1 for o in honest), [(o.student, o.incidents) for o in honest]


def test_big_output_is_truncated(graded):
    notebook = graded["root"] / "autograded" / "chatty" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
    assert notebook.stat().st_size < 5 * 2**20
    assert "output_truncated" in [i["kind"] for i in outcome(graded, "chatty").incidents]


def test_tampering_with_checks_changes_nothing(graded):
    """A fake check module in sys.modules and a replaced torch.allclose live in the kernel; notebook
    01's checks run in the trusted checker (tests/test_trust_boundary.py has the other attacks), so
    only the wrong answer loses its point."""
    rebinds = outcome(graded, "rebinds")
    failed = {t["grade_id"]: t for t in rebinds.tests if not t["passed"] and not t["manual"]}
    assert set(failed) == {LAST_TEST}
    assert rebinds.score == FULL - 1


def test_the_report_says_where_the_verdicts_were_decided(graded):
    report = (graded["root"] / "reports" / "grading_report.md").read_text()
    assert f"decided by the trusted checker, outside the student's kernel: {ASSIGNMENT}" in report
    honest = [line for line in report.splitlines() if line.startswith("| Zoë Ångström Núñez |")]
    assert "TAMPERING" not in honest[0]


# --------------------------------------------------------------------------------------
# Isolation
# --------------------------------------------------------------------------------------

@pytest.mark.skipif(sandbox.bwrap_path() is None, reason="bubblewrap unavailable: no isolation to test")
def test_student_code_cannot_touch_gradebook_sources_or_other_students(graded):
    root = graded["root"]
    assert sha(graded["victim_file"]) == graded["victim_before"]
    assert sha(graded["source_path"]) == graded["source_before"]
    # (other tools may update the real gradebook meanwhile; the attacker's write would start it with "pwned")
    assert not REAL_GRADEBOOK.exists() or not REAL_GRADEBOOK.read_bytes().startswith(b"pwned")
    assert (root / "gradebook.db").read_bytes()[:15] == b"SQLite format 3"
    notebook = nbformat.read(root / "autograded" / "attacker" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb", as_version=4)
    printed = "".join(o.get("text", "") for o in cell(notebook, LAST).outputs)
    assert printed.count("blocked") == 4 and "no network" in printed and "NETWORK REACHABLE" not in printed


def _kernels_in(folders: set[str]) -> list[tuple[str, str]]:
    left = []
    for link in Path("/proc").glob("[0-9]*/cwd"):
        try:
            where = os.readlink(link)  # a kernel runs in its student's folder (even once it is deleted)
        except OSError:
            continue
        if any(folder in where for folder in folders):
            left.append((link.parent.name, where))
    return left


def test_no_student_kernel_outlives_the_run(graded):
    """Hung, crashed, timed-out and finished kernels alike are gone once grading returns.

    A killed nbgrader process's sandboxed kernel dies through the sandbox's parent-death signal, which
    the kernel receives asynchronously: on a loaded machine it may take a moment. A kernel
    that really outlives its nbgrader process is still running after a minute.
    """
    folders = {f"/autograded/{student}/{ASSIGNMENT}" for student in graded["sub"]}
    deadline = time.monotonic() + 60
    while (left := _kernels_in(folders)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], f"kernels still running a minute after grading returned: {left}"


def test_sandbox_warning_names_the_missing_tool(monkeypatch):
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert "bubblewrap" in sandbox.unavailable_reason()
    assert "SANDBOX=off" in sandbox.refusal() and "refusing to grade" in sandbox.refusal()


# --------------------------------------------------------------------------------------
# Intake, nothing lost, reports
# --------------------------------------------------------------------------------------

def test_intake_refuses_bad_files_with_reasons_and_keeps_originals(graded):
    by_source = {e.source: e for e in graded["entries"]}
    assert "not valid JSON" in " ".join(by_source["broken/01_mha_shapes.ipynb"].reasons)
    assert "empty file" in by_source["broken/Copy of 01_mha_shapes.ipynb"].reasons
    assert "not a notebook" in " ".join(by_source["broken/notes.pdf"].reasons)
    assert "not those of any notebook" in " ".join(by_source["wrong/01_mha_shapes.ipynb"].reasons)
    assert all(by_source[s].status == "refused" for s in by_source if s.startswith(("broken/", "wrong/")))
    assert by_source["colab/Copy of 01_mha_shapes (2).ipynb"].status == "repaired"
    assert any("put back the deleted cell 'test_split_heads'" in r
               for r in by_source["edited tests/01_mha_shapes.ipynb"].reasons)
    assert {p: sha(p) for p in graded["downloads"].rglob("*") if p.is_file()} == graded["originals"]
    report = (graded["root"] / "reports" / "intake_report.md").read_text()
    assert "refused" in report and "Zoë Ångström Núñez" in report


def test_nothing_is_lost(graded):
    root = graded["root"]
    students = set(graded["sub"]) | {"victim"}
    assert {p.name for p in (root / "autograded").iterdir()} == students
    assert {p.name for p in (root / "feedback").iterdir()} == students
    with open(graded["grades_csv"], encoding="utf-8") as handle:
        rows = {r["student_id"]: float(r["score"]) for r in csv.DictReader(handle)}
    assert rows == scores(root)
    with open(graded["by_question_csv"], encoding="utf-8") as handle:
        questions = list(csv.DictReader(handle))
    assert len(questions) == len(GRADED_CELLS) * len(students)
    per_student = {}
    for row in questions:
        per_student[row["student"]] = per_student.get(row["student"], 0) + float(row["score"])
    assert per_student == rows
    report = json.loads((root / "reports" / "grading_report.json").read_text())
    assert {s["student"] for s in report["submissions"]} == students


def test_feedback_never_shows_hidden_tests_tracebacks_or_output(graded):
    root = graded["root"]
    source = nbformat.read(graded["source_path"], as_version=4)
    hidden = set()
    for c in source.cells:
        hidden.update(feedback.hidden_lines(c.source))
    assert hidden
    for page in (root / "feedback").rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        assert not any(line in text for line in hidden), page
        assert "Traceback" not in text and "BEGIN HIDDEN" not in text and "xxxxxxxxxx" not in text
        assert "all good" not in text
    blank = (root / "feedback" / "blank" / ASSIGNMENT / f"{ASSIGNMENT}.html").read_text(encoding="utf-8")
    assert "not implemented yet" in blank and f"0 / {POSSIBLE:g}" in blank
    osexit = (root / "feedback" / "osexit" / ASSIGNMENT / f"{ASSIGNMENT}.html").read_text(encoding="utf-8")
    assert "stopped the Python kernel" in osexit


def test_regrading_is_idempotent_and_only_regrades_changes(graded):
    root = graded["root"]
    before = scores(root)
    log: list[str] = []
    outcomes = grade.grade(root, jobs=2, limits=graded["limits"], log=log.append)
    assert {o.status for o in outcomes} == {"unchanged"}, log
    assert scores(root) == before
    # the blank student submits again, solved this time: only that one is regraded
    solved = nbformat.read(root / "submitted" / "Zoë Ångström Núñez" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb", as_version=4)
    write(root / "submitted" / "blank" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb", solved)
    outcomes = grade.grade(root, jobs=2, limits=graded["limits"], log=log.append)
    regraded = [o.student for o in outcomes if o.status == "graded"]
    assert regraded == ["blank"], log
    assert scores(root) == {**before, "blank": FULL}


def test_make_grade_cli_reports_and_exits_zero(graded):
    result = subprocess.run([str(REPO_ROOT / ".venv" / "bin" / "python"), "-m", "autograder.grading.grade",
                             "--root", str(graded["root"]), "--timeout", str(graded["limits"].timeout),
                             "--memory-mb", str(graded["limits"].memory_mb), "--file-mb", str(graded["limits"].file_mb),
                             "--max-output-bytes", str(graded["limits"].max_output_bytes), "--attempts", str(graded["limits"].attempts)],
                            cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "unchanged" in result.stdout
