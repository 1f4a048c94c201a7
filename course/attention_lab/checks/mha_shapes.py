"""Checks for notebook 01 -- multi-head attention, shape by shape.

References come from PyTorch itself (``F.scaled_dot_product_attention`` on the math
backend, ``nn.MultiheadAttention``) or from definitions written differently from the
idiomatic answer (slicing instead of view/permute), computed in float64 at check time.
"""

from __future__ import annotations

import copy
import math
from fractions import Fraction
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from attention_lab.bridge.probes import Probe
from attention_lab.checking import (
    CheckFailure,
    ThreadProfiler,
    Variant,
    call_student,
    check,
    crash_message,
    describe,
    expect_choice,
    expect_close,
    expect_signature,
    expect_tensor,
    expect_true,
    expect_value_error,
    is_integer,
    is_number,
    freeze_module,
    randint,
    randn,
    random_generator,
    reference_sdpa,
    shape_str,
)

ATTENTION_BUILTINS = ("scaled_dot_product_attention", "multi_head_attention_forward")

# --------------------------------------------------------------------------------------
# References (definitions, not the idiomatic answers)
#
# No reference here has an exercise's contract, so none can be imported as an answer: head
# splits and merges are written inline with torch's own tensor_split / unbind, the weights come
# from SDPA (which the from-scratch guard forbids to a student) under a different signature.
# --------------------------------------------------------------------------------------


def _reference_weights(query: torch.Tensor, key: torch.Tensor, *, attn_mask: torch.Tensor | None,
                       scale: float | None = None) -> torch.Tensor:
    """Attention weights from PyTorch: SDPA with V = identity returns the weight matrix itself."""
    s_k = key.shape[-2]
    identity = torch.eye(s_k, dtype=query.dtype, device=query.device).expand(*key.shape[:-2], s_k, s_k)
    return reference_sdpa(query, key, identity, attn_mask=attn_mask, scale=scale)


