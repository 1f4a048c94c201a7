"""Intake: names students produce, stripped metadata, bad files -- no kernels, fast."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import nbformat
import pytest

from autograder.term import intake, intake_files
from autograder.publishing.release import REPO_ROOT

ASSIGNMENT = "01_mha_shapes"
ASSIGNMENTS = ["01_mha_shapes", "02_numpy_walkthrough", "03_masks_and_causality"]


def release():
    return nbformat.read(REPO_ROOT / "course" / f"{ASSIGNMENT}.ipynb", as_version=4)


def grade_ids(notebook) -> list[str]:
    return [c.metadata["nbgrader"]["grade_id"] for c in notebook.cells if "nbgrader" in c.metadata]


def run(tmp_path: Path, files: dict[str, object]):
    downloads, root = tmp_path / "downloads", tmp_path / "autograder"
    for name, content in files.items():
        path = downloads / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, (bytes, str)):
            path.write_bytes(content.encode() if isinstance(content, str) else content)
        else:
            nbformat.write(content, str(path))
    before = {p: p.read_bytes() for p in downloads.rglob("*") if p.is_file()}
    entries = intake.intake(downloads, root, REPO_ROOT / "course", assignments=[ASSIGNMENT])
    assert {p: p.read_bytes() for p in downloads.rglob("*") if p.is_file()} == before  # originals untouched
    return {e.source: e for e in entries}, root


@pytest.mark.parametrize("name", [
    "01_mha_shapes.ipynb", "Copy of 01_mha_shapes.ipynb", "01_mha_shapes (1).ipynb", "01_MHA_Shapes.ipynb",
    "Copy of 01_mha_shapes (3).ipynb", "01 mha shapes.ipynb", "01_mha_shapes copy.ipynb", "01_mha_shapes-2.ipynb",
])
def test_names_students_produce(name):
    assert intake.assignment_from_name(name, ASSIGNMENTS) == ASSIGNMENT


@pytest.mark.parametrize("name", ["homework.ipynb", "mha.ipynb", "04_something.ipynb"])
def test_names_that_say_nothing(name):
    assert intake.assignment_from_name(name, ASSIGNMENTS) is None


def test_student_ids_with_spaces_and_accents_are_kept():
    assert intake.clean_student_id(" Zoë Ångström ") == ("Zoë Ångström", None)
    assert intake.clean_student_id("e\u0301mile")[0] == "\u00e9mile"  # NFC, as macOS writes it
    student, problem = intake.clean_student_id("bad*name")
    assert student is None and "cannot use" in problem


def test_accepted_notebook_is_placed_where_nbgrader_looks(tmp_path):
    entries, root = run(tmp_path, {"Ana María/Copy of 01_mha_shapes.ipynb": release()})
    entry = entries["Ana María/Copy of 01_mha_shapes.ipynb"]
    assert entry.status == "accepted"
    placed = root / "submitted" / "Ana María" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
    assert grade_ids(nbformat.read(placed, as_version=4)) == grade_ids(release())


def test_stripped_metadata_is_repaired(tmp_path):
    stripped = release()
    for cell in stripped.cells:
        cell.metadata = {"colab": {"id": "x"}}
    entries, root = run(tmp_path, {"bo/01_mha_shapes.ipynb": stripped})
    assert entries["bo/01_mha_shapes.ipynb"].status == "repaired"
    placed = nbformat.read(root / "submitted" / "bo" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb", as_version=4)
    assert grade_ids(placed) == grade_ids(release())
    points = {c.metadata["nbgrader"]["grade_id"]: c.metadata["nbgrader"].get("points") for c in placed.cells
              if "nbgrader" in c.metadata}
    assert points["test_split_heads"] == 2


def test_edited_test_cell_without_metadata_is_found_by_its_first_line(tmp_path):
    notebook = release()
    for cell in notebook.cells:
        cell.metadata = {}
    test = next(c for c in notebook.cells if c.source.startswith('"""merge_heads'))
    test.source += "\nprint('I changed this')"
    entries, root = run(tmp_path, {"cy/01_mha_shapes.ipynb": notebook})
    assert entries["cy/01_mha_shapes.ipynb"].status == "repaired"
    placed = nbformat.read(root / "submitted" / "cy" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb", as_version=4)
    assert grade_ids(placed) == grade_ids(release())


def test_deleted_test_cell_is_put_back_in_place(tmp_path):
    notebook = release()
    index = next(i for i, c in enumerate(notebook.cells) if c.metadata.get("nbgrader", {}).get("grade_id") == "test_merge_heads")
    del notebook.cells[index]
    entries, root = run(tmp_path, {"di/01_mha_shapes.ipynb": notebook})
    assert any("put back the deleted cell 'test_merge_heads'" in r for r in entries["di/01_mha_shapes.ipynb"].reasons)
    placed = nbformat.read(root / "submitted" / "di" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb", as_version=4)
    assert grade_ids(placed) == grade_ids(release())
    assert placed.cells[index].metadata["nbgrader"]["grade_id"] == "test_merge_heads"


def test_ambiguous_stripped_notebook_is_refused(tmp_path):
    notebook = release()
    for cell in notebook.cells:
        cell.metadata = {}
    test = next(c for c in notebook.cells if c.source.startswith('"""merge_heads'))
    twin = copy.deepcopy(test)
    twin.id = "my-copy-of-the-test"  # JupyterLab gives a copied cell an id of its own
    twin.source += "\n# my own copy"
    test.source += "\n# edited"
    notebook.cells.insert(notebook.cells.index(test) + 1, twin)
    entries, root = run(tmp_path, {"ed/01_mha_shapes.ipynb": notebook})
    entry = entries["ed/01_mha_shapes.ipynb"]
    assert entry.status == "refused" and "cannot tell which cell is 'test_merge_heads'" in " ".join(entry.reasons)
    assert not (root / "submitted" / "ed").exists()


def test_bad_files_are_refused_with_reasons(tmp_path):
    foreign = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('my own project, nothing to do with attention')")])
    entries, root = run(tmp_path, {
        "fa/01_mha_shapes.ipynb": '{"cells": [',
        "fa/Copy of 01_mha_shapes.ipynb": "",
        "fa/answers.docx": b"PK\x03\x04",
        "fa/other.ipynb": json.dumps({"hello": 1}),
        "ga/01_mha_shapes.ipynb": foreign,
        "loose.ipynb": release(),
    })
    reasons = {k: " ".join(e.reasons) for k, e in entries.items()}
    assert all(e.status == "refused" for e in entries.values())
    assert "not valid JSON" in reasons["fa/01_mha_shapes.ipynb"]
    assert "empty file" in reasons["fa/Copy of 01_mha_shapes.ipynb"]
    assert "unknown file" in reasons["fa/answers.docx"]
    assert "not a Jupyter notebook" in reasons["fa/other.ipynb"]
    assert "not those of any notebook" in reasons["ga/01_mha_shapes.ipynb"]
    assert "not inside a student folder" in reasons["loose.ipynb"]
    assert not (root / "submitted").exists()


def test_notebook_of_another_assignment_is_refused(tmp_path, monkeypatch):
    # a second assignment whose release is notebook 01 with other first lines
    other = release()
    for cell in other.cells:
        cell.source = "OTHER " + cell.source
        for key in ("nbgrader",):
            if key in cell.metadata:
                cell.metadata[key]["grade_id"] = "x_" + cell.metadata[key]["grade_id"]
    course = tmp_path / "course"
    course.mkdir()
    nbformat.write(release(), str(course / f"{ASSIGNMENT}.ipynb"))
    nbformat.write(other, str(course / "02_numpy_walkthrough.ipynb"))
    downloads = tmp_path / "downloads" / "ha"
    downloads.mkdir(parents=True)
    nbformat.write(other, str(downloads / "01_mha_shapes.ipynb"))
    entries = intake.intake(tmp_path / "downloads", tmp_path / "autograder", course,
                            assignments=[ASSIGNMENT, "02_numpy_walkthrough"])
    (entry,) = entries
    assert entry.status == "refused"
    assert "named like 01_mha_shapes but its cells are those of 02_numpy_walkthrough" in " ".join(entry.reasons)


def test_unnamed_notebook_is_recognised_by_content_and_newest_wins(tmp_path):
    old, new = release(), release()
    new.cells[-1].source += "\n"  # a different file
    folder = tmp_path / "downloads" / "jo"
    folder.mkdir(parents=True)
    nbformat.write(old, str(folder / "01_mha_shapes (2).ipynb"))
    nbformat.write(new, str(folder / "homework.ipynb"))
    os.utime(folder / "01_mha_shapes (2).ipynb", (1_000_000, 1_000_000))
    entries = {e.source: e for e in intake.intake(tmp_path / "downloads", tmp_path / "autograder",
                                                  REPO_ROOT / "course", assignments=[ASSIGNMENT])}
    assert entries["jo/homework.ipynb"].status == "accepted"
    assert "recognised by its content" in " ".join(entries["jo/homework.ipynb"].reasons)
    assert entries["jo/01_mha_shapes (2).ipynb"].status == "refused"
    assert "superseded by the newer file" in " ".join(entries["jo/01_mha_shapes (2).ipynb"].reasons)


def test_reintake_is_unchanged_and_report_is_written(tmp_path):
    files = {"ki/01_mha_shapes.ipynb": release()}
    run(tmp_path, files)
    entries = intake.intake(tmp_path / "downloads", tmp_path / "autograder", REPO_ROOT / "course", assignments=[ASSIGNMENT])
    assert "already in place, unchanged" in entries[0].reasons
    report = intake.write_report(entries, tmp_path / "autograder", tmp_path / "downloads")
    assert "ki/01_mha_shapes.ipynb" in report.read_text()
    assert json.loads((report.parent / "intake_report.json").read_text())["files"][0]["status"] == "accepted"


def test_links_are_refused_never_followed(tmp_path):
    """A link restored by unzipping an archive could point at the course's own notebooks
    (the model solution): it is refused, a linked file and a linked folder alike."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    nbformat.write(release(), str(elsewhere / f"{ASSIGNMENT}.ipynb"))
    downloads = tmp_path / "downloads"
    (downloads / "mallory").mkdir(parents=True)
    (downloads / "mallory" / f"{ASSIGNMENT}.ipynb").symlink_to(elsewhere / f"{ASSIGNMENT}.ipynb")
    (downloads / "trudy").symlink_to(elsewhere, target_is_directory=True)
    (downloads / "oscar").mkdir()
    (downloads / "oscar" / "work").symlink_to(elsewhere, target_is_directory=True)
    entries = {e.source: e for e in intake.intake(downloads, tmp_path / "autograder", REPO_ROOT / "course",
                                                  assignments=[ASSIGNMENT])}
    assert set(entries) == {f"mallory/{ASSIGNMENT}.ipynb", "trudy", "oscar/work"}
    for entry in entries.values():
        assert entry.status == "refused" and "links are not followed" in " ".join(entry.reasons), entry
    assert str(elsewhere) in " ".join(entries["trudy"].reasons)
    assert not (tmp_path / "autograder" / "submitted").exists()


def test_a_file_that_breaks_the_reader_is_refused_alone(tmp_path):
    """JSON nested too deeply for Python's parser (a RecursionError) is that file's refusal:
    the other students are filed and the report is written."""
    nested = release()
    nested.cells[0].metadata["deep"] = "PLACEHOLDER"
    text = nbformat.writes(nested).replace('"PLACEHOLDER"', "[" * 100_000 + "]" * 100_000)
    entries, root = run(tmp_path, {"deep/01_mha_shapes.ipynb": text, "fine/01_mha_shapes.ipynb": release()})
    assert entries["fine/01_mha_shapes.ipynb"].status == "accepted"
    deep = entries["deep/01_mha_shapes.ipynb"]
    assert deep.status == "refused" and "nested too deeply" in " ".join(deep.reasons)
    assert (root / "submitted" / "fine").is_dir() and not (root / "submitted" / "deep").exists()
    report = intake.write_report(list(entries.values()), root, tmp_path / "downloads").read_text()
    assert "nested too deeply" in report


def test_a_notebook_over_the_size_limit_is_refused_naming_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(intake_files, "MAX_NOTEBOOK_BYTES", 200_000)
    big = release()
    big.cells[0].metadata["padding"] = "x" * 300_000
    entries, root = run(tmp_path, {"huge/01_mha_shapes.ipynb": big, "fine/01_mha_shapes.ipynb": release()})
    reasons = " ".join(entries["huge/01_mha_shapes.ipynb"].reasons)
    assert entries["huge/01_mha_shapes.ipynb"].status == "refused"
    assert "over the limit of 0.2 MB" in reasons and "MAX_NOTEBOOK_BYTES" in reasons
    assert entries["fine/01_mha_shapes.ipynb"].status == "accepted"


def test_invisible_characters_in_a_student_folder_name_are_removed_with_the_reason(tmp_path):
    """A zero-width space or a right-to-left override makes ``alice`` look like one student and
    file as another: the name is normalised (NFKC, no format characters), and the report says so."""
    entries, root = run(tmp_path, {"alice/01_mha_shapes.ipynb": release(),
                                   "al\u200bice/Copy of 01_mha_shapes.ipynb": release(),
                                   "\u202eb\u200dob/01_mha_shapes.ipynb": release(),
                                   "\uff43arol/01_mha_shapes.ipynb": release()})
    assert sorted(p.name for p in (root / "submitted").iterdir()) == ["alice", "bob", "carol"]
    zero_width = entries["al\u200bice/Copy of 01_mha_shapes.ipynb"]
    assert zero_width.student == "alice" and "U+200B ZERO WIDTH SPACE" in " ".join(zero_width.reasons)
    override = " ".join(entries["\u202eb\u200dob/01_mha_shapes.ipynb"].reasons)
    assert "U+202E RIGHT-TO-LEFT OVERRIDE" in override and "taken as 'bob'" in override
