"""Formgrader's buttons, rerouted through the pipeline (a jupyter_server extension of `make formgrader`).

nbgrader's Formgrader offers buttons that would go around Attention Lab's pipeline: its
"Autograde" runs plain ``nbgrader autograde`` inside the lab server (the student's kernel
outside the sandbox, writing the gradebook directly); its "Generate Feedback" writes the whole
autograded notebook, hidden tests included, as the student's feedback; "Generate" and
"Release" would build a release other than ``make release``'s. This extension answers those
API routes before nbgrader does:

* Autograde (a submission)   -> ``python -m autograder.grade --student S --assignment A --force``
                                (sandboxed kernels, the one writer of the gradebook);
* Generate Feedback          -> ``python -m autograder.feedback [--student S] --assignment A``
                                (feedback pages that never show test code);
* Generate, Release, Unrelease, Collect, Release Feedback -> refused, with what to run instead
  (``make release``, ``make intake``; feedback pages are sent through the LMS).

Every reply has nbgrader's own shape (``success``, ``log``, ``error``), so Formgrader shows
it in its usual dialog.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path

from jupyter_server.utils import url_path_join
from nbgrader.server_extensions.formgrader.base import BaseApiHandler, check_notebook_dir, check_xsrf
from tornado import web
from tornado.routing import HostMatches, Rule
from tornado.web import _ApplicationRouter

from autograder.nbgrader_cli import nbgrader_environment
from autograder.settings import REPO_ROOT

GRADE_TIMEOUT = 3600  # seconds: one submission graded by the pipeline (its own limits apply inside)

REFUSALS = {
    "generate": ("Formgrader's Generate is off in Attention Lab: the student notebooks are built from "
                 "solutions/ by `make release` (the gradebook's copy of each assignment is built by "
                 "`make grade`), so there is one release, never a second one made here."),
    "release": ("Formgrader's Release is off: Attention Lab uses no exchange. Students get the notebooks of "
                "course/ (built by `make release`) through the course repository or your LMS."),
    "unrelease": "Formgrader's Unrelease is off: Attention Lab uses no exchange (see `make release`).",
    "collect": ("Formgrader's Collect is off: submissions come in through `make intake SUBMISSIONS=<folder>` "
                "(checked against the roster, repaired, time-stamped), then `make grade`."),
    "release_feedback": ("Formgrader's Release Feedback is off: Attention Lab uses no exchange. The feedback "
                         "pages are in the course root's feedback/<student>/<assignment>/; send them through "
                         "your LMS."),
}


def pipeline_command(module: str, root: str, *arguments: str) -> list[str]:
    return [sys.executable, "-m", f"autograder.{module}", "--root", root, *arguments]


async def run_pipeline(command: list[str], timeout: float = GRADE_TIMEOUT) -> dict:
    """Run one pipeline command without blocking the server; nbgrader's reply shape."""
    process = await asyncio.create_subprocess_exec(
        *command, cwd=REPO_ROOT, env=nbgrader_environment(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout)
    except asyncio.TimeoutError:
        process.kill()
        await process.wait()
        return {"success": False, "log": "", "error": f"{' '.join(command[2:])} ran past {timeout} s and was stopped"}
    log = "$ python " + " ".join(command[1:]) + "\n" + output.decode(errors="replace")
    if process.returncode == 0:
        return {"success": True, "log": log}
    return {"success": False, "log": log, "error": f"the pipeline exited with status {process.returncode}:\n{log[-4000:]}"}


class PipelineHandler(BaseApiHandler):
    """Base of the rerouted buttons."""

    @property
    def root(self) -> str:
        return str(Path(self.coursedir.root).resolve())

    def reply(self, result: dict) -> None:
        # a JSON string with Tornado's default content type, as nbgrader's own handlers reply:
        # Formgrader's pages JSON.parse the text (an application/json reply would reach them parsed)
        self.write(json.dumps(result))


class AutogradeHandler(PipelineHandler):
    @web.authenticated
    @check_xsrf
    @check_notebook_dir
    async def post(self, assignment_id, student_id):
        folder = Path(self.root) / "submitted" / student_id / assignment_id
        if not folder.is_dir():
            self.reply({"success": False, "log": "", "error": (
                f"no submission in {folder}: submissions come in through `make intake SUBMISSIONS=<folder>` "
                "(a withdrawn one is under archive/withdrawn/)")})
            return
        self.reply(await run_pipeline(pipeline_command(
            "grade", self.root, "--student", student_id, "--assignment", assignment_id, "--force", "--jobs", "1")))


class GenerateFeedbackHandler(PipelineHandler):
    @web.authenticated
    @check_xsrf
    @check_notebook_dir
    async def post(self, assignment_id, student_id=None):
        arguments = ["--assignment", assignment_id] + (["--student", student_id] if student_id else [])
        self.reply(await run_pipeline(pipeline_command("feedback", self.root, *arguments)))


def refusing(action: str):
    class RefusedHandler(PipelineHandler):
        @web.authenticated
        @check_xsrf
        def post(self, *args):
            # Formgrader shows it in a <pre> that does not wrap: lines of a readable width
            self.reply({"success": False, "log": "", "error": textwrap.fill(REFUSALS[action], 90, break_long_words=False, break_on_hyphens=False)})

    RefusedHandler.__name__ = f"Refused{action.title().replace('_', '')}Handler"
    return RefusedHandler


HANDLERS = [
    (r"/formgrader/api/assignment/([^/]+)/assign", refusing("generate")),
    (r"/formgrader/api/assignment/([^/]+)/release", refusing("release")),
    (r"/formgrader/api/assignment/([^/]+)/unrelease", refusing("unrelease")),
    (r"/formgrader/api/assignment/([^/]+)/collect", refusing("collect")),
    (r"/formgrader/api/assignment/([^/]+)/generate_feedback", GenerateFeedbackHandler),
    (r"/formgrader/api/assignment/([^/]+)/release_feedback", refusing("release_feedback")),
    (r"/formgrader/api/assignment/([^/]+)/([^/]+)/generate_feedback", GenerateFeedbackHandler),
    (r"/formgrader/api/assignment/([^/]+)/([^/]+)/release_feedback", refusing("release_feedback")),
    (r"/formgrader/api/submission/([^/]+)/([^/]+)/autograde", AutogradeHandler),
]


def _jupyter_server_extension_points():
    return [{"module": "autograder.lab.instructor.pipeline_buttons"}]


def _load_jupyter_server_extension(serverapp):
    """Put these routes first: tornado takes the first rule that matches, whatever order the
    extensions were loaded in (Formgrader's own rules stay, for every other route)."""
    webapp = serverapp.web_app
    base_url = webapp.settings["base_url"]
    handlers = [(url_path_join(base_url, pattern.lstrip("/")), handler) for pattern, handler in HANDLERS]
    webapp.default_router.rules.insert(0, Rule(HostMatches(".*$"), _ApplicationRouter(webapp, handlers)))
    serverapp.log.info("Attention Lab: Formgrader's Autograde and Generate Feedback go through the pipeline; "
                       "Generate, Release, Collect and Release Feedback are off")
