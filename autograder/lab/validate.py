"""The student lab's Validate button: nbgrader's validator in a child process, with a time limit.

nbgrader's own server extension runs the whole notebook *inside* the Jupyter server's event
loop (nbgrader issue #1232): while a notebook validates, the server answers nothing else --
not the student's kernel, not autosave, not the notebook's own messages -- and nothing bounds
the run as a whole (only each cell, at ``Execute.timeout``). On a busy machine a validation
that takes 20 s alone can take many minutes, and the student sees a spinner that never ends.

Here the same validator (nbgrader's ``Validator``, configured as nbgrader's handler configures
it: the working folder's ``nbgrader_config.py`` first) runs in a child process that the
server awaits without blocking. The run has a time limit, ``VALIDATE_SECONDS``, which the
machine's load stretches (``load average / cores``, at most ``MAX_STRETCH`` times) but never
removes: when it is spent, the child and its kernel are stopped and the dialog says which
cell was still running. A failed cell shows its check's message first and what the student's
code printed or warned after it (see :func:`failure_text`), so a warning never hides the message.

The Validate button itself (nbgrader's JupyterLab extension) is unchanged: it POSTs the
notebook's path to ``/assignments/validate`` and reads ``{"success", "value"}`` back; this
module serves that URL and ``/nbgrader_version`` in place of nbgrader's extension.

Run as a script, the module is the child: ``python validate.py NOTEBOOK RESULT PROGRESS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

# Seconds a whole validation may take on an idle machine: the slowest course notebook runs in
# well under two minutes alone. Load stretches it (see load_stretch) up to MAX_STRETCH times.
VALIDATE_SECONDS = float(os.environ.get("ATTENTION_LAB_VALIDATE_SECONDS", 600))
MAX_STRETCH = 3.0
# What the student's own code printed to stderr (warnings, logging) is kept after the check's
# message, this many lines at most (the dialog is not a log viewer).
STDERR_LINES = 12


# An exercise's header in the notebook's text: "### Exercise 6.6 — merging with lse, a written answer (2 pts, ~5 min)".
EXERCISE_HEADER = re.compile(r"^#{2,4}\s+(Exercise\s+\d+\.\d+\b.*?)\s*(?:\(\d+\s*pts?\b[^)]*\))?\s*$", re.MULTILINE)


# A question asked inside an exercise's section: "**Written question (1 pt).** The demo above shows ...".
QUESTION_LABEL = re.compile(r"^\*\*(?P<label>[^*(]+?)\s*(?:\([^)]*\))?\.?\*\*")


def written_question(cells: list, index: int) -> str | None:
    """The question a written answer (the markdown cell at ``index``) answers: the last exercise header above it,
    e.g. "Exercise 6.6 — merging with lse, a written answer", and the question's own label when the cell just above
    asks it inside that exercise's section ("Exercise 1.2 — merge_heads, its written question"); None when no
    exercise header comes before it."""
    for cell in reversed(cells[:index + 1]):
        headers = EXERCISE_HEADER.findall(cell.source) if cell.cell_type == "markdown" else []
        if headers:
            question = headers[-1].strip()
            break
    else:
        return None
    above = cells[index - 1] if index else None
    label = QUESTION_LABEL.match(above.source.strip()) if above is not None and above.cell_type == "markdown" \
        and not EXERCISE_HEADER.search(above.source) else None
    return f"{question}, its {label['label'].strip().lower()}" if label else question


def unanswered_text(question: str) -> str:
    """What Validate says of a written answer left blank (nbgrader's own words name no question)."""
    return (f"You did not provide a response to {question}: write your answer in its cell, in place of "
            "YOUR ANSWER HERE.")


def load_stretch() -> float:
    """How much longer than alone things take now: 1 on an idle machine, more when the
    machine runs more than it has cores for, never more than MAX_STRETCH."""
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        return 1.0
    return min(MAX_STRETCH, max(1.0, load))


def failure_text(outputs: list[dict]) -> str:
    """What a failed cell shows in Validate: its error first (the check's message), then what
    the student's code wrote to stderr while it ran (a warning, a log line), marked as such.

    nbgrader joins the error and stderr in output order, so a warning printed before the check
    failed came first and could hide the message below it.
    """
    errors, stderr = [], []
    for output in outputs:
        if output.get("output_type") == "error":
            errors.append("\n".join(output.get("traceback", [])) or f"{output.get('ename')}: {output.get('evalue')}")
        elif output.get("output_type") == "stream" and output.get("name") == "stderr":
            stderr.append(output.get("text", ""))
    lines = "".join(stderr).rstrip("\n").splitlines()
    if len(lines) > STDERR_LINES:
        lines = lines[:STDERR_LINES - 1] + [f"... ({len(lines) - STDERR_LINES + 1} more lines)"]
    parts = errors[:]
    if lines:
        parts.append("Your code also printed (stderr) while this cell ran:\n" + "\n".join(lines))
    return "\n\n".join(parts)


def timed_out_result(source: str, position: str, seconds: float, limit: float) -> dict:
    message = (f"Validate stopped after {seconds:.0f} s (its limit on this machine now: {limit:.0f} s). "
               f"This cell ({position}) was still running. A cell that never finishes (an endless loop, "
               "input(), an answer far slower than it should be) keeps Validate from finishing: run the "
               "notebook yourself (Kernel > Restart Kernel and Run All Cells) and look at the cell that "
               "does not finish.")
    return {"failed": [{"source": source, "error": _html(message), "raw_error": message}]}


def _html(text: str) -> str:
    from nbconvert.filters.ansi import ansi2html

    return ansi2html(text)


# --------------------------------------------------------------------------------------
# The child: nbgrader's validator on one notebook
# --------------------------------------------------------------------------------------

def _child(notebook: str, result_path: str, progress_path: str) -> None:
    from jupyter_core.paths import jupyter_config_path
    from nbgrader.apps import NbGrader
    from nbgrader.validator import Validator

    def stop(signum, frame):  # let nbclient shut its kernel down on the way out
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)

    class CourseValidator(Validator):
        def _get_failed_cells(self, nb):
            # Which question each written answer belongs to, for the dialog (01 and 03 have several).
            self.questions = {id(cell): written_question(nb.cells, index) for index, cell in enumerate(nb.cells)
                              if cell.cell_type == "markdown"}
            return super()._get_failed_cells(nb)

        def _extract_error(self, cell):
            if cell.cell_type == "markdown" and getattr(self, "questions", {}).get(id(cell)):
                return unanswered_text(self.questions[id(cell)])
            text = failure_text(cell.get("outputs", [])) if cell.cell_type == "code" else ""
            return text or super()._extract_error(cell)

    def on_cell_execute(cell, cell_index, **kwargs):
        Path(progress_path).write_text(json.dumps({"index": cell_index, "source": cell.source}))

    # The configuration nbgrader's own handler loads: the working folder's nbgrader_config.py first.
    paths = jupyter_config_path()
    paths.insert(0, os.getcwd())
    app = NbGrader()
    app.config_file_paths.append(paths)
    app.load_config_file()
    config = app.config
    config.Execute.on_cell_execute = on_cell_execute
    # Killed once every cell has run, as grading does: a graceful shutdown can hang 2.5 s
    # (autograder.grading.execute.notebook_client says why), and the student waits for the answer.
    config.Execute.shutdown_kernel = "immediate"
    try:
        outcome = {"success": True, "value": CourseValidator(config=config).validate(notebook)}
    except KeyboardInterrupt:
        return
    except Exception:  # what nbgrader's handler answers when the validator itself fails
        import traceback

        outcome = {"success": False, "value": traceback.format_exc()}
    Path(result_path).write_text(json.dumps(outcome))


