"""Reading an answer's code: the shortcuts a check looks for are found however they are spelled,
in the answer or in a helper it calls, from the source or (without one) from the bytecode."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import scipy.special
from scipy.special import softmax as imported_softmax

from attention_lab.code_inspection import answer_functions, find_uses, has_loop, source_available

MATMUL = {"functions": ("numpy.dot", "numpy.matmul", "numpy.einsum"), "methods": ("dot",), "operators": ("@",)}
matmul_alias = np.matmul


def operator_after_asarray(x, W):
    return np.asarray(x) @ W


def in_place_operator(x, W):
    out = np.array(x)
    out @= W
    return out


def module_function(x, W):
    return np.dot(x, W)


def full_module_name(x, W):
    import numpy

    return numpy.einsum("i,ij->j", x, W)


def local_alias(x, W):
    from numpy import einsum as contract

    return contract("i,ij->j", x, W)


def global_alias(x, W):
    return matmul_alias(x, W)


def method_call(x, W):
    return np.asarray(x).dot(W)


def _helper(x, W):
    return x.dot(W)


def through_a_helper(x, W):
    return _helper(x, W)


def explicit_loops(x, W):
    out = np.zeros(W.shape[1])
    for j in range(W.shape[1]):
        out[j] = sum(x[i] * W[i, j] for i in range(W.shape[0]))
    return out


def whole_arrays(x, W):
    return np.sum(np.asarray(x)[:, None] * W, axis=0)


def a_while_loop(x, W):
    j, out = 0, []
    while j < W.shape[1]:
        out.append(float(np.sum(x * W[:, j])))
        j += 1
    return np.array(out)


def mapped(x, W):
    return np.array(list(map(lambda j: np.sum(x * W[:, j]), range(W.shape[1]))))


@pytest.mark.parametrize("answer, written, line_offset", [
    (operator_after_asarray, "@", 1),
    (in_place_operator, "@", 2),
    (module_function, "np.dot", 1),
    (full_module_name, "numpy.einsum", 3),
    (local_alias, "contract", 3),
    (global_alias, "matmul_alias", 1),
    (method_call, "….dot", 1),
    (through_a_helper, "x.dot", 1),
])
def test_find_uses_sees_every_spelling_of_a_matrix_product(answer, written, line_offset):
    uses = find_uses(answer, **MATMUL)
    assert uses, f"{answer.__name__}: no use found"
    assert uses[0].written == written
    function = _helper if answer is through_a_helper else answer
    assert uses[0].line == function.__code__.co_firstlineno + line_offset
    alias = {"contract": "numpy.einsum, ", "matmul_alias": "numpy.matmul, "}.get(written, "")
    assert uses[0].describe() == f"{written} ({alias}in {function.__name__}, line {uses[0].line})"


def test_find_uses_names_what_an_alias_is():
    assert [use.target for use in find_uses(global_alias, **MATMUL)] == ["numpy.matmul"]
    assert [use.target for use in find_uses(local_alias, **MATMUL)] == ["numpy.einsum"]


@pytest.mark.parametrize("answer", [explicit_loops, whole_arrays, a_while_loop, mapped])
def test_find_uses_finds_nothing_in_code_without_the_shortcut(answer):
    assert find_uses(answer, **MATMUL) == []


@pytest.mark.parametrize("answer, loops", [
    (explicit_loops, True), (a_while_loop, True), (mapped, True),
    (whole_arrays, False), (module_function, False), (np.matmul, False),
])
def test_has_loop(answer, loops):
    assert has_loop(answer) is loops


def test_a_library_function_used_as_the_answer_is_found():
    uses = find_uses(scipy.special.softmax, functions=("scipy.special.softmax",))
    assert [use.target for use in uses] == ["scipy.special.softmax"]
    assert find_uses(functools.partial(imported_softmax, axis=0), functions=("scipy.special.softmax",))
    assert find_uses(np.matmul, functions=("numpy.matmul",))


def test_softmax_from_scipy_is_found_however_imported():
    def by_module(x, axis=-1):
        return scipy.special.softmax(x, axis=axis)

    def by_name(x, axis=-1):
        return imported_softmax(x, axis)

    def inside(x, axis=-1):
        from scipy import special

        return np.exp(x - special.logsumexp(x, axis=axis, keepdims=True))

    targets = ("scipy.special.softmax", "scipy.special.logsumexp")
    assert [use.target for use in find_uses(by_module, functions=targets)] == ["scipy.special.softmax"]
    assert [use.target for use in find_uses(by_name, functions=targets)] == ["scipy.special.softmax"]
    assert [use.target for use in find_uses(inside, functions=targets)] == ["scipy.special.logsumexp"]


SOURCE_LESS = '''
import numpy as np
from scipy.special import softmax as sm

def product(x, W):
    return np.asarray(x) @ W

def loops(x, W):
    return np.array([sum(x[i] * W[i, j] for i in range(W.shape[0])) for j in range(W.shape[1])])

def softmax_inside(x, axis=-1):
    import scipy.special as special
    return special.softmax(x, axis=axis)

def by_alias(x, axis=-1):
    return sm(x, axis)

def while_loop(x):
    i = 0
    while i < 3:
        i += 1
    return x

def helper(x, W):
    return np.dot(x, W)

def calls_helper(x, W):
    return helper(x, W)
'''


def test_without_source_the_bytecode_tells_the_same():
    namespace: dict = {}
    exec(compile(SOURCE_LESS, "<no file>", "exec"), namespace)
    assert not source_available(namespace["product"])
    assert [use.written for use in find_uses(namespace["product"], **MATMUL)] == ["@"]
    assert find_uses(namespace["loops"], **MATMUL) == [] and has_loop(namespace["loops"])
    assert not has_loop(namespace["product"])
    assert has_loop(namespace["while_loop"])
    targets = ("scipy.special.softmax",)
    assert [use.target for use in find_uses(namespace["softmax_inside"], functions=targets)] == list(targets)
    assert [use.target for use in find_uses(namespace["by_alias"], functions=targets)] == list(targets)
    uses = find_uses(namespace["calls_helper"], **MATMUL)
    assert [(use.target, use.function) for use in uses] == [("numpy.dot", "helper")]


def test_lambdas_are_read_from_their_bytecode():
    answer = lambda x, W: np.matmul(x, W)  # noqa: E731
    assert [use.target for use in find_uses(answer, **MATMUL)] == ["numpy.matmul"]
    assert not has_loop(answer)


def test_helpers_are_followed_only_within_the_answers_namespace():
    assert answer_functions(through_a_helper) == [through_a_helper, _helper]
    assert answer_functions(through_a_helper, follow_helpers=False) == [through_a_helper]
    assert find_uses(through_a_helper, follow_helpers=False, **MATMUL) == []
    # math.prod is a library function: never read as the student's code.
    assert answer_functions(lambda values: math.prod(values))[1:] == []


def test_a_class_answer_is_read_through_its_methods():
    class Layer:
        def __call__(self, x, W):
            return self.project(x, W)

        def project(self, x, W):
            return x @ W

    assert [use.function for use in find_uses(Layer, **MATMUL)] == ["project"]
    assert [use.function for use in find_uses(Layer(), **MATMUL)] == ["project"]


def test_a_library_imported_only_inside_the_answer_is_still_found():
    """Targets resolve without importing anything new; an import inside the answer is followed."""
    import subprocess
    import sys

    program = '''
import sys
from attention_lab.code_inspection import find_uses

def answer(x, axis=-1):
    from scipy.special import softmax
    return softmax(x, axis=axis)

def plain(x, axis=-1):
    return x

assert "scipy" not in sys.modules
assert find_uses(plain, functions=("scipy.special.softmax",)) == []
assert "scipy" not in sys.modules, "reading code that does not use scipy imported it"
assert [u.target for u in find_uses(answer, functions=("scipy.special.softmax",))] == ["scipy.special.softmax"]
print("ok")
'''
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr
