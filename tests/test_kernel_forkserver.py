"""Grading kernels forked from the nbgrader process's sandboxed kernel server (autograder.isolation.kernel_forkserver).

* a forked kernel is set up as a kernel started afresh in the same sandbox: same ``sys.path``,
  ``sys.argv`` shape, working folder, environment and resource limits; each draws its own
  random numbers;
* the kernel server refuses to run anywhere but as PID 1 of a sandbox (it kills every other
  process of its PID namespace);
* it imports torch and the course package only for notebooks that start with the course's
  setup cell (a notebook without it would pay for them at every nbgrader process start).

What a student can do to the server, or leave behind for the next student, is tested
through the grading pipeline in tests/test_grading.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import nbformat

from autograder.isolation import kernel_forkserver, sandbox
from autograder.grading.task import starts_with_the_setup_cell
from autograder.publishing.release import build_source, course_repository
from tests.grading_helpers import tiny_notebook

pytestmark = pytest.mark.skipif(sandbox.bwrap_path() is None, reason="the kernel server runs only under bubblewrap")

FACTS = """
import json, os, resource, sys
import numpy
print(json.dumps({
    "path": sys.path, "argv0": os.path.basename(sys.argv[0]), "argv_rest": sys.argv[1:2], "cwd": os.getcwd(),
    "environment": dict(os.environ),
    "start_environment": open("/proc/self/environ", "rb").read().decode(errors="replace"),
    "limits": [resource.getrlimit(r) for r in (resource.RLIMIT_AS, resource.RLIMIT_FSIZE, resource.RLIMIT_CORE)],
    "executable": sys.executable, "uid": os.getuid(), "sandbox_pid_1": open("/proc/1/cmdline").read() != "",
    "tmp_empty": os.listdir("/tmp") in ([], ["ipython"], ["matplotlib"], ["ipython", "matplotlib"]),
    "random": numpy.random.rand(),
}))
"""


SECRET = "hunter2-db-password"


def run_in_kernel(spec_dir: Path, workdir: Path, runtime: Path, code: str) -> dict:
    """Start the grading kernelspec in ``spec_dir`` as nbgrader does (IPC transport), run ``code``."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    specs = KernelSpecManager(kernel_dirs=[str(spec_dir / "kernels")])
    manager = KernelManager(kernel_spec_manager=specs, kernel_name=sandbox.KERNEL_NAME, transport="ipc",
                            ip=str(runtime / "k"), connection_file=str(runtime / "k.json"))
    manager.start_kernel(cwd=str(workdir))
    client = manager.blocking_client()
    client.start_channels()
    printed: list[str] = []
    try:
        client.wait_for_ready(timeout=120)
        reply = client.execute_interactive(code, timeout=120, output_hook=lambda message: printed.append(
            message["content"].get("text", "")) if message["msg_type"] == "stream" else None)
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return json.loads("".join(printed))


@pytest.fixture
def sandbox_folders(tmp_path):
    workroot, runtime = tmp_path / "autograded", tmp_path / "rt"
    workdir = workroot / "ann" / "01_mha_shapes"
    workdir.mkdir(parents=True)
    runtime.mkdir()
    return tmp_path, workroot, workdir, runtime


def test_a_forked_kernel_is_set_up_as_a_fresh_sandboxed_kernel(sandbox_folders, monkeypatch):
    base, workroot, workdir, runtime = sandbox_folders
    limits = {"memory_mb": 3072, "file_mb": 64}
    fresh_spec, forked_spec = base / "fresh", base / "forked"
    sandbox.write_kernelspec(fresh_spec, sandbox.kernel_argv(workdir, runtime, **limits, sandbox=True, hidden=[base]))
    server = kernel_forkserver.Server()
    socket_path = base / "server.sock"
    sandbox.write_kernelspec(forked_spec, sandbox.kernel_client_argv(socket_path, **limits))
    grader = {"JUPYTER_PATH": "/somewhere", "LANG": "C.UTF-8",  # what the nbgrader process sets while it grades, ...
              "ATTENTION_LAB_DB_URL": f"postgresql://grader:{SECRET}@db/course", "AWS_SECRET_ACCESS_KEY": SECRET}
    environment = {**os.environ, **grader, **sandbox.kernel_environment()}  # (... and what it was started with)
    for name, value in grader.items():  # (restored after the test: later tests in this process never see them)
        monkeypatch.setenv(name, value)
    try:
        server.ensure(sandbox.kernel_server_argv(workroot, runtime, hidden=[base]), str(socket_path), environment)
        fresh = run_in_kernel(fresh_spec, workdir, runtime, FACTS)
        forked = [run_in_kernel(forked_spec, workdir, runtime, FACTS) for _ in range(2)]
        assert server.clean()
        assert server.process.poll() is None, "the kernel server stopped"
    finally:
        server.stop()
    for kernel in forked:
        assert {k: v for k, v in kernel.items() if k not in ("random", "start_environment")} == \
            {k: v for k, v in fresh.items() if k not in ("random", "start_environment")}
    assert fresh["limits"][0][0] == 3072 * 2**20 and fresh["cwd"] == str(workdir)
    assert fresh["environment"]["HOME"] == "/tmp" and fresh["environment"]["LANG"] == "C.UTF-8"
    # the grader's own variables (a database password) never reach a kernel, not even through
    # the start-up environment a forked kernel inherits from its server (/proc/self/environ)
    allowed = {*sandbox.INHERITED_ENVIRONMENT, *sandbox.kernel_environment(), *sandbox.SANDBOX_ENVIRONMENT, "PATH",
               "PWD", "TERM"}  # (the last two set anew by bwrap's --chdir and by ipykernel)
    for kernel in (fresh, *forked):
        assert {name for name in kernel["environment"] if name in environment} <= allowed, kernel["environment"]
        assert SECRET not in json.dumps(kernel), "the grader's database password reached a kernel"
    assert forked[0]["random"] != forked[1]["random"], "two forked kernels drew the same numbers"
    assert not socket_path.exists(), "the stopped server's socket is left behind"


