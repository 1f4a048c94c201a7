"""Student content is inert in Formgrader (a jupyter_server extension of `make formgrader`).

Formgrader's hand-grading page (``/formgrader/submissions/<id>/``) renders a student's
autograded notebook with nbconvert, as it is: a written answer holding ``<img src=x
onerror=...>``, an output that is HTML with a ``<script>``, SVG with script, a
``javascript:`` link or an iframe ran as script in the TA's browser, with the TA's session
(the Jupyter API: files, kernels, terminals). This extension answers Formgrader's page routes
before nbgrader does and renders the same pages with everything a student wrote made inert:

* markdown and raw cells, HTML and markdown outputs pass through :func:`inert_html`: an
  allow-list of text tags (no script, style, iframe, object, svg, form, input; no event
  handler, ``style`` or ``id`` attribute; ``class`` only with the values code highlighting and
  tables use, never one of the page's own, such as Bootstrap's ``modal-backdrop in``, which lays
  a backdrop over the score inputs; links only to http(s) and mailto; images only from
  ``data:image/...``), cleaned by nh3 (the Rust sanitiser ammonia); what is not allowed is shown
  escaped, as text, so the grader sees what the student tried; the TeX commands with which
  MathJax would style, link or name an element (``\\style``, ``\\class``, ``\\cssId``, ``\\href``,
  ``\\unicode``, ``\\bbox``, ``\\require``) lose their backslash there and in LaTeX outputs;
* outputs keep only the kinds Formgrader shows (text, PNG/JPEG, SVG as an image, HTML,
  markdown, LaTeX), rebuilt without their metadata; JavaScript and widget outputs are
  dropped; cell metadata keeps only nbgrader's (escaped), so tags and ids cannot reach the
  page's markup;
* the page is sent with a Content-Security-Policy that allows only Formgrader's own scripts
  (its files, and its inline scripts by their hashes, taken from the same page rendered
  without the student's cells), images from the server or ``data:``, requests to the server
  only, no frames, no plugins: if something got through the sanitiser it would still not run,
  nor load anything from elsewhere (its styles may be inline: MathJax, from its CDN, adds the
  styles of the math it draws as ``<style>`` elements);
* Formgrader's other pages (nbgrader's Jinja templates, which print a student's id raw, even
  inside a script) are rendered with every value escaped, under the same kind of policy, whose
  inline styles too are only the page's own, by their hashes; the
  files nbgrader serves beside a submission, and its API's answers (JSON sent as text/html),
  are sandboxed documents that run nothing if opened as a page.

It also holds the kernel manager that keeps kernels off in the instructor lab
(:class:`KernelsOffManager`, see ``jupyter_server_config.py``).
"""

from __future__ import annotations

import base64
import copy
import functools
import hashlib
import html
import os
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import nbformat
import nh3
from jinja2 import Environment, FileSystemLoader, pass_context
from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager
from jupyter_server.utils import url_path_join
from markupsafe import Markup
from nbconvert.exporters import HTMLExporter
from nbgrader.api import MissingEntry
from nbgrader.server_extensions.formgrader import handlers as formgrader_handlers
from nbgrader.server_extensions.formgrader.base import BaseHandler as FormgraderBaseHandler
from nbgrader.server_extensions.formgrader.base import check_notebook_dir, check_xsrf
from nbgrader.server_extensions.formgrader.handlers import SubmissionFilesHandler, SubmissionHandler
from pygments.token import STANDARD_TYPES
from tornado import web
from tornado.routing import HostMatches, Rule
from tornado.web import OutputTransform, _ApplicationRouter

# --------------------------------------------------------------------------------------
# HTML a student wrote
# --------------------------------------------------------------------------------------

INERT_TAGS = {"a", "abbr", "b", "blockquote", "br", "caption", "code", "col", "colgroup", "dd", "del", "details",
              "div", "dl", "dt", "em", "figcaption", "figure", "h1", "h2", "h3", "h4", "h5", "h6", "hr", "i", "img",
              "ins", "kbd", "li", "mark", "ol", "p", "pre", "q", "s", "samp", "small", "span", "strike", "strong",
              "sub", "summary", "sup", "table", "tbody", "td", "tfoot", "th", "thead", "tr", "u", "ul", "var"}
