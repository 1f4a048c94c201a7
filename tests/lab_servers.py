"""Start `make lab` / `make formgrader` for a test, and a headless Chromium to drive them.

The servers are the Makefile's own targets (what a student or instructor runs), pointed at a
scratch folder so that a test never writes into the repository, and with their JupyterLab
settings and workspaces in the scratch folder too (autosave every few seconds, nothing left
in the developer's ~/.jupyter).

The browser is Debian's ``/usr/bin/chromium`` driven by Playwright from PyPI (``make browser``
installs it; ``playwright install`` is never used), kept off the network by its flags.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.readme_commands import start_readme_command, stop_process_group

from tests.conftest import REPO_ROOT

TOKEN = "attention-lab-test"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-quic"]
# The machine running the suite is loaded (2 cores, other tests in parallel): generous limits,
# always waits on a condition, never fixed sleeps.
SERVER_START_SECONDS = 180
AUTOSAVE_SECONDS = 3
SCREENSHOTS_DIR = Path(os.environ.get("ATTENTION_LAB_SCREENSHOTS", REPO_ROOT / "build" / "browser-screenshots"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_get(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


# How often a page checks a condition a test waits for: Playwright's default, every animation
# frame, keeps the page drawing 60 frames a second for as long as it waits (a Run All of notebook
# 03 cost the renderer 1.5 s of CPU more, 13.7-14.4 s against 12.5 s).
POLL_MS = 250


def wait_until(page, expression: str, *, arg=None, timeout: float | None = None) -> None:
    """``page.wait_for_function``, the condition checked every :data:`POLL_MS` ms."""
    page.wait_for_function(expression, arg=arg, timeout=timeout, polling=POLL_MS)


@dataclass
class LabServer:
    """A running JupyterLab: its address, the folder it serves, its log."""

    base_url: str
    root_dir: Path
    log: Path

    def url(self, path: str) -> str:
        separator = "&" if "?" in path else "?"
        return f"{self.base_url}/{path.lstrip('/')}{separator}token={TOKEN}"

    def api(self, path: str) -> dict:
        return json.loads(http_get(self.url(f"api/{path.lstrip('/')}")))


def _lab_settings(settings_dir: Path) -> None:
    """JupyterLab user settings for the test: autosave after a few seconds (default: 2 minutes),
    and every cell in the page (by default only the cells on screen are, so a test could not find them)."""
    settings = {
        ("docmanager-extension", "plugin"): {"autosave": True, "autosaveInterval": AUTOSAVE_SECONDS},
        ("notebook-extension", "tracker"): {"windowingMode": "none"},
    }
    for (extension, plugin), values in settings.items():
        path = settings_dir / "@jupyterlab" / extension / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


@contextlib.contextmanager
def running_lab(target: str, root_dir: Path, scratch: Path, extra_env: dict | None = None, command: str = "",
                replace: dict | None = None, port: int | None = None, students_repository: Path | None = None):
    """``make <target>``, as the README writes it, serving ``root_dir`` on a free port; stopped
    (whole process group) on exit.

    ``command``: another of the README's command lines that starts it (``make formgrader
    DB_URL=...``), its placeholders ``replace`` filled in (tests/readme_commands.py); the test's
    JupyterLab options reach it through the environment, or, where the command names its own,
    ``port`` is the one they name. ``students_repository``: the folder `make publish` wrote, whose own
    ``make <target>`` runs there instead (its ``.venv``, a link to this one, taken as set up)."""
    port = port or free_port()
    log = scratch / f"{target}.log"
    settings_dir = scratch / "lab-settings"
    _lab_settings(settings_dir)
    args = (f"--no-browser --port={port} --ServerApp.ip=127.0.0.1 --IdentityProvider.token={TOKEN} "
            f"--ServerApp.root_dir={root_dir}")
    variable = "LAB_ARGS" if target == "lab" else "FORMGRADER_ARGS"
    # Validate's time limit (autograder/lab/validate.py), stretched up to 3x by load: a test's
    # wait for the dialog (15 min) is longer than the stretched limit (12 min).
    # `make formgrader` serves FORMGRADER_ROOT (its working folder); `make lab` serves course/.
    variables = {variable: args, **({"FORMGRADER_ROOT": str(root_dir)} if target == "formgrader" else {})}
    environment = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings_dir), ATTENTION_LAB_VALIDATE_SECONDS="240",
                       JUPYTERLAB_WORKSPACES_DIR=str(scratch / "lab-workspaces"), **variables, **(extra_env or {}))
    with open(log, "w") as log_file:
        if students_repository is None:
            process = start_readme_command(command or f"make {target}", env=environment, replace=replace,
                                           stdout=log_file, stderr=subprocess.STDOUT)
        else:
            process = subprocess.Popen(["make", "-o", ".venv/.installed", target], cwd=students_repository,
                                       env=environment, stdout=log_file, stderr=subprocess.STDOUT,
                                       start_new_session=True)
    server = LabServer(f"http://127.0.0.1:{port}", root_dir, log)
    try:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while True:
            try:
                server.api("status")
                break
            except OSError:
                if process.poll() is not None:
                    pytest.fail(f"make {target} exited:\n{log.read_text()}")
                if time.monotonic() > deadline:
                    pytest.fail(f"make {target} did not start in {SERVER_START_SECONDS} s:\n{log.read_text()}")
                time.sleep(0.5)  # polling interval, not a wait for something to happen
        yield server
    finally:
        stop_process_group(process, grace=60)


def copy_course(destination: Path) -> Path:
    """The student's folder as a clone has it: the course notebooks and the Validate config."""
    destination.mkdir(parents=True, exist_ok=True)
    for path in sorted((REPO_ROOT / "course").glob("[0-9][0-9]_*.ipynb")) + [REPO_ROOT / "course" / "nbgrader_config.py"]:
        shutil.copy2(path, destination / path.name)
    return destination


