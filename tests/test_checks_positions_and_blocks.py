"""The checks of notebook 03 accept correct answers written differently and reject known mistakes.

Every wrong answer here is a mistake a student really makes (most of them are in the seed's
draft: post-norm, a missing residual, an unconverted mask, Linear(2, 256) after a 24-feature
encoder, frequencies without pi or as a plain attribute, ReLU instead of GELU, eps 1e-5); each
must be rejected with the hint that names it. The correct answers are written another way
than the solution notebook, so the checks are shown to test behaviour, not spelling.
Also here: the procedurally drawn rose and the notebook's widgets.
"""

from __future__ import annotations

import copy
import math
import re

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from attention_lab.checking import CheckFailure
from attention_lab.checks import positions_and_blocks as checks
from tests.bridge_harness import run_both_ways
from tests.curriculum import solution_cells
from attention_lab.images import draw_rose, image_dataset, pixel_coordinates

# Every test twice: the checks in the student's kernel (the lab), and through the bridge (grading).
where_checks_run = run_both_ways()

CPU = {"device": "cpu", "quiet": True}

# --------------------------------------------------------------------------------------
# Multiple-choice questions
# --------------------------------------------------------------------------------------


def test_answer_permutation():
    checks.check_answer_permutation("B", **CPU)
    checks.check_answer_permutation(" b ", **CPU)
    with pytest.raises(CheckFailure, match="not implemented yet"):
        checks.check_answer_permutation(None, **CPU)
    with pytest.raises(CheckFailure, match="Invariant would mean"):
        checks.check_answer_permutation("A", **CPU)
    with pytest.raises(CheckFailure, match="predictable"):
        checks.check_answer_permutation("C", **CPU)
    with pytest.raises(CheckFailure, match="should be one of"):
        checks.check_answer_permutation("equivariant", **CPU)


def test_answer_shift():
    checks.check_answer_shift("B", **CPU)
    with pytest.raises(CheckFailure, match="not implemented yet"):
        checks.check_answer_shift(None, **CPU)
    with pytest.raises(CheckFailure, match="angle-addition formulas: both are sums"):
        checks.check_answer_shift("A", **CPU)
    with pytest.raises(CheckFailure, match="multiple of 2 pi would make the matrix the identity"):
        checks.check_answer_shift("C", **CPU)


def test_answer_no_positions():
    checks.check_answer_no_positions("c", **CPU)
    with pytest.raises(CheckFailure, match="not implemented yet"):
        checks.check_answer_no_positions(None, **CPU)
    with pytest.raises(CheckFailure, match="Which of them came just before is not in its input"):
        checks.check_answer_no_positions("A", **CPU)
    with pytest.raises(CheckFailure, match="rule out half of the candidates"):
        checks.check_answer_no_positions("B", **CPU)


# --------------------------------------------------------------------------------------
# sinusoidal_positions
# --------------------------------------------------------------------------------------


def sinusoidal_stacked(num_positions, dim, base=10000.0):
    """Correct, written another way: exp/log frequencies, sin and cos stacked then interleaved by reshape."""
    if dim % 2:
        raise ValueError(f"odd dim {dim}")
    inverse = torch.exp(torch.arange(0, dim, 2).float() * (-math.log(base) / dim))
    angles = torch.outer(torch.arange(num_positions).float(), inverse)
    return torch.stack([angles.sin(), angles.cos()], dim=-1).reshape(num_positions, dim)


