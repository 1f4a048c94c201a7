"""nbgrader configuration for Attention Lab (the Makefile runs nbgrader from this folder)."""

import os

c = get_config()  # noqa: F821 -- provided by nbgrader when it loads this file

c.CourseDirectory.root = os.path.dirname(os.path.abspath(__file__))
c.CourseDirectory.course_id = "attention-lab"
# autograder/source/<assignment>/<assignment>.ipynb is generated from solutions/ by `make release`.
c.CourseDirectory.source_directory = "source"
c.CourseDirectory.release_directory = "release"
c.CourseDirectory.submitted_directory = "submitted"
c.CourseDirectory.autograded_directory = "autograded"
c.CourseDirectory.feedback_directory = "feedback"

# Every student's notebook has one code stub per answer cell; `make release` turns
# "raise NotImplementedError()" into "Exercise 1.3: implement split_heads".
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.enforce_metadata = True

# Per-cell timeout while autograding: an infinite loop costs one cell, not the class.
c.ExecutePreprocessor.timeout = 120
c.ExecutePreprocessor.interrupt_on_timeout = True
c.Execute.timeout = 120
# Widgets draw a static figure when no frontend is attached.
c.Execute.extra_arguments = []

c.Autograde.create_student = True
c.GenerateFeedback.force = True
