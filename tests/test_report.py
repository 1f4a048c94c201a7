"""The class report on a generated class with known mistakes: it counts them exactly.

The class: notebook 01's gradebook (``nbgrader generate_assignment``), and per student an
autograded notebook whose failed test cells carry the messages the real checks give for
known wrong answers (no kernel: the checks run here, on the wrong functions).
"""

from __future__ import annotations

import json

import nbformat
import pytest

from attention_lab.checks.mha_shapes import check_merge_heads, check_split_heads
from autograder.reports import class_report as report
from autograder.store import gradebook
from autograder.store.nbgrader_cli import run_nbgrader
from autograder.places import REPO_ROOT
from autograder.publishing.release import build_source, course_repository, write_notebook

ASSIGNMENT = "01_mha_shapes"


def reshape_only(x, num_heads):
    batch, seq, width = x.shape
    return x.reshape(batch, num_heads, seq, width // num_heads)


def view_no_permute(x, num_heads):
    batch, seq, width = x.shape
    return x.view(batch, seq, num_heads, width // num_heads)


def merge_reshape_only(x):
    batch, heads, seq, d_head = x.shape
    return x.reshape(batch, seq, heads * d_head)


def failure(check, answer) -> str:
    try:
        check(answer)
    except Exception as error:  # the check's CheckFailure: its message is what the cell shows
        return str(error)
    raise AssertionError(f"{check.__name__} accepted {answer.__name__}")


# student -> {test grade_id: wrong answer's message}
MISTAKES = {
    "s01": {"test_split_heads": (check_split_heads, reshape_only)},
    "s02": {"test_split_heads": (check_split_heads, reshape_only)},
    "s03": {"test_split_heads": (check_split_heads, reshape_only)},
    "s04": {"test_split_heads": (check_split_heads, view_no_permute)},
    "s05": {"test_split_heads": (check_split_heads, view_no_permute)},
    "s06": {"test_split_heads": (check_split_heads, reshape_only),
            "test_merge_heads": (check_merge_heads, merge_reshape_only)},
    "s07": {}, "s08": {}, "s09": {},
}
HAND_GRADED = {"s01": 1.0, "s02": 0.0, "s03": 1.0}   # why_contiguous; the others wait for a grader


def own_answer(student: str) -> str:
    """split_heads written in the student's own way: the code differs from everyone else's."""
    lines = [f"    step_{student}_{n} = 'note {n} of {student}'" for n in range(20)]
    return "def split_heads(x, num_heads):\n" + "\n".join(lines) + (
        "\n    batch, seq, width = x.shape\n    return x.view(batch, seq, num_heads, width // num_heads).transpose(1, 2)\n")


def executed_notebook(student: str) -> nbformat.NotebookNode:
    notebook = nbformat.read(REPO_ROOT / "course" / f"{ASSIGNMENT}.ipynb", as_version=4)
    copied = {"s08": "s07", "s09": "s07"}.get(student, student)
    for cell in notebook.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("grade_id") == "split_heads":
            cell.source = own_answer(copied)
            if student == "s09":  # the same code, comments and blank lines added
                cell.source = "# my own work\n" + cell.source.replace("\n    batch", "\n\n    # shapes\n    batch")
        if meta.get("grade_id") in MISTAKES[student]:
            check, answer = MISTAKES[student][meta["grade_id"]]
            cell.outputs = [nbformat.v4.new_output("error", ename="CheckFailure", evalue=failure(check, answer),
                                                   traceback=["CheckFailure: ..."])]
    return notebook


@pytest.fixture(scope="module")
def generated_class(tmp_path_factory):
    root = tmp_path_factory.mktemp("class-report") / "course_root"
    write_notebook(build_source(ASSIGNMENT, course_repository()), root / "source" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb")
    run_nbgrader("generate_assignment", ASSIGNMENT, "--force", "--log-level=ERROR", root=root, capture=True)
    with gradebook.open_gradebook(root) as gb:
        for student, mistakes in MISTAKES.items():
            gb.update_or_create_student(student)
            submission = gb.add_submission(ASSIGNMENT, student)
            for grade in submission.notebooks[0].grades:
                if grade.cell.cell_type == "markdown":
                    grade.manual_score = HAND_GRADED.get(student)
                    grade.needs_manual_grade = student not in HAND_GRADED
                else:
                    grade.auto_score = 0.0 if grade.name in mistakes else grade.max_score
                    grade.needs_manual_grade = False
            gb.db.commit()
            folder = root / "autograded" / student / ASSIGNMENT
            folder.mkdir(parents=True)
            nbformat.write(executed_notebook(student), str(folder / f"{ASSIGNMENT}.ipynb"))
            incidents = ([{"kind": "timeout", "notebook": ASSIGNMENT, "cell": 9, "grade_id": "merge_heads"}]
                         if student == "s05" else [])
            (folder / ".grading.json").write_text(json.dumps({"incidents": incidents}))
    (root / "reports").mkdir()
    (root / "reports" / "grading_report.json").write_text(json.dumps({"submissions": [
        {"student": "s10", "assignment": ASSIGNMENT, "status": "failed", "error": "gave up after 6 attempts\nlog",
         "incidents": [{"kind": "kernel_died", "notebook": ASSIGNMENT, "cell": 7, "grade_id": "split_heads"}]}]}))
    for student in ("s10", "s11"):
        folder = root / "submitted" / student / ASSIGNMENT
        folder.mkdir(parents=True)
        (folder / f"{ASSIGNMENT}.ipynb").write_text("{}")
    return root


@pytest.fixture(scope="module")
def written(generated_class):
    (page,) = report.write_reports(generated_class)
    return page, json.loads((page.parent / "report.json").read_text())


def test_the_report_counts_the_mistakes_by_name_exactly(written):
    _, data = written
    mistakes = {m["hint"]: m["students"] for m in data["mistakes"]}
    assert mistakes == {"mha_shapes.split_heads/reshape_only": 4, "mha_shapes.split_heads/view_no_permute": 2,
                        "mha_shapes.merge_heads/reshape_only": 1}
    assert [m["hint"] for m in data["mistakes"]][0] == "mha_shapes.split_heads/reshape_only"  # most frequent first
    assert data["failing_tests"] == [{"grade_id": "test_split_heads", "students": 6},
                                     {"grade_id": "test_merge_heads", "students": 1}]


def test_question_statistics_and_incomplete_totals(written):
    _, data = written
    questions = {q["grade_id"]: q for q in data["questions"]}
    split = questions["test_split_heads"]
    assert (split["graded"], split["full"], split["zero"], split["mean"], split["median"]) == (9, 3, 6, 0.6667, 0.0)
    assert split["discrimination"] == 1.0           # the top 27 % all have it, the bottom 27 % none
    assert questions["test_attention_weights"]["discrimination"] == 0.0   # everyone has it
    written_answer = questions["why_contiguous"]
    assert (written_answer["graded"], written_answer["pending"], written_answer["written"]) == (3, 6, True)
    assert data["total"]["incomplete"] == 6 and data["students"] == 9


def test_similar_submissions_are_flagged_and_only_those(written):
    _, data = written
    assert [(p["students"], p["identical"]) for p in data["similar"]] == [
        (["s07", "s08"], True), (["s07", "s09"], True), (["s08", "s09"], True)]


def test_not_graded_and_incidents_say_why(written):
    _, data = written
    why = {row["student"]: row["why"] for row in data["not_graded"]}
    assert why["s10"].startswith("gave up after 6 attempts") and "stopped the kernel" in why["s10"]
    assert "make grade" in why["s11"]
    assert [r["student"] for r in data["incidents"]] == ["s05"] and "time limit" in data["incidents"][0]["incident"]


def test_the_page_names_the_mistakes_and_is_deterministic(written, generated_class):
    page, _ = written
    text = page.read_text()
    assert "mha_shapes.split_heads/reshape_only" in text and "reshape reads memory in order" in text
    assert "figures/scores.png" in text and (page.parent / "figures" / "questions.png").exists()
    before = {p: p.read_bytes() for p in page.parent.rglob("*") if p.is_file()}
    report.write_reports(generated_class)
    assert {p: p.read_bytes() for p in page.parent.rglob("*") if p.is_file()} == before


def test_correct_submissions_are_not_flagged_for_sharing_the_model_solution(generated_class):
    """Correct answers converge on the model solution (95-100 % alike whole): only what students
    wrote beyond the release and the model is compared."""
    source = nbformat.read(generated_class / "source" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb", as_version=4)
    models = {c.metadata["nbgrader"]["grade_id"]: c.source for c in source.cells
              if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("solution")}
    given = report.given_code(generated_class, ASSIGNMENT)

    def solved(student: str) -> nbformat.NotebookNode:
        notebook = nbformat.read(REPO_ROOT / "course" / f"{ASSIGNMENT}.ipynb", as_version=4)
        for cell in notebook.cells:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            if grade_id in models:
                cell.source = models[grade_id].replace("### BEGIN SOLUTION", f"# {student}'s answer")
        return notebook

    whole = sum((report.code_tokens(m) for m in models.values()), [])
    assert len(whole) >= report.MIN_ANSWER_TOKENS   # compared whole, they would be flagged as identical
    students = [report.Student(s, 1.0, 1.0, False, answer_tokens=report.answer_tokens(solved(s), given))
                for s in ("c1", "c2", "c3")]
    assert report.similar_pairs(students) == []
    # the model plus the same long code of their own: still a pair to look at
    for student in students[:2]:
        student.answer_tokens += report.code_tokens(own_answer("shared"))
    assert [p["students"] for p in report.similar_pairs(students)] == [["c1", "c2"]]
