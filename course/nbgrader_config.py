"""nbgrader settings for students: what the Validate button in JupyterLab uses."""

c = get_config()  # noqa: F821 -- provided by nbgrader when it loads this file

# Validate runs the whole notebook; training cells (notebooks 03 and 04) take up to a minute.
c.Execute.timeout = 300
