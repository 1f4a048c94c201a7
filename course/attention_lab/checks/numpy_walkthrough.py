"""Checks for notebook 02 -- the NumPy walkthrough.

The answers are NumPy only: every check calls the student's code with ``numpy_only=True``,
so an answer that computes with torch and converts back fails and is told so. The
references are PyTorch in float64 (``F.scaled_dot_product_attention`` on the math backend,
``nn.MultiheadAttention`` holding copies of the student's weights) or definitions written
differently from the idiomatic answer, all computed at check time.

Layout note: the notebook follows the seed and writes projections as ``X @ W`` with ``W``
of shape ``(in, out)``; ``nn.Linear.weight`` and ``in_proj_weight`` are ``(out, in)``, so
the references copy transposes.
"""

from __future__ import annotations

import copy
import functools
import math
import re
import traceback
import tracemalloc
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn as nn

from attention_lab.checking import (
    CheckFailure,
    RuleFailure,
    Variant,
    call_student,
    check,
    describe,
    choice_digest,
    expect_choice,
    expect_close,
    expect_array,
    expect_signature,
    expect_true,
    expect_value_error,
    is_number,
    freeze_module,
    one_cpu_thread,
    reference_sdpa,
    shape_str,
    tolerance,
)
from attention_lab.bridge import probes, wire
from attention_lab.bridge.probes import Probe
from attention_lab.checking import _is_student_file
from attention_lab.code_inspection import find_uses, has_loop

# --------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------


def _rng(seed: int) -> np.random.Generator:
    """A private NumPy generator: checks never disturb the notebook's own random state."""
    return np.random.default_rng(seed)


def _normal(rng: np.random.Generator, *shape: int, dtype=np.float64, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _t(array: np.ndarray) -> torch.Tensor:
    """A float64 CPU tensor holding a copy of ``array`` (for the PyTorch references)."""
    return torch.from_numpy(np.array(array, dtype=np.float64))


def _array(value: Any) -> str:
    return describe(value) if not isinstance(value, np.ndarray) else f"array of shape {shape_str(value.shape)} ({value.dtype})"


def _call(fn: Callable, *args: Any, call: str, matmul_hint: str | None = None, axis_hint: str | None = None,
          **kwargs: Any) -> Any:
    """call_student with NumPy only, and a hint for the broadcasting errors NumPy raises
    (``matmul_hint`` replaces the one for a product of mismatched shapes; ``axis_hint`` is the one for two arrays
    of as many axes, a reduction's kept axis that is not the right one)."""
    try:
        return call_student(fn, *args, call=call, numpy_only=True, **kwargs)
    except CheckFailure as failure:
        text = str(failure)
        if "not implemented yet" in text or "Likely mistake" in text or "NumPy only" in text:
            raise
        if "remapped shapes" in text or ("matmul" in text and "mismatch" in text):  # raised by @
            hint = matmul_hint or ERROR_HINTS["matmul_shapes"]
            raise CheckFailure(f"{text}\n  Likely mistake: {hint}") from failure.__cause__
        if "could not be broadcast" in text:
            # "... with shapes (2,2,6,6) (2,2,1,3)": as many axes is an axis kept (keepdims) but not the right one
            shapes = re.findall(r"\(([\d,]*)\)", text.split("could not be broadcast", 1)[1])
            ranks = {len([size for size in shape.split(",") if size]) for shape in shapes[:2]}  # "(3,)": one axis
            hint = ERROR_HINTS["lost_axis"] if len(ranks) == 2 else axis_hint if len(shapes) >= 2 else None
            if hint:
                raise CheckFailure(f"{text}\n  Likely mistake: {hint}") from failure.__cause__
        raise


def _one_thread(function: Callable) -> Callable:
    """Run a check on one CPU thread: its arrays are tiny, and PyTorch's thread pool costs more
    than it saves on them (tens of milliseconds a call on a busy machine, microseconds on one)."""

    @functools.wraps(function)
    def wrapper(*args: Any, device: torch.device | None = None, **kwargs: Any) -> None:
        with one_cpu_thread(device if device is not None else "cpu"):
            return function(*args, device=device, **kwargs)

    return wrapper


ERROR_HINTS = {
    "matmul_shapes": "a transpose. Q @ Kᵀ needs K with only its last two axes swapped (np.swapaxes(K, -1, -2) "
    "or K.transpose(0, 1, 3, 2)); K.T reverses all four axes.",
    "lost_axis": "a reduction lost its axis. Keep it for broadcasting with keepdims=True (e.g. "
    "np.max(x, axis=axis, keepdims=True)).",
    "kept_axis": "one number per query: drop the kept axis at the end (lse[..., 0], or keepdims=False in the "
    "last reduction).",
}
# The notebook's rule: an answer returns the dtype it was given (float32 in, float32 out).
# Each message leads with the cause that fits its exercise, then states the rule.
_DTYPE_RULE = " The rule of this notebook: float32 in, float32 out."
DTYPE_HINTS = {
    "row": "Create the output with the inputs' dtype, np.zeros(M, dtype=np.result_type(x_row, W)): "
    "np.zeros(M) alone is float64 whatever the inputs." + _DTYPE_RULE,
    "heads": "Reshape, transpose and concatenate keep the dtype: look for a conversion (.astype(...), "
    "np.array(..., dtype=...)) or a new array created without dtype=t.dtype." + _DTYPE_RULE,
    "softmax": "np.max, np.exp, np.sum and arithmetic between arrays keep float32: look for a conversion "
    "(.astype(np.float64), dtype=float) or a new array created without the input's dtype." + _DTYPE_RULE,
    "scaled": "NumPy 2 keeps a float32 array float32 when it meets a Python float, but a NumPy float64 "
    "scalar such as np.sqrt(d) promotes it to float64: divide by math.sqrt(d) (a Python float) or cast "
    "back with .astype(Q.dtype), and create new arrays with dtype=Q.dtype." + _DTYPE_RULE,
}


def _expect_unchanged(before: np.ndarray, after: np.ndarray, call: str, name: str) -> None:
    expect_true(np.array_equal(before, after, equal_nan=True),
                f"{call} changed its input {name} in place. Compute a new array (x = x - m, not x -= m): "
                "the caller still needs the original.")


# --------------------------------------------------------------------------------------
# Exercise: row_times_matrix
# --------------------------------------------------------------------------------------


class ExplicitSums(Probe):
    """Watches the guarded arrays (:class:`_ExplicitSumsOnly`) of one call: the first matrix
    product the answer asked of them (:attr:`used`), even if the answer caught the refusal."""

    active: list["ExplicitSums"] = []

    def __init__(self):
        super().__init__()
        self.used: str | None = None

    def __enter__(self) -> "ExplicitSums":
        ExplicitSums.active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        ExplicitSums.active.remove(self)

    def findings(self) -> str | None:
        return self.used

    def accept(self, findings) -> None:
        self.used = findings[:200] if isinstance(findings, str) else None

    def failure(self) -> CheckFailure | None:
        return CheckFailure(_MATMUL_USED.format(name=self.used)) if self.used else None


def _refuse_matmul(name: str) -> CheckFailure:
    for guard in ExplicitSums.active:
        guard.used = guard.used or name
    return CheckFailure(_MATMUL_USED.format(name=name))


class _ExplicitSumsOnly(np.ndarray):
    """An array that refuses to be multiplied as a matrix: the exercise is to write the sums.

    Elementwise arithmetic, indexing, np.sum and friends work as usual (and return plain
    arrays); ``@``, np.matmul, np.dot, np.einsum, np.inner, np.tensordot, np.vdot raise (and
    tell the :class:`ExplicitSums` watching the call).
    """

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if ufunc.__name__ in _MATRIX_UFUNCS:
            raise _refuse_matmul(f"np.{ufunc.__name__} (the @ operator)")
        inputs = tuple(i.view(np.ndarray) if isinstance(i, _ExplicitSumsOnly) else i for i in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, _ExplicitSumsOnly) else o for o in kwargs["out"])
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        if getattr(func, "__name__", "") in _MATRIX_FUNCTIONS:
            raise _refuse_matmul(f"np.{func.__name__}")
        return super().__array_function__(func, types, args, kwargs)

    def dot(self, *args, **kwargs):
        raise _refuse_matmul(".dot")


_MATRIX_UFUNCS = {"matmul", "vecdot", "matvec", "vecmat"}
_MATRIX_FUNCTIONS = {"dot", "einsum", "inner", "tensordot", "vdot", "multi_dot", "matmul", "vecdot"}
_MATMUL_USED = ("row_times_matrix should write the sums itself -- out[j] = Σ_i x_row[i] · W[i, j], with loops "
                "over j and i -- but it calls {name}. The point of the exercise is what @ does inside; you will "
                "use @ everywhere after it.")
# What reading the answer's code looks for (the array guard above cannot see an answer that first
# converts its input, np.asarray(x_row) @ W).
_ROW_SHORTCUTS = {
    "functions": tuple(f"numpy.{name}" for name in ("dot", "matmul", "einsum", "inner", "tensordot", "vdot", "vecdot",
                                                     "matvec", "vecmat", "linalg.multi_dot", "linalg.matmul",
                                                     "linalg.vecdot", "linalg.tensordot")),
    "methods": ("dot",),
    "operators": ("@",),
}

ROW_HINTS = {
    "transposed": "you computed Σ_j W[i, j] · x_row[j] (that is W @ x_row = x_row @ Wᵀ). Output j is "
    "Σ_i x_row[i] · W[i, j]: x_row runs down column j of W.",
    "wrong_length": "your output has one entry per row of W; it needs one per column: "
    "for j in range(W.shape[1]): out[j] = Σ_i x_row[i] · W[i, j].",
    "no_loop": "row_times_matrix computes the whole product at once, with no loop: a sum of elementwise "
    "products of whole arrays (np.sum(x_row[:, None] * W, axis=0)) is @ in disguise. Write the sums: for "
    "each output j, add up x_row[i] · W[i, j] over i, in a loop (or a comprehension).",
    "index_transposed": "you indexed W[j, i]. W has shape (N, M): its rows are the input features i and "
    "its columns the output features j, so out[j] = Σ_i x_row[i] · W[i, j]. On a square W the swap "
    "computes x_row @ Wᵀ; on this one it runs off the end of W.",
    "loop_ranges": "your loops' ranges are swapped: i runs over the N rows of W (range(W.shape[0])) and j "
    "over its M columns (range(W.shape[1])). They only agree when W is square.",
    "index_error": "an index ran past the end of an array. W has shape (N, M): i runs over range(N) (the "
    "entries of x_row, the rows of W) and j over range(M) (the columns of W, the entries of the output).",
}


def _expect_no_matmul_shortcut(row_times_matrix: Callable) -> None:
    """Read the answer's code: no matrix product in any spelling, and a loop somewhere."""
    uses = find_uses(row_times_matrix, **_ROW_SHORTCUTS)
    if uses:
        raise CheckFailure(_MATMUL_USED.format(name=uses[0].describe()))
    if not has_loop(row_times_matrix):
        raise CheckFailure(f"row_times_matrix has no loop.\n  Likely mistake: {ROW_HINTS['no_loop']}")


def _diagnose_index_error(row_times_matrix: Callable, x_row: np.ndarray, W: np.ndarray) -> str:
    """An IndexError on a non-square W: run the answer on a square W to see which mix-up it is."""
    n = W.shape[0]
    square = np.arange(1.0, n * n + 1.0).reshape(n, n) / n  # distinct entries: every mix-up shows
    try:
        out = np.asarray(row_times_matrix(x_row.view(_ExplicitSumsOnly), square.view(_ExplicitSumsOnly)),
                         dtype=np.float64)
    except Exception:
        return ROW_HINTS["index_error"]
    if out.shape == (n,) and np.allclose(out, square @ x_row):
        return ROW_HINTS["index_transposed"]
    if out.shape == (n,) and np.allclose(out, x_row @ square):
        return ROW_HINTS["loop_ranges"]
    return ROW_HINTS["index_error"]


def _check_row_once(row_times_matrix: Callable, x_row: np.ndarray, W: np.ndarray) -> None:
    n, m = W.shape
    call = f"row_times_matrix(x_row, W) with x_row {_array(x_row)}, W {_array(W)}"
    guarded_x = x_row.view(_ExplicitSumsOnly)
    guarded_W = W.view(_ExplicitSumsOnly)
    try:
        out = _call(row_times_matrix, guarded_x, guarded_W, call=call, probes=[ExplicitSums()])
    except CheckFailure as failure:
        if isinstance(failure.__cause__, IndexError) and n != m and "Likely mistake" not in str(failure):
            hint = _diagnose_index_error(row_times_matrix, x_row, W)
            raise CheckFailure(f"{failure}\n  Likely mistake: {hint}") from failure.__cause__
        raise
    hints = {(n,): ROW_HINTS["wrong_length"]} if n != m else {}
    out = expect_array(out, what=call, shape=(m,), dtype=np.result_type(x_row, W), hints=hints,
                       dtype_hint=DTYPE_HINTS["row"])
    expected = _t(x_row) @ _t(W)
    variants = [Variant(lambda: _t(W) @ _t(x_row), ROW_HINTS["transposed"])] if n == m else []
    expect_close(out, expected, what=call, against="x_row @ W (PyTorch, float64)", variants=variants)


