"""The students' JupyterLab, ``make lab``: its config folder ``student/``, the course notebooks kept as
released (``course_notebooks``) and the Validate button (``validate``). `make publish` copies it into the
students' repository as ``lab/``.

``student/`` is a Jupyter config directory that the Makefile adds to ``JUPYTER_CONFIG_PATH``:
``jupyter_server_config.py`` picks the server extensions, ``labconfig/page_config.json``
the JupyterLab plugins. Students' own settings (theme, shortcuts) stay in ``~/.jupyter``.
The instructors' JupyterLab is ``autograder/formgrader/``.
"""
