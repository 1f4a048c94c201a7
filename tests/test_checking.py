"""Unit tests of the check framework (attention_lab.checking) and device selection."""

from __future__ import annotations

import math
import traceback

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import attention_lab
from attention_lab import checking
from attention_lab.checking import (
    CheckFailure,
    Variant,
    call_student,
    check,
    expect_array,
    expect_close,
    expect_signature,
    expect_tensor,
    from_scratch,
    math_sdpa_backend,
    pinned_numerics,
    reference_sdpa,
    tolerance,
    verify_untampered,
)

# --------------------------------------------------------------------------------------
# Device-independent verdicts (argued on the CPU; `make gpu-check` runs the checks on CUDA)
# --------------------------------------------------------------------------------------


def test_pinned_numerics_turns_tf32_off_and_restores_the_notebook_settings():
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("medium")
    try:
        with pinned_numerics():
            assert torch.backends.cuda.matmul.allow_tf32 is False
            assert torch.backends.cudnn.allow_tf32 is False
            assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.backends.cudnn.allow_tf32 is True
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("highest")


def test_reference_attention_runs_on_the_math_backend_only():
    with math_sdpa_backend():
        assert torch.backends.cuda.math_sdp_enabled()
        assert not torch.backends.cuda.flash_sdp_enabled()
        assert not torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()  # restored afterwards


