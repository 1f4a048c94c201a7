"""The nbgrader flow itself (course config + real ``nbgrader autograde``), the grading
engines (on a tiny assignment), and the pieces of the pipeline that need no kernel
(feedback wording, fingerprints, discovery)."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

from autograder import feedback, grade
from autograder.nbgrader_cli import run_nbgrader
from autograder.release import REPO_ROOT, build_source, course_repository, write_notebook

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
    from nbgrader.api import Gradebook

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
    with Gradebook(grade.db_url(course_root), grade.COURSE_ID) as gb:
        scores = {s.student.id: (s.score, s.max_score) for s in gb.find_assignment(ASSIGNMENT).submissions}
    # 20 points, of which the 1-point written answer waits for a hand grade (it counts 0 until then).
    assert scores == {"solver": (19.0, 20.0), "blank": (0.0, 20.0)}


def test_discovery_skips_unknown_assignments_and_empty_folders(course_root):
    for folder in ("ann/01_mha_shapes", "ann/99_unknown", "bob/01_mha_shapes"):
        (course_root / "submitted" / folder).mkdir(parents=True)
    (course_root / "submitted" / "ann" / "01_mha_shapes" / "01_mha_shapes.ipynb").write_text("{}")
    (course_root / "submitted" / "ann" / "99_unknown" / "x.ipynb").write_text("{}")
    submissions, problems = grade.discover(course_root)
    assert [s.key for s in submissions] == ["ann/01_mha_shapes"]
    assert any("99_unknown" in p for p in problems) and any("bob/01_mha_shapes" in p for p in problems)


def test_fingerprint_changes_with_submission_source_and_settings(course_root):
    folder = course_root / "submitted" / "ann" / ASSIGNMENT
    folder.mkdir(parents=True)
    (folder / f"{ASSIGNMENT}.ipynb").write_text("{}")
    submission = grade.Submission("ann", ASSIGNMENT, folder)
    settings = grade.Settings()
    first = grade.fingerprint(submission, course_root, settings)
    assert grade.fingerprint(submission, course_root, settings) == first
    (folder / ".ipynb_checkpoints").mkdir()
    (folder / ".ipynb_checkpoints" / "x.ipynb").write_text("noise")
    assert grade.fingerprint(submission, course_root, settings) == first
    assert grade.fingerprint(submission, course_root, grade.Settings(timeout=5)) != first
    (folder / f"{ASSIGNMENT}.ipynb").write_text('{"changed": 1}')
    assert grade.fingerprint(submission, course_root, settings) != first


# --------------------------------------------------------------------------------------
# What feedback may say
# --------------------------------------------------------------------------------------

TEST_SOURCE = '''"""split_heads: shapes and values."""
from attention_lab.checks.mha_shapes import check_split_heads

check_split_heads(split_heads)
### BEGIN HIDDEN TESTS
check_split_heads(split_heads, seed=1101, device="cpu")
### END HIDDEN TESTS'''


def error(line: int, evalue: str = "expected [2, 3] got [3, 2]", ename: str = "CheckFailure") -> dict:
    return {"ename": ename, "evalue": evalue,
            "traceback": ["\x1b[0;31m----\x1b[0m", f"Cell \x1b[0;32mIn[12], line {line}\x1b[0m\n      1 x\n",
                          "File /x/checks.py:10, in check_split_heads", f"{ename}: {evalue}"]}


def test_visible_check_failure_shows_its_message():
    assert feedback.explain(error(4), TEST_SOURCE) == "CheckFailure: expected [2, 3] got [3, 2]"


def test_hidden_failure_says_so_and_nothing_more():
    text = feedback.explain(error(6, evalue="seed=1101 device cpu mismatch"), TEST_SOURCE)
    assert "hidden tests" in text and "1101" not in text and "CheckFailure" not in text


def test_message_quoting_hidden_code_is_withheld():
    text = feedback.explain(error(4, evalue='check_split_heads(split_heads, seed=1101, device="cpu")'), TEST_SOURCE)
    assert "withheld" in text and "1101" not in text


def test_grader_reasons_are_explained():
    assert "time limit" in feedback.explain(error(4, ename="CellTimeoutError", evalue=""), TEST_SOURCE)
    assert "out of memory" in feedback.explain(error(4, ename="MemoryError", evalue=""), TEST_SOURCE)
    skipped = feedback.explain({"ename": "GraderSkippedCell", "evalue": "this cell stopped the kernel"}, TEST_SOURCE)
    assert skipped == "Not run: this cell stopped the kernel."


def test_render_escapes_and_totals():
    rows = [{"grade_id": "test_a", "checks": "<b>a</b>", "score": 1.0, "max_score": 2.0, "passed": False,
             "message": "<script>x</script>"},
            {"grade_id": "test_b", "checks": "b", "score": 3.0, "max_score": 3.0, "passed": True, "message": ""}]
    page = feedback.render("Zoë", "01", "01", rows, [])
    assert "<script>" not in page and "&lt;script&gt;" in page and "4 / 5" in page and "Zoë" in page


# --------------------------------------------------------------------------------------
# The engines: one long-lived nbgrader process per job, a new kernel per notebook
# --------------------------------------------------------------------------------------

TINY = "00_tiny"


def tiny_notebook(answer: str):
    """A one-exercise nbgrader notebook (no torch: fast): ``answer`` must define ``value = 42``."""
    def nbgrader(grade_id, **flags):
        return {"nbgrader": {"grade_id": grade_id, "schema_version": 3, "task": False, "grade": False,
                             "solution": False, "locked": False, **flags}}

    return nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(answer, metadata=nbgrader("answer", solution=True)),
        nbformat.v4.new_code_cell("import builtins\n"
                                  "assert not hasattr(builtins, 'left_by_another_student')\n"
                                  "builtins.left_by_another_student = True\n"
                                  "assert value == 42", metadata=nbgrader("test_value", grade=True, locked=True, points=1)),
    ], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})


@pytest.fixture
def tiny_class(tmp_path):
    """A course root with the tiny assignment and a few students (``{student: answer}`` to fill)."""
    root = tmp_path / "autograder"
    (root / "source" / TINY).mkdir(parents=True)
    nbformat.write(tiny_notebook("### BEGIN SOLUTION\nvalue = 42\n### END SOLUTION"),
                   str(root / "source" / TINY / f"{TINY}.ipynb"))

    def submit(answers: dict[str, str]):
        for student, answer in answers.items():
            folder = root / "submitted" / student / TINY
            folder.mkdir(parents=True)
            nbformat.write(tiny_notebook(answer), str(folder / f"{TINY}.ipynb"))
        return root

    return submit


@pytest.fixture
def engine_starts(monkeypatch):
    """The pid of every engine process the pipeline starts."""
    pids: list[int] = []
    start = grade.Engine._start

    def counted(self):
        start(self)
        pids.append(self.process.pid)

    monkeypatch.setattr(grade.Engine, "_start", counted)
    return pids


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


@pytest.mark.slow
def test_one_engine_grades_a_job_students_each_in_a_fresh_kernel(tiny_class, engine_starts):
    root = tiny_class({"ann": "value = 42", "bob": "value = 41", "cy": "value = 42", "dee": "value = 42"})
    outcomes = grade.grade(root, jobs=1, settings=grade.Settings(timeout=30), log=lambda *_: None)
    # A kernel shared between students would fail the second one's test (the builtins marker).
    assert {o.student: o.score for o in outcomes} == {"ann": 1.0, "bob": 0.0, "cy": 1.0, "dee": 1.0}
    assert len(engine_starts) == 1, "the job's engine should grade all four students"
    assert processes_running("-m", "autograder.worker", parent=os.getpid()) == [], "the engine outlived the run"


@pytest.mark.slow
def test_engine_past_the_notebook_timeout_is_replaced_and_the_class_goes_on(tiny_class, engine_starts):
    root = tiny_class({"ann": "import time\ntime.sleep(600)\nvalue = 42", "bob": "value = 42"})
    settings = grade.Settings(timeout=300, notebook_timeout=15, attempts=2)
    outcomes = {o.student: o for o in grade.grade(root, jobs=1, settings=settings, log=lambda *_: None)}
    assert outcomes["ann"].status == "graded" and outcomes["ann"].score == 0.0
    assert [i["kind"] for i in outcomes["ann"].incidents] == ["notebook_timeout"]
    assert outcomes["bob"].score == 1.0
    assert len(engine_starts) == 2, "the killed engine should be replaced by exactly one new one"
    assert processes_running("-m", "autograder.worker", parent=os.getpid()) == []


@pytest.mark.slow
@pytest.mark.parametrize("isolation, seconds", [("auto", "4171"), ("off", "4172")])
def test_processes_a_student_detaches_do_not_outlive_their_grading(tiny_class, isolation, seconds):
    """Under bubblewrap the sandbox's end takes them; without it the engine adopts and kills them."""
    root = tiny_class({"ann": f"import subprocess\nsubprocess.Popen(['sleep', '{seconds}'], start_new_session=True)\n"
                              "value = 42"})
    outcomes = grade.grade(root, jobs=1, settings=grade.Settings(timeout=30, sandbox=isolation), log=lambda *_: None)
    assert [o.score for o in outcomes] == [1.0]
    assert processes_running("sleep", seconds) == [], "a process the student started is still running"
