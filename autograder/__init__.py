"""The instructor side of Attention Lab: publishing the course, running a term and grading it with nbgrader.

One folder per idea; each imports only from those above it in this list (docs/design.md, "The code"):

    places.py, limits.py,   where everything is; a grading run's limits, every default once; the
    command_line.py         command line of every `python -m autograder...`
    lab/                    the students' JupyterLab (make lab): notebooks kept as released, Validate
    store/                  the gradebook and its server, a graded notebook read, nbgrader's CLI, run reports
    isolation/              the bubblewrap sandbox, control groups, the kernel server
    grading/trusted/        the trusted checker, where every verdict is decided, and its client
    publishing/             the student notebooks (release) and the students' repository (publish)
    term/                   course settings, roster and due dates, intake, the example class, cleaning up
    grading/, reports/      make grade; feedback, exports, the LMS's files, the class report
    formgrader/             the instructors' JupyterLab (make formgrader): Formgrader, inert submissions

nbgrader_config.py is nbgrader's own configuration (it reads places.py and limits.py).
"""

import importlib.abc
import importlib.util
import sys

# jsonschema (under nbformat and nbgrader) imports `rfc3987_syntax` when it is installed
# (jupyter-events asks for jsonschema[format-nongpl]), and that module builds dozens of Earley
# parsers as it is imported: a second of CPU in every process that reads a notebook, for the
# "iri" formats that no Jupyter or nbgrader schema uses (python-jsonschema/jsonschema#1428).
# Grading starts such processes all the time (each Dask worker, each nbgrader process, each
# nbgrader command): in a process that imports this package first, jsonschema goes without it.
sys.modules.setdefault("rfc3987_syntax", None)

# The commands that moved into a folder, by the name they had: `python -m autograder.grade` keeps
# working for a term (runs autograder.grading.grade and says so). Code imports the new names only
# (tests/test_package_structure.py checks it).
MOVED_COMMANDS = {
    "autograder.grade": "autograder.grading.grade",
    "autograder.execute": "autograder.grading.execute",
    "autograder.sandbox": "autograder.isolation.sandbox",
    "autograder.gradebook": "autograder.store.gradebook",
    "autograder.postgres": "autograder.store.postgres",
    "autograder.release": "autograder.publishing.release",
    "autograder.publish": "autograder.publishing.publish",
    "autograder.course_settings": "autograder.term.course_settings",
    "autograder.roster": "autograder.term.roster",
    "autograder.intake": "autograder.term.intake",
    "autograder.example_class": "autograder.term.example_class",
    "autograder.housekeeping": "autograder.term.housekeeping",
    "autograder.feedback": "autograder.reports.feedback",
    "autograder.export": "autograder.reports.export",
    "autograder.lms_export": "autograder.reports.lms_export",
    "autograder.class_report": "autograder.reports.class_report",
}


class MovedCommandFinder(importlib.abc.MetaPathFinder):
    """Finds a moved command by its old name: the module where it went, under the old name.

    No file keeps the old name (a file there would hide from git that the module moved, and
    other branches' edits of it would not follow it)."""

    def find_spec(self, name, path=None, target=None):
        moved_to = MOVED_COMMANDS.get(name)
        if moved_to is None:
            return None
        if sys.argv[:1] == ["-m"]:   # what `python -m` sets while it looks for the module
            print(f"note: `python -m {name}` is now `python -m {moved_to}` (the old name works for this term)",
                  file=sys.stderr)
        return importlib.util.spec_from_file_location(name, importlib.util.find_spec(moved_to).origin)


if not any(isinstance(finder, MovedCommandFinder) for finder in sys.meta_path):
    sys.meta_path.append(MovedCommandFinder())
