"""`make formgrader`: JupyterLab for instructors, on the course root (autograder/course_root/).

nbgrader's Formgrader works on the same course root and gradebook as `make intake / grade /
feedback / export`: the one nbgrader config, autograder/nbgrader_config.py, is found through
JUPYTER_CONFIG_PATH (the Makefile puts autograder/ there). The exchange (Assignment List,
Course List) is off: submissions come in through `make intake`, not through an exchange folder.
"""

import os
import sys
from pathlib import Path

# The repository, for the extension below (autograder/ is not an installed package).
REPOSITORY = Path(__file__).resolve().parents[2]
if str(REPOSITORY) not in sys.path:
    sys.path.insert(0, str(REPOSITORY))

from autograder.formgrader.inert_submissions import SHELL_VARIABLE, KernelsOffManager  # noqa: E402
from autograder.store.gradebook import stamp_in_process  # noqa: E402

c = get_config()  # noqa: F821 -- provided by Jupyter when it loads this file

# A gradebook Formgrader creates (Manage Students on a new course root) is stamped in this
# process, as the pipeline's are, instead of by running `alembic heads` (2 s).
stamp_in_process()

# Formgrader's Manage Assignments asks the exchange about released/collected assignments; the
# default exchange (/usr/local/share/nbgrader/exchange) is not writable, which it reports as an
# error. The course uses no exchange, so an empty one inside the (git-ignored) course root.
EXCHANGE = Path.cwd() / "exchange"  # `make formgrader` runs in the course root
EXCHANGE.mkdir(exist_ok=True)
c.Exchange.root = str(EXCHANGE)

# Student content is inert in Formgrader's hand-grading page (sanitised, sent with a
# Content-Security-Policy): autograder/formgrader/inert_submissions.py. And no shell: a
# terminal or a kernel here runs as the instructor, outside the sandbox, on the course root --
# what a script slipped into a page would reach for. Off unless `make formgrader
# INSTRUCTOR_KERNELS=on`; Formgrader itself needs neither.
if os.environ.get(SHELL_VARIABLE, "").lower() not in ("on", "1", "yes", "true"):
    c.ServerApp.terminals_enabled = False
    c.ServerApp.kernel_manager_class = KernelsOffManager
    c.KernelSpecManager.allowed_kernelspecs = {"kernels-are-off"}  # the launcher lists none

# Formgrader's Autograde / Generate Feedback go through the pipeline (sandbox, one gradebook
# writer, no hidden test shown); Generate / Release / Collect / Release Feedback are off, with
# what to run instead: autograder/formgrader/pipeline_buttons.py. Every page that shows scores
# says they are raw, before the course's late penalty: autograder/formgrader/raw_scores.py.
c.ServerApp.jpserver_extensions = {
    "nbgrader.server_extensions.formgrader": True,
    "autograder.formgrader.pipeline_buttons": True,
    "autograder.formgrader.inert_submissions": True,
    "autograder.formgrader.raw_scores": True,
    "nbgrader.server_extensions.validate_assignment": True,
    "nbgrader.server_extensions.assignment_list": False,
    "nbgrader.server_extensions.course_list": False,
}
c.LabApp.news_url = None
c.LabApp.check_for_updates_class = "jupyterlab.NeverCheckForUpdate"