def _with_minus_inf_fill(scores: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Scores with -inf where ``keep`` is False, as a student writes it (a row with nothing to keep
    becomes NaN after the softmax). Used for wrong variants, e.g. a flipped causal mask, whose last
    row blocks every key: the student's output then has NaN exactly there, and so does the variant.
    """
    return scores if keep is None else scores.masked_fill(~keep, float("-inf"))


def _mask_description(mask: torch.Tensor | None) -> str:
    return "no mask" if mask is None else f"a boolean mask of shape {shape_str(mask.shape)}"


# --------------------------------------------------------------------------------------
# Exercise: split_heads
# --------------------------------------------------------------------------------------

SPLIT_HEADS_HINTS = {
    "view_no_permute": "you reshaped to [B, S, H, d_head] but did not move the head axis in front "
    "of the sequence axis: add .permute(0, 2, 1, 3) (or .transpose(1, 2)).",
    "reshape_only": "you reshaped straight to [B, H, S, d_head]. The shape is right but the numbers "
    "are scrambled: reshape reads memory in order, so 'heads' would cut across tokens. First "
    "view as [B, S, H, d_head] (split the feature axis), then permute.",
    "strided": "your heads take every H-th feature (view as [B, S, d_head, H]); head h must take "
    "the contiguous block of features h*d_head ... (h+1)*d_head - 1.",
}


def _split_heads_variants(x: torch.Tensor, num_heads: int) -> list[Variant]:
    b, s, d_model = x.shape
    d_head = d_model // num_heads
    return [
        Variant(lambda: x.reshape(b, num_heads, s, d_head), SPLIT_HEADS_HINTS["reshape_only"]),
        Variant(lambda: x.reshape(b, s, d_head, num_heads).permute(0, 3, 1, 2), SPLIT_HEADS_HINTS["strided"]),
    ]


def _check_split_heads_once(split_heads: Callable, x: torch.Tensor, num_heads: int, name: str) -> torch.Tensor:
    b, s, d_model = x.shape
    d_head = d_model // num_heads
    call = f"{name}(x, num_heads={num_heads}) with x a {describe(x)}"
    out = call_student(split_heads, x, num_heads, call=call)
    expect_tensor(out, what=call, shape=(b, num_heads, s, d_head), dtype=x.dtype, device=x.device,
                  hints={(b, s, num_heads, d_head): SPLIT_HEADS_HINTS["view_no_permute"]})
    # Head h = features h*d_head ... (h+1)*d_head - 1: H consecutive chunks, stacked on a new axis 1.
    expect_close(out, torch.stack(x.tensor_split(num_heads, dim=-1), dim=1), what=call,
                 against="head h = features h*d_head ... (h+1)*d_head - 1 of every token",
                 variants=_split_heads_variants(x, num_heads))
    return out


def _check_split_heads(split_heads: Callable, *, seed: int, device: torch.device, name: str) -> None:
    expect_signature(split_heads, name, ["x", "num_heads"])
    generator = random_generator(seed)
    # Contract and numbers: float64 ground truth, then the course's device in float32.
    for dtype in (torch.float64, torch.float32):
        x = randn(2, 5, 12, generator=generator, dtype=dtype, device=device)
        _check_split_heads_once(split_heads, x, 3, name)
    # Edge cases: one head, one token, a non-contiguous input (a transposed [S, B, D] tensor).
    _check_split_heads_once(split_heads, randn(1, 1, 6, generator=generator, device=device), 1, name)
    _check_split_heads_once(split_heads, randn(3, 1, 8, generator=generator, device=device), 4, name)
    x_transposed = randn(7, 2, 16, generator=generator, device=device).transpose(0, 1)
    _check_split_heads_once(split_heads, x_transposed, 4, name)
    # Properties on random sizes.
    for _ in range(8):
        b, s, h, d = (randint(1, 3, generator), randint(1, 9, generator),
                      randint(1, 6, generator), randint(1, 5, generator))
        _check_split_heads_once(split_heads, randn(b, s, h * d, generator=generator, device=device), h, name)
    expect_value_error(split_heads, randn(2, 3, 10, generator=generator, device=device), 4,
                       call=f"{name}(x, num_heads=4) with D = 10", why="D = 10 is not divisible by H = 4",
                       must_mention=(10, 4))


@check("split_heads: shapes, values, edge cases and the D % H error ({device})")
def check_split_heads(split_heads: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """split_heads: [B, S, D] -> [B, H, S, D//H], head h = features h*d ... (h+1)*d - 1."""
    _check_split_heads(split_heads, seed=seed, device=device, name="split_heads")


EINOPS_HINTS = {
    "no_rearrange": "split_heads_einops should be written with einops (e.g. rearrange(x, "
    "'b s (h d) -> b h s d', h=num_heads), or the layer einops.layers.torch.Rearrange), but it never called einops.",
    "rearrange_not_splitting": "einops must do the split itself: call rearrange (or a Rearrange layer) on the "
    "[B, S, D] input with a pattern that splits the feature axis, \"b s (h d) -> ...\". Here the heads are split by "
    "something else (split_heads, view, reshape...) and einops only moves axes around.",
}


class EinopsCalls(Probe):
    """(entry point, input shape, output shape) of every call into einops made during one call of
    the student's code.

    Any entry point counts, however it was imported: the functions (rearrange, reduce, repeat,
    einsum, pack, unpack), the layers (einops.layers.torch.Rearrange, Reduce, EinMix). A call is
    seen by what runs: a Python frame in einops' own files entered from a frame outside them.
    A module of einops that the answer imports first (``from einops.layers.torch import
    Rearrange`` inside the function) runs its own code once: that is an import, not a call.
    """

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []
        self._open: dict[int, tuple] = {}
        self._profiler = ThreadProfiler(self._profile)

    def __enter__(self) -> "EinopsCalls":
        import os

        import einops

        self._root = os.path.dirname(os.path.abspath(einops.__file__)) + os.sep
        self._profiler.start()
        return self

    def __exit__(self, *exc) -> None:
        self._profiler.stop()

    def _in_einops(self, frame) -> bool:
        import os

        return frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(self._root)

    def _profile(self, frame, event, arg) -> None:
        if event in ("call", "return") and frame.f_code.co_name != "<module>" and self._in_einops(frame) \
                and not self._in_einops(frame.f_back):
            if event == "call":
                tensor = next((v for v in frame.f_locals.values() if isinstance(v, torch.Tensor)), None)
                self._open[id(frame)] = (frame.f_code.co_name, tuple(tensor.shape) if tensor is not None else ())
            elif id(frame) in self._open:
                name, before = self._open.pop(id(frame))
                self.calls.append((name, before, tuple(arg.shape) if isinstance(arg, torch.Tensor) else ()))

    def findings(self) -> list:
        return [[name, list(before), list(after)] for name, before, after in self.calls]

    def accept(self, findings) -> None:
        calls = []
        for item in findings if isinstance(findings, list) else ():
            if isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) \
                    and all(isinstance(shape, list) and all(type(n) is int for n in shape) for shape in item[1:]):
                calls.append((item[0][:100], tuple(item[1]), tuple(item[2])))
        self.calls = calls


def _einops_calls(split_heads_einops: Callable, x: torch.Tensor, num_heads: int) -> list[tuple]:
    """Every call into einops made by ``split_heads_einops(x, num_heads)`` (see :class:`EinopsCalls`)."""
    calls = EinopsCalls()
    call_student(split_heads_einops, x, num_heads, call=f"split_heads_einops(x, num_heads={num_heads}) "
                 f"with x a {describe(x)}", probes=[calls])
    return calls.calls


@check("split_heads_einops: written with einops, same result as split_heads ({device})")
def check_split_heads_einops(split_heads_einops: Callable, *, seed: int = 0,
                             device: torch.device | None = None) -> None:
    """split_heads_einops: the same contract as split_heads, and einops does the split."""
    expect_signature(split_heads_einops, "split_heads_einops", ["x", "num_heads"])
    x = randn(2, 5, 12, generator=random_generator(seed), device=device)
    calls = _einops_calls(split_heads_einops, x, 3)
    expect_true(bool(calls), EINOPS_HINTS["no_rearrange"])
    # The split is einops' when one einops call takes the 3-D input and returns the 4-D heads.
    splitting = [call for call in calls if call[1] == tuple(x.shape) and len(call[2]) == 4]
    described = ", ".join(f"{name} {shape_str(before)} -> {shape_str(after)}" if before or after else name
                          for name, before, after in calls if name != "__init__") or "a layer that it never applies"
    expect_true(bool(splitting), f"split_heads_einops(x, num_heads=3) with x of shape {shape_str(x.shape)} calls "
                f"einops only as {described}.\n  Likely mistake: {EINOPS_HINTS['rearrange_not_splitting']}")
    _check_split_heads(split_heads_einops, seed=seed, device=device, name="split_heads_einops")


# --------------------------------------------------------------------------------------
# Exercise: merge_heads
# --------------------------------------------------------------------------------------

MERGE_HEADS_HINTS = {
    "reshape_only": "you reshaped [B, H, S, d] straight to [B, S, H*d]. Move the head axis back "
    "next to the features first: .transpose(1, 2) (or .permute(0, 2, 1, 3)), then flatten.",
    "not_contiguous": "after permute/transpose the tensor is not contiguous, so .view cannot "
    "flatten it: call .contiguous() before .view, or use .reshape (which copies only if needed).",
}


def _check_merge_heads_once(merge_heads: Callable, x: torch.Tensor) -> None:
    b, h, s, d = x.shape
    call = f"merge_heads(x) with x a {describe(x)}"
    try:
        out = call_student(merge_heads, x, call=call)
    except CheckFailure as failure:
        if "view size is not compatible" in str(failure):
            raise CheckFailure(f"{failure}\n  Likely mistake: {MERGE_HEADS_HINTS['not_contiguous']}") from failure.__cause__
        raise
    expect_tensor(out, what=call, shape=(b, s, h * d), dtype=x.dtype, device=x.device)
    # Each token's H head vectors side by side: unbind the head axis, concatenate on features.
    expect_close(out, torch.cat(x.unbind(1), dim=-1), what=call, against="the heads' features concatenated per token",
                 variants=[Variant(lambda: x.reshape(b, s, h * d), MERGE_HEADS_HINTS["reshape_only"])])


@check("merge_heads: shapes, values and the round trip with split ({device})")
def check_merge_heads(merge_heads: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """merge_heads: [B, H, S, d] -> [B, S, H*d], the inverse of split_heads."""
    expect_signature(merge_heads, "merge_heads", ["x"])
    generator = random_generator(seed)
    for dtype in (torch.float64, torch.float32):
        _check_merge_heads_once(merge_heads, randn(2, 3, 5, 4, generator=generator, dtype=dtype, device=device))
    # What split_heads returns is a permuted view: merge_heads must accept it.
    x = randn(2, 5, 12, generator=generator, device=device)
    permuted = x.view(2, 5, 3, 4).permute(0, 2, 1, 3)
    _check_merge_heads_once(merge_heads, permuted)
    round_trip = call_student(merge_heads, permuted, call="merge_heads(split_heads(x, 3))")
    expect_close(round_trip, x, what="merge_heads(split_heads(x, 3))", against="x (a round trip)")
    for _ in range(8):
        b, h, s, d = (randint(1, 3, generator), randint(1, 5, generator),
                      randint(1, 7, generator), randint(1, 5, generator))
        _check_merge_heads_once(merge_heads, randn(b, h, s, d, generator=generator, device=device))


# --------------------------------------------------------------------------------------
# Exercises: attention_weights and scaled_dot_product_attention
# --------------------------------------------------------------------------------------

ATTENTION_HINTS = {
    "no_scale": "no 1/sqrt(d_head) scaling: divide the scores q @ k^T by math.sqrt(d_head) "
    "(d_head = q.shape[-1]) before the softmax.",
    "scale_by_d": "you divided by d_head; the scale is 1/sqrt(d_head).",
    "wrong_axis": "softmax over the wrong axis: each query's weights over the keys must sum to 1, "
    "so take the softmax over the last axis (dim=-1).",
    "mask_flipped": "mask polarity flipped: in this course (as in F.scaled_dot_product_attention) "
    "True means 'may attend'. Fill the positions where the mask is False with -inf.",
    "no_transpose": "use k.transpose(-2, -1): the scores are q @ k^T, one row per query and one column per key.",
    "mask_ignored": "the mask was ignored: positions where mask is False must get weight exactly 0.",
    "weights_transposed": "multiply weights @ v (weights [S_q, S_k] times v [S_k, d_v]), not its transpose.",
    "zero_fill": "the masked scores were set to 0, not -inf. exp(0) = 1, so a masked key still gets weight: "
    "fill with float('-inf') (or torch.finfo(scores.dtype).min) before the softmax.",
    "transpose_wrong_axes": "k.transpose(0, 1) swaps the batch (or head) axis with the next one; the scores need the "
    "last two axes of k swapped: k.transpose(-2, -1) (or k.mT).",
    "scores_times_v": "out = weights @ v: you multiplied the scores (before the softmax) by v. Take the softmax "
    "first, then use its weights.",
}


def _attention_variants(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> list[Variant]:
    d_head = q.shape[-1]
    scores = q @ k.transpose(-2, -1)
    variants = [
        Variant(lambda: _reference_weights(q, k, attn_mask=mask, scale=1.0), ATTENTION_HINTS["no_scale"]),
        Variant(lambda: _reference_weights(q, k, attn_mask=mask, scale=1.0 / d_head), ATTENTION_HINTS["scale_by_d"]),
    ]
    if mask is None:
        variants.append(Variant(lambda: torch.softmax(scores / math.sqrt(d_head), dim=-2), ATTENTION_HINTS["wrong_axis"]))
    else:
        variants.append(Variant(lambda: _reference_weights(q, k, attn_mask=None), ATTENTION_HINTS["mask_ignored"]))
        variants.append(Variant(lambda: torch.softmax(_with_minus_inf_fill(scores / math.sqrt(d_head), ~mask), dim=-1),
                                ATTENTION_HINTS["mask_flipped"]))
        masked_scores = _with_minus_inf_fill(scores / math.sqrt(d_head), mask)
        variants.append(Variant(lambda: torch.softmax(masked_scores, dim=-2).nan_to_num(0.0), ATTENTION_HINTS["wrong_axis"]))
        variants.append(Variant(lambda: torch.softmax((scores / math.sqrt(d_head)).masked_fill(~mask, 0.0), dim=-1),
                                ATTENTION_HINTS["zero_fill"]))
    if k.dim() >= 3:
        variants.append(Variant(lambda: _swapped_weights(q, k, mask), ATTENTION_HINTS["transpose_wrong_axes"]))
    return variants


def _swapped_weights(q: torch.Tensor, k: torch.Tensor, mask) -> torch.Tensor | None:
    """The weights of an answer that wrote k.transpose(0, 1) where k.transpose(-2, -1) belongs, when that
    runs at all (None when it raises)."""
    try:
        scores = q @ k.transpose(0, 1) / math.sqrt(q.shape[-1])
        return torch.softmax(_with_minus_inf_fill(scores, mask), dim=-1)
    except RuntimeError:
        return None


def _matmul_error(left_shape, right_shape, device: torch.device) -> str | None:
    """The message PyTorch raises for ``left @ right`` on these shapes and this device (None if it works)."""
    try:
        torch.empty(left_shape, device=device) @ torch.empty(right_shape, device=device)
    except RuntimeError as error:
        return str(error)
    return None


def _call_attention(fn: Callable, *args, call: str, scores_shapes: tuple, **kwargs):
    """call_student, naming the missing or misplaced transpose when the answer's scores raised.

    ``scores_shapes`` is (q's shape, k's shape) of the scores the answer computes: q @ k on them
    raises the very RuntimeError the answer raised when it forgot k.transpose(-2, -1), and
    q @ k.transpose(0, 1) the one it raised when it swapped the wrong axes.
    """
    try:
        return call_student(fn, *args, call=call, forbidden=ATTENTION_BUILTINS, **kwargs)
    except CheckFailure as failure:
        cause = failure.__cause__
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        q_shape, k_shape = scores_shapes
        swapped = (k_shape[1], k_shape[0], *k_shape[2:]) if len(k_shape) >= 3 else None
        # The answer's own RuntimeError, reproduced on empty tensors of the same shapes, names the mistake.
        for right, hint in ((k_shape, "no_transpose"), (swapped, "transpose_wrong_axes")):
            error = None if right is None else _matmul_error(q_shape, right, device)
            if isinstance(cause, RuntimeError) and error is not None and str(cause) == error:
                raise CheckFailure(f"{failure}\n  Likely mistake: {ATTENTION_HINTS[hint]}") from cause
        raise


def _causal(s: int, device: torch.device) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool, device=device).tril()


def _attention_cases(generator: torch.Generator, device: torch.device):
    """(q, k, v, mask) cases: float64 and float32, 3-D and 4-D, masks of several broadcast shapes.

    Every query keeps at least one key: what a fully masked row should give is a convention
    (SDPA returns zeros, the -inf recipe NaN, a finite fill the mean of v), not part of the exercise.
    """
    yield (randn(2, 3, 5, 8, generator=generator, device=device, dtype=torch.float64),
           randn(2, 3, 5, 8, generator=generator, device=device, dtype=torch.float64),
           randn(2, 3, 5, 6, generator=generator, device=device, dtype=torch.float64), None)
    yield (randn(2, 3, 5, 8, generator=generator, device=device, dtype=torch.float32),
           randn(2, 3, 7, 8, generator=generator, device=device, dtype=torch.float32),
           randn(2, 3, 7, 6, generator=generator, device=device, dtype=torch.float32), None)
    # A causal [S, S] mask broadcast over batch and heads.
    yield (randn(2, 2, 6, 4, generator=generator, device=device),
           randn(2, 2, 6, 4, generator=generator, device=device),
           randn(2, 2, 6, 4, generator=generator, device=device), _causal(6, device))
    # A padding mask [B, 1, 1, S_k]: the last two keys of the second sequence are padding.
    padding = torch.ones(2, 1, 1, 5, dtype=torch.bool, device=device)
    padding[1, ..., 3:] = False
    yield (randn(2, 3, 4, 8, generator=generator, device=device),
           randn(2, 3, 5, 8, generator=generator, device=device),
           randn(2, 3, 5, 8, generator=generator, device=device), padding)
    # Square S == d_head, where q @ k without the transpose still has the right shape.
    yield (randn(2, 2, 4, 4, generator=generator, device=device), randn(2, 2, 4, 4, generator=generator, device=device),
           randn(2, 2, 4, 4, generator=generator, device=device), None)
    # 3-D inputs (no head axis) and a single token.
    yield (randn(3, 4, 8, generator=generator, device=device), randn(3, 4, 8, generator=generator, device=device),
           randn(3, 4, 2, generator=generator, device=device), None)
    yield (randn(1, 1, 1, 16, generator=generator, device=device), randn(1, 1, 1, 16, generator=generator, device=device),
           randn(1, 1, 1, 16, generator=generator, device=device), None)


def _check_weights(weights: torch.Tensor, q, k, mask, call: str) -> None:
    expected_shape = (*torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]), q.shape[-2], k.shape[-2])
    expect_tensor(weights, what=call, shape=expected_shape, dtype=q.dtype, device=q.device,
                  hints={(*expected_shape[:-2], q.shape[-2], q.shape[-1]): ATTENTION_HINTS["no_transpose"]})
    expect_close(weights, _reference_weights(q, k, attn_mask=mask), what=call,
                 against="softmax(q @ k^T / sqrt(d_head)) from F.scaled_dot_product_attention",
                 variants=_attention_variants(q, k, mask))
    # Properties: every row sums to 1; masked positions get exactly zero weight.
    row_error = (weights.double().sum(-1) - 1).abs()
    if not bool((row_error < 1e-3).all()):
        worst = float(weights.double().sum(-1).flatten()[row_error.argmax()])
        raise CheckFailure(f"{call}: every row of the weights should sum to 1 (one probability "
                           f"distribution per query), but a row sums to {worst:.4f}.")
    if mask is not None:
        leaked = weights.masked_select(~mask.expand_as(weights))
        if not bool((leaked == 0).all()):
            raise CheckFailure(f"{call}: positions where the mask is False must get weight exactly 0 "
                               f"(fill their scores with -inf before the softmax), found {float(leaked.abs().max()):.3g}.")


