"""The grading pipeline behind ``python -m autograder.grading.grade`` (``make grade``), one room per part.

In the parent process (the instructor's machine; the only writer of the gradebook and
``autograded/``):

* :mod:`autograder.grading.plan`: settings, discovery of submissions, fingerprints, the
  run's state and lock: *what* needs grading;
* :mod:`autograder.grading.dask_cluster`: the Dask cluster (an embedded ``LocalCluster`` by
  default, or an existing scheduler) and the tasks sent to it, with the bytes each carries;
* :mod:`autograder.grading.merge`: the gradebook (sources, assignments, templates) and the
  merge of each result into it and into ``autograded/``;
* :mod:`autograder.grading.run_report`: the console lines and ``reports/grading_report.{md,json}``.

On a Dask worker (any machine with the course installed; no shared filesystem):

* :mod:`autograder.grading.task`: one submission, from the bytes of its task to the bytes of
  its autograded notebooks and grades, through a long-lived nbgrader process per worker
  (:mod:`autograder.grading.nbgrader_process`), each notebook in a new sandboxed kernel;
* :mod:`autograder.grading.trusted`: the other side of the trust boundary, next to each
  nbgrader process: the trusted checker, where every graded test cell of a notebook in
  :data:`autograder.grading.trusted.checker_client.CHECKED_OUTSIDE_THE_KERNEL` runs, reaching the student's kernel
  through the bridge (:mod:`attention_lab.bridge`) with data only.
"""
