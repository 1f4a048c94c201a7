"""`make lab` serves the course to students: Validate and widgets on, instructor tools off,
and a course notebook saved by JupyterLab is byte for byte the committed release."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import platform
import shutil
import urllib.error
import urllib.parse
import urllib.request
import warnings

import nbformat
import pytest
from jupyter_server.services.contents.filemanager import FileContentsManager
from traitlets.config.loader import load_pyconfig_files

from autograder.lab import validate
from autograder.lab.course_notebooks import CourseContentsManager, is_course_notebook, keep_course_notebooks_clean
from tests.conftest import ASSIGNMENTS, REPO_ROOT
from tests.lab_servers import TOKEN, copy_course, http_get, running_lab


# One thread for every coroutine of these tests: the contents manager's checkpoint database
# (SQLite) must be used by the thread that opened it.
_APART = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-lab-asyncio")


def run_apart(coroutine):
    """``asyncio.run`` in a thread of its own: in a test worker where the session's Playwright
    browser is running, the main thread already has a running event loop."""
    return _APART.submit(asyncio.run, coroutine).result()

# What a JupyterLab front end sends back after opening a course notebook and running it:
# the kernel's own language_info and kernelspec, outputs, counts, and view state.
KERNEL_METADATA = {
    "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
    "language_info": {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
                      "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
                      "pygments_lexer": "ipython3", "version": "3.11.2"},
    "widgets": {"application/vnd.jupyter.widget-state+json": {"state": {}, "version_major": 2, "version_minor": 0}},
}


def _as_run_in_jupyterlab(notebook: dict) -> dict:
    notebook = copy.deepcopy(notebook)
    notebook["metadata"] = copy.deepcopy(KERNEL_METADATA)
    for count, cell in enumerate(notebook["cells"], start=1):
        if cell["cell_type"] == "code":
            cell["execution_count"] = count
            cell["outputs"] = [{"name": "stdout", "output_type": "stream", "text": ["shape [2, 4, 6, 8]\n"]}]
            cell["metadata"].update({"execution": {"iopub.status.idle": "2026-11-23T03:00:00.000Z"}, "scrolled": True})
    return notebook


def _student_contents_manager(root) -> FileContentsManager:
    """jupyter_server's own contents manager, configured by the student lab's config file."""
    config = load_pyconfig_files(["jupyter_server_config.py"], str(REPO_ROOT / "autograder" / "lab" / "student"))
    assert config.FileContentsManager.pre_save_hook is keep_course_notebooks_clean
    with warnings.catch_warnings():  # traitlets validates the configured hook twice and warns about it
        warnings.filterwarnings("ignore", message="Overriding existing pre_save_hook")
        return FileContentsManager(root_dir=str(root), config=config)


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_jupyterlab_saving_an_opened_and_run_course_notebook_leaves_its_bytes_unchanged(assignment, tmp_path):
    committed = REPO_ROOT / "course" / f"{assignment}.ipynb"
    shutil.copy(committed, tmp_path / committed.name)
    contents = _student_contents_manager(tmp_path)
    model = contents.get(committed.name)
    model["content"] = _as_run_in_jupyterlab(json.loads(json.dumps(model["content"])))
    contents.save(model, committed.name)
    assert (tmp_path / committed.name).read_bytes() == committed.read_bytes()


def test_a_students_own_work_is_saved_and_their_own_notebooks_keep_their_outputs(tmp_path):
    committed = REPO_ROOT / "course" / "01_mha_shapes.ipynb"
    shutil.copy(committed, tmp_path / committed.name)
    contents = _student_contents_manager(tmp_path)
    notebook = _as_run_in_jupyterlab(json.loads(json.dumps(contents.get(committed.name)["content"])))
    answer = next(c for c in notebook["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == "split_heads")
    answer["source"] = "def split_heads(x, num_heads):\n    return x  # my attempt"
    notebook["cells"].append(nbformat.v4.new_code_cell("my_own_experiment = 1"))
    contents.save({"type": "notebook", "format": "json", "content": notebook}, committed.name)
    saved = nbformat.read(tmp_path / committed.name, as_version=4)
    assert any(cell.source.endswith("# my attempt") for cell in saved.cells)
    assert saved.cells[-1].source == "my_own_experiment = 1"
    assert all(cell.outputs == [] for cell in saved.cells if cell.cell_type == "code")

    (tmp_path / "notes").mkdir()
    contents.save({"type": "notebook", "format": "json", "content": _as_run_in_jupyterlab(notebook)}, "notes/mine.ipynb")
    mine = nbformat.read(tmp_path / "notes" / "mine.ipynb", as_version=4)
    assert mine.metadata.language_info.version == "3.11.2"
    assert any(cell.outputs for cell in mine.cells if cell.cell_type == "code")


def test_only_the_course_notebooks_at_the_top_are_course_notebooks():
    assert is_course_notebook("01_mha_shapes.ipynb") and is_course_notebook("/05_llama_attention.ipynb")
    assert not is_course_notebook("notes/01_mha_shapes.ipynb")
    assert not is_course_notebook("Untitled.ipynb") and not is_course_notebook("01_mha_shapes-Copy1.ipynb")


@pytest.fixture(scope="module")
def student_lab(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("student-lab")
    with running_lab("lab", copy_course(scratch / "course"), scratch) as server:
        yield server


def _validate(server, path: str) -> dict:
    request = urllib.request.Request(server.url("assignments/validate"),
                                     data=urllib.parse.urlencode({"path": path}).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read().decode())


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.slow
def test_lab_serves_the_course_with_validate_and_widgets_and_no_instructor_tools(student_lab):
    names = {item["name"] for item in student_lab.api("contents")["content"]}
    assert "01_mha_shapes.ipynb" in names
    page = http_get(student_lab.url("lab"))
    assert "@jupyter/nbgrader" in page, "nbgrader's lab extension (Validate button) is not loaded"
    assert "@jupyter-widgets/jupyterlab-manager" in page, "the ipywidgets extension is not loaded"
    for plugin in ("formgrader", "create-assignment", "assignment-list", "course-list", "menu"):
        assert f'"@jupyter/nbgrader:{plugin}"' in page.split('"disabledExtensions"')[1].split("]")[0], plugin
    assert _status(student_lab.url("formgrader")) == 404, "Formgrader's server extension runs in the student lab"
    assert _status(student_lab.url("courses")) == 404, "the exchange's course list runs in the student lab"


@pytest.mark.slow
def test_validate_button_reports_the_blanks_and_passes_a_solved_notebook(student_lab, fresh_build):
    blank = _validate(student_lab, "01_mha_shapes.ipynb")
    assert blank["success"] is True  # the request worked; the notebook's verdict is inside
    assert "failed" in blank["value"] or "NotImplementedError" in json.dumps(blank["value"])
    shutil.copy(fresh_build.source("01_mha_shapes"), student_lab.root_dir / "solved.ipynb")
    solved = _validate(student_lab, "solved.ipynb")
    assert solved["success"] is True
    assert "failed" not in solved["value"] and "NotImplementedError" not in json.dumps(solved["value"]), solved


def test_a_course_notebook_is_served_with_its_kernels_metadata_and_saved_with_the_courses(tmp_path):
    """Opening is not editing: JupyterLab finds in the notebook exactly the kernelspec and
    language_info the starting kernel reports (so it marks nothing modified); on save the
    course's metadata goes back, so the file keeps its bytes."""
    committed = REPO_ROOT / "course" / "01_mha_shapes.ipynb"
    shutil.copy(committed, tmp_path / committed.name)
    config = load_pyconfig_files(["jupyter_server_config.py"], str(REPO_ROOT / "autograder" / "lab" / "student"))
    assert config.ServerApp.contents_manager_class is CourseContentsManager
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Overriding existing pre_save_hook")
        contents = CourseContentsManager(root_dir=str(tmp_path), config=config)
    model = run_apart(contents.get(committed.name))
    served = model["content"]["metadata"]
    assert served["kernelspec"] == {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    assert served["language_info"]["version"] == platform.python_version()
    assert served["language_info"]["codemirror_mode"] == {"name": "ipython", "version": 3}
    run_apart(contents.save(model, committed.name))
    assert (tmp_path / committed.name).read_bytes() == committed.read_bytes()

    # a student's own notebook is served as it is
    OTHER_KERNEL = {"name": "other", "display_name": "Other", "language": "other"}
    nbformat.write(nbformat.v4.new_notebook(metadata={"kernelspec": OTHER_KERNEL}), tmp_path / "mine.ipynb")
    assert run_apart(contents.get("mine.ipynb"))["content"]["metadata"] == {"kernelspec": OTHER_KERNEL}
    # packaging artefacts of `make setup` are not in the student's file browser
    (tmp_path / "attention_lab.egg-info").mkdir()
    listed = {item["name"] for item in run_apart(contents.get(""))["content"]}
    assert "attention_lab.egg-info" not in listed and committed.name in listed


def test_a_failed_cell_in_validate_shows_the_checks_message_before_what_the_code_printed():
    outputs = [{"output_type": "stream", "name": "stderr",
                "text": "<cell>:3: RuntimeWarning: overflow encountered in matmul\n" * 30},
               {"output_type": "stream", "name": "stdout", "text": "debug print\n"},
               {"output_type": "error", "ename": "CheckFailure", "evalue": "x",
                "traceback": ["CheckFailure: attention_weights(q, k) should sum to 1 over keys",
                              "  likely mistake: softmax over the wrong axis"]}]
    text = validate.failure_text(outputs)
    assert text.startswith("CheckFailure: attention_weights(q, k) should sum to 1"), text
    assert "likely mistake: softmax over the wrong axis" in text
    assert text.index("likely mistake") < text.index("RuntimeWarning")  # the message first
    assert "RuntimeWarning: overflow encountered in matmul" in text       # the warning kept, after it
    assert len(text.splitlines()) < 20, text                             # and cut short
    assert "debug print" not in text


@pytest.mark.slow
def test_validate_that_cannot_finish_is_stopped_and_names_the_cell_still_running(tmp_path):
    """A notebook whose cell never ends: Validate answers within its (load-stretched) limit,
    with that cell, and leaves no kernel behind."""
    import psutil

    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_code_cell("import time\nwhile True:  # never ends\n    time.sleep(0.1)"),
        nbformat.v4.new_code_cell("y = 2"),
    ], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nbformat.write(notebook, tmp_path / "endless.ipynb")
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    answer = run_apart(validate.validate_notebook(tmp_path / "endless.ipynb", base_seconds=3))
    assert answer["success"] is True, answer
    failed = answer["value"]["failed"]
    assert len(failed) == 1 and "while True" in failed[0]["source"], failed
    assert "Validate stopped after" in failed[0]["raw_error"] and "cell 2" in failed[0]["raw_error"], failed
    left = [child for child in psutil.Process().children(recursive=True) if child.pid not in before]
    assert not [child for child in left if child.is_running() and child.status() != psutil.STATUS_ZOMBIE], left