@check("attention_weights: softmax(q k^T / sqrt(d_head)) with masks, matches PyTorch ({device})")
def check_attention_weights(attention_weights: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """attention_weights: shape [..., S_q, S_k], values, rows sum to 1, masked weights exactly 0, from scratch."""
    expect_signature(attention_weights, "attention_weights", ["q", "k", "mask"])
    generator = random_generator(seed)
    for q, k, _v, mask in _attention_cases(generator, device):
        call = f"attention_weights(q, k, mask) with q a {describe(q)}, k of shape {shape_str(k.shape)}, {_mask_description(mask)}"
        weights = _call_attention(attention_weights, q, k, mask, call=call, scores_shapes=(q.shape, k.shape))
        _check_weights(weights, q, k, mask, call)
    # Random sizes, causal: no query may put weight on a later key.
    for _ in range(6):
        b, h, s, d = (randint(1, 3, generator), randint(1, 4, generator),
                      randint(1, 9, generator), randint(1, 16, generator))
        q, k = (randn(b, h, s, d, generator=generator, device=device) for _ in range(2))
        mask = _causal(s, device)
        call = f"attention_weights(q, k, causal mask) with q, k of shape {shape_str(q.shape)}"
        weights = _call_attention(attention_weights, q, k, mask, call=call, scores_shapes=(q.shape, k.shape))
        _check_weights(weights, q, k, mask, call)


@check("scaled_dot_product_attention: outputs and weights match F.scaled_dot_product_attention ({device})",
       uses=("attention_weights",))
def check_scaled_dot_product_attention(scaled_dot_product_attention: Callable, *, seed: int = 0,
                                       device: torch.device | None = None) -> None:
    """scaled_dot_product_attention: (out [..., S_q, d_v], weights), equal to PyTorch's SDPA, from scratch."""
    expect_signature(scaled_dot_product_attention, "scaled_dot_product_attention", ["q", "k", "v", "mask"])
    generator = random_generator(seed)
    for q, k, v, mask in _attention_cases(generator, device):
        call = (f"scaled_dot_product_attention(q, k, v, mask) with q a {describe(q)}, k {shape_str(k.shape)}, "
                f"v {shape_str(v.shape)}, {_mask_description(mask)}")
        result = _call_attention(scaled_dot_product_attention, q, k, v, mask, call=call, scores_shapes=(q.shape, k.shape))
        expect_true(isinstance(result, tuple) and len(result) == 2,
                    f"{call} should return a tuple (out, weights), got {describe(result)}.")
        out, weights = result
        _check_weights(weights, q, k, mask, call + " -> weights")
        expected_shape = (*torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]), q.shape[-2], v.shape[-1])
        expect_tensor(out, what=call + " -> out", shape=expected_shape, dtype=q.dtype, device=q.device)
        expect_close(out, reference_sdpa(q, k, v, attn_mask=mask), what=call + " -> out",
                     against="F.scaled_dot_product_attention",
                     variants=[Variant(lambda: reference_sdpa(q, k, v, attn_mask=mask, scale=1.0), ATTENTION_HINTS["no_scale"]),
                               Variant(lambda: (weights.transpose(-2, -1) @ v) if q.shape[-2] == k.shape[-2] else None,
                                       ATTENTION_HINTS["weights_transposed"]),
                               Variant(lambda: _with_minus_inf_fill(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), mask) @ v,
                                       ATTENTION_HINTS["scores_times_v"])])