def _table(num_positions, dim, base, frequency_of_column, layout="interleaved", start=0):
    if dim % 2:
        raise ValueError(f"odd dim {dim}")
    p = torch.arange(start, start + num_positions, dtype=torch.float32)[:, None]
    if layout == "concatenated":
        w = torch.tensor([frequency_of_column(2 * i) for i in range(dim // 2)], dtype=torch.float32)
        return torch.cat([torch.sin(p * w), torch.cos(p * w)], dim=-1)
    w = torch.tensor([frequency_of_column(c) for c in range(dim)], dtype=torch.float32)
    sin, cos = torch.sin(p * w), torch.cos(p * w)
    even = torch.arange(dim) % 2 == 0
    return torch.where(~even if layout == "swapped" else even, sin, cos)


def right_frequency(dim, base):
    return lambda c: base ** (-(2 * (c // 2)) / dim)


def sinusoidal_concatenated(num_positions, dim, base=10000.0):
    n, d = num_positions, dim
    return _table(n, d, base, right_frequency(d, base), layout="concatenated")


def sinusoidal_swapped(num_positions, dim, base=10000.0):
    n, d = num_positions, dim
    return _table(n, d, base, right_frequency(d, base), layout="swapped")


def sinusoidal_column_index(num_positions, dim, base=10000.0):
    n, d = num_positions, dim
    return _table(n, d, base, lambda c: base ** (-2 * c / d))


def sinusoidal_per_column(num_positions, dim, base=10000.0):
    n, d = num_positions, dim
    return _table(n, d, base, lambda c: base ** (-c / d))


def sinusoidal_half_exponent(num_positions, dim, base=10000.0):
    n, d = num_positions, dim
    return _table(n, d, base, lambda c: base ** (-(c // 2) / d))


def sinusoidal_multiplied(num_positions, dim, base=10000.0):
    n, d = num_positions, dim
    return _table(n, d, base, lambda c: base ** (2 * (c // 2) / d))


def sinusoidal_from_one(num_positions, dim, base=10000.0):
    n, d = num_positions, dim
    return _table(n, d, base, right_frequency(d, base), start=1)


def sinusoidal_no_odd_check(num_positions, dim, base=10000.0):
    n, d = num_positions, dim
    return sinusoidal_stacked(n, d + d % 2, base)[:, :d]


def sinusoidal_float64(num_positions, dim, base=10000.0):
    n, d = num_positions, dim
    return sinusoidal_stacked(n, d, base).double()


def sinusoidal_transposed(num_positions, dim, base=10000.0):
    n, d = num_positions, dim
    return sinusoidal_stacked(n, d, base).T


def sinusoidal_numpy(num_positions, dim, base=10000.0):
    n, d = num_positions, dim
    return sinusoidal_stacked(n, d, base).numpy()


def test_sinusoidal_positions_accepts_a_correct_answer_written_differently():
    checks.check_sinusoidal_positions(sinusoidal_stacked, **CPU)
    checks.check_sinusoidal_positions(sinusoidal_stacked, seed=7, **CPU)


@pytest.mark.parametrize("answer, hint", [
    (sinusoidal_concatenated, "interleaves"),
    (sinusoidal_swapped, "sine and cosine are swapped"),
    (sinusoidal_column_index, "column index"),
    (sinusoidal_per_column, "must share one frequency"),
    (sinusoidal_half_exponent, "exponent is 2i/dim"),
    (sinusoidal_multiplied, "divide by it"),
    (sinusoidal_from_one, "positions start at 0"),
])
def test_sinusoidal_positions_diagnoses_known_mistakes(answer, hint):
    with pytest.raises(CheckFailure, match=hint):
        checks.check_sinusoidal_positions(answer, **CPU)


def sinusoidal_half_width(num_positions, dim, base=10000.0):
    return sinusoidal_stacked(num_positions, dim, base)[:, 0::2]


def test_sinusoidal_positions_contract():
    with pytest.raises(CheckFailure, match=r"should raise ValueError \(dim = 7 is odd"):
        checks.check_sinusoidal_positions(sinusoidal_no_odd_check, **CPU)
    with pytest.raises(CheckFailure, match="(?s)should return torch.float32 .*got torch.float64.*dtype=torch.float32"):
        checks.check_sinusoidal_positions(sinusoidal_float64, **CPU)
    with pytest.raises(CheckFailure, match=r"(?s)should have shape \[6, 8\], got \[8, 6\].*one row per position"):
        checks.check_sinusoidal_positions(sinusoidal_transposed, **CPU)
    with pytest.raises(CheckFailure, match=r"(?s)should have shape \[6, 8\], got \[6, 4\].*a sine and a cosine"):
        checks.check_sinusoidal_positions(sinusoidal_half_width, **CPU)
    with pytest.raises(CheckFailure, match="should be a torch.Tensor, got ndarray"):
        checks.check_sinusoidal_positions(sinusoidal_numpy, **CPU)
    with pytest.raises(CheckFailure, match=r"take the parameters \(num_positions, dim, base\)"):
        checks.check_sinusoidal_positions(lambda n, d: sinusoidal_stacked(n, d), **CPU)


def test_positions_break_equivariance():
    checks.check_positions_break_equivariance(sinusoidal_stacked, **CPU)
    checks.check_positions_break_equivariance(sinusoidal_stacked, seed=3, **CPU)
    with pytest.raises(CheckFailure, match="every row .* is the same vector"):
        checks.check_positions_break_equivariance(lambda n, d, base=10000.0: torch.ones(n, d), **CPU)
    with pytest.raises(CheckFailure, match="not implemented yet"):
        checks.check_positions_break_equivariance(_not_implemented, **CPU)


def test_positions_break_equivariance_requires_the_sinusoidal_table():
    """Any random table breaks the symmetry; the exercise asks for the sinusoidal one (issue: randn got the point)."""
    with pytest.raises(CheckFailure, match="(?s)PE\\[p\\] \\. PE\\[p \\+ \\d+\\] differ.*depend only on the offset"):
        checks.check_positions_break_equivariance(lambda n, d, base=10000.0: torch.randn(n, d), **CPU)
    with pytest.raises(CheckFailure, match="interleaves"):  # offset-only, but not the table asked for
        checks.check_positions_break_equivariance(sinusoidal_concatenated, **CPU)


def _not_implemented(*args, **kwargs):
    raise NotImplementedError("Exercise 3.2: implement sinusoidal_positions")


# --------------------------------------------------------------------------------------
# pe_shift_matrix
# --------------------------------------------------------------------------------------


def shift_block_diag(offset, dim, base=10000.0):
    """Correct, written another way: torch.block_diag of 2x2 rotations built from exp/log frequencies."""
    if dim % 2:
        raise ValueError(f"odd dim {dim}")
    frequencies = torch.exp(-math.log(base) * torch.arange(0, dim, 2).float() / dim)
    blocks = [torch.tensor([[math.cos(offset * w), math.sin(offset * w)],
                            [-math.sin(offset * w), math.cos(offset * w)]]) for w in frequencies.tolist()]
    return torch.block_diag(*blocks)


def shift_from_table(offset, dim, base=10000.0):
    """Correct, written another way: rotation blocks read off the sinusoidal table of the offset itself."""
    if dim % 2:
        raise ValueError(f"dim must be even, got {dim}")
    row = sinusoidal_stacked(abs(offset) + 1, dim, base)[abs(offset)]
    sin, cos = row[0::2] * (1 if offset >= 0 else -1), row[1::2]
    matrix = torch.zeros(dim, dim)
    for i in range(dim // 2):
        matrix[2 * i:2 * i + 2, 2 * i:2 * i + 2] = torch.stack([torch.stack([cos[i], sin[i]]),
                                                                 torch.stack([-sin[i], cos[i]])])
    return matrix


def shift_variant(*, sign=1.0, layout="interleaved", column_frequency=False, exponent=2.0, use_offset=True,
                  dtype=torch.float32, check_odd=True):
    def pe_shift_matrix(offset, dim, base=10000.0):
        if check_odd and dim % 2:
            raise ValueError(f"dim = {dim} is odd")
        matrix = torch.zeros(dim, dim, dtype=dtype)
        half = dim // 2
        for i in range(half):
            a, b = (2 * i, 2 * i + 1) if layout == "interleaved" else (i, i + half)
            angle_a = (offset if use_offset else 1) * base ** (-exponent * (a if column_frequency else i) / dim)
            angle_b = (offset if use_offset else 1) * base ** (-exponent * (b if column_frequency else i) / dim)
            matrix[a, a], matrix[a, b] = math.cos(angle_a), sign * math.sin(angle_a)
            matrix[b, a], matrix[b, b] = -sign * math.sin(angle_b), math.cos(angle_b)
        return matrix
    return pe_shift_matrix


def test_pe_shift_matrix_accepts_a_correct_answer_written_differently():
    checks.check_pe_shift_matrix(shift_block_diag, **CPU)
    checks.check_pe_shift_matrix(shift_from_table, seed=4, **CPU)
    checks.check_pe_shift_matrix(shift_variant(), seed=5, **CPU)


@pytest.mark.parametrize("answer, hint", [
    (shift_variant(sign=-1.0), r"turn the wrong way: they move PE\[p\] to PE\[p - offset\]"),
    (shift_variant(layout="half"), "pair feature i with feature i \\+ dim/2"),
    (shift_variant(column_frequency=True), "used the column index c in the exponent"),
    (shift_variant(exponent=1.0), "the exponent is 2i/dim, not i/dim"),
    (shift_variant(exponent=-2.0), "you multiplied by base\\^\\(2i/dim\\)"),
    (shift_variant(use_offset=False), "does not grow with the offset"),
    (shift_variant(dtype=torch.float64), "(?s)should return torch.float32.*default dtype"),
    (shift_variant(check_odd=False), r"pe_shift_matrix\(2, 7\) should raise ValueError"),
])
def test_pe_shift_matrix_diagnoses_known_mistakes(answer, hint):
    with pytest.raises(CheckFailure, match=hint):
        checks.check_pe_shift_matrix(answer, **CPU)


def test_pe_shift_matrix_is_checked_for_every_position():
    """A matrix right for the first positions only (a rotation block zeroed for the slowest pair) is caught
    by the every-p comparison, which names the position row."""
    def slow_pair_dropped(offset, dim, base=10000.0):
        matrix = shift_block_diag(offset, dim, base)
        matrix[-2:, -2:] = torch.eye(2)
        return matrix

    with pytest.raises(CheckFailure, match=r"@ PE\[p\] for every p = 0 \.\.\. 23 .* does not match PE\[p \+ 3\]"):
        checks.check_pe_shift_matrix(slow_pair_dropped, **CPU)


# --------------------------------------------------------------------------------------
# offset_only_qk: a W_qᵀW_k whose projected scores stay offset-only
# --------------------------------------------------------------------------------------


def offset_only_block_diag(scales, angles):
    """Correct, written another way: torch.block_diag of complex numbers a·e^(-it) as 2x2 real blocks."""
    if len(scales) != len(angles):
        raise ValueError(f"{len(scales)} scales but {len(angles)} angles")
    blocks = []
    for z in torch.polar(scales, -angles.to(scales.dtype)):      # a·(cos t - i sin t)
        blocks.append(torch.stack([torch.stack([z.real, -z.imag]), torch.stack([z.imag, z.real])]))
    return torch.block_diag(*blocks)


def offset_only_from_shift(scales, angles):
    """Correct, written another way: the rotation as cos(t)·I + sin(t)·J per pair, with J = [[0, 1], [-1, 0]],
    scattered into a zero matrix with a loop."""
    if scales.shape != angles.shape:
        raise ValueError(f"scales has {scales.numel()} entries, angles {angles.numel()}")
    eye = torch.eye(2, dtype=scales.dtype, device=scales.device)
    turn = torch.tensor([[0.0, 1.0], [-1.0, 0.0]], dtype=scales.dtype, device=scales.device)
    matrix = scales.new_zeros(2 * len(scales), 2 * len(scales))
    for i, (a, t) in enumerate(zip(scales, angles.to(scales.dtype))):
        matrix[2 * i:2 * i + 2, 2 * i:2 * i + 2] = a * (torch.cos(t) * eye + torch.sin(t) * turn)
    return matrix


def offset_only_variant(*, layout="interleaved", sin_sign=1.0, reflection=False, scaled=True, cos_only=False,
                        same_block=False, dtype=None, check_lengths=True):
    def offset_only_qk(scales, angles):
        if check_lengths and len(scales) != len(angles):
            raise ValueError(f"{len(scales)} != {len(angles)}")
        half = len(scales)
        matrix = torch.zeros(2 * half, 2 * half, dtype=dtype or scales.dtype, device=scales.device)
        for i in range(half):
            a, t = (scales[0], angles[0]) if same_block else (scales[i], angles[i])
            a = a if scaled else torch.ones_like(a)
            j, k = (2 * i, 2 * i + 1) if layout == "interleaved" else (i, i + half)
            trig = 1.0 if cos_only else a
            matrix[j, j] = a * torch.cos(t)
            matrix[j, k] = sin_sign * trig * torch.sin(t)
            matrix[k, j] = (1.0 if reflection else -1.0) * sin_sign * trig * torch.sin(t)
            matrix[k, k] = (-1.0 if reflection else 1.0) * a * torch.cos(t)
        return matrix
    return offset_only_qk


def test_offset_only_qk_accepts_a_correct_answer_written_differently():
    checks.check_offset_only_qk(offset_only_block_diag, **CPU)
    checks.check_offset_only_qk(offset_only_from_shift, seed=4, **CPU)
    checks.check_offset_only_qk(offset_only_variant(), seed=5, **CPU)


@pytest.mark.parametrize("answer, hint", [
    (offset_only_variant(layout="half"), "rotate_half"),
    (offset_only_variant(reflection=True), "reflection"),
    (offset_only_variant(sin_sign=-1.0), "transposed"),
    (offset_only_variant(scaled=False), "no_scale"),
    (offset_only_variant(cos_only=True), "partial_scale"),
    (offset_only_variant(same_block=True), "one_block"),
])
def test_offset_only_qk_diagnoses_known_mistakes(answer, hint):
    with pytest.raises(CheckFailure) as failure:
        checks.check_offset_only_qk(answer, **CPU)
    assert checks.OFFSET_ONLY_HINTS[hint] in str(failure.value), str(failure.value)


def test_offset_only_qk_measures_the_offset_only_property():
    """A generic matrix (here: a dense random one) breaks the property: the message says by how much, at which
    offset, and that the scores depend on the absolute positions."""
    def dense(scales, angles):
        generator = torch.Generator().manual_seed(0)
        return torch.randn(2 * len(scales), 2 * len(scales), generator=generator, dtype=scales.dtype)

    with pytest.raises(CheckFailure, match=r"PE\[p\]ᵀ M PE\[p \+ -?\d+\] differ from one p to another .* depend on "
                                           r"the absolute positions"):
        checks.check_offset_only_qk(dense, **CPU)


@pytest.mark.parametrize("answer, message", [
    (offset_only_variant(dtype=torch.float32), "float64"),
    (offset_only_variant(check_lengths=False), r"offset_only_qk\(scales of 3 pairs, angles of 4\) should raise ValueError"),
])
def test_offset_only_qk_contract(answer, message):
    with pytest.raises(CheckFailure, match=message):
        checks.check_offset_only_qk(answer, **CPU)


# --------------------------------------------------------------------------------------
# FourierFeatures
# --------------------------------------------------------------------------------------


class FourierPow(nn.Module):
    """Correct, written another way: torch.pow, unsqueeze/reshape, buffer named freqs."""

    def __init__(self, in_dim, num_frequencies):
        super().__init__()
        self.out_dim = 2 * num_frequencies * in_dim
        self.register_buffer("freqs", torch.pi * torch.pow(2.0, torch.arange(num_frequencies)), persistent=False)

    def forward(self, x):
        angles = (x.unsqueeze(-1) * self.freqs).reshape(*x.shape[:-1], -1)
        return torch.cat((angles.sin(), angles.cos()), -1)


def fourier_variant(*, frequencies=None, store="buffer", order="coordinate", layout="blocks",
                    out_dim=None, seed_slice=False):
    """A FourierFeatures class with one known mistake switched on."""

    class Variant(nn.Module):
        def __init__(self, in_dim, num_frequencies):
            super().__init__()
            self.out_dim = in_dim * 2 * num_frequencies if out_dim is None else out_dim(in_dim, num_frequencies)
            k = torch.arange(num_frequencies, dtype=torch.float32)
            values = 2.0 ** k * math.pi if frequencies is None else frequencies(k)
            if store == "buffer":
                self.register_buffer("frequencies", values, persistent=False)
            elif store == "persistent":
                self.register_buffer("frequencies", values)
            elif store == "parameter":
                self.frequencies = nn.Parameter(values)
            else:
                self.frequencies = values

        def forward(self, x):
            if seed_slice:
                angles = (x[..., None:] * self.frequencies).flatten(-2)
            elif order == "coordinate":
                angles = (x[..., None] * self.frequencies.to(x)).flatten(-2)
            else:
                angles = (self.frequencies.to(x)[:, None] * x[..., None, :]).flatten(-2)
            if layout == "interleaved":
                return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)
            if layout == "cos_first":
                return torch.cat([angles.cos(), angles.sin()], dim=-1)
            return torch.cat([angles.sin(), angles.cos()], dim=-1)

    return Variant


class FourierPiInForward(nn.Module):
    """Correct, written another way: the buffer holds 2^k (float32) and forward multiplies by pi."""

    def __init__(self, in_dim, num_frequencies):
        super().__init__()
        self.out_dim = in_dim * num_frequencies * 2
        self.register_buffer("scales", 2.0 ** torch.arange(num_frequencies, dtype=torch.float32), persistent=False)

    def forward(self, x):
        angles = torch.pi * torch.einsum("...c,f->...cf", x, self.scales.to(x.dtype)).flatten(-2)
        return torch.cat([angles.sin(), angles.cos()], dim=-1)


class FourierCatThenFlatten(FourierPow):
    """The draft fixed in the other order: sin/cos concatenated per coordinate, flattened afterwards."""

    def forward(self, x):
        angles = x[..., None] * self.freqs  # [..., in_dim, F]
        return torch.cat([angles.sin(), angles.cos()], dim=-1).flatten(-2)


class FourierNoBuffer(nn.Module):
    """The frequencies made again in every forward call: no buffer."""

    def __init__(self, in_dim, num_frequencies):
        super().__init__()
        self.out_dim, self.num_frequencies = in_dim * 2 * num_frequencies, num_frequencies

    def forward(self, x):
        frequencies = 2.0 ** torch.arange(self.num_frequencies, dtype=x.dtype, device=x.device) * math.pi
        angles = (x[..., None] * frequencies).flatten(-2)
        return torch.cat([angles.sin(), angles.cos()], dim=-1)


class FourierNoFlatten(FourierPow):
    def forward(self, x):
        angles = x.unsqueeze(-1) * self.freqs
        return torch.cat((angles.sin(), angles.cos()), -1)


class FourierFloat32Output(FourierPow):
    def forward(self, x):
        return super().forward(x).float()


def test_fourier_features_accepts_a_correct_answer_written_differently():
    checks.check_fourier_features(FourierPow, **CPU)
    checks.check_fourier_features(FourierPow, seed=11, **CPU)
    checks.check_fourier_features(fourier_variant(), **CPU)
    checks.check_fourier_features(FourierPiInForward, **CPU)
    checks.check_fourier_features(FourierPiInForward, seed=4, **CPU)


@pytest.mark.parametrize("answer, hint", [
    (fourier_variant(frequencies=lambda k: 2.0 ** k), "2\\^k; they are 2\\^k \\* pi"),
    (fourier_variant(frequencies=lambda k: torch.exp(k)), "the draft's exp"),
    (fourier_variant(store="plain"), "(?s)plain attribute \\(self.frequencies\\).*plain tensor attribute.*register_buffer"),
    (FourierCatThenFlatten, "one \\[sin, cos\\] block per coordinate"),
    (FourierNoBuffer, "has no buffer.*\n.*keep the frequencies in a buffer"),
    (fourier_variant(store="persistent"), "persistent=False"),
    (fourier_variant(store="parameter"), "nn.Parameter"),
    (fourier_variant(order="frequency"), "flattened in the wrong order"),
    (fourier_variant(layout="interleaved"), "interleaved per angle"),
    (fourier_variant(layout="cos_first"), "cos comes first"),
    (fourier_variant(frequencies=lambda k: (k + 1) * math.pi), "grow linearly"),
    (fourier_variant(seed_slice=True), r"x\[\.\.\., None:\] is a full slice"),
    (fourier_variant(out_dim=lambda i, f: 2 * f), "in_dim coordinates x F frequencies x 2"),
    (fourier_variant(out_dim=lambda i, f: i * f), "a sine and a cosine"),
])
def test_fourier_features_diagnoses_known_mistakes(answer, hint):
    with pytest.raises(CheckFailure, match=hint):
        checks.check_fourier_features(answer, **CPU)


def test_fourier_features_contract():
    with pytest.raises(CheckFailure, match=r"(?s)should have shape \[4, 3, 24\], got \[4, 3, 2, 12\].*flatten"):
        checks.check_fourier_features(FourierNoFlatten, **CPU)
    with pytest.raises(CheckFailure, match="should keep the input dtype torch.float64, got torch.float32. The rule "
                                           "of this notebook: keep the input's dtype"):
        checks.check_fourier_features(FourierFloat32Output, **CPU)
    with pytest.raises(CheckFailure, match="should be an nn.Module"):
        checks.check_fourier_features(lambda in_dim, num_frequencies: "not a module", **CPU)


# --------------------------------------------------------------------------------------
# CoordinateMLP
# --------------------------------------------------------------------------------------


class MLPExplicit(nn.Module):
    """Correct, written another way: four named layers and F.relu in forward; Identity for no encoder."""

    def __init__(self, encoder=None, hidden=256):
        super().__init__()
        self.encoder = nn.Identity() if encoder is None else encoder
        width = 2 if encoder is None else encoder.out_dim
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, hidden // 2)
        self.fc3 = nn.Linear(hidden // 2, hidden // 4)
        self.fc4 = nn.Linear(hidden // 4, 3)

    def forward(self, coords):
        h = self.encoder(coords)
        for layer in (self.fc1, self.fc2, self.fc3):
            h = F.relu(layer(h))
        return self.fc4(h)


class MLPSeedWidth(MLPExplicit):
    """The draft's bug: the first layer always takes 2 features."""

    def __init__(self, encoder=None, hidden=256):
        super().__init__(None, hidden)
        self.encoder = nn.Identity() if encoder is None else encoder


class MLPFinalReLU(MLPExplicit):
    def forward(self, coords):
        return F.relu(super().forward(coords))


class MLPFinalSigmoid(MLPExplicit):
    def forward(self, coords):
        return torch.sigmoid(super().forward(coords))


class MLPNoReLU(MLPExplicit):
    def forward(self, coords):
        h = self.encoder(coords)
        return self.fc4(self.fc3(self.fc2(self.fc1(h))))


class MLPUnregisteredEncoder(MLPExplicit):
    def __init__(self, encoder=None, hidden=256):
        super().__init__(encoder, hidden)
        del self.encoder
        self.encoders = [nn.Identity() if encoder is None else encoder]  # a plain list: not registered

    def forward(self, coords):
        h = self.encoders[0](coords)
        for layer in (self.fc1, self.fc2, self.fc3):
            h = F.relu(layer(h))
        return self.fc4(h)


class MLPConstantWidth(MLPExplicit):
    def __init__(self, encoder=None, hidden=256):
        super().__init__(encoder, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden // 4)


def test_coordinate_mlp_accepts_a_correct_answer_written_differently():
    checks.check_coordinate_mlp(MLPExplicit, **CPU)
    checks.check_coordinate_mlp(MLPExplicit, seed=5, **CPU)


@pytest.mark.parametrize("answer, hint", [
    (MLPSeedWidth, "the first Linear takes 2 features, but the encoder outputs"),
    (MLPFinalReLU, "ReLU after the last Linear"),
    (MLPFinalSigmoid, "sigmoid after the last Linear"),
    (MLPNoReLU, "ReLUs between the Linear layers are missing"),
    (MLPUnregisteredEncoder, "store the encoder as a module attribute"),
    (MLPConstantWidth, r"four nn.Linear layers .* = \[\(2, 256\), \(256, 128\), \(128, 64\), \(64, 3\)\]"),
])
def test_coordinate_mlp_diagnoses_known_mistakes(answer, hint):
    with pytest.raises(CheckFailure, match=hint):
        checks.check_coordinate_mlp(answer, **CPU)


def test_coordinate_mlp_contract():
    with pytest.raises(CheckFailure, match=r"take the parameters \(encoder, hidden\)"):
        checks.check_coordinate_mlp(lambda hidden=256, encoder=None: MLPExplicit(encoder, hidden), **CPU)

    class Float32Output(MLPExplicit):
        def forward(self, coords):
            return super().forward(coords).float()

    with pytest.raises(CheckFailure, match="should keep the input dtype torch.float64, got torch.float32"):
        checks.check_coordinate_mlp(Float32Output, **CPU)


# --------------------------------------------------------------------------------------
# psnr
# --------------------------------------------------------------------------------------


def psnr_torch(pred, target, max_value=1.0):
    """Correct, written another way: -10·log10(MSE / max²) in torch; log10(0) = -inf gives +inf."""
    mse = F.mse_loss(pred.detach().double(), target.detach().double())
    return (-10.0 * torch.log10(mse / max_value ** 2)).item()


def psnr_natural_log(pred, target, max_value=1.0):
    return 10 * math.log(max_value ** 2 / F.mse_loss(pred, target).item())


def psnr_twenty(pred, target, max_value=1.0):
    return 20 * math.log10(max_value / F.mse_loss(pred, target).item())


def psnr_peak_not_squared(pred, target, max_value=1.0):
    return 10 * math.log10(max_value / F.mse_loss(pred, target).item())


def psnr_sum(pred, target, max_value=1.0):
    return 10 * math.log10(max_value ** 2 / ((pred - target) ** 2).sum().item())


def psnr_upside_down(pred, target, max_value=1.0):
    return 10 * math.log10(F.mse_loss(pred, target).item() / max_value ** 2)


def psnr_tensor(pred, target, max_value=1.0):
    return 10 * torch.log10(max_value ** 2 / F.mse_loss(pred, target))


def psnr_no_inf(pred, target, max_value=1.0):
    return 10 * math.log10(max_value ** 2 / F.mse_loss(pred.detach(), target).item())


def psnr_numpy(pred, target, max_value=1.0):
    """Correct, in NumPy: a NumPy float (np.float64, or np.float32 from float32 arrays) is a number (issue #52)."""
    error = (pred.detach().cpu().numpy() - target.detach().cpu().numpy()) ** 2
    with np.errstate(divide="ignore"):
        return 10 * np.log10(np.float32(max_value) ** 2 / np.mean(error))


def test_psnr_accepts_a_correct_answer_written_differently():
    checks.check_psnr(psnr_torch, **CPU)
    checks.check_psnr(psnr_torch, seed=9, **CPU)
    checks.check_psnr(psnr_numpy, **CPU)


@pytest.mark.parametrize("answer, hint", [
    (psnr_natural_log, "use log10"),
    (psnr_twenty, "20 \\* log10 goes with the root"),
    (psnr_peak_not_squared, "square the peak value"),
    (psnr_sum, "the \\*mean\\* of the squared errors"),
    (psnr_upside_down, "upside down"),
])
def test_psnr_diagnoses_known_mistakes(answer, hint):
    with pytest.raises(CheckFailure, match=hint):
        checks.check_psnr(answer, **CPU)


def test_psnr_contract():
    with pytest.raises(CheckFailure, match="(?s)should return a Python float, got a tensor of shape.*float\\(...\\) or .item"):
        checks.check_psnr(psnr_tensor, **CPU)
    with pytest.raises(CheckFailure, match=r"psnr\(x, x\) \(a perfect reconstruction\) raised ZeroDivisionError"):
        checks.check_psnr(psnr_no_inf, **CPU)


# --------------------------------------------------------------------------------------
# fit_image and the outcome
# --------------------------------------------------------------------------------------


def fit_image_plain(model, coords, colors, steps, lr):
    """Correct, written another way: no progress bar (so no progress argument), set_to_none, manual MSE."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    history = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = ((model(coords) - colors) ** 2).mean()
        loss.backward()
        optimizer.step()
        history.append(loss.item())
    return history


def fit_variant(*, optimizer="adam", after=False, zero_grad=True, reduction="mean", use_lr=True,
                fresh=False, as_tensors=False):
    def fit_image(model, coords, colors, steps, lr, progress=True):
        make = lambda: (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam)(  # noqa: E731
            model.parameters(), **({"lr": lr} if use_lr or optimizer == "sgd" else {}))
        opt = make()
        losses = []
        for _ in range(steps):
            if fresh:
                opt = make()
            if zero_grad:
                opt.zero_grad()
            loss = F.mse_loss(model(coords), colors, reduction=reduction)
            loss.backward()
            opt.step()
            if after:
                with torch.no_grad():
                    losses.append(F.mse_loss(model(coords), colors).item())
            else:
                losses.append(loss if as_tensors else loss.item())
        return losses

    return fit_image


def test_fit_image_accepts_a_correct_answer_written_differently():
    checks.check_fit_image(fit_image_plain, **CPU)
    checks.check_fit_image(fit_variant(), seed=4, **CPU)


@pytest.mark.parametrize("answer, hint", [
    (fit_variant(optimizer="sgd"), "plain SGD"),
    (fit_variant(after=True), "after the optimizer step"),
    (fit_variant(zero_grad=False), "gradients accumulate"),
    (fit_variant(reduction="sum"), "not the sum"),
    (fit_variant(use_lr=False), "learning rate was ignored"),
    (fit_variant(fresh=True), "create the optimizer once"),
])
def test_fit_image_diagnoses_known_mistakes(answer, hint):
    with pytest.raises(CheckFailure, match=hint):
        checks.check_fit_image(answer, **CPU)


def test_fit_image_contract():
    with pytest.raises(CheckFailure, match=r"returned a list of tensors; store loss.item\(\)"):
        checks.check_fit_image(fit_variant(as_tensors=True), **CPU)
    with pytest.raises(CheckFailure, match=r"one loss per step \(12\), got 11"):
        checks.check_fit_image(lambda model, coords, colors, steps, lr: fit_image_plain(model, coords, colors, steps, lr)[1:], **CPU)
    with pytest.raises(CheckFailure, match="should return a list of 12 floats, got tuple"):
        checks.check_fit_image(lambda model, coords, colors, steps, lr: tuple(fit_image_plain(model, coords, colors, steps, lr)), **CPU)


def _outcome_scores(capsys, *answers):
    checks.check_fourier_beats_identity(*answers, **CPU)
    printed = capsys.readouterr().out
    found = re.search(r"raw \(x, y\) ([\d.]+) dB, Fourier features ([\d.]+) dB", printed)
    assert found, printed
    return float(found.group(1)), float(found.group(2))


class MLPDrawsRandomNumbers(MLPExplicit):
    """Correct, but uses the global RNG while building (as a different layer order would)."""

    def __init__(self, encoder=None, hidden=256):
        torch.randn(1000)
        super().__init__(encoder, hidden)


def test_outcome_fourier_features_beat_raw_coordinates(capsys):
    raw, fourier = _outcome_scores(capsys, FourierPow, MLPExplicit, fit_image_plain)
    assert fourier - raw > 5.0  # measured ~7 dB: the 3 dB threshold leaves slack
    # The check re-initialises the layers from its seed: how an answer draws its initial weights
    # does not change the experiment.
    assert _outcome_scores(capsys, FourierPow, MLPDrawsRandomNumbers, fit_image_plain) == pytest.approx(
        (raw, fourier), abs=0.05)


def test_outcome_rejects_training_that_does_not_train():
    def fit_image_no_steps(model, coords, colors, steps, lr):
        with torch.no_grad():
            loss = F.mse_loss(model(coords), colors).item()
        return [loss] * steps

    with pytest.raises(CheckFailure, match="a margin of .* less than the 3 dB"):
        checks.check_fourier_beats_identity(FourierPow, MLPExplicit, fit_image_no_steps, **CPU)


def test_outcome_reports_an_unimplemented_class():
    class Stub(nn.Module):
        def __init__(self, *args, **kwargs):
            raise NotImplementedError("Exercise 3.5: implement CoordinateMLP")

    with pytest.raises(CheckFailure, match="not implemented yet"):
        checks.check_fourier_beats_identity(FourierPow, Stub, fit_image_plain, **CPU)


# --------------------------------------------------------------------------------------
# TransformerLayer
# --------------------------------------------------------------------------------------


class LayerFloatMask(nn.Module):
    """Correct, written another way: an additive float mask (-inf where blocked), weights requested and dropped."""

    def __init__(self, embed_dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        hidden = int(embed_dim * mlp_ratio)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, hidden), nn.GELU(), nn.Linear(hidden, embed_dim))
        self.norm1 = nn.LayerNorm(embed_dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(embed_dim, eps=1e-6)

    def forward(self, x, mask=None):
        additive = None
        if mask is not None:
            additive = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill(~mask, float("-inf"))
        y = self.norm1(x)
        attended, _weights = self.attn(y, y, y, attn_mask=additive)
        x = attended + x
        return self.mlp(self.norm2(x)) + x


def layer_variant(*, post_norm=False, attn_residual=True, mlp_residual=True, convert_mask=True,
                  activation=nn.GELU, eps=1e-6, batch_first=True, swap_norms=False, take_first=True,
                  need_weights=True, kv_unnormalised=False):
    class Layer(LayerFloatMask):
        def __init__(self, embed_dim, num_heads, mlp_ratio=4.0):
            super().__init__(embed_dim, num_heads, mlp_ratio)
            hidden = int(embed_dim * mlp_ratio)
            self.attn = nn.MultiheadAttention(embed_dim, num_heads, batch_first=batch_first)
            self.mlp = nn.Sequential(nn.Linear(embed_dim, hidden), activation(), nn.Linear(hidden, embed_dim))
            self.norm1 = nn.LayerNorm(embed_dim, eps=eps)
            self.norm2 = nn.LayerNorm(embed_dim, eps=eps)

        def forward(self, x, mask=None):
            blocked = None if mask is None else (~mask if convert_mask else mask)
            norm1, norm2 = (self.norm2, self.norm1) if swap_norms else (self.norm1, self.norm2)
            if post_norm:
                x = norm1(x + self.attn(x, x, x, attn_mask=blocked)[0])
                return norm2(x + self.mlp(x))
            h = norm1(x)
            kv = x if kv_unnormalised else h
            result = self.attn(h, kv, kv, attn_mask=blocked, need_weights=need_weights)
            attended = result[0] if take_first else result
            x = x + attended if attn_residual else attended
            m = self.mlp(norm2(x))
            return x + m if mlp_residual else m

    return Layer


def test_transformer_layer_accepts_a_correct_answer_written_differently():
    checks.check_transformer_layer(LayerFloatMask, **CPU)
    checks.check_transformer_layer(layer_variant(), seed=2, **CPU)
    checks.check_transformer_layer_properties(LayerFloatMask, **CPU)
    checks.check_transformer_layer_properties(layer_variant(), seed=2, **CPU)


@pytest.mark.parametrize("answer, hint", [
    (layer_variant(post_norm=True), "post-norm layer"),
    (layer_variant(attn_residual=False, mlp_residual=False), "both residual connections are missing"),
    (layer_variant(attn_residual=False), "residual connection around attention is missing"),
    (layer_variant(mlp_residual=False), "residual connection around the MLP is missing"),
    (layer_variant(convert_mask=False), "passed to nn.MultiheadAttention unconverted"),
    (layer_variant(convert_mask=False, need_weights=False), "passed to nn.MultiheadAttention unconverted"),
    (layer_variant(swap_norms=True), "yours are swapped"),
    (layer_variant(kv_unnormalised=True), "normalise once and use the result as query, key and value"),
    (layer_variant(activation=nn.ReLU), "ReLU instead of GELU"),
    (layer_variant(activation=lambda: nn.GELU(approximate="tanh")), "exact nn.GELU"),
    (layer_variant(eps=1e-5), "eps should be 1e-6, got 1e-05"),
    (layer_variant(batch_first=False), "batch_first=True"),
    (layer_variant(take_first=False), "returns a tuple \\(output, weights\\): take \\[0\\]"),
])
def test_transformer_layer_diagnoses_known_mistakes(answer, hint):
    with pytest.raises(CheckFailure, match=hint):
        checks.check_transformer_layer(answer, **CPU)


@pytest.mark.parametrize("answer, hint", [
    (layer_variant(post_norm=True), "post-norm layer"),
    (layer_variant(attn_residual=False, mlp_residual=False), "both residual connections are missing"),
    (layer_variant(convert_mask=False), "(?s)returned NaN.*passed to nn.MultiheadAttention unconverted"),
    (layer_variant(convert_mask=False, need_weights=False), "(?s)no future token.*passed to nn.MultiheadAttention unconverted"),
])
def test_transformer_layer_properties_diagnose_known_mistakes(answer, hint):
    with pytest.raises(CheckFailure, match=hint):
        checks.check_transformer_layer_properties(answer, **CPU)


def test_transformer_layer_properties_catch_an_ignored_mask():
    class IgnoresMask(LayerFloatMask):
        def forward(self, x, mask=None):
            return super().forward(x, None)

    with pytest.raises(CheckFailure, match="(?s)a causal mask lets no future token influence the past.*mask was ignored"):
        checks.check_transformer_layer_properties(IgnoresMask, **CPU)


def test_transformer_layer_contract():
    class NoNorms(LayerFloatMask):
        def __init__(self, embed_dim, num_heads, mlp_ratio=4.0):
            super().__init__(embed_dim, num_heads, mlp_ratio)
            self.in_norm, self.mlp_norm = self.norm1, self.norm2
            del self.norm1, self.norm2

    with pytest.raises(CheckFailure, match="norm1 should be an nn.LayerNorm, got None"):
        checks.check_transformer_layer(NoNorms, **CPU)

    class WideMLP(LayerFloatMask):
        def __init__(self, embed_dim, num_heads, mlp_ratio=4.0):
            super().__init__(embed_dim, num_heads, mlp_ratio)
            self.mlp = nn.Sequential(nn.Linear(embed_dim, 4 * embed_dim), nn.GELU(), nn.Linear(4 * embed_dim, embed_dim))

    with pytest.raises(CheckFailure, match=r"mlp\[0\] should be nn.Linear\(12, 24\)"):
        checks.check_transformer_layer(WideMLP, **CPU)

    class Float32Output(LayerFloatMask):
        def forward(self, x, mask=None):
            return super().forward(x, mask).float()

    with pytest.raises(CheckFailure, match="should keep the input dtype torch.float64, got torch.float32. The rule "
                                           "of this notebook: keep the input's dtype"):
        checks.check_transformer_layer(Float32Output, **CPU)


# --------------------------------------------------------------------------------------
# Transformer
# --------------------------------------------------------------------------------------


class StackOfClones(nn.Module):
    """Correct, written another way: deep copies of one layer (as nn.TransformerEncoder does)."""

    def __init__(self, embed_dim, num_heads, num_layers, mlp_ratio=4.0):
        super().__init__()
        first = LayerFloatMask(embed_dim, num_heads, mlp_ratio)
        self.layers = nn.ModuleList([copy.deepcopy(first) for _ in range(num_layers)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)

    def forward(self, x, mask=None):
        for layer in self.layers:
            x = layer(x, mask=mask)
        return self.norm(x)


def stack_variant(*, shared=False, container="modulelist", final_norm=True, pass_mask=True, eps=1e-6):
    class Stack(StackOfClones):
        def __init__(self, embed_dim, num_heads, num_layers, mlp_ratio=4.0):
            super().__init__(embed_dim, num_heads, num_layers, mlp_ratio)
            layers = ([LayerFloatMask(embed_dim, num_heads, mlp_ratio)] * num_layers if shared else
                      [LayerFloatMask(embed_dim, num_heads, mlp_ratio) for _ in range(num_layers)])
            del self.layers
            if container == "modulelist":
                self.layers = nn.ModuleList(layers)
            elif container == "sequential":
                self.layers = nn.Sequential(*layers)
            else:
                self.layers = layers
            self.norm = nn.LayerNorm(embed_dim, eps=eps)

        def forward(self, x, mask=None):
            for layer in self.layers:
                x = layer(x, mask if pass_mask else None)
            return self.norm(x) if final_norm else x

    return Stack


def test_transformer_accepts_a_correct_answer_written_differently():
    checks.check_transformer(StackOfClones, **CPU)
    checks.check_transformer(stack_variant(), seed=8, **CPU)


@pytest.mark.parametrize("answer, hint", [
    (stack_variant(shared=True), r"\[TransformerLayer\(\.\.\.\)\] \* n\) repeats one layer"),
    (stack_variant(container="sequential"), "(?s)is an nn.Sequential.*cannot pass the mask to every layer"),
    (stack_variant(container="list"), "plain Python list is not registered"),
    (stack_variant(final_norm=False), "final LayerNorm is missing"),
    (stack_variant(pass_mask=False), "the mask did not reach the layers"),
    (stack_variant(eps=1e-5), "norm.eps should be 1e-6"),
])
def test_transformer_diagnoses_known_mistakes(answer, hint):
    with pytest.raises(CheckFailure, match=hint):
        checks.check_transformer(answer, **CPU)


def test_transformer_reports_a_wrong_layer_as_such():
    class PostNormStack(StackOfClones):
        def __init__(self, embed_dim, num_heads, num_layers, mlp_ratio=4.0):
            super().__init__(embed_dim, num_heads, num_layers, mlp_ratio)
            self.layers = nn.ModuleList([layer_variant(post_norm=True)(embed_dim, num_heads, mlp_ratio)
                                         for _ in range(num_layers)])

    with pytest.raises(CheckFailure, match="(?s)post-norm layer.*make test_TransformerLayer pass first"):
        checks.check_transformer(PostNormStack, **CPU)


def test_transformer_contract():
    with pytest.raises(CheckFailure, match=r"take the parameters \(embed_dim, num_heads, num_layers, mlp_ratio\)"):
        checks.check_transformer(lambda embed_dim, num_heads, mlp_ratio=4.0: None, **CPU)
    with pytest.raises(CheckFailure, match="should hold 3 layers, got 2"):
        checks.check_transformer(lambda embed_dim, num_heads, num_layers, mlp_ratio=4.0:
                                 StackOfClones(embed_dim, num_heads, 2, mlp_ratio), **CPU)


# --------------------------------------------------------------------------------------
# OrderTransformer
# --------------------------------------------------------------------------------------


class OrderNanoGPT(nn.Module):
    """Correct, written another way (nanoGPT's names): wte/wpe, nn.Embedding for learned positions, the
    sinusoidal table computed in forward, an nn.ModuleDict around the stack, keyword mask."""

    def __init__(self, vocab_size, embed_dim, num_heads, num_layers, max_len, positions="sinusoidal"):
        super().__init__()
        if positions not in {"sinusoidal", "learned", "none"}:
            raise ValueError(f"unknown positions {positions}")
        self.kind = positions
        self.parts = nn.ModuleDict({"wte": nn.Embedding(vocab_size, embed_dim),
                                    "h": StackOfClones(embed_dim, num_heads, num_layers)})
        if positions == "learned":
            self.parts["wpe"] = nn.Embedding(max_len, embed_dim)
        self.lm_head = nn.Linear(embed_dim, vocab_size)

    def forward(self, tokens, mask=None):
        seq_len = tokens.size(1)
        x = self.parts["wte"](tokens)
        if self.kind == "learned":
            x = x + self.parts["wpe"](torch.arange(seq_len, device=tokens.device))
        elif self.kind == "sinusoidal":
            x = x + sinusoidal_stacked(seq_len, x.size(-1)).to(x)
        return self.lm_head(self.parts["h"](x, mask=mask))


def order_variant(*, after=False, scaled=False, embed=True, pass_mask=True, learned_store="parameter",
                  sinusoidal_store="buffer", slice_table=True, none_adds=False, sinusoidal_adds=True,
                  check_name=True, cast_float=False, cast_logits=False):
    class Order(nn.Module):
        def __init__(self, vocab_size, embed_dim, num_heads, num_layers, max_len, positions="sinusoidal"):
            super().__init__()
            if check_name and positions not in ("sinusoidal", "learned", "none"):
                raise ValueError(f"positions={positions!r}")
            self.kind = positions
            self.token_embedding = nn.Embedding(vocab_size, embed_dim)
            table = sinusoidal_stacked(max_len, embed_dim)
            if positions == "learned":
                learned = 0.02 * torch.randn(max_len, embed_dim)
                if learned_store == "parameter":
                    self.table = nn.Parameter(learned)
                elif learned_store == "buffer":
                    self.register_buffer("table", learned)
                else:
                    self.table = learned
            elif positions == "sinusoidal" or none_adds:
                if sinusoidal_store == "parameter":
                    self.table = nn.Parameter(table)
                elif sinusoidal_store == "plain":
                    self.table = table
                elif sinusoidal_store == "persistent":
                    self.register_buffer("table", table)
                else:
                    self.register_buffer("table", table, persistent=False)
            else:
                self.table = None
            self.transformer = StackOfClones(embed_dim, num_heads, num_layers)
            self.head = nn.Linear(embed_dim, vocab_size)
            self.scale = math.sqrt(embed_dim) if scaled else 1.0

        def forward(self, tokens, mask=None):
            x = self.token_embedding(tokens) * self.scale
            if not embed:
                x = torch.zeros_like(x)
            if cast_float:
                x = x.float()
            table = self.table
            if table is not None and (self.kind != "sinusoidal" or sinusoidal_adds):
                table = table[: tokens.shape[1]] if slice_table else table
            else:
                table = None
            m = mask if pass_mask else None
            if table is not None and not after:
                x = x + table
            h = self.transformer(x, m)
            if table is not None and after:
                h = h + table
            return self.head(h).float() if cast_logits else self.head(h)

    return Order


def test_order_transformer_accepts_a_correct_answer_written_differently():
    checks.check_order_transformer(OrderNanoGPT, **CPU)
    checks.check_order_transformer(order_variant(), seed=3, **CPU)


@pytest.mark.parametrize("answer, hint", [
    (order_variant(after=True), "positions were added to the Transformer's output"),
    (order_variant(scaled=True), "multiplied by sqrt\\(D\\)"),
    (order_variant(embed=False), "the token embedding is missing"),
    (order_variant(pass_mask=False), "the mask did not reach the Transformer"),
    (order_variant(learned_store="plain"), "(?s)no trainable \\[9, 16\\] position table.*not a Parameter"),
    (order_variant(learned_store="buffer"), "(?s)no trainable \\[9, 16\\] position table.*not a Parameter"),
    (order_variant(sinusoidal_store="parameter"), "(?s)holds the sinusoidal table as a trainable.*is a Parameter"),
    # a plain attribute does not follow .to(device): it passed on the CPU, failed on a GPU (issue #34)
    (order_variant(sinusoidal_store="plain"), "(?s)as a plain attribute, self.table: after model.to\\(torch.float"
                                             "(32|64)\\) it is still float(64|32).*Likely mistake: the sinusoidal "
                                             "table is a plain tensor attribute"),
    # saved in every state_dict, unlike FourierFeatures' frequencies (issue #52: it passed)
    (order_variant(sinusoidal_store="persistent"), "(?s)position table is the buffer 'table', and it appears in "
                                                  "state_dict.*persistent=False"),
    (order_variant(slice_table=False), "add the rows of positions 0 ... S-1"),
    (order_variant(sinusoidal_adds=False), "no positions were added, although positions='sinusoidal'"),
    (order_variant(none_adds=True), "positions='none' must add no position table"),
    (order_variant(check_name=False), "positions='rope'\\) should raise ValueError"),
    (order_variant(cast_logits=True), "should return logits in the module's dtype torch.float64, got "
                                      "torch.float32. The rule of this notebook: keep the input's dtype"),
    (order_variant(cast_float=True), "(?s)mixed dtype.*Likely mistake: something in your model computes in another "
                                     "dtype than the module's. The rule of this notebook"),
])
def test_order_transformer_diagnoses_known_mistakes(answer, hint):
    with pytest.raises(CheckFailure, match=hint):
        checks.check_order_transformer(answer, **CPU)


class OrderPositionsByToken(OrderNanoGPT):
    """A real mistake: the learned positions looked up with the token ids, wpe(tokens)."""

    def forward(self, tokens, mask=None):
        x = self.parts["wte"](tokens)
        if self.kind == "learned":
            x = x + self.parts["wpe"](tokens)
        elif self.kind == "sinusoidal":
            x = x + sinusoidal_stacked(tokens.size(1), x.size(-1)).to(x)
        return self.lm_head(self.parts["h"](x, mask=mask))


def test_order_transformer_names_positions_looked_up_by_token():
    # Token ids past max_len crash the lookup (the check's vocabularies are larger than max_len).
    with pytest.raises(CheckFailure, match="(?s)IndexError: index out of range.*indexed with the token ids"):
        checks.check_order_transformer(OrderPositionsByToken, **CPU)


def test_order_transformer_accepts_an_unused_table_and_names_a_used_one_for_none():
    """A table created in every mode (timm style) is fine for 'none' when it is not added."""
    class TableAlways(OrderNanoGPT):
        def __init__(self, vocab_size, embed_dim, num_heads, num_layers, max_len, positions="sinusoidal"):
            super().__init__(vocab_size, embed_dim, num_heads, num_layers, max_len, positions)
            self.pos_embed = nn.Parameter(0.02 * torch.randn(1, max_len, embed_dim))

        def forward(self, tokens, mask=None):
            x = self.parts["wte"](tokens)
            if self.kind != "none":
                x = x + (self.pos_embed[:, : tokens.size(1)] if self.kind == "learned"
                         else sinusoidal_stacked(tokens.size(1), x.size(-1)).to(x))
            return self.lm_head(self.parts["h"](x, mask))

    checks.check_order_transformer(TableAlways, **CPU)

    class AddsItForNone(TableAlways):
        def forward(self, tokens, mask=None):
            x = self.parts["wte"](tokens)
            x = x + (sinusoidal_stacked(tokens.size(1), x.size(-1)).to(x) if self.kind == "sinusoidal"
                     else self.pos_embed[:, : tokens.size(1)])
            return self.lm_head(self.parts["h"](x, mask))

    with pytest.raises(CheckFailure, match="positions='none' must add no position table"):
        checks.check_order_transformer(AddsItForNone, **CPU)


def test_order_transformer_contract():
    with pytest.raises(CheckFailure, match="take the parameters \\(vocab_size, embed_dim, num_heads, num_layers, "
                                           "max_len, positions\\)"):
        checks.check_order_transformer(lambda vocab_size, embed_dim, num_heads, num_layers, max_len: None, **CPU)

    class NoHead(OrderNanoGPT):
        def __init__(self, vocab_size, embed_dim, num_heads, num_layers, max_len, positions="sinusoidal"):
            super().__init__(vocab_size, embed_dim, num_heads, num_layers, max_len, positions)
            self.lm_head = nn.Identity()

    with pytest.raises(CheckFailure, match="should end with a linear head, nn.Linear\\(16, 11\\)"):
        checks.check_order_transformer(NoHead, **CPU)

    class OneHot(OrderNanoGPT):
        def __init__(self, vocab_size, embed_dim, num_heads, num_layers, max_len, positions="sinusoidal"):
            super().__init__(vocab_size, embed_dim, num_heads, num_layers, max_len, positions)
            self.parts["wte"] = nn.Linear(vocab_size, embed_dim)

    with pytest.raises(CheckFailure, match="(?s)should hold the token embedding.*token embedding is missing"):
        checks.check_order_transformer(OneHot, **CPU)


def test_order_transformer_must_run_the_students_transformer():
    """An answer that builds its own stack although the notebook defines Transformer is told to use it."""
    namespace = {"nn": nn, "Transformer": StackOfClones, "Base": OrderNanoGPT, "StackOfClones": StackOfClones}
    exec("class Own(nn.Module):\n"
         "    def __init__(self, embed_dim, num_heads, num_layers):\n"
         "        super().__init__()\n"
         "        self.layers = nn.ModuleList(StackOfClones(embed_dim, num_heads, 1).layers\n"
         "                                    for _ in range(num_layers))\n"
         "    def forward(self, x, mask=None):\n"
         "        for layer in self.layers:\n"
         "            x = layer(x, mask)\n"
         "        return x\n"
         "class OrderTransformer(Base):\n"
         "    def __init__(self, vocab_size, embed_dim, num_heads, num_layers, max_len, positions='sinusoidal'):\n"
         "        super().__init__(vocab_size, embed_dim, num_heads, num_layers, max_len, positions)\n"
         "        self.parts['h'] = Own(embed_dim, num_heads, num_layers)\n",
         namespace)
    with pytest.raises(CheckFailure, match="holds no instance of your Transformer"):
        checks.check_order_transformer(namespace["OrderTransformer"], **CPU)


def test_order_task_batches_hold_distinct_tokens_and_the_previous_one_as_target():
    tokens, targets = checks.previous_token_batch(50, torch.Generator().manual_seed(0))
    assert tokens.shape == targets.shape == (50, checks.ORDER_LENGTH)
    assert all(len(set(row)) == checks.ORDER_LENGTH for row in tokens.tolist())
    assert (targets[:, 0] == -100).all() and (targets[:, 1:] == tokens[:, :-1]).all()


@pytest.mark.slow
def test_order_outcome_passes_with_positions_and_catches_a_model_that_ignores_them(capsys):
    checks.check_order_transformer_outcome(order_variant(), device="cpu")
    assert "with sinusoidal positions" in capsys.readouterr().out
    with pytest.raises(CheckFailure, match="with sinusoidal positions, your OrderTransformer reached a token "
                                           "accuracy of 0\\.[0-5]"):
        checks.check_order_transformer_outcome(order_variant(sinusoidal_adds=False), **CPU)


@pytest.mark.slow
def test_order_outcome_catches_positions_that_leak_into_none():
    with pytest.raises(CheckFailure, match="above the ceiling 1/\\(S-1\\) = 0.143"):
        checks.check_order_transformer_outcome(order_variant(none_adds=True), **CPU)


def test_order_outcome_says_which_training_raised_the_same_in_the_lab_and_in_grading():
    """In grading the check's loop runs in the student's kernel (OrderTraining); an error of the
    model's forward during training is worded as in the lab, with the call that built the model."""
    class FailsWhileTraining(order_variant()):
        def forward(self, tokens, mask=None):
            if self.training:
                raise RuntimeError("dropout needs a generator")
            return super().forward(tokens, mask)

    with pytest.raises(CheckFailure, match=r"training OrderTransformer\(16, 32, 2, 2, 8, positions='sinusoidal'\) "
                                           r"raised RuntimeError: dropout needs a generator"):
        checks.check_order_transformer_outcome(FailsWhileTraining, **CPU)


def test_order_outcome_trains_in_the_students_process_not_across_the_bridge(where_checks_run):
    """Driven from the checker, 2 x 200 training steps took two crossings each (forward, backward):
    the check ran 4x slower graded than in the notebook. The loop is sent to the kernel instead,
    and the checker measures the accuracy with its own sequences."""
    if where_checks_run != "grading":
        pytest.skip("crossings are counted in grading")
    from attention_lab.checks import positions_and_blocks
    from tests.bridge_harness import bridged

    with bridged({"OrderTransformer": order_variant()}) as bridge:
        model_class = bridge.lookup(["OrderTransformer"])["OrderTransformer"]
        positions_and_blocks.check_order_transformer_outcome(model_class, **CPU)
        assert bridge.requests < 20, f"{bridge.requests} crossings for two training runs"


def _train_three_times_longer(self, model):
    """A rewritten OrderTraining.measure: three runs of the check's loop instead of one."""
    from attention_lab.checks import positions_and_blocks

    for seed in range(3):
        positions_and_blocks._train_order(model, None, seed, torch.device("cpu"))
    return {"raised": None}


# What a student who rewrites the course package in their kernel can make OrderTraining.measure
# (which runs there) do and report, and what the check, in the checker, concludes.
KERNEL_TRAINING_LIES = {
    # no training at all, "nothing raised": the checker measures the untrained model itself
    "skips the training": (lambda self, model: {"raised": None}, order_variant(),
                           r"with sinusoidal positions, your OrderTransformer reached a token accuracy of 0\.[0-8]"),
    # more training for a model that never sees the positions: none reaches 0.9 (the ceiling is 1/7)
    "trains longer a model that ignores positions": (_train_three_times_longer, order_variant(sinusoidal_adds=False),
                                                     r"with sinusoidal positions, .* accuracy of 0\.1"),
    # a report the checker did not ask for, claiming the accuracy itself
    "reports an accuracy": (lambda self, model: {"raised": None, "accuracy": 1.0}, order_variant(),
                            r"training OrderTransformer\(16, 32, 2, 2, 8, positions='sinusoidal'\): your notebook's "
                            r"kernel sent a malformed measurement of the training of your OrderTransformer"),
    "reports no dict": (lambda self, model: "trained, 1.0", order_variant(), r"sent a malformed measurement"),
    # an exception report the checker cannot read (its bases are not a list)
    "reports a malformed exception": (lambda self, model: {"raised": {"type": "X", "bases": 5}}, order_variant(),
                                      r"training OrderTransformer\(.*\): the kernel sent a malformed exception"),
}


@pytest.mark.parametrize("lie", KERNEL_TRAINING_LIES)
def test_order_outcome_is_measured_by_the_checker_whatever_the_kernel_says_of_its_training(where_checks_run, lie,
                                                                                         monkeypatch):
    """In grading the training loop runs in the student's kernel (OrderTraining): a rewritten loop
    can report anything, yet the accuracy is computed in the checker from the model's outputs, so a
    model that does not learn the order fails, and a report of another shape fails the test."""
    if where_checks_run != "grading":
        pytest.skip("the training is sent to the kernel in grading")
    from attention_lab.checks import positions_and_blocks
    from tests.bridge_harness import bridged

    kernel_measure, answer, message = KERNEL_TRAINING_LIES[lie]
    # the agent's copy of the probe (the checker only calls accept)
    monkeypatch.setattr(positions_and_blocks.OrderTraining, "measure", kernel_measure)
    with bridged({"OrderTransformer": answer}) as bridge:
        model_class = bridge.lookup(["OrderTransformer"])["OrderTransformer"]
        with pytest.raises(CheckFailure, match=message):
            positions_and_blocks.check_order_transformer_outcome(model_class, **CPU)


# --------------------------------------------------------------------------------------
# The dtype rule: a layer that computes in float32 inside
# --------------------------------------------------------------------------------------


class LayerNormInFloat32(LayerFloatMask):
    """A real mistake: LayerNorm fed x.float() (as in mixed-precision code) meets float64 weights."""

    def forward(self, x, mask=None):
        blocked = None if mask is None else ~mask
        h = self.norm1(x.float()).to(x.dtype)
        x = x + self.attn(h, h, h, attn_mask=blocked, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def test_a_layernorm_cast_to_float32_names_the_dtype_rule():
    with pytest.raises(CheckFailure, match="(?s)mixed dtype.*Likely mistake: part of your layer computes in another "
                                           "dtype.*keep the input's dtype \\(float64 in, float64 out\\)"):
        checks.check_transformer_layer(LayerNormInFloat32, **CPU)

    class Stack(StackOfClones):
        def __init__(self, embed_dim, num_heads, num_layers, mlp_ratio=4.0):
            super().__init__(embed_dim, num_heads, num_layers, mlp_ratio)

        def forward(self, x, mask=None):
            return super().forward(x, mask).float()

    with pytest.raises(CheckFailure, match="should keep the input dtype torch.float64, got torch.float32. The rule"):
        checks.check_transformer(Stack, **CPU)

    class FinalNormInFloat32(StackOfClones):
        def forward(self, x, mask=None):
            for layer in self.layers:
                x = layer(x, mask)
            return self.norm(x.float()).to(x.dtype)

    with pytest.raises(CheckFailure, match="(?s)mixed dtype.*keep the input's dtype"):
        checks.check_transformer(FinalNormInFloat32, **CPU)


# --------------------------------------------------------------------------------------
# The rose and the widgets
# --------------------------------------------------------------------------------------


def test_rose_is_a_deterministic_rgb_picture_with_fine_detail():
    rose = draw_rose(64)
    assert rose.shape == (64, 64, 3) and rose.dtype == np.float32
    assert 0.0 <= rose.min() and rose.max() <= 1.0
    np.testing.assert_array_equal(rose, draw_rose(64))
    # Fine detail: many sharp jumps between neighbouring pixels (the petal outlines).
    jumps = np.abs(np.diff(rose, axis=1)).max(-1)
    assert (jumps > 0.3).sum() > 60
    # Red petals in the middle, green stem near the bottom, pale background in a corner.
    assert rose[26, 32, 0] > rose[26, 32, 1] + 0.2
    assert rose[60, 32, 1] > rose[60, 32, 0]
    assert rose[2, 2].min() > 0.8
    with pytest.raises(ValueError, match="size = 4"):
        draw_rose(4)


def test_image_dataset_flattens_pixels_row_major_with_coordinates_in_unit_square():
    rose = draw_rose(16)
    coords, colors = image_dataset(rose, dtype=torch.float64)
    assert coords.shape == (256, 2) and colors.shape == (256, 3) and coords.dtype == torch.float64
    np.testing.assert_allclose(colors.reshape(16, 16, 3).numpy(), rose, rtol=0, atol=0)
    assert coords.min() == 0.0 and coords.max() == 1.0
    # Pixel (row 2, column 5) is (x, y) = (5/15, 2/15).
    torch.testing.assert_close(coords[2 * 16 + 5], torch.tensor([5 / 15, 2 / 15], dtype=torch.float64))
    assert pixel_coordinates(3, 4).shape == (3, 4, 2)


def test_positions_explorer_draws_the_table_and_the_dot_products():
    from attention_lab.widgets.positions import positions_explorer

    widget = positions_explorer(sinusoidal_stacked, num_positions=40, dim=16)
    heatmap_axes, dot_axes = widget.figure.axes[0], widget.figure.axes[1]  # (axes[2]: the colour bar)
    np.testing.assert_allclose(heatmap_axes.images[0].get_array(), sinusoidal_stacked(40, 16).numpy(), rtol=1e-6)
    dots = dot_axes.lines[0].get_ydata()
    assert int(np.argmax(dots)) == 20 and math.isclose(dots.max(), 8.0, rel_tol=1e-5)

    widget.controls["position"].value = 5
    dots = widget.figure.axes[1].lines[0].get_ydata()
    assert int(np.argmax(dots)) == 5

    widget.controls["dim"].value = 32
    assert widget.figure.axes[0].images[0].get_array().shape == (40, 32)
    assert math.isclose(widget.figure.axes[1].lines[0].get_ydata().max(), 16.0, rel_tol=1e-5)

    before = np.array(widget.figure.axes[0].images[0].get_array())
    widget.controls["base"].value = 100.0
    after = np.array(widget.figure.axes[0].images[0].get_array())
    np.testing.assert_allclose(after, sinusoidal_stacked(40, 32, base=100.0).numpy(), rtol=1e-5, atol=1e-6)
    assert not np.allclose(before, after)


def test_positions_explorer_lets_not_implemented_through():
    from attention_lab.widgets.positions import positions_explorer

    with pytest.raises(NotImplementedError):
        positions_explorer(_not_implemented)


def test_show_images_draws_one_panel_per_picture():
    from attention_lab.widgets.positions import show_images

    rose = draw_rose(16)
    widget = show_images({"target": rose, "half": torch.from_numpy(rose) * 0.5, "too bright": rose * 3})
    axes = widget.figure.axes
    assert [ax.get_title() for ax in axes] == ["target", "half", "too bright"]
    np.testing.assert_allclose(axes[1].images[0].get_array(), rose * 0.5, rtol=1e-6)
    assert np.asarray(axes[2].images[0].get_array()).max() <= 1.0  # clipped for display
    assert widget._repr_mimebundle_()["image/png"]


# --------------------------------------------------------------------------------------
# The notebooks' own cells leave the student's helpers alone (notebooks 03 and 04)
# --------------------------------------------------------------------------------------

# Names that answers really give their helper functions (the Annotated Transformer's `attention`,
# vit-explain's `rollout`, timm's `block`, ...). A demo cell that assigns one at top level
# replaces the student's helper, and a later check of an answer that calls it fails far from
# the cause. The corpus runs such answers through the notebooks; this catches it without a kernel.
HELPER_NAMES = {"attention", "softmax", "rollout", "block", "layer", "patches", "heads", "predict", "rotate",
                "mask", "split_heads", "merge_heads", "positions", "encode", "clones"}


def _top_level_names(source: str) -> set[str]:
    import ast

    names = set()
    for node in ast.parse(source).body:
        targets = []
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.For, ast.With)):
            targets = [node.target] if isinstance(node, ast.For) else [item.optional_vars for item in node.items]
        for target in filter(None, targets):  # (a `with` without `as` binds nothing)
            names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


@pytest.mark.parametrize("assignment", ["03_positions_and_blocks", "04_vision_transformer"])
def test_demo_cells_do_not_rebind_helper_names(assignment):
    cells = solution_cells(assignment)
    demo_code = [cell.source for cell in cells if cell.cell_type == "code"
                 and "answer" not in cell.metadata and "test" not in cell.metadata]
    # The source format marks cells `answer=` / `test=` in the header: jupytext keeps them as metadata.
    assert len(demo_code) < len([cell for cell in cells if cell.cell_type == "code"])
    clobbered = {name for code in demo_code for name in _top_level_names(code)} & HELPER_NAMES
    assert not clobbered, f"{assignment}: demo cells rebind helper names {sorted(clobbered)}"


def test_transformer_failure_names_the_students_failing_layer():
    """Transformer uses TransformerLayer: a post-norm layer is named as the cause when Transformer's check fails."""
    namespace = {"nn": nn, "TransformerLayer": layer_variant(post_norm=True), "Base": StackOfClones}
    exec("class Transformer(Base):\n"
         "    def __init__(self, embed_dim, num_heads, num_layers, mlp_ratio=4.0):\n"
         "        super().__init__(embed_dim, num_heads, num_layers, mlp_ratio)\n"
         "        self.layers = nn.ModuleList(TransformerLayer(embed_dim, num_heads, mlp_ratio) for _ in range(num_layers))\n",
         namespace)
    with pytest.raises(CheckFailure, match="(?s)uses your TransformerLayer, which fails its own check"):
        checks.check_transformer(namespace["Transformer"], **CPU)


# --------------------------------------------------------------------------------------
# The NoPE + causal prediction, the ceiling's derivation, and previous_token_score
# --------------------------------------------------------------------------------------


def test_answer_nope_causal_and_the_derivations_come_only_with_the_right_answer(capsys):
    checks.check_answer_nope_causal(" c ", device="cpu")
    checks.check_answer_no_positions("C", device="cpu")
    printed = capsys.readouterr().out
    assert "most recent one it can see" in printed and "1/(S - 1) = 1/7" in printed
    for letter, phrase in (("A", "Is a causal model still one"), ("B", "guessing among the tokens it can see")):
        with pytest.raises(CheckFailure, match=phrase) as failure:
            checks.check_answer_nope_causal(letter, **CPU)
        assert "most recent one it can see" not in str(failure.value)
    with pytest.raises(CheckFailure, match="Which of them came just before") as failure:
        checks.check_answer_no_positions("A", **CPU)
    assert "1/(S - 1) = 1/7" not in str(failure.value)


def score_by_index(attention):
    """A correct answer: gather the sub-diagonal with index tensors."""
    attention = torch.stack(list(attention), 1) if isinstance(attention, list) else attention
    if attention.dim() != 5 or attention.shape[-1] != attention.shape[-2] or attention.shape[-1] == 1:
        raise ValueError(f"bad attention shape {tuple(attention.shape)}")
    queries = torch.arange(1, attention.shape[-1], device=attention.device)
    return attention[..., queries, queries - 1].mean(dim=(0, -1))


def _score(pick, checks_input=True):
    """A wrong answer: the input stacked and (unless told not to) validated, then ``pick``."""
    def previous_token_score(attention):
        attention = torch.stack(list(attention), 1) if isinstance(attention, list) else attention
        if checks_input and (attention.dim() != 5 or attention.shape[-1] != attention.shape[-2]
                             or attention.shape[-1] == 1):
            raise ValueError(f"bad attention shape {tuple(attention.shape)}")
        return pick(attention)
    return previous_token_score


def test_previous_token_score_accepts_a_correct_answer():
    checks.check_previous_token_score(score_by_index, **CPU)
    checks.check_previous_token_score(score_by_index, seed=3132, **CPU)


@pytest.mark.parametrize("wrong, phrase", [
    (_score(lambda a: a.diagonal(0, -2, -1).mean(dim=(0, -1))), "you averaged the diagonal"),
    (_score(lambda a: a.diagonal(1, -2, -1).mean(dim=(0, -1))), "the next token"),
    (_score(lambda a: a.diagonal(-1, -2, -1).sum(-1).mean(0) / a.shape[-1]), "it has S - 1 entries"),
    (_score(lambda a: a.diagonal(-1, -2, -1).mean(dim=(0, 1))), "averaged over the wrong axes"),
    (_score(lambda a: a.diagonal(-1, -2, -1).mean(dim=(1, -1))), "averaged over the wrong axes"),
    (_score(lambda a: a.diagonal(-1, -2, -1).mean(dim=(0, -1)).transpose(0, 1)), "averaged over the wrong axes"),
    (_score(lambda a: a.diagonal(-1, -2, -1).float().mean(dim=(0, -1))), "should keep the input dtype"),
    (_score(lambda a: a.diagonal(-1, -2, -1).mean(dim=(0, -1)), checks_input=False), "should raise ValueError"),
    (lambda attention: score_by_index(attention).double(), "should keep the input dtype"),
])
def test_previous_token_score_names_the_mistake(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_previous_token_score(wrong, **CPU)



# --------------------------------------------------------------------------------------
# ANSWER_PERMUTATION's explanation, and pe_shift_matrix's hints
# --------------------------------------------------------------------------------------


def test_answer_permutation_explains_itself_only_once_it_is_right(capsys):
    checks.check_answer_permutation("B", device="cpu")
    assert "says where a token sits" in capsys.readouterr().out
    for letter in "AC":
        with pytest.raises(CheckFailure) as failure:
            checks.check_answer_permutation(letter, **CPU)
        assert "says where a token sits" not in str(failure.value)


def test_no_hint_of_pe_shift_matrix_writes_its_block_out():
    """A hint names the mistake; it does not hand over the answer (the block [[cos t, sin t], [-sin t, cos t]])."""
    for hint in checks.PE_SHIFT_HINTS.values():
        assert "[[cos" not in hint and "-sin t, cos t" not in hint, hint
    with pytest.raises(CheckFailure) as failure:
        checks.check_pe_shift_matrix(shift_variant(sign=-1.0), **CPU)
    assert "[[cos" not in str(failure.value)


# --------------------------------------------------------------------------------------
# induction_score
# --------------------------------------------------------------------------------------


def induction_score_by_loops(attention, tokens):
    """A correct answer written another way: plain loops over sequences, queries and earlier positions."""
    attention = torch.stack(list(attention), 1) if isinstance(attention, list) else attention
    if attention.dim() != 5 or attention.shape[-1] != attention.shape[-2] \
            or tuple(tokens.shape) != (attention.shape[0], attention.shape[-1]):
        raise ValueError(f"attention {tuple(attention.shape)} and tokens {tuple(tokens.shape)} do not match")
    total, pairs = torch.zeros(attention.shape[1:3], dtype=attention.dtype, device=attention.device), 0
    for b in range(tokens.shape[0]):
        for i in range(tokens.shape[1]):
            keys = [j + 1 for j in range(i - 1) if tokens[b, j] == tokens[b, i]]
            if keys:
                total += attention[b, :, :, i, keys].sum(-1)
                pairs += 1
    return total / max(pairs, 1)


def induction_score_by_einsum(attention, tokens):
    """Another correct answer: a one-hot of the keys built with a shifted comparison, summed by einsum."""
    maps = torch.stack(attention, dim=1) if isinstance(attention, (list, tuple)) else attention
    if maps.dim() != 5 or maps.shape[-2] != maps.shape[-1] or tokens.shape != maps.shape[:1] + maps.shape[-1:]:
        raise ValueError("shapes do not match")
    s = tokens.shape[1]
    before_key = torch.cat([torch.full_like(tokens[:, :1], -1), tokens[:, :-1]], dim=1)   # the token at k - 1
    keys = (before_key[:, None, :] == tokens[:, :, None]) & torch.ones(s, s, dtype=torch.bool,
                                                                      device=tokens.device).tril(-1)
    counted = keys.any(-1)
    weight = torch.einsum("blhqk,bqk->lh", maps, (keys & counted[..., None]).to(maps.dtype))
    return weight / counted.sum().clamp(min=1).to(maps.dtype)


def test_induction_score_accepts_correct_answers():
    for answer in (induction_score_by_loops, induction_score_by_einsum):
        checks.check_induction_score(answer, **CPU)
        checks.check_induction_score(answer, seed=3151, **CPU)


def _induction(pick):
    """A wrong induction_score: the input validated as the contract says, then ``pick(maps, tokens)``."""
    def induction_score(attention, tokens):
        maps = torch.stack(list(attention), 1) if isinstance(attention, list) else attention
        if maps.dim() != 5 or maps.shape[-1] != maps.shape[-2] or tokens.shape != (maps.shape[0], maps.shape[-1]):
            raise ValueError("shapes do not match")
        return pick(maps, tokens)
    return induction_score


def _keys(tokens, shift=1, gap=2):
    s = tokens.shape[1]
    earlier = (tokens[:, :, None] == tokens[:, None, :]) & (torch.arange(s)[None, :] <= torch.arange(s)[:, None] - gap)
    return earlier.roll(shift, dims=-1) if shift else earlier, earlier.any(-1)


def _pooled(maps, keys, counted):
    weight = (maps * keys[:, None, None].to(maps.dtype)).sum(-1)
    return (weight * counted[:, None, None]).sum((0, -1)) / counted.sum()


@pytest.mark.parametrize("wrong, phrase", [
    (_induction(lambda m, t: _pooled(m, _keys(t, shift=0)[0], _keys(t)[1])), "the earlier occurrence j itself"),
    (_induction(lambda m, t: _pooled(m, *_keys(t, gap=1))), "you counted j = i - 1 too"),
    (_induction(lambda m, t: (m * _keys(t)[0][:, None, None].to(m.dtype)).sum(-1).mean((0, -1))),
     "counting those whose token never appeared before as 0"),
    (_induction(lambda m, t: torch.stack([_pooled(m[b:b + 1], *_keys(t[b:b + 1])) for b in range(t.shape[0])
                                          if _keys(t[b:b + 1])[1].any()]).mean(0)),
     "averaged the queries of each sequence first"),
    (_induction(lambda m, t: _pooled(m, _keys(t)[0] & (_keys(t)[0].cumsum(-1) == 1), _keys(t)[1])),
     "you counted one earlier occurrence per query"),
    (_induction(lambda m, t: (m * _keys(t)[0][:, None, None].to(m.dtype)).sum(-1).sum((0, -1))
                / _keys(t)[1].sum()), "not 0 / 0 = NaN"),
    (_induction(lambda m, t: _pooled(m, *_keys(t)).transpose(0, 1)), "averaged over the wrong axes"),
    (_induction(lambda m, t: _pooled(m, *_keys(t)).float()), "should keep the input dtype"),
    (lambda attention, tokens: induction_score_by_loops(torch.stack(list(attention), 1) if isinstance(attention, list)
                                                        else attention, tokens[:, :attention[0].shape[-1]]
                                                        if isinstance(attention, list) else tokens[:, :attention.shape[-1]]),
     "should raise ValueError"),
])
def test_induction_score_names_the_mistake(wrong, phrase):
    with pytest.raises(CheckFailure, match=re.escape(phrase) if "=" in phrase or "/" in phrase else phrase):
        checks.check_induction_score(wrong, **CPU)


# --------------------------------------------------------------------------------------
# induction_model
# --------------------------------------------------------------------------------------


class HandSetModel(nn.Module):
    """Two causal heads on a residual stream, written another way than the notebook's: one stacked parameter per
    layer for the four matrices, the scores through einsum, the maps kept from the last call."""

    def __init__(self, vocab_size, max_len, width, causal=True):
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(vocab_size + max_len, width))   # tokens, then positions
        self.heads = nn.Parameter(torch.zeros(2, 4, width, width))             # [layer, (q, k, v, o), D, D]
        self.readout = nn.Parameter(torch.zeros(width, vocab_size))
        self.vocab_size, self.causal = vocab_size, causal

    def maps_and_logits(self, tokens):
        s = tokens.shape[1]
        x = self.embed[tokens] + self.embed[self.vocab_size:self.vocab_size + s]
        maps = []
        for w_q, w_k, w_v, w_o in self.heads:
            scores = torch.einsum("bqd,bkd->bqk", x @ w_q, x @ w_k)
            if self.causal:
                scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1), -torch.inf)
            weights = scores.softmax(-1)
            x = x + weights @ x @ w_v @ w_o
            maps.append(weights.unsqueeze(1))
        return maps, x @ self.readout

    def forward(self, tokens):
        return self.maps_and_logits(tokens)[1]

    def attention(self, tokens):
        return self.maps_and_logits(tokens)[0]


def hand_set(vocab_size, max_len, *, strength=16.0, second_strength=16.0, shift=1, swap_layers=False, swap_roles=False, key_reads_token=False,
             value_reads_previous=False, no_readout=False, guard_position_zero=True, causal=True):
    """The induction model (or one deliberate mistake) in the layout [previous | token | copied | position]. Key 0
    is kept off layer 2 by a key that also subtracts its own token (another way than the notebook's)."""
    v, n = vocab_size, max_len
    previous, token, copied, position = (slice(0, v), slice(v, 2 * v), slice(2 * v, 3 * v), slice(3 * v, 3 * v + n))
    model = HandSetModel(v, n, 3 * v + n, causal=causal)
    eye_v = torch.eye(v)
    with torch.no_grad():
        model.embed[:v, token] = eye_v
        model.embed[v:, position] = torch.eye(n)
        first, second = model.heads
        first[0][position, position] = strength * torch.diag(torch.ones(n - shift), -shift) if shift >= 0 else \
            strength * torch.diag(torch.ones(n + shift), -shift)
        first[1][position, position] = torch.eye(n)
        first[2][token, token] = eye_v
        first[3][token, previous] = eye_v
        query, key = (previous, token) if swap_roles else (token, token if key_reads_token else previous)
        second[0][query, token] = second_strength * eye_v
        second[1][key, token] = eye_v
        if guard_position_zero and not (swap_roles or key_reads_token):
            second[1][token, token] -= eye_v            # the key at 0 "previous = own token" cancels out
        second[2][previous if value_reads_previous else token, token] = eye_v
        second[3][token, copied] = eye_v
        if not no_readout:
            model.readout[copied] = eye_v
        if swap_layers:
            model.heads.copy_(model.heads.flip(0).clone())
    return model


def induction_variant(**mistakes):
    def induction_model(vocab_size, max_len):
        return hand_set(vocab_size, max_len, **mistakes)
    return induction_model


def test_induction_model_accepts_a_model_written_another_way(capsys):
    checks.check_induction_model(induction_variant(), device="cpu")
    assert "accuracy on the second half: 1.000" in capsys.readouterr().out
    checks.check_induction_model_properties(induction_variant(), **CPU)
    checks.check_induction_model(induction_variant(), seed=3161, **CPU)


class PeeksAtTheFuture(nn.Module):
    """attention() returns the causal maps of a correct model, but forward copies the next token."""

    def __init__(self, vocab_size, max_len):
        super().__init__()
        self.honest = hand_set(vocab_size, max_len)

    def forward(self, tokens):
        return F.one_hot(tokens.roll(-1, dims=1), self.honest.vocab_size).float()

    def attention(self, tokens):
        return self.honest.attention(tokens)


class ReturnsScores(nn.Module):
    """A correct forward pass, but attention() returns each layer's map times 2 (not a distribution)."""

    def __init__(self, vocab_size, max_len):
        super().__init__()
        self.honest = hand_set(vocab_size, max_len)

    def forward(self, tokens):
        return self.honest(tokens)

    def attention(self, tokens):
        return [2 * weights for weights in self.honest.attention(tokens)]


@pytest.mark.parametrize("mistakes, phrase", [
    (dict(swap_layers=True), "the two heads are in the wrong order"),
    (dict(shift=0), "attends to the query's own position"),
    (dict(shift=-1), "does not attend to the previous position"),
    (dict(swap_roles=True), "query and key have swapped roles"),
    (dict(key_reads_token=True), "matches the current token with the key's own token"),
    (dict(value_reads_previous=True), "the model predicts the current token"),
    (dict(no_readout=True), "but the predictions are not"),
    (dict(guard_position_zero=False), "position 0 has no previous token"),
    (dict(causal=False), "puts weight on future keys"),
])
def test_induction_model_names_the_mistake(mistakes, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_induction_model(induction_variant(**mistakes), **CPU)


@pytest.mark.parametrize("model, check, phrase", [
    (PeeksAtTheFuture, checks.check_induction_model, "its forward pass sees the future"),
    (ReturnsScores, checks.check_induction_model_properties, "must return the softmax weights"),
])
def test_induction_model_checks_read_the_forward_pass_and_the_maps_apart(model, check, phrase):
    def induction_model(vocab_size, max_len):
        return model(vocab_size, max_len)

    with pytest.raises(CheckFailure, match=phrase):
        check(induction_model, **CPU)


@pytest.mark.parametrize("mistakes, phrase", [
    (dict(second_strength=2.0), r"layer 2's induction score is 0\.\d+"),
    (dict(shift=0), r"layer 1 puts 0\.\d+ of its weight on the previous position"),
    (dict(strength=1.5), "the heads attend to the right keys, but not sharply"),
])
def test_induction_model_properties_read_both_heads(mistakes, phrase):
    """Soft heads can still predict right (the largest weight is on the right key): only the maps show it."""
    checks.check_induction_model(induction_variant(strength=1.5), **CPU)
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_induction_model_properties(induction_variant(**mistakes), **CPU)


def test_induction_model_contract_names_a_missing_attention_method_and_a_wrong_return():
    with pytest.raises(CheckFailure, match="should have a method attention"):
        checks.check_induction_model(lambda vocab_size, max_len: PlainLogits(vocab_size), **CPU)
    with pytest.raises(CheckFailure, match="should return an nn.Module"):
        checks.check_induction_model(lambda vocab_size, max_len: "a model", **CPU)


class PlainLogits(nn.Module):
    """Logits of the right shape, and no attention method."""

    def __init__(self, vocab_size):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, tokens):
        return torch.zeros(*tokens.shape, self.vocab_size)


def test_repeated_sequences_hold_distinct_tokens_then_the_same_again():
    tokens = checks.repeated_sequences(50, 12, 7, torch.Generator().manual_seed(0))
    assert tokens.shape == (50, 14)
    assert all(len(set(row[:7])) == 7 for row in tokens.tolist())
    assert torch.equal(tokens[:, :7], tokens[:, 7:])
