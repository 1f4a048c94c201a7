"""`make publish`: the students' repository holds the notebooks, the helper package and a README,
its links point at it, and nothing secret is in it (issue #35, item 16) -- no kernels."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile

import nbformat

from autograder.publishing import publish
from autograder.places import REPO_ROOT
from autograder.publishing.release import assignment_names, course_repository
from tests.readme_commands import run_readme_command


def test_make_publish_writes_a_students_repository_with_no_secret(tmp_path):
    dest = tmp_path / "students"
    result = run_readme_command("make publish DEST=../attention-lab-students REPO=myuni/attention-lab-students",
                                replace={"../attention-lab-students": str(dest)}, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in dest.iterdir()) == sorted(publish.WRITTEN)
    assert sorted(p.stem for p in (dest / "course").glob("*.ipynb")) == assignment_names()
    first = nbformat.read(dest / "course" / "01_mha_shapes.ipynb", as_version=4)
    text = json.dumps(first)
    assert "github/myuni/attention-lab-students/blob/main/course/01_mha_shapes.ipynb" in text
    assert 'COURSE_REPOSITORY = \\"myuni/attention-lab-students\\"' in text
    assert course_repository() not in (dest / "README.md").read_text() + text
    assert tomllib.loads((dest / "pyproject.toml").read_text())["tool"]["attention_lab"]["repository"] == \
        "myuni/attention-lab-students"
    # what `pip install attention-lab @ git+https://github.com/<REPO>` builds: the helper package
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                            "-w", str(tmp_path / "wheel"), str(dest)], capture_output=True, text=True, timeout=600)
    assert wheel.returncode == 0, wheel.stdout + wheel.stderr
    (built,) = (tmp_path / "wheel").glob("*.whl")
    names = zipfile.ZipFile(built).namelist()
    assert "attention_lab/checking.py" in names and not any(n.startswith(("solutions", "autograder")) for n in names)
    # publishing again into the same folder, a clone of the students' repository, keeps its .git
    (dest / ".git").mkdir()
    (dest / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    again = run_readme_command("make publish", env=dict(os.environ, DEST=str(dest), REPO="myuni/attention-lab-students"),
                               timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (dest / ".git" / "HEAD").read_text() == "ref: refs/heads/main\n"
    assert sorted(p.stem for p in (dest / "course").glob("*.ipynb")) == assignment_names()


def test_the_check_finds_a_solution_a_hidden_test_or_a_private_folder(tmp_path):
    dest = tmp_path / "students"
    assert publish.publish(dest, "myuni/attention-lab-students") == []
    solutions, hidden = publish.secret_lines()
    notebook = nbformat.read(dest / "course" / "01_mha_shapes.ipynb", as_version=4)
    answer = next(c for c in notebook.cells if c.metadata.get("nbgrader", {}).get("solution") and c.cell_type == "code")
    own = next(line for line in sorted(solutions) if line not in answer.source)
    answer.source += "\n" + own
    notebook.cells[-1].source += "\n" + sorted(hidden)[0]
    nbformat.write(notebook, str(dest / "course" / "01_mha_shapes.ipynb"))
    shutil.copytree(REPO_ROOT / "solutions", dest / "solutions")
    problems = publish.secrets_in(dest, course_repository())
    assert "solutions is there" in problems
    assert any(p.startswith("course/01_mha_shapes.ipynb holds solution or hidden-test code") for p in problems)
    assert any(p.startswith("solutions/") and "holds solution" in p for p in problems), problems
    # a publication into a folder of other files is refused
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    try:
        publish.publish(other, "myuni/attention-lab-students")
        raise AssertionError("published over files it did not write")
    except SystemExit as refusal:
        assert "did not write" in str(refusal)