# --------------------------------------------------------------------------------------
# Exercise: MultiHeadSelfAttention (and load_torch_mha_weights)
# --------------------------------------------------------------------------------------

MHSA_HINTS = {
    "no_out_linear": "the output projection is missing: apply self.out_linear to the merged heads.",
    "no_scale": "no 1/sqrt(d_head) scaling in the scores (d_head = embed_dim // num_heads, not embed_dim).",
    "scale_by_model_width": "you scaled by 1/sqrt(embed_dim); the scale is 1/sqrt(d_head) = 1/sqrt(embed_dim // num_heads).",
    "mask_flipped": "mask polarity flipped: True means 'may attend'.",
    "averaged_weights": "return the weights of every head, [B, H, S, S]; do not average over heads.",
    "mask_dropped": "the mask was not applied: forward(x, mask) must pass mask on to the attention weights "
    "(positions where it is False get weight 0).",
    "split_without_moving_heads": "your heads are cut by reshaping [B, S, D] straight to [B, H, S, d_head]. The shape "
    "is right but each 'head' then mixes features of several tokens: view as [B, S, H, d_head] first, then move "
    "the head axis with .transpose(1, 2) (as split_heads does).",
    "values_wrong_projection": "the values must come from v_linear: your V equals another projection's output "
    "(q_linear or k_linear). Check v = self.v_linear(x).",
}


def _torch_mha_like(module: nn.Module, embed_dim: int, num_heads: int, bias: bool) -> nn.MultiheadAttention:
    """nn.MultiheadAttention holding the student's module's weights (stacked q; k; v)."""
    reference = nn.MultiheadAttention(embed_dim, num_heads, bias=bias, batch_first=True)
    reference = reference.to(device=module.q_linear.weight.device, dtype=module.q_linear.weight.dtype)
    with torch.no_grad():
        reference.in_proj_weight.copy_(torch.cat([module.q_linear.weight, module.k_linear.weight, module.v_linear.weight]))
        reference.out_proj.weight.copy_(module.out_linear.weight)
        if bias:
            reference.in_proj_bias.copy_(torch.cat([module.q_linear.bias, module.k_linear.bias, module.v_linear.bias]))
            reference.out_proj.bias.copy_(module.out_linear.bias)
    return reference


def _torch_mha_reference(reference: nn.MultiheadAttention, x: torch.Tensor, mask: torch.Tensor | None):
    # nn.MultiheadAttention's boolean attn_mask means True = *blocked*: the opposite of ours.
    blocked = None if mask is None else ~mask
    return reference(x, x, x, attn_mask=blocked, need_weights=True, average_attn_weights=False)


def _mhsa_variants(module: nn.Module, x: torch.Tensor, mask, num_heads: int) -> list[Variant]:
    d_model = x.shape[-1]
    d_head = d_model // num_heads

    def manual(scale: float, use_out: bool = True, flip: bool = False, use_mask: bool = True,
               scrambled_split: bool = False, scrambled_merge: bool = False, values=None):
        b, s, _ = x.shape
        projections = (module.q_linear, module.k_linear, values or module.v_linear)
        if scrambled_split:  # [B, S, D] -> [B, H, S, d_head] by reshape alone
            q, k, v = (linear(x).reshape(b, num_heads, s, d_head) for linear in projections)
        else:
            q, k, v = (torch.stack(linear(x).tensor_split(num_heads, dim=-1), dim=1)  # [B, H, S, d_head]
                       for linear in projections)
        if flip:
            weights = torch.softmax(_with_minus_inf_fill((q @ k.transpose(-2, -1)) * scale, ~mask), dim=-1)
            heads = weights @ v
        else:
            heads = reference_sdpa(q, k, v, attn_mask=mask if use_mask else None, scale=scale)
        context = heads.reshape(b, s, d_model) if scrambled_merge else torch.cat(heads.unbind(1), dim=-1)  # [B, S, D]
        return module.out_linear(context) if use_out else context

    right_scale = 1 / math.sqrt(d_head)
    variants = [
        Variant(lambda: manual(right_scale, use_out=False), MHSA_HINTS["no_out_linear"]),
        Variant(lambda: manual(1.0), MHSA_HINTS["no_scale"]),
        Variant(lambda: manual(1 / math.sqrt(d_model)), MHSA_HINTS["scale_by_model_width"]),
        Variant(lambda: manual(right_scale, values=module.k_linear), MHSA_HINTS["values_wrong_projection"]),
        Variant(lambda: manual(right_scale, values=module.q_linear), MHSA_HINTS["values_wrong_projection"]),
    ]
    if num_heads > 1:
        for merge in (False, True):  # merged back correctly, or by the inverse reshape
            variants.append(Variant(lambda merge=merge: manual(right_scale, scrambled_split=True, scrambled_merge=merge),
                                    MHSA_HINTS["split_without_moving_heads"]))
    if mask is not None:
        variants.append(Variant(lambda: manual(right_scale, flip=True), MHSA_HINTS["mask_flipped"]))
        variants.append(Variant(lambda: manual(right_scale, use_mask=False), MHSA_HINTS["mask_dropped"]))
    return variants


def _build_module(cls: Callable, embed_dim: int, num_heads: int, bias: bool, device, dtype) -> nn.Module:
    call = f"MultiHeadSelfAttention({embed_dim}, {num_heads}, bias={bias})"
    module = call_student(cls, embed_dim, num_heads, bias=bias, call=call)
    expect_true(isinstance(module, nn.Module), f"{call} should be an nn.Module, got {describe(module)}.")
    for attr in ("q_linear", "k_linear", "v_linear", "out_linear"):
        layer = getattr(module, attr, None)
        expect_true(isinstance(layer, nn.Linear), f"{call} should have an attribute {attr} that is an nn.Linear, "
                    f"got {describe(layer)}. The names are part of the contract (load_torch_mha_weights uses them).")
        expect_true(tuple(layer.weight.shape) == (embed_dim, embed_dim),
                    f"{call}.{attr}.weight should be [{embed_dim}, {embed_dim}], got {shape_str(layer.weight.shape)}.")
        expect_true((layer.bias is not None) == bias, f"{call}.{attr} should {'have' if bias else 'have no'} bias.")
    return module.to(device=device, dtype=dtype)


