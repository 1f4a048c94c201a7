"""The two JupyterLab set-ups: ``student/`` (``make lab``) and ``instructor/`` (``make formgrader``).

Each folder is a Jupyter config directory that the Makefile adds to ``JUPYTER_CONFIG_PATH``:
``jupyter_server_config.py`` picks the server extensions, ``labconfig/page_config.json``
the JupyterLab plugins. Students' own settings (theme, shortcuts) stay in ``~/.jupyter``.
"""