def chromium_unavailable_reason() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (make setup installs it)"
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing (make browser installs Debian's chromium)"
    return None


@contextlib.contextmanager
def off_the_network():
    """Chromium's flags that keep it off the network for real: every request to another host
    (Formgrader loads MathJax from a CDN) goes to a proxy that refuses it at once -- a port this
    process holds without listening -- instead of waiting on a network that may drop it silently.

    The browser refuses such requests itself: a Playwright route would intercept every request
    of every page, and routing turns the browser's cache off (each JupyterLab page would fetch
    and compile its scripts again, about 2 s of CPU a page)."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        yield [f"--proxy-server=http://127.0.0.1:{closed.getsockname()[1]}", "--proxy-bypass-list=127.0.0.1;localhost"]


@pytest.fixture(scope="session")
def browser(tmp_path_factory):
    """Headless Debian chromium with a fresh profile, off the network; skipped LOUDLY when missing."""
    reason = chromium_unavailable_reason()
    if reason:
        message = f"BROWSER TESTS NOT RUN: {reason}"
        warnings.warn(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    with off_the_network() as proxy_flags, sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS + proxy_flags,
            viewport={"width": 1400, "height": 1000},
        )
        context.set_default_timeout(120_000)
        try:
            yield context
        finally:
            context.close()


class Screenshots:
    """Numbered screenshots of one test's steps under SCREENSHOTS_DIR/<test> (artifacts, not compared)."""

    def __init__(self, test_name: str):
        self.folder = SCREENSHOTS_DIR / test_name
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True)
        self.count = 0
        print(f"screenshots: {self.folder}")

    def take(self, page, step: str) -> Path:
        self.count += 1
        path = self.folder / f"{self.count:02d}-{step}.png"
        page.screenshot(path=str(path))
        return path


@pytest.fixture
def screenshots(request) -> Screenshots:
    return Screenshots(request.node.name.replace("/", "_").replace("[", "-").rstrip("]"))


def set_formgrader_score(page, grade_id: str, score: str) -> None:
    """Type a score into Formgrader's box for a graded cell; wait until Formgrader stored it.

    Formgrader's grading page binds its score boxes only once the window has loaded and its
    grades and comments have come back from its API (binding also rewrites each box with the
    stored score): a score typed before that is never sent, the timeout seen under load.
    """
    wait_until(page, "() => window.formgrader && formgrader.grades && formgrader.grades.loaded"
                     " && formgrader.comments && formgrader.comments.loaded")
    box = page.locator(f"input.score#{grade_id}")
    with page.expect_response(lambda r: "/formgrader/api/grade/" in r.url and r.request.method == "PUT" and r.ok):
        box.fill(score)
        box.press("Tab")