def _check_mhsa_forward(module: nn.Module, x: torch.Tensor, mask, num_heads: int, label: str) -> None:
    b, s, d_model = x.shape
    reference = _torch_mha_like(module, d_model, num_heads, module.q_linear.bias is not None)
    expected_out, expected_weights = _torch_mha_reference(reference, x, mask)
    call = f"{label}(x{', mask' if mask is not None else ''}) with x a {describe(x)}, {_mask_description(mask)}"
    heads_shape = (b, num_heads, s, d_model // num_heads)
    out = _call_attention(module, x, mask, call=call, scores_shapes=(heads_shape, heads_shape))
    expect_tensor(out, what=call, shape=(b, s, d_model), dtype=x.dtype, device=x.device)
    expect_close(out, expected_out, what=call, against="nn.MultiheadAttention with the same weights",
                 variants=_mhsa_variants(module, x, mask, num_heads))
    call_weights = call + " with return_weights=True"
    result = call_student(module, x, mask, return_weights=True, call=call_weights, forbidden=ATTENTION_BUILTINS)
    expect_true(isinstance(result, tuple) and len(result) == 2,
                f"{call_weights} should return (out, weights), got {describe(result)}.")
    expect_tensor(result[1], what=call_weights + " -> weights", shape=(b, num_heads, s, s), dtype=x.dtype, device=x.device,
                  hints={(b, s, s): MHSA_HINTS["averaged_weights"]})
    expect_close(result[1], expected_weights, what=call_weights + " -> weights",
                 against="nn.MultiheadAttention's per-head weights (average_attn_weights=False)")


@check("MultiHeadSelfAttention: attributes, output and weights match nn.MultiheadAttention; equivariance and causality ({device})",
       uses=("split_heads", "merge_heads", "attention_weights", "scaled_dot_product_attention"))
def check_multi_head_self_attention(MultiHeadSelfAttention: Callable, *, seed: int = 0,
                                    device: torch.device | None = None) -> None:
    """MultiHeadSelfAttention: contract, numbers against nn.MultiheadAttention, properties, from scratch."""
    expect_signature(MultiHeadSelfAttention, "MultiHeadSelfAttention", ["embed_dim", "num_heads", "bias"])
    generator = random_generator(seed)
    torch.manual_seed(seed)  # the student's nn.Linear initialisation (the RNG is restored afterwards)
    for dtype, bias in ((torch.float64, True), (torch.float32, True), (torch.float64, False)):
        module = _build_module(MultiHeadSelfAttention, 16, 4, bias, device, dtype)
        x = randn(2, 5, 16, generator=generator, dtype=dtype, device=device)
        _check_mhsa_forward(module, x, None, 4, "MultiHeadSelfAttention(16, 4)")
        _check_mhsa_forward(module, x, _causal(5, device), 4, "MultiHeadSelfAttention(16, 4)")
    # Properties on random sizes: permutation equivariance without a mask; causality with one.
    for _ in range(4):
        h, d, s = randint(1, 4, generator), randint(1, 4, generator), randint(2, 7, generator)
        module = _build_module(MultiHeadSelfAttention, h * d, h, True, device, torch.float64)
        x = randn(2, s, h * d, generator=generator, device=device)
        label = f"MultiHeadSelfAttention({h * d}, {h})"
        _check_mhsa_forward(module, x, None, h, label)
        permutation = torch.randperm(s, generator=generator).to(device)
        out = call_student(module, x, call=label + "(x)", forbidden=ATTENTION_BUILTINS)
        out_permuted = call_student(module, x[:, permutation], call=label + "(x permuted)", forbidden=ATTENTION_BUILTINS)
        expect_close(out_permuted, out[:, permutation], what=f"{label} on tokens permuted by {permutation.tolist()}",
                     against="the original outputs permuted the same way (self-attention is permutation-equivariant)")
        changed = x.clone()
        changed[:, -1] += 1.0
        mask = _causal(s, device)
        before = call_student(module, x, mask, call=label + "(x, causal)", forbidden=ATTENTION_BUILTINS)
        after = call_student(module, changed, mask, call=label + "(x, causal)", forbidden=ATTENTION_BUILTINS)
        expect_close(after[:, :-1], before[:, :-1], what=f"{label} with a causal mask after changing the last token",
                     against="the outputs of the earlier tokens (a causal mask lets no future token influence the past)")


LOAD_HINTS = {
    "transposed": "nn.Linear stores weight as [out, in] like in_proj_weight: copy the block as it is, do not transpose it.",
    "wrong_block": "wrong block of in_proj_weight: rows are stacked in the order q, k, v.",
    "not_parameter": "copy into the existing parameter with .copy_() under torch.no_grad(), instead of "
    "replacing it with a plain tensor.",
    "shares_memory": "changing one changes the other. Copy the values (param.copy_(...)) instead of assigning "
    "a slice.",
}


@check("load_torch_mha_weights: parameters copied from in_proj_weight/bias and out_proj; outputs then match ({device})",
       uses=("MultiHeadSelfAttention",))
def check_load_torch_mha_weights(load_torch_mha_weights: Callable, MultiHeadSelfAttention: Callable, *,
                                 seed: int = 0, device: torch.device | None = None) -> None:
    """load_torch_mha_weights: copies stacked q;k;v weights into q/k/v_linear; module then equals nn.MultiheadAttention."""
    expect_signature(load_torch_mha_weights, "load_torch_mha_weights", ["module", "torch_mha"])
    generator = random_generator(seed)
    torch.manual_seed(seed)
    for bias in (True, False):
        embed_dim, num_heads = 12, 3
        torch_mha = nn.MultiheadAttention(embed_dim, num_heads, bias=bias, batch_first=True).to(device, torch.float64)
        with torch.no_grad():  # biases start at zero in PyTorch: make them count
            for parameter in torch_mha.parameters():
                parameter.copy_(randn(*parameter.shape, generator=generator, device=device) * 0.3)
        module = _build_module(MultiHeadSelfAttention, embed_dim, num_heads, bias, device, torch.float64)
        original = copy.deepcopy(torch_mha)  # what every expected value comes from: the student never has it
        call = f"load_torch_mha_weights(module, torch_mha) with embed_dim={embed_dim}, bias={bias}"
        returned = call_student(load_torch_mha_weights, module, torch_mha, call=call, writes=("module",))
        expect_true(returned is None, f"{call} should modify module in place and return None, got {describe(returned)}.")
        stacked_weight = original.in_proj_weight.detach()
        names = ("q_linear", "k_linear", "v_linear")
        for index, name in enumerate(names):
            layer = getattr(module, name)
            expect_true(isinstance(layer.weight, nn.Parameter), f"after {call}, module.{name}.weight should still be "
                        f"an nn.Parameter.\n  Likely mistake: {LOAD_HINTS['not_parameter']}")
            block = stacked_weight[index * embed_dim:(index + 1) * embed_dim]
            others = [stacked_weight[j * embed_dim:(j + 1) * embed_dim] for j in range(3) if j != index]
            expect_close(layer.weight, block, what=f"module.{name}.weight after {call}",
                         against=f"rows {index * embed_dim}..{(index + 1) * embed_dim - 1} of in_proj_weight (stacked q; k; v)",
                         variants=[Variant(block.T, LOAD_HINTS["transposed"])]
                         + [Variant(other, LOAD_HINTS["wrong_block"]) for other in others])
            if bias:
                expect_close(layer.bias, original.in_proj_bias[index * embed_dim:(index + 1) * embed_dim],
                             what=f"module.{name}.bias after {call}", against="the matching slice of in_proj_bias")
        expect_close(module.out_linear.weight, original.out_proj.weight, what=f"module.out_linear.weight after {call}",
                     against="torch_mha.out_proj.weight")
        with torch.no_grad():
            torch_mha.in_proj_weight.add_(1.0)
        expect_true(not torch.equal(module.q_linear.weight, torch_mha.in_proj_weight[:embed_dim]),
                    f"after {call}, module.q_linear.weight shares memory with torch_mha.in_proj_weight.\n"
                    f"  Likely mistake: {LOAD_HINTS['shares_memory']}")
        with torch.no_grad():
            torch_mha.in_proj_weight.sub_(1.0)
        x = randn(2, 4, embed_dim, generator=generator, device=device)
        expected, _ = original(x, x, x, need_weights=False)
        out = call_student(module, x, call="MultiHeadSelfAttention(x) after loading", forbidden=ATTENTION_BUILTINS)
        expect_close(out, expected, what="your MultiHeadSelfAttention's output after load_torch_mha_weights",
                     against="torch_mha(x, x, x) (the weights were copied right, so check MultiHeadSelfAttention itself)")


# --------------------------------------------------------------------------------------
# Exercise: attention_layer_flops (what one layer costs), and the crossover question
# --------------------------------------------------------------------------------------

FLOPS_HINTS = {
    "multiply_add_once": "a multiply-add counts as 2 FLOPs (one multiply, one add), as FlopCounterMode counts "
    "them: an [m, k] @ [k, n] product costs 2·m·k·n, not m·k·n.",
    "one_projection": "you counted one projection; the layer has four [D, D] projections: Q, K, V and the output.",
    "three_projections": "you left out the output projection: Q, K, V and out_linear make four [D, D] products.",
    "linear_in_s": "the attention part grows with S², not S: Q @ Kᵀ compares every query with every key "
    "([S, d_head] @ [d_head, S] per head), and weights @ V is [S, S] @ [S, d_head].",
    "only_scores": "attention is half of what the counter counts: either you counted Q @ Kᵀ but not weights @ V, "
    "which costs as much again, or you halved it for a causal mask -- a mask saves no product: Q @ Kᵀ is computed "
    "for every (query, key) pair, and the masked scores are set to -inf after it.",
    "causal_half": "you counted only the (query, key) pairs a causal mask keeps, S·(S+1)/2 per head: a mask saves "
    "no product. Q @ Kᵀ and weights @ V are computed for every pair (the masked scores are set to -inf after the "
    "product), and FlopCounterMode counts what the products compute.",
    "no_batch": "every sequence of the batch costs the same again: multiply by batch_size.",
    "swapped": "the two entries are swapped: 'projections' grows with D², 'attention' with S².",
    "biases": "you counted the biases: FlopCounterMode counts matrix products only, so the four projections "
    "cost 4 · 2·B·S·D², without the B·S·D additions of their biases.",
    "times_heads": "the attention term was multiplied by the number of heads (by {factor}): each head compares "
    "queries and keys of width d_head = D/H, so the H heads together cost 2 · 2·B·S²·(H·d_head) = 4·B·S²·D, "
    "whatever H is. Count with D, and no factor H.",
    "softmax_counted": "FlopCounterMode counts matrix products only: the scaling, the mask and the softmax "
    "(a few operations per score) are not in its count. Count the products alone.",
}
FLOPS_KEYS = ("projections", "attention")
_PROJECTIONS = ("q_linear", "k_linear", "v_linear", "out_linear")


class _Product(nn.Module):
    """One matrix product of two inputs (``torch.einsum(equation, a, b)``) as a module of its own, so that
    FlopCounterMode counts it under its own name."""

    def __init__(self, equation: str) -> None:
        super().__init__()
        self.equation = equation

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.einsum(self.equation, a, b)


class _CountedAttention(nn.Module):
    """What the FLOP checks count on: multi-head attention whose every matrix product is a submodule of its
    own -- the projections ``q``, ``k``, ``v``, ``out`` and the products ``scores`` (Q @ Kᵀ) and ``mix``
    (weights @ V) -- so that FlopCounterMode's count comes part by part. Built on the meta device (shapes,
    no numbers: any size costs nothing). Not the exercise's contract (no q_linear ..., forward(x) only)."""

    def __init__(self, width: int, heads: int, device) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(width, width, device=device) for _ in range(4))
        self.scores, self.mix = _Product("bhqd,bhkd->bhqk"), _Product("bhqk,bhkd->bhqd")
        self.heads = heads

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        q, k, v = (torch.stack(projection(tokens).tensor_split(self.heads, dim=-1), dim=1)
                   for projection in (self.q, self.k, self.v))  # [B, H, S, d_head]
        weights = (self.scores(q, k) * q.shape[-1] ** -0.5).softmax(-1)
        return self.out(torch.cat(self.mix(weights, v).unbind(1), dim=-1))


