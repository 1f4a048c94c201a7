"""The environment files agree: environment.yml mirrors pyproject.toml; constraints pin everything."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import yaml
from packaging.requirements import Requirement

from tests.conftest import REPO_ROOT


def _pyproject_requirements() -> dict[str, str]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["dev"]
    return {Requirement(r).name.lower(): str(Requirement(r).specifier) for r in requirements}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_environment_yml_mirrors_pyproject():
    environment = yaml.safe_load((REPO_ROOT / "environment.yml").read_text())
    pip_section = next(item["pip"] for item in environment["dependencies"] if isinstance(item, dict))
    from_yml = {Requirement(r).name.lower(): str(Requirement(r).specifier) for r in pip_section}
    assert from_yml == _pyproject_requirements()
    python = next(item for item in environment["dependencies"] if isinstance(item, str) and item.startswith("python"))
    requires_python = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert python == "python" + requires_python


def test_constraints_pin_every_direct_dependency_within_its_range():
    pins = {}
    for line in (REPO_ROOT / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[_normalise(name)] = version.strip()
    for name, specifier in _pyproject_requirements().items():
        assert _normalise(name) in pins, f"{name} is not pinned in constraints.txt"
        assert Requirement(f"{name}{specifier}").specifier.contains(pins[_normalise(name)]), \
            f"the pinned {name}=={pins[_normalise(name)]} is outside pyproject's range {specifier}"
    assert pins["torch"] == "2.13.0", "torch is pinned to the release that installs as a CPU build here"


def test_installed_versions_are_the_pinned_ones():
    """`make setup` installs with -c constraints.txt: what the tests run on is what is pinned."""
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
    installed = {}
    for line in frozen.splitlines():
        if "==" in line:
            name, version = line.split("==")
            installed[_normalise(name)] = version.split("+")[0]
    pins = {_normalise(l.split("==")[0]): l.split("==")[1].strip()
            for l in (REPO_ROOT / "constraints.txt").read_text().splitlines() if "==" in l}
    for name in _pyproject_requirements():
        assert installed.get(_normalise(name)) == pins[_normalise(name)], name