@check("row_times_matrix: explicit sums equal x_row @ W, square and non-square W")
@_one_thread
def check_row_times_matrix(row_times_matrix: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """row_times_matrix: one (N,) @ (N, M) product written as sums, equal to x_row @ W."""
    expect_signature(row_times_matrix, "row_times_matrix", ["x_row", "W"])
    rng = _rng(seed)
    # Non-square first: (N,) @ (N, M) with N != M is where index mix-ups show.
    for index, (n, m, dtype) in enumerate(((4, 3, np.float64), (3, 5, np.float64), (4, 4, np.float64),
                                           (5, 2, np.float32), (1, 1, np.float64))):
        _check_row_once(row_times_matrix, _normal(rng, n, dtype=dtype), _normal(rng, n, m, dtype=dtype))
        if index == 0:  # it runs (a blank is "not implemented yet"): now read how it computes
            _expect_no_matmul_shortcut(row_times_matrix)
    for _ in range(3):
        n, m = (int(v) for v in rng.integers(1, 7, size=2))
        _check_row_once(row_times_matrix, _normal(rng, n), _normal(rng, n, m))


# --------------------------------------------------------------------------------------
# Exercises: np_split_heads and np_merge_heads
# --------------------------------------------------------------------------------------

SPLIT_HINTS = {
    "no_transpose": "you reshaped to (B, S, H, d_head) but did not move the head axis in front of the "
    "sequence axis: add .transpose(0, 2, 1, 3).",
    "reshape_only": "you reshaped straight to (B, H, S, d_head). The shape is right but the numbers are "
    "scrambled: reshape reads memory in order, so 'heads' would cut across tokens. Reshape to "
    "(B, S, H, d_head) first (split the feature axis), then transpose(0, 2, 1, 3).",
    "sequence_axis": "you split the sequence axis into heads (np.split(t, num_heads, axis=1)): each "
    "'head' got a block of tokens with all their features. Heads split the features, the last axis: "
    "np.split(t, num_heads, axis=-1), or reshape to (B, S, H, d_head) and transpose.",
    "strided": "your heads take every H-th feature (reshape to (B, S, d_head, H)); head h must take the "
    "contiguous block of features h*d_head ... (h+1)*d_head - 1.",
}
MERGE_HINTS = {
    "reshape_only": "you reshaped (B, H, S, d) straight to (B, S, H*d). Move the head axis back next to "
    "the features first: .transpose(0, 2, 1, 3), then reshape.",
}


def _split_shape_hints(b: int, s: int, n: int, num_heads: int) -> dict[tuple[int, ...], str]:
    """Wrong shapes that name their mistake: the head axis not moved, or the tokens split instead."""
    hints = {}
    if s % num_heads == 0:
        hints[(b, num_heads, s // num_heads, n)] = SPLIT_HINTS["sequence_axis"]
    hints[(b, s, num_heads, n // num_heads)] = SPLIT_HINTS["no_transpose"]  # wins where both shapes coincide
    return hints


def _split_reference(t: np.ndarray, num_heads: int) -> torch.Tensor:
    """Head h = features h*d ... (h+1)*d - 1 of every token, by slicing (PyTorch, float64)."""
    x = _t(t)
    d_head = x.shape[-1] // num_heads
    return torch.stack([x[..., h * d_head:(h + 1) * d_head] for h in range(num_heads)], dim=1)


def _check_split_once(np_split_heads: Callable, t: np.ndarray, num_heads: int) -> np.ndarray:
    b, s, n = t.shape
    d_head = n // num_heads
    call = f"np_split_heads(t, num_heads={num_heads}) with t {_array(t)}"
    before = t.copy()
    out = _call(np_split_heads, t, num_heads, call=call)
    out = expect_array(out, what=call, shape=(b, num_heads, s, d_head), dtype=t.dtype,
                          hints=_split_shape_hints(b, s, n, num_heads), dtype_hint=DTYPE_HINTS["heads"])
    _expect_unchanged(before, t, call, "t")
    expect_close(out, _split_reference(t, num_heads), what=call,
                 against="head h = features h*d_head ... (h+1)*d_head - 1 of every token",
                 variants=[Variant(lambda: t.reshape(b, num_heads, s, d_head), SPLIT_HINTS["reshape_only"]),
                           Variant(lambda: t.reshape(b, s, d_head, num_heads).transpose(0, 3, 1, 2), SPLIT_HINTS["strided"])])
    return out


@check("np_split_heads: (B, S, D) -> (B, H, S, D//H), values, edge cases and the D % H error")
@_one_thread
def check_np_split_heads(np_split_heads: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """np_split_heads: (B, S, D) -> (B, H, S, D//H), head h = features h*d ... (h+1)*d - 1."""
    expect_signature(np_split_heads, "np_split_heads", ["t", "num_heads"])
    rng = _rng(seed)
    _check_split_once(np_split_heads, _normal(rng, 2, 6, 4), 2)  # the notebook's configuration
    _check_split_once(np_split_heads, _normal(rng, 2, 5, 12, dtype=np.float32), 3)
    _check_split_once(np_split_heads, _normal(rng, 1, 1, 6), 1)
    _check_split_once(np_split_heads, _normal(rng, 3, 1, 8), 4)
    _check_split_once(np_split_heads, _normal(rng, 7, 2, 16).transpose(1, 0, 2), 4)  # not contiguous
    for _ in range(6):
        b, s, h, d = (int(v) for v in rng.integers(1, 6, size=4))
        _check_split_once(np_split_heads, _normal(rng, b, s, h * d), h)
    expect_value_error(np_split_heads, _normal(rng, 2, 3, 10), 4, call="np_split_heads(t, num_heads=4) with D = 10",
                       why="D = 10 is not divisible by 4 heads", must_mention=(10, 4))


def _check_merge_once(np_merge_heads: Callable, t: np.ndarray) -> None:
    b, h, s, d = t.shape
    call = f"np_merge_heads(t) with t {_array(t)}"
    before = t.copy()
    out = _call(np_merge_heads, t, call=call)
    out = expect_array(out, what=call, shape=(b, s, h * d), dtype=t.dtype, dtype_hint=DTYPE_HINTS["heads"])
    _expect_unchanged(before, t, call, "t")
    expected = torch.cat([_t(t)[:, head] for head in range(h)], dim=-1)
    expect_close(out, expected, what=call, against="the heads' features concatenated per token",
                 variants=[Variant(lambda: t.reshape(b, s, h * d), MERGE_HINTS["reshape_only"])])


@check("np_merge_heads: (B, H, S, d) -> (B, S, H*d), values and the round trip with the split")
@_one_thread
def check_np_merge_heads(np_merge_heads: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """np_merge_heads: (B, H, S, d) -> (B, S, H*d), the inverse of np_split_heads."""
    expect_signature(np_merge_heads, "np_merge_heads", ["t"])
    rng = _rng(seed)
    _check_merge_once(np_merge_heads, _normal(rng, 2, 2, 6, 2))
    _check_merge_once(np_merge_heads, _normal(rng, 2, 3, 5, 4, dtype=np.float32))
    # What a split returns is a transposed view: the merge must accept it and undo it exactly.
    x = _normal(rng, 2, 5, 12)
    heads = x.reshape(2, 5, 3, 4).transpose(0, 2, 1, 3)
    _check_merge_once(np_merge_heads, heads)
    round_trip = _call(np_merge_heads, heads, call="np_merge_heads(np_split_heads(x, 3))")
    expect_close(round_trip, _t(x), what="np_merge_heads(np_split_heads(x, 3))", against="x (a round trip)")
    for _ in range(6):
        b, h, s, d = (int(v) for v in rng.integers(1, 6, size=4))
        _check_merge_once(np_merge_heads, _normal(rng, b, h, s, d))


# --------------------------------------------------------------------------------------
# Exercise: np_softmax
# --------------------------------------------------------------------------------------

SOFTMAX_HINTS = {
    "no_max": "np.exp overflowed: exp(1000) is inf in float64 (exp(89) already in float32), and inf/inf is "
    "NaN. Subtract each row's maximum before np.exp: softmax(x) = softmax(x - max(x)), exactly.",
    "global_max": "you subtracted one maximum for the whole array. A row far below it underflows: "
    "every exp(x - max) is 0 and the row becomes 0/0 = NaN. Subtract each row's own maximum: "
    "np.max(x, axis=axis, keepdims=True).",
    "ignores_axis": "the softmax ran over the last axis although a different axis was asked for. Use the "
    "axis argument in the max and in the sum.",
    "no_keepdims": "the row maxima were broadcast against the wrong axis. Keep the reduced axis: "
    "np.max(x, axis=axis, keepdims=True), and the same for the sum.",
    "sum_axis": "the normalising sum ran over the wrong axis: e / e.sum(axis=axis, keepdims=True).",
    "max_axis": "the maximum was taken over the wrong axis. Subtracting a constant leaves a softmax "
    "unchanged only if it is the same for the whole row: subtract each row's own maximum, along the "
    "softmax's axis, np.max(x, axis=axis, keepdims=True).",
    "nan": "np.exp of a huge or infinite number, or 0/0: subtract each row's own maximum "
    "(np.max(x, axis=axis, keepdims=True)) -- not its minimum, not one maximum for the whole array -- "
    "before np.exp.",
}


def _softmax_variants(x: np.ndarray, axis: int) -> list[Variant]:
    def naive():
        with np.errstate(all="ignore"):
            e = np.exp(x.astype(np.float64))
            return e / e.sum(axis=axis, keepdims=True)

    def global_max():
        with np.errstate(all="ignore"):
            e = np.exp(x.astype(np.float64) - np.max(x))
            return e / e.sum(axis=axis, keepdims=True)

    def no_keepdims(reinsert_last: bool):
        """The row maxima without keepdims, broadcast as they come or re-added as the last axis
        (``np.max(x, axis=axis)[..., None]``, right only for the last axis)."""
        if x.ndim < 2:
            return None
        with np.errstate(all="ignore"):
            m = np.max(x, axis=axis)
            try:
                e = np.exp(x.astype(np.float64) - (m[..., None] if reinsert_last else m))
                return e / e.sum(axis=axis, keepdims=True)
            except ValueError:
                return None

    def sum_other_axis():
        if x.ndim < 2:
            return None
        other = -1 if axis % x.ndim != x.ndim - 1 else 0
        with np.errstate(all="ignore"):
            e = np.exp(x.astype(np.float64) - np.max(x, axis=axis, keepdims=True))
            return e / e.sum(axis=other, keepdims=True)

    def max_over(other: int):
        with np.errstate(all="ignore"):
            e = np.exp(x.astype(np.float64) - np.max(x, axis=other, keepdims=True))
            return e / e.sum(axis=axis, keepdims=True)

    variants = [Variant(naive, SOFTMAX_HINTS["no_max"]), Variant(global_max, SOFTMAX_HINTS["global_max"])]
    variants += [Variant(lambda other=other: max_over(other), SOFTMAX_HINTS["max_axis"])
                 for other in range(x.ndim) if other != axis % x.ndim]
    if axis % x.ndim != x.ndim - 1:
        variants.append(Variant(lambda: torch.softmax(_t(x), dim=-1), SOFTMAX_HINTS["ignores_axis"]))
    variants += [Variant(lambda: no_keepdims(False), SOFTMAX_HINTS["no_keepdims"]),
                 Variant(lambda: no_keepdims(True), SOFTMAX_HINTS["no_keepdims"]),
                 Variant(sum_other_axis, SOFTMAX_HINTS["sum_axis"])]
    return variants


def _check_softmax_once(np_softmax: Callable, x: np.ndarray, axis: int | None, label: str) -> np.ndarray:
    call = f"np_softmax(x{'' if axis is None else f', axis={axis}'}) with x {label}"
    before = x.copy()
    with np.errstate(all="ignore"):  # a naive answer's overflow warnings would drown the message
        out = _call(np_softmax, x, call=call) if axis is None else _call(np_softmax, x, axis=axis, call=call)
    out = expect_array(out, what=call, shape=x.shape, dtype=x.dtype, dtype_hint=DTYPE_HINTS["softmax"])
    _expect_unchanged(before, x, call, "x")
    axis = -1 if axis is None else axis
    expected = torch.softmax(_t(x), dim=axis)
    variants = _softmax_variants(x, axis)
    if np.isnan(out).any():
        # Both a missing and a global max give NaN rows; a global max only where rows differ in scale.
        candidates = [variants[1], variants[0]]
        hint = next((v.hint for v in candidates if _same(out, v.output())), SOFTMAX_HINTS["nan"])
        raise CheckFailure(f"{call} returned NaN where torch.softmax gives finite weights "
                           f"(first NaN at index {tuple(int(i) for i in np.argwhere(np.isnan(out))[0])}).\n"
                           f"  Likely mistake: {hint}")
    expect_close(out, expected, what=call, against=f"torch.softmax(x, dim={axis}) in float64", variants=variants)
    return out


def _same(a: np.ndarray, b: np.ndarray | None) -> bool:
    return b is not None and a.shape == b.shape and bool(np.array_equal(np.isnan(a), np.isnan(b)))


# Library functions that do the exercise's work (the stable shift included) in one call.
_SOFTMAX_SHORTCUTS = ("scipy.special.softmax", "scipy.special.log_softmax", "scipy.special.logsumexp",
                      "torch.softmax", "torch.log_softmax", "torch.special.softmax", "torch.special.log_softmax",
                      "torch.nn.functional.softmax", "torch.nn.functional.log_softmax", "torch.logsumexp")
_SOFTMAX_SHORTCUT_USED = ("np_softmax should compute the softmax itself -- subtract each row's maximum, then "
                          "np.exp, then divide by the sum -- but it calls {name}, which does all of that for you "
                          "(the stable shift included). The point of the exercise is how that is done.")


def _expect_no_softmax_shortcut(np_softmax: Callable) -> None:
    uses = find_uses(np_softmax, functions=_SOFTMAX_SHORTCUTS)
    if uses:
        extra = " (And this notebook is NumPy only.)" if uses[0].target.startswith("torch") else ""
        raise CheckFailure(_SOFTMAX_SHORTCUT_USED.format(name=uses[0].describe()) + extra)


@check("np_softmax: stable at 1000, rows of different scales, -inf entries, any axis")
@_one_thread
def check_np_softmax(np_softmax: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """np_softmax: equals torch.softmax where naive code breaks (overflow, underflow, -inf, other axes)."""
    expect_signature(np_softmax, "np_softmax", ["x", "axis"])
    _expect_no_softmax_shortcut(np_softmax)
    rng = _rng(seed)
    # Ordinary numbers first, so a plain bug is not reported as a stability problem.
    _check_softmax_once(np_softmax, _normal(rng, 3, 5), None, "of shape [3, 5] (ordinary values, default axis)")
    _check_softmax_once(np_softmax, _normal(rng, 2, 2, 6, 6, dtype=np.float32), -1, "float32 scores [2, 2, 6, 6]")
    # Large inputs: exp(1000) overflows to inf, and inf / inf is NaN.
    big = np.array([[1000.0, 999.0, 998.0], [1000.0, 1000.0, 1000.0]]) + rng.uniform(0, 0.5, size=(2, 3))
    _check_softmax_once(np_softmax, big, -1, "around 1000")
    _check_softmax_once(np_softmax, big.astype(np.float32) / 10, -1, "float32 around 100 (exp overflows float32 at 89)")
    # Rows of very different scales: one global max underflows the low row to 0/0.
    scales = np.array([[0.0, 1.0, 2.0, 0.5], [-1000.0, -1001.0, -999.5, -1002.0]]) + rng.uniform(0, 0.5, size=(2, 4))
    _check_softmax_once(np_softmax, scales, -1, "rows near 0 and near -1000")
    # -inf on part of a row: those entries get weight exactly 0, the rest stays finite.
    masked = _normal(rng, 3, 5)
    masked[0, 1:3] = -np.inf
    masked[2, 0] = -np.inf
    out = _check_softmax_once(np_softmax, masked, -1, "containing -inf on part of two rows")
    expect_true(bool((out[np.isneginf(masked)] == 0).all()),
                "np_softmax(x) with -inf entries: their weights should be exactly 0.")
    # A non-default axis: on a square 3-D array first (where maxima put back on the wrong axis
    # still broadcast, so the mistake can be named), then columns of a 2-D array, the middle axis.
    _check_softmax_once(np_softmax, _normal(rng, 3, 4, 4) + 500.0, -2, "of shape [3, 4, 4] + 500, axis -2")
    _check_softmax_once(np_softmax, _normal(rng, 4, 3), 0, "of shape [4, 3], softmax over columns")
    _check_softmax_once(np_softmax, _normal(rng, 2, 5, 3, scale=3.0), 1, "of shape [2, 5, 3], the middle axis")
    _check_softmax_once(np_softmax, _normal(rng, 7), 0, "of shape [7]")
    # Properties: shift invariance per row, positive weights summing to 1.
    for _ in range(4):
        shape = tuple(int(v) for v in rng.integers(1, 6, size=int(rng.integers(1, 4))))
        axis = int(rng.integers(-len(shape), len(shape)))
        x = _normal(rng, *shape, scale=5.0)
        out = _check_softmax_once(np_softmax, x, axis, f"random of shape {shape_str(shape)}")
        expect_true(np.allclose(out.sum(axis=axis), 1.0) and bool((out >= 0).all()),
                    f"np_softmax(x, axis={axis}) on {shape_str(shape)}: weights should be >= 0 and sum to 1 along axis {axis}.")


# --------------------------------------------------------------------------------------
# Exercise: np_attention
# --------------------------------------------------------------------------------------

ATTENTION_HINTS = {
    "no_scale": "no 1/sqrt(d_head) scaling: divide the scores Q @ Kᵀ by math.sqrt(d_head) "
    "(d_head = Q.shape[-1]) before the softmax.",
    "scale_by_d": "you divided by d_head; the scale is 1/sqrt(d_head).",
    "wrong_axis": "softmax over the wrong axis: each query's weights over the keys must sum to 1, so take "
    "the softmax over the last axis (axis=-1).",
    "mask_flipped": "mask polarity flipped: in this course (as in F.scaled_dot_product_attention) True means "
    "'may attend'. Set the scores where the mask is False to -inf: np.where(mask, scores, -np.inf).",
    "mask_ignored": "the mask was ignored: positions where mask is False must get weight exactly 0.",
    "mask_after_softmax": "you zeroed the masked weights after the softmax, so the rows no longer sum to 1. "
    "Mask the scores (-inf) before the softmax instead.",
    "no_transpose": "the scores are Q @ Kᵀ -- one row per query and one column per key -- so transpose K's "
    "last two axes (np.swapaxes(K, -1, -2)).",
    "weights_transposed": "multiply weights @ V (weights (S_q, S_k) times V (S_k, d_v)), not its transpose.",
    "overflow": "your softmax overflowed on large scores: use a stable softmax (your np_softmax) that "
    "subtracts each row's maximum.",
}


def _sdpa_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None) -> torch.Tensor:
    """Attention weights from PyTorch: SDPA with V = identity returns the weight matrix itself."""
    s_k = k.shape[-2]
    identity = torch.eye(s_k, dtype=q.dtype).expand(*k.shape[:-2], s_k, s_k)
    return reference_sdpa(q, k, identity, attn_mask=mask, scale=scale)


def _attention_variants(Q, K, V, mask) -> tuple[list[Variant], list[Variant]]:
    """(variants of the weights, variants of the output) for known mistakes."""
    q, k, v = _t(Q), _t(K), _t(V)
    m = None if mask is None else torch.from_numpy(np.asarray(mask))
    d_head = q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_head)
    weight_variants = [
        (lambda: _sdpa_weights(q, k, m, scale=1.0), ATTENTION_HINTS["no_scale"]),
        (lambda: _sdpa_weights(q, k, m, scale=1.0 / d_head), ATTENTION_HINTS["scale_by_d"]),
    ]
    if q.shape[-2] == k.shape[-2] == d_head:
        weight_variants.append((lambda: torch.softmax(q @ k / math.sqrt(d_head), -1), ATTENTION_HINTS["no_transpose"]))
    if m is None:
        weight_variants.append((lambda: torch.softmax(scores, dim=-2), ATTENTION_HINTS["wrong_axis"]))
    else:
        weight_variants.append((lambda: _sdpa_weights(q, k, None), ATTENTION_HINTS["mask_ignored"]))
        weight_variants.append((lambda: _sdpa_weights(q, k, None) * m, ATTENTION_HINTS["mask_after_softmax"]))
        if bool((~m).any(-1).all()):  # the flipped mask leaves every row something to attend to
            weight_variants.append((lambda: _sdpa_weights(q, k, ~m), ATTENTION_HINTS["mask_flipped"]))
        weight_variants.append((lambda: torch.softmax(scores.masked_fill(~m, -math.inf), dim=-2).nan_to_num(0.0),
                                ATTENTION_HINTS["wrong_axis"]))
    weights = [Variant(output, hint) for output, hint in weight_variants]
    outputs = [Variant(lambda o=output: o() @ v if o().shape[-1] == v.shape[-2] else None, hint)
               for output, hint in weight_variants]
    if q.shape[-2] == k.shape[-2]:
        outputs.append(Variant(lambda: _sdpa_weights(q, k, m).transpose(-2, -1) @ v, ATTENTION_HINTS["weights_transposed"]))
    return weights, outputs


def _nan_hint(nan_rows: np.ndarray, mask, weights_shape: Sequence[int]) -> str:
    """NaN rows where the mask allows every key are what a flipped mask gives (those rows become all -inf)."""
    if mask is not None:
        full_rows = np.broadcast_to(np.asarray(mask), tuple(weights_shape)).all(-1)  # (B, H, S_q)
        if nan_rows.ndim == 2:  # per token (B, S): a NaN in any head reaches the token's output
            full_rows = full_rows.any(1)
        if full_rows.any() and np.array_equal(nan_rows, full_rows):
            return ATTENTION_HINTS["mask_flipped"] + " (The rows where every key is allowed became all -inf: 0/0.)"
    return ATTENTION_HINTS["overflow"]


def _check_attention_once(np_attention: Callable, Q, K, V, mask, label: str) -> None:
    b, h, s_q, d = Q.shape
    s_k, d_v = K.shape[-2], V.shape[-1]
    mask_text = "no mask" if mask is None else f"a boolean mask of shape {shape_str(mask.shape)}"
    call = f"np_attention(Q, K, V, mask) with Q {_array(Q)}, K {shape_str(K.shape)}, V {shape_str(V.shape)}, {mask_text}{label}"
    inputs = [a.copy() for a in (Q, K, V)]
    with np.errstate(all="ignore"):
        result = _call(np_attention, Q, K, V, mask, call=call)
    expect_true(isinstance(result, tuple) and len(result) == 2, f"{call} should return a tuple (out, weights), got {describe(result)}.")
    out, weights = result
    weights = expect_array(weights, what=call + " -> weights", shape=(b, h, s_q, s_k), dtype=Q.dtype,
                              hints={(b, h, s_q, d): ATTENTION_HINTS["no_transpose"]} if d != s_k else None, dtype_hint=DTYPE_HINTS["scaled"])
    out = expect_array(out, what=call + " -> out", shape=(b, h, s_q, d_v), dtype=Q.dtype, dtype_hint=DTYPE_HINTS["scaled"])
    for before, after, name in zip(inputs, (Q, K, V), "QKV"):
        _expect_unchanged(before, after, call, name)
    q, k, v = _t(Q), _t(K), _t(V)
    m = None if mask is None else torch.from_numpy(np.asarray(mask))
    weight_variants, out_variants = _attention_variants(Q, K, V, mask)
    if np.isnan(weights).any():
        raise CheckFailure(f"{call} -> weights contains NaN where F.scaled_dot_product_attention gives finite "
                           f"weights.\n  Likely mistake: {_nan_hint(np.isnan(weights).any(-1), mask, weights.shape)}")
    expect_close(weights, _sdpa_weights(q, k, m), what=call + " -> weights",
                 against="softmax(Q @ Kᵀ / sqrt(d_head)) from F.scaled_dot_product_attention", variants=weight_variants)
    expect_close(out, reference_sdpa(q, k, v, attn_mask=m), what=call + " -> out",
                 against="F.scaled_dot_product_attention (float64)", variants=out_variants)
    if mask is not None:
        leaked = weights[np.broadcast_to(~np.asarray(mask), weights.shape)]
        if not bool((leaked == 0).all()):
            raise CheckFailure(f"{call}: positions where the mask is False must get weight exactly 0 (set their "
                               f"scores to -inf before the softmax), found {float(np.abs(leaked).max()):.3g}.")


@check("np_attention: (out, weights) equal F.scaled_dot_product_attention, with masks and large scores",
       uses=("np_softmax",))
@_one_thread
def check_np_attention(np_attention: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """np_attention: softmax(Q Kᵀ / sqrt(d_head)) V on (B, H, S, d) arrays, boolean masks True = may attend."""
    expect_signature(np_attention, "np_attention", ["Q", "K", "V", "mask"])
    rng = _rng(seed)
    causal = np.tril(np.ones((6, 6), dtype=bool))
    # The notebook's configuration: B=2, H=2, S=6, d_head=2.
    _check_attention_once(np_attention, *(_normal(rng, 2, 2, 6, 2) for _ in range(3)), None, "")
    _check_attention_once(np_attention, *(_normal(rng, 2, 2, 6, 2) for _ in range(3)), causal, " (causal)")
    # Cross-attention sizes, float32, value width != d_head.
    _check_attention_once(np_attention, _normal(rng, 2, 3, 4, 8, dtype=np.float32), _normal(rng, 2, 3, 5, 8, dtype=np.float32),
                          _normal(rng, 2, 3, 5, 3, dtype=np.float32), None, "")
    # A padding mask (B, 1, 1, S_k): the last two keys of the second sequence are padding.
    padding = np.ones((2, 1, 1, 5), dtype=bool)
    padding[1, ..., 3:] = False
    _check_attention_once(np_attention, _normal(rng, 2, 3, 4, 8), _normal(rng, 2, 3, 5, 8), _normal(rng, 2, 3, 5, 8),
                          padding, " (padding)")
    # Square case S == d_head, where a missing transpose still has the right shape.
    _check_attention_once(np_attention, *(_normal(rng, 1, 2, 4, 4) for _ in range(3)), None, "")
    # Large scores (~1e3 and more): a naive softmax overflows to NaN.
    _check_attention_once(np_attention, _normal(rng, 1, 2, 6, 8, scale=30.0), _normal(rng, 1, 2, 6, 8, scale=30.0),
                          _normal(rng, 1, 2, 6, 8), causal, " (large scores)")
    # One token.
    _check_attention_once(np_attention, *(_normal(rng, 1, 1, 1, 4) for _ in range(3)), None, "")
    # Random sizes with a random mask that leaves every query at least one key.
    for _ in range(3):
        b, h, s, d = (int(v) for v in rng.integers(1, 6, size=4))
        mask = rng.random((s, s)) < 0.6
        mask[np.arange(s), rng.integers(0, s, size=s)] = True
        _check_attention_once(np_attention, *(_normal(rng, b, h, s, d) for _ in range(3)), mask, " (random mask)")


# --------------------------------------------------------------------------------------
# Exercise: np_multi_head_attention
# --------------------------------------------------------------------------------------

MHA_HINTS = {
    "no_out": "the output projection is missing: after merging the heads, multiply by W_o. "
    "Concatenating the heads is not the end (the walkthrough this notebook grew from forgot this step too).",
    "layout": "you used the weights in (out, in) layout (X @ W.T, as nn.Linear stores them). Here the "
    "weights are (in, out), as the notebook writes them: Q = X @ W_q, and out = merged @ W_o.",
    "layout_qkv": "you used W_q, W_k, W_v in (out, in) layout (X @ W.T). Here they are (in, out): Q = X @ W_q.",
    "layout_out": "you used W_o in (out, in) layout (merged @ W_o.T). Here it is (in, out): merged @ W_o.",
    "no_scale": "no 1/sqrt(d_head) scaling in the scores (d_head = D // num_heads).",
    "scale_by_width": "you scaled by 1/sqrt(D); the scale is 1/sqrt(d_head) = 1/sqrt(D // num_heads).",
    "mask_flipped": "mask polarity flipped: True means 'may attend' (nn.MultiheadAttention uses the "
    "opposite; this course does not).",
    "split": "the heads are split wrongly: reshape (B, S, D) to (B, S, H, d_head) and then transpose to "
    "(B, H, S, d_head); reshaping straight to (B, H, S, d_head) mixes tokens.",
    "merge": "the heads are merged wrongly: transpose (B, H, S, d) back to (B, S, H, d) before reshaping to (B, S, D).",
}


def _torch_mha(W_q, W_k, W_v, W_o, num_heads: int) -> nn.MultiheadAttention:
    """nn.MultiheadAttention holding copies of the (in, out) weights, transposed to its (out, in) layout."""
    d_model = W_q.shape[0]
    module = nn.MultiheadAttention(d_model, num_heads, bias=False, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        module.in_proj_weight.copy_(torch.cat([_t(W_q).T, _t(W_k).T, _t(W_v).T]))
        module.out_proj.weight.copy_(_t(W_o).T)
    return module


def _manual_mha(X, W_q, W_k, W_v, W_o, num_heads, mask, *, scale=None, out=True, transpose_qkv=False,
                transpose_out=False, flip=False, split="right", merge="right") -> torch.Tensor:
    """The pipeline with one deliberate change, for diagnosis (PyTorch, float64)."""
    x = _t(X)
    b, s, d_model = x.shape
    d_head = d_model // num_heads

    def project(W):
        w = _t(W)
        return x @ (w.T if transpose_qkv else w)

    def heads(t):
        if split == "reshape":
            return t.reshape(b, num_heads, s, d_head)
        return t.reshape(b, s, num_heads, d_head).transpose(1, 2)

    q, k, v = (heads(project(W)) for W in (W_q, W_k, W_v))
    m = None if mask is None else torch.from_numpy(np.asarray(mask))
    if m is not None and flip:
        m = ~m
    context = reference_sdpa(q, k, v, attn_mask=m, scale=scale)
    merged = context.reshape(b, s, d_model) if merge == "reshape" else context.transpose(1, 2).reshape(b, s, d_model)
    if not out:
        return merged
    w_o = _t(W_o)
    return merged @ (w_o.T if transpose_out else w_o)


def _mha_variants(X, weights, num_heads, mask) -> list[Variant]:
    d_model = X.shape[-1]

    def v(hint, **kwargs):
        return Variant(lambda: _manual_mha(X, *weights, num_heads, mask, **kwargs), MHA_HINTS[hint])

    variants = [v("no_out", out=False), v("layout", transpose_qkv=True, transpose_out=True),
                v("layout_qkv", transpose_qkv=True), v("layout_out", transpose_out=True),
                v("no_scale", scale=1.0)]
    if num_heads > 1:
        variants += [v("scale_by_width", scale=1 / math.sqrt(d_model)), v("split", split="reshape"),
                     v("merge", merge="reshape")]
    if mask is not None and bool((~np.asarray(mask)).any(-1).all()):
        variants.append(v("mask_flipped", flip=True))
    return variants


def _check_mha_once(np_multi_head_attention: Callable, X, weights, num_heads: int, mask, label: str = "") -> np.ndarray:
    b, s, d_model = X.shape
    mask_text = "no mask" if mask is None else f"a boolean mask of shape {shape_str(mask.shape)}"
    call = (f"np_multi_head_attention(X, W_q, W_k, W_v, W_o, num_heads={num_heads}, mask) with X {_array(X)}, "
            f"weights ({d_model}, {d_model}), {mask_text}{label}")
    inputs = [a.copy() for a in (X, *weights)]
    with np.errstate(all="ignore"):
        out = _call(np_multi_head_attention, X, *weights, num_heads, mask, call=call)
    out = expect_array(out, what=call, shape=(b, s, d_model), dtype=X.dtype,
                          hints={(b, num_heads, s, d_model // num_heads): MHA_HINTS["merge"] + " (and apply W_o)"}, dtype_hint=DTYPE_HINTS["scaled"])
    for before, after, name in zip(inputs, (X, *weights), ("X", "W_q", "W_k", "W_v", "W_o")):
        _expect_unchanged(before, after, call, name)
    if np.isnan(out).any():
        b_, s_ = X.shape[:2]
        raise CheckFailure(f"{call} contains NaN where nn.MultiheadAttention gives finite values.\n  Likely mistake: "
                           f"{_nan_hint(np.isnan(out).any(-1), mask, (b_, num_heads, s_, s_))}")
    reference = _torch_mha(*weights, num_heads)
    blocked = None if mask is None else torch.from_numpy(~np.asarray(mask))  # nn.MultiheadAttention: True = blocked
    expected, _ = reference(_t(X), _t(X), _t(X), attn_mask=blocked, need_weights=False)
    expect_close(out, expected.detach(), what=call,
                 against="nn.MultiheadAttention holding your weights (in_proj_weight = [W_qᵀ; W_kᵀ; W_vᵀ], out_proj.weight = W_oᵀ)",
                 variants=_mha_variants(X, weights, num_heads, mask))
    return out


def _mha_weights(rng, d_model, dtype=np.float64):
    # Scaled like a real initialisation (std 1/sqrt(D)) so the softmax is neither flat nor one-hot.
    return tuple(_normal(rng, d_model, d_model, dtype=dtype, scale=1 / math.sqrt(d_model)) for _ in range(4))


@check("np_multi_head_attention: equals nn.MultiheadAttention with the same weights, incl. W_o; equivariance and causality",
       uses=("np_split_heads", "np_merge_heads", "np_attention", "np_softmax"))
@_one_thread
def check_np_multi_head_attention(np_multi_head_attention: Callable, *, seed: int = 0,
                                  device: torch.device | None = None) -> None:
    """np_multi_head_attention: projections (X @ W, W (in, out)), split, attention, merge, output projection."""
    expect_signature(np_multi_head_attention, "np_multi_head_attention",
                     ["X", "W_q", "W_k", "W_v", "W_o", "num_heads", "mask"])
    rng = _rng(seed)
    causal = np.tril(np.ones((6, 6), dtype=bool))
    # The notebook's configuration: B=2, S=6, D=4, H=2.
    X = _normal(rng, 2, 6, 4)
    weights = _mha_weights(rng, 4)
    weights = tuple(w * 2 for w in weights)  # D = 4 is tiny: larger weights make every mistake visible
    _check_mha_once(np_multi_head_attention, X, weights, 2, None)
    band = np.abs(np.arange(6)[:, None] - np.arange(6)[None, :]) <= 1  # each token sees its neighbours
    _check_mha_once(np_multi_head_attention, X, weights, 2, band, " (band: |i - j| <= 1)")
    _check_mha_once(np_multi_head_attention, X, weights, 2, causal, " (causal)")
    # Wider, float32, several heads, and one head.
    X = _normal(rng, 2, 5, 12, dtype=np.float32)
    _check_mha_once(np_multi_head_attention, X, _mha_weights(rng, 12, np.float32), 3, None)
    _check_mha_once(np_multi_head_attention, _normal(rng, 1, 4, 8), _mha_weights(rng, 8), 1, None)
    # Properties on random sizes: permutation equivariance without a mask, causality with one.
    for _ in range(3):
        h, d, s = (int(v) for v in rng.integers(1, 5, size=3))
        s += 1
        X = _normal(rng, 2, s, h * d)
        weights = _mha_weights(rng, h * d)
        out = _check_mha_once(np_multi_head_attention, X, weights, h, None)
        permutation = rng.permutation(s)
        call = f"np_multi_head_attention on tokens permuted by {permutation.tolist()}"
        permuted = _call(np_multi_head_attention, X[:, permutation], *weights, h, None, call=call)
        expect_close(permuted, out[:, permutation], what=call,
                     against="the original outputs permuted the same way (self-attention is permutation-equivariant)")
        mask = np.tril(np.ones((s, s), dtype=bool))
        before = _check_mha_once(np_multi_head_attention, X, weights, h, mask, " (causal)")
        changed = X.copy()
        changed[:, -1] += 1.0
        call = "np_multi_head_attention with a causal mask after changing the last token"
        after = _call(np_multi_head_attention, changed, *weights, h, mask, call=call)
        expect_close(after[:, :-1], before[:, :-1], what=call,
                     against="the outputs of the earlier tokens (a causal mask lets no future token influence the past)")


# --------------------------------------------------------------------------------------
# Exercise: dot_product_variance
# --------------------------------------------------------------------------------------

VARIANCE_HINTS = {
    "sigma_squared": "your estimate is close to d·σ², not d·σ⁴. Each product q_i·k_i has variance "
    "Var(q_i)·Var(k_i) = σ²·σ² = σ⁴; check that *both* q and k are drawn with standard deviation σ "
    "(rng.normal(0.0, sigma, ...)), not one of them with 1 or sqrt(σ).",
    "sigma_eighth": "your estimate is close to d·σ⁸: rng.normal's scale is the standard deviation σ, not the "
    "variance σ². Draw with rng.normal(0.0, sigma, size=...).",
    "std": "you returned the standard deviation sqrt(d)·σ², not the variance. Use np.var (or the mean of the "
    "squares, since the mean is 0).",
    "no_sum": "your estimate is close to σ⁴ (no factor d): either you divided by sqrt(d_head) (measure the raw "
    "q·k) or you took the variance of single products q_i·k_i instead of their sum over d_head.",
    "self_dot": "your estimate is close to 2·d·σ⁴, the variance of q·q: draw k independently of q.",
    "entries": "your estimate is close to σ², the variance of single entries of q (or k): measure the "
    "variance of the dot products q·k = Σ_i q_i·k_i, one per sample, not of the vectors' entries.",
    "sample_axis": "your estimate is close to n_samples·σ⁴: the dot products summed over the samples (axis 0) "
    "instead of over the d_head features. Sum over the last axis: np.sum(q * k, axis=-1).",
    "formula": "you returned the formula, not a measurement: draw n_samples pairs (q, k) with the rng you "
    "are given and measure the variance of their dot products.",
    "more_samples": "your results vary less from one rng to the next than a measurement on n_samples pairs: "
    "measure on exactly the n_samples pairs you are asked for (rng.normal(0.0, sigma, size=(n_samples, d_head)) "
    "for q, the same for k), not on a fixed, larger number.",
    "fewer_samples": "your results vary more from one rng to the next than a measurement on n_samples pairs: "
    "measure on all the n_samples pairs you are asked for (rng.normal(0.0, sigma, size=(n_samples, d_head)) for "
    "q, the same for k), not on fewer.",
}


def _standard_error(d_head: int, sigma: float, n_samples: int) -> float:
    """The standard error of the sample variance of q·k on ``n_samples`` pairs.

    For q, k with iid N(0, σ²) entries, Z = q·k has E[Z²] = dσ⁴ and E[Z⁴] = (3d² + 6d)σ⁸, so
    Var(Z²) = (2d² + 6d)σ⁸ and the mean of n squares has standard error sqrt((2d² + 6d)/n)·σ⁴
    (np.var, which subtracts the sample mean, and ddof=1 differ from it by O(1/n)).
    """
    return math.sqrt((2 * d_head ** 2 + 6 * d_head) / n_samples) * sigma ** 4


def _variance_tolerance(d_head: int, sigma: float, n_samples: int) -> float:
    """Five standard errors of the sample variance of q·k."""
    return 5.0 * _standard_error(d_head, sigma, n_samples)


# The spread of a measurement: this many rng seeds at a small n_samples. The standard deviation of the results of
# a sampling answer, over its standard error, is 1 ± 0.08 here (measured on three styles, 300 trials each: 0.71 to
# 1.28); the check accepts 0.5 to 2, six standard deviations below and twelve above. Below 0.05 nothing was
# measured (the formula, perhaps with noise); between, more pairs than asked (a fixed size: 10,000 pairs give 0.14).
_SPREAD_RUNS, _SPREAD_SAMPLES, _SPREAD_RANGE, _NO_SPREAD = 100, 200, (0.5, 2.0), 0.05


def _call_variance(dot_product_variance: Callable, d_head: int, sigma: float, n_samples: int,
                   rng: np.random.Generator, call: str) -> float:
    global_state = np.random.get_state()
    rng_state = copy.deepcopy(rng.bit_generator.state)
    try:
        value = _call(dot_product_variance, d_head, sigma, n_samples, rng, call=call)
        used_global = not _same_global_state(global_state, np.random.get_state())
    finally:
        np.random.set_state(global_state)  # the notebook's own global stream is left as it was
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    expect_true(is_number(value),
                f"{call} should return one float (the measured variance), got {describe(value)}.")
    value = float(value)
    if rng.bit_generator.state == rng_state:
        where = ("np.random's global generator (np.random.randn / np.random.normal)" if used_global
                 else "a generator of your own, or no randomness at all")
        expected = d_head * sigma ** 4
        extra = f"\n  Likely mistake: {VARIANCE_HINTS['formula']}" if math.isclose(value, expected, rel_tol=1e-9) else ""
        raise CheckFailure(f"{call} did not draw from the rng it was given: it used {where}. Draw every sample "
                           f"from rng (rng.normal(0.0, sigma, size=(n_samples, d_head))), so that the same rng "
                           f"state gives the same result.{extra}")
    if used_global:
        raise CheckFailure(f"{call} drew from np.random's global generator as well as from rng: draw every "
                           "sample from the rng you are given.")
    return value


def _same_global_state(a, b) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


def _diagnose_variance(value: float, d_head: int, sigma: float, n_samples: int) -> str | None:
    s2, s4 = sigma ** 2, sigma ** 4
    # (value of the mistake, hint, relative window). A wrong estimator has its own sampling noise: ~25%
    # is generous and still unambiguous for the sizes the check uses (d = 64, σ = 2 separates these
    # values by factors of 2 or more); a sum over the samples leaves only d_head values to measure.
    alternatives = [
        (d_head * s2, "sigma_squared", 0.25),
        (d_head * s4 * s4, "sigma_eighth", 0.25),
        (math.sqrt(d_head) * s2, "std", 0.25),
        (s4, "no_sum", 0.25),
        (2 * d_head * s4, "self_dot", 0.25),
        (s2, "entries", 0.25),
        (n_samples * s4, "sample_axis", 0.6),
    ]
    for alternative, key, window in alternatives:
        if abs(alternative - d_head * s4) > 0.5 * d_head * s4 and abs(value - alternative) <= window * alternative:
            return VARIANCE_HINTS[key]
    return None


@check("dot_product_variance: measures d·σ⁴ within the sampling error, from the rng it is given")
@_one_thread
def check_dot_product_variance(dot_product_variance: Callable, *, seed: int = 0,
                               device: torch.device | None = None) -> None:
    """dot_product_variance: empirical Var(q·k) for iid N(0, σ²) entries ≈ d_head·σ⁴, reproducible from rng."""
    expect_signature(dot_product_variance, "dot_product_variance", ["d_head", "sigma", "n_samples", "rng"])
    n_samples = 20_000
    cases = [(64, 2.0), (16, 0.5), (1, 3.0), (8, 1.0)]
    for index, (d_head, sigma) in enumerate(cases):
        rng_seed = 1000 * seed + index
        call = (f"dot_product_variance(d_head={d_head}, sigma={sigma}, n_samples={n_samples}, "
                f"rng=np.random.default_rng({rng_seed}))")
        value = _call_variance(dot_product_variance, d_head, sigma, n_samples, np.random.default_rng(rng_seed), call)
        if index == 0:  # the same rng state must give the same measurement
            again = _call_variance(dot_product_variance, d_head, sigma, n_samples, np.random.default_rng(rng_seed), call)
            expect_true(value == again, f"{call} gave {value!r} and then {again!r} from two generators in the same "
                        "state. Draw every sample from the rng you are given, so that a seeded rng reproduces the result.")
        expected = d_head * sigma ** 4
        tolerance = _variance_tolerance(d_head, sigma, n_samples)
        if not abs(value - expected) <= tolerance:
            message = (f"{call} returned {value:.6g}, expected d_head·σ⁴ = {d_head}·{sigma:g}⁴ = {expected:.6g} "
                       f"within ±{tolerance:.3g} (five standard errors of a variance measured on {n_samples} samples).")
            hint = _diagnose_variance(value, d_head, sigma, n_samples)
            if hint:
                message += f"\n  Likely mistake: {hint}"
            raise CheckFailure(message)
    _expect_sampling_spread(dot_product_variance, seed)


def _expect_sampling_spread(dot_product_variance: Callable, seed: int) -> None:
    """A measurement is a sample: over many rng seeds its results spread around d·σ⁴ by its standard error, which
    shrinks as 1/sqrt(n_samples). The formula d·σ⁴ returned as it is, or with a little noise drawn from the rng,
    does not spread so; a measurement on fewer pairs than asked spreads more."""
    d_head, sigma, n_samples = 16, 1.0, _SPREAD_SAMPLES
    call = (f"dot_product_variance(d_head={d_head}, sigma={sigma}, n_samples={n_samples}, rng) with "
            f"{_SPREAD_RUNS} rng seeds")
    values = [_call_variance(dot_product_variance, d_head, sigma, n_samples,
                             np.random.default_rng([seed, 52, run]), call) for run in range(_SPREAD_RUNS)]
    spread, expected = float(np.std(values, ddof=1)), _standard_error(d_head, sigma, n_samples)
    low, high = _SPREAD_RANGE
    if low <= spread / expected <= high:
        return
    ratio = spread / expected
    hint = VARIANCE_HINTS["formula" if ratio < _NO_SPREAD else "more_samples" if ratio < low else "fewer_samples"]
    raise CheckFailure(f"{call}: the results spread by {spread:.3g} (their standard deviation) around "
                       f"{float(np.mean(values)):.4g}, where a variance measured on {n_samples} pairs spreads by "
                       f"about {expected:.3g} (its standard error, sqrt((2·d² + 6·d) / n_samples)·σ⁴).\n"
                       f"  Likely mistake: {hint}")


# --------------------------------------------------------------------------------------
# The multiple-choice question on softmax peakedness
# --------------------------------------------------------------------------------------

CHOICES = ("A", "B", "C", "D")
SCALING_QUESTION_NAME = "ANSWER_SCALING"
# The experiment's curves come after this check in the notebook: the hints reason from the variances.
SCALING_HINTS = {
    "6dddff1bb3f79bb8": "with 1/sqrt(d_head) the scores keep the variance σ⁴ at every width; with 1/d_head it is "
    "σ⁴/d_head, which keeps falling as d_head grows: would rows whose scores spread less and less stay as peaked?",
    "f2d0ab0cce843573": "the raw scores go one-hot because their variance d_head·σ⁴ grows. With 1/d_head the variance "
    "σ⁴/d_head shrinks instead: what does a softmax make of scores that are all close to each other?",
    "c5d04ac49cc59655": "at d_head = 4 the 1/d_head scores have the variance σ⁴/4 (a standard deviation of 0.5 for "
    "unit entries): does a softmax over 16 such scores put nearly all its weight on one key?",
}


def peakedness_curves(d_heads: Sequence[int] = (4, 16, 64, 256, 1024), seq_len: int = 16, num_queries: int = 200,
                      seed: int = 0) -> dict[str, np.ndarray]:
    """Mean max softmax weight per row for q, k with iid N(0, 1) entries, scaled by 1, 1/sqrt(d) and 1/d."""
    rng = _rng(seed)
    curves: dict[str, list[float]] = {"unscaled": [], "scaled": [], "by_d": []}
    for d_head in d_heads:
        q = rng.standard_normal((num_queries, 1, d_head))
        k = rng.standard_normal((num_queries, seq_len, d_head))  # fresh keys for every query
        scores = torch.from_numpy((q * k).sum(-1))  # [num_queries, seq_len]
        for name, factor in (("unscaled", 1.0), ("scaled", 1 / math.sqrt(d_head)), ("by_d", 1 / d_head)):
            curves[name].append(float(torch.softmax(scores * factor, -1).amax(-1).mean()))
    return {"d_head": np.array(d_heads), **{name: np.array(values) for name, values in curves.items()},
            "uniform": np.full(len(d_heads), 1.0 / seq_len)}


def _statements(curves: dict[str, np.ndarray]) -> dict[str, bool]:
    """Which of the notebook's four statements about the 1/d_head scaling the measured curves support."""
    by_d, scaled, uniform = curves["by_d"], curves["scaled"], curves["uniform"][0]
    flattens = bool(abs(by_d[-1] - uniform) < 0.02 and np.all(np.diff(by_d) < 0))
    return {
        # A: 1/d keeps the rows as peaked as 1/sqrt(d) for every width.
        "A": bool(np.all(np.abs(by_d - scaled) < 0.05)),
        # B: 1/d makes the rows one-hot as d_head grows.
        "B": bool(by_d[-1] > 0.9),
        # C: 1/d flattens the rows towards uniform as d_head grows.
        "C": flattens and not bool(by_d[0] > 0.9),
        # D: one-hot at small d_head, uniform at large.
        "D": flattens and bool(by_d[0] > 0.9),
    }


@check("ANSWER_SCALING: right choice")
@_one_thread
def check_answer_scaling(answer: Any, *, seed: int = 0, device: torch.device | None = None) -> None:
    """The multiple-choice question: the check re-runs the experiment and accepts the one statement it supports."""
    expect_choice(answer, name=SCALING_QUESTION_NAME, options="".join(CHOICES),
                  correct_digest=choice_digest(SCALING_QUESTION_NAME, _supported_statement(seed)), hints=SCALING_HINTS)


@functools.lru_cache(maxsize=None)
def _supported_statement(seed: int) -> str:
    """The one statement the peakedness experiment supports, as the experiment finds it (no letter is
    stored in clear): run once per seed, not on every check of an answer."""
    supported = [letter for letter, holds in _statements(peakedness_curves(seed=seed)).items() if holds]
    if len(supported) != 1:  # the experiment itself went wrong: say so rather than grade at random
        raise RuntimeError(f"the peakedness experiment supports {supported}; please report this to the course staff")
    return supported[0]


# --------------------------------------------------------------------------------------
# Exercise: softmax_backward
# --------------------------------------------------------------------------------------

SOFTMAX_BACKWARD_HINTS = {
    "no_rowsum": "you returned p · dp: the term − Σ_j dp_j · p_j is missing. Every weight depends on every "
    "score of its row (they share the normalising sum), so ds = p · (dp − Σ_j dp_j · p_j), the sum taken "
    "along axis with keepdims=True.",
    "diagonal_only": "you returned p · (1 − p) · dp: only the diagonal of the Jacobian, as if each weight "
    "depended on its own score alone. The off-diagonal entries −p_i · p_j contribute too.",
    "unweighted_sum": "the sum must be weighted by p: Σ_j dp_j · p_j (one dot product per row), not Σ_j dp_j.",
    "no_outer_p": "the whole bracket is multiplied by p: without that factor a weight of 0 (a masked key) "
    "would still pass gradient to its score.",
    "sign": "the sign is flipped: ds = p · (dp − Σ_j dp_j · p_j), not p · (Σ_j dp_j · p_j − dp).",
    "mean": "Σ_j dp_j · p_j is a sum (np.sum), not a mean.",
    "sum_axis": "the sum Σ_j dp_j · p_j ran over the wrong axis (or over the whole array): take it along "
    "axis, with keepdims=True, one value per row.",
    "ignores_axis": "the backward ran over the last axis although a different axis was asked for: use the "
    "axis argument in the sum.",
    "softmax_again": "you applied the softmax to p again. p is already the softmax's output (the weights): "
    "the backward uses it as it is.",
    "jacobian": "you built the [n, n] Jacobian diag(p) − p pᵀ of every row. The vector-Jacobian product "
    "never needs it: Σ_i dp_i · ∂p_i/∂s_j collapses to one dot product per row, so the backward of a softmax "
    "costs as much memory as its forward.",
}


def _softmax_inputs(rng: np.random.Generator, shape: Sequence[int], axis: int, dtype=np.float64, scale: float = 1.0,
                    masked: np.ndarray | None = None) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """(scores, p = softmax(scores) in dtype, dp in dtype); masked scores are -inf, so p is exactly 0 there."""
    scores = _normal(rng, *shape, scale=scale)
    if masked is not None:
        scores[masked] = -np.inf
    s = torch.from_numpy(scores)
    p = torch.softmax(s, dim=axis).numpy().astype(dtype)
    return s, p, _normal(rng, *shape, dtype=dtype)


def _softmax_vjp(scores: torch.Tensor, dp: np.ndarray, axis: int) -> torch.Tensor:
    """The gradient of softmax(scores) along axis, with upstream dp: torch.autograd in float64."""
    s = scores.clone().requires_grad_(True)
    # The gradient of Σ softmax(s) · dp is the vector-Jacobian product (a scalar loss: autograd.grad
    # with grad_outputs would import sympy, seconds of a notebook's run time).
    (grad,) = torch.autograd.grad((torch.softmax(s, dim=axis) * _t(dp)).sum(), s)
    return grad


def _softmax_backward_variants(p: np.ndarray, dp: np.ndarray, axis: int) -> list[Variant]:
    P, dP = _t(p), _t(dp)
    dot = (dP * P).sum(axis, keepdim=True)
    variants = [
        Variant(lambda: P * dP, SOFTMAX_BACKWARD_HINTS["no_rowsum"]),
        Variant(lambda: P * (1 - P) * dP, SOFTMAX_BACKWARD_HINTS["diagonal_only"]),
        Variant(lambda: P * (dP - dP.sum(axis, keepdim=True)), SOFTMAX_BACKWARD_HINTS["unweighted_sum"]),
        Variant(lambda: dP - dot, SOFTMAX_BACKWARD_HINTS["no_outer_p"]),
        Variant(lambda: P * (dot - dP), SOFTMAX_BACKWARD_HINTS["sign"]),
        Variant(lambda: P * (dP - (dP * P).mean(axis, keepdim=True)), SOFTMAX_BACKWARD_HINTS["mean"]),
        Variant(lambda: P * (dP - (dP * P).sum()), SOFTMAX_BACKWARD_HINTS["sum_axis"]),
    ]
    twice = torch.softmax(P, dim=axis)
    variants.append(Variant(lambda: twice * (dP - (dP * twice).sum(axis, keepdim=True)),
                            SOFTMAX_BACKWARD_HINTS["softmax_again"]))
    variants += [Variant(lambda other=other: P * (dP - (dP * P).sum(other, keepdim=True)), SOFTMAX_BACKWARD_HINTS["sum_axis"])
                 for other in range(p.ndim) if other != axis % p.ndim]
    if axis % p.ndim != p.ndim - 1:
        variants.insert(0, Variant(lambda: P * (dP - (dP * P).sum(-1, keepdim=True)), SOFTMAX_BACKWARD_HINTS["ignores_axis"]))
    return variants


class PeakAllocation(Probe):
    """The most memory one call held at once beyond what was held before, in bytes (:attr:`peak`).

    NumPy reports its array buffers to tracemalloc, so this sees every intermediate array
    however it was made (np.eye, np.einsum, broadcasting, a loop over rows).
    """

    def __init__(self):
        super().__init__()
        self.peak: int | None = None

    def __enter__(self) -> "PeakAllocation":
        self._tracing = tracemalloc.is_tracing()
        if not self._tracing:
            tracemalloc.start()
        self._before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        return self

    def __exit__(self, *exc) -> None:
        _, peak = tracemalloc.get_traced_memory()
        if not self._tracing:
            tracemalloc.stop()
        self.peak = max(peak - self._before, 0)

    def findings(self) -> int | None:
        return self.peak

    def accept(self, findings) -> None:
        self.peak = findings if type(findings) is int and findings >= 0 else None


def _check_softmax_backward_once(softmax_backward: Callable, scores: torch.Tensor, p: np.ndarray, dp: np.ndarray,
                                 axis: int | None, label: str, measure: bool = False) -> np.ndarray:
    call = f"softmax_backward(p, dp{'' if axis is None else f', axis={axis}'}) with p and dp {label}"
    inputs = (p.copy(), dp.copy())
    kwargs = {} if axis is None else {"axis": axis}
    with np.errstate(all="ignore"):
        allocation = PeakAllocation()
        ds = _call(softmax_backward, p, dp, call=call, probes=[allocation] if measure else [], **kwargs)
        peak = allocation.peak
    if measure and peak is None:
        raise CheckFailure(f"{call}: the grader could not measure the memory it held (no measurement came back).")
    ds = expect_array(ds, what=call, shape=p.shape, dtype=p.dtype, dtype_hint=DTYPE_HINTS["softmax"])
    for before, after, name in zip(inputs, (p, dp), ("p", "dp")):
        _expect_unchanged(before, after, call, name)
    axis = -1 if axis is None else axis
    expect_close(ds, _softmax_vjp(scores, dp, axis), what=call,
                 against=f"torch.autograd through torch.softmax(scores, dim={axis}) (float64)",
                 variants=_softmax_backward_variants(p, dp, axis))
    if measure:
        n = p.shape[axis]
        jacobian_bytes = n * n * p.dtype.itemsize  # one row's Jacobian
        if peak > jacobian_bytes // 4:
            raise RuleFailure(
                f"{call} held {peak / 2**20:.1f} MB at once, for inputs of {p.nbytes / 2**10:.0f} kB each: the "
                f"size of an [n, n] Jacobian (n = {n}: {jacobian_bytes / 2**20:.1f} MB per row).\n"
                f"  Likely mistake: {SOFTMAX_BACKWARD_HINTS['jacobian']}")
    return ds


@check("softmax_backward: equals torch.autograd along any axis, masked weights pass no gradient, no [n, n] Jacobian")
@_one_thread
def check_softmax_backward(softmax_backward: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """softmax_backward: the vector-Jacobian product p · (dp − Σ dp·p) of a softmax, against torch.autograd."""
    expect_signature(softmax_backward, "softmax_backward", ["p", "dp", "axis"])
    rng = _rng(seed)
    _check_softmax_backward_once(softmax_backward, *_softmax_inputs(rng, (3, 5), -1), None,
                                 "of shape [3, 5] (default axis)")
    # Rows of 512 keys: the check measures the memory the answer holds at once.
    _check_softmax_backward_once(softmax_backward, *_softmax_inputs(rng, (4, 512), -1, scale=3.0), -1,
                                 "of shape [4, 512]", measure=True)
    _check_softmax_backward_once(softmax_backward, *_softmax_inputs(rng, (2, 2, 6, 6), -1, np.float32), -1,
                                 "float32 attention weights [2, 2, 6, 6]")
    # Masked keys: their weight is exactly 0, and so must be the gradient reaching their score.
    masked = np.zeros((3, 6), dtype=bool)
    masked[0, 4:] = masked[1, :2] = masked[2, 1] = True
    scores, p, dp = _softmax_inputs(rng, (3, 6), -1, masked=masked)
    ds = _check_softmax_backward_once(softmax_backward, scores, p, dp, -1, "of shape [3, 6] with masked (zero) weights")
    expect_true(bool((ds[masked] == 0).all()),
                f"softmax_backward(p, dp) with weights exactly 0 (masked keys): the gradient reaching their "
                f"scores should be exactly 0, found {float(np.abs(ds[masked]).max()):.3g}.\n  Likely mistake: "
                f"{SOFTMAX_BACKWARD_HINTS['no_outer_p']}")
    # Other axes: columns of a 2-D array, axis -2 of a 3-D one, the middle axis; a single row.
    _check_softmax_backward_once(softmax_backward, *_softmax_inputs(rng, (4, 3), 0), 0, "of shape [4, 3], axis 0")
    _check_softmax_backward_once(softmax_backward, *_softmax_inputs(rng, (3, 4, 4), -2), -2, "of shape [3, 4, 4], axis -2")
    _check_softmax_backward_once(softmax_backward, *_softmax_inputs(rng, (2, 5, 3), 1, np.float32, scale=2.0), 1,
                                 "float32 of shape [2, 5, 3], the middle axis")
    _check_softmax_backward_once(softmax_backward, *_softmax_inputs(rng, (7,), 0), 0, "of shape [7]")
    for _ in range(3):
        shape = tuple(int(v) for v in rng.integers(1, 6, size=int(rng.integers(1, 4))))
        axis = int(rng.integers(-len(shape), len(shape)))
        _check_softmax_backward_once(softmax_backward, *_softmax_inputs(rng, shape, axis, scale=2.0), axis,
                                     f"random of shape {shape_str(shape)}")


# --------------------------------------------------------------------------------------
# Exercise: np_attention_lse (what the forward keeps for the backward)
# --------------------------------------------------------------------------------------

ATTENTION_LSE_HINTS = {
    "lse_unscaled": "lse is the log-sum-exp of the scores the softmax saw: scaled by 1/sqrt(d) and masked, "
    "not the raw Q @ Kᵀ.",
    "lse_unmasked": "lse left the masked scores in: they are -inf before the softmax, so exp(-inf) = 0 adds "
    "nothing to the sum. Take the log-sum-exp of the masked scores.",
    "lse_max_only": "lse is log Σ_j exp(s_j), not the row's maximum: m + log Σ_j exp(s_j - m).",
    "lse_shift_lost": "the row's maximum was subtracted for stability but not added back: lse = m + "
    "log Σ_j exp(s_j - m).",
    "lse_base2": "lse is a natural log (np.log), the inverse of np.exp; base-2 units are a GPU kernel's trick "
    "(notebook 06).",
    "fully_masked_out": "a query whose mask row is all False has no key: its out must be 0 and its lse -inf, "
    "as F.scaled_dot_product_attention and torch.logsumexp give, not NaN. A row maximum of -inf gives "
    "-inf - (-inf) = NaN: subtract 0 instead where the maximum is -inf, and divide by 1 where the sum is 0.",
    "silenced": "your code silences NumPy (np.errstate(...), np.seterr or a warnings filter), but the invalid "
    "operation still runs: a -inf - (-inf), a 0/0 or the log of 0 makes NaN or -inf that your code then repairs. "
    "The exercise asks for code in which none runs: compute with np.where so that each operation gets valid "
    "inputs (a maximum of 0 where the row's is -inf, a sum of 1 where it is 0).",
    "warning": "NumPy warned while computing it (log of 0, -inf - (-inf), 0/0): a fully masked row must give "
    "out = 0 and lse = -inf without a warning. Compute with np.where so that no invalid operation runs "
    "(e.g. a maximum of 0 where the row's is -inf, a sum of 1 where it is 0).",
}


class FloatingPointErrors(Probe):
    """The floating-point errors NumPy meets while one call runs (0/0, -inf - (-inf), the log of 0, an overflow),
    those the answer silences included: while it runs, every error mode NumPy is asked for -- the answer's own
    ``with np.errstate(all="ignore")``, ``np.seterr``, a decorator -- is this probe's, which records each error
    (and the student's line where it happened) and neither raises nor prints it. ``silenced``: the answer asked
    NumPy to ignore (or only print, warn, ...) some error. (NumPy 2's error modes all come from one function,
    which the probe replaces while the call runs; with NumPy 1 it records the errors the answer leaves audible.)"""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[str] = []  # "invalid value (your line: `...`)", in order, each once
        self.silenced = False

    def _record(self, kind: str, flag: int) -> None:
        """NumPy's error callback: ``kind`` ("invalid value", "divide by zero", "overflow"), where in the answer."""
        line = next((f" (your line: `{frame.line.strip()}`)" for frame in reversed(traceback.extract_stack())
                     if _is_student_file(frame.filename) and frame.line), "")
        if f"{kind}{line}" not in self.errors and len(self.errors) < 10:
            self.errors.append(f"{kind}{line}")

    def __enter__(self) -> "FloatingPointErrors":
        self._restore = self._fallback = None
        try:
            from numpy._core import _ufunc_config

            original = _ufunc_config._make_extobj
        except (ImportError, AttributeError):  # NumPy 1.x: its errors are seen, not those it silences
            self._fallback = np.errstate(call=self._record, all="call", under="ignore")
            self._fallback.__enter__()
            return self
        ours = original(call=self._record, all="call", under="ignore")

        def the_probes_mode(**asked: Any) -> Any:  # what np.errstate and np.seterr set, whatever they are asked
            self.silenced = self.silenced or any(mode not in (None, "raise", "call", _ufunc_config._Unspecified)
                                                 for name, mode in asked.items() if name != "call")
            return ours

        self._restore = (_ufunc_config, original)
        _ufunc_config._make_extobj = the_probes_mode
        self._token = _ufunc_config._extobj_contextvar.set(ours)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fallback is not None:
            self._fallback.__exit__(*exc)
            return
        module, original = self._restore
        module._make_extobj = original
        module._extobj_contextvar.reset(self._token)  # the answer's np.seterr, undone with it

    def findings(self) -> dict:
        return {"errors": self.errors, "silenced": self.silenced}

    def accept(self, findings: Any) -> None:
        if not (isinstance(findings, dict) and isinstance(findings.get("silenced"), bool)):
            raise wire.WireError("a malformed report of floating-point errors")
        self.errors, self.silenced = probes.strings(findings.get("errors"), limit=10), findings["silenced"]


def _reference_lse(Q, K, mask) -> torch.Tensor:
    """log Σ_j exp(scaled, masked score): torch.logsumexp in float64, -inf for a fully masked row."""
    q, k = _t(Q), _t(K)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~torch.from_numpy(np.array(mask, dtype=bool)), -math.inf)
    return torch.logsumexp(scores, dim=-1)


def _lse_variants(Q, K, mask) -> list[Variant]:
    q, k = _t(Q), _t(K)
    raw = q @ k.transpose(-2, -1)
    scaled = raw / math.sqrt(q.shape[-1])
    keep = None if mask is None else torch.from_numpy(np.array(mask, dtype=bool))

    def masked(scores):
        return scores if keep is None else scores.masked_fill(~keep, -math.inf)

    right = torch.logsumexp(masked(scaled), dim=-1)
    top = masked(scaled).amax(dim=-1)
    variants = [
        Variant(lambda: torch.logsumexp(masked(raw), dim=-1), ATTENTION_LSE_HINTS["lse_unscaled"]),
        Variant(lambda: top, ATTENTION_LSE_HINTS["lse_max_only"]),
        Variant(lambda: right - top, ATTENTION_LSE_HINTS["lse_shift_lost"]),
        Variant(lambda: right / math.log(2), ATTENTION_LSE_HINTS["lse_base2"]),
    ]
    if keep is not None:
        variants.insert(1, Variant(lambda: torch.logsumexp(scaled, dim=-1), ATTENTION_LSE_HINTS["lse_unmasked"]))
    return variants


def _check_attention_lse_once(np_attention_lse: Callable, Q, K, V, mask, label: str) -> None:
    b, h, s_q, _ = Q.shape
    d_v = V.shape[-1]
    mask_text = "no mask" if mask is None else f"a boolean mask of shape {shape_str(mask.shape)}"
    call = (f"np_attention_lse(Q, K, V, mask) with Q {_array(Q)}, K {shape_str(K.shape)}, V {shape_str(V.shape)}, "
            f"{mask_text}{label}")
    inputs = [a.copy() for a in (Q, K, V)]
    errors = FloatingPointErrors()
    result = _call(np_attention_lse, Q, K, V, mask, call=call, probes=[errors])
    expect_true(isinstance(result, tuple) and len(result) == 2,
                f"{call} should return a tuple (out, lse), got {describe(result)}.")
    out, lse = result
    out = expect_array(out, what=call + " -> out", shape=(b, h, s_q, d_v), dtype=Q.dtype,
                       dtype_hint=DTYPE_HINTS["scaled"])
    lse = expect_array(lse, what=call + " -> lse", shape=(b, h, s_q), dtype=Q.dtype, dtype_hint=DTYPE_HINTS["scaled"],
                       hints={(b, h, s_q, 1): ERROR_HINTS["kept_axis"]})
    for before, after, name in zip(inputs, (Q, K, V), "QKV"):
        _expect_unchanged(before, after, call, name)
    q, k, v = _t(Q), _t(K), _t(V)
    m = None if mask is None else torch.from_numpy(np.array(mask, dtype=bool))
    fully_masked = mask is not None and bool((~np.broadcast_to(np.asarray(mask, dtype=bool), (b, h, s_q, K.shape[-2]))
                                               .any(-1)).any())
    if np.isnan(out).any() or np.isnan(lse).any():
        hint = ATTENTION_LSE_HINTS["fully_masked_out"] if fully_masked else ATTENTION_HINTS["overflow"]
        raise CheckFailure(f"{call} returned NaN where F.scaled_dot_product_attention and torch.logsumexp give "
                           f"numbers (0 and -inf for a query with no key).\n  Likely mistake: {hint}")
    expected_out = reference_sdpa(q, k, v, attn_mask=m)

    def mean_of_values_where_no_key():  # what a finite fill (-1e9) gives a query with no key
        no_key = ~m.expand(b, h, s_q, K.shape[-2]).any(-1, keepdim=True)
        return torch.where(no_key, v.mean(-2, keepdim=True), expected_out)

    expect_close(out, expected_out, what=call + " -> out",
                 against="F.scaled_dot_product_attention (float64; 0 for a query with no key)",
                 variants=[Variant(mean_of_values_where_no_key if fully_masked else None,
                                   ATTENTION_LSE_HINTS["fully_masked_out"])])
    expect_close(lse, _reference_lse(Q, K, mask), what=call + " -> lse",
                 against="torch.logsumexp of the scaled, masked scores (float64; -inf for a query with no key)",
                 variants=_lse_variants(Q, K, mask))
    if errors.errors:
        hint = ATTENTION_LSE_HINTS["silenced" if errors.silenced else "warning"]
        raise CheckFailure(f"{call} is right, but NumPy met {errors.errors[0]}"
                           + (" and silenced it" if errors.silenced else "") + f".\n  Likely mistake: {hint}")


@check("np_attention_lse: out equals F.scaled_dot_product_attention and lse torch.logsumexp, fully masked rows "
       "included, no warning", uses=("np_softmax",))
@_one_thread
def check_np_attention_lse(np_attention_lse: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """np_attention_lse: (out, lse) on (B, H, S, d) arrays; a query with no key gives out 0, lse -inf."""
    expect_signature(np_attention_lse, "np_attention_lse", ["Q", "K", "V", "mask"])
    rng = _rng(seed)
    causal = np.tril(np.ones((6, 6), dtype=bool))
    _check_attention_lse_once(np_attention_lse, *(_normal(rng, 2, 2, 6, 2) for _ in range(3)), None, "")
    _check_attention_lse_once(np_attention_lse, *(_normal(rng, 2, 2, 6, 2) for _ in range(3)), causal, " (causal)")
    _check_attention_lse_once(np_attention_lse, _normal(rng, 2, 3, 4, 8, dtype=np.float32),
                              _normal(rng, 2, 3, 5, 8, dtype=np.float32), _normal(rng, 2, 3, 5, 3, dtype=np.float32),
                              None, "")
    _check_attention_lse_once(np_attention_lse, _normal(rng, 1, 2, 6, 8, scale=30.0),
                              _normal(rng, 1, 2, 6, 8, scale=30.0), _normal(rng, 1, 2, 6, 8), causal,
                              " (large scores)")
    queries_and_keys = np.ones((2, 1, 5, 6), dtype=bool)
    queries_and_keys[1, :, 3:, :] = False  # padding queries: fully masked rows
    queries_and_keys[1, :, :, 4:] = False
    _check_attention_lse_once(np_attention_lse, _normal(rng, 2, 2, 5, 4), _normal(rng, 2, 2, 6, 4),
                              _normal(rng, 2, 2, 6, 3), queries_and_keys, " (padding queries: fully masked rows)")
    strictly_causal = np.tril(np.ones((5, 5), dtype=bool), -1)  # query 0 sees nothing
    _check_attention_lse_once(np_attention_lse, *(_normal(rng, 1, 2, 5, 3, dtype=np.float32) for _ in range(3)),
                              strictly_causal, " (strictly causal: query 0 has no key)")
    for _ in range(2):
        b, h, s, d = (int(v) for v in rng.integers(1, 5, size=4))
        mask = rng.random((s, s)) < 0.6
        _check_attention_lse_once(np_attention_lse, *(_normal(rng, b, h, s, d) for _ in range(3)), mask,
                                  " (random mask)")


# --------------------------------------------------------------------------------------
# Exercise: np_attention_backward
# --------------------------------------------------------------------------------------

ATTENTION_BACKWARD_HINTS = {
    "no_rowsum": "the softmax's backward lost its − Σ_j dP_ij · P_ij term: dS = P · (dP − Σ_j dP_ij · P_ij) "
    "along the keys (your softmax_backward(P, dP)), not P · dP.",
    "rowsum_unweighted": "Σ_j dP_ij · P_ij must be weighted by P (one dot product per query), not Σ_j dP_ij.",
    "rowsum_axis": "the sum Σ_j dP_ij · P_ij runs over the keys (the last axis), one value per query.",
    "no_scale": "dQ and dK miss the factor 1/sqrt(d): the scores are (Q @ Kᵀ) / sqrt(d), so the gradient "
    "reaching Q and K through them carries the same factor.",
    "scale_by_d": "dQ and dK carry 1/d; the factor is the forward's own, 1/sqrt(d), once.",
    "scale_dv": "dV is scaled by 1/sqrt(d), but the scale sits inside the scores: V is not scaled, and "
    "neither is its gradient.",
    "forward_no_scale": "the weights were recomputed without the 1/sqrt(d) scale: the backward must use "
    "exactly the forward's weights, softmax(Q @ Kᵀ / sqrt(d)) with the mask.",
    "dv_transposed": "dV was computed as P @ dout; write dV = Pᵀ @ dout, np.swapaxes(P, -1, -2) @ dout: dV has V's "
    "shape (keys × d_v), and key j collects the gradient of every query that read it, weighted by P[i, j].",
    "dp_transposed": "dP (queries × keys, the shape of P) came out transposed: build it from dout and V so "
    "that entry (i, j) is dout[i] · V[j].",
    "dq_transposed": "dQ was computed from dSᵀ; write dQ = dS @ K (times 1/sqrt(d)): query i's gradient collects "
    "row i of dS (its own scores) times the keys.",
    "dk_transposed": "dK was computed from dS; write dK = dSᵀ @ Q (times 1/sqrt(d)): key j's gradient collects "
    "column j of dS (the scores of key j with every query) times the queries.",
    "mask_ignored": "the backward ignored the mask: recompute the weights with the same mask as the forward "
    "(masked scores -inf, weights 0), or gradient flows into masked entries.",
    "masked_leak": "gradient flowed into masked entries: with a gradient on one query only, the keys that "
    "this query may not attend to got a nonzero dK or dV. A masked weight must be exactly 0 (score -inf, "
    "or a fill like -1e9 far below every score), and the softmax's backward multiplies by the weight, so "
    "nothing flows back through a masked score.",
    "no_outer_p": "the softmax's backward multiplies the whole bracket by P: dS = P · (dP − Σ_j dP_ij · P_ij). "
    "Without that factor, gradient flows even through weights that are 0 (masked entries).",
    "fully_masked_nan": "a query whose mask row is all False has weights NaN (-inf everywhere, 0/0), and "
    "the backward sums over the queries (Pᵀ @ dout): one NaN row makes NaN of every key's gradient. Set "
    "the weights of such rows to 0 before using them.",
    "fully_masked_sends": "a query whose mask row is all False sent gradient back (a fill such as -1e9 "
    "gives it uniform weights). The convention: its weights are 0, it adds nothing to dQ, dK or dV.",
    "matmul_shapes": "a product with the wrong transpose. Follow the shapes: every gradient has the shape "
    "of its array (dQ like Q, dK like K, dV like V), and for C = A @ B, dA = dC @ Bᵀ and dB = Aᵀ @ dC "
    "(np.swapaxes(A, -1, -2) transposes the last two axes).",
}
# Mistakes of the recipe that recomputes P from lse and takes D = rowsum(dout ∘ out).
BACKWARD_LSE_HINTS = {
    "lse_ignored": "P was recomputed as exp(scores) without subtracting lse: each row must be normalised, "
    "P_ij = exp(s_ij - lse_i), with s the scaled, masked scores.",
    "lse_unscaled_scores": "P = exp(s - lse) needs the scores the forward's lse was taken of: scaled by "
    "1/sqrt(d) (and masked), not the raw Q @ Kᵀ.",
    "lse_mask_ignored": "P = exp(s - lse) was computed without the mask: a masked score must give P = 0 "
    "(set it to -inf before the exp, or P to 0 after), or gradient flows into masked entries.",
    "delta_unweighted": "your D is the row sum of dout alone. D_i = Σ_j dP_ij · P_ij is one number per query "
    "(your derivation in 2.10 writes it without P or dP), and it depends on the forward's output too, not on "
    "dout only.",
    "delta_axis": "your D sums over the wrong axis. It is one number per query, a sum over the value features "
    "(the last axis, keepdims=True: shape (..., S_q, 1)); a sum over the queries (axis=-2) gives one number per "
    "feature instead.",
    "ds_sign": "dS has the wrong sign: dS = P ∘ (dP − D), dP first, as in the softmax's backward p · (dp − Σ dp·p); "
    "P ∘ (D − dP) turns dQ and dK around (dV, which does not use dS, is right).",
    "lse_recomputed": "your backward recomputes the softmax instead of using lse: its gradients stay the same "
    "whatever lse it is given. The exercise is the backward from the saved lse: P = exp(s − lse) with the lse it "
    "is given (s the scaled, masked scores), with no max and no sum over the keys again -- what lets "
    "FlashAttention recompute P one tile at a time.",
    "delta_recomputed": "your backward computes D from P and dP (Σ_j P_ij · dP_ij) instead of from out: its "
    "gradients stay the same whatever out it is given. Take D as you derived it in 2.10, from the out it is "
    "given: it needs no row of P -- what lets FlashAttention compute it before its loops.",
    "float32_inside": "your code computes in float32 inside (an .astype(np.float32), dtype=np.float32, or a "
    "float32 array mixed in): on float64 input its float32 rounding shows in these gradients -- given inputs that "
    "differ below float32's precision, it returns exactly the same numbers. Compute in the input's dtype: "
    "float64 in, float64 inside.",
    "float16_inside": "your code computes in float16 inside (an .astype(np.float16) or dtype=np.float16): on "
    "float32 input its float16 rounding shows in these gradients -- given inputs that differ below float16's "
    "precision, it returns exactly the same numbers. Compute in the input's dtype: float32 in, float32 inside.",
    "fully_masked_delta": "a fully masked query has lse = -inf, and the forward may have left NaN in its out: "
    "exp(s - lse) = exp(-inf + inf) is NaN, so is a D computed from a NaN out, and one NaN row makes NaN of "
    "every key's gradient. Where lse is -inf (np.isfinite), set that row's P and D to 0.",
}


def _attention_gradients(Q, K, V, dout, mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of F.scaled_dot_product_attention (math backend) by torch.autograd, in float64.

    A fully masked query row outputs zeros there (PyTorch >= 2.5), so it sends no gradient.
    """
    q, k, v = (_t(a).requires_grad_(True) for a in (Q, K, V))
    m = None if mask is None else torch.from_numpy(np.array(mask, dtype=bool))
    out = reference_sdpa(q, k, v, attn_mask=m)
    return torch.autograd.grad((out * _t(dout)).sum(), (q, k, v))  # a scalar loss: see _softmax_vjp


def _manual_attention_backward(Q, K, V, dout, mask, *, rowsum="weighted", grad_scale="sqrt", scale_dv=False,
                               transpose=None, use_mask=True, fully_masked="zero", forward_scale=True, outer_p=True):
    """The backward written out in PyTorch (float64), with one deliberate change, for diagnosis."""
    q, k, v, do = _t(Q), _t(K), _t(V), _t(dout)
    d = q.shape[-1]
    scores = q @ k.transpose(-2, -1) / (math.sqrt(d) if forward_scale else 1.0)
    if mask is not None and use_mask:
        allowed = torch.from_numpy(np.array(mask, dtype=bool)).expand(scores.shape)
        any_allowed = allowed.any(-1, keepdim=True)
        scores = torch.where(any_allowed, scores.masked_fill(~allowed, -math.inf), 0.0)  # full rows: uniform
        p = torch.softmax(scores, dim=-1)
        if fully_masked == "zero":
            p = p * any_allowed
    else:
        p = torch.softmax(scores, dim=-1)
    dv = (p @ do) if transpose == "dv" else p.transpose(-2, -1) @ do
    dp = do @ v.transpose(-2, -1)
    if transpose == "dp":
        dp = dp.transpose(-2, -1)
    total = {"weighted": (dp * p).sum(-1, keepdim=True), "none": 0.0, "unweighted": dp.sum(-1, keepdim=True),
             "axis": (dp * p).sum(-2, keepdim=True)}[rowsum]
    ds = p * (dp - total) if outer_p else dp - total
    factor = {"sqrt": 1 / math.sqrt(d), "none": 1.0, "d": 1 / d}[grad_scale]
    dq = (ds.transpose(-2, -1) if transpose == "dq" else ds) @ k * factor
    dk = (ds if transpose == "dk" else ds.transpose(-2, -1)) @ q * factor
    if scale_dv:
        dv = dv / math.sqrt(d)
    return dq, dk, dv


def _lse_backward(Q, K, V, out, lse, dout, mask, *, p_from: str = "lse", delta: str = "out", sign: float = 1.0):
    """The recipe from (out, lse) in float64 -- with the out and lse it is given -- or with one deliberate
    change, for diagnosis."""
    q, k, v, o, do = _t(Q), _t(K), _t(V), _t(np.nan_to_num(out)), _t(dout)
    scale = 1 / math.sqrt(q.shape[-1])
    raw = q @ k.transpose(-2, -1)
    scores = raw if p_from == "unscaled" else raw * scale
    keep = None if mask is None else torch.from_numpy(np.array(mask, dtype=bool)).expand(scores.shape)
    if keep is not None and p_from != "unmasked":
        scores = scores.masked_fill(~keep, -math.inf)
    seen = torch.isfinite(_t(lse))[..., None]
    shift = torch.where(seen, _t(lse)[..., None], torch.zeros(()))
    p = torch.exp(scores) if p_from == "no_lse" else torch.exp(scores - shift)
    p = torch.where(seen, p, torch.zeros(()))
    d_row = {"out": lambda: (do * o).sum(-1, keepdim=True), "dout": lambda: do.sum(-1, keepdim=True),
             "axis": lambda: (do * o).sum(-2, keepdim=True)}[delta]()
    ds = sign * p * (do @ v.transpose(-2, -1) - d_row) * scale
    return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ do


def _attention_backward_variants(Q, K, V, dout, mask) -> list[tuple[Callable[[], Any], str]]:
    """(lazy (dQ, dK, dV) of a known mistake, its hint)."""
    s_q, s_k = Q.shape[-2], K.shape[-2]
    options: list[tuple[dict, str]] = [
        (dict(rowsum="none"), "no_rowsum"), (dict(rowsum="unweighted"), "rowsum_unweighted"),
        (dict(grad_scale="none"), "no_scale"), (dict(grad_scale="d"), "scale_by_d"), (dict(scale_dv=True), "scale_dv"),
        (dict(forward_scale=False), "forward_no_scale"), (dict(outer_p=False), "no_outer_p"),
    ]
    if s_q == s_k:
        options += [(dict(rowsum="axis"), "rowsum_axis"), (dict(transpose="dv"), "dv_transposed"),
                    (dict(transpose="dq"), "dq_transposed"), (dict(transpose="dk"), "dk_transposed"),
                    (dict(transpose="dp"), "dp_transposed")]
    if mask is not None:
        options += [(dict(use_mask=False), "mask_ignored"), (dict(fully_masked="uniform"), "fully_masked_sends")]

    def lazy(kwargs):
        cache: list = []

        def compute():
            if not cache:
                cache.append(_manual_attention_backward(Q, K, V, dout, mask, **kwargs))
            return cache[0]
        return compute

    return [(lazy(kwargs), ATTENTION_BACKWARD_HINTS[key]) for kwargs, key in options]


def _lse_backward_variants(Q, K, V, out, lse, dout, mask) -> list[tuple[Callable[[], Any], str]]:
    """(lazy (dQ, dK, dV) of a mistake of the lse recipe, its hint)."""
    options = [(dict(p_from="no_lse"), "lse_ignored"), (dict(p_from="unscaled"), "lse_unscaled_scores"),
               (dict(delta="dout"), "delta_unweighted"), (dict(sign=-1.0), "ds_sign")]
    if V.shape[-1] == K.shape[-2]:  # D summed over the queries broadcasts against dP only then
        options.append((dict(delta="axis"), "delta_axis"))
    if mask is not None:
        options.append((dict(p_from="unmasked"), "lse_mask_ignored"))
    return [(functools.lru_cache(maxsize=1)(lambda kwargs=kwargs: _lse_backward(Q, K, V, out, lse, dout, mask,
                                                                                **kwargs)),
             BACKWARD_LSE_HINTS[key]) for kwargs, key in options]


def _forward_for_backward(Q, K, V, mask, dtype, nan_rows: bool) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) as the forward saves them, in ``dtype``: out from SDPA (0 for a query with no key, or NaN
    there with ``nan_rows``, as the -inf recipe of np_attention leaves it), lse from torch.logsumexp (-inf)."""
    m = None if mask is None else torch.from_numpy(np.array(mask, dtype=bool))
    out = reference_sdpa(_t(Q), _t(K), _t(V), attn_mask=m).numpy()
    lse = _reference_lse(Q, K, mask).numpy()
    if nan_rows:
        out = np.where(np.isfinite(lse)[..., None], out, np.nan)
    return out.astype(dtype), lse.astype(dtype)


def _check_attention_backward_once(np_attention_backward: Callable, Q, K, V, dout, mask, label: str,
                                   saved_dtype=None, nan_rows: bool = False) -> None:
    b, h, s_q, d = Q.shape
    s_k, d_v = K.shape[-2], V.shape[-1]
    saved_dtype = Q.dtype if saved_dtype is None else saved_dtype
    out, lse = _forward_for_backward(Q, K, V, mask, saved_dtype, nan_rows)
    mask_text = "no mask" if mask is None else f"a boolean mask of shape {shape_str(mask.shape)}"
    saved_text = "" if saved_dtype == Q.dtype else f", out and lse in {np.dtype(saved_dtype)}"
    nan_text = " (out NaN where a query has no key)" if nan_rows else ""
    call = (f"np_attention_backward(Q, K, V, out, lse, dout, mask) with Q {_array(Q)}, K {shape_str(K.shape)}, "
            f"V {shape_str(V.shape)}, {mask_text}{saved_text}{label}{nan_text}")
    inputs = [np.array(a, copy=True) for a in (Q, K, V, out, lse, dout)] + \
        ([] if mask is None else [np.array(mask, copy=True)])
    with np.errstate(all="ignore"):
        result = _call(np_attention_backward, Q, K, V, out, lse, dout, mask, call=call,
                       matmul_hint=ATTENTION_BACKWARD_HINTS["matmul_shapes"], axis_hint=BACKWARD_LSE_HINTS["delta_axis"])
    expect_true(isinstance(result, (tuple, list)) and len(result) == 3,
                f"{call} should return a tuple (dQ, dK, dV), got {describe(result)}.")
    names = ("dQ", "dK", "dV")
    shape_hints = {"dK": {(b, h, d, s_k): ATTENTION_BACKWARD_HINTS["matmul_shapes"]},
                   "dV": {(b, h, d_v, s_k): ATTENTION_BACKWARD_HINTS["matmul_shapes"]}}
    grads = [expect_array(g, what=f"{call} -> {name}", shape=like.shape, dtype=Q.dtype,
                          hints=shape_hints.get(name), dtype_hint=DTYPE_HINTS["scaled"])
             for g, name, like in zip(result, names, (Q, K, V))]
    for before, after, name in zip(inputs, (Q, K, V, out, lse, dout, mask),
                                   ("Q", "K", "V", "out", "lse", "dout", "mask")):
        _expect_unchanged(before, after, call, name)
    expected = _attention_gradients(Q, K, V, dout, mask)
    allowed = None if mask is None else np.broadcast_to(np.asarray(mask, dtype=bool), (b, h, s_q, s_k))
    fully_masked = allowed is not None and bool((~allowed.any(-1)).any())
    for grad, name in zip(grads, names):
        if np.isnan(grad).any():
            hint = (BACKWARD_LSE_HINTS["fully_masked_delta"] if nan_rows else
                    ATTENTION_BACKWARD_HINTS["fully_masked_nan"] if fully_masked else ATTENTION_HINTS["overflow"])
            raise CheckFailure(f"{call} -> {name} contains NaN where torch.autograd gives finite gradients.\n"
                               f"  Likely mistake: {hint}")
    variants = (_lse_backward_variants(Q, K, V, out, lse, dout, mask)
                + _attention_backward_variants(Q, K, V, dout, mask))
    for index in (2, 0, 1):  # dV first: it needs only the weights; then dQ and dK
        try:
            expect_close(grads[index], expected[index], what=f"{call} -> {names[index]}",
                         against=f"{names[index]} from torch.autograd through F.scaled_dot_product_attention (float64)",
                         variants=[Variant(lambda compute=compute, i=index: compute()[i], hint)
                                   for compute, hint in variants])
        except CheckFailure as failure:
            if "Likely mistake" in str(failure):
                raise
            if allowed is not None:
                _expect_no_leak(np_attention_backward, Q, K, V, out, lse, dout, mask, allowed, call)
            lower = _precision_inside(np_attention_backward, Q, K, V, dout, mask, call)
            if lower is not None:
                raise CheckFailure(f"{failure}\n  Likely mistake: {BACKWARD_LSE_HINTS[lower + '_inside']}") from None
            raise


def _precision_inside(np_attention_backward: Callable, Q, K, V, dout, mask, call: str) -> str | None:
    """"float32" (float64 input) or "float16" (float32 input) when the answer computes in that lower precision
    inside: given inputs that are exact in it, and the same inputs changed below its precision, it returns exactly
    the same numbers (an answer that keeps the input's dtype does not). None otherwise."""
    lower = {np.dtype(np.float64): np.float32, np.dtype(np.float32): np.float16}.get(Q.dtype)
    if lower is None:
        return None
    exact = [np.asarray(a).astype(lower).astype(Q.dtype) for a in (Q, K, V, dout)]
    out, lse = (a.astype(lower).astype(Q.dtype) for a in _forward_for_backward(*exact[:3], mask, Q.dtype, False))
    arrays = [*exact[:3], out, lse, exact[3]]
    nudge = Q.dtype.type(1 + float(np.finfo(lower).eps) / 64)  # below half a unit of `lower`: rounds back to it
    results = []
    for given in (arrays, [a * nudge for a in arrays]):
        try:
            with np.errstate(all="ignore"):
                results.append(_call(np_attention_backward, *given[:6], mask, call=call))
        except CheckFailure:
            return None
    same = all(isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b, equal_nan=True)
               for a, b in zip(*results))
    return np.dtype(lower).name if same else None


def _expect_backward_from_saved(np_attention_backward: Callable, rng: np.random.Generator) -> None:
    """The method: given an out that is not the forward's, then an lse shifted by a known constant per query row,
    the gradients must change exactly as D = rowsum(dout ∘ out) and P = exp(s − lse) say. A backward that
    recomputes D from P and dP, or P with a softmax, returns the gradients of attention whatever it is given."""
    Q, K, V, dout = (_normal(rng, 1, 2, 6, width) for width in (4, 4, 3, 3))
    mask = np.tril(np.ones((6, 6), dtype=bool))
    out, lse = _forward_for_backward(Q, K, V, mask, np.float64, nan_rows=False)
    recomputed = _attention_gradients(Q, K, V, dout, mask)  # what an answer that ignores out or lse returns
    changes = [("out", "out + a known change (not the forward's out)", out + _normal(rng, *out.shape, scale=0.5), lse,
                "delta_recomputed"),
               ("lse", "lse + a known constant per query row", out, lse + rng.uniform(0.3, 1.0, lse.shape),
                "lse_recomputed")]
    for name, given, changed_out, changed_lse, hint in changes:
        call = (f"np_attention_backward(Q, K, V, out, lse, dout, mask) with Q {_array(Q)}, K and V {shape_str(K.shape)}, "
                f"a causal mask, and given {given}")
        with np.errstate(all="ignore"):
            result = _call(np_attention_backward, Q, K, V, changed_out, changed_lse, dout, mask, call=call)
        expected = _lse_backward(Q, K, V, changed_out, changed_lse, dout, mask)
        for index in (2, 0, 1):
            if torch.allclose(expected[index], recomputed[index]):
                continue  # this gradient does not use what was changed (dV does not use out)
            grad_name = ("dQ", "dK", "dV")[index]
            got = expect_array(result[index] if isinstance(result, (tuple, list)) and len(result) == 3 else result,
                               what=f"{call} -> {grad_name}", shape=(Q, K, V)[index].shape)
            expect_close(got, expected[index], what=f"{call} -> {grad_name}",
                         against=f"the formula with the {name} it was given (float64)",
                         variants=[Variant(recomputed[index], BACKWARD_LSE_HINTS[hint])])


def _expect_no_leak(np_attention_backward: Callable, Q, K, V, out, lse, dout, mask, allowed: np.ndarray,
                    call: str) -> None:
    """With a gradient on one query only, the keys that query may not attend to get dK = dV = 0."""
    masked_per_query = (~allowed).sum(axis=(0, 1, 3)) * allowed.any(-1).all(axis=(0, 1))  # skip fully masked
    query = int(np.argmax(masked_per_query))
    if masked_per_query[query] == 0:
        return
    probe = np.zeros_like(dout)
    probe[..., query, :] = dout[..., query, :]
    with np.errstate(all="ignore"):
        grads = _call(np_attention_backward, Q, K, V, out, lse, probe, mask, call=call)
    hidden = ~allowed[:, :, query, :]  # (B, H, S_k): the keys this query may not see
    for grad, name in zip(grads[1:], ("dK", "dV")):
        grad = np.asarray(grad)
        leak = float(np.nan_to_num(np.abs(grad[hidden]), nan=np.inf).max())
        if leak > tolerance(grad.dtype)[1]:
            raise CheckFailure(f"{call} with dout nonzero on query {query} only -> {name}: the keys query {query} is "
                               f"masked from should get exactly 0, found {leak:.3g}.\n  Likely mistake: "
                               f"{ATTENTION_BACKWARD_HINTS['masked_leak']}")


@check("np_attention_backward: dQ, dK, dV from (out, lse) equal torch.autograd, with masks, fully masked rows "
       "and large scores", uses=("softmax_backward", "np_softmax", "np_attention_lse"))
@_one_thread
def check_np_attention_backward(np_attention_backward: Callable, *, seed: int = 0,
                                device: torch.device | None = None) -> None:
    """np_attention_backward: the gradients of attention's out with respect to Q, K and V, from the saved
    out and lse (computed here in float64 by PyTorch, as np_attention_lse returns them)."""
    expect_signature(np_attention_backward, "np_attention_backward", ["Q", "K", "V", "out", "lse", "dout", "mask"])
    rng = _rng(seed)

    def case(b, h, s_q, s_k, d, d_v, mask=None, label="", dtype=np.float64, scale=1.0, saved_dtype=None,
             nan_rows=False):
        Q, K = _normal(rng, b, h, s_q, d, dtype=dtype, scale=scale), _normal(rng, b, h, s_k, d, dtype=dtype, scale=scale)
        V, dout = _normal(rng, b, h, s_k, d_v, dtype=dtype), _normal(rng, b, h, s_q, d_v, dtype=dtype)
        _check_attention_backward_once(np_attention_backward, Q, K, V, dout, mask, label, saved_dtype, nan_rows)

    causal = np.tril(np.ones((6, 6), dtype=bool))
    case(2, 2, 6, 6, 2, 2)  # the notebook's configuration
    case(2, 2, 6, 6, 2, 2, causal, " (causal)")
    case(1, 2, 5, 4, 3, 4)  # d_v = S_k: a sum over the wrong axis broadcasts, and is wrong
    case(2, 3, 4, 5, 8, 3, dtype=np.float32)  # cross-attention sizes, float32, d_v != d
    case(2, 3, 4, 5, 8, 3, dtype=np.float32, saved_dtype=np.float64)  # the saved arrays in another dtype
    padding = np.ones((2, 1, 1, 5), dtype=bool)
    padding[1, ..., 3:] = False  # the last two keys of the second sequence are padding
    case(2, 2, 4, 5, 4, 4, padding, " (padding)")
    # Fully masked rows: padding queries that may attend to nothing, and one such row in a (S_q, S_k) mask.
    queries_and_keys = np.ones((2, 1, 5, 6), dtype=bool)
    queries_and_keys[1, :, 3:, :] = False
    queries_and_keys[1, :, :, 4:] = False
    case(2, 2, 5, 6, 4, 3, queries_and_keys, " (padding queries: fully masked rows)")
    case(2, 2, 5, 6, 4, 3, queries_and_keys, " (padding queries: fully masked rows)", nan_rows=True)
    one_row = np.tril(np.ones((5, 5), dtype=bool), -1)  # strictly causal: query 0 sees nothing
    case(1, 2, 5, 5, 3, 3, one_row, " (strictly causal: query 0 is fully masked)", dtype=np.float32)
    case(1, 2, 6, 6, 8, 8, causal, " (large scores)", scale=30.0)  # a naive softmax overflows
    for _ in range(3):
        b, h, s, d = (int(v) for v in rng.integers(1, 5, size=4))
        mask = rng.random((s, s)) < 0.6
        case(b, h, s, s, d, int(rng.integers(1, 5)), mask, " (random mask)")
    _expect_backward_from_saved(np_attention_backward, rng)


freeze_module(__name__)
