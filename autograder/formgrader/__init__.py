"""The instructors' JupyterLab, ``make formgrader``: nbgrader's Formgrader on the course root, with
student content shown inert, its grading buttons run through the pipeline, and raw scores said to be raw.

This folder is also the Jupyter config directory the Makefile adds to ``JUPYTER_CONFIG_PATH``
(``jupyter_server_config.py``, ``labconfig/page_config.json``).
"""
