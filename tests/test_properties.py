"""Properties that must hold for every size and every seed, not just the ones a test picked.

Hypothesis draws the sizes, magnitudes and seeds. Two kinds of property:

* the check framework's comparison: within tolerance always passes, well outside always
  fails, whatever the shape, dtype or magnitude; a known wrong variant is always named;
* the checks at any seed: nbgrader's hidden tests call the same checks with other seeds,
  so a correct answer written another way must pass, and a known mistake must be named,
  at every seed, not only at the seeds the notebook shows.

Examples are derandomized so a failure in CI reproduces from the log, and have no deadline
because the suite runs on a loaded 2-core machine.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_lab.checking import (
    CheckFailure, Variant, diagnose, expect_close, randint, randn, random_generator, tolerance,
)
from attention_lab.checks import mha_shapes as checks
from tests.test_checks_mha_shapes import (
    merge_heads_flatten, merge_heads_reshape_only, split_heads_reshape_only, split_heads_strided,
    split_heads_unflatten, weights_einsum, weights_no_scale,
)

PROPERTY = settings(max_examples=25, deadline=None, derandomize=True)
CHECK_AT_ANY_SEED = settings(max_examples=8, deadline=None, derandomize=True)

seeds = st.integers(min_value=0, max_value=2**31 - 1)
shapes = st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=4).map(tuple)
float_dtypes = st.sampled_from([torch.float64, torch.float32])
# How large the values are: the relative part of the tolerance must scale with them.
magnitudes = st.sampled_from([1e-3, 1.0, 1e3])


def _case(seed: int, shape: tuple[int, ...], magnitude: float):
    """A float64 reference and a random position in it."""
    generator = random_generator(seed)
    expected = randn(*shape, generator=generator) * magnitude
    position = tuple(randint(0, size - 1, generator) for size in shape)
    return expected, position


def _nudged(expected: torch.Tensor, position: tuple[int, ...], dtype: torch.dtype, budgets: float) -> torch.Tensor:
    """``expected`` in ``dtype``, with one value moved by ``budgets`` times float32's tolerance there.

    float32's budget is the widest a float32 or float64 answer may get, so moving by more
    than it must always fail, and by a fraction of the answer's own budget must always pass.
    """
    rtol, atol = tolerance(torch.float32)
    actual = expected.clone()
    actual[position] += budgets * (atol + rtol * abs(float(expected[position])))
    return actual.to(dtype)


@PROPERTY
@given(seed=seeds, shape=shapes, magnitude=magnitudes, dtype=float_dtypes)
def test_expect_close_always_passes_within_the_answers_tolerance(seed, shape, magnitude, dtype):
    expected, position = _case(seed, shape, magnitude)
    rtol, atol = tolerance(dtype)
    actual = expected.clone()
    actual[position] += 0.5 * (atol + rtol * abs(float(expected[position])))
    # float32 rounding itself stays inside float32's budget: the cast is part of the property.
    largest_error = expect_close(actual.to(dtype), expected, what="out", against="the reference")
    assert largest_error <= atol + rtol * float(expected.abs().max())


@PROPERTY
@given(seed=seeds, shape=shapes, magnitude=magnitudes, dtype=float_dtypes,
       budgets=st.floats(min_value=3.0, max_value=1e6))
def test_expect_close_always_fails_well_outside_the_tolerance(seed, shape, magnitude, dtype, budgets):
    expected, position = _case(seed, shape, magnitude)
    with pytest.raises(CheckFailure):
        expect_close(_nudged(expected, position, dtype, budgets), expected, what="out", against="the reference")


@PROPERTY
@given(seed=seeds, shape=shapes, magnitude=magnitudes)
def test_a_wrong_answer_equal_to_a_known_variant_is_named(seed, shape, magnitude):
    expected, _ = _case(seed, shape, magnitude)
    wrong = expected * 2 + 1  # [same shape], far from the reference everywhere
    unrelated = -expected - 1
    variants = [Variant(unrelated, "the unrelated mistake"), Variant(lambda: wrong, "the doubled mistake")]
    assert diagnose(wrong.float(), variants, *tolerance(torch.float32)) == "the doubled mistake"
    assert diagnose(expected, variants[1:], *tolerance(torch.float64)) is None


@PROPERTY
@given(seed=seeds, low=st.integers(-50, 50), width=st.integers(0, 20))
def test_randint_stays_within_its_inclusive_bounds(seed, low, width):
    value = randint(low, low + width, random_generator(seed))
    assert low <= value <= low + width


@PROPERTY
@given(seed=seeds, shape=shapes)
def test_randn_draws_the_same_numbers_whatever_the_dtype(seed, shape):
    """Checks draw in float64 on the CPU, then cast: float32 and CUDA runs see the same inputs."""
    as_float64 = randn(*shape, generator=random_generator(seed))
    as_float32 = randn(*shape, generator=random_generator(seed), dtype=torch.float32)
    assert torch.equal(as_float32, as_float64.float())


# --------------------------------------------------------------------------------------
# Checks at any seed (notebook 01's head bookkeeping and attention weights)
# --------------------------------------------------------------------------------------

CPU = {"device": "cpu", "quiet": True}


@CHECK_AT_ANY_SEED
@given(seed=seeds)
def test_split_and_merge_heads_accept_correct_answers_at_any_seed(seed):
    checks.check_split_heads(split_heads_unflatten, seed=seed, **CPU)
    checks.check_merge_heads(merge_heads_flatten, seed=seed, **CPU)


@CHECK_AT_ANY_SEED
@given(seed=seeds)
def test_split_and_merge_heads_name_known_mistakes_at_any_seed(seed):
    for wrong, hint in [(split_heads_reshape_only, checks.SPLIT_HEADS_HINTS["reshape_only"]),
                        (split_heads_strided, checks.SPLIT_HEADS_HINTS["strided"])]:
        with pytest.raises(CheckFailure) as failure:
            checks.check_split_heads(wrong, seed=seed, **CPU)
        assert hint in str(failure.value)
    with pytest.raises(CheckFailure) as failure:
        checks.check_merge_heads(merge_heads_reshape_only, seed=seed, **CPU)
    assert checks.MERGE_HEADS_HINTS["reshape_only"] in str(failure.value)


@CHECK_AT_ANY_SEED
@given(seed=seeds)
def test_attention_weights_accepts_a_finite_fill_and_names_a_missing_scale_at_any_seed(seed):
    checks.check_attention_weights(weights_einsum, seed=seed, **CPU)
    with pytest.raises(CheckFailure) as failure:
        checks.check_attention_weights(weights_no_scale, seed=seed, **CPU)
    assert checks.ATTENTION_HINTS["no_scale"] in str(failure.value)
