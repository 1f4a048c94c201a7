"""autograder/'s layout, measured from its imports: folders that import each other one way only (no
circle, no import running up, none hidden in a function), and the commands that moved into a folder
still run by their old names, saying where they went."""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from autograder import MOVED_COMMANDS
from autograder.places import AUTOGRADER_DIR, REPO_ROOT


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in AUTOGRADER_DIR.rglob("*.py") if "course_root" not in path.parts}


def folder(module: str) -> str:
    """The package a module lies in (a package's ``__init__`` lies in the package itself)."""
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement names (``from a import b``: ``a.b`` where that is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    return [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES | MOVED_COMMANDS else node.module
            for alias in node.names]


def imports_of(path: Path) -> list[tuple[str, bool]]:
    """``(module, inside a function)`` for every import statement of the file."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and not getattr(child, "level", 0):
                found.extend((name, in_function) for name in imported(child))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return found


def known(name: str) -> str | None:
    """The autograder module ``name`` names (itself, or the module one of its names lies in)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


ARROWS = {module: {target for name, _ in imports_of(path) if (target := known(name)) and target != module}
          for module, path in MODULES.items()}


def reachable(start: str, arrows: dict[str, set[str]]) -> set[str]:
    seen, pending = set(), [start]
    while pending:
        for following in arrows.get(pending.pop(), ()):
            if following not in seen:
                seen.add(following)
                pending.append(following)
    return seen


def test_no_module_of_autograder_imports_itself_back():
    circles = sorted(module for module in MODULES if module in reachable(module, ARROWS))
    assert not circles, f"modules in an import circle: {circles}"


def test_the_folders_import_each_other_one_way_only():
    """A folder never imports from a folder that (through others) imports from it: no import runs up."""
    folders: dict[str, set[str]] = {}
    for module, targets in ARROWS.items():
        folders.setdefault(folder(module), set()).update(folder(t) for t in targets if folder(t) != folder(module))
    running_up = sorted(f"{module} -> {target}" for module, targets in ARROWS.items() for target in targets
                        if folder(target) != folder(module) and folder(module) in reachable(folder(target), folders))
    assert not running_up, "imports between folders that import each other:\n" + "\n".join(running_up)


def test_no_import_of_the_package_hides_in_a_function():
    """An import of autograder inside a function is how a circle hides: every one is at the top of its module."""
    hidden = sorted(f"{module}: {name}" for module, path in MODULES.items()
                    for name, in_function in imports_of(path) if in_function and known(name))
    assert not hidden, "imports inside functions:\n" + "\n".join(hidden)


def test_code_imports_a_moved_command_by_its_new_name_only():
    """The old names are for people typing `python -m`; code that imported one would run a second copy."""
    files = [path for top in ("autograder", "tests", "benchmarks") for path in (REPO_ROOT / top).rglob("*.py")
             if "corpus" not in path.parts and "course_root" not in path.parts]
    stale = sorted(f"{path.relative_to(REPO_ROOT)}: {name}" for path in files for name, _ in imports_of(path)
                   if name in MOVED_COMMANDS or name == "autograder.settings")
    assert not stale, "imports of an old name (see MOVED_COMMANDS for the new one):\n" + "\n".join(stale)


def test_nothing_runs_or_documents_a_moved_command_by_its_old_name():
    """The code, the Makefile and the docs name each command where it is (the old names are
    for an instructor's habit: this package's table and the changelog name them)."""
    old = re.compile(r"(?<![\w.])(" + "|".join(re.escape(name) for name in MOVED_COMMANDS) + r")(?![\w.])")
    files = [REPO_ROOT / "Makefile", REPO_ROOT / "README.md", *(REPO_ROOT / "docs").rglob("*.md"),
             *(path for top in ("autograder", "tests", "benchmarks") for path in (REPO_ROOT / top).rglob("*.py")
               if "corpus" not in path.parts and "course_root" not in path.parts)]
    explained = {AUTOGRADER_DIR / "__init__.py", Path(__file__)}
    stale = sorted(f"{path.relative_to(REPO_ROOT)}: {match.group(1)}" for path in files if path not in explained
                   for match in old.finditer(path.read_text(encoding="utf-8")))
    assert not stale, stale


def test_a_moved_command_runs_by_its_old_name_and_says_where_it_went():
    result = subprocess.run([sys.executable, "-m", "autograder.grade", "--help"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--submission-timeout" in result.stdout
    assert "`python -m autograder.grade` is now `python -m autograder.grading.grade`" in result.stderr


@pytest.mark.parametrize("old", sorted(MOVED_COMMANDS))
def test_every_moved_command_runs_the_module_it_moved_to(old, monkeypatch):
    """As `python -m <old> --help` runs it (in this process: one Python for all of them)."""
    monkeypatch.setattr(sys, "argv", [old, "--help"])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as exit:
        runpy.run_module(old, run_name="__main__", alter_sys=True)
    assert exit.value.code == 0
    assert printed.getvalue().startswith("usage:"), printed.getvalue()
    assert importlib.import_module(MOVED_COMMANDS[old]).__doc__.split("\n")[0].strip() in printed.getvalue()


def test_the_checks_package_names_every_module_it_holds():
    import attention_lab.checks as checks

    modules = sorted(path.stem for path in Path(checks.__file__).parent.glob("*.py") if path.stem != "__init__")
    assert [m for m in modules if f"``{m}``" not in checks.__doc__] == []