def _round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """Keep 10 mantissa bits, as a TF32 tensor core does with matmul inputs."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(mantissa * 2**11) / 2**11, exponent)


def test_float32_tolerance_would_reject_tf32_matmuls_so_checks_must_pin_them_off():
    """Why TF32 must be off in checks: its rounding is outside the float32 budget.

    A correct answer computed with TF32 matmuls (as CUDA does by default for some ops on
    Ampere+) would be failed by the CUDA float32 tolerance; with full float32 it passes.
    """
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(64, 64, generator=generator, dtype=torch.float64)
    b = torch.randn(64, 64, generator=generator, dtype=torch.float64)
    exact = a @ b
    full_float32 = a.float() @ b.float()
    tf32 = _round_to_tf32(a.float()) @ _round_to_tf32(b.float())
    rtol, atol = tolerance(torch.float32, "cuda")
    assert torch.allclose(full_float32.double(), exact, rtol=rtol, atol=atol)
    assert not torch.allclose(tf32.double(), exact, rtol=rtol, atol=atol)


def test_tolerances_widen_with_lower_precision_and_on_cuda():
    order = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
    for device in ("cpu", "cuda"):
        atols = [tolerance(dtype, device)[1] for dtype in order]
        assert atols == sorted(atols)
    assert tolerance(torch.float32, "cuda")[1] >= tolerance(torch.float32, "cpu")[1]
    assert tolerance(np.float64) == tolerance(torch.float64)
    with pytest.raises(ValueError, match="no tolerance"):
        tolerance(torch.int64)


def test_every_tolerance_still_catches_a_missing_sqrt_d_scale():
    """The loosest budget (bf16) is far tighter than the error of a typical wrong answer."""
    generator = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 6, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    right = torch.softmax(q @ k.mT / 4.0, -1)
    wrong = torch.softmax(q @ k.mT, -1)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        rtol, atol = tolerance(dtype, "cuda")
        assert not torch.allclose(wrong, right, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------------------
# Contract helpers
# --------------------------------------------------------------------------------------


def test_expect_tensor_names_expected_and_actual_shape_without_broadcasting_slack():
    with pytest.raises(CheckFailure, match=r"should have shape \[6\], got \[1, 6\]"):
        expect_tensor(torch.zeros(1, 6), what="f(x)", shape=(6,))
    with pytest.raises(CheckFailure, match="same number of elements"):
        expect_tensor(torch.zeros(2, 3), what="f(x)", shape=(3, 2))
    with pytest.raises(CheckFailure, match="Likely mistake: forgot the permute"):
        expect_tensor(torch.zeros(2, 3), what="f(x)", shape=(3, 2), hints={(2, 3): "forgot the permute"})


def test_expect_tensor_checks_type_dtype_and_device():
    with pytest.raises(CheckFailure, match="should be a torch.Tensor, got ndarray"):
        expect_tensor(np.zeros(3), what="f(x)")
    with pytest.raises(CheckFailure, match="keep the input dtype torch.float64, got torch.float32"):
        expect_tensor(torch.zeros(3), what="f(x)", dtype=torch.float64)
    with pytest.raises(CheckFailure, match="should be on cpu like its inputs, got meta"):
        expect_tensor(torch.zeros(3, device="meta"), what="f(x)", device="cpu")


def test_expect_array_rejects_tensors_and_wrong_shapes():
    with pytest.raises(CheckFailure, match="got a torch tensor"):
        expect_array(torch.zeros(2), what="f(x)")
    with pytest.raises(CheckFailure, match=r"should have shape \[2, 3\], got \[3, 2\]"):
        expect_array(np.zeros((3, 2)), what="f(x)", shape=(2, 3))


def test_expect_close_reports_location_values_tolerance_and_likely_mistake():
    expected = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    actual = expected.clone()
    actual[1, 2] += 0.5
    with pytest.raises(CheckFailure) as failure:
        expect_close(actual, expected, what="f(x)", against="the reference",
                     variants=[Variant(expected * 2, "doubled"), Variant(actual.clone(), "off by half at the end")])
    message = str(failure.value)
    assert "1 of 6 values are off" in message
    assert "index (1, 2): got 5.5, expected 5" in message
    assert "atol=1e-09" in message
    assert "Likely mistake: off by half at the end" in message


def test_expect_close_flags_nan_and_accepts_matching_infinities():
    expected = torch.tensor([0.5, float("-inf")], dtype=torch.float64)
    assert expect_close(expected.clone(), expected, what="f", against="g") == 0.0
    with pytest.raises(CheckFailure, match="contains NaN"):
        expect_close(torch.tensor([float("nan"), float("-inf")], dtype=torch.float64), expected, what="f", against="g")


def test_expect_close_uses_the_tolerance_of_the_answers_dtype():
    expected = torch.ones(4, dtype=torch.float64)
    slightly_off = expected + 1e-6
    expect_close(slightly_off.float(), expected, what="f", against="g")  # within float32's budget
    with pytest.raises(CheckFailure):
        expect_close(slightly_off, expected, what="f", against="g", float64_internals=True)  # outside float64's


# --------------------------------------------------------------------------------------
# Precision policy: float32 internals on float64 input
# --------------------------------------------------------------------------------------


def _rms_norm_in_float32(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm idiom: compute in float32, cast back to the input's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x)


def _rms_norm_reference(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _float64_input() -> torch.Tensor:
    return torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)


def test_float32_internals_on_float64_input_pass_with_one_note_per_check(capsys):
    x = _float64_input()
    answer = _rms_norm_in_float32(x)
    assert answer.dtype == torch.float64
    assert not torch.allclose(answer, _rms_norm_reference(x), rtol=1e-7, atol=1e-9)  # really float32-accurate only

    @check("rms demo ({device})")
    def check_rms(rms, *, seed=0, device=None):
        for _ in range(3):  # three comparisons, one note
            expect_close(rms(x), _rms_norm_reference(x), what="rms(x)", against="the reference")

    check_rms(_rms_norm_in_float32, device="cpu")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "✓ rms demo (cpu)"
    assert len(lines) == 2 and lines[1].startswith("  note: rms(x) is accurate to float32 precision"), lines
    assert "fine here" in lines[1]
    check_rms(_rms_norm_in_float32, device="cpu", quiet=True)
    assert capsys.readouterr().out == ""
    check_rms(_rms_norm_reference, device="cpu")  # float64 all the way: no note
    assert capsys.readouterr().out == "✓ rms demo (cpu)\n"


def test_float64_internals_rejects_the_downcast_and_names_it():
    x = _float64_input()
    with pytest.raises(CheckFailure) as failure:
        expect_close(_rms_norm_in_float32(x), _rms_norm_reference(x), what="rms(x)", against="the reference",
                     float64_internals=True)
    message = str(failure.value)
    assert "only to float32 precision, not float64" in message
    assert "Likely mistake: " + checking.HINTS["downcast"] in message
    assert ".type_as(x)" in message and "keep float64" in message
    expect_close(_rms_norm_reference(x), _rms_norm_reference(x), what="rms(x)", against="the reference",
                 float64_internals=True)


def test_precision_policy_applies_to_numpy_float64_output_too(capsys):
    x = _float64_input().numpy()
    reference = x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True))
    via_float32 = (x.astype(np.float32) / np.sqrt(np.mean(x.astype(np.float32) ** 2, axis=-1, keepdims=True))).astype(np.float64)
    assert not np.allclose(via_float32, reference, rtol=1e-7, atol=1e-9)
    expect_close(via_float32, reference, what="f(x)", against="g")
    assert "accurate to float32 precision" in capsys.readouterr().out
    with pytest.raises(CheckFailure, match="only to float32 precision"):
        expect_close(via_float32, reference, what="f(x)", against="g", float64_internals=True)


def test_precision_leniency_never_lets_a_wrong_float64_answer_through():
    x = _float64_input()
    wrong = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)  # L2 instead of RMS: off by far more than 1e-1
    with pytest.raises(CheckFailure, match="does not match the reference") as failure:
        expect_close(wrong, _rms_norm_reference(x), what="rms(x)", against="the reference",
                     variants=[Variant(wrong.clone(), "sum instead of mean")])
    assert "Likely mistake: sum instead of mean" in str(failure.value)
    # An explicit float32 budget for this comparison (e.g. angles that grow with position) is honoured.
    slightly_off = _rms_norm_reference(x) + 5e-4
    with pytest.raises(CheckFailure):
        expect_close(slightly_off, _rms_norm_reference(x), what="rms(x)", against="the reference")
    expect_close(slightly_off, _rms_norm_reference(x), what="rms(x)", against="the reference",
                 float32_tolerance=(0.0, 1e-3))


# --------------------------------------------------------------------------------------
# Numbers in messages
# --------------------------------------------------------------------------------------


def test_failure_shows_enough_digits_to_see_the_difference_and_the_relative_error():
    expected = torch.tensor([0.03706965], dtype=torch.float64)
    actual = torch.tensor([0.03706972], dtype=torch.float64)
    with pytest.raises(CheckFailure) as failure:
        expect_close(actual, expected, what="w", against="the reference", rtol=1e-7, atol=1e-9, float64_internals=True)
    assert "only to float32 precision" in str(failure.value)  # 7e-8 off: float32-accurate
    far = torch.tensor([0.0370697 + 3e-4], dtype=torch.float64)
    with pytest.raises(CheckFailure) as failure:
        expect_close(far.float(), expected, what="w", against="the reference")
    message = str(failure.value)
    assert ("got 0.0373697, expected 0.0370697 (difference 0.0003, relative 0.0081; "
            "tolerance atol=1e-05, rtol=0.0001)") in message, message


def test_describe_difference_uses_the_fewest_digits_that_tell_the_values_apart():
    assert checking.describe_difference(0.03706972, 0.03706965, 1e-7, 1e-9) == (
        "got 0.03706972, expected 0.03706965 (difference 7e-08, relative 1.9e-06; tolerance atol=1e-09, rtol=1e-07)")
    assert checking.describe_difference(5.5, 5.0, 1e-7, 1e-9).startswith("got 5.5, expected 5 (difference 0.5, relative 0.1;")
    assert checking.describe_difference(1.0, 0.0, 0, 1e-5) == "got 1, expected 0 (difference 1; tolerance atol=1e-05, rtol=0)"
    assert checking.describe_difference(float("nan"), 1.0, 0, 1e-5) == "got nan, expected 1 (tolerance atol=1e-05, rtol=0)"


# --------------------------------------------------------------------------------------
# Diagnosis never names a variant that equals the right answer on this input
# --------------------------------------------------------------------------------------


def test_diagnosis_skips_variants_that_coincide_with_the_reference():
    expected = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    # Outside the tolerance (0.2 > 0.05 * 3), but inside the 10x looser band used to match variants.
    slightly_wrong = torch.tensor([1.0, 2.0, 3.2], dtype=torch.float64)
    # "cache ignored" equals the truth on this input (nothing cached yet): it says nothing about the answer.
    coincides = Variant(expected.clone(), "cache ignored")
    assert checking.diagnose(slightly_wrong, [coincides], rtol=0.05, atol=0.0) == "cache ignored"  # without expected
    assert checking.diagnose(slightly_wrong, [coincides], rtol=0.05, atol=0.0, expected=expected) is None
    with pytest.raises(CheckFailure) as failure:
        expect_close(slightly_wrong, expected, what="f", against="g", rtol=0.05, atol=0.0, variants=[coincides])
    assert "Likely mistake" not in str(failure.value)
    # A variant that differs from the truth is still named after a coinciding one is skipped.
    wrong = torch.tensor([1.0, 2.0, 6.0], dtype=torch.float64)
    with pytest.raises(CheckFailure) as failure:
        expect_close(wrong, expected, what="f", against="g", rtol=0.05, atol=0.0,
                     variants=[coincides, Variant(wrong.clone(), "last value doubled")])
    assert "Likely mistake: last value doubled" in str(failure.value)


def test_expect_signature_requires_the_contract_parameter_names():
    expect_signature(lambda x, num_heads, extra=1: None, "f", ["x", "num_heads"])
    with pytest.raises(CheckFailure, match=r"should take the parameters \(x, num_heads\), but it takes \(x\)"):
        expect_signature(lambda x: None, "f", ["x", "num_heads"])
    with pytest.raises(CheckFailure, match="should be a function or class, got None"):
        expect_signature(None, "f", ["x"])


def test_call_student_turns_errors_into_messages_that_name_the_call():
    def blank(x):
        raise NotImplementedError("Exercise 9.9: implement f")

    with pytest.raises(CheckFailure, match=r"f\(x\) with x \[2\]: not implemented yet \(Exercise 9.9"):
        call_student(blank, 1, call="f(x) with x [2]")

    def buggy(x):
        return x @ torch.zeros(3, 4)

    with pytest.raises(CheckFailure, match=r"f\(x\) raised RuntimeError"):
        call_student(buggy, torch.zeros(2, 2), call="f(x)")


def test_a_failed_call_frees_what_the_answer_held_and_still_shows_its_line():
    """An answer that filled the memory until MemoryError: the failure (which IPython keeps as
    the last error) shows the student's line but no longer holds the list, so the next cells
    have their memory back (a 3 GB kernel then failed every later test with MemoryError)."""
    import weakref

    held = []

    class Block:
        pass

    def hog(x):
        blocks = [Block()]
        held.append(weakref.ref(blocks[0]))
        raise MemoryError

    with pytest.raises(CheckFailure, match=r"f\(x\) raised MemoryError") as failure:
        call_student(hog, torch.zeros(2), call="f(x)")
    assert held[0]() is None, "the failure still holds what the answer allocated"
    lines = [frame.line for frame in traceback.extract_tb(failure.value.__cause__.__traceback__)]
    assert "raise MemoryError" in lines, lines


def test_call_student_names_the_dtype_rule_when_float32_meets_float64():
    def float32_weight(x):  # an answer that builds a float32 tensor inside a float64 computation
        return x @ torch.ones(x.shape[-1], 2)

    def float32_layer_norm(x):
        return F.layer_norm(x, x.shape[-1:], torch.ones(x.shape[-1]))

    def float32_module(x):
        return nn.Linear(x.shape[-1], 2)(x)

    x = torch.randn(3, 4, dtype=torch.float64)
    for answer in (float32_weight, float32_layer_norm, float32_module):
        with pytest.raises(CheckFailure, match=r"raised RuntimeError[\s\S]*Likely mistake: your code mixes float32 "
                                               r"and float64[\s\S]*keep the input's dtype") as failure:
            call_student(answer, x, call="f(x)")
        assert isinstance(failure.value.__cause__, RuntimeError)  # the original error stays the cause
    with pytest.raises(CheckFailure) as failure:  # a shape error is not a dtype error
        call_student(lambda x: x @ torch.ones(5, 2, dtype=torch.float64), x, call="f(x)")
    assert "float32" not in str(failure.value)


def test_expect_tensor_names_the_dtype_rule_and_why_the_checks_use_float64():
    with pytest.raises(CheckFailure, match=r"got torch.float32.\n  The rule of every notebook: an answer returns the "
                                           r"dtype it was given[\s\S]*float32 rounding would hide"):
        expect_tensor(torch.zeros(3), what="f(x)", dtype=torch.float64)


def test_expect_array_gives_its_dtype_hint_a_line_of_its_own():
    with pytest.raises(CheckFailure, match=r"got float64.\n  Likely mistake: keep float32: no np.float64"):
        expect_array(np.zeros(3), what="f(x)", dtype=np.float32, dtype_hint="keep float32: no np.float64")


@pytest.mark.parametrize("answer, operation", [
    (lambda q, k: (q.mul_(2.0), q @ k.T)[1], r"`q \*= ...` \(or `q.mul_\(...\)`\)"),
    (lambda q, k: (q.__imul__(2.0), q @ k.T)[1], r"`q \*= ...`"),
    (lambda q, k: (k.masked_fill_(k > 0, 0.0), q @ k.T)[1], r"`k.masked_fill_\(...\)` changed k in place"),
    (lambda q, k: (k.__iadd__(1.0), q @ k.T)[1], r"`k \+= ...`"),
    (lambda q, k: (q.__setitem__((0, 0), 1.0), q @ k.T)[1], r"`q\[...\] = ...`"),
    (lambda q, k: (torch.exp(q, out=q), q @ k.T)[1], r"`out=q` in exp"),
    (lambda q, k: (q[:, :1].mul_(3.0), q @ k.T)[1], r"`q \*= ...`"),  # through a view of q
])
def test_call_student_fails_an_answer_that_changes_its_input_in_place(answer, operation):
    def f(q, k):
        return answer(q, k)

    q, k = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(CheckFailure, match=r"f\(q, k\): your code changed its input [qk] in place[\s\S]*Likely mistake: "
                                           + operation) as failure:
        call_student(f, q, k, call="f(q, k)")
    assert "modified its input in place" in str(failure.value)


def test_call_student_checks_arrays_and_tensors_inside_tuples_and_can_be_told_not_to():
    def scale_array(x):
        x *= 2.0
        return x.sum()

    with pytest.raises(CheckFailure, match=r"changed its input x in place[\s\S]*`np.exp\(x, out=x\)`"):
        call_student(scale_array, np.ones(3), call="f(x)")

    def bump_second(pair):
        pair[1].add_(1.0)
        return pair[0]

    with pytest.raises(CheckFailure, match=r"changed its input pair\[1\] in place[\s\S]*`pair\[1\] \+= ...`"):
        call_student(bump_second, (torch.zeros(2), torch.zeros(2)), call="f(pair)")
    state = torch.zeros(2)
    assert call_student(bump_second, (state, state.clone()), call="f(pair)", inputs_unchanged=False) is state

    def accumulate(total, increment):  # updated in place and handed back in its own position: the exercise decides
        total.add_(increment)
        return total, increment.sum()

    assert call_student(accumulate, state, torch.ones(2), call="f(total, increment)")[0] is state

    def moved_to_another_position(total, increment):
        increment.mul_(2.0)
        return increment, total

    with pytest.raises(CheckFailure, match=r"changed its input increment in place"):
        call_student(moved_to_another_position, torch.zeros(2), torch.ones(2), call="f(total, increment)")

    def fresh(x):  # in-place work on a tensor of its own is fine, NaN inputs too
        y = x.clone()
        y.mul_(2.0)
        return y

    call_student(fresh, torch.tensor([1.0, float("nan")]), call="f(x)")


# --------------------------------------------------------------------------------------
# From-scratch guard
# --------------------------------------------------------------------------------------


def test_from_scratch_catches_the_builtin_however_it_was_imported():
    from torch.nn.functional import scaled_dot_product_attention as renamed

    q = torch.randn(1, 2, 3, 4)
    forbidden = ("scaled_dot_product_attention", "multi_head_attention_forward", "rms_norm")
    for call in (lambda: renamed(q, q, q), lambda: F.scaled_dot_product_attention(q, q, q),
                 lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q)):
        with pytest.raises(CheckFailure, match="from-scratch exercise.*scaled_dot_product_attention"):
            with from_scratch("attention", forbidden):
                call()
    with pytest.raises(CheckFailure, match="multi_head_attention_forward"):
        with from_scratch("attention", forbidden):
            mha = nn.MultiheadAttention(4, 2, batch_first=True)
            mha(q[0], q[0], q[0])
    with pytest.raises(CheckFailure, match="rms_norm"):
        with from_scratch("qk_norm", forbidden):
            nn.RMSNorm(4)(q)
    with from_scratch("attention", forbidden):  # ordinary operations are fine
        torch.softmax(q @ q.mT / 2.0, dim=-1)


def test_numpy_only_rejects_any_torch_call_and_allows_numpy():
    with from_scratch("np_softmax", numpy_only=True):
        np.exp(np.ones(3)).sum()
    with pytest.raises(CheckFailure, match="must be written with NumPy only.*called torch"):
        with from_scratch("np_softmax", numpy_only=True):
            torch.softmax(torch.as_tensor(np.ones(3)), dim=0).numpy()


# --------------------------------------------------------------------------------------
# Tamper protection
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("namespace, attribute", [
    (torch, "allclose"),
    (F, "scaled_dot_product_attention"),
    (torch.testing, "assert_close"),
    (np, "allclose"),
    (nn.MultiheadAttention, "forward"),
    (torch.Tensor, "__rsub__"),
    (math, "isclose"),
])
def test_replacing_a_library_function_fails_the_next_check_and_is_undone(namespace, attribute):
    original = vars(namespace)[attribute]
    setattr(namespace, attribute, lambda *args, **kwargs: True)
    try:
        with pytest.raises(CheckFailure, match=f"replaced library functions.*{attribute}"):
            verify_untampered()
        assert vars(namespace)[attribute] is original
    finally:
        setattr(namespace, attribute, original)
    verify_untampered()  # clean again


def test_adding_an_operator_override_to_tensor_is_caught_and_removed():
    """`torch.Tensor.__sub__ = ...` shadows the C implementation from the Python class."""
    torch.Tensor.__sub__ = lambda self, other: torch.zeros(())
    try:
        with pytest.raises(CheckFailure, match="replaced library functions.*torch.Tensor.__sub__"):
            verify_untampered()
        assert "__sub__" not in vars(torch.Tensor)
        assert float(torch.ones(()) - torch.ones(())) == 0.0 and float(torch.full((), 3.0) - 1) == 2.0
    finally:
        vars(torch.Tensor).get("__sub__") and delattr(torch.Tensor, "__sub__")


def test_check_modules_are_read_only():
    from attention_lab.checks import mha_shapes

    real = mha_shapes.check_split_heads
    with pytest.raises(AttributeError, match="read-only"):
        mha_shapes.check_split_heads = lambda *args, **kwargs: None
    with pytest.raises(AttributeError, match="read-only"):
        del mha_shapes.check_split_heads
    with pytest.raises(AttributeError, match="read-only"):
        checking_module = __import__("attention_lab.checks.mha_shapes", fromlist=["x"])
        setattr(checking_module, "expect_close", None)
    assert mha_shapes.check_split_heads is real


def test_an_answer_cell_rebinding_a_check_name_cannot_pass_the_test_cell():
    """The test cell imports the check itself, so a rebinding in the notebook is overridden."""
    namespace = {"__name__": "notebook"}
    exec("check_split_heads = lambda *a, **k: None\n"
         "def split_heads(x, num_heads):\n"
         "    return x\n", namespace)
    with pytest.raises(CheckFailure):
        exec("from attention_lab.checks.mha_shapes import check_split_heads\n"
             "check_split_heads(split_heads, device='cpu', quiet=True)", namespace)


# --------------------------------------------------------------------------------------
# The check wrapper
# --------------------------------------------------------------------------------------


def test_check_wrapper_prints_one_line_and_leaves_the_notebook_rng_alone(capsys):
    @check("demo check on {device}")
    def check_demo(answer, *, seed=0, device=None):
        torch.randn(100)  # a check's own draws must not move the notebook's generator
        answer()

    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    check_demo(lambda: torch.rand(5), device="cpu")
    assert torch.rand(1) == expected_next
    assert capsys.readouterr().out == "✓ demo check on cpu\n"
    check_demo(lambda: None, device="cpu", quiet=True)
    assert capsys.readouterr().out == ""


def test_check_wrapper_pins_numerics_while_the_check_runs():
    seen = {}

    @check("ok")
    def check_flags(answer, *, seed=0, device=None):
        seen["tf32"] = torch.backends.cuda.matmul.allow_tf32
        seen["precision"] = torch.get_float32_matmul_precision()

    torch.set_float32_matmul_precision("medium")
    try:
        check_flags(None, device="cpu", quiet=True)
    finally:
        torch.set_float32_matmul_precision("highest")
    assert seen == {"tf32": False, "precision": "highest"}


# --------------------------------------------------------------------------------------
# Dependencies: a failure names the student's earlier answer it is built on, if that is wrong
# --------------------------------------------------------------------------------------

_HELPERS = {
    "right": ("def split_heads(x, num_heads):\n"
              "    if x.shape[-1] % num_heads:\n"
              "        raise ValueError(f'D={x.shape[-1]} is not divisible by H={num_heads}')\n"
              "    return x.unflatten(-1, (num_heads, -1)).transpose(1, 2)\n"),
    "wrong": ("def split_heads(x, num_heads):\n"  # the classic: reshape without the transpose
              "    if x.shape[-1] % num_heads:\n"
              "        raise ValueError(f'D={x.shape[-1]} is not divisible by H={num_heads}')\n"
              "    b, s, d = x.shape\n"
              "    return x.reshape(b, num_heads, s, d // num_heads)\n"),
}
# The answer uses the notebook's split_heads; a wrong helper makes it wrong.
_HEAD_MEANS = ("def head_means(x, num_heads):\n"
               "    return split_heads(x, num_heads).mean(dim=-1)\n")
_HEAD_MEANS_CLASS = ("class HeadMeans:\n"
                     "    def __call__(self, x, num_heads):\n"
                     "        return split_heads(x, num_heads).mean(dim=-1)\n")


# The notes run the helper's own check, found in the registry that importing its module fills: this
# module must not depend on another test having imported it first (with pytest-xdist it may not have).
from attention_lab.checks import mha_shapes as _registers_check_split_heads  # noqa: E402,F401


@check("head_means ({device})", uses=("split_heads", "merge_heads"))
def check_head_means(head_means, *, seed=0, device=None):
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    expected = x.unflatten(-1, (4, 2)).transpose(1, 2).mean(-1)  # [B, H, S]
    got = call_student(head_means, x, 4, call="head_means(x, 4)")
    expect_close(got, expected, what="head_means(x, 4)", against="the mean of each head's features")


def _notebook(*cells: str) -> dict:
    """Run cells as a notebook would: one global namespace of its own."""
    namespace = {"__name__": "__main__"}
    for cell in cells:
        exec(cell, namespace)
    return namespace


def test_a_failure_names_the_students_helper_that_fails_its_own_check():
    notebook = _notebook(_HELPERS["wrong"], _HEAD_MEANS)
    with pytest.raises(CheckFailure) as failure:
        check_head_means(notebook["head_means"], device="cpu", quiet=True)
    message = str(failure.value)
    assert message.startswith("head_means(x, 4) does not match the mean of each head's features")
    assert "Note: this exercise uses your split_heads, which fails its own check (split_heads(x" in message
    assert message.endswith("Fix split_heads first.")
    assert "merge_heads" not in message  # not defined in this notebook: nothing said


def test_a_class_answer_finds_the_helpers_of_its_own_notebook():
    notebook = _notebook(_HELPERS["wrong"], _HEAD_MEANS_CLASS)
    with pytest.raises(CheckFailure, match="uses your split_heads, which fails its own check"):
        check_head_means(notebook["HeadMeans"](), device="cpu", quiet=True)
    with pytest.raises(CheckFailure) as failure:  # the class itself: HeadMeans(x, 4) fails before any helper runs
        check_head_means(notebook["HeadMeans"], device="cpu", quiet=True)
    assert "raised TypeError" in str(failure.value) and "Note:" not in str(failure.value)


def test_no_note_about_a_helper_the_answer_never_called():
    """A self-contained answer that fails is not told to fix a wrong helper it does not use."""
    notebook = _notebook(_HELPERS["wrong"], "def head_means(x, num_heads):\n"
                                            "    return x.unflatten(-1, (num_heads, -1)).transpose(1, 2).sum(-1)\n")
    with pytest.raises(CheckFailure) as failure:
        check_head_means(notebook["head_means"], device="cpu", quiet=True)
    assert "does not match" in str(failure.value) and "Note:" not in str(failure.value)
    # A class answer (an nn.Module) that calls the wrong helper from its forward is told; one that does not, is not.
    module_cells = ("class HeadMeans(nn.Module):\n"
                    "    def forward(self, x, num_heads):\n"
                    "        return {body}\n")
    calls_helper = _notebook("import torch.nn as nn\n", _HELPERS["wrong"],
                             module_cells.format(body="split_heads(x, num_heads).mean(-1)"))
    with pytest.raises(CheckFailure, match="uses your split_heads, which fails its own check"):
        check_head_means(calls_helper["HeadMeans"](), device="cpu", quiet=True)
    self_contained = _notebook("import torch.nn as nn\n", _HELPERS["wrong"],
                               module_cells.format(body="x.unflatten(-1, (num_heads, -1)).transpose(1, 2).sum(-1)"))
    with pytest.raises(CheckFailure) as failure:
        check_head_means(self_contained["HeadMeans"](), device="cpu", quiet=True)
    assert "Note:" not in str(failure.value)


def test_call_tracing_restores_the_previous_profiler():
    import sys

    seen = []

    def profiler(frame, event, arg):
        if event == "call":
            seen.append(frame.f_code.co_name)

    notebook = _notebook(_HELPERS["wrong"], _HEAD_MEANS)
    sys.setprofile(profiler)
    try:
        with pytest.raises(CheckFailure, match="Fix split_heads first"):
            check_head_means(notebook["head_means"], device="cpu", quiet=True)
        assert sys.getprofile() is profiler
    finally:
        sys.setprofile(None)
    assert "split_heads" in seen  # the notebook's own profiler still saw the calls


def test_a_check_run_under_prun_passes_and_the_profiler_goes_on_after_it():
    """IPython's %prun runs a cell under cProfile, whose Profile object sys.getprofile returns and
    which cannot be called as a profile function: chaining to it failed every check that traces the
    answer's helpers or its einops calls (TypeError: 'Profile' object is not callable, a traceback
    from the package). The checks pass under it, and cProfile profiles again once they are done."""
    import cProfile
    import pstats
    import sys

    from attention_lab.checks.mha_shapes import check_split_heads_einops

    notebook = _notebook(_HELPERS["wrong"], _HEAD_MEANS, "import einops\n"
                         "def split_heads_einops(x, num_heads):\n"
                         "    if x.shape[-1] % num_heads:\n"
                         "        raise ValueError(f'D = {x.shape[-1]} is not divisible by {num_heads} heads')\n"
                         "    return einops.rearrange(x, 'b s (h d) -> b h s d', h=num_heads)\n"
                         "def after_the_checks():\n"
                         "    return 0\n")

    def cell():
        with pytest.raises(CheckFailure, match="Fix split_heads first"):
            check_head_means(notebook["head_means"], device="cpu", quiet=True)
        check_split_heads_einops(notebook["split_heads_einops"], device="cpu", quiet=True)
        notebook["after_the_checks"]()

    profiler = cProfile.Profile()
    profiler.runcall(cell)
    assert sys.getprofile() is None
    assert "after_the_checks" in {function for _, _, function in pstats.Stats(profiler).stats}


def test_a_check_stops_watching_the_answer_once_there_is_nothing_left_to_record():
    """Call tracing (a profiler) and the from-scratch tripwire (a torch function mode) see every call
    and every tensor operation of the answer: under them a training check ran twice as slow. Tracing
    stops once every helper it looks for has been seen; the tripwire is only set when a function is
    forbidden or an input is watched."""
    import sys

    @check("loop ({device})", uses=("split_heads",))
    def check_loop(loop, *, seed=0, device=None, forbidden=()):
        call_student(loop, call="loop()", forbidden=forbidden)

    notebook = _notebook(_HELPERS["right"], "import sys, torch\n"
                         "def loop():\n"
                         "    seen.append((sys.getprofile() is not None, torch._C._is_torch_function_mode_enabled()))\n"
                         "    split_heads(torch.zeros(1, 2, 4), 2)\n"
                         "    seen.append((sys.getprofile() is not None, torch._C._is_torch_function_mode_enabled()))\n")
    notebook["seen"] = seen = []
    check_loop(notebook["loop"], device="cpu", quiet=True)
    assert seen == [(True, False), (False, False)]  # traced until split_heads ran; no tripwire at all
    assert sys.getprofile() is None
    seen.clear()
    check_loop(notebook["loop"], device="cpu", quiet=True, forbidden=("softmax",))
    assert seen == [(True, True), (False, True)]  # something forbidden: the tripwire watches throughout


def test_no_note_when_the_helper_is_right_or_missing_or_the_answer_is_blank():
    right_helper = _notebook(_HELPERS["right"], "def head_means(x, num_heads):\n    return split_heads(x, num_heads).sum(-1)\n")
    with pytest.raises(CheckFailure) as failure:
        check_head_means(right_helper["head_means"], device="cpu", quiet=True)
    assert "Note:" not in str(failure.value)
    no_helper = _notebook("def head_means(x, num_heads):\n    return x.reshape(2, 4, 3, 2).mean(-1)\n")
    with pytest.raises(CheckFailure) as failure:
        check_head_means(no_helper["head_means"], device="cpu", quiet=True)
    assert "Note:" not in str(failure.value)
    blank = _notebook(_HELPERS["wrong"], "def head_means(x, num_heads):\n    raise NotImplementedError('Exercise')\n")
    with pytest.raises(CheckFailure) as failure:
        check_head_means(blank["head_means"], device="cpu", quiet=True)
    assert "not implemented yet" in str(failure.value) and "Note:" not in str(failure.value)
    check_head_means(_notebook(_HELPERS["right"], _HEAD_MEANS)["head_means"], device="cpu", quiet=True)  # passes


def test_dependency_checks_do_not_recurse():
    """A helper whose own check uses the failing answer must not start an endless chain."""
    runs = []

    @check("ping ({device})", uses=("pong",))
    def check_ping(ping, *, seed=0, device=None):
        runs.append("ping")
        ping()  # calls pong, which calls ping
        raise CheckFailure("ping is wrong")

    @check("pong ({device})", uses=("ping",))
    def check_pong(pong, *, seed=0, device=None):
        runs.append("pong")
        pong()
        raise CheckFailure("pong is wrong")

    notebook = _notebook("def ping(n=2):\n    return pong(n - 1) if n > 0 else 0\n",
                         "def pong(n=2):\n    return ping(n - 1) if n > 0 else 0\n")
    with pytest.raises(CheckFailure) as failure:
        check_ping(notebook["ping"], device="cpu", quiet=True)
    assert runs == ["ping", "pong"]
    assert str(failure.value) == "ping is wrong\nNote: this exercise uses your pong, which fails its own check (pong is wrong). Fix pong first."


def test_checks_are_registered_by_the_name_of_the_answer_they_take():
    from attention_lab.checks import mha_shapes

    registry = checking.registered_checks()
    assert mha_shapes.check_split_heads in registry["split_heads"]
    assert check_head_means in registry["head_means"] and check_head_means.uses == ("split_heads", "merge_heads")
    with pytest.raises(TypeError, match="sequence of names"):
        check("x", uses="split_heads")


def test_reference_sdpa_is_the_untampered_builtin():
    q = torch.randn(1, 1, 3, 4, dtype=torch.float64)
    # The CPU's default kernel and the math backend agree to rounding, not bit for bit.
    assert torch.allclose(reference_sdpa(q, q, q), F.scaled_dot_product_attention(q, q, q), rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------
# Device selection
# --------------------------------------------------------------------------------------


def test_pick_device_prefers_cuda_only_when_available(monkeypatch):
    monkeypatch.delenv(attention_lab.device.DEVICE_ENV_VAR, raising=False)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert attention_lab.pick_device().type == expected
    monkeypatch.setenv(attention_lab.device.DEVICE_ENV_VAR, "cpu")
    assert attention_lab.pick_device().type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            attention_lab.pick_device("cuda")


def test_setup_seeds_and_prints_the_environment(capsys):
    device = attention_lab.setup(seed=7, preferred="cpu")
    first = torch.rand(1)
    attention_lab.setup(seed=7, preferred="cpu", verbose=False)
    assert torch.rand(1) == first
    line = capsys.readouterr().out
    assert device.type == "cpu"
    assert f"torch {torch.__version__}" in line and "device: CPU" in line


def test_the_snapshot_is_taken_by_the_setup_cell_before_any_answer_cell():
    """`import attention_lab` (the setup cell) loads the checks' snapshot; an answer cell that
    replaces torch.allclose afterwards is caught by the first check."""
    import subprocess
    import sys

    program = ("import attention_lab, sys, torch\n"
               "assert 'attention_lab.checking' in sys.modules\n"
               "torch.allclose = lambda *a, **k: True\n"
               "from attention_lab.checks.mha_shapes import check_answer_draft_bug\n"
               "try:\n"
               "    check_answer_draft_bug('B', device='cpu')\n"
               "except AssertionError as failure:\n"
               "    print('caught:', failure)\n")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert "caught: Your notebook replaced library functions that the checks rely on: torch.allclose" in result.stdout, \
        result.stdout + result.stderr


def test_pytorchs_own_lazy_wrapper_of_manual_seed_is_not_tampering_but_a_fake_is():
    original = vars(torch)["manual_seed"]
    snapshot_entry = next(i for i, (ns, attr, _) in enumerate(checking._SNAPSHOT) if ns is torch and attr == "manual_seed")
    expected = checking._SNAPSHOT[snapshot_entry]
    try:
        def fake(seed):
            return None

        torch.manual_seed = fake
        with pytest.raises(CheckFailure, match="torch.manual_seed"):
            verify_untampered()
    finally:
        torch.manual_seed = original
        checking._SNAPSHOT[snapshot_entry] = expected


def test_ordinary_library_use_in_a_notebook_does_not_look_like_tampering():
    """Lazy imports inside PyTorch (an optimizer pulls in torch._dynamo) must not trip the guard."""
    model = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True, norm_first=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = model(torch.randn(2, 3, 8)).pow(2).mean()
    loss.backward()
    optimizer.step()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    q = torch.randn(1, 4, 3, 8)
    F.scaled_dot_product_attention(q, q[:, :2], q[:, :2], enable_gqa=True, is_causal=True)
    torch.manual_seed(0)
    verify_untampered()


# --------------------------------------------------------------------------------------
# No warnings from the framework itself
# --------------------------------------------------------------------------------------


def test_comparisons_accept_read_only_arrays_and_complex_values_without_a_warning():
    import warnings

    expected = np.arange(6.0).reshape(2, 3)
    read_only = np.broadcast_to(np.arange(3.0), (2, 3))  # a view NumPy marks read-only
    table = torch.polar(torch.ones(3, dtype=torch.float64), torch.arange(3, dtype=torch.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        expect_close(read_only, np.broadcast_to(np.arange(3.0), (2, 3)), what="f", against="g")
        with pytest.raises(CheckFailure, match="does not match"):
            expect_close(read_only, expected, what="f", against="g")
        expect_close(table.to(torch.complex64), table, what="table", against="exp(i p)")
        with pytest.raises(CheckFailure, match=r"2 of 6 values are off"):  # the imaginary parts are compared too
            expect_close(table.conj().resolve_conj(), table, what="table", against="exp(i p)")
    assert tolerance(torch.complex64) == tolerance(torch.float32)


def test_a_wrong_float64_answer_computed_in_float32_keeps_its_hint():
    """The precision policy accepts float32 internals on float64 input, so a *wrong* answer
    written that way is matched to its known mistake at float32's precision too."""
    generator = checking.random_generator(0)
    scores = checking.randn(4, 6, generator=generator)
    expected = torch.softmax(scores, dim=-1)
    wrong_axis = torch.softmax(scores, dim=0)
    # float32 internals over a longer computation: off by a few 1e-6 relative, like float32 sums
    computed_in_float32 = wrong_axis * (1 + 5e-6)
    assert not torch.allclose(computed_in_float32, wrong_axis, rtol=1e-6, atol=1e-8)  # float64's band misses it
    with pytest.raises(CheckFailure, match="Likely mistake: softmax over the wrong axis"):
        expect_close(computed_in_float32, expected, what="weights", against="softmax",
                     variants=[Variant(wrong_axis, "softmax over the wrong axis")])


def test_a_plural_subject_gets_a_plural_verb():
    with pytest.raises(CheckFailure, match=r"^the losses returned by f\(\) do not match a reference run: "):
        expect_close([1.0, 2.0], [1.0, 3.0], what="the losses returned by f()", against="a reference run")
    with pytest.raises(CheckFailure, match=r"^the class token does not match"):
        expect_close([1.0], [2.0], what="the class token", against="x")


# --------------------------------------------------------------------------------------
# What a number is (issue #52: np.int64(4608) was "not a number")
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, number, integer", [
    (4608, True, True), (4608.0, True, False), (np.int64(4608), True, True), (np.int8(3), True, True),
    (np.uint16(3), True, True), (np.float32(2.5), True, False), (np.float64(2.5), True, False),
    (True, False, False), (np.True_, False, False), (torch.tensor(3), False, False), ("4608", False, False),
    (None, False, False), (np.array(3), False, False), (1 + 2j, False, False),
])
def test_numpy_scalars_are_numbers_and_integers_where_python_numbers_are(value, number, integer):
    assert checking.is_number(value) is number and checking.is_integer(value) is integer
