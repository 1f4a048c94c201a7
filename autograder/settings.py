"""Every place and setting of the instructor pipeline, defined once.

The code lives in ``autograder/``; what nbgrader and the pipeline generate (gradebook,
``source/``, ``submitted/``, ``autograded/``, ``feedback/``, reports, grade exports) lives in
the course root ``autograder/course_root/``, a folder of its own that git ignores as a whole.
``autograder/nbgrader_config.py`` reads its values from here, so the command-line tools,
Formgrader and the Python pipeline agree on them.
"""

from __future__ import annotations

import os
from pathlib import Path

AUTOGRADER_DIR = Path(__file__).resolve().parent   # the code (and nbgrader_config.py)
REPO_ROOT = AUTOGRADER_DIR.parent
SOLUTIONS_DIR = REPO_ROOT / "solutions"             # the one source of each notebook
COURSE_DIR = REPO_ROOT / "course"                   # the student release, committed
# nbgrader's course root: the class's data and what grading generates. Another folder where
# this variable names one (a course root kept outside the clone; the tests' scratch roots).
COURSE_ROOT_VARIABLE = "ATTENTION_LAB_COURSE_ROOT"
COURSE_ROOT = Path(os.environ.get(COURSE_ROOT_VARIABLE) or AUTOGRADER_DIR / "course_root").resolve()
COURSE_ID = "attention-lab"

# The generated first code cell of every notebook: it installs/imports the course and so
# pays for importing torch; the grader gives it the kernel start-up budget, not a cell's.
SETUP_CELL_ID = "setup"

# Grading limits (defaults of ``python -m autograder.grade``; see grade.Settings).
CELL_TIMEOUT = 120              # seconds a cell may run, counted from the cell's own start
KERNEL_STARTUP_TIMEOUT = 300    # seconds for a kernel to start and run the setup cell
# Notebooks whose graded test cells run in the trusted checker (autograder.grading.trusted.checker), not
# in the student's kernel: their verdicts cannot be forged by the submission's code. A notebook
# left out would still run its test cells in the kernel (the grading report says which).
CHECKED_OUTSIDE_THE_KERNEL = ("01_mha_shapes", "02_numpy_walkthrough", "03_positions_and_blocks", "04_vision_transformer",
                              "05_llama_attention", "06_efficient_attention", "07_inference_attention")
UNRESPONSIVE_GRACE = 10         # seconds (at least) an interrupted kernel has to answer
MAX_OUTPUT_BYTES = 1_000_000    # output kept per cell

# The largest file `make intake` takes in as a submission: the released notebooks are under
# 100 kB; a few plots in the outputs stay far below. A bigger file is refused, saying so.
MAX_NOTEBOOK_BYTES = 20_000_000

# nbgrader's late-submission penalty (LateSubmissionPlugin.penalty_method: "none" or "zero"),
# applied from each submission's timestamp.txt (written by intake) and the assignment's due
# date in the gradebook. The default of a new course: the course's own choice (with its grace
# period, extensions and limits) is kept in the course root's settings file, below.
LATE_PENALTY_METHOD = "none"

# The course's grading settings, one JSON file in the course root (`make settings`,
# autograder/course_settings.py): every path that grades reads it.
COURSE_SETTINGS_FILE = "course_settings.json"

# The gradebook: SQLite in the course root unless this variable (set by `make ... DB_URL=...`)
# names a database server, e.g. postgresql://grader:secret@db.example.org/attention_lab,
# shared by the grading pipeline and every grader's Formgrader.
DB_URL_VARIABLE = "ATTENTION_LAB_DB_URL"
