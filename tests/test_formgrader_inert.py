"""Student content is inert in Formgrader (autograder/formgrader/inert_submissions.py).

Hostile submissions are graded into the gradebook by the pipeline, then a TA opens them in
Formgrader's hand-grading page in the real browser: a written answer with ``<img onerror>``,
a link to ``javascript:``, SVG with script, an iframe, a tracking image, CSS loading from
elsewhere; a code answer whose outputs are HTML with ``<script>``, SVG with script and
JavaScript. Each payload would set a marker in the page and write a file in the course root
through the Jupyter API with the TA's XSRF cookie. None runs, no request leaves for another
host, Formgrader's own scripts run under the page's Content-Security-Policy (no violation),
and a score can still be typed and saved. The instructor lab offers no terminal and starts no
kernel (they would run as the instructor, outside the sandbox)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

import nbformat
import pytest
from nbconvert.exporters import HTMLExporter
from nbgrader.server_extensions.formgrader import handlers as formgrader_handlers
from traitlets.config import Config

from autograder.grading import grade
from autograder.store import gradebook
from autograder.formgrader.inert_submissions import (InertHTMLExporter, content_security_policy, inert_html,
                                                         page_scripts)
from tests.grading_helpers import TINY, tiny_course
from tests.lab_servers import TOKEN, free_port, running_lab, set_formgrader_score, wait_until


ELSEWHERE = "http://203.0.113.7"  # TEST-NET-3: never a real host


def payload(name: str) -> str:
    """JavaScript that marks the page and writes ``<name>.txt`` in the course root (Jupyter API)."""
    return (f"window.top.pwned=(window.top.pwned||[]).concat(['{name}']);"
            "t=(document.cookie.match(/_xsrf=([^;]+)/)||[])[1];"
            f"fetch('/api/contents/{name}.txt',{{method:'PUT',headers:{{'X-XSRFToken':t}},"
            "body:JSON.stringify({type:'file',format:'text',content:'pwned'})})")


WRITTEN = (
    "My reasoning. <img src=x onerror=\"" + payload("img_onerror") + "\">\n\n"
    "[a link](javascript:" + payload("javascript_link") + ")\n\n"
    "<svg onload=\"" + payload("svg_onload") + "\"><script>" + payload("svg_script") + "</script></svg>\n\n"
    "<iframe srcdoc=\"<script>" + payload("iframe") + "</script>\"></iframe>\n\n"
    f"<img src=\"{ELSEWHERE}/tracking.png\"> <div style=\"background:url({ELSEWHERE}/bg.png)\">styled</div>\n\n"
    "<script>" + payload("markdown_script") + "</script>"
)
HTML_OUTPUT = "<b>bold output</b><script>" + payload("html_output") + "</script>"
SVG_OUTPUT = '<svg xmlns="http://www.w3.org/2000/svg"><script>' + payload("svg_output") + "</script></svg>"
CODE = (
    "value = 42\n"
    "from IPython.display import HTML, SVG, Javascript, display\n"
    f"display(HTML({HTML_OUTPUT!r}))\n"
    f"display(SVG({SVG_OUTPUT!r}))\n"
    f"display(Javascript({payload('javascript_output')!r}))\n"
)


# A first name, and a student id a folder could hold (no slash), each trying to run
HOSTILE_FIRST_NAME = "<img src=x onerror=\"" + payload("first_name") + "\">"
HOSTILE_ID = "eve\"+(window.top.pwned=['student_id'])+\"<img src=x onerror=window.top.pwned=['id_markup']>"


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("formgrader-inert")
    root = tiny_course(scratch / "course_root", {"mallory": CODE}, written={"mallory": WRITTEN})
    (root / "nbgrader_config.py").write_text(f"c = get_config()\nc.CourseDirectory.root = {str(root)!r}\n")
    outcomes = grade.grade(root, jobs=1, limits=grade.Limits(timeout=60), log=lambda *_: None)
    assert [o.status for o in outcomes] == ["graded"]
    autograded = (root / "autograded" / "mallory" / TINY / f"{TINY}.ipynb").read_text()
    assert "html_output" in autograded and "application/javascript" in autograded  # the outputs are there
    with gradebook.open_gradebook(root) as gb:  # names as a roster or a folder can bring them
        gb.update_or_create_student("mallory", first_name=HOSTILE_FIRST_NAME, last_name="Moriarty")
        gb.update_or_create_student(HOSTILE_ID)
    # started as the README shows for TAs, with this test's port and token
    port = free_port()
    with running_lab("formgrader", root, scratch, command=FOR_TAS, port=port,
                     replace={"--port=8890": f"--port={port}", "<a long random token>": TOKEN}) as server:
        yield server, root


FOR_TAS = ('make formgrader FORMGRADER_ARGS="--no-browser --ServerApp.ip=0.0.0.0 --port=8890 '
           '--IdentityProvider.token=<a long random token>"')


def start_kernel(server) -> urllib.request.Request:
    return urllib.request.Request(server.url("api/kernels"), data=json.dumps({"name": "python3"}).encode(),
                                  method="POST", headers={"Content-Type": "application/json"})


@pytest.mark.slow
@pytest.mark.xdist_group("formgrader_inert")
def test_a_hostile_submission_runs_nothing_in_formgrader_and_can_still_be_graded(hostile, browser, screenshots):
    server, root = hostile
    page = browser.new_page()
    page.add_init_script("document.addEventListener('securitypolicyviolation', e => "
                         "(window.top.violations = window.top.violations || []).push(e.violatedDirective + ' ' + e.blockedURI))")
    requests = []
    page.on("request", lambda request: requests.append(request.url))
    page.goto(server.url("formgrader"))  # logs in: the token becomes the cookie the payloads would use
    page.goto(server.url(f"formgrader/gradebook/{TINY}/{TINY}"))
    page.locator("table tbody tr").filter(has_text="Moriarty").locator("td.name a:visible").click()
    page.get_by_text("My reasoning.").first.wait_for()
    page.get_by_text("bold output").first.wait_for()
    set_formgrader_score(page, "why_value", "1.5")
    page.locator("a", has_text="a link").first.click()  # a javascript: link, clicked: nothing
    wait_until(page, "() => document.readyState === 'complete'")
    screenshots.take(page, "hostile-submission-inert")
    assert page.evaluate("window.pwned || null") is None
    assert page.evaluate("window.violations || []") == []  # Formgrader's own scripts run under the policy
    assert "<script>" in page.locator("body").inner_text()  # what the student tried is shown, as text
    mathjax = "https://cdnjs.cloudflare.com/ajax/libs/mathjax/"  # Formgrader's own, allowed by the policy
    assert [url for url in requests if not url.startswith((server.base_url, mathjax, "data:"))] == []
    page.close()
    assert sorted(p.name for p in root.glob("*.txt")) == []
    with gradebook.open_gradebook(root) as gb:
        assert gb.find_grade("why_value", TINY, TINY, "mallory").manual_score == 1.5


@pytest.mark.slow
@pytest.mark.xdist_group("formgrader_inert")
def test_formgraders_own_pages_show_hostile_names_as_text(hostile, browser, screenshots):
    """nbgrader's templates print a student's id raw, in the page and in a script
    (``var student_id = "..."``): a folder name or a link could run script there."""
    server, _ = hostile
    page = browser.new_page()
    page.add_init_script("document.addEventListener('securitypolicyviolation', e => "
                         "(window.top.violations = window.top.violations || []).push(e.violatedDirective + ' ' + e.blockedURI))")
    page.goto(server.url("formgrader"))
    page.goto(server.url("formgrader/manage_students/" + urllib.parse.quote(HOSTILE_ID, safe="")))
    page.locator("ol.breadcrumb, ul.breadcrumb").get_by_text(HOSTILE_ID).first.wait_for()
    page.locator("table").get_by_text(TINY).first.wait_for()  # the page's own script ran and listed the work
    assert page.evaluate("window.pwned || null") is None and page.evaluate("window.violations || []") == []
    page.goto(server.url("formgrader/manage_students"))
    page.locator("table").get_by_text("Moriarty").first.wait_for()
    screenshots.take(page, "hostile-names-as-text")
    hostile_id = urllib.parse.quote(HOSTILE_ID, safe="")
    for path in ("formgrader", f"formgrader/manage_submissions/{TINY}", "formgrader/gradebook",
                 f"formgrader/gradebook/{TINY}", f"formgrader/manage_students/mallory/{TINY}",
                 f"formgrader/manage_students/{hostile_id}/{TINY}"):
        page.goto(server.url(path))  # each page's own scripts fill its table under its policy
        page.locator("table tbody tr").first.wait_for()
        assert page.evaluate("window.pwned || null") is None and page.evaluate("window.violations || []") == [], path
    page.goto(server.url(f"formgrader/gradebook/{TINY}/{TINY}"))
    page.locator("table tbody tr").filter(has_text="Moriarty").locator("td.name a:visible").click()
    page.get_by_text("My reasoning.").first.wait_for()
    page.locator("nav span.glyphicon-eye-open").click()  # Formgrader's own onclick handler, allowed by its hash
    page.locator("nav a.name-shown").wait_for()
    assert HOSTILE_FIRST_NAME in page.locator("nav a.name-shown").inner_text()  # the name, as text
    assert page.evaluate("window.pwned || null") is None and page.evaluate("window.violations || []") == []
    page.close()


@pytest.mark.slow
@pytest.mark.xdist_group("formgrader_inert")
def test_formgraders_api_opened_as_a_page_runs_nothing(hostile, browser):
    """Formgrader's API answers JSON as text/html: a link to it (a student's answer may hold
    one) opened in the browser would render the names in it as markup."""
    server, _ = hostile
    page = browser.new_page()
    page.goto(server.url("formgrader"))
    for path in ("formgrader/api/students", f"formgrader/api/submitted_notebooks/{TINY}/{TINY}"):
        response = page.goto(server.url(path))
        assert "Moriarty" in page.content()
        assert "default-src 'none'" in response.headers["content-security-policy"], path
        assert page.evaluate("window.pwned || null") is None, path
    page.close()


@pytest.mark.slow
@pytest.mark.xdist_group("formgrader_inert")
def test_the_policy_alone_stops_the_payloads(hostile, browser):
    """The second layer on its own: the hostile notebook rendered as stock nbgrader renders it
    (nothing sanitised), served from the server's origin with the policy the page gets: no
    payload runs, each blocked by the policy (a violation reported)."""
    server, root = hostile
    config = Config()
    config.HTMLExporter.template_name = "formgrade"
    config.HTMLExporter.extra_template_basedirs = [formgrader_handlers.template_path]
    resources = {"assignment_id": TINY, "notebook_id": TINY, "submission_id": "x", "index": 0, "total": 1,
                 "base_url": "", "student": "mallory", "last_name": None, "first_name": None, "notebook_path": "x"}
    notebook = nbformat.read(root / "autograded" / "mallory" / TINY / f"{TINY}.ipynb", as_version=4)
    raw, _ = HTMLExporter(config=config).from_notebook_node(notebook, resources=dict(resources))
    trusted, _ = InertHTMLExporter(config=config).from_notebook_node(nbformat.v4.new_notebook(),
                                                                     resources=dict(resources))
    assert "<script>window.top.pwned" in raw  # the stock page carries the payloads
    policy = content_security_policy(trusted, HTMLExporter(config=config).mathjax_url)
    page = browser.new_page()
    page.add_init_script("document.addEventListener('securitypolicyviolation', e => "
                         "(window.top.violations = window.top.violations || []).push(e.violatedDirective))")
    address = server.url("formgrader/policy-check")
    page.route(address, lambda route: route.fulfill(status=200, body=raw, headers={
        "Content-Type": "text/html; charset=utf-8", "Content-Security-Policy": policy}))
    page.goto(address)
    page.get_by_text("My reasoning.").first.wait_for()
    wait_until(page, "() => document.readyState === 'complete'")
    violations = page.evaluate("window.violations || []")
    assert page.evaluate("window.pwned || null") is None
    assert any(v.startswith("script-src") for v in violations), violations
    page.close()
    assert sorted(p.name for p in root.glob("*.txt")) == []


@pytest.mark.slow
@pytest.mark.xdist_group("formgrader_inert")
def test_the_page_is_sent_with_a_policy_against_inline_script(hostile):
    server, _ = hostile
    with gradebook.open_gradebook(hostile[1]) as gb:
        submission_id = gb.find_submission_notebook(TINY, TINY, "mallory").id
    with urllib.request.urlopen(server.url(f"formgrader/submissions/{submission_id}/"), timeout=120) as response:
        policy = response.headers["Content-Security-Policy"]
        text = response.read().decode()
    assert "script-src 'self'" in policy and "'unsafe-inline'" not in policy.split("script-src")[1].split(";")[0]
    assert "frame-src 'none'" in policy and "img-src 'self' data:" in policy
    scripts = " ".join(sum(page_scripts(text), []))
    assert "pwned" in text and "pwned" not in scripts  # shown as text, never inside a script or a handler
    # Formgrader's other pages allow their own inline styles only (the submission page's MathJax adds its own)
    with urllib.request.urlopen(server.url("formgrader/manage_students"), timeout=120) as response:
        styles = response.headers["Content-Security-Policy"].split("style-src")[1].split(";")[0]
    assert "'unsafe-inline'" not in styles and "'sha256-" in styles, styles


@pytest.mark.slow
@pytest.mark.xdist_group("formgrader_inert")
def test_the_instructor_lab_has_no_terminal_and_starts_no_kernel(hostile):
    server, _ = hostile
    with pytest.raises(urllib.error.HTTPError) as terminal:
        request = urllib.request.Request(server.url("api/terminals"), data=b"", method="POST")
        urllib.request.urlopen(request, timeout=60)
    assert terminal.value.code in (403, 404)
    with pytest.raises(urllib.error.HTTPError) as kernel:
        urllib.request.urlopen(start_kernel(server), timeout=60)
    assert kernel.value.code == 403 and "INSTRUCTOR_KERNELS=on" in kernel.value.read().decode()
    assert server.api("kernelspecs")["kernelspecs"] == {}


@pytest.mark.slow
def test_instructor_kernels_on_turns_kernels_on_for_that_session(tmp_path):
    """`make formgrader INSTRUCTOR_KERNELS=on`, as the README writes it (its JupyterLab options,
    FORMGRADER_ARGS, from the environment), starts a kernel, and stops with it."""
    root = tmp_path / "course_root"
    root.mkdir()
    (root / "nbgrader_config.py").write_text(f"c = get_config()\nc.CourseDirectory.root = {str(root)!r}\n")
    with running_lab("formgrader", root, tmp_path, command="make formgrader INSTRUCTOR_KERNELS=on") as server:
        assert "python3" in server.api("kernelspecs")["kernelspecs"]
        with urllib.request.urlopen(start_kernel(server), timeout=120) as started:
            assert started.status == 201
            kernel = json.loads(started.read())
        assert [k["id"] for k in server.api("kernels")] == [kernel["id"]]
        urllib.request.urlopen(urllib.request.Request(server.url(f"api/kernels/{kernel['id']}"), method="DELETE"),
                               timeout=60)


@pytest.mark.parametrize("html, kept, gone", [
    ("<img src=x onerror=alert(1)>", "<img", "onerror"),
    ("<a href='javascript:alert(1)'>x</a>", "<a>x</a>", "javascript:"),
    ("<svg onload=alert(1)><script>alert(2)</script></svg>", "&lt;script&gt;", "<script"),
    ("<iframe src='https://example.org'></iframe>", "&lt;iframe", "<iframe"),
    ("<img src='http://203.0.113.7/x.png' alt='plot'>", "alt=\"plot\"", "203.0.113.7"),
    ("<span id='why_value' style='color:red' class='c'>t</span>", "class=\"c\"", "id="),
    ("<a href='https://example.org/docs'>docs</a>", "href=\"https://example.org/docs\"", "onclick"),
    # Bootstrap's backdrop, laid over the score inputs: a class of the page's own is dropped ...
    ("<div class='modal-backdrop in'>over everything</div>", "<div>over everything</div>", "modal"),
    ("<p class='navbar-fixed-top c'>t</p>", "class=\"c\"", "navbar"),
    # ... those of highlighted code stay (nbconvert's own markup of a code cell)
    ("<div class='highlight hl-ipython3'><pre><span class='k'>def</span></pre></div>",
     "<div class=\"highlight hl-ipython3\"><pre><span class=\"k\">def</span>", "<span>def"),
    # MathJax's styling, linking and naming TeX is shown, never run (an HTML-encoded backslash too)
    ("$\\href{javascript:alert(1)}{x}$ and $\\style{position:fixed}{y}$", "\uff3chref{javascript", "\\href"),
    ("$&#92;class{modal-backdrop in}{z} \\cssId{statusmessage}{w} \\unicode{x263a}$", "\uff3cclass{", "\\c"),
])
def test_inert_html_keeps_text_and_drops_what_runs_or_loads(html, kept, gone):
    cleaned = inert_html(html)
    assert kept in cleaned and gone not in cleaned, cleaned


def test_latex_outputs_lose_their_styling_tex():
    from autograder.formgrader.inert_submissions import inert_notebook

    cell = nbformat.v4.new_code_cell("x", outputs=[nbformat.v4.new_output(
        "display_data", data={"text/latex": "$\\bbox[background:red;padding:9in]{x}\\require{action}$"})])
    latex = inert_notebook(nbformat.v4.new_notebook(cells=[cell])).cells[0].outputs[0].data["text/latex"]
    assert "\\bbox" not in latex and "\\require" not in latex and "\uff3cbbox[" in latex, latex
