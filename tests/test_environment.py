"""The environment: environment.yml mirrors pyproject.toml, constraints pin everything, `make floors`
has a floor for every runtime dependency and reports what a student would see, and setup() shows
figures inline on old Matplotlib."""

from __future__ import annotations

import re
import subprocess
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

import nbformat
import pytest
import yaml
from packaging.requirements import Requirement

from attention_lab.device import INLINE_BACKEND, show_figures_inline
from benchmarks.floors import floor_pins, floors_constraints, notebook_problems
from tests.conftest import REPO_ROOT


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def _pyproject_requirements() -> list[Requirement]:
    project = _pyproject()
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]


def _by_name(requirements: list[Requirement]) -> dict[str, tuple[str, str]]:
    """name -> (version range, environment marker), the parts two lists must agree on."""
    return {_normalise(r.name): (str(r.specifier), str(r.marker or "")) for r in requirements}


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO_ROOT / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[_normalise(name)] = version.strip()
    return pins


def test_environment_yml_mirrors_pyproject():
    environment = yaml.safe_load((REPO_ROOT / "environment.yml").read_text())
    pip_section = next(item["pip"] for item in environment["dependencies"] if isinstance(item, dict))
    assert _by_name([Requirement(r) for r in pip_section]) == _by_name(_pyproject_requirements())
    python = next(item for item in environment["dependencies"] if isinstance(item, str) and item.startswith("python"))
    assert python == "python" + _pyproject()["requires-python"]


def test_constraints_pin_every_direct_dependency_within_its_range():
    """Every requirement is pinned, including those whose marker excludes this interpreter."""
    pins = _pins()
    for requirement in _pyproject_requirements():
        name = _normalise(requirement.name)
        assert name in pins, f"{requirement.name} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pins[name]), \
            f"the pinned {name}=={pins[name]} is outside pyproject's range {requirement.specifier}"
    assert pins["torch"] == "2.13.0", "torch is pinned to the release that installs as a CPU build here"


def test_installed_versions_are_the_pinned_ones():
    """`make setup` installs with -c constraints.txt: what the tests run on is what is pinned."""
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
    installed = {}
    for line in frozen.splitlines():
        if "==" in line:
            name, version = line.split("==")
            installed[_normalise(name)] = version.split("+")[0]
    pins = _pins()
    for requirement in _pyproject_requirements():
        name = _normalise(requirement.name)
        if requirement.marker is None or requirement.marker.evaluate():  # tomli: 3.10 only
            assert installed.get(name) == pins[name], name


class _FakeKernelShell:
    """Just enough of IPython's kernel shell: a kernel, and line magics that are recorded."""

    kernel = object()

    def __init__(self):
        self.magics = []

    def run_line_magic(self, name, line):
        self.magics.append((name, line))


@pytest.mark.parametrize("mplbackend, shell, activated", [
    (None, _FakeKernelShell(), True),          # a Jupyter kernel left to its default backend
    (INLINE_BACKEND, _FakeKernelShell(), True),  # what ipykernel itself puts in MPLBACKEND
    ("Agg", _FakeKernelShell(), False),        # a backend the user chose is kept
    (None, None, False),                       # plain Python: no IPython shell
])
def test_setup_activates_the_inline_backend_only_in_a_kernel_left_to_it(monkeypatch, mplbackend, shell, activated):
    """With IPython 9 and Matplotlib < 3.9 the first figure shows as text unless this runs."""
    import IPython

    if mplbackend is None:
        monkeypatch.delenv("MPLBACKEND", raising=False)
    else:
        monkeypatch.setenv("MPLBACKEND", mplbackend)
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    show_figures_inline()
    if shell is not None:
        assert shell.magics == ([("matplotlib", "inline")] if activated else [])


def test_every_runtime_dependency_has_a_floor_that_make_floors_installs():
    """`make floors` installs each runtime dependency at its lower bound: each must have one."""
    floors = dict(line.split("==") for line in floors_constraints((REPO_ROOT / "pyproject.toml").read_text()).split())
    runtime = [Requirement(r) for r in _pyproject()["dependencies"]]
    assert set(floors) == {_normalise(r.name) for r in runtime}
    for requirement in runtime:
        assert requirement.specifier.contains(floors[_normalise(requirement.name)]), requirement
    with pytest.raises(ValueError, match="no plain lower bound"):
        floor_pins(["numpy~=1.24"])


def test_the_floors_report_flags_what_a_student_would_see_go_wrong():
    figure_as_text = nbformat.v4.new_output("display_data", data={"text/plain": "<Figure size 640x480 with 3 Axes>"})
    figure = nbformat.v4.new_output("display_data", data={"text/plain": "<Figure size 640x480 with 1 Axes>",
                                                          "image/png": "iVBORw0KGgo="})
    warning = nbformat.v4.new_output("stream", name="stderr", text="UserWarning: something is deprecated\n")
    error = nbformat.v4.new_output("error", ename="ValueError", evalue="bad shape", traceback=[])
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(outputs=[figure]),
        nbformat.v4.new_code_cell(outputs=[figure_as_text]),
        nbformat.v4.new_code_cell(outputs=[nbformat.v4.new_output("stream", name="stderr", text="\n"), warning]),
        nbformat.v4.new_code_cell(outputs=[error], metadata={"nbgrader": {"grade_id": "test_split_heads"}}),
    ])
    assert notebook_problems(notebook) == [
        "cell 2: a figure came out as text: <Figure size 640x480 with 3 Axes>",
        "cell 3: printed to stderr: UserWarning: something is deprecated",
        "test_split_heads: ValueError: bad shape",
    ]


@pytest.mark.xdist_group("group_probe")
def test_tests_of_one_xdist_group_run_together(request):
    """`make test` keeps each xdist_group on one worker (one graded class, one server, one
    cluster per group).  pytest-xdist 3.8 marks a test's group in its node id, which pytest
    9.2 ignores (pytest-xdist#1386): the groups are then split silently and the suite runs
    each set-up twice.  constraints.txt pins a pytest that works; this catches a change."""
    if not request.config.getoption("loadgroup", False):
        pytest.skip("runs under `pytest -n N --dist loadgroup` (make test)")
    assert request.node.nodeid.endswith("@group_probe"), (
        f"pytest {pytest.__version__} with this pytest-xdist does not keep xdist_group tests together: "
        f"this test's node id is {request.node.nodeid!r}, with no '@group_probe' (pytest-xdist#1386); "
        "install the versions pinned in constraints.txt (make setup)")


def test_the_slow_tests_are_handed_out_first(request):
    """tests/conftest.py puts every slow test before the others: pytest-xdist hands them out in
    this order (its groups of several tests first), and a slow test started last keeps one
    worker busy alone at the end of `make test`."""
    slow = [item.get_closest_marker("slow") is not None for item in request.session.items]
    first_quick = slow.index(False) if False in slow else len(slow)
    late = [item.nodeid for item, is_slow in zip(request.session.items[first_quick:], slow[first_quick:]) if is_slow]
    assert not late, f"slow tests collected after a quick one: {late[:5]}"