def test_the_kernel_server_runs_only_as_pid_1_of_a_sandbox(tmp_path):
    """Outside a PID namespace of its own, kill(-1) would reach every process of the user."""
    result = subprocess.run([sys.executable, str(sandbox.KERNEL_SERVER), "serve", "--listen-fd", "0",
                             "--workdir-root", str(tmp_path), "--runtime-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "runs only as PID 1 of a sandbox" in result.stderr


def test_the_server_preloads_the_course_only_for_notebooks_with_its_setup_cell(tmp_path):
    def source(notebook) -> dict[str, bytes]:
        return {"notebook.ipynb": nbformat.writes(notebook).encode(), "data/other.ipynb": b"not read"}

    assert starts_with_the_setup_cell(source(build_source("01_mha_shapes", course_repository())))
    assert starts_with_the_setup_cell(source(tiny_notebook("value = 42", setup=True)))
    assert not starts_with_the_setup_cell(source(tiny_notebook("value = 42")))
    course_modules = ("ipykernel.kernelapp,torch,torch._dynamo,attention_lab,matplotlib.font_manager,"
                      "attention_lab.widgets.live:warm_up")
    for course, preloaded in ((True, course_modules), (False, "ipykernel.kernelapp")):
        argv = sandbox.kernel_server_argv(tmp_path, tmp_path, course=course)
        assert argv[argv.index("--preload") + 1] == preloaded


FONT_LIST_UNBUILT = """import glob, os, sys
from matplotlib.figure import Figure
assert 'attention_lab.widgets.live' in sys.modules
figure = Figure()
figure.suptitle('a title needs a font')
figure.savefig(os.devnull, format='png')
built = glob.glob(os.path.join(os.environ['MPLCONFIGDIR'], 'fontlist-*.json'))
assert not built, f'this kernel scanned the fonts again: {built}'
"""


def test_a_forked_kernel_draws_with_the_servers_font_list(forked_kernels, tmp_path):
    """The widgets and matplotlib's font list are loaded once, in the server: MPLCONFIGDIR is in
    the sandbox's /tmp, emptied after every student, where each kernel rebuilt the list."""
    if forked_kernels is None:
        pytest.skip("bubblewrap unavailable: notebooks run in fresh kernels")
    from autograder.grading.execute import execute_notebook

    for name in ("first", "second"):  # the second after the server emptied /tmp
        path = tmp_path / f"{name}.ipynb"
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(FONT_LIST_UNBUILT)]), path)
        result = execute_notebook(path, kernels=forked_kernels)
        assert not result.errors, result.summary()


def test_forked_kernels_run_each_notebook_in_a_kernel_of_its_own(forked_kernels, tmp_path):
    """autograder.grading.execute.ForkedKernels (the corpus runs on it): torch already imported, and
    nothing the first notebook leaves -- a variable, a file in /tmp -- reaches the second."""
    if forked_kernels is None:
        pytest.skip("bubblewrap unavailable: notebooks run in fresh kernels")
    from autograder.grading.execute import execute_notebook

    first, second = tmp_path / "first.ipynb", tmp_path / "second.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import sys\nassert 'torch' in sys.modules\nleft_behind = 1\nopen('/tmp/left-behind', 'w').write('x')")]), first)
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import os\nassert 'left_behind' not in globals()\nassert not os.path.exists('/tmp/left-behind')")]), second)
    for path in (first, second):
        result = execute_notebook(path, kernels=forked_kernels)
        assert not result.errors, result.summary()
