"""No working answer ships in the student package: every check fails on everything the package defines.

The package is installed on students' machines (Colab installs it), so a function or class in
it that passes a check *is* a solution, whatever it is called. Comparing lines of text cannot
see a reference written differently from the solution; calling the checks on every function
and class the package defines can.

Calling 55 checks on 230 objects in full would take minutes, since some checks do expensive
work before they first call the answer (re-running an experiment, building a model). So each
check is first probed with a stand-in answer that records the first call the check makes and
raises: if the check fails after that one call whatever common exception the call raises, an
object that raises on the same call (replayed directly, with copies of the same arguments)
fails the check too, and is not run in full. Every other object is run through the check in
full. A check that never calls its stand-in judges its answer by what it is (a string for a
multiple-choice question, a dataclass for a config): it is run in full on every class and on
one function.

A check of several answers (``check_llama_attention_kv_cache(LlamaAttention, KVCache)``) is
tried with the package's objects named like its other answers in their places; where the
package defines none (today: ``check_llama_attention_kv_cache``, ``check_load_torch_mha_weights``,
``check_fourier_beats_identity``, ``check_train_classifier_outcome``) it is not tried, and the
single-answer checks of those answers stand guard instead.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib
import inspect
import io
import pkgutil
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import matplotlib.pyplot as plt
import pytest

import attention_lab
from attention_lab.checking import HINT_LOG_ENV_VAR, CheckFailure, registered_checks

# The exception types a failing first call commonly raises.
PROBED_ERRORS = (TypeError, ValueError, RuntimeError, AttributeError, IndexError, KeyError,
                 NotImplementedError, AssertionError, ZeroDivisionError)


def package_checks() -> list[Callable]:
    """Every check of every notebook (imports all check modules, which register their checks)."""
    for info in pkgutil.iter_modules(importlib.import_module("attention_lab.checks").__path__):
        importlib.import_module(f"attention_lab.checks.{info.name}")
    checks = {id(c): c for group in registered_checks().values() for c in group
              if c.__module__.startswith("attention_lab.checks.")}
    return sorted(checks.values(), key=lambda c: (c.__module__, c.__name__))


def package_objects() -> dict[str, Any]:
    """Every function and class defined in the attention_lab package (private ones included), checks excepted."""
    checks = {id(c) for c in package_checks()}
    modules = [attention_lab] + [importlib.import_module(info.name)
                                 for info in pkgutil.walk_packages(attention_lab.__path__, "attention_lab.")]
    objects = {}
    for module in modules:
        for name, obj in vars(module).items():
            defined_here = getattr(obj, "__module__", None) == module.__name__
            if defined_here and (inspect.isfunction(obj) or inspect.isclass(obj)) and id(obj) not in checks:
                objects[f"{module.__name__}.{name}"] = obj
    return objects


class _Stop(BaseException):
    """Raised by nothing but a probe's stand-in, to tell "the check called me" from its own failures."""


@dataclass
class _StandIn:
    """An answer that records each call and raises ``error`` (or whatever the probe asks)."""

    error: BaseException
    calls: list = field(default_factory=list)
    __signature__: inspect.Signature | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((copy.deepcopy(args), copy.deepcopy(kwargs)))
        raise self.error