INERT_ATTRIBUTES = {"*": {"class", "title"}, "a": {"href"}, "img": {"alt", "width", "height", "src"},
                    "td": {"colspan", "rowspan", "align"}, "th": {"colspan", "rowspan", "align"}, "ol": {"start"}}
DATA_IMAGE = re.compile(r"data:image/(png|jpeg|gif|webp|svg\+xml);base64,[A-Za-z0-9+/=\s]*$", re.IGNORECASE)
# The class values student HTML keeps: Pygments' token classes (the code nbconvert highlights, in a
# `highlight` or `hl-<language>` block) and pandas' `dataframe` table. None of them is a class of
# Formgrader's page (Bootstrap's, its own), which would style or lay out what the grader uses.
CODE_CLASSES = frozenset(name for name in STANDARD_TYPES.values() if name) | {"highlight", "dataframe"}
HIGHLIGHT_LANGUAGE = re.compile(r"hl-[a-z0-9]{1,32}")
# TeX commands with which MathJax styles, links or names what it draws, or loads an extension that does.
STYLING_TEX = re.compile(r"\\(style|class|cssId|href|unicode|bbox|require)(?![A-Za-z])")


def _inert_attribute(tag: str, name: str, value: str) -> str | None:
    """Attributes a student's HTML keeps (nh3 has kept only those of INERT_ATTRIBUTES, with safe URLs):
    none that loads anything from elsewhere, no class but those of :data:`CODE_CLASSES`."""
    if name == "class":
        kept = [word for word in value.split() if word in CODE_CLASSES or HIGHLIGHT_LANGUAGE.fullmatch(word)]
        return " ".join(kept) or None
    if tag == "a" and name == "href":
        return None if value.strip().lower().startswith("data:") else value
    if tag == "img" and name == "src":
        return value if DATA_IMAGE.match(value.strip()) else None
    return value


def inert_tex(text: str) -> str:
    """``text`` with the styling TeX commands (:data:`STYLING_TEX`) shown instead of run: ``\\href``
    becomes ``＼href`` (a fullwidth backslash), which MathJax reads as text."""
    return STYLING_TEX.sub(lambda match: "\uff3c" + match.group(1), text)


