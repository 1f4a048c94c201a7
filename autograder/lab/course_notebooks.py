"""What a course notebook looks like on disk, and the student lab's pre-save hook that keeps it so.

The release is written exactly as JupyterLab's server writes notebooks (``nbformat.write``),
with the notebook metadata every course notebook carries. Opening a notebook still changes
two things in JupyterLab's copy: the kernel fills in ``language_info`` (with the Python
version of this machine) and the kernelspec's display name. Running adds outputs and
execution counts. None of that is the student's work, and all of it would show up in
``git status`` and conflict on ``git pull``; so on save the hook puts back the course's
metadata and drops outputs. What a student saves is what they wrote: their code, their
written answers, cells they added.

Opening must not count as editing either: JupyterLab marks a notebook modified (a dot on its
tab, "Save changes?" on close) as soon as the kernel's metadata differs from the file's. So
the student lab serves a course notebook with the metadata its kernel is about to write
(:class:`CourseContentsManager`): the kernel then changes nothing, and the pre-save hook
writes the course's metadata back, so the file on disk stays as released.
"""

from __future__ import annotations

import copy
import re
from pathlib import PurePosixPath

from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager

# Every course notebook runs on the default Python kernel; the version is left out on purpose
# (it differs per machine and would make the file differ per machine).
COURSE_NOTEBOOK_METADATA = {
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}
COURSE_NOTEBOOK_NAME = re.compile(r"^\d\d_\w+\.ipynb$")
# Cell metadata JupyterLab writes for the view, not the content: timing of the last run,
# an output area scrolled or collapsed, a cell folded.
VIEW_STATE_KEYS = ("execution", "scrolled", "collapsed", "jupyter", "trusted")


def is_course_notebook(path: str) -> bool:
    """``01_mha_shapes.ipynb`` at the top of the lab's folder; not a student's own notebook."""
    relative = PurePosixPath(path.strip("/"))
    return len(relative.parts) == 1 and bool(COURSE_NOTEBOOK_NAME.match(relative.name))


def strip_run_state(notebook: dict) -> dict:
    """Course metadata back, outputs, execution counts and view state out (in place)."""
    notebook["metadata"] = {key: dict(value) for key, value in COURSE_NOTEBOOK_METADATA.items()}
    for cell in notebook.get("cells", []):
        metadata = cell.get("metadata", {})
        for key in VIEW_STATE_KEYS:
            metadata.pop(key, None)
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
    return notebook


def kernel_metadata() -> dict:
    """The ``kernelspec`` and ``language_info`` JupyterLab writes into a notebook when the
    course's kernel (``python3``: ipykernel on the server's own Python) starts."""
    from ipykernel.ipkernel import IPythonKernel
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    return {
        "kernelspec": {"display_name": spec.display_name, "language": spec.language, "name": "python3"},
        "language_info": copy.deepcopy(IPythonKernel.language_info),
    }


class CourseContentsManager(AsyncLargeFileManager):
    """jupyter_server's default contents manager; a course notebook is served with the
    metadata of the kernel that will run it, so opening it changes nothing."""

    async def get(self, path, content=True, type=None, format=None, **kwargs):
        model = await super().get(path, content=content, type=type, format=format, **kwargs)
        if model.get("type") == "notebook" and isinstance(model.get("content"), dict) and is_course_notebook(path):
            model["content"]["metadata"].update(kernel_metadata())
        return model


def keep_course_notebooks_clean(model, path, contents_manager=None, **kwargs):
    """jupyter_server pre-save hook of the student lab (see the module docstring)."""
    if model.get("type") == "notebook" and isinstance(model.get("content"), dict) and is_course_notebook(path):
        strip_run_state(model["content"])
