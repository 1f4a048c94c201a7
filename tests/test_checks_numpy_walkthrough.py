"""The checks of notebook 02 accept correct NumPy answers written differently and reject known mistakes.

Every wrong answer here is a mistake a student really makes (most of them are in the seed
walkthrough itself); each must be rejected with the hint that names it. The correct answers
are deliberately written another way than the solution notebook.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import warnings

import numpy as np
import pytest
import torch

from attention_lab.checking import CheckFailure, choice_digest
from attention_lab.checks import numpy_walkthrough as checks
from tests.bridge_harness import run_both_ways
from tests.curriculum import solution_cells
from attention_lab.widgets.numpy_scores import RAW, SCALED, variance_explorer

# Every test twice: the checks in the student's kernel (the lab), and through the bridge (grading).
where_checks_run = run_both_ways()

CPU = {"device": "cpu", "quiet": True}
# NumPy 2 promotes a float32 array times a NumPy float64 scalar (1 / np.sqrt(d)) to float64;
# NumPy 1 kept float32, so there that scale is no mistake and the checks must accept it.
NUMPY_SCALARS_PROMOTE = (np.ones(1, np.float32) * np.float64(1.0)).dtype == np.float64


def _reference_softmax(x, axis=-1):
    shifted = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=axis, keepdims=True)


# --------------------------------------------------------------------------------------
# row_times_matrix
# --------------------------------------------------------------------------------------


def row_generator_sum(x_row, W):
    return np.array([sum(x_row[i] * W[i, j] for i in range(len(x_row))) for j in range(W.shape[1])],
                    dtype=np.result_type(x_row, W))


def row_broadcast_sum(x_row, W):
    return np.sum(x_row[:, None] * W, axis=0)


def row_uses_matmul(x_row, W):
    return x_row @ W


def row_uses_dot(x_row, W):
    return np.dot(x_row, W)


def row_uses_einsum(x_row, W):
    return np.einsum("i,ij->j", x_row, W)


def row_indices_swapped(x_row, W):
    # out[j] = sum_i x[i] * W[j, i]: one entry per *row* of W
    n_rows, n_columns = W.shape
    out = np.zeros(n_rows, dtype=W.dtype)
    for j in range(n_rows):
        for i in range(n_columns):
            out[j] += x_row[i] * W[j, i]
    return out


def row_square_transposed(x_row, W):
    out = np.zeros(W.shape[1], dtype=W.dtype)
    for j in range(W.shape[1]):
        for i in range(W.shape[0]):
            out[j] += x_row[i] * W[j, i]
    return out


def row_default_dtype(x_row, W):
    out = np.zeros(W.shape[1])  # float64 whatever the input
    for j in range(W.shape[1]):
        out[j] = sum(x_row[i] * W[i, j] for i in range(W.shape[0]))
    return out


def row_asarray_matmul(x_row, W):
    return np.asarray(x_row) @ np.asarray(W)  # plain arrays: the runtime guard cannot see this @


def row_asarray_dot(x_row, W):
    return np.dot(np.asarray(x_row), np.asarray(W))


def row_asarray_inner(x_row, W):
    return np.inner(np.asarray(x_row), np.asarray(W).T)


def row_asarray_matmul_function(x_row, W):
    return np.matmul(np.array(x_row), np.array(W))


def row_loop_with_dot(x_row, W):
    x = np.asarray(x_row)
    return np.array([x.dot(np.asarray(W)[:, j]) for j in range(W.shape[1])])


def row_w_index_swapped(x_row, W):
    out = np.zeros(W.shape[1], dtype=W.dtype)
    for j in range(W.shape[1]):
        for i in range(W.shape[0]):
            out[j] += x_row[i] * W[j, i]  # W[j, i] instead of W[i, j]
    return out


def row_ranges_swapped(x_row, W):
    out = np.zeros(W.shape[1], dtype=W.dtype)
    for j in range(W.shape[0]):  # j over the rows, i over the columns: right only when square
        for i in range(W.shape[1]):
            out[j] += x_row[i] * W[i, j]
    return out


def row_off_by_one(x_row, W):
    out = np.zeros(W.shape[1], dtype=W.dtype)
    for j in range(W.shape[1]):
        for i in range(W.shape[0]):
            out[j] += x_row[i] * W[i, j + 1]  # off by one
    return out


def row_via_torch(x_row, W):
    return (torch.from_numpy(np.asarray(x_row)) @ torch.from_numpy(np.asarray(W))).numpy()


def row_returns_list(x_row, W):
    return [sum(x_row[i] * W[i, j] for i in range(W.shape[0])) for j in range(W.shape[1])]


def row_one_loop_elementwise(x_row, W):
    return np.array([np.sum(x_row * W[:, j]) for j in range(W.shape[1])], dtype=np.result_type(x_row, W))


def row_sum_of_scaled_rows(x_row, W):
    total = np.zeros(W.shape[1], dtype=np.result_type(x_row, W))
    for i in range(W.shape[0]):
        total = total + x_row[i] * W[i]  # out = Σ_i x_row[i] · (row i of W)
    return total


def test_row_times_matrix_accepts_correct_answers_written_differently():
    checks.check_row_times_matrix(row_generator_sum, **CPU)
    checks.check_row_times_matrix(row_one_loop_elementwise, seed=3, **CPU)
    checks.check_row_times_matrix(row_sum_of_scaled_rows, seed=4, **CPU)


@pytest.mark.parametrize("wrong, phrase", [
    (row_uses_matmul, r"should write the sums itself[\s\S]*np.matmul"),
    (row_uses_dot, r"should write the sums itself[\s\S]*np.dot"),
    (row_uses_einsum, r"should write the sums itself[\s\S]*np.einsum"),
    (row_asarray_matmul, r"should write the sums itself[\s\S]*calls @ \(in row_asarray_matmul, line \d+\)"),
    (row_asarray_dot, r"should write the sums itself[\s\S]*np.dot \(in row_asarray_dot"),
    (row_asarray_inner, r"should write the sums itself[\s\S]*np.inner"),
    (row_asarray_matmul_function, r"should write the sums itself[\s\S]*np.matmul"),
    (row_loop_with_dot, r"should write the sums itself[\s\S]*x.dot"),
    (row_broadcast_sum, "has no loop" + r"[\s\S]*" + re.escape(checks.ROW_HINTS["no_loop"])),
    (row_w_index_swapped, r"raised IndexError[\s\S]*" + re.escape(checks.ROW_HINTS["index_transposed"])),
    (row_ranges_swapped, r"raised IndexError[\s\S]*" + re.escape(checks.ROW_HINTS["loop_ranges"])),
    (row_off_by_one, r"raised IndexError[\s\S]*" + re.escape(checks.ROW_HINTS["index_error"])),
    (row_indices_swapped, r"should have shape \[3\], got \[4\][\s\S]*one per column"),
    (row_default_dtype, "should keep the input dtype float32, got float64\\.\\n  Likely mistake: " + re.escape(checks.DTYPE_HINTS["row"])),
    (row_via_torch, "NumPy only"),
    (row_returns_list, "should return a NumPy ndarray of shape"),
])
def test_row_times_matrix_rejects_known_mistakes(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_row_times_matrix(wrong, **CPU)


def test_row_times_matrix_names_transposed_indices_on_a_square_matrix():
    rng = np.random.default_rng(0)
    with pytest.raises(CheckFailure, match=r"x_row @ W[\s\S]*W @ x_row"):
        checks._check_row_once(row_square_transposed, rng.standard_normal(4), rng.standard_normal((4, 4)))


def test_row_times_matrix_reports_a_blank_and_a_renamed_parameter():
    def blank(x_row, W):
        raise NotImplementedError("Exercise 2.1: implement row_times_matrix")

    with pytest.raises(CheckFailure, match="not implemented yet"):
        checks.check_row_times_matrix(blank, **CPU)
    with pytest.raises(CheckFailure, match=r"should take the parameters \(x_row, W\), but it takes \(x, W\)"):
        checks.check_row_times_matrix(lambda x, W: row_broadcast_sum(x, W), **CPU)


# --------------------------------------------------------------------------------------
# np_split_heads / np_merge_heads
# --------------------------------------------------------------------------------------


def split_by_np_split(t, num_heads):
    if t.shape[-1] % num_heads:
        raise ValueError(f"width {t.shape[-1]} cannot be split into {num_heads} heads")
    return np.stack(np.split(t, num_heads, axis=-1), axis=1)


def split_no_transpose(t, num_heads):
    b, s, n = t.shape
    if n % num_heads:
        raise ValueError(f"{n} {num_heads}")
    return t.reshape(b, s, num_heads, n // num_heads)


def split_reshape_only(t, num_heads):
    b, s, n = t.shape
    if n % num_heads:
        raise ValueError(f"{n} {num_heads}")
    return t.reshape(b, num_heads, s, n // num_heads)


def split_strided(t, num_heads):
    b, s, n = t.shape
    if n % num_heads:
        raise ValueError(f"{n} {num_heads}")
    return t.reshape(b, s, n // num_heads, num_heads).transpose(0, 3, 1, 2)


def split_vague_error(t, num_heads):
    return np.stack(np.split(t, num_heads, axis=-1), axis=1)  # np.split's own ValueError names neither number


def split_silent(t, num_heads):
    b, s, n = t.shape
    d = n // num_heads
    return t[..., : d * num_heads].reshape(b, s, num_heads, d).transpose(0, 2, 1, 3)


def split_sequence_axis(t, num_heads):
    if t.shape[-1] % num_heads:
        raise ValueError(f"width {t.shape[-1]} cannot be split into {num_heads} heads")
    return np.stack(np.split(t, num_heads, axis=1), axis=1)  # splits the tokens, not the features


def split_float32(t, num_heads):
    return split_by_np_split(t, num_heads).astype(np.float32)


def split_via_torch(t, num_heads):
    x = torch.from_numpy(t)
    return x.unflatten(-1, (num_heads, -1)).transpose(1, 2).numpy()


def test_np_split_heads_accepts_a_correct_answer_written_differently():
    checks.check_np_split_heads(split_by_np_split, **CPU)
    checks.check_np_split_heads(split_by_np_split, seed=5, **CPU)


@pytest.mark.parametrize("wrong, phrase", [
    (split_no_transpose, r"should have shape \[2, 2, 6, 2\], got \[2, 6, 2, 2\][\s\S]*transpose\(0, 2, 1, 3\)"),
    (split_reshape_only, "reshape reads memory in order"),
    (split_strided, "every H-th feature"),
    (split_vague_error, "should name 10 and 4"),
    (split_silent, "should raise ValueError"),
    (split_float32, "should keep the input dtype float64, got float32\\.\\n  Likely mistake: " + re.escape(checks.DTYPE_HINTS["heads"])),
    (split_sequence_axis, r"should have shape \[2, 2, 6, 2\], got \[2, 2, 3, 4\][\s\S]*"
     + re.escape(checks.SPLIT_HINTS["sequence_axis"])),
    (split_via_torch, "NumPy only"),
])
def test_np_split_heads_rejects_known_mistakes(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_np_split_heads(wrong, **CPU)


def merge_by_concatenate(t):
    return np.concatenate([t[:, h] for h in range(t.shape[1])], axis=-1)


def merge_reshape_only(t):
    b, h, s, d = t.shape
    return t.reshape(b, s, h * d)


def merge_forgets_to_flatten(t):
    return t.transpose(0, 2, 1, 3)


def merge_in_place_transpose(t):
    # ndarray.shape assignment on a transposed view fails: a classic "view" mistake
    merged = t.transpose(0, 2, 1, 3)
    merged.shape = (t.shape[0], t.shape[2], t.shape[1] * t.shape[3])
    return merged


def merge_float64(t):
    return merge_by_concatenate(t).astype(np.float64)


def test_np_merge_heads_accepts_and_rejects():
    checks.check_np_merge_heads(merge_by_concatenate, **CPU)
    with pytest.raises(CheckFailure, match="Move the head axis back"):
        checks.check_np_merge_heads(merge_reshape_only, **CPU)
    with pytest.raises(CheckFailure, match=r"should have shape \[2, 6, 4\], got \[2, 6, 2, 2\]"):
        checks.check_np_merge_heads(merge_forgets_to_flatten, **CPU)
    with pytest.raises(CheckFailure, match="raised AttributeError"):
        checks.check_np_merge_heads(merge_in_place_transpose, **CPU)
    with pytest.raises(CheckFailure, match="got float64\\.\\n  Likely mistake: " + re.escape(checks.DTYPE_HINTS["heads"])):
        checks.check_np_merge_heads(merge_float64, **CPU)


# --------------------------------------------------------------------------------------
# np_softmax
# --------------------------------------------------------------------------------------


def softmax_logsumexp(x, axis=-1):
    top = np.max(x, axis=axis, keepdims=True)
    log_total = top + np.log(np.sum(np.exp(x - top), axis=axis, keepdims=True))
    return np.exp(x - log_total)


def softmax_naive(x, axis=-1):
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def softmax_global_max(x, axis=-1):
    e = np.exp(x - np.max(x))
    return e / e.sum(axis=axis, keepdims=True)


def softmax_ignores_axis(x, axis=-1):
    return _reference_softmax(x, -1)


def softmax_no_keepdims(x, axis=-1):
    e = np.exp(x - np.max(x, axis=axis))
    return e / e.sum(axis=axis, keepdims=True)


def softmax_min_shift(x, axis=-1):
    e = np.exp(x - np.min(x, axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def softmax_in_place(x, axis=-1):
    x -= np.max(x, axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def softmax_always_float64(x, axis=-1):
    return _reference_softmax(x.astype(np.float64), axis)


def softmax_scipy(x, axis=-1):
    import scipy.special

    return scipy.special.softmax(x, axis=axis)


def softmax_scipy_logsumexp(x, axis=-1):
    from scipy.special import logsumexp

    return np.exp(x - logsumexp(x, axis=axis, keepdims=True))


def softmax_max_other_axis(x, axis=-1):
    other = 0 if axis % x.ndim != 0 else -1
    e = np.exp(x - np.max(x, axis=other, keepdims=True))  # the max over the wrong axis
    return e / e.sum(axis=axis, keepdims=True)


def softmax_via_torch(x, axis=-1):
    return torch.softmax(torch.from_numpy(x), dim=axis).numpy()


def test_np_softmax_accepts_a_correct_answer_written_differently():
    checks.check_np_softmax(softmax_logsumexp, **CPU)
    checks.check_np_softmax(softmax_logsumexp, seed=9, **CPU)


@pytest.mark.parametrize("wrong, phrase", [
    (softmax_naive, r"returned NaN[\s\S]*Subtract each row's maximum"),
    (softmax_global_max, r"returned NaN[\s\S]*one maximum for the whole array"),
    (softmax_ignores_axis, "a different axis was asked for"),
    (softmax_no_keepdims, "keepdims=True"),
    (softmax_min_shift, r"returned NaN[\s\S]*not its minimum"),
    (softmax_in_place, "changed its input x in place"),
    (softmax_always_float64, "should keep the input dtype float32, got float64\\.\\n  Likely mistake: "
     + re.escape(checks.DTYPE_HINTS["softmax"])),
    (softmax_scipy, r"should compute the softmax itself[\s\S]*calls scipy.special.softmax \(in softmax_scipy"),
    (softmax_scipy_logsumexp, r"should compute the softmax itself[\s\S]*calls logsumexp"),
    (softmax_max_other_axis, re.escape(checks.SOFTMAX_HINTS["max_axis"])),
    (softmax_via_torch, r"calls torch.softmax[\s\S]*NumPy only"),
])
def test_np_softmax_rejects_known_mistakes(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_np_softmax(wrong, **CPU)


def test_np_softmax_global_max_is_caught_only_by_rows_of_different_scales():
    # On the first inputs a global max is harmless; the check must reach the row near -1000.
    with pytest.raises(CheckFailure, match="rows near 0 and near -1000"):
        checks.check_np_softmax(softmax_global_max, **CPU)


# --------------------------------------------------------------------------------------
# np_attention
# --------------------------------------------------------------------------------------


def attention_einsum(Q, K, V, mask=None):
    scores = np.einsum("bhqd,bhkd->bhqk", Q, K) * (1.0 / math.sqrt(Q.shape[-1]))
    if mask is not None:
        scores = np.where(mask, scores, -1e30)  # finite fill is fine: exp underflows to exactly 0
    weights = softmax_logsumexp(scores, axis=-1)
    return np.einsum("bhqk,bhkd->bhqd", weights, V), weights


def _attention_with(Q, K, V, mask, *, scale=None, axis=-1, flip=False, transpose_k=True, mask_after=False,
                    weights_t=False, softmax=_reference_softmax):
    d = Q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = (Q @ (np.swapaxes(K, -1, -2) if transpose_k else K)) * scale
    if mask is not None and not mask_after:
        scores = np.where(~mask if flip else mask, scores, -np.inf)
    weights = softmax(scores, axis=axis)
    if mask is not None and mask_after:
        weights = weights * mask
    return (np.swapaxes(weights, -1, -2) if weights_t else weights) @ V, weights


WRONG_ATTENTION = {
    "no_scale": (lambda Q, K, V, mask=None: _attention_with(Q, K, V, mask, scale=1.0), "no 1/sqrt"),
    "scale_by_d": (lambda Q, K, V, mask=None: _attention_with(Q, K, V, mask, scale=1.0 / Q.shape[-1]),
                   "divided by d_head"),
    "wrong_axis": (lambda Q, K, V, mask=None: _attention_with(Q, K, V, mask, axis=-2), "wrong axis"),
    "flipped": (lambda Q, K, V, mask=None: _attention_with(Q, K, V, mask, flip=True), "polarity flipped"),
    "ignored": (lambda Q, K, V, mask=None: _attention_with(Q, K, V, None), "mask was ignored"),
    "after_softmax": (lambda Q, K, V, mask=None: _attention_with(Q, K, V, mask, mask_after=True),
                      "after the softmax"),
    "no_transpose": (lambda Q, K, V, mask=None: _attention_with(Q, K, V, mask, transpose_k=False),
                     r"transpose[\s\S]*last two"),
    "full_transpose": (lambda Q, K, V, mask=None: (lambda w: (w @ V, w))(_reference_softmax(Q @ K.T)),
                       "K.T reverses all four axes"),
    "weights_transposed": (lambda Q, K, V, mask=None: _attention_with(Q, K, V, mask, weights_t=True),
                           r"weights @ V[\s\S]*not its transpose"),
    "naive_softmax": (lambda Q, K, V, mask=None: _attention_with(Q, K, V, mask, softmax=softmax_naive),
                      "softmax overflowed"),
    "np_sqrt": (lambda Q, K, V, mask=None: _attention_with(Q, K, V, mask, scale=1 / np.sqrt(Q.shape[-1])),
                r"keep the input dtype float32, got float64\.\n  Likely mistake: NumPy 2 keeps[\s\S]*math.sqrt[\s\S]*float32 in, float32 out"),
    "only_out": (lambda Q, K, V, mask=None: _attention_with(Q, K, V, mask)[0], "should return a tuple"),
    "torch": (lambda Q, K, V, mask=None: tuple(
        t.numpy() for t in _torch_attention(torch.from_numpy(Q), torch.from_numpy(K), torch.from_numpy(V))), "NumPy only"),
}


def _torch_attention(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1)
    return weights @ v, weights


def test_np_attention_accepts_a_correct_answer_written_differently():
    checks.check_np_attention(attention_einsum, **CPU)
    checks.check_np_attention(attention_einsum, seed=4, **CPU)


@pytest.mark.parametrize("name", sorted(WRONG_ATTENTION))
def test_np_attention_rejects_known_mistakes(name):
    wrong, phrase = WRONG_ATTENTION[name]

    def np_attention(Q, K, V, mask=None):
        with np.errstate(all="ignore"):
            return wrong(Q, K, V, mask)

    if name == "np_sqrt" and not NUMPY_SCALARS_PROMOTE:
        checks.check_np_attention(np_attention, **CPU)
        return
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_np_attention(np_attention, **CPU)


# --------------------------------------------------------------------------------------
# np_multi_head_attention
# --------------------------------------------------------------------------------------


def mha_einsum(X, W_q, W_k, W_v, W_o, num_heads, mask=None):
    b, s, width = X.shape
    d = width // num_heads
    q, k, v = (np.einsum("bsi,io->bso", X, W).reshape(b, s, num_heads, d) for W in (W_q, W_k, W_v))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    weights = softmax_logsumexp(scores)
    context = np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, width)
    return context @ W_o


def _mha_with(X, W_q, W_k, W_v, W_o, num_heads, mask=None, *, use_out=True, t_qkv=False, t_out=False,
              scale=None, flip=False, split="right", merge="right"):
    b, s, width = X.shape
    d = width // num_heads

    def heads(t):
        if split == "reshape":
            return t.reshape(b, num_heads, s, d)
        return t.reshape(b, s, num_heads, d).transpose(0, 2, 1, 3)

    q, k, v = (heads(X @ (W.T if t_qkv else W)) for W in (W_q, W_k, W_v))
    m = None if mask is None else (~mask if flip else mask)
    scores = q @ np.swapaxes(k, -1, -2) * (1 / math.sqrt(d) if scale is None else scale)
    if m is not None:
        scores = np.where(m, scores, -np.inf)
    with np.errstate(all="ignore"):
        context = _reference_softmax(scores) @ v
    merged = context.reshape(b, s, width) if merge == "reshape" else context.transpose(0, 2, 1, 3).reshape(b, s, width)
    if not use_out:
        return merged
    return merged @ (W_o.T if t_out else W_o)


WRONG_MHA = {
    "no_out": (dict(use_out=False), "output projection is missing"),
    "layout": (dict(t_qkv=True, t_out=True), r"\(out, in\) layout \(X @ W.T"),
    "layout_qkv": (dict(t_qkv=True), r"W_q, W_k, W_v in \(out, in\) layout"),
    "layout_out": (dict(t_out=True), r"W_o in \(out, in\) layout"),
    "no_scale": (dict(scale=1.0), "no 1/sqrt"),
    "scale_by_width": (dict(scale=0.5), r"1/sqrt\(D\)"),  # D = 4 in the first case
    "flipped": (dict(flip=True), "polarity flipped"),
    "split": (dict(split="reshape"), "split wrongly"),
    "merge": (dict(merge="reshape"), "merged wrongly"),
}


def test_np_multi_head_attention_accepts_a_correct_answer_written_differently():
    checks.check_np_multi_head_attention(mha_einsum, **CPU)
    checks.check_np_multi_head_attention(mha_einsum, seed=11, **CPU)


@pytest.mark.parametrize("name", sorted(WRONG_MHA))
def test_np_multi_head_attention_rejects_known_mistakes(name):
    options, phrase = WRONG_MHA[name]

    def np_multi_head_attention(X, W_q, W_k, W_v, W_o, num_heads, mask=None):
        return _mha_with(X, W_q, W_k, W_v, W_o, num_heads, mask, **options)

    with pytest.raises(CheckFailure, match=phrase):
        checks.check_np_multi_head_attention(np_multi_head_attention, **CPU)


def test_np_multi_head_attention_flipped_causal_mask_is_named_even_when_it_gives_nan():
    # A flipped causal mask leaves the last query nothing to attend to: NaN, diagnosed as polarity.
    weights = tuple(np.random.default_rng(1).standard_normal((4, 4)) for _ in range(4))
    X = np.random.default_rng(2).standard_normal((2, 6, 4))
    causal = np.tril(np.ones((6, 6), dtype=bool))

    def flipped(X, W_q, W_k, W_v, W_o, num_heads, mask=None):
        return _mha_with(X, W_q, W_k, W_v, W_o, num_heads, mask, flip=True)

    with pytest.raises(CheckFailure, match=r"contains NaN[\s\S]*polarity flipped"):
        checks._check_mha_once(flipped, X, weights, 2, causal)


def test_np_multi_head_attention_rejects_torch_and_wrong_returns():
    def via_torch(X, W_q, W_k, W_v, W_o, num_heads, mask=None):
        module = torch.nn.MultiheadAttention(X.shape[-1], num_heads, bias=False, batch_first=True, dtype=torch.float64)
        x = torch.from_numpy(X)
        return module(x, x, x)[0].detach().numpy()

    def returns_tuple(X, W_q, W_k, W_v, W_o, num_heads, mask=None):
        return mha_einsum(X, W_q, W_k, W_v, W_o, num_heads, mask), None

    def np_sqrt_scale(X, W_q, W_k, W_v, W_o, num_heads, mask=None):
        return _mha_with(X, W_q, W_k, W_v, W_o, num_heads, mask, scale=1 / np.sqrt(X.shape[-1] // num_heads))

    with pytest.raises(CheckFailure, match="NumPy only"):
        checks.check_np_multi_head_attention(via_torch, **CPU)
    with pytest.raises(CheckFailure, match="should return a NumPy ndarray of shape"):
        checks.check_np_multi_head_attention(returns_tuple, **CPU)
    if NUMPY_SCALARS_PROMOTE:
        with pytest.raises(CheckFailure, match="should keep the input dtype float32, got float64"):
            checks.check_np_multi_head_attention(np_sqrt_scale, **CPU)
    else:
        checks.check_np_multi_head_attention(np_sqrt_scale, **CPU)
    with pytest.raises(CheckFailure, match=r"should take the parameters \(X, W_q, W_k, W_v, W_o, num_heads, mask\)"):
        checks.check_np_multi_head_attention(lambda X, W_q, W_k, W_v, W_o, H, mask=None: None, **CPU)


# --------------------------------------------------------------------------------------
# dot_product_variance
# --------------------------------------------------------------------------------------


def variance_mean_of_squares(d_head, sigma, n_samples, rng):
    q = sigma * rng.standard_normal((n_samples, d_head))
    k = sigma * rng.standard_normal((n_samples, d_head))
    return float(np.mean(np.einsum("nd,nd->n", q, k) ** 2))


def variance_sigma_squared(d_head, sigma, n_samples, rng):
    q = rng.normal(0.0, sigma, size=(n_samples, d_head))
    k = rng.normal(0.0, 1.0, size=(n_samples, d_head))  # only one of them scaled: the seed's d·σ²
    return float(np.var(np.sum(q * k, axis=-1)))


def variance_scale_is_variance(d_head, sigma, n_samples, rng):
    q = rng.normal(0.0, sigma**2, size=(n_samples, d_head))
    k = rng.normal(0.0, sigma**2, size=(n_samples, d_head))
    return float(np.var(np.sum(q * k, axis=-1)))


def variance_returns_std(d_head, sigma, n_samples, rng):
    q, k = (rng.normal(0.0, sigma, size=(n_samples, d_head)) for _ in range(2))
    return float(np.std(np.sum(q * k, axis=-1)))


def variance_scaled_scores(d_head, sigma, n_samples, rng):
    q, k = (rng.normal(0.0, sigma, size=(n_samples, d_head)) for _ in range(2))
    return float(np.var(np.sum(q * k, axis=-1) / math.sqrt(d_head)))


def variance_self_dot(d_head, sigma, n_samples, rng):
    q = rng.normal(0.0, sigma, size=(n_samples, d_head))
    return float(np.var(np.sum(q * q, axis=-1)))


def variance_of_q_alone(d_head, sigma, n_samples, rng):
    q = rng.normal(0.0, sigma, size=(n_samples, d_head))
    rng.normal(0.0, sigma, size=(n_samples, d_head))  # k, drawn and never used
    return float(np.var(q))


def variance_summed_over_samples(d_head, sigma, n_samples, rng):
    q, k = (rng.normal(0.0, sigma, size=(n_samples, d_head)) for _ in range(2))
    return float(np.var(np.sum(q * k, axis=0)))  # one sum per feature, over the samples


def variance_formula(d_head, sigma, n_samples, rng):
    return d_head * sigma**4


def variance_global_rng(d_head, sigma, n_samples, rng):
    q, k = (np.random.normal(0.0, sigma, size=(n_samples, d_head)) for _ in range(2))
    return float(np.var(np.sum(q * k, axis=-1)))


def variance_own_rng(d_head, sigma, n_samples, rng):
    return variance_mean_of_squares(d_head, sigma, n_samples, np.random.default_rng(0))


def variance_mixed_rng(d_head, sigma, n_samples, rng):
    q = rng.normal(0.0, sigma, size=(n_samples, d_head))
    k = np.random.normal(0.0, sigma, size=(n_samples, d_head))
    return float(np.var(np.sum(q * k, axis=-1)))


def variance_returns_array(d_head, sigma, n_samples, rng):
    return np.array([variance_mean_of_squares(d_head, sigma, n_samples, rng)])


def variance_via_torch(d_head, sigma, n_samples, rng):
    q = torch.from_numpy(rng.normal(0.0, sigma, size=(n_samples, d_head)))
    k = torch.from_numpy(rng.normal(0.0, sigma, size=(n_samples, d_head)))
    return float((q * k).sum(-1).var())


def variance_loop_ddof(d_head, sigma, n_samples, rng):
    """Right: one pair at a time in a loop, the unbiased variance (ddof=1)."""
    products = [float(rng.normal(0.0, sigma, d_head) @ rng.normal(0.0, sigma, d_head)) for _ in range(n_samples)]
    return np.var(products, ddof=1)  # a NumPy float64


def variance_float32_einsum(d_head, sigma, n_samples, rng):
    """Right: both vectors drawn at once, float32, np.var of an einsum; a NumPy float32 scalar returned."""
    q, k = rng.standard_normal((2, n_samples, d_head), dtype=np.float32) * np.float32(sigma)
    return np.var(np.einsum("nd,nd->n", q, k))


def variance_formula_with_jitter(d_head, sigma, n_samples, rng):
    """The closed form with a little noise drawn from rng: it depends on the rng and is close, but measures nothing
    (issue #51: it got full marks)."""
    return d_head * sigma**4 * (1 + 1e-3 * rng.standard_normal())


def variance_of_fixed_pairs(d_head, sigma, n_samples, rng):
    """A measurement on 10,000 pairs whatever n_samples asks for: close at every size, but n_samples ignored."""
    return variance_mean_of_squares(d_head, sigma, 10_000, rng)


def variance_of_fewer_pairs(d_head, sigma, n_samples, rng):
    """A measurement on 20 pairs where n_samples is small (on all of them where it is large, so that the numbers
    alone pass): it measures fewer pairs than asked."""
    return variance_mean_of_squares(d_head, sigma, 20 if n_samples < 10_000 else n_samples, rng)


def test_dot_product_variance_accepts_a_correct_answer_written_differently():
    checks.check_dot_product_variance(variance_mean_of_squares, **CPU)
    checks.check_dot_product_variance(variance_mean_of_squares, seed=3, **CPU)
    checks.check_dot_product_variance(variance_loop_ddof, **CPU)
    checks.check_dot_product_variance(variance_float32_einsum, seed=5, **CPU)


@pytest.mark.parametrize("wrong, hint", [(variance_formula_with_jitter, "formula"),
                                         (variance_of_fixed_pairs, "more_samples"),
                                         (variance_of_fewer_pairs, "fewer_samples")])
def test_dot_product_variance_must_measure_a_sample_whose_spread_is_its_standard_error(wrong, hint):
    """The results of a measurement on n pairs spread over rng seeds by its standard error (issue #51)."""
    with pytest.raises(CheckFailure, match=re.escape(checks.VARIANCE_HINTS[hint])) as failure:
        checks.check_dot_product_variance(wrong, **CPU)
    assert "with 100 rng seeds: the results spread by" in str(failure.value)


@pytest.mark.parametrize("wrong, phrase", [
    (variance_sigma_squared, r"expected d_head·σ⁴[\s\S]*close to d·σ², not d·σ⁴"),
    (variance_scale_is_variance, r"close to d·σ⁸[\s\S]*standard deviation σ, not the variance"),
    (variance_returns_std, "standard deviation sqrt"),
    (variance_scaled_scores, r"close to σ⁴ \(no factor d\)"),
    (variance_self_dot, r"2·d·σ⁴[\s\S]*independently of q"),
    (variance_formula, r"did not draw from the rng[\s\S]*returned the formula"),
    (variance_of_q_alone, re.escape(checks.VARIANCE_HINTS["entries"])),
    (variance_summed_over_samples, re.escape(checks.VARIANCE_HINTS["sample_axis"])),
    (variance_global_rng, r"did not draw from the rng it was given: it used np.random's global generator"),
    (variance_own_rng, r"did not draw from the rng it was given: it used a generator of your own"),
    (variance_mixed_rng, "as well as from rng"),
    (variance_returns_array, "should return one float"),
    (variance_via_torch, "NumPy only"),
])
def test_dot_product_variance_rejects_known_mistakes(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_dot_product_variance(wrong, **CPU)


def test_dot_product_variance_tolerance_follows_the_sample_count():
    # Five standard errors of the sample variance of q·k: sqrt((2d² + 6d)/n)·σ⁴, shrinking like 1/sqrt(n).
    assert checks._variance_tolerance(64, 2.0, 20_000) == pytest.approx(5 * math.sqrt((2 * 64**2 + 6 * 64) / 20_000) * 16)
    assert checks._variance_tolerance(64, 2.0, 80_000) == pytest.approx(checks._variance_tolerance(64, 2.0, 20_000) / 2)
    # An estimate 10% off at d=64 (about 5 standard errors of 20,000 samples) is rejected.
    biased = lambda d_head, sigma, n_samples, rng: 1.1 * variance_mean_of_squares(d_head, sigma, n_samples, rng)
    with pytest.raises(CheckFailure, match="within ±"):
        checks.check_dot_product_variance(biased, **CPU)


def test_dot_product_variance_check_leaves_the_global_numpy_stream_alone():
    np.random.seed(123)
    expected = np.random.random()
    np.random.seed(123)
    with pytest.raises(CheckFailure):
        checks.check_dot_product_variance(variance_global_rng, **CPU)
    assert np.random.random() == expected


# --------------------------------------------------------------------------------------
# The multiple-choice question
# --------------------------------------------------------------------------------------


def test_answer_scaling_accepts_the_supported_statement():
    supported = [letter for letter, holds in checks._statements(checks.peakedness_curves()).items() if holds]
    assert supported == ["C"]
    checks.check_answer_scaling("C", **CPU)
    checks.check_answer_scaling(" c ", seed=5, **CPU)


@pytest.mark.parametrize("letter", ["A", "B", "D"])
def test_answer_scaling_rejects_wrong_choices_without_revealing_the_answer(letter):
    with pytest.raises(CheckFailure, match="is not right. " + re.escape(checks.SCALING_HINTS[choice_digest("ANSWER_SCALING", letter)])) as failure:
        checks.check_answer_scaling(letter, **CPU)
    assert "C" not in str(failure.value).replace("ANSWER_SCALING", "")


@pytest.mark.parametrize("answer, phrase", [
    (None, "not implemented yet"),
    ("E", r'should be one of the strings "A", "B", "C", "D", got str .E.'),
    (2, r"should be one of[\s\S]*got int 2"),
])
def test_answer_scaling_rejects_blank_and_invalid_answers(answer, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_answer_scaling(answer, **CPU)


def test_peakedness_curves_show_saturation_without_scaling():
    curves = checks.peakedness_curves(seed=1)
    assert curves["unscaled"][-1] > 0.9 > curves["unscaled"][0]
    assert np.ptp(curves["scaled"]) < 0.08


# --------------------------------------------------------------------------------------
# The checks cannot be replaced
# --------------------------------------------------------------------------------------


def test_check_module_is_frozen():
    with pytest.raises(AttributeError, match="read-only"):
        checks.check_np_softmax = lambda *args, **kwargs: None


# --------------------------------------------------------------------------------------
# The widget
# --------------------------------------------------------------------------------------


def variance_by_sampling(d_head, sigma, n_samples, rng):
    q = rng.normal(0.0, sigma, size=(n_samples, d_head))
    k = rng.normal(0.0, sigma, size=(n_samples, d_head))
    return float(np.einsum("nd,nd->n", q, k).var())


def _histogram_and_bars(explorer):
    hist_ax, weight_ax = explorer.figure.axes[:2]
    return hist_ax, np.array([bar.get_height() for bar in weight_ax.patches])


def test_variance_explorer_shows_the_students_measurement_and_the_prediction():
    calls = []

    def recording(d_head, sigma, n_samples, rng):
        calls.append((d_head, sigma))
        return variance_by_sampling(d_head, sigma, n_samples, rng)

    explorer = variance_explorer(recording)
    assert set(explorer.controls) == {"d_head", "sigma", "scaling"}
    assert calls == [(64, 1.0)]
    title = explorer.figure._suptitle.get_text()
    assert "predicted σ⁴ = 1;" in title
    explorer.controls["sigma"].value = 2.0
    assert "predicted σ⁴ = 16;" in explorer.figure._suptitle.get_text()
    explorer.controls["scaling"].value = RAW
    assert "predicted d·σ⁴ = 1.02e+03" in explorer.figure._suptitle.get_text()
    assert calls[-1] == (64, 2.0)


def test_variance_explorer_scaling_keeps_the_spread_and_the_softmax_fixed_across_widths():
    explorer = variance_explorer(variance_by_sampling)
    peaks = {}
    for scaling in (SCALED, RAW):
        explorer.controls["scaling"].value = scaling
        for d_head in (4, 1024):
            explorer.controls["d_head"].value = d_head
            hist_ax, bars = _histogram_and_bars(explorer)
            assert len(bars) == 16 and abs(bars.sum() - 1.0) < 1e-9  # mean sorted weights of 16 keys
            assert np.all(np.diff(bars) <= 1e-12)  # sorted, largest first
            peaks[scaling, d_head] = bars[0]
    # Scaled: about equally peaked for every width; raw: one-hot at d_head = 1024.
    assert abs(peaks[SCALED, 4] - peaks[SCALED, 1024]) < 0.1
    assert peaks[RAW, 1024] > 0.95 > peaks[RAW, 4]
    # σ = 2 and scaled: variance 16, the softmax is far from uniform although the scale is "right".
    explorer.controls["scaling"].value = SCALED
    explorer.controls["sigma"].value = 2.0
    assert _histogram_and_bars(explorer)[1][0] > 0.6


def test_variance_explorer_sliders_update_on_release():
    explorer = variance_explorer(variance_by_sampling)
    assert explorer.controls["sigma"].continuous_update is False


# --------------------------------------------------------------------------------------
# Mistakes named on other axes and shapes
# --------------------------------------------------------------------------------------


def softmax_max_put_back_last(x, axis=-1):
    e = np.exp(x - np.max(x, axis=axis)[..., None])  # right for the last axis only
    return e / e.sum(axis=axis, keepdims=True)


def softmax_sum_over_last_axis(x, axis=-1):
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("wrong, hint", [
    (softmax_max_put_back_last, "no_keepdims"),
    (softmax_sum_over_last_axis, "sum_axis"),
])
def test_np_softmax_names_axis_mistakes_on_other_axes(wrong, hint):
    with pytest.raises(CheckFailure, match=re.escape(checks.SOFTMAX_HINTS[hint])):
        checks.check_np_softmax(wrong, **CPU)


def test_np_attention_names_elementwise_scores_by_their_shape():
    def elementwise(Q, K, V, mask=None):
        weights = _reference_softmax(Q * K / math.sqrt(Q.shape[-1]))  # Q * K, not Q @ Kᵀ
        return weights @ V.swapaxes(-1, -2) @ V, weights

    with pytest.raises(CheckFailure, match=r"-> weights should have shape \[2, 2, 6, 6\], got \[2, 2, 6, 2\][\s\S]*"
                       + re.escape(checks.ATTENTION_HINTS["no_transpose"])):
        checks.check_np_attention(elementwise, **CPU)


def test_no_function_of_the_check_module_or_the_widget_is_a_working_answer():
    """Nothing importable from the package answers an exercise of notebook 02."""
    import inspect

    from attention_lab.widgets import numpy_scores

    candidates = [obj for module in (checks, numpy_scores) for name, obj in vars(module).items()
                  if inspect.isfunction(obj) and obj.__module__ == module.__name__ and not name.startswith("check_")]
    all_checks = [checks.check_row_times_matrix, checks.check_np_split_heads, checks.check_np_merge_heads,
                  checks.check_np_softmax, checks.check_np_attention, checks.check_np_multi_head_attention,
                  checks.check_dot_product_variance, checks.check_softmax_backward,
                  checks.check_np_attention_backward]
    for candidate in candidates:
        for check in all_checks:
            with pytest.raises(Exception):
                check(candidate, **CPU)


# --------------------------------------------------------------------------------------
# softmax_backward
# --------------------------------------------------------------------------------------


def backward_expanded(p, dp, axis=-1):
    weighted = p * dp
    return weighted - p * np.sum(weighted, axis=axis, keepdims=True)


def backward_by_rows(p, dp, axis=-1):
    p_last, dp_last = np.moveaxis(p, axis, -1), np.moveaxis(dp, axis, -1)
    out = np.empty_like(p_last)
    for index in np.ndindex(p_last.shape[:-1]):  # one row at a time, never a matrix
        row, upstream = p_last[index], dp_last[index]
        out[index] = row * (upstream - row @ upstream)
    return np.moveaxis(out, -1, axis)


def _wrong_backward(formula):
    def softmax_backward(p, dp, axis=-1):
        return formula(p, dp, axis).astype(p.dtype)
    return softmax_backward


def _row_dot(p, dp, axis):
    return np.sum(p * dp, axis=axis, keepdims=True)


def backward_jacobian(p, dp, axis=-1):
    p_last, dp_last = np.moveaxis(p, axis, -1), np.moveaxis(dp, axis, -1)
    eye = np.eye(p_last.shape[-1], dtype=p.dtype)
    jacobian = p_last[..., :, None] * eye - p_last[..., :, None] * p_last[..., None, :]  # [..., n, n]
    return np.moveaxis(np.einsum("...ij,...i->...j", jacobian, dp_last), -1, axis)


def backward_jacobian_per_row(p, dp, axis=-1):
    p_last, dp_last = np.moveaxis(p, axis, -1), np.moveaxis(dp, axis, -1)
    out = np.empty_like(p_last)
    for index in np.ndindex(p_last.shape[:-1]):
        row = p_last[index]
        out[index] = (np.diag(row) - np.outer(row, row)) @ dp_last[index]
    return np.moveaxis(out, -1, axis)


def backward_in_place(p, dp, axis=-1):
    dp -= np.sum(p * dp, axis=axis, keepdims=True)
    return p * dp


def backward_float64(p, dp, axis=-1):
    return backward_expanded(p.astype(np.float64), dp.astype(np.float64), axis)


def backward_via_torch(p, dp, axis=-1):
    P, dP = torch.from_numpy(p), torch.from_numpy(dp)
    return (P * (dP - (P * dP).sum(axis, keepdim=True))).numpy()


WRONG_SOFTMAX_BACKWARD = {
    "no_rowsum": _wrong_backward(lambda p, dp, axis: p * dp),
    "diagonal_only": _wrong_backward(lambda p, dp, axis: p * (1 - p) * dp),
    "unweighted_sum": _wrong_backward(lambda p, dp, axis: p * (dp - np.sum(dp, axis=axis, keepdims=True))),
    "no_outer_p": _wrong_backward(lambda p, dp, axis: dp - _row_dot(p, dp, axis)),
    "sign": _wrong_backward(lambda p, dp, axis: p * (_row_dot(p, dp, axis) - dp)),
    "mean": _wrong_backward(lambda p, dp, axis: p * (dp - np.mean(p * dp, axis=axis, keepdims=True))),
    "sum_axis": _wrong_backward(lambda p, dp, axis: p * (dp - np.sum(p * dp))),
    "ignores_axis": _wrong_backward(lambda p, dp, axis: p * (dp - _row_dot(p, dp, -1))),
    "jacobian": backward_jacobian,
    "softmax_again": _wrong_backward(lambda p, dp, axis: backward_expanded(_reference_softmax(p, axis), dp, axis)),
}


def test_softmax_backward_accepts_correct_answers_written_differently():
    checks.check_softmax_backward(backward_expanded, **CPU)
    checks.check_softmax_backward(backward_by_rows, seed=2901, **CPU)


@pytest.mark.parametrize("name", sorted(WRONG_SOFTMAX_BACKWARD))
def test_softmax_backward_names_known_mistakes(name):
    with pytest.raises(CheckFailure, match=re.escape(checks.SOFTMAX_BACKWARD_HINTS[name])):
        checks.check_softmax_backward(WRONG_SOFTMAX_BACKWARD[name], **CPU)


@pytest.mark.parametrize("wrong, phrase", [
    (backward_jacobian, r"held \d+\.\d MB at once[\s\S]*\[n, n\] Jacobian \(n = 512"),
    (backward_jacobian_per_row, r"held \d+\.\d MB at once[\s\S]*diag\(p\) − p pᵀ"),
    (backward_in_place, "changed its input dp in place"),
    (backward_float64, "should keep the input dtype float32, got float64\\.\\n  Likely mistake: " + re.escape(checks.DTYPE_HINTS["softmax"])),
    (backward_via_torch, "NumPy only"),
    (lambda p, grad, axis=-1: backward_expanded(p, grad, axis), r"should take the parameters \(p, dp, axis\)"),
])
def test_softmax_backward_rejects_other_mistakes(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_softmax_backward(wrong, **CPU)


def test_softmax_backward_memory_measure_sees_what_an_answer_holds():
    with checks.PeakAllocation() as small_measure:
        small = np.ones((4, 512)) * 2.0
    with checks.PeakAllocation() as big_measure:
        big = np.ones((4, 512, 512)).sum()
    assert small.shape == (4, 512) and 4 * 512 * 8 <= small_measure.peak < 512 * 512 * 8 // 4
    assert float(big) == 4 * 512 * 512 and big_measure.peak >= 4 * 512 * 512 * 8


# --------------------------------------------------------------------------------------
# np_attention_backward
# --------------------------------------------------------------------------------------


def _attention_backward(Q, K, V, out, lse, dout, mask=None, *, rowsum="weighted", grad_scale=None, scale_dv=False,
                        transpose=None, use_mask=True, fully_masked="zero", forward_scale=True, leak=False,
                        fill=-np.inf):
    """A NumPy backward with one deliberate change (the correct one with the defaults). It ignores the
    saved out and lse and recomputes P with a softmax: correct, if not the recipe the notebook asks for."""
    d = Q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    scores = Q @ np.swapaxes(K, -1, -2) * (scale if forward_scale else 1.0)
    any_key = None
    if mask is not None and use_mask:
        any_key = np.any(mask, axis=-1, keepdims=True)
        scores = np.where(mask, scores, fill)
        if fully_masked != "nan":
            scores = np.where(any_key, scores, 0.0)
    with np.errstate(all="ignore"):
        P = _reference_softmax(scores)
    if any_key is not None and fully_masked == "zero":
        P = np.where(any_key, P, 0.0)
    dV = (P @ dout) if transpose == "dv" else np.swapaxes(P, -1, -2) @ dout
    dP = dout @ np.swapaxes(V, -1, -2)
    if transpose == "dp":
        dP = np.swapaxes(dP, -1, -2)
    total = {"weighted": np.sum(dP * P, axis=-1, keepdims=True), "none": 0.0,
             "unweighted": np.sum(dP, axis=-1, keepdims=True), "axis": np.sum(dP * P, axis=-2, keepdims=True)}[rowsum]
    dS = (dP - total) if leak else P * (dP - total)
    factor = scale if grad_scale is None else grad_scale(d)
    dQ = (np.swapaxes(dS, -1, -2) if transpose == "dq" else dS) @ K * factor
    dK = (dS if transpose == "dk" else np.swapaxes(dS, -1, -2)) @ Q * factor
    if transpose == "dk_shape":
        dK = np.swapaxes(dK, -1, -2)
    if scale_dv:
        dV = dV * scale
    return dQ.astype(Q.dtype), dK.astype(Q.dtype), dV.astype(Q.dtype)


def attention_backward_einsum(Q, K, V, out, lse, dout, mask=None):
    """Recomputes out too, and takes D from it: correct, ignoring what the forward saved."""
    scale = 1 / math.sqrt(Q.shape[-1])
    scores = np.einsum("bhqd,bhkd->bhqk", Q, K) * scale
    if mask is not None:
        scores = np.where(mask, scores, -1e9)
    P = softmax_logsumexp(scores)
    if mask is not None:
        P = P * np.any(mask, axis=-1, keepdims=True)
    out_again = np.einsum("bhqk,bhkv->bhqv", P, V)
    dP = np.einsum("bhqv,bhkv->bhqk", dout, V)
    dS = P * (dP - np.sum(dout * out_again, axis=-1, keepdims=True)) * scale  # FlashAttention's rowsum(dO ∘ O)
    return (np.einsum("bhqk,bhkd->bhqd", dS, K), np.einsum("bhqk,bhqd->bhkd", dS, Q),
            np.einsum("bhqk,bhqv->bhkv", P, dout))


WRONG_ATTENTION_BACKWARD = {
    "no_rowsum": dict(rowsum="none"),
    "rowsum_unweighted": dict(rowsum="unweighted"),
    "rowsum_axis": dict(rowsum="axis"),
    "no_scale": dict(grad_scale=lambda d: 1.0),
    "scale_by_d": dict(grad_scale=lambda d: 1.0 / d),
    "scale_dv": dict(scale_dv=True),
    "forward_no_scale": dict(forward_scale=False),
    "dv_transposed": dict(transpose="dv"),
    "dp_transposed": dict(transpose="dp"),
    "dq_transposed": dict(transpose="dq"),
    "dk_transposed": dict(transpose="dk"),
    "mask_ignored": dict(use_mask=False),
    "no_outer_p": dict(leak=True),
    "masked_leak": dict(fill=-5.0),  # a fill not far enough below the scores: masked weights are not 0
    "fully_masked_nan": dict(fully_masked="nan"),
    "fully_masked_sends": dict(fully_masked="uniform", fill=-1e9),
    "matmul_shapes": dict(transpose="dk_shape"),
}


def test_a_backward_that_recomputes_the_softmax_is_named_not_passed():
    """Right numbers, the wrong method: the exercise is the backward from the saved out and lse (issue #52: these
    got full marks, and a ✓ that said "from (out, lse)")."""
    for answer, hint in ((_attention_backward, "delta_recomputed"), (attention_backward_einsum, "delta_recomputed"),
                         (functools.partial(_backward_from_lse, p_from="softmax"), "lse_recomputed"),
                         (functools.partial(_backward_from_lse, delta="p_dp"), "delta_recomputed")):
        with pytest.raises(CheckFailure, match=re.escape(checks.BACKWARD_LSE_HINTS[hint])) as failure:
            checks.check_np_attention_backward(answer, **CPU)
        assert "and given " in str(failure.value) and "the formula with the" in str(failure.value)


def backward_from_lse_loops(Q, K, V, out, lse, dout, mask=None):
    """Right, written differently: a loop over (batch, head) with helpers, keyword calls, P from lse with
    np.where so that no row without a key meets -inf - (-inf), D with einsum."""
    def probabilities(scores, row_lse):
        has_key = np.isfinite(row_lse)[:, None]
        return np.where(has_key, np.exp(scores - np.where(has_key, row_lse[:, None], 0.0)), 0.0)

    def gradients(q, k, v, o, row_lse, do, allowed):
        scores = np.where(allowed, q @ k.T / np.sqrt(np.float64(q.shape[-1])).astype(q.dtype), -np.inf)
        p = probabilities(scores=scores, row_lse=row_lse)
        delta = np.einsum("qv,qv->q", do, np.where(np.isfinite(row_lse)[:, None], o, 0.0))
        ds = p * (do @ v.T - delta[:, None]) / math.sqrt(q.shape[-1])
        return ds @ k, ds.T @ q, p.T @ do

    shape = Q.shape[:2] + (Q.shape[2], K.shape[2])
    allowed = np.broadcast_to(True if mask is None else mask, shape)
    grads = [np.zeros_like(Q), np.zeros_like(K), np.zeros_like(V)]
    for b in range(Q.shape[0]):
        for h in range(Q.shape[1]):
            parts = gradients(Q[b, h], K[b, h], V[b, h], out[b, h], lse[b, h], dout[b, h], allowed[b, h])
            for grad, part in zip(grads, parts):
                grad[b, h] = part
    return tuple(grads)


def test_np_attention_backward_accepts_correct_answers_written_differently():
    checks.check_np_attention_backward(backward_from_lse_loops, **CPU)
    checks.check_np_attention_backward(backward_from_lse_loops, seed=3001, **CPU)


@pytest.mark.parametrize("name", sorted(WRONG_ATTENTION_BACKWARD))
def test_np_attention_backward_names_known_mistakes(name):
    options = WRONG_ATTENTION_BACKWARD[name]

    def np_attention_backward(Q, K, V, out, lse, dout, mask=None):
        return _attention_backward(Q, K, V, out, lse, dout, mask, **options)

    with pytest.raises(CheckFailure, match=re.escape(checks.ATTENTION_BACKWARD_HINTS[name])):
        checks.check_np_attention_backward(np_attention_backward, **CPU)


def test_np_attention_backward_names_a_transposed_product_that_does_not_fit():
    def wrong(Q, K, V, out, lse, dout, mask=None):
        dQ, dK, dV = _attention_backward(Q, K, V, out, lse, dout, mask)
        P = _reference_softmax(Q @ np.swapaxes(K, -1, -2) / math.sqrt(Q.shape[-1]))
        return dQ, dK, P.T @ dout  # .T reverses all four axes

    with pytest.raises(CheckFailure, match=r"raised ValueError[\s\S]*"
                       + re.escape(checks.ATTENTION_BACKWARD_HINTS["matmul_shapes"])):
        checks.check_np_attention_backward(wrong, **CPU)


@pytest.mark.parametrize("wrong, phrase", [
    (lambda Q, K, V, out, lse, dout, mask=None: _attention_backward(Q, K, V, out, lse, dout, mask)[:2],
     r"should return a tuple \(dQ, dK, dV\)"),
    (lambda Q, K, V, out, lse, dout, mask=None: tuple(g.astype(np.float64)
                                                      for g in _attention_backward(Q, K, V, out, lse, dout, mask)),
     "got float64\\.\\n  Likely mistake: " + re.escape(checks.DTYPE_HINTS["scaled"])),
    (lambda Q, K, V, out, lse, dout, mask=None: tuple(torch.from_numpy(g).numpy()
                                                      for g in (torch.from_numpy(Q).numpy(),) * 3), "NumPy only"),
    (lambda Q, K, V, dout, mask=None: None, r"should take the parameters \(Q, K, V, out, lse, dout, mask\)"),
])
def test_np_attention_backward_rejects_wrong_returns(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_np_attention_backward(wrong, **CPU)


def test_np_attention_backward_leaves_its_inputs_alone():
    def scales_in_place(Q, K, V, out, lse, dout, mask=None):
        Q *= 1.0  # harmless, but then:
        dout -= dout.mean()
        return _attention_backward(Q, K, V, out, lse, dout, mask)

    with pytest.raises(CheckFailure, match="changed its input dout in place"):
        checks.check_np_attention_backward(scales_in_place, **CPU)


def _backward_from_lse(Q, K, V, out, lse, dout, mask=None, *, p_from="lse", delta="out", guard_delta=True,
                       sign=1.0, in_float32=False):
    """The notebook's recipe (P = exp(s - lse), D = rowsum(dout ∘ out)) with one deliberate change
    (``in_float32``: everything computed in float32, s - lse included)."""
    dtype = Q.dtype
    if in_float32:
        Q, K, V, out, lse, dout = (a.astype(np.float32) for a in (Q, K, V, out, lse, dout))
    scale = 1.0 / math.sqrt(Q.shape[-1])
    raw = np.einsum("bhqd,bhkd->bhqk", Q, K)
    scores = raw if p_from == "unscaled" else raw * scale
    if mask is not None and p_from != "unmasked":
        scores = np.where(mask, scores, -np.inf)
    finite = np.isfinite(lse)[..., None]
    with np.errstate(all="ignore"):
        if p_from == "softmax":  # the weights again, with a softmax: lse never read
            shifted = scores - np.where(finite, np.max(scores, axis=-1, keepdims=True), 0.0)
            P = np.exp(shifted) / np.where(finite, np.sum(np.exp(shifted), axis=-1, keepdims=True), 1.0)
        else:
            P = np.exp(scores) if p_from == "no_lse" else np.exp(scores - np.where(finite, lse[..., None], 0.0))
        P = np.where(finite, P, 0.0)
        product = np.where(finite, dout * out, 0.0) if guard_delta else dout * out
        dP = np.einsum("bhqv,bhkv->bhqk", dout, V)
        D = {"out": lambda: np.sum(product, axis=-1, keepdims=True), "dout": lambda: np.sum(dout, axis=-1, keepdims=True),
             "p_dp": lambda: np.sum(P * dP, axis=-1, keepdims=True),  # softmax_backward's own sum: out never read
             "axis": lambda: np.sum(product, axis=-2, keepdims=True)}[delta]()
        dS = sign * P * (dP - D) * scale
    grads = np.einsum("bhqk,bhkd->bhqd", dS, K), np.einsum("bhqk,bhqd->bhkd", dS, Q), \
        np.einsum("bhqk,bhqv->bhkv", P, dout)
    return tuple(g.astype(dtype) for g in grads)


def test_np_attention_backward_accepts_the_recipe_from_lse():
    checks.check_np_attention_backward(_backward_from_lse, **CPU)
    checks.check_np_attention_backward(_backward_from_lse, seed=3001, **CPU)


@pytest.mark.parametrize("options, hint", [
    (dict(p_from="no_lse"), "lse_ignored"),
    (dict(p_from="unscaled"), "lse_unscaled_scores"),
    (dict(p_from="unmasked"), "lse_mask_ignored"),
    (dict(delta="dout"), "delta_unweighted"),
    (dict(guard_delta=False), "fully_masked_delta"),
    # named since issue #52 (numbers only, or another mistake's name, before)
    (dict(sign=-1.0), "ds_sign"),
    (dict(delta="axis"), "delta_axis"),  # (..., 1, d_v) against dP's (..., S_q, S_k): NumPy's broadcast error
    (dict(in_float32=True), "float32_inside"),  # s - lse in float32 too: off at large scores
])
def test_np_attention_backward_names_the_mistakes_of_the_recipe_from_lse(options, hint):
    def np_attention_backward(Q, K, V, out, lse, dout, mask=None):
        return _backward_from_lse(Q, K, V, out, lse, dout, mask, **options)

    with pytest.raises(CheckFailure, match=re.escape(checks.BACKWARD_LSE_HINTS[hint])):
        checks.check_np_attention_backward(np_attention_backward, **CPU)


def test_np_attention_backward_names_a_sum_over_the_queries_where_its_shape_fits():
    """D summed over the queries with keepdims=True, where S_k = d_v: no broadcast error, wrong numbers, named."""
    def np_attention_backward(Q, K, V, out, lse, dout, mask=None):
        if V.shape[-1] != K.shape[-2]:
            return _backward_from_lse(Q, K, V, out, lse, dout, mask)
        return _backward_from_lse(Q, K, V, out, lse, dout, mask, delta="axis")

    with pytest.raises(CheckFailure, match=re.escape(checks.BACKWARD_LSE_HINTS["delta_axis"])) as failure:
        checks.check_np_attention_backward(np_attention_backward, **CPU)
    assert "could not be broadcast" not in str(failure.value)


def test_np_attention_backward_names_float16_inside_on_float32_input():
    def np_attention_backward(Q, K, V, out, lse, dout, mask=None):
        if Q.dtype != np.float32:
            return _backward_from_lse(Q, K, V, out, lse, dout, mask)
        grads = _backward_from_lse(*(a.astype(np.float16) for a in (Q, K, V, out, lse, dout)), mask)
        return tuple(g.astype(np.float32) for g in grads)

    with pytest.raises(CheckFailure, match=re.escape(checks.BACKWARD_LSE_HINTS["float16_inside"])):
        checks.check_np_attention_backward(np_attention_backward, **CPU)


def test_np_attention_backward_keeps_q_dtype_when_the_saved_arrays_come_in_another():
    def keeps_the_saved_dtype(Q, K, V, out, lse, dout, mask=None):
        grads = _backward_from_lse(Q.astype(np.result_type(Q, out)), K, V, out, lse, dout, mask)
        return tuple(g.astype(np.result_type(g, out)) for g in grads)

    with pytest.raises(CheckFailure, match=r"out and lse in float64.*\n?.*got float64"):
        checks.check_np_attention_backward(keeps_the_saved_dtype, **CPU)


# np_attention_lse


def attention_lse_by_logaddexp(Q, K, V, mask=None):
    """A correct answer written differently: np.logaddexp.reduce for lse, the weights from it."""
    scores = np.einsum("bhqd,bhkd->bhqk", Q, K) / math.sqrt(Q.shape[-1])
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    lse = np.logaddexp.reduce(scores, axis=-1)  # -inf for a row of -inf, without a warning
    has_key = np.isfinite(lse)[..., None]
    weights = np.where(has_key, np.exp(scores - np.where(has_key, lse[..., None], 0.0)), 0.0)
    return (weights @ V).astype(Q.dtype), lse.astype(Q.dtype)


def _lse_answer(*, lse_scaled=True, masked_lse=True, lse_form="right", guard=True, keep_axis=False):
    """np_attention_lse with one deliberate change (correct with the defaults)."""
    def np_attention_lse(Q, K, V, mask=None):
        raw = Q @ np.swapaxes(K, -1, -2)
        scores = raw / math.sqrt(Q.shape[-1])
        masked = scores if mask is None else np.where(mask, scores, -np.inf)
        m = np.max(masked, axis=-1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):  # (only the unguarded variant meets 0/0)
            shift = np.where(np.isfinite(m), m, 0.0) if guard else m
            exps = np.exp(masked - shift)
            total = np.sum(exps, axis=-1, keepdims=True)
            out = (exps / (np.where(total > 0, total, 1.0) if guard else total)) @ V
        lse_source = (masked if masked_lse else scores) * (1.0 if lse_scaled else math.sqrt(Q.shape[-1]))
        lse_m = np.max(lse_source, axis=-1, keepdims=True)
        lse_shift = np.where(np.isfinite(lse_m), lse_m, 0.0)
        lse_total = np.sum(np.exp(lse_source - lse_shift), axis=-1, keepdims=True)
        log_total = np.log(np.where(lse_total > 0, lse_total, 1.0))  # no log(0)
        lse = {"right": lse_shift + log_total, "max": lse_m, "no_shift": log_total,
               "base2": (lse_shift + log_total) / math.log(2)}[lse_form]
        if guard:
            lse = np.where(lse_total > 0, lse, -np.inf)
        lse = lse if keep_axis else lse[..., 0]
        return out.astype(Q.dtype), lse.astype(Q.dtype)
    return np_attention_lse


def test_np_attention_lse_accepts_correct_answers():
    checks.check_np_attention_lse(_lse_answer(), **CPU)
    checks.check_np_attention_lse(attention_lse_by_logaddexp, **CPU)
    checks.check_np_attention_lse(attention_lse_by_logaddexp, seed=3101, **CPU)


@pytest.mark.parametrize("options, hint", [
    (dict(lse_scaled=False), checks.ATTENTION_LSE_HINTS["lse_unscaled"]),
    (dict(masked_lse=False), checks.ATTENTION_LSE_HINTS["lse_unmasked"]),
    (dict(lse_form="max"), checks.ATTENTION_LSE_HINTS["lse_max_only"]),
    (dict(lse_form="no_shift"), checks.ATTENTION_LSE_HINTS["lse_shift_lost"]),
    (dict(lse_form="base2"), checks.ATTENTION_LSE_HINTS["lse_base2"]),
    (dict(guard=False), checks.ATTENTION_LSE_HINTS["fully_masked_out"]),
    (dict(keep_axis=True), checks.ERROR_HINTS["kept_axis"]),
])
def test_np_attention_lse_names_the_mistake(options, hint):
    with pytest.raises(CheckFailure, match=re.escape(hint)):
        checks.check_np_attention_lse(_lse_answer(**options), **CPU)


def test_np_attention_lse_must_not_warn_on_a_query_with_no_key():
    def warns(Q, K, V, mask=None):
        out, lse = attention_lse_by_logaddexp(Q, K, V, mask)
        np.log(np.zeros(1))  # log(0): right value, but a RuntimeWarning the student would see
        return out, lse

    with pytest.raises(CheckFailure, match=re.escape(checks.ATTENTION_LSE_HINTS["warning"])) as failure:
        checks.check_np_attention_lse(warns, **CPU)
    assert "NumPy met divide by zero (your line: `np.log(np.zeros(1))" in str(failure.value)


def test_np_attention_lse_on_numpy_1_still_names_an_error_it_hears(monkeypatch):
    """NumPy 1 (the course allows >= 1.24) has no single function behind its error modes to own: the probe falls
    back to recording the errors an answer leaves audible, and right answers pass."""
    import types

    from numpy import _core

    monkeypatch.setattr(_core, "_ufunc_config", types.SimpleNamespace())  # no _make_extobj, as in NumPy 1
    checks.check_np_attention_lse(attention_lse_by_logaddexp, **CPU)

    def warns(Q, K, V, mask=None):
        np.log(np.zeros(1))
        return attention_lse_by_logaddexp(Q, K, V, mask)

    with pytest.raises(CheckFailure, match=re.escape(checks.ATTENTION_LSE_HINTS["warning"])):
        checks.check_np_attention_lse(warns, **CPU)


def lse_silenced(silence):
    """The recipe with no guard against a query that sees no key, its warnings silenced (``silence``: how), NaN
    and -inf repaired afterwards: right numbers, but the invalid operations the exercise is about still run."""
    def np_attention_lse(Q, K, V, mask=None):
        scores = Q @ np.swapaxes(K, -1, -2) / math.sqrt(Q.shape[-1])
        if mask is not None:
            scores = np.where(mask, scores, -np.inf)
        with silence():
            row_max = np.max(scores, axis=-1, keepdims=True)
            exps = np.exp(scores - row_max)  # -inf - (-inf) = NaN on a row without keys
            total = np.sum(exps, axis=-1, keepdims=True)
            out = np.nan_to_num(exps / total) @ V
            lse = np.where(np.isfinite(row_max), row_max + np.log(total), -np.inf)[..., 0]
        return out.astype(Q.dtype), lse.astype(Q.dtype)
    return np_attention_lse


def _seterr_ignored():
    @contextlib.contextmanager
    def silence():
        saved = np.seterr(all="ignore")
        try:
            yield
        finally:
            np.seterr(**saved)
    return silence


def _warnings_ignored():
    @contextlib.contextmanager
    def silence():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    return silence


@pytest.mark.parametrize("silence, hint", [
    (lambda: np.errstate(all="ignore"), "silenced"),
    (lambda: np.errstate(invalid="ignore", divide="ignore"), "silenced"),
    (_seterr_ignored(), "silenced"),
    (_warnings_ignored(), "warning"),  # NumPy's own mode untouched: the invalid operation is what it names
], ids=["errstate", "errstate_parts", "seterr", "warnings_filter"])
def test_np_attention_lse_that_silences_numpys_warnings_is_named(silence, hint):
    """Silencing the warning leaves the invalid operation in (issue #52: np.errstate passed)."""
    with pytest.raises(CheckFailure, match=re.escape(checks.ATTENTION_LSE_HINTS[hint])) as failure:
        checks.check_np_attention_lse(lse_silenced(silence), **CPU)
    assert "NumPy met invalid value (your line: `exps = np.exp(scores - row_max)" in str(failure.value)
    assert np.geterr()["invalid"] == "warn"  # the answer's np.seterr did not outlive the call


def test_np_attention_lse_gives_the_mean_of_the_values_a_name():
    """A -1e9 fill gives a query with no key the mean of the values: named, not only 'off'."""
    def filled(Q, K, V, mask=None):
        scores = np.einsum("bhqd,bhkd->bhqk", Q, K) / math.sqrt(Q.shape[-1])
        if mask is not None:
            scores = np.where(mask, scores, -1e9)
        lse = np.logaddexp.reduce(scores, axis=-1)
        return (np.exp(scores - lse[..., None]) @ V).astype(Q.dtype), lse.astype(Q.dtype)

    with pytest.raises(CheckFailure, match=re.escape(checks.ATTENTION_LSE_HINTS["fully_masked_out"])):
        checks.check_np_attention_lse(filled, **CPU)


def test_the_notebooks_gradient_claims_hold():
    """Section 10: with 1/d_head the gradient reaching q falls like 1/sqrt(d_head) although the
    softmax's own Jacobian stays large; with 1/sqrt(d_head) it stays level; raw scores starve it."""
    def norms(d, scale, seed=0, num_keys=16, num_queries=200):
        rng = np.random.default_rng(seed)
        q = torch.from_numpy(rng.standard_normal((num_queries, 1, d))).requires_grad_(True)
        k = torch.from_numpy(rng.standard_normal((num_queries, num_keys, d)))
        jacobians = [torch.autograd.functional.jacobian(lambda row: torch.softmax(scale * (k[i] @ row), -1), q[i, 0])
                     for i in range(num_queries)]
        return float(np.median([float(j.norm()) for j in jacobians]))

    by_d = [norms(d, 1 / d) for d in (4, 64, 1024)]
    by_sqrt = [norms(d, 1 / math.sqrt(d)) for d in (4, 64, 1024)]
    raw = [norms(d, 1.0) for d in (4, 1024)]
    assert by_d[0] / by_d[1] == pytest.approx(4, rel=0.2) and by_d[1] / by_d[2] == pytest.approx(4, rel=0.2)
    assert max(by_sqrt) / min(by_sqrt) < 1.2
    assert raw[1] < 0.01 * raw[0]


# --------------------------------------------------------------------------------------
# The notebook around the checks
# --------------------------------------------------------------------------------------


def _notebook_02_cells():
    return solution_cells("02_numpy_walkthrough")


def test_no_demo_cell_runs_between_an_answer_and_its_check():
    """A student reads the check's message before any demo can crash on the mistake."""
    pending = None  # the answer whose check has not run yet
    for cell in _notebook_02_cells():
        if cell.cell_type != "code":
            continue
        if "answer" in cell.metadata:
            pending = cell.metadata["answer"]
        elif "test" in cell.metadata:
            pending = None
        elif pending is not None:
            raise AssertionError(f"a demo cell runs after the answer {pending} but before its check:\n{cell.source[:200]}")


def test_no_code_line_is_longer_than_100_characters():
    long = [line for cell in _notebook_02_cells() if cell.cell_type == "code"
            for line in cell.source.splitlines() if len(line) > 100]
    assert not long, long


def test_np_attention_backward_says_what_to_write_for_dv():
    # "dV is P @ dout, a transposed product" read as if P @ dout were the rule (issue #34): say Pᵀ @ dout.
    def np_attention_backward(Q, K, V, out, lse, dout, mask=None):
        return _attention_backward(Q, K, V, out, lse, dout, mask, transpose="dv")

    with pytest.raises(CheckFailure, match=r"computed as P @ dout; write dV = Pᵀ @ dout"):
        checks.check_np_attention_backward(np_attention_backward, **CPU)


def test_a_softmax_backward_that_breaks_only_the_memory_rule_is_not_blamed_for_wrong_numbers():
    # The Jacobian gives the right numbers: it cannot explain np_attention_backward's wrong dV, so no
    # "Fix softmax_backward first" (issue #34). A softmax_backward with wrong numbers is still named.
    namespace = {"softmax_backward": backward_jacobian, "np": np}
    exec("def np_attention_backward(Q, K, V, out, lse, dout, mask=None):\n"
         "    softmax_backward(Q[..., :1, :1] * 0 + 1.0, Q[..., :1, :1])\n"
         "    return wrong(Q, K, V, out, lse, dout, mask)\n", namespace)
    namespace["wrong"] = lambda *args: _attention_backward(*args, transpose="dv")
    with pytest.raises(CheckFailure) as failure:
        checks.check_np_attention_backward(namespace["np_attention_backward"], **CPU)
    assert "Fix softmax_backward first" not in str(failure.value), str(failure.value)
    namespace["softmax_backward"] = WRONG_SOFTMAX_BACKWARD["no_rowsum"]
    with pytest.raises(CheckFailure, match="Fix softmax_backward first"):
        checks.check_np_attention_backward(namespace["np_attention_backward"], **CPU)