class _EscapeUnknownTags(HTMLParser):
    """HTML with every tag nh3 would drop written as text instead (``&lt;script&gt;``), and its text
    free of styling TeX: what the grader sees of what the student tried. Only for display: nh3,
    which parses the result as a browser does, decides what may stay a tag."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def _tag(self, tag: str, text: str) -> None:
        self.parts.append(text if tag in INERT_TAGS else html.escape(text, quote=False))

    def handle_starttag(self, tag, attrs):
        self._tag(tag, self.get_starttag_text())

    handle_startendtag = handle_starttag

    def handle_endtag(self, tag):
        self._tag(tag, f"</{tag}>")

    def handle_data(self, data):
        self.parts.append(html.escape(inert_tex(data), quote=False))

    def handle_decl(self, decl):
        self.parts.append(html.escape(f"<!{decl}>", quote=False))

    def unknown_decl(self, data):
        self.parts.append(html.escape(f"<![{data}]>", quote=False))

    def handle_pi(self, data):
        self.parts.append(html.escape(f"<?{data}>", quote=False))


def inert_html(text) -> str:
    """HTML from a student, made inert: an allow-list of text tags and attributes (nh3); the rest
    escaped, shown as text; styling TeX shown, not run (:func:`inert_tex`)."""
    text = text.decode() if isinstance(text, bytes) else str(text)
    escaper = _EscapeUnknownTags()
    escaper.feed(text)
    escaper.close()
    return nh3.clean("".join(escaper.parts), tags=INERT_TAGS, attributes=INERT_ATTRIBUTES,
                     attribute_filter=_inert_attribute, url_schemes={"http", "https", "mailto", "data"},
                     link_rel=None, strip_comments=True)


# --------------------------------------------------------------------------------------
# A notebook a student submitted
# --------------------------------------------------------------------------------------

SHOWN_OUTPUTS = {"text/plain", "text/html", "text/markdown", "text/latex", "image/png", "image/jpeg",
                 "image/svg+xml"}
BASE64 = re.compile(r"[A-Za-z0-9+/=\s]*")
SAFE_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _inert_output(output) -> nbformat.NotebookNode | None:
    """One output rebuilt from the fields Formgrader shows, without metadata; None to drop it."""
    kind = output.get("output_type")
    if kind == "stream":
        return nbformat.v4.new_output("stream", name="stderr" if output.get("name") == "stderr" else "stdout",
                                      text=str(output.get("text", "")))
    if kind == "error":
        return nbformat.v4.new_output("error", ename=str(output.get("ename", "")), evalue=str(output.get("evalue", "")),
                                      traceback=[str(line) for line in output.get("traceback", [])])
    if kind not in ("display_data", "execute_result"):
        return None
    data = {}
    for mimetype, value in dict(output.get("data", {})).items():
        value = "".join(value) if isinstance(value, list) else value
        if mimetype not in SHOWN_OUTPUTS or not isinstance(value, str):
            continue
        if mimetype in ("image/png", "image/jpeg") and not BASE64.fullmatch(value):
            continue
        data[mimetype] = inert_tex(value) if mimetype == "text/latex" else value  # (typeset by MathJax, escaped)
    if not data:
        return None
    if kind == "execute_result":
        count = output.get("execution_count")
        return nbformat.v4.new_output("execute_result", data=data,
                                      execution_count=count if isinstance(count, int) else None)
    return nbformat.v4.new_output("display_data", data=data)


def _escaped(value):
    """nbgrader metadata as the template writes it into attributes: strings escaped."""
    if isinstance(value, str):
        return html.escape(value, quote=True)
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    return None


def inert_notebook(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of ``notebook`` holding nothing that could reach the page as markup or script:
    cells keep their source (markdown is cleaned when rendered) and nbgrader's metadata
    (escaped); outputs are rebuilt (:func:`_inert_output`); cell ids and counts checked."""
    safe = nbformat.v4.new_notebook(metadata={key: copy.deepcopy(notebook.metadata[key])
                                              for key in ("kernelspec", "language_info") if key in notebook.metadata})
    for index, cell in enumerate(notebook.cells):
        kind = cell.get("cell_type")
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else str(source)
        if kind == "code":
            new = nbformat.v4.new_code_cell(source)
            outputs = (_inert_output(o) for o in cell.get("outputs", []) if isinstance(o, dict))
            new.outputs = [o for o in outputs if o is not None]
            count = cell.get("execution_count")
            new.execution_count = count if isinstance(count, int) else None
        elif kind == "markdown":
            new = nbformat.v4.new_markdown_cell(source)
            attachments = cell.get("attachments")
            if isinstance(attachments, dict):  # rendered as data: images, through inert_html
                new.attachments = copy.deepcopy(attachments)
        else:
            new = nbformat.v4.new_raw_cell(source)
        grading = cell.get("metadata", {}).get("nbgrader")
        if isinstance(grading, dict):
            new.metadata["nbgrader"] = {str(key): _escaped(value) for key, value in grading.items()}
        cell_id = cell.get("id")
        new.id = cell_id if isinstance(cell_id, str) and SAFE_ID.fullmatch(cell_id) else f"cell-{index}"
        safe.cells.append(new)
    return safe


class InertHTMLExporter(HTMLExporter):
    """nbgrader's Formgrader exporter (its ``formgrade`` template, its configuration), with the
    notebook made inert first and every piece of student HTML through :func:`inert_html`."""

    @pass_context
    def markdown2html(self, context, source):
        return inert_html(super().markdown2html(context, source))

    def default_filters(self):
        yield from super().default_filters()
        yield ("clean_html", inert_html)   # outputs (text/html, text/markdown) and raw cells

    def from_notebook_node(self, nb, resources=None, **kw):
        self.sanitize_html = True  # the template drops JavaScript and widget outputs, cleans HTML
        return super().from_notebook_node(inert_notebook(nb), resources, **kw)