def _quietly(function: Callable, *args: Any, **kwargs: Any) -> BaseException | None:
    """Run ``function``; return what it raised (None if it returned). Output and figures are discarded."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")  # objects called with arguments never meant for them complain
            function(*args, **kwargs)
        return None
    except (Exception, _Stop) as error:
        return error
    finally:
        plt.close("all")


_PARAMETERS = re.compile(r"should take the parameters \(([^)]*)\)")


def _stand_in(error: BaseException, parameters: list[str]) -> _StandIn:
    stand_in = _StandIn(error)
    if parameters:  # a check that looks at the parameter names first must see the right ones
        stand_in.__signature__ = inspect.Signature(
            [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in parameters])
    return stand_in


@dataclass
class Probe:
    first_call: tuple | None  # (args, kwargs) of the check's first call of its answer, if it makes one
    fatal_errors: tuple[type, ...]  # errors that, raised by that call, make the check fail at once


def probe(check_function: Callable, others: tuple) -> Probe:
    parameters: list[str] = []
    for _attempt in range(3):  # learn the parameter names a signature check asks for
        stand_in = _stand_in(_Stop(), parameters)
        outcome = _quietly(check_function, stand_in, *others, device="cpu", quiet=True)
        wanted = _PARAMETERS.search(str(outcome)) if isinstance(outcome, CheckFailure) and not stand_in.calls else None
        if not wanted:
            break
        parameters = [name.strip() for name in wanted.group(1).split(",") if name.strip()]
    if not stand_in.calls:
        return Probe(None, ())
    fatal = []
    for error_type in PROBED_ERRORS:
        stand_in = _stand_in(error_type("probe"), parameters)
        outcome = _quietly(check_function, stand_in, *others, device="cpu", quiet=True)
        if outcome is not None and len(stand_in.calls) == 1:
            fatal.append(error_type)
    return Probe(stand_in.calls[0] if stand_in.calls else None, tuple(fatal))


def _fails_at_first_call(candidate: Any, found: Probe) -> bool:
    if found.first_call is None or not found.fatal_errors:
        return False
    args, kwargs = copy.deepcopy(found.first_call)
    error = _quietly(candidate, *args, **kwargs)
    return error is not None and type(error) in found.fatal_errors


def _other_answers(check_function: Callable, objects: dict[str, Any]) -> tuple | None:
    """For a check of several answers (e.g. LlamaAttention with KVCache): the package's objects
    named like the other answers, or None when there are none (the check is then not tried)."""
    names = [p.name for p in inspect.signature(check_function).parameters.values()
             if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
    others = []
    for name in names:
        matches = [obj for label, obj in objects.items() if label.rsplit(".", 1)[-1].lstrip("_").lower() == name.lower()]
        if not matches:
            return None
        others.append(matches[0])
    return tuple(others)


def leaks(check_function: Callable, objects: dict[str, Any]) -> list[str]:
    """The package objects that pass ``check_function``."""
    others = _other_answers(check_function, objects)
    if others is None:
        return []
    found = probe(check_function, others)
    candidates = objects
    if found.first_call is None:  # judges its answer by what it is (a string, a dataclass): every class, one function
        first_function = next(label for label, obj in objects.items() if inspect.isfunction(obj))
        candidates = {label: obj for label, obj in objects.items() if inspect.isclass(obj) or label == first_function}
    passing = []
    for label, candidate in candidates.items():
        if _fails_at_first_call(candidate, found):
            continue
        if _quietly(check_function, candidate, *others, device="cpu", quiet=True) is None:
            passing.append(label)
    return passing


_CHECKS = package_checks()


@pytest.fixture(autouse=True)
def _not_counted_for_hint_coverage(monkeypatch):
    """Failures of package objects that are not answers say nothing about which hints tests reach."""
    monkeypatch.delenv(HINT_LOG_ENV_VAR, raising=False)


@pytest.mark.parametrize("check_function", _CHECKS, ids=[f"{c.__module__.rsplit('.', 1)[-1]}.{c.__name__}" for c in _CHECKS])
def test_no_function_or_class_of_the_package_passes_a_check(check_function):
    passing = leaks(check_function, package_objects())
    assert not passing, (f"{check_function.__name__} passes on {passing}: a working answer ships in the student "
                         "package. Write the reference so it cannot be used as an answer (e.g. inline it in the "
                         "check, or give it a different contract), or compute the expected output another way.")


# --------------------------------------------------------------------------------------
# The test's own machinery must be able to see a leak
# --------------------------------------------------------------------------------------


def test_the_probe_learns_the_first_call_and_which_errors_end_the_check():
    from attention_lab.checks import mha_shapes

    found = probe(mha_shapes.check_merge_heads, ())
    (x,), kwargs = found.first_call
    assert x.dim() == 4 and kwargs == {}  # merge_heads(x) with x [B, H, S, d_head]
    assert TypeError in found.fatal_errors and RuntimeError in found.fatal_errors


def test_a_working_answer_hidden_anywhere_in_the_package_is_caught(monkeypatch):
    from attention_lab.checks import mha_shapes

    def merge_heads_copy(x):  # as if a widget had shipped a working merge_heads
        return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)

    def unrelated(a, b, c):
        return a

    objects = {"attention_lab.widgets.fake.merge_heads_copy": merge_heads_copy,
               "attention_lab.widgets.fake.unrelated": unrelated, "attention_lab.widgets.fake.Thing": dict}
    assert leaks(mha_shapes.check_merge_heads, objects) == ["attention_lab.widgets.fake.merge_heads_copy"]
    assert leaks(mha_shapes.check_split_heads, objects) == []


# --------------------------------------------------------------------------------------
# Multiple-choice answers: never in clear in the installed package (issue #34)
# --------------------------------------------------------------------------------------


def _module_dicts(tree: ast.Module) -> dict[str, ast.Dict]:
    return {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Dict) for target in node.targets if isinstance(target, ast.Name)}


def test_no_check_module_holds_a_multiple_choice_answer_in_clear():
    # The right letter is stored as its salted digest, and so are the keys of the per-option hints (hints keyed
    # by the wrong letters would name the right one by elimination).
    import attention_lab.checks

    calls = 0
    for info in pkgutil.iter_modules(attention_lab.checks.__path__):
        module = importlib.import_module(f"attention_lab.checks.{info.name}")
        tree = ast.parse(inspect.getsource(module))
        dicts = _module_dicts(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "expect_choice"):
                continue
            calls += 1
            keywords = {keyword.arg: keyword.value for keyword in node.keywords}
            assert "correct" not in keywords, f"{info.name}, line {node.lineno}: a letter in clear"
            digest = keywords["correct_digest"]
            assert not (isinstance(digest, ast.Constant) and len(str(digest.value)) < 16), \
                f"{info.name}, line {node.lineno}: correct_digest={ast.unparse(digest)} is no digest"
            hints = keywords.get("hints")
            if isinstance(hints, ast.Name):
                keys = [key.value for key in dicts[hints.id].keys if isinstance(key, ast.Constant)]
                assert keys and all(re.fullmatch(r"[0-9a-f]{16}", key) for key in keys), \
                    f"{info.name}: {hints.id} is keyed by {keys}, not by digests"
    assert calls >= 7  # the multiple-choice questions of notebooks 01-04


def test_a_choice_digest_matches_its_letter_only():
    from attention_lab.checking import choice_digest

    assert choice_digest("ANSWER_X", " b ") == choice_digest("ANSWER_X", "B")
    assert len({choice_digest("ANSWER_X", letter) for letter in "ABCD"}) == 4
    assert choice_digest("ANSWER_X", "B") != choice_digest("ANSWER_Y", "B")
