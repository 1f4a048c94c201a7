"""The trusted side of grading: where the verdict of every graded test cell is computed.

* :mod:`autograder.grading.trusted.checker`: the trusted checker process, which runs a graded test
  cell and reaches the student's objects only through the bridge (data both ways);
* :mod:`autograder.grading.trusted.checker_client`: the grading client's side: which cells go to the checker,
  the checker process it keeps, and the agent it has the student's kernel run.
"""
