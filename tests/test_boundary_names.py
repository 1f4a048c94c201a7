"""The trust boundary in the names: one rule says which cells go to the checker, each probe method
says which side it runs on and each side of the bridge calls only its own, and the trusted side
takes no private name from the student's package."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import nbformat
import pytest

import attention_lab.bridge.probes as probes
from autograder.grading.trusted.checker_client import CHECKED_OUTSIDE_THE_KERNEL, runs_in_the_checker
from autograder.places import AUTOGRADER_DIR

BRIDGE = Path(probes.__file__).parent
CHECKED = CHECKED_OUTSIDE_THE_KERNEL[0]


def cell(kind: str = "code", **nbgrader) -> nbformat.NotebookNode:
    made = nbformat.v4.new_code_cell("check()") if kind == "code" else nbformat.v4.new_markdown_cell("text")
    made.metadata["nbgrader"] = nbgrader
    return made


@pytest.mark.parametrize("given, notebook, expected", [
    (cell(grade=True, grade_id="test_split_heads", points=2), CHECKED, True),        # a graded test cell
    (cell(grade=False, solution=True, grade_id="split_heads"), CHECKED, False),       # an answer cell
    (cell(), CHECKED, False),                                                         # a demo
    (cell("markdown", grade=True, solution=True, grade_id="why"), CHECKED, False),    # a written answer
    (cell(grade=True, grade_id="test_split_heads", points=2), "99_not_checked", False),
])
def test_one_rule_says_which_cells_the_trusted_checker_runs(given, notebook, expected):
    assert runs_in_the_checker(given, notebook) is expected


PROBE_METHODS = {name: method for name, method in vars(probes.Probe).items()
                 if inspect.isfunction(method) and name != "__init__"}


def test_every_method_of_a_probe_says_the_side_it_runs_on():
    sides = {name: getattr(method, "side", None) for name, method in PROBE_METHODS.items()}
    assert None not in sides.values(), f"probe methods without a side: {[n for n, s in sides.items() if s is None]}"
    assert {name for name, side in sides.items() if side == "checker"} == {"accept", "failure"}


def probe_calls(path: Path, function: str | None = None) -> set[str]:
    """The methods of a probe (a name ``probe``) that code in ``path`` calls (in ``function`` only, if named)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if function:
        tree = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == function)
    calls = {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
             and node.func.value.id == "probe"}
    entered = any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "enter_context" and ast.unparse(node.args) == "probe" for node in ast.walk(tree))
    return calls | ({"__enter__", "__exit__"} if entered else set())


def test_each_side_of_the_bridge_calls_only_its_own_side_of_a_probe():
    kernel = probe_calls(BRIDGE / "kernel_side.py") | probe_calls(BRIDGE / "probes.py", "from_requests")
    checker = probe_calls(BRIDGE / "checker_side.py")
    assert kernel and checker
    assert {name: PROBE_METHODS[name].side for name in kernel} == dict.fromkeys(kernel, "kernel")
    assert {name: PROBE_METHODS[name].side for name in checker} == dict.fromkeys(checker, "checker")


def test_the_trusted_side_takes_no_private_name_from_the_students_package():
    private = []
    for path in AUTOGRADER_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attention_lab"):
                private += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and ast.unparse(node.value).startswith("attention_lab"):
                private.append(f"{path.name}: {ast.unparse(node)}")
    assert not private, private
