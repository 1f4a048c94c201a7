"""`make lab`: JupyterLab for students, on course/.

Only what a student needs: nbgrader's Validate button (run by autograder/lab/validate.py)
and ipywidgets. Formgrader, the exchange (Assignment List, Course List) and Jupytext are
instructor tools and stay off; packaging artefacts (attention_lab.egg-info) stay hidden.
Course notebooks are saved without outputs and with the course's metadata, so opening,
running or validating one never changes the committed file (see course_notebooks.py).
"""

import importlib
import sys
from pathlib import Path

c = get_config()  # noqa: F821 -- provided by Jupyter when it loads this file


def lab_package() -> str:
    """The package that holds this config folder, whose modules serve the lab: ``autograder.lab`` here,
    ``lab`` in the students' repository (`make publish` copies both); its root goes on ``sys.path``
    (the server runs in course/)."""
    folder, names = Path(__file__).resolve().parent.parent, []
    while (folder / "__init__.py").exists():
        folder, names = folder.parent, [folder.name, *names]
    sys.path.insert(0, str(folder))
    return ".".join(names)


LAB = lab_package()
course_notebooks = importlib.import_module(f"{LAB}.course_notebooks")

c.ServerApp.jpserver_extensions = {
    # Validate: nbgrader's button, served by our own handler (a child process with a time
    # limit, see autograder/lab/validate.py) instead of nbgrader's, which blocks the server.
    "nbgrader.server_extensions.validate_assignment": False,
    f"{LAB}.validate": True,
    "nbgrader.server_extensions.formgrader": False,
    "nbgrader.server_extensions.assignment_list": False,
    "nbgrader.server_extensions.course_list": False,
    "jupyterlab_jupytext": False,
}
c.ServerApp.contents_manager_class = course_notebooks.CourseContentsManager  # opening a notebook is not editing it
c.FileContentsManager.pre_save_hook = course_notebooks.keep_course_notebooks_clean
# The editable install (`make setup`) leaves attention_lab.egg-info next to the package in
# course/: not the course, so not in the student's file browser (JupyterLab's own list + it).
c.ContentsManager.hide_globs = ["__pycache__", "*.pyc", "*.pyo", ".DS_Store", "*~", "*.egg-info"]
# No news feed or update check: the course never talks to the internet while you work.
c.LabApp.news_url = None
c.LabApp.check_for_updates_class = "jupyterlab.NeverCheckForUpdate"
