"""nbgrader configuration for Attention Lab: the command-line pipeline and Formgrader alike.

nbgrader reads this file from the working folder (the pipeline runs nbgrader from
``autograder/``); every value that the Python pipeline also needs comes from
``autograder/places.py`` and ``autograder/limits.py``, so the two never disagree.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
from autograder.limits import Limits  # noqa: E402
from autograder.places import COURSE_ID, COURSE_ROOT, DB_URL_VARIABLE, LATE_PENALTY_METHOD  # noqa: E402

c = get_config()  # noqa: F821 -- provided by nbgrader when it loads this file

# Generated state (gradebook, source/, submitted/, autograded/, feedback/) in a folder of
# its own; `make grade` builds source/<assignment>/ from solutions/.
c.CourseDirectory.root = str(COURSE_ROOT)
c.CourseDirectory.course_id = COURSE_ID
# A shared gradebook on a database server (`make formgrader DB_URL=postgresql://...`): the
# same one the grading pipeline writes (autograder/store/gradebook.py reads the same variable).
if os.environ.get(DB_URL_VARIABLE):
    c.CourseDirectory.db_url = os.environ[DB_URL_VARIABLE]

# Every student's notebook has one code stub per answer cell; `make release` turns
# "raise NotImplementedError()" into "Exercise 1.3: implement split_heads".
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.enforce_metadata = True

# Per-cell timeout (plain `nbgrader autograde`, Formgrader); an infinite loop costs one cell.
c.Execute.timeout = Limits.timeout

c.Autograde.create_student = True

# nbgrader's late-submission penalty, as the pipeline applies it (timestamp.txt vs due date).
c.LateSubmissionPlugin.penalty_method = LATE_PENALTY_METHOD