class _CountedBlock(nn.Module):
    """A pre-norm block (LayerNorm, attention, LayerNorm, MLP with GELU) whose attention is _CountedAttention
    (explicit products: FlopCounterMode does not count SDPA's fused kernels on a CPU) and whose MLP's two
    products are ``up`` and ``down``."""

    def __init__(self, width: int, heads: int, hidden: int, device) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width, device=device)
        self.attn = _CountedAttention(width, heads, device)
        self.norm2 = nn.LayerNorm(width, device=device)
        self.up = nn.Linear(width, hidden, device=device)
        self.down = nn.Linear(hidden, width, device=device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens + self.attn(self.norm1(tokens))
        return tokens + self.down(nn.functional.gelu(self.up(self.norm2(tokens))))


# The parts of the counted modules, by the key of the answer's dict they belong to ("attention": the rest).
_PARTS = {"projections": ("q", "k", "v", "out"), "mlp": ("up", "down")}
_PRODUCTS = ("q", "k", "v", "out", "scores", "mix", "up", "down")


def _measured(module: nn.Module, tokens: torch.Tensor) -> dict[str, int]:
    """FlopCounterMode's count of one forward pass of one of the check's own modules, by product (``q``, ``k``,
    ``v``, ``out``, ``scores``, ``mix``, ``up``, ``down``), and ``total``."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        module(tokens)
    parts = {"total": int(counter.get_total_flops())}
    for name, operations in counter.get_flop_counts().items():  # by module: "Global", "_CountedBlock.attn.q", ...
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _PRODUCTS:
            parts[leaf] = int(sum(operations.values()))
    return parts


def _by_key(parts: dict[str, int], keys: Sequence[str]) -> dict[str, int]:
    """The measured parts summed by the keys of an answer: the projections, the MLP, and attention, the rest."""
    counts = {key: sum(parts.get(name, 0) for name in _PARTS[key]) for key in keys if key in _PARTS}
    return {key: counts[key] if key in counts else parts["total"] - sum(counts.values()) for key in keys}


class FlopCount(Probe):
    """FlopCounterMode's count of one call, split into the FLOPs inside the submodules named
    ``projection_names`` (the projections) and the rest (attention)."""

    def __init__(self, projection_names: Sequence[str] = ()):
        super().__init__(projection_names=list(projection_names))
        self.projection_names = tuple(projection_names)
        self.count: dict | None = None

    def __enter__(self) -> "FlopCount":
        from torch.utils.flop_counter import FlopCounterMode

        self._grad = torch.no_grad()
        self._grad.__enter__()
        self._counter = FlopCounterMode(display=False)
        self._counter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._counter.__exit__(*exc)
        finally:
            self._grad.__exit__(*exc)
        total = self._counter.get_total_flops()
        projections = sum(flops for name, operations in self._counter.get_flop_counts().items()
                          if name.rsplit(".", 1)[-1] in self.projection_names for flops in operations.values())
        self.count = {"projections": int(projections), "attention": int(total - projections)}

    def findings(self) -> dict | None:
        return self.count

    def accept(self, findings) -> None:
        if isinstance(findings, dict) and set(findings) == set(FLOPS_KEYS) \
                and all(type(v) is int for v in findings.values()):
            self.count = dict(findings)


def _counted(module: Callable, x: torch.Tensor, projection_names: Sequence[str], call: str | None) -> dict:
    """FlopCounterMode's count of one forward pass (see :class:`FlopCount`); ``call`` None: a
    module of the check's own, called directly."""
    counter = FlopCount(projection_names)
    if call is None:
        with counter:
            module(x)
    else:
        call_student(module, x, call=call, forbidden=ATTENTION_BUILTINS, probes=[counter])
    if counter.count is None:
        raise CheckFailure(f"{call}: no FLOP count came back from the call")
    return counter.count


def _students_count(MultiHeadSelfAttention: Callable | None, case: tuple, heads: int, reference: dict) -> tuple:
    """(count, why not) on the student's own module: (None, reason) when it cannot be measured or
    does other work than a multi-head attention layer."""
    batch_size, seq_len, d_model = case
    if MultiHeadSelfAttention is None:
        return None, "no MultiHeadSelfAttention is defined in this notebook"
    label = f"MultiHeadSelfAttention({d_model}, {heads})"
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            module = call_student(MultiHeadSelfAttention, d_model, heads, call=label)
        x = torch.randn(batch_size, seq_len, d_model, generator=random_generator(seq_len))
        count = _counted(module, x, _PROJECTIONS, call=f"{label}(x) with x of shape {shape_str(x.shape)}")
    except CheckFailure as failure:
        return None, str(failure).splitlines()[0]
    except Exception as error:  # e.g. not an nn.Module at all
        return None, crash_message(label, error)
    if count != reference:
        return None, (f"it counts {count['projections']:,} FLOPs in q/k/v/out_linear and {count['attention']:,} "
                      f"elsewhere, not the layer's {reference['projections']:,} and {reference['attention']:,}")
    return count, ""


def _is(got: int, measured: int | Fraction, factor: Fraction | int = 1) -> bool:
    """``got == measured · factor`` exactly (a count is an integer: no rounding)."""
    return got == Fraction(measured) * factor


def _flops_mistake(got: dict, parts: dict[str, int], case: tuple, hidden: int | None = None) -> str:
    """The likely mistake of a wrong count, named from what FlopCounterMode measured on the check's module part
    by part (half of a part, one product of it, the batch left out, ...): no formula of the answer is written
    here. ``hidden``: the MLP's hidden width (block_flops)."""
    b, s, d = case
    want = _by_key(parts, list(got))
    keys = [key for key in want if got[key] != want[key]]
    if set(got) >= {"projections", "attention"} and got["projections"] == want["attention"] \
            and got["attention"] == want["projections"] and got["projections"] != got["attention"]:
        return FLOPS_HINTS["swapped"]
    if all(_is(got[key], want[key], Fraction(1, 2)) for key in want):
        return FLOPS_HINTS["multiply_add_once"]
    if b > 1 and all(_is(got[key], want[key], Fraction(1, b)) for key in want):
        return FLOPS_HINTS["no_batch"]
    for key in keys:
        value, measured = got[key], want[key]
        if b > 1 and _is(value, measured, Fraction(1, b)):
            return FLOPS_HINTS["no_batch"]
        if key == "projections":
            if value in (parts["q"], parts["q"] // 2):
                return FLOPS_HINTS["one_projection"]
            if value == parts["q"] + parts["k"] + parts["v"]:
                return FLOPS_HINTS["three_projections"]
            if _is(value, measured, Fraction(1, 2)):
                return FLOPS_HINTS["multiply_add_once"]
            extra = value - measured  # a bias adds one number to each of the B·S·D outputs of a projection
            if extra > 0 and extra % (b * s * d) == 0 and extra // (b * s * d) in (1, 2, 3, 4, 6, 8):
                return FLOPS_HINTS["biases"]
        elif key == "attention":
            if value > measured and value % measured == 0 and got.get("projections") == want.get("projections"):
                return FLOPS_HINTS["times_heads"].format(factor=value // measured)
            if value == parts["scores"]:
                return FLOPS_HINTS["only_scores"]
            if s > 1 and _is(value, measured, Fraction(s + 1, 2 * s)):
                return FLOPS_HINTS["causal_half"]
            if s > 1 and _is(value, measured, Fraction(1, s)):
                return FLOPS_HINTS["linear_in_s"]
            extra = value - measured  # a few operations per score: B·S² of them per head
            if 0 < extra < measured and extra % (b * s * s) == 0:
                return FLOPS_HINTS["softmax_counted"]
        elif key == "mlp":
            if value == parts["up"]:
                return BLOCK_FLOPS_HINTS["mlp_half"]
            if any(width != hidden and _is(value, measured, Fraction(width, hidden)) for width in (d, 4 * d)):
                return BLOCK_FLOPS_HINTS["mlp_ratio_ignored"]
    return ""


def _expect_flops(got: Any, expected: dict, parts: dict, call: str, counted_on: str, case: tuple, int_hint: str,
                  hidden: int | None = None) -> None:
    """``got``, an answer's dict of counts, against FlopCounterMode's ``expected``; its mistake named."""
    keys = list(expected)
    expect_true(isinstance(got, dict), f"{call} should return a dict with the keys {keys}, got {describe(got)}.")
    missing, extra = [k for k in keys if k not in got], [k for k in got if k not in keys]
    expect_true(not missing and not extra, f"{call} should have exactly the keys {keys}; "
                f"missing {missing}, unexpected {extra}.")
    for key in keys:
        expect_true(is_integer(got[key]), f"{call}[{key!r}] should be an int (a count of FLOPs), got "
                    f"{describe(got[key])}. {int_hint}")
    if got != expected:
        hint = _flops_mistake(got, parts, case, hidden)
        wrong = [key for key in keys if got[key] != expected[key]]
        raise CheckFailure(f"{call} does not match FlopCounterMode's count on {counted_on}: "
                           + "; ".join(f"{key} should be {expected[key]:,}, got {got[key]:,}" for key in wrong) + "."
                           + (f"\n  Likely mistake: {hint}" if hint else ""))


@check("attention_layer_flops: the FLOPs that FlopCounterMode counts on a multi-head attention layer")
def check_attention_layer_flops(attention_layer_flops: Callable, MultiHeadSelfAttention: Callable | None = None, *,
                                seed: int = 0, device: torch.device | None = None) -> None:
    """attention_layer_flops(batch_size, seq_len, d_model) -> {"projections", "attention"}, against
    torch.utils.flop_counter.FlopCounterMode run on the student's own MultiHeadSelfAttention (the check's own
    layer when theirs cannot be measured; the note says so)."""
    from attention_lab.checking import _student_namespace, add_note

    expect_signature(attention_layer_flops, "attention_layer_flops", ["batch_size", "seq_len", "d_model"])
    if MultiHeadSelfAttention is None:
        MultiHeadSelfAttention = (_student_namespace(attention_layer_flops) or {}).get("MultiHeadSelfAttention")
    generator = random_generator(seed)
    # Small layers are measured on the student's own module too; real sizes (ViT-B, GPT-2) on the check's
    # layer only, on the meta device, which has shapes and no numbers.
    measured_cases = [(3, 7, 16, 4), (1, 9, 12, 3), (randint(2, 4, generator), randint(3, 40, generator), 8, 2)]
    real_cases = [(8, 197, 768, 12), (1, 1024, 768, 12), (randint(1, 9, generator), randint(1, 4096, generator), 64, 4)]
    fallback = None
    for batch_size, seq_len, d_model, heads in measured_cases + real_cases:
        case = (batch_size, seq_len, d_model)
        parts = _measured(_CountedAttention(d_model, heads, device="meta"),
                          torch.empty(batch_size, seq_len, d_model, device="meta"))
        expected = _by_key(parts, FLOPS_KEYS)
        source = "a reference layer"
        if (batch_size, seq_len, d_model, heads) in measured_cases:
            students, why_not = _students_count(MultiHeadSelfAttention, case, heads, expected)
            if students is not None:
                expected, source = students, "your MultiHeadSelfAttention"
            elif fallback is None:
                fallback = why_not
        call = f"attention_layer_flops(batch_size={batch_size}, seq_len={seq_len}, d_model={d_model})"
        got = call_student(attention_layer_flops, batch_size, seq_len, d_model, call=call)
        _expect_flops(got, expected, parts, call, f"{source} (B={batch_size}, S={seq_len}, D={d_model}, H={heads})",
                      case, "Integer arithmetic keeps it exact: no `/`, no `math.pow`.")
    if fallback is not None:
        add_note(f"  note: your MultiHeadSelfAttention could not be measured ({fallback}), so the small "
                 "cases were counted on a reference layer instead. Fix MultiHeadSelfAttention to see your own "
                 "module counted.")


# --------------------------------------------------------------------------------------
# Exercise: block_flops (the whole pre-norm block), and the crossover as a number
# --------------------------------------------------------------------------------------

BLOCK_FLOPS_HINTS = {
    "mlp_half": "the MLP's count is half of FlopCounterMode's: either one of its two matrix products is "
    "missing -- up, [B·S, D] @ [D, hidden], and down, [B·S, hidden] @ [hidden, D], cost the same -- or a "
    "multiply-add was counted as 1 FLOP: the counter counts 2 (one multiply, one add), so an [m, k] @ [k, n] "
    "product costs 2·m·k·n.",
    "mlp_ratio_ignored": "the MLP's hidden width is int(mlp_ratio · d_model), not d_model or 4 · d_model "
    "whatever mlp_ratio is: the check also calls block_flops with another mlp_ratio.",
}
BLOCK_FLOPS_KEYS = ("projections", "attention", "mlp")


@check("block_flops: the FLOPs that FlopCounterMode counts on a whole pre-norm block, by part")
def check_block_flops(block_flops: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """block_flops(batch_size, seq_len, d_model, mlp_ratio=4) -> {"projections", "attention", "mlp"},
    against FlopCounterMode run on a block of the check's on the meta device, at the default ratio and others."""
    expect_signature(block_flops, "block_flops", ["batch_size", "seq_len", "d_model", "mlp_ratio"])
    generator = random_generator(seed)
    cases = [(3, 7, 16, 4, None), (8, 197, 768, 12, None), (1, 1024, 768, 12, 2),
             (randint(1, 5, generator), randint(1, 2048, generator), 64, 4, (8 / 3, 3.5)[randint(0, 1, generator)])]
    for batch_size, seq_len, d_model, heads, mlp_ratio in cases:
        hidden = int((4 if mlp_ratio is None else mlp_ratio) * d_model)
        parts = _measured(_CountedBlock(d_model, heads, hidden, device="meta"),
                          torch.empty(batch_size, seq_len, d_model, device="meta"))
        args = (batch_size, seq_len, d_model) + (() if mlp_ratio is None else (mlp_ratio,))
        call = (f"block_flops(batch_size={batch_size}, seq_len={seq_len}, d_model={d_model}"
                + ("" if mlp_ratio is None else f", mlp_ratio={mlp_ratio:.4g}") + ")")
        got = call_student(block_flops, *args, call=call)
        _expect_flops(got, _by_key(parts, BLOCK_FLOPS_KEYS), parts, call,
                      f"a pre-norm block (B={batch_size}, S={seq_len}, D={d_model}, MLP hidden width {hidden})",
                      (batch_size, seq_len, d_model),
                      "Integer arithmetic keeps it exact: int(mlp_ratio * d_model) is the hidden width.", hidden)


CROSSOVER_HINTS = {
    "projections_only": "that is where attention passes the four projections; the block also has the MLP. "
    "Compare attention with everything else block_flops counts.",
    "mlp_only": "that is where attention equals the MLP alone; the rest of the block is the MLP and the four "
    "projections.",
    "one_projection": "at S = D one Q @ Kᵀ costs as much as one projection; the question compares all of "
    "attention with all the rest of the block.",
    "half_of_attention": "where attention is half the block, it equals everything else: attention = the rest, "
    "not 2 · the rest.",
}
_CROSSOVER_WIDTH = 768  # the question's block: D = 768 (GPT-2 small, ViT-B), a 4·D MLP


@check("ANSWER_ATTENTION_CROSSOVER: the sequence length where attention is half the block's FLOPs")
def check_answer_attention_crossover(answer, *, seed: int = 0, device: torch.device | None = None) -> None:
    """Where attention's FLOPs equal the rest of the block's, found from FlopCounterMode's count of one block of
    the question's width: attention grows with S², the projections and the MLP with S, so one count at any S
    says where they meet. The derivation is printed only once the answer is right."""
    from attention_lab.checking import add_note

    name, width = "ANSWER_ATTENTION_CROSSOVER", _CROSSOVER_WIDTH
    if answer is None:
        raise CheckFailure(f"{name}: not implemented yet. Set {name} to a number: the sequence length S.")
    expect_true(is_number(answer) and math.isfinite(answer),
                f"{name} should be a number (a sequence length, e.g. 1000), got {describe(answer)}.")
    seq_len = width  # counted at S = D (any S would do)
    parts = _measured(_CountedBlock(width, 12, 4 * width, device="meta"), torch.empty(1, seq_len, width, device="meta"))
    counts = _by_key(parts, BLOCK_FLOPS_KEYS)
    # attention(S) = A·(S/seq_len)², the rest(S) = R·(S/seq_len): equal at S = seq_len·R/A.
    at = lambda rest, quadratic: seq_len * Fraction(rest, quadratic)  # noqa: E731
    crossover = at(counts["projections"] + counts["mlp"], counts["attention"])
    wrong = {at(counts["projections"], counts["attention"]): "projections_only",
             at(counts["mlp"], counts["attention"]): "mlp_only",
             at(parts["q"], parts["scores"]): "one_projection", 2 * crossover: "half_of_attention"}
    if abs(answer - crossover) > 0.5:
        hint = next((CROSSOVER_HINTS[key] for value, key in wrong.items() if abs(answer - value) <= 0.5), "")
        raise CheckFailure(f"{name} = {answer!r} is not right: at that S attention's FLOPs do not equal the rest "
                           f"of the block's (D = {width}, MLP 4·D)." + (f"\n  Likely mistake: {hint}" if hint else ""))
    # The counts as multiples of B·S²·D and B·S·D² (B = 1), for the derivation.
    a = Fraction(counts["attention"], seq_len ** 2 * width)
    p, m = (Fraction(counts[key], seq_len * width ** 2) for key in ("projections", "mlp"))
    add_note(f"  Why: attention costs {a}·B·S²·D; the rest of the block costs {p}·B·S·D² (four projections) + "
             f"{m}·B·S·D² (MLP at 4·D) = {p + m}·B·S·D². They are equal at S = {(p + m) / a}·D = {int(crossover):,} "
             f"for D = {width}; attention passes the four projections alone at S = {p / a}·D = "
             f"{int(at(counts['projections'], counts['attention'])):,}. A ViT-B image (197 tokens) and GPT-2's "
             "context (1,024) are far below both.")


# --------------------------------------------------------------------------------------
# The predict-first question on the einops draft
# --------------------------------------------------------------------------------------

DRAFT_BUG_HINTS = {
    "c7390fb084833ee8": "Compare the draft's scores with q @ kᵀ / sqrt(d_head), line by line: is every step there?",
    "f5de7d41c6eb93cb": "Which way does the draft's missing step move the scores: towards larger or smaller magnitudes? "
    "Then: what does the softmax do with larger scores?",
    "ae5ac23dac7b8990": "Read the last line of forward again: what does self.out_proj do there?",
}


@check("ANSWER_DRAFT_BUG: right prediction")
def check_answer_draft_bug(answer, *, seed: int = 0, device: torch.device | None = None) -> None:
    """The predict-first question on the einops draft's weights (the right letter is stored as its digest)."""
    expect_choice(answer, name="ANSWER_DRAFT_BUG", options="ABCD", correct_digest="63e17ec1140d89c4",
                  hints=DRAFT_BUG_HINTS)


freeze_module(__name__)
