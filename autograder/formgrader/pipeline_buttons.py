"""Formgrader's buttons, rerouted through the pipeline (a jupyter_server extension of `make formgrader`).

nbgrader's Formgrader offers buttons that would go around Attention Lab's pipeline: its
"Autograde" runs plain ``nbgrader autograde`` inside the lab server (the student's kernel
outside the sandbox, writing the gradebook directly); its "Generate Feedback" writes the whole
autograded notebook, hidden tests included, as the student's feedback; "Generate" and
"Release" would build a release other than ``make release``'s. This extension answers those
API routes before nbgrader does:

* Autograde (a submission)   -> ``python -m autograder.grading.grade --student S --assignment A --force``
                                (sandboxed kernels, the one writer of the gradebook);
* Generate Feedback          -> ``python -m autograder.reports.feedback [--student S] --assignment A``
                                (feedback pages that never show test code);
* Generate, Release, Unrelease, Collect, Release Feedback -> refused, with what to run instead
  (``make release``, ``make intake``; feedback pages are sent through the LMS).

Every reply has nbgrader's own shape (``success``, ``log``, ``error``), so Formgrader shows
it in its usual dialog; a refusal, and what a failed pipeline said, are the reply's log (its
``error`` would be shown as a "Traceback"), in a box whose lines wrap (see
``inert_submissions.READABLE_DIALOGS``).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from jupyter_server.utils import url_path_join
from nbgrader.server_extensions.formgrader.base import BaseApiHandler, check_notebook_dir, check_xsrf
from tornado import web
from tornado.routing import HostMatches, Rule
from tornado.web import _ApplicationRouter

from autograder.places import REPO_ROOT
from autograder.store.nbgrader_cli import nbgrader_environment

GRADE_TIMEOUT = 3600  # seconds: one submission graded by the pipeline (its own limits apply inside)

REFUSALS = {
    "generate": ("Formgrader's Generate is off in Attention Lab: the student notebooks are built from "
                 "solutions/ in one place, so there is one release, never a second one made here. Instead, "
                 "type `make release` in the course's repository (the student notebooks, in course/); "
                 "`make grade` puts each assignment in the gradebook."),
    "release": ("Formgrader's Release is off in Attention Lab: the course uses no exchange folder. Students "
                "get the notebooks of course/ from their own repository or your LMS: type `make publish "
                "DEST=<folder> REPO=<owner/name>` to write the students' repository."),
    "unrelease": ("Formgrader's Unrelease is off in Attention Lab: the course uses no exchange folder, so "
                  "nothing was released here. To change what students get, edit solutions/, then type "
                  "`make release` and `make publish`."),
    "collect": ("Formgrader's Collect is off in Attention Lab: submissions come from your LMS's export, not "
                "from an exchange folder. Instead, type `make intake SUBMISSIONS=<the export's folder>` "
                "(checked against the roster, repaired, time-stamped), then `make grade`."),
    "release_feedback": ("Formgrader's Release Feedback is off in Attention Lab: the course uses no exchange "
                         "folder. Generate Feedback (or `make feedback`) writes the pages in the course root's "
                         "feedback/<student>/<assignment>/: send them through your LMS (`make lms-export` "
                         "zips them for Moodle)."),
}


def refused(sentence: str) -> dict:
    """A refused button's reply: the sentence as the reply's log, and no ``error``. Formgrader
    shows an ``error`` under the heading "Traceback"; a refusal is not one."""
    return {"success": False, "log": sentence, "error": ""}


def pipeline_command(module: str, root: str, *arguments: str) -> list[str]:
    return [sys.executable, "-m", module, "--root", root, *arguments]


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
    # what the pipeline said (a refusal: the lock of another run, no sandbox) is its output, shown once
    return refused(f"{log.rstrip()}\n(the pipeline exited with status {process.returncode})")


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
            self.reply(refused(f"Autograde found no submission of {assignment_id} by {student_id} in {folder}: "
                               "submissions come in through `make intake SUBMISSIONS=<folder>` (a withdrawn one "
                               "is under archive/withdrawn/)."))
            return
        self.reply(await run_pipeline(pipeline_command(
            "autograder.grading.grade", self.root, "--student", student_id, "--assignment", assignment_id, "--force", "--jobs", "1")))


class GenerateFeedbackHandler(PipelineHandler):
    @web.authenticated
    @check_xsrf
    @check_notebook_dir
    async def post(self, assignment_id, student_id=None):
        arguments = ["--assignment", assignment_id] + (["--student", student_id] if student_id else [])
        self.reply(await run_pipeline(pipeline_command("autograder.reports.feedback", self.root, *arguments)))


def refusing(action: str):
    class RefusedHandler(PipelineHandler):
        @web.authenticated
        @check_xsrf
        def post(self, *args):
            self.reply(refused(REFUSALS[action]))

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
    return [{"module": "autograder.formgrader.pipeline_buttons"}]


def _load_jupyter_server_extension(serverapp):
    """Put these routes first: tornado takes the first rule that matches, whatever order the
    extensions were loaded in (Formgrader's own rules stay, for every other route)."""
    webapp = serverapp.web_app
    base_url = webapp.settings["base_url"]
    handlers = [(url_path_join(base_url, pattern.lstrip("/")), handler) for pattern, handler in HANDLERS]
    webapp.default_router.rules.insert(0, Rule(HostMatches(".*$"), _ApplicationRouter(webapp, handlers)))
    serverapp.log.info("Attention Lab: Formgrader's Autograde and Generate Feedback go through the pipeline; "
                       "Generate, Release, Collect and Release Feedback are off")