# --------------------------------------------------------------------------------------
# The page and its Content-Security-Policy
# --------------------------------------------------------------------------------------

class _Scripts(HTMLParser):
    """The inline scripts, event-handler attributes and inline styles of a page, as the browser parses them."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.inline: list[str] = []
        self.handlers: list[str] = []
        self.styles: list[str] = []  # <style> elements and style attributes
        self._in: str | None = None  # "script" or "style" while inside one

    def handle_starttag(self, tag, attrs):
        self.handlers += [value or "" for name, value in attrs if name.startswith("on")]
        self.styles += [value or "" for name, value in attrs if name == "style"]
        if tag == "script" and not any(name == "src" for name, _ in attrs):
            self._in = "script"
            self.inline.append("")
        elif tag == "style":
            self._in = "style"
            self.styles.append("")

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self._in = None

    def handle_data(self, data):
        if self._in == "script":
            self.inline[-1] += data
        elif self._in == "style":
            self.styles[-1] += data


def _parsed(page: str) -> _Scripts:
    parser = _Scripts()
    parser.feed(page)
    parser.close()
    return parser


def page_scripts(page: str) -> tuple[list[str], list[str]]:
    """(inline scripts, event handlers) of an HTML page."""
    parser = _parsed(page)
    return parser.inline, parser.handlers


def _hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@functools.lru_cache(maxsize=1)
def formgrader_script_styles() -> frozenset[str]:
    """The style attributes Formgrader's own scripts write into the markup they build
    (``$("<p ... style='display: none'/>")``): allowed by their hashes too."""
    folder = Path(formgrader_handlers.template_path).parent / "static" / "js"
    found = set()
    for script in folder.glob("*.js"):
        found.update(match.group(2) for match in re.finditer(r"style=(['\"])([^'\"<>]*)\1", script.read_text(errors="replace")))
    return frozenset(found)


def content_security_policy(trusted_page: str, mathjax_url: str = "", inline_styles: bool = False) -> str:
    """The policy for a page whose only scripts are those of ``trusted_page`` (Formgrader's
    template, rendered without student content): its inline scripts and event handlers by
    hash, script files from the server (and MathJax's folder when it comes from a CDN); its
    inline styles, too, are the page's own (by hash, with those of Formgrader's scripts) unless
    ``inline_styles`` (a page with MathJax, which adds the styles of the math it draws)."""
    parsed = _parsed(trusted_page)
    scripts = {_hash(body) for body in parsed.inline}
    handlers = {_hash(body) for body in parsed.handlers}
    mathjax = ""
    parts = urlsplit(mathjax_url or "")
    if parts.scheme == "https" and parts.netloc:
        mathjax = f" https://{parts.netloc}{parts.path.rsplit('/', 1)[0]}/"
    hashes = " ".join(sorted(scripts | handlers))
    styles = " 'unsafe-inline'" if inline_styles else " 'unsafe-hashes' " + " ".join(
        sorted({_hash(style) for style in (*parsed.styles, *formgrader_script_styles())}))
    return "; ".join([
        "default-src 'none'",
        f"script-src 'self'{mathjax}" + (" 'unsafe-hashes'" if handlers else "") + (f" {hashes}" if hashes else ""),
        f"style-src 'self'{styles}{mathjax}",
        f"font-src 'self' data:{mathjax}",
        "img-src 'self' data:",
        "connect-src 'self'",
        "frame-src 'none'", "object-src 'none'", "base-uri 'none'", "form-action 'self'",
        "frame-ancestors 'self'",
    ])


# Formgrader's own pages (nbgrader's Jinja templates, not autoescaped) print a student's id
# raw, in the page and inside a script: ``var student_id = "{{ student_id }}";``. A folder named
# ``x"+alert(1)+"`` (no slash needed) or a link to ``manage_students/<img onerror=...>`` ran.
HTML_SPECIALS = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&#34;"})


def _escaped_value(value):
    """Every value a Formgrader template prints, escaped for the places those templates print
    them (text, double-quoted attributes, double-quoted JavaScript strings); ``'`` is left as
    it is, so that ``O'Brien`` stays a working id in the pages' scripts."""
    if isinstance(value, str) and not isinstance(value, Markup):
        return Markup(value.translate(HTML_SPECIALS))
    return value


# Formgrader's dialogs show a reply's log in a <pre> that does not wrap, inside a dialog 600 px
# wide: a sentence (a refused button's, tests/test_formgrader_buttons.py) ran off its right edge.
# Its lines wrap here, between words, so the whole text is in view at any window width.
READABLE_DIALOGS = ("<style>div.modal div.panel pre { white-space: pre-wrap; word-break: normal; "
                    "overflow-wrap: anywhere; }</style>")


class EscapingRender:
    """Formgrader's pages rendered with every value escaped (:func:`_escaped_value`) and sent
    with a Content-Security-Policy allowing the page's own scripts (all of them the template's:
    an escaped value cannot open a script or an attribute); their dialogs' text wraps
    (:data:`READABLE_DIALOGS`)."""

    def render(self, name, **namespace):
        environment = self.settings.get("attention_lab_escaping_jinja2_env")
        if environment is None:
            environment = Environment(loader=FileSystemLoader([formgrader_handlers.template_path]),
                                      autoescape=True, finalize=_escaped_value)
            self.settings["attention_lab_escaping_jinja2_env"] = environment
        page = environment.get_template(name).render(**namespace).replace("</head>", READABLE_DIALOGS + "</head>", 1)
        self.set_header("Content-Security-Policy", content_security_policy(page))
        return page


class InertSubmissionHandler(EscapingRender, SubmissionHandler):
    """nbgrader's SubmissionHandler.get, rendering through :class:`InertHTMLExporter`, with the
    student's names escaped and the page's Content-Security-Policy."""

    @property
    def exporter(self) -> InertHTMLExporter:
        exporter = self.settings.get("attention_lab_inert_exporter")
        if exporter is None:
            exporter = InertHTMLExporter(config=self.settings["nbgrader_exporter"].config)
            self.settings["attention_lab_inert_exporter"] = exporter
        return exporter

    @web.authenticated
    @check_xsrf
    @check_notebook_dir
    def get(self, submission_id):
        try:
            submission = self.gradebook.find_submission_notebook_by_id(submission_id)
            assignment_id = submission.assignment.assignment.name
            notebook_id = submission.notebook.name
            student_id = submission.student.id
        except MissingEntry:
            raise web.HTTPError(404, "Invalid submission") from None
        if os.path.split(self.request.path)[1] == submission_id:  # as nbgrader: a trailing slash
            url = self.request.path + "/" + ("?" + self.request.query if self.request.query else "")
            return self.redirect(url, permanent=True)
        filename = os.path.join(os.path.abspath(self.coursedir.format_path(
            self.coursedir.autograded_directory, student_id, assignment_id)), f"{notebook_id}.ipynb")
        indices = self.api.get_notebook_submission_indices(assignment_id, notebook_id)
        resources = {"assignment_id": assignment_id, "notebook_id": notebook_id, "student": student_id,
                     "last_name": submission.student.last_name, "first_name": submission.student.first_name,
                     "notebook_path": self.url_prefix + "/" + os.path.relpath(filename, self.coursedir.root),
                     "submission_id": submission.id, "index": indices.get(submission.id, -2),
                     "total": len(indices), "base_url": self.base_url}
        if not os.path.exists(filename):
            self.clear()
            self.set_status(404)
            self.write(self.render("formgrade_404.tpl", resources={**resources, "filename": filename}))
            return
        # nbconvert's template escapes nothing: the names are escaped here
        resources = {key: html.escape(value, quote=True) if isinstance(value, str) and key != "base_url" else value
                     for key, value in resources.items()}
        notebook = nbformat.read(filename, as_version=4)
        page, _ = self.exporter.from_notebook_node(notebook, resources=copy.deepcopy(resources))
        empty = nbformat.v4.new_notebook(metadata=notebook.metadata)
        trusted, _ = self.exporter.from_notebook_node(empty, resources=copy.deepcopy(resources))
        self.set_header("Content-Security-Policy", content_security_policy(trusted, self.exporter.mathjax_url,
                                                                           inline_styles=True))
        self.set_header("Referrer-Policy", "same-origin")  # a student's link learns nothing of this page
        self.write(page)


class InertSubmissionFilesHandler(SubmissionFilesHandler):
    """The files beside a submission (nbgrader serves the autograded folder, for images a
    notebook links to), each as a sandboxed document: an HTML file there runs no script."""

    def set_extra_headers(self, path):
        self.set_header("Content-Security-Policy", "default-src 'none'; img-src 'self' data:; sandbox")
        self.set_header("X-Content-Type-Options", "nosniff")


API_POLICY = "default-src 'none'; frame-ancestors 'none'; sandbox"


class ApiResponsePolicy(OutputTransform):
    """Formgrader's API (nbgrader's, and the rerouted buttons) answers JSON as ``text/html``: a
    link to it opened in the browser rendered the names in it as markup (a student id
    ``<img src=x onerror=...>`` ran). Every answer under ``formgrader/api/`` gets a policy that
    runs nothing there; Formgrader's pages read these answers with XHR, which the policy of the
    answer does not touch."""

    prefix = "/formgrader/api/"   # under the server's base_url, set when the extension loads

    def __init__(self, request):
        super().__init__(request)
        self.applies = request.path.startswith(self.prefix)

    def transform_first_chunk(self, status_code, headers, chunk, finishing):
        if self.applies:
            headers["Content-Security-Policy"] = API_POLICY
            headers["X-Content-Type-Options"] = "nosniff"
        return status_code, headers, chunk


def formgrader_routes() -> list[tuple]:
    """nbgrader's Formgrader page routes, in its order, each handler made safe: the submission
    page inert, the files beside it sandboxed, every other page escaped (:class:`EscapingRender`)."""
    routes = []
    for pattern, handler, *options in formgrader_handlers.default_handlers:
        if handler is SubmissionHandler:
            handler = InertSubmissionHandler
        elif handler is SubmissionFilesHandler:
            handler = InertSubmissionFilesHandler
        elif issubclass(handler, FormgraderBaseHandler) and not issubclass(handler, web.StaticFileHandler):
            handler = type(handler.__name__, (EscapingRender, handler), {"__module__": __name__})
        routes.append((pattern.lstrip("/"), handler, *options))
    return routes


# --------------------------------------------------------------------------------------
# No shell in the instructor lab unless asked for
# --------------------------------------------------------------------------------------

SHELL_VARIABLE = "ATTENTION_LAB_INSTRUCTOR_KERNELS"   # `make formgrader INSTRUCTOR_KERNELS=on`
KERNELS_OFF = ("Kernels are off in the instructor lab: a kernel here runs as you, outside the sandbox, on the "
               "course root with every solution and the gradebook. Formgrader needs none (grading goes through "
               "the pipeline). Start it with `make formgrader INSTRUCTOR_KERNELS=on` to have kernels and terminals.")


class KernelsOffManager(AsyncMappingKernelManager):
    """The instructor lab's kernel manager while kernels are off: every start is refused,
    with the reason and how to turn them on."""

    async def start_kernel(self, *args, **kwargs):
        raise web.HTTPError(403, KERNELS_OFF)


def _jupyter_server_extension_points():
    return [{"module": "autograder.formgrader.inert_submissions"}]


def _load_jupyter_server_extension(serverapp):
    """Put the route first: tornado takes the first rule that matches, whatever order the
    extensions were loaded in (Formgrader's own rules stay, for every other route)."""
    webapp = serverapp.web_app
    routes = [(url_path_join(webapp.settings["base_url"], pattern), *rest) for pattern, *rest in formgrader_routes()]
    webapp.default_router.rules.insert(0, Rule(HostMatches(".*$"), _ApplicationRouter(webapp, routes)))
    ApiResponsePolicy.prefix = url_path_join(webapp.settings["base_url"], "formgrader/api/")
    webapp.transforms.append(ApiResponsePolicy)
    serverapp.log.info("Attention Lab: Formgrader shows student submissions inert (sanitised, "
                       "with a Content-Security-Policy)")