@pytest.mark.slow
def test_validate_runs_beside_the_server_not_inside_it(student_lab):
    """The lab answers while a notebook validates (nbgrader's own handler blocks the server)."""
    import threading

    result = {}
    worker = threading.Thread(target=lambda: result.update(_validate(student_lab, "01_mha_shapes.ipynb")))
    worker.start()
    answered_meanwhile = 0
    while worker.is_alive():
        student_lab.api("status")  # raises (timeout 30 s) if the server is blocked
        answered_meanwhile += 1
        worker.join(timeout=0.5)
    assert result.get("success") is True, result
    assert answered_meanwhile >= 2, "the validation ended before the server could be asked anything"


def test_validate_names_the_written_question_left_blank():
    """nbgrader says "You did not provide a response" under YOUR ANSWER HERE, naming no question: 01 and 03 have
    several written answers (issue #34). Each blank one is named by its exercise's header."""
    named = {}
    for assignment in ASSIGNMENTS:
        notebook = nbformat.read(REPO_ROOT / "course" / f"{assignment}.ipynb", as_version=4)
        written = [index for index, cell in enumerate(notebook.cells)
                   if cell.cell_type == "markdown" and cell.metadata.get("nbgrader", {}).get("solution")]
        questions = [validate.written_question(notebook.cells, index) for index in written]
        assert written and all(q and q.startswith("Exercise ") for q in questions), questions
        assert len(set(questions)) == len(questions), questions  # each names its own question
        assert not any("pts" in q or "min)" in q for q in questions), questions  # the heading, not its points
        named[assignment] = questions
    assert named["01_mha_shapes"] == ["Exercise 1.2 — merge_heads, its written question"], named
    assert len(named["03_positions_and_blocks"]) == 2, named


@pytest.mark.slow
def test_validate_dialog_says_which_written_answer_is_missing(tmp_path):
    from nbgrader.utils import compute_checksum

    answer = nbformat.v4.new_markdown_cell("YOUR ANSWER HERE", metadata={"nbgrader": {
        "grade": True, "solution": True, "locked": False, "grade_id": "why", "points": 1, "schema_version": 3}})
    answer.metadata["nbgrader"]["checksum"] = compute_checksum(answer)
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("### Exercise 9.2 — why a view cannot be reshaped, a written answer (1 pt, ~3 min)"),
        answer,
    ], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nbformat.write(notebook, tmp_path / "written.ipynb")
    result = run_apart(validate.validate_notebook(tmp_path / "written.ipynb", base_seconds=120))
    failed = result["value"]["failed"]
    assert len(failed) == 1 and failed[0]["raw_error"] == validate.unanswered_text(
        "Exercise 9.2 — why a view cannot be reshaped, a written answer"), failed
