"""`make lab` serves the course: JupyterLab with nbgrader's Validate and ipywidgets working."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from tests.conftest import REPO_ROOT

TOKEN = "attention-lab-test"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("lab") / "lab.log"
    args = (f"--no-browser --port={port} --ServerApp.ip=127.0.0.1 --IdentityProvider.token={TOKEN} "
            "--ServerApp.open_browser=False --LabApp.news_url=None --LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate")
    with open(log, "w") as log_file:
        process = subprocess.Popen(["make", "--no-print-directory", "lab", f"LAB_ARGS={args}"], cwd=REPO_ROOT,
                                   stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                _get(f"{base}/api/status?token={TOKEN}")
                break
            except OSError:
                if process.poll() is not None:
                    pytest.fail(f"make lab exited:\n{log.read_text()}")
                time.sleep(0.5)
        else:
            pytest.fail(f"JupyterLab did not start:\n{log.read_text()}")
        yield base
    finally:
        import os
        import signal

        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


def _validate(base: str, path: str) -> dict:
    request = urllib.request.Request(f"{base}/assignments/validate?token={TOKEN}",
                                     data=urllib.parse.urlencode({"path": path}).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read().decode())


@pytest.mark.slow
def test_lab_serves_the_course_folder_with_the_nbgrader_and_widget_extensions(lab_server):
    contents = json.loads(_get(f"{lab_server}/api/contents?token={TOKEN}"))
    names = {item["name"] for item in contents["content"]}
    assert "01_mha_shapes.ipynb" in names
    page = _get(f"{lab_server}/lab?token={TOKEN}")
    assert "@jupyter/nbgrader" in page, "nbgrader's lab extension (Validate button) is not loaded"
    assert "@jupyter-widgets/jupyterlab-manager" in page, "the ipywidgets extension is not loaded"


@pytest.mark.slow
def test_validate_button_reports_the_blanks_and_passes_a_solved_notebook(lab_server, fresh_build):
    scratch = REPO_ROOT / "course" / ".validate-test.ipynb"
    blank = _validate(lab_server, "01_mha_shapes.ipynb")
    assert blank["success"] is True  # the request worked; the notebook's verdict is inside
    assert "failed" in blank["value"] or "NotImplementedError" in json.dumps(blank["value"])
    shutil.copy(fresh_build.source("01_mha_shapes"), scratch)
    try:
        solved = _validate(lab_server, scratch.name)
    finally:
        scratch.unlink()
    assert solved["success"] is True
    assert "failed" not in solved["value"] and "NotImplementedError" not in json.dumps(solved["value"]), solved
