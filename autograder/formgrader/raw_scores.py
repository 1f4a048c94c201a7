"""Formgrader's scores are raw, and its pages say so (a jupyter_server extension of `make formgrader`).

nbgrader's Formgrader shows each submission's score as the gradebook sums it: the points the work
earned, before the late penalty.  The course's late penalty is a rule applied when a score is read
(:mod:`autograder.term.scores`): ``grades.csv``, the LMS export, the feedback pages and the class report
deduct it.  So a TA typing a hand grade on a late submission sees, on every page that shows a
score (the gradebook, the students' pages, the submissions of an assignment, the hand-grading page
itself), a note above it: the scores here are raw, the course's late rule (penalty, grace period),
and the late submissions the page is about, each with its raw score and the score the exports give.

The note is added to the page as it is sent (a tornado output transform): plain text in a
Bootstrap alert, no script and no style of its own, so the pages' Content-Security-Policy
(``inert_submissions.py``) holds as it is.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from urllib.parse import unquote

from jupyter_server.utils import url_path_join
from tornado.web import OutputTransform

from autograder.store import gradebook
from autograder.term import scores
from autograder.term.course_settings import CourseSettings

MOST_LISTED = 20   # late submissions named on a page about the whole class
# Formgrader's page routes that show scores (nbgrader's formgrader/handlers.py), under "formgrader/"
SCORE_PAGES = [
    (re.compile(r"gradebook/?"), ()),
    (re.compile(r"gradebook/([^/]+)(?:/[^/]+)?/?"), ("assignment",)),
    (re.compile(r"manage_submissions/([^/]+)/?"), ("assignment",)),
    (re.compile(r"manage_students/?"), ()),
    (re.compile(r"manage_students/([^/]+)(?:/([^/]+))?/?"), ("student", "assignment")),
    (re.compile(r"submissions/([^/]+)/?"), ("submission",)),
]
# where the note goes: inside the hand-grading page's first container (its fixed navigation bar
# would cover the top of the page), else at the top of the page
PLACES = [re.compile(rb'<div class="container">'), re.compile(rb"<body[^>]*>", re.IGNORECASE)]


def page_subject(path: str, prefix: str) -> dict[str, str] | None:
    """What a Formgrader page shows scores of (``{}``: the whole class), or None: no scores."""
    if not path.startswith(prefix):
        return None
    rest = path[len(prefix):]
    for pattern, names in SCORE_PAGES:
        match = pattern.fullmatch(rest)
        if match:
            return {name: unquote(value) for name, value in zip(names, match.groups()) if value}
    return None


def late_submissions(book, settings: CourseSettings, subject: dict[str, str]) -> list[tuple[str, str, scores.Score]]:
    """``(student, assignment, score)`` of each late submission the page is about."""
    from nbgrader.api import MissingEntry

    if "submission" in subject:
        try:
            submissions = [book.find_submission_notebook_by_id(subject["submission"]).assignment]
        except MissingEntry:
            return []
    else:
        submissions = [s for a in book.assignments if subject.get("assignment") in (None, a.name)
                       for s in a.submissions if subject.get("student") in (None, s.student.id)]
    found = []
    for submission in submissions:
        score = scores.submission_score(submission, settings)
        if score.late:
            found.append((submission.student.id, submission.assignment.name, score))
    return sorted(found, key=lambda item: (item[1], item[0]))


def note(settings: CourseSettings, late: list[tuple[str, str, scores.Score]], whole_class: bool) -> str:
    """The note, as HTML (every value escaped)."""
    esc = html.escape
    rule = f"late penalty {settings.late_penalty}, grace period {settings.grace_minutes:g} minutes"
    parts = [f"<b>Raw scores.</b> The scores on this page are the points earned, before the late penalty "
             f"(course settings: {esc(rule)}; <code>make settings</code>). <code>grades.csv</code>, the LMS export, "
             "the feedback pages and the class report deduct it when they are written, hand grades included."]
    if late:
        rows = [f"<li>{esc(student)}, {esc(assignment)}: {esc(scores.lateness(score.seconds_late))} late; raw "
                f"{score.raw:g} / {score.max_score:g}, late penalty {score.penalty:g}, score "
                f"<b>{score.final:g}</b></li>" for student, assignment, score in late[:MOST_LISTED]]
        more = f"<li>and {len(late) - MOST_LISTED} more</li>" if len(late) > MOST_LISTED else ""
        parts.append(f"Late under the course settings:<ul>{''.join(rows)}{more}</ul>")
    elif not whole_class:
        parts.append("Nothing on this page is late under the course settings.")
    return ("<div class='alert alert-warning' id='attention-lab-raw-scores' role='note'>"
            + " ".join(parts) + "</div>")


class RawScoreNote(OutputTransform):
    """Adds :func:`note` at the top of each Formgrader page that shows scores."""

    prefix = "/formgrader/"   # under the server's base_url, set when the extension loads
    settings: dict = {}       # the web application's (Formgrader's course directory)

    def __init__(self, request):
        super().__init__(request)
        self.subject = page_subject(request.path, self.prefix) if request.method == "GET" else None

    def transform_first_chunk(self, status_code, headers, chunk, finishing):
        if self.subject is None or status_code != 200 or not finishing \
                or not headers.get("Content-Type", "").startswith("text/html"):
            return status_code, headers, chunk
        place = next((found for found in (pattern.search(chunk) for pattern in PLACES) if found), None)
        if place is None:
            return status_code, headers, chunk
        try:
            added = self.note().encode()
        except (Exception, SystemExit) as error:  # a note that cannot be written never costs the page
            added = (f"<div class='alert alert-warning' id='attention-lab-raw-scores'>Scores on this page are raw "
                     f"(before the late penalty); the late submissions could not be listed: "
                     f"{html.escape(type(error).__name__)}</div>").encode()
        chunk = chunk[:place.end()] + added + chunk[place.end():]
        if "Content-Length" in headers:
            headers["Content-Length"] = str(len(chunk))
        return status_code, headers, chunk

    def note(self) -> str:
        coursedir = self.settings["nbgrader_formgrader"].coursedir
        root = Path(coursedir.root)
        settings = CourseSettings.load(root)
        with gradebook.open_gradebook(root, coursedir.db_url) as book:
            late = late_submissions(book, settings, self.subject)
        return note(settings, late, whole_class=not self.subject)


def _jupyter_server_extension_points():
    return [{"module": "autograder.formgrader.raw_scores"}]


def _load_jupyter_server_extension(serverapp):
    webapp = serverapp.web_app
    RawScoreNote.prefix = url_path_join(webapp.settings["base_url"], "formgrader/")
    RawScoreNote.settings = webapp.settings
    webapp.transforms.append(RawScoreNote)
    serverapp.log.info("Attention Lab: Formgrader's pages say that their scores are raw (before the late penalty)")
