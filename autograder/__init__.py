"""The instructor side of Attention Lab: building the student release and grading with nbgrader."""

import sys

# jsonschema (under nbformat and nbgrader) imports `rfc3987_syntax` when it is installed
# (jupyter-events asks for jsonschema[format-nongpl]), and that module builds dozens of Earley
# parsers as it is imported: a second of CPU in every process that reads a notebook, for the
# "iri" formats that no Jupyter or nbgrader schema uses (python-jsonschema/jsonschema#1428).
# Grading starts such processes all the time (each Dask worker, each nbgrader process, each
# nbgrader command): in a process that imports this package first, jsonschema goes without it.
sys.modules.setdefault("rfc3987_syntax", None)