# --------------------------------------------------------------------------------------
# The server side
# --------------------------------------------------------------------------------------

def _stop_tree(pid: int) -> None:
    """SIGTERM the child (it shuts its kernel down), then SIGKILL whatever of it is left."""
    import psutil

    try:
        parent = psutil.Process(pid)
        family = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in family:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(family, timeout=10)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=10)


async def validate_notebook(path: Path, log=None, base_seconds: float | None = None) -> dict:
    """Validate ``path`` in a child process; the answer nbgrader's Validate button expects."""
    base_seconds = VALIDATE_SECONDS if base_seconds is None else base_seconds
    with tempfile.TemporaryDirectory(prefix="validate-") as scratch:
        result, progress = Path(scratch) / "result.json", Path(scratch) / "progress.json"
        child = await asyncio.create_subprocess_exec(
            sys.executable, __file__, str(path), str(result), str(progress),
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
        started, stretch = time.monotonic(), load_stretch()
        while True:
            try:
                await asyncio.wait_for(child.wait(), timeout=1.0)
                break
            except asyncio.TimeoutError:
                stretch = max(stretch, load_stretch())  # a limit that load stretches...
                limit = base_seconds * stretch          # ...but never removes
                elapsed = time.monotonic() - started
                if elapsed > limit:
                    await asyncio.get_running_loop().run_in_executor(None, _stop_tree, child.pid)
                    await child.wait()
                    try:
                        running = json.loads(progress.read_text())
                    except (OSError, ValueError):
                        running = {"index": None, "source": "(the kernel had not started a cell yet)"}
                    position = "before the first cell" if running["index"] is None else f"cell {running['index'] + 1}"
                    if log:
                        log.warning("Validate of %s stopped after %.0f s in %s", path, elapsed, position)
                    return {"success": True,
                            "value": timed_out_result(running["source"].strip(), position, elapsed, limit)}
        if result.exists():
            return json.loads(result.read_text())
        return {"success": False, "value": f"the validator stopped without an answer (exit status {child.returncode})"}


def _handlers():
    from jupyter_server.base.handlers import JupyterHandler
    from nbgrader import __version__ as nbgrader_version
    from tornado import web

    class ValidateHandler(JupyterHandler):
        @web.authenticated
        async def post(self):
            try:
                relative = self.get_argument("path")
            except web.MissingArgumentError:
                relative = self.get_json_body()["path"]
            root = Path(self.settings["server_root_dir"]).resolve()
            target = (root / relative).resolve()
            if not target.is_relative_to(root):
                raise web.HTTPError(403, "Access denied: path outside allowed directory")
            self.finish(json.dumps(await validate_notebook(target, self.log)))

    class VersionHandler(JupyterHandler):
        @web.authenticated
        def get(self):
            same = self.get_argument("version") == nbgrader_version
            self.finish(json.dumps({"success": True} if same else {
                "success": False,
                "message": f"The Validate button ({self.get_argument('version')}) and nbgrader "
                           f"({nbgrader_version}) differ: run `make setup` again."}))

    return [(r"/assignments/validate", ValidateHandler), (r"/nbgrader_version", VersionHandler)]


def _jupyter_server_extension_points():
    return [{"module": __name__}]  # autograder.lab.validate; lab.validate in the students' repository


def _load_jupyter_server_extension(server_app):
    from jupyter_server.utils import url_path_join

    web_app = server_app.web_app
    base_url = web_app.settings["base_url"]
    web_app.add_handlers(".*$", [(url_path_join(base_url, pattern), handler) for pattern, handler in _handlers()])
    server_app.log.info("attention-lab: Validate runs in a child process, limit %.0f s (stretched by load)",
                        VALIDATE_SECONDS)


if __name__ == "__main__":
    _child(*sys.argv[1:4])
