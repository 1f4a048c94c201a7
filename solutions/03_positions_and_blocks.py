# %% [markdown]
# # 03 — Positions and the Transformer block
#
# Self-attention compares every token with every other token — and has no idea where any of
# them sits. In this notebook you will *see* that (permute the tokens and the outputs just
# permute along), fix it with the Transformer's sinusoidal position encoding, meet its
# cousin the Fourier-feature encoding by teaching a small network to paint a rose, and
# assemble the pre-norm Transformer layer and check it against PyTorch's own
# `nn.TransformerEncoderLayer`. Then you train a small Transformer on a task that needs
# order, with and without positions, and look inside its trained heads. Finally, one step
# deeper: two heads that copy from the context — an induction head — built by hand.
#
# **39 points, about 170 minutes.**
#
# **Notation** (as in every notebook): `B` batch, `S` sequence length, `D` model width, `H`
# heads. **Masks** are boolean with **True = may attend**; `nn.MultiheadAttention` uses the
# opposite meaning (True = blocked), which matters in exercise 3.9.
#
# **Dtypes.** Keep the input's dtype: float64 in, float64 out. The checks run your modules in
# float64, where rounding is far too small to hide a mistake; nothing inside may cast to
# float32 (exercise 3.9 says more).

# %%
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# Every model in this notebook is tiny: on a CPU, splitting each small matmul across threads
# costs more than it saves (and a busy machine makes it much worse), so use one thread.
torch.set_num_threads(1)

# %% [markdown]
# ## 1. Self-attention does not know the order of its tokens
#
# Take a sequence of `S` token vectors, run it through self-attention, then do the same with
# the tokens shuffled. What happens to the outputs? Look at `softmax(Q Kᵀ / sqrt(d_head)) V`
# and ask what, in it, refers to *where* a token sits.

# %% [markdown]
# ### Exercise 3.1 — permutation (1 pt, ~2 min)
#
# **Predict before you run anything.** Which word describes what shuffling the tokens does to
# self-attention? Set `ANSWER_PERMUTATION` to `"A"`, `"B"` or `"C"`, then run the experiment
# below your answer.
#
# * **A.** Self-attention is permutation-**invariant**: shuffling the tokens leaves every
#   output unchanged.
# * **B.** Self-attention is permutation-**equivariant**: shuffling the tokens shuffles the
#   outputs in exactly the same way.
# * **C.** Neither: shuffling the tokens changes the outputs unpredictably.

# %% answer="ANSWER_PERMUTATION"
ANSWER_PERMUTATION = None  # "A", "B" or "C"
### BEGIN SOLUTION
ANSWER_PERMUTATION = "B"
### END SOLUTION

# %% [markdown]
# Now the experiment, with PyTorch's `nn.MultiheadAttention` (untrained: its weights are
# random, which is all this needs):

# %%
B, S, D, H = 1, 6, 16, 4
untrained_attention = nn.MultiheadAttention(D, H, batch_first=True).to(device)
tokens = torch.randn(B, S, D, device=device)           # [B, S, D]
permutation = torch.tensor([3, 0, 5, 1, 4, 2], device=device)

with torch.no_grad():
    out, _ = untrained_attention(tokens, tokens, tokens)  # [B, S, D]
    tokens_shuffled = tokens[:, permutation]             # the same tokens, new order
    out_shuffled, _ = untrained_attention(tokens_shuffled, tokens_shuffled, tokens_shuffled)

print("outputs changed by the shuffle?        ",
      not torch.allclose(out_shuffled, out, atol=1e-5))
print("outputs shuffled the same way as input?",
      torch.allclose(out_shuffled, out[:, permutation], atol=1e-5))

# %% test="test_ANSWER_PERMUTATION" points=1
"""ANSWER_PERMUTATION: the right word for what shuffling the tokens does to self-attention."""
from attention_lab.checks.positions_and_blocks import check_answer_permutation

check_answer_permutation(ANSWER_PERMUTATION)

# %% [markdown]
# For a bag of words that is fine; for language it is not: "dog bites man" and "man bites
# dog" contain the same tokens. (You may read that Transformers are permutation
# *invariant*; a pooled sentence vector is, but the token outputs are equivariant.) The fix
# is to make each input vector carry its position: add a **position encoding** `PE[p]` to
# the token at position `p`. Then the same word at two different places is two different
# vectors.
#
# ## 2. Sinusoidal position encodings
#
# The original Transformer (Vaswani et al., 2017) uses a fixed table: for position `p` and
# feature pair `i = 0 … D/2 - 1`,
#
# $$PE[p, 2i] = \sin\!\left(\frac{p}{\text{base}^{2i/D}}\right), \qquad
#   PE[p, 2i+1] = \cos\!\left(\frac{p}{\text{base}^{2i/D}}\right), \qquad \text{base} = 10000.$$
#
# Each pair `(2i, 2i+1)` is a point on a circle that turns with the position, at angular
# frequency `ω_i = base^(-2i/D)`: pair 0 turns by one radian per position, the last pairs
# turn so slowly that they tell far-apart positions apart. Sines and cosines are
# **interleaved**: even features are sines, odd features are cosines.

# %% [markdown]
# ### Exercise 3.2 — sinusoidal_positions (3 pts, ~10 min)
#
# Return the `[num_positions, dim]` table above (float32, the default dtype; positions
# `p = 0 … num_positions - 1`). `dim` must be even: raise a `ValueError` naming `dim`
# otherwise. Tip: compute the angles `p · ω_i` as an outer product `[P, 1] * [1, D/2]`, then
# write the sines into the even columns (`pe[:, 0::2]`) and the cosines into the odd ones.

# %% answer="sinusoidal_positions"
def sinusoidal_positions(num_positions, dim, base=10000.0):
    """The Transformer's sinusoidal position encodings.

    PE[p, 2i] = sin(p / base^(2i/dim)),  PE[p, 2i+1] = cos(p / base^(2i/dim))
    returns: [num_positions, dim] (float32)

    Example: sinusoidal_positions(3, 4)[1] == [sin(1), cos(1), sin(0.01), cos(0.01)]
    Raises ValueError if dim is odd.
    """
    ### BEGIN SOLUTION
    if dim % 2 != 0:
        raise ValueError(f"dim = {dim} must be even (features come in sin/cos pairs)")
    positions = torch.arange(num_positions, dtype=torch.float32)[:, None]            # [P, 1]
    frequencies = base ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)     # [D/2]
    angles = positions * frequencies[None, :]                                        # [P, D/2]
    pe = torch.zeros(num_positions, dim)
    pe[:, 0::2] = torch.sin(angles)
    pe[:, 1::2] = torch.cos(angles)
    return pe
    ### END SOLUTION


# %% test="test_sinusoidal_positions" points=3
"""sinusoidal_positions: [P, D] interleaved sin/cos, odd-dim error; positions break equivariance."""
from attention_lab.checks.positions_and_blocks import (
    check_positions_break_equivariance, check_sinusoidal_positions)

check_sinusoidal_positions(sinusoidal_positions)
check_positions_break_equivariance(sinusoidal_positions)
### BEGIN HIDDEN TESTS
check_sinusoidal_positions(sinusoidal_positions, seed=3201, device="cpu")
check_positions_break_equivariance(sinusoidal_positions, seed=3202, device="cpu")
### END HIDDEN TESTS

# %%
pe = sinusoidal_positions(50, 16)
print("PE:", tuple(pe.shape), "| PE[1, :4] =", pe[1, :4].tolist())
print("every row has norm sqrt(D/2):",
      torch.allclose(pe.norm(dim=-1), torch.full((50,), math.sqrt(8.0))))

# %% [markdown]
# Now add your encodings to the tokens of section 1 and shuffle again. The positions stay
# where they are (position 0 is still the first slot), so a shuffled token now meets a
# different `PE[p]`:

# %%
pe = sinusoidal_positions(S, D).to(device)              # [S, D], broadcast over the batch
with torch.no_grad():
    with_positions = tokens + pe
    shuffled_with_positions = tokens[:, permutation] + pe
    out, _ = untrained_attention(with_positions, with_positions, with_positions)
    out_shuffled, _ = untrained_attention(
        shuffled_with_positions, shuffled_with_positions, shuffled_with_positions)
print("with positions, outputs shuffled the same way as input?",
      torch.allclose(out_shuffled, out[:, permutation], atol=1e-5))

# %% [markdown]
# **Look at it.** Left: the table as a heatmap (a row per position); the first columns
# oscillate fast, the last ones barely move. Right: the dot product `PE[p₀] · PE[p]` against
# `p`. It peaks at `p = p₀` and depends only on the offset `p - p₀`, because
# `sin(a)sin(b) + cos(a)cos(b) = cos(a - b)`: every pair contributes `cos((p - p₀) ω_i)`.
# Drag `p₀` — the curve slides but keeps its shape. Change the base and the width to see how
# the frequencies spread. (This holds for the raw table; after exercise 3.4 you will see what
# attention's learned projections do to it.)

# %%
from attention_lab.widgets.positions import positions_explorer

positions_explorer(sinusoidal_positions, num_positions=64)

# %% [markdown]
# ### Exercise 3.3 — predict: one matrix for every position? (1 pt, ~3 min)
#
# **Predict before you build it.** Fix an offset `k` (say `k = 3`). Is there one matrix `M`
# such that `PE[p + k] = M @ PE[p]` for *every* position `p`? Set `ANSWER_SHIFT` to `"A"`,
# `"B"` or `"C"`, then build the matrix (if there is one) in the next exercise.
#
# * **A.** No: the entries of `PE[p]` are sines of `p · ω_i`, so moving by `k` is a
#   non-linear change that a single matrix cannot make for every `p`; `M` would have to
#   depend on `p` too.
# * **B.** Yes: one matrix per offset `k`, the same for every `p`.
# * **C.** Only when `k · ω_i` is a multiple of `2π` for every frequency, i.e. for no
#   practical `k` but 0.

# %% answer="ANSWER_SHIFT"
ANSWER_SHIFT = None  # "A", "B" or "C"
### BEGIN SOLUTION
ANSWER_SHIFT = "B"
### END SOLUTION

# %% test="test_ANSWER_SHIFT" points=1
"""ANSWER_SHIFT: a fixed matrix moves every sinusoidal encoding by the same offset."""
from attention_lab.checks.positions_and_blocks import check_answer_shift

check_answer_shift(ANSWER_SHIFT)

# %% [markdown]
# ### Exercise 3.4 — pe_shift_matrix, then a `W_qᵀ W_k` that keeps the offset (4 pts, ~23 min)
#
# (3 points for `pe_shift_matrix`, 1 for `offset_only_qk` further down.)
#
# Work it out on one pair of features: pair `i` of `PE[p]` is `(sin(p ω_i), cos(p ω_i))`, and
# pair `i` of `PE[p + k]` is `(sin((p + k) ω_i), cos((p + k) ω_i))`. Expand both with the
# angle-addition formulas: the result is a fixed `2 × 2` matrix (it depends on `k ω_i`, not on
# `p`) applied to the pair of `PE[p]`. Put one such block per pair on the diagonal of a
# `[dim, dim]` matrix of zeros, where `sinusoidal_positions` keeps that pair (its layout:
# features `2i` and `2i + 1`). Return it in float32 (the default dtype, like the table); an
# odd `dim` raises a `ValueError` naming `dim`. A negative offset moves the positions back.

# %% answer="pe_shift_matrix"
def pe_shift_matrix(offset, dim, base=10000.0):
    """The matrix that moves a sinusoidal encoding by `offset` positions.

    returns: [dim, dim] (float32), block-diagonal with one 2x2 rotation per feature pair, such
    that sinusoidal_positions(P, dim)[p + offset] == pe_shift_matrix(offset, dim) @ PE[p].

    Example: pe_shift_matrix(0, 4) is the 4x4 identity.
    Raises ValueError if dim is odd.
    """
    ### BEGIN SOLUTION
    if dim % 2 != 0:
        raise ValueError(f"dim = {dim} must be even (features come in sin/cos pairs)")
    frequencies = base ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)   # [D/2]
    angles = offset * frequencies                                                  # [D/2]
    cos, sin = torch.cos(angles), torch.sin(angles)
    even = torch.arange(0, dim, 2)                                                 # sines
    matrix = torch.zeros(dim, dim)
    matrix[even, even] = cos            # sin(a + b) = sin a cos b + cos a sin b
    matrix[even, even + 1] = sin
    matrix[even + 1, even] = -sin       # cos(a + b) = cos a cos b - sin a sin b
    matrix[even + 1, even + 1] = cos
    return matrix
    ### END SOLUTION


# %% test="test_pe_shift_matrix" points=3
"""pe_shift_matrix: [D, D] block rotations, PE[p + k] == M @ PE[p] for every p; odd-dim error."""
from attention_lab.checks.positions_and_blocks import check_pe_shift_matrix

check_pe_shift_matrix(pe_shift_matrix)
### BEGIN HIDDEN TESTS
check_pe_shift_matrix(pe_shift_matrix, seed=3401, device="cpu")
### END HIDDEN TESTS

# %% [markdown]
# A rotation keeps lengths and angles, so `PE[p + k] · PE[q + k] = PE[p] · PE[q]`: moving
# both positions by the same amount changes no dot product, which is why `PE[p₀] · PE[p]`
# depends only on `p - p₀`. But attention never compares raw encodings: it compares
# `q = W_q x` with `k = W_k x`, learned projections. Then the score of two positions is
# `PE[p]ᵀ W_qᵀ W_k PE[q]`, and the rotations cancel only if `M = W_qᵀ W_k` commutes with them:
# `PE[p + k]ᵀ M PE[q + k] = PE[p]ᵀ R_kᵀ M R_k PE[q]`, which equals `PE[p]ᵀ M PE[q]` for every
# `p, q` when `R_kᵀ M R_k = M`. A generic pair of projections does not commute with the
# rotations. Which `M` does? Two 2-D rotations commute with each other, and so does a rotation
# with a multiple of one: a **scaled rotation** `a · R(θ)`.
#
# **Worked on one pair**, with numbers (the cell below): let `R` move the pair by `k·ω = 0.5`
# rad. A generic `M = [[1, 2], [0, 1]]` comes out of `Rᵀ M R` changed — the score of two
# positions changes when both move by `k`. A scaled rotation `M = 2·R(0.3)` comes out unchanged:
# `Rᵀ M R = 2 · R(−0.5) R(0.3) R(0.5) = 2 · R(0.3)`, because rotations of the plane add their
# angles, in any order.

# %%
def pair_rotation(angle):
    """pe_shift_matrix's 2 x 2 block: moves one (sin, cos) pair forward by `angle`."""
    return torch.tensor([[math.cos(angle), math.sin(angle)], [-math.sin(angle), math.cos(angle)]],
                        dtype=torch.float64)


shift = pair_rotation(0.5)  # one pair, both positions moved by k·ω = 0.5 rad
for name, M in (("a generic M", torch.tensor([[1.0, 2.0], [0.0, 1.0]], dtype=torch.float64)),
                ("a scaled rotation 2·R(0.3)", 2 * pair_rotation(0.3))):
    print(f"{name}: M = {M.numpy().round(3).tolist()}, "
          f"Rᵀ M R = {(shift.T @ M @ shift).numpy().round(3).tolist()}")

# %% [markdown]
# **Find one.** Write `offset_only_qk(scales, angles)`: the `[D, D]` matrix with one scaled
# rotation per frequency pair on its diagonal, pair `i` where `sinusoidal_positions` keeps it
# (features `2i` and `2i + 1`), zeros elsewhere. Its block is `pe_shift_matrix`'s block with
# the angle `angles[i]`, times `scales[i]`:
#
# | name | signature | contract |
# | --- | --- | --- |
# | `offset_only_qk` | `(scales, angles) -> Tensor` | `scales`, `angles`: `[D/2]` → `[D, D]` block-diagonal, block `i` at rows and columns `2i, 2i+1` equal to `scales[i] · [[cos t, sin t], [−sin t, cos t]]` with `t = angles[i]`; the dtype and device of `scales`; `ValueError` naming both lengths when `scales` and `angles` differ in length |
#
# The check measures what it promises: `PE[p]ᵀ M PE[q]` must depend on `q − p` alone.

# %% answer="offset_only_qk"
def offset_only_qk(scales, angles):
    """A W_qᵀW_k under which sinusoidal scores depend on the offset alone.

    scales, angles: [D/2] -> [D, D], block-diagonal, block i (rows and columns 2i, 2i+1) equal
    to scales[i] * [[cos t, sin t], [-sin t, cos t]], t = angles[i].
    Example: offset_only_qk(torch.ones(2), torch.zeros(2)) is the 4x4 identity.
    """
    ### BEGIN SOLUTION
    if scales.shape != angles.shape or scales.dim() != 1:
        raise ValueError(f"scales ({tuple(scales.shape)}) and angles ({tuple(angles.shape)}) must both "
                         f"be [D/2]: one scale and one angle per pair, {len(scales)} != {len(angles)}")
    dim = 2 * scales.numel()
    angles = angles.to(scales.dtype)
    cos, sin = scales * torch.cos(angles), scales * torch.sin(angles)     # [D/2]
    even = torch.arange(0, dim, 2, device=scales.device)
    matrix = torch.zeros(dim, dim, dtype=scales.dtype, device=scales.device)
    matrix[even, even] = cos
    matrix[even, even + 1] = sin
    matrix[even + 1, even] = -sin
    matrix[even + 1, even + 1] = cos
    return matrix
    ### END SOLUTION


# %% test="test_offset_only_qk" points=1
"""offset_only_qk: one scaled rotation per pair; PE[p]ᵀ M PE[q] depends on q - p alone."""
from attention_lab.checks.positions_and_blocks import check_offset_only_qk

check_offset_only_qk(offset_only_qk)
### BEGIN HIDDEN TESTS
check_offset_only_qk(offset_only_qk, seed=3402, device="cpu")
### END HIDDEN TESTS

# %% [markdown]
# Now measure it: for each offset, how much do the scores of all pairs at that offset differ —
# for the raw table, after a generic pair of random projections, and with your `M`?

# %%
table = sinusoidal_positions(32, 16).double()                     # [P, D]
projection_q = torch.randn(16, 16, dtype=torch.float64) / 4.0     # stand-ins for W_q, W_k
projection_k = torch.randn(16, 16, dtype=torch.float64) / 4.0


def spread_along_offsets(scores):
    """Largest (max - min) along a diagonal of scores [P, P]: 0 if only the offset matters."""
    return max(float(d.max() - d.min()) for d in (scores.diagonal(o) for o in range(-31, 32)))


raw = table @ table.T                                             # PE[p] . PE[q]
projected = (table @ projection_q.T) @ (table @ projection_k.T).T   # (W_q PE[p]) . (W_k PE[q])
print(f"raw PE . PE:       scores at one offset differ by up to {spread_along_offsets(raw):.1e}")
print(f"after W_q and W_k: scores at one offset differ by up to "
      f"{spread_along_offsets(projected):.2f}")
commuting = offset_only_qk(torch.rand(8, dtype=torch.float64) + 0.5,
                           (torch.rand(8) * 6.28).double())          # your M = W_qᵀ W_k
print(f"M of scaled rotations per pair: differ by up to "
      f"{spread_along_offsets(table @ commuting @ table.T):.1e}")

# %% [markdown]
# The raw dot products depend on the offset only (up to rounding). After a **generic** pair of
# projections they depend on the absolute positions too. But a **learned** `W_qᵀ W_k` *can* keep
# the offset-only property exactly: one scaled rotation per frequency pair does (third line,
# rounding only). Whether training finds such a block is another matter: the sinusoidal model you
# train in section 5 does not — its position table alone, through its first layer's `W_q` and
# `W_k`, gives scores that still vary by 4 to 5 along one offset (measured there; exercise 3.14
# asks what its heads do instead). So: a generic `W` breaks it, a learned `W` can keep it, and
# **RoPE** (notebook 05) *guarantees* it for every `W`: it adds nothing to the input but rotates
# `q` and `k` *after* the projections, by `R(p ω)`, so that the score `(R_p q) · (R_{p'} k) = qᵀ
# R_{p' - p} k` depends on the offset alone, whatever `W_q` and `W_k` learned.

# %% [markdown]
# ### Fixed, learned, rotary — and biases on the scores
#
# | encoding | what it is | used in |
# | --- | --- | --- |
# | **sinusoidal (fixed)** | the table above, added to the token embeddings; nothing learned | the original Transformer |
# | **learned absolute** | a trainable `[max_positions, D]` table (`nn.Parameter`), added the same way; cannot go beyond `max_positions` | BERT, GPT-2, ViT (notebook 04) |
# | **rotary (RoPE)** | no vector is added: each query and key is *rotated*, pair by pair, by the angle `p · ω_i` — section 2's frequencies over the head's width, `ω_i = base^(−2i/d_head)`, not `D` — so `q · k` depends only on the offset between their positions | Llama and most recent LLMs (notebook 05 builds it) |
# | **ALiBi** | no vector is added: head `h` adds `−m_h · (i − j)` to the score of query `i` and key `j`, a fixed slope per head (`m_h = 2^(−8h/H)`: 1/2, 1/4, …, 1/256 for 8 heads); nothing learned | BLOOM, MPT |
# | **T5 relative bias** | no vector is added: a *learned* number per head and per bucket of the offset `j − i` is added to the score; offsets below 8 (each sign) get a bucket each, larger ones logarithmically wider buckets, and every offset of 91 or more the last one | T5 |
#
# Sinusoidal and learned encodings are both **absolute**: each position gets its own vector
# (the choice is fixed vs learned, not "sinusoidal vs absolute"); Vaswani et al. found the
# two about equally good. RoPE encodes each absolute position as a rotation so that attention
# scores see only *relative* offsets. ALiBi and T5 add nothing to the tokens at all: they bias
# the scores by the offset, one fixed and one learned. The cell below shows one property of each
# bias. ALiBi's is defined for any length, and Press et al. (2022) trained on 1,024 tokens and
# found the perplexity held on longer inputs; the others do not extrapolate well far beyond the
# lengths seen in training without extra tricks (for RoPE: position interpolation, NTK scaling,
# YaRN), and T5's buckets cannot tell apart two offsets that both lie in its last bucket.

# %%
def alibi_bias(seq_len, num_heads):
    """ALiBi's bias [H, S, S]: -m_h·(i - j) for key j at or before query i (a causal model)."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, num_heads + 1) / num_heads)  # [H]
    offset = torch.arange(seq_len)[:, None] - torch.arange(seq_len)[None, :]  # i - j
    return -slopes[:, None, None] * offset.clamp(min=0)


def t5_bucket(offset, num_buckets=32, max_distance=128):
    """T5's bucket of an offset j - i (bidirectional: half the buckets for each sign)."""
    half = num_buckets // 2
    exact = half // 2  # offsets 0 ... exact - 1 get a bucket each
    distance = offset.abs()
    log_bucket = exact + (torch.log(distance.clamp(min=1).float() / exact)
                          / math.log(max_distance / exact) * (half - exact)).long()
    return (offset > 0).long() * half + torch.where(distance < exact, distance,
                                                   log_bucket.clamp(max=half - 1))


# ALiBi: a bias that depends on i - j alone, so on equal content scores each step back
# multiplies a key's weight by e^(-m): a recency preference that needs no table.
alibi_head = alibi_bias(6, num_heads=4)[0]  # head 0: m = 1/4
later_keys = torch.ones(6, 6, dtype=torch.bool).triu(1)
alibi_weights = torch.softmax(alibi_head.masked_fill(later_keys, float("-inf")), dim=-1)
print("ALiBi, head 0, query 5, equal content scores: weights", alibi_weights[5].numpy().round(3),
      f"| each step back × {float(alibi_weights[5, 4] / alibi_weights[5, 5]):.3f} = e^(-1/4)")
# T5: small offsets are told apart exactly, far ones share buckets (and then one bias).
offsets = torch.tensor([-8, -1, 0, 1, 7, 8, 16, 64, 91, 128, 1000])
print("T5 buckets:", dict(zip(offsets.tolist(), t5_bucket(offsets).tolist())))

# %% [markdown]
# ## 3. The rose: Fourier features of coordinates
#
# The same sine-and-cosine trick helps a very different network. A **coordinate MLP** takes
# the `(x, y)` position of a pixel and predicts its colour; trained on every pixel of one
# picture, it *becomes* the picture. Here is ours, drawn by the course (no download):

# %%
from attention_lab.images import draw_rose, image_dataset
from attention_lab.widgets.positions import show_images

rose = draw_rose(64)                                   # [64, 64, 3] floats in [0, 1]
coords, colors = image_dataset(rose, device=device)    # [4096, 2] in [0, 1], [4096, 3]
print("coords:", tuple(coords.shape), "colors:", tuple(colors.shape))
show_images({"target": rose})

# %% [markdown]
# A ReLU network fed the raw `(x, y)` learns smooth things first and fine detail very
# slowly (its "spectral bias"): the thin petal edges come out blurred. Feeding it
# `sin` and `cos` of the coordinates at **increasing** frequencies `2^k · π` hands it the
# fine detail directly (Tancik et al., 2020; the same encoding as NeRF's). Note the
# difference from section 2: there, frequencies *decrease* from 1 (`base^(-2i/D)`) to tell
# up to thousands of integer positions apart; here they *increase* from π, to resolve
# small differences between coordinates in `[0, 1]`.
#
# **Find the bug.** A draft of this encoder, as you may meet it:
#
# ```python
# class PositionalEmbedding(nn.Module):
#     def __init__(self, embed_dim):
#         super().__init__()
#         self.freq = torch.exp(torch.arange(0, embed_dim, 2).float() / 2)
#
#     def forward(self, x):
#         x = x[..., None:] * self.freq[None, None, :].to(x.device)
#         return torch.cat([torch.sin(x), torch.cos(x)], dim=-1).view(x.shape[:-2], -1)
# ```
#
# Before you read on, look for four problems.
#
# <details><summary>The four problems</summary>
#
# 1. `x[..., None:]` is a full slice (`None:` means "from the start"), not a new axis: it
#    must be `x[..., None]`, giving `[..., in_dim, 1]` so that every coordinate is
#    multiplied by every frequency.
# 2. `.view(x.shape[:-2], -1)` is a `TypeError` (a tuple and an int); a flatten of the last two
#    axes is meant. *Where* it goes decides the layout: flattened after the `cat`, as in the
#    draft, every coordinate gets its own `[sines, cosines]` block. The contract of this
#    notebook (below) flattens the *angles* first and then concatenates, so all sines come
#    before all cosines. Both are valid encodings; the check accepts the contract's one and
#    names the other.
# 3. `self.freq` is a plain attribute: `.to(device)`, `.double()` and `state_dict` do not see
#    it. Register it as a **buffer**: `self.register_buffer("frequencies", ..., persistent=False)`
#    (non-persistent: it is computed from the constructor's arguments, so it need not be saved).
# 4. Its frequencies `exp(0), exp(1), exp(2), …` are neither the Transformer's nor the
#    usual `2^k · π`; and it is a coordinate encoder, not the Transformer's positional embedding.
# </details>

# %% [markdown]
# ### Exercise 3.5 — FourierFeatures (2 pts, ~15 min)
#
# For coordinates `x [..., in_dim]` and `F = num_frequencies`:
#
# 1. angles: `x[..., c] · 2^k · π` for every coordinate `c` and `k = 0 … F-1`:
#    `[..., in_dim, 1] * [F] -> [..., in_dim, F]`;
# 2. flatten the last two axes: `[..., in_dim * F]` (coordinate-major: all frequencies of
#    `x[..., 0]` first);
# 3. return `cat(sin(angles), cos(angles))`: `[..., in_dim * 2 * F]`.
#
# Mind the order: flatten, *then* take sin and cos and concatenate (the draft's
# concatenate-then-flatten gives the other layout). Keep the frequencies in a non-persistent
# buffer — `2^k · π`, or `2^k` with the `π` applied in `forward`: the check judges the output,
# not how the buffer is stored — and set `self.out_dim = in_dim * 2 * F` (the network after
# the encoder needs it).

# %% answer="FourierFeatures"
class FourierFeatures(nn.Module):
    """Fourier features of coordinates: [..., in_dim] -> [..., in_dim * 2 * num_frequencies].

    out = cat(sin(angles), cos(angles)),  angles[..., c*F + k] = x[..., c] * 2^k * pi

    Example: FourierFeatures(2, 6)(torch.rand(4096, 2)).shape == (4096, 24); out_dim == 24.
    """

    def __init__(self, in_dim, num_frequencies):
        super().__init__()
        ### BEGIN SOLUTION
        self.in_dim = in_dim
        self.num_frequencies = num_frequencies
        self.out_dim = in_dim * 2 * num_frequencies
        frequencies = 2.0 ** torch.arange(num_frequencies) * math.pi    # [F]: pi, 2pi, 4pi, ...
        self.register_buffer("frequencies", frequencies, persistent=False)
        ### END SOLUTION

    def forward(self, x):
        ### BEGIN SOLUTION
        angles = x[..., None] * self.frequencies.to(x.dtype)                   # [..., in_dim, F]
        angles = angles.flatten(-2)                                            # [..., in_dim * F]
        return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)      # [..., in_dim * 2F]
        ### END SOLUTION


# %% test="test_FourierFeatures" points=2
"""FourierFeatures: out_dim, frequencies in a non-persistent buffer, x·2^k·pi, the layout."""
from attention_lab.checks.positions_and_blocks import check_fourier_features

check_fourier_features(FourierFeatures)
### BEGIN HIDDEN TESTS
check_fourier_features(FourierFeatures, seed=3401, device="cpu")
### END HIDDEN TESTS

# %%
encoder = FourierFeatures(2, 6)
print("out_dim:", encoder.out_dim, "| buffers:", [name for name, _ in encoder.named_buffers()],
      "| in state_dict:", list(encoder.state_dict()))
print(tuple(coords.shape), "->", tuple(encoder.to(device)(coords).shape))

# %% [markdown]
# ### Exercise 3.6 — CoordinateMLP (1 pt, ~8 min)
#
# The draft's "Rose" network, fixed. `encoder` is `None` (the network sees the raw `(x, y)`,
# 2 features) or a module with an `out_dim` attribute (the network sees `out_dim` features).
# Then:
#
# `Linear(in, hidden) → ReLU → Linear(hidden, hidden//2) → ReLU → Linear(hidden//2, hidden//4)
# → ReLU → Linear(hidden//4, 3)`, with no activation at the end.
#
# The draft used `nn.Linear(2, 256)` as its first layer *after* a 24-feature encoder: the
# first layer's width must follow the encoder. Store the encoder as an attribute (so that
# `.to(device)` moves its buffer too).

# %% answer="CoordinateMLP"
class CoordinateMLP(nn.Module):
    """An MLP from pixel coordinates to RGB: [..., 2] -> [..., 3].

    encoder: None (use the raw coordinates) or an nn.Module with an `out_dim` attribute.
    hidden: width of the first hidden layer (then hidden // 2, hidden // 4).

    Example: CoordinateMLP(FourierFeatures(2, 6), hidden=64)(torch.rand(10, 2)).shape == (10, 3)
    """

    def __init__(self, encoder=None, hidden=256):
        super().__init__()
        ### BEGIN SOLUTION
        self.encoder = encoder
        in_features = 2 if encoder is None else encoder.out_dim
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden // 2), nn.ReLU(),
            nn.Linear(hidden // 2, hidden // 4), nn.ReLU(),
            nn.Linear(hidden // 4, 3),
        )
        ### END SOLUTION

    def forward(self, coords):
        ### BEGIN SOLUTION
        features = coords if self.encoder is None else self.encoder(coords)   # [..., in_features]
        return self.net(features)                                             # [..., 3]
        ### END SOLUTION


# %% test="test_CoordinateMLP" points=1
"""CoordinateMLP: widths follow the encoder's out_dim and hidden; forward: the Linear/ReLU stack."""
from attention_lab.checks.positions_and_blocks import check_coordinate_mlp

check_coordinate_mlp(CoordinateMLP)
### BEGIN HIDDEN TESTS
check_coordinate_mlp(CoordinateMLP, seed=3501, device="cpu")
### END HIDDEN TESTS

# %%
print(CoordinateMLP(FourierFeatures(2, 6), hidden=64))

# %% [markdown]
# ### Exercise 3.7 — psnr (1 pt, ~3 min)
#
# The **peak signal-to-noise ratio** in decibels, the usual score of a reconstruction:
# `PSNR = 10 · log10(max_value² / MSE)`, with `MSE` the mean squared error over all pixels
# and channels and `max_value` the largest possible pixel value (1.0 for our images).
# Higher is better; each +10 dB divides the MSE by 10. Return a Python `float`; identical
# images give `float("inf")`.

# %% answer="psnr"
def psnr(pred, target, max_value=1.0):
    """Peak signal-to-noise ratio in dB: 10 * log10(max_value**2 / mean((pred - target)**2)).

    pred, target: tensors of the same shape. Returns a Python float (inf if they are equal).

    Example: psnr(torch.zeros(4), torch.full((4,), 0.1)) ≈ 20.0   (MSE = 0.01; in float32,
    0.1 is not exact and the result is 19.9999997)
    """
    ### BEGIN SOLUTION
    # A score, not a loss: no gradient.
    mse = torch.mean((pred.detach() - target.detach()) ** 2).item()
    if mse == 0.0:
        return float("inf")
    return 10.0 * math.log10(max_value ** 2 / mse)
    ### END SOLUTION


# %% test="test_psnr" points=1
"""psnr: 10·log10(max²/MSE) as a Python float, for several images and max values; inf if equal."""
from attention_lab.checks.positions_and_blocks import check_psnr

check_psnr(psnr)
### BEGIN HIDDEN TESTS
check_psnr(psnr, seed=3601, device="cpu")
### END HIDDEN TESTS

# %%
print(f"PSNR of a grey guess: {psnr(torch.full_like(colors, 0.5), colors):.2f} dB")

# %% [markdown]
# ### Exercise 3.8 — fit_image (2 pts, ~10 min)
#
# (1 point for the loop, 1 for the outcome further down.)
#
# Train the model on every pixel at once (full batch): for each of `steps` steps, clear the
# gradients, compute the mean squared error between `model(coords)` and `colors`,
# back-propagate, and take one `torch.optim.Adam(model.parameters(), lr=lr)` step. Return
# the list of the `steps` losses as Python floats (`loss.item()`, measured before each
# step). Show progress with `tqdm.auto.tqdm(..., disable=not progress)` so that callers
# (like the checks) can turn it off.

# %% answer="fit_image"
from tqdm.auto import tqdm


def fit_image(model, coords, colors, steps, lr, progress=True):
    """Fit model(coords) to colors with full-batch Adam on the mean squared error.

    coords: [N, 2], colors: [N, 3] (same device as model). Trains model in place.
    returns: list of `steps` floats, the loss before each optimizer step.

    Example: losses = fit_image(model, coords, colors, steps=200, lr=1e-2); losses[-1] < losses[0]
    """
    ### BEGIN SOLUTION
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    bar = tqdm(range(steps), desc="fitting", disable=not progress, leave=False, mininterval=0.5)
    for _ in bar:
        optimizer.zero_grad()
        loss = F.mse_loss(model(coords), colors)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
    return losses
    ### END SOLUTION


# %% test="test_fit_image" points=1
"""fit_image: the losses and final weights equal a reference full-batch Adam run."""
from attention_lab.checks.positions_and_blocks import check_fit_image

check_fit_image(fit_image)
### BEGIN HIDDEN TESTS
check_fit_image(fit_image, seed=3701, device="cpu")
### END HIDDEN TESTS

# %% [markdown]
# **Paint the rose twice.** The same network, trained for the same 400 steps from the same
# seed: once on the raw coordinates, once on their Fourier features. (This takes a few
# seconds on a laptop CPU.)

# %%
reconstructions, scores = {}, {}
for name, encoder in [("raw (x, y)", None), ("Fourier features", FourierFeatures(2, 6))]:
    torch.manual_seed(0)
    model = CoordinateMLP(encoder, hidden=64).to(device)
    losses = fit_image(model, coords, colors, steps=400, lr=1e-2)
    with torch.no_grad():
        prediction = model(coords).clamp(0, 1)           # [4096, 3]
    scores[name] = psnr(prediction, colors)
    reconstructions[f"{name}: {scores[name]:.1f} dB"] = prediction.reshape(rose.shape).cpu()
show_images({"target": rose, **reconstructions})

# %% [markdown]
# The raw-coordinate network gets the big shapes and blurs every edge; the Fourier-feature
# network draws the petals and their outlines. The check below repeats this experiment
# itself (seeded, 200 steps, with your classes and your `fit_image`) and asks for a clear
# margin.

# %% test="test_fit_image_outcome" points=1
"""Outcome: with your FourierFeatures, CoordinateMLP and fit_image, Fourier beats raw by >= 3 dB."""
from attention_lab.checks.positions_and_blocks import check_fourier_beats_identity

check_fourier_beats_identity(FourierFeatures, CoordinateMLP, fit_image)

# %% [markdown]
# ## 4. The Transformer layer
#
# A Transformer layer is not just "attention + positions + MLP": what makes deep stacks
# trainable are the **residual connections** (each sublayer *adds* to the running vector `x`
# instead of replacing it) and **LayerNorm**. Modern models put the norm *before* each
# sublayer (**pre-norm**; ViT, GPT-2 and later):
#
# ```
# x = x + attn(norm1(x))      # tokens exchange information
# x = x + mlp(norm2(x))       # each token is processed on its own
# ```
#
# The original 2017 layer was **post-norm**: `x = norm1(x + attn(x))`, which needs a careful
# learning-rate warm-up to train deep. The MLP is `Linear(D, 4·D) → GELU → Linear(4·D, D)`,
# and the norms use `eps = 1e-6`, as in ViT (GPT-2 keeps `nn.LayerNorm`'s default `1e-5`: the
# value is a per-model choice, and this course follows ViT).
#
# **Find the bug.** A draft of the layer, as you may meet it:
#
# ```python
# class TransformerLayer(nn.Module):
#     def __init__(self, embed_dim, num_heads):
#         super().__init__()
#         self.attn = MultiHeadAttn(embed_dim, num_heads, batch_first=True)
#         self.mlp = nn.Sequential(nn.Linear(embed_dim, embed_dim * 4), nn.ReLU(),
#                                  nn.Linear(embed_dim * 4, embed_dim))
#         self.in_norm = nn.LayerNorm(embed_dim)
#         self.mlp_norm = nn.LayerNorm(embed_dim)
#
#     def forward(self, x):
#         x_norm = self.in_norm(x)
#         x = x + self.attn(x_norm, x_norm, x_norm)[0]
#         return x + self.mlp(self.mlp_norm(x))
# ```
#
# <details><summary>What is wrong</summary>
#
# The pre-norm residual structure is right. But `MultiHeadAttn` is a hand-written class
# (like notebook 01's `DraftMultiHeadAttention`): it accepts no `batch_first` (TypeError),
# and it returns a **tensor**, so `[0]` silently takes batch element 0 and broadcasts it
# over the whole batch. `nn.MultiheadAttention` returns `(output, weights)` (and so do
# hand-written classes that copy its interface): `[0]` is right only for those. ViT- and
# GPT-style blocks use GELU, not ReLU; `eps = 1e-5` is GPT-2's value but not ViT's `1e-6`,
# which this notebook's contract follows. And there is no way to pass a mask.
# </details>
#
# **Masks, once more.** Our masks say True = may attend. `nn.MultiheadAttention`'s boolean
# `attn_mask` says True = **blocked**. Your layer takes our convention and must convert:
# `attn_mask=~mask`. Pass `need_weights=False` (you only need the output).
#
# **PyTorch's own layer.** `nn.TransformerEncoderLayer` computes exactly this layer — but only
# with *all* of `norm_first=True, activation="gelu", layer_norm_eps=1e-6,
# dim_feedforward=int(mlp_ratio·D), dropout=0.0, batch_first=True`. Its defaults follow the
# 2017 translation model — post-norm, ReLU, a 2048-wide MLP whatever `D` is, dropout 0.1 — and
# add eps `1e-5`, which is `nn.LayerNorm`'s own default (the paper gives no eps), and `[S, B, D]`
# inputs. The check below copies your weights into one configured like
# that and compares the outputs.

# %% [markdown]
# ### Exercise 3.9 — TransformerLayer (4 pts, ~15 min)
#
# Attributes (the names are the contract; the check copies them into PyTorch's layer):
# `norm1`, `norm2`: `nn.LayerNorm(D, eps=1e-6)`; `attn`: `nn.MultiheadAttention(D, H,
# batch_first=True)`; `mlp`: `nn.Sequential(nn.Linear(D, hidden), nn.GELU(), nn.Linear(hidden,
# D))` with `hidden = int(mlp_ratio * D)`. `forward(x [B, S, D], mask=None)`: `mask` is `None`
# or boolean `[S, S]`, True = may attend; returns `[B, S, D]`.
#
# **The dtype rule** (this is where the notebook first enforces it): keep the input's dtype,
# float64 in, float64 out. The checks build your layer, call `.double()` on it and feed it
# float64 tensors: in float64, rounding errors are about 1e-16, so any difference from
# PyTorch's layer is a real mistake, not noise. So never cast inside the layer: a
# `self.norm1(x.float())` meets float64 LayerNorm weights and crashes with
# `RuntimeError: mixed dtype`, and a `.float()` on the output returns the wrong dtype.

# %% answer="TransformerLayer"
class TransformerLayer(nn.Module):
    """A pre-norm Transformer layer: x + attn(norm1(x)), then x + mlp(norm2(x)).

    forward(x [B, S, D], mask bool [S, S] (True = may attend) or None) -> [B, S, D]

    Example: TransformerLayer(16, 4)(torch.randn(2, 5, 16)).shape == (2, 5, 16)
    """

    def __init__(self, embed_dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        ### BEGIN SOLUTION
        hidden = int(mlp_ratio * embed_dim)
        self.norm1 = nn.LayerNorm(embed_dim, eps=1e-6)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)
        self.norm2 = nn.LayerNorm(embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, hidden), nn.GELU(),
                                 nn.Linear(hidden, embed_dim))
        ### END SOLUTION

    def forward(self, x, mask=None):
        ### BEGIN SOLUTION
        blocked = None if mask is None else ~mask          # nn.MultiheadAttention: True = blocked
        h = self.norm1(x)                                  # [B, S, D]
        x = x + self.attn(h, h, h, attn_mask=blocked, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))                    # [B, S, D]
        return x
        ### END SOLUTION


# %% test="test_TransformerLayer" points=3
"""TransformerLayer: attributes; equals nn.TransformerEncoderLayer(norm_first, gelu, eps 1e-6)."""
from attention_lab.checks.positions_and_blocks import check_transformer_layer

check_transformer_layer(TransformerLayer)
### BEGIN HIDDEN TESTS
check_transformer_layer(TransformerLayer, seed=3801, device="cpu")
### END HIDDEN TESTS

# %% test="test_TransformerLayer_properties" points=1
"""TransformerLayer: zero sublayers give the identity; no future leak; equivariant, no positions."""
from attention_lab.checks.positions_and_blocks import check_transformer_layer_properties

check_transformer_layer_properties(TransformerLayer)
### BEGIN HIDDEN TESTS
check_transformer_layer_properties(TransformerLayer, seed=3802, device="cpu")
### END HIDDEN TESTS

# %%
example_layer = TransformerLayer(D, H).to(device)
causal = torch.ones(S, S, dtype=torch.bool, device=device).tril()   # [S, S], True = may attend
with torch.no_grad():
    print("out:", tuple(example_layer(tokens, causal).shape))
print(f"parameters: {sum(p.numel() for p in example_layer.parameters()):,}")

# %% [markdown]
# ### Exercise 3.10 — Transformer (2 pts, ~5 min)
#
# Stack `num_layers` **independent** layers in an `nn.ModuleList` called `layers` (an
# `nn.Sequential` cannot pass the mask along), apply them in order with the same mask, then a
# final `norm = nn.LayerNorm(D, eps=1e-6)`. Why a final norm: in a pre-norm stack each layer
# normalises only the *input of its sublayers*; the residual stream `x` itself is never
# normalised — every layer adds to it, so its scale grows with depth — and whatever reads the
# stack's output (a classifier head, the next-token projection) wants normalised features.
# A post-norm stack needs none, its last operation already is a LayerNorm. Beware `nn.ModuleList([TransformerLayer(...)] * num_layers)`: that is one
# layer repeated — the same weights `num_layers` times.
#
# Like PyTorch's `nn.TransformerEncoder`, this stack adds no positions: the caller adds them
# to the token embeddings first (as below).

# %% answer="Transformer"
class Transformer(nn.Module):
    """A stack of pre-norm Transformer layers with a final LayerNorm.

    forward(x [B, S, D], mask bool [S, S] or None) -> [B, S, D]

    Example: Transformer(16, 4, num_layers=2)(torch.randn(2, 5, 16)).shape == (2, 5, 16)
    """

    def __init__(self, embed_dim, num_heads, num_layers, mlp_ratio=4.0):
        super().__init__()
        ### BEGIN SOLUTION
        self.layers = nn.ModuleList(
            [TransformerLayer(embed_dim, num_heads, mlp_ratio) for _ in range(num_layers)]
        )
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        ### END SOLUTION

    def forward(self, x, mask=None):
        ### BEGIN SOLUTION
        for layer in self.layers:
            x = layer(x, mask)                             # [B, S, D]
        return self.norm(x)
        ### END SOLUTION


# %% test="test_Transformer" points=2
"""Transformer: independent layers in a ModuleList, final LayerNorm eps 1e-6, mask to each layer."""
from attention_lab.checks.positions_and_blocks import check_transformer

check_transformer(Transformer)
### BEGIN HIDDEN TESTS
check_transformer(Transformer, seed=3901, device="cpu")
### END HIDDEN TESTS

# %% [markdown]
# Now everything together: token vectors through a two-layer stack, shuffled and not. Who
# breaks the symmetry — the positions, or the mask? Try each alone:

# %%
demo_stack = Transformer(D, H, num_layers=2).to(device).eval()
pe_table = sinusoidal_positions(S, D).to(device)      # [S, D]


def shuffle_commutes(positions, mask):
    """Does shuffling the tokens only shuffle the outputs?"""
    with torch.no_grad():
        out = demo_stack(tokens + positions, mask)
        out_shuffled = demo_stack(tokens[:, permutation] + positions, mask)
    return torch.allclose(out_shuffled, out[:, permutation], atol=1e-5)


no_positions = torch.zeros_like(pe_table)
print("no positions, no mask:     shuffle only shuffles the outputs?",
      shuffle_commutes(no_positions, None))
print("positions, no mask:        shuffle only shuffles the outputs?",
      shuffle_commutes(pe_table, None))
print("no positions, causal mask: shuffle only shuffles the outputs?",
      shuffle_commutes(no_positions, causal))
last_changed = tokens.clone()
last_changed[:, -1] = torch.randn(D, device=device)
with torch.no_grad():
    out, out_last_changed = demo_stack(tokens, causal), demo_stack(last_changed, causal)
print("causal mask: changing the last token leaves the earlier outputs alone?",
      torch.allclose(out_last_changed[:, :-1], out[:, :-1], atol=1e-5))

# %% [markdown]
# The positions break the symmetry — and so does the causal mask *on its own*, with no
# positions at all: token `i` sees tokens `0 … i` only, so which tokens it sees depends on
# where it sits. A causal model without any position encoding ("NoPE") therefore still
# knows something about order. Section 5 measures how much.

# %% [markdown]
# ### Exercise 3.11 — written: what keeps the symmetry (2 pts, ~5 min)
#
# The properties check of exercise 3.9 confirmed that your layer, without positions and
# without a mask, is permutation-**equivariant** — although it has far more in it than
# attention. In the cell below, in three or four sentences: explain why the MLP sublayer, the
# two LayerNorms and the residual connections do not break that symmetry; and name one kind
# of input for which equivariance (no positions at all) is exactly what you want, and why.
# This answer is graded by hand.

# %% [markdown] manual="why_equivariance_survives" points=2
# The LayerNorms and the MLP act on every token separately, with the same weights for every
# token: applying them and then shuffling the tokens gives the same result as shuffling first.
# The residual connections add each token's sublayer output to the same token's input, again
# position by position. Attention is equivariant itself, and a composition of equivariant maps
# is equivariant, so the whole layer (and a stack of them) is. Equivariance is what you want
# for an input that is a *set*, with no natural order: a point cloud (the points of a 3-D scan),
# the objects detected in an image, the atoms of a molecule — the order the data happens to be
# stored in must not change the answer for each element.

# %% [markdown]
# ## 5. Attention that learns: what positions add, and what the mask alone gives
#
# Time to train. The task needs order and nothing else: each sequence holds `S = 8`
# **different** tokens out of a vocabulary of 16, in random order, and at every position
# `i ≥ 1` the model must output the token at position `i - 1` — the **previous token**
# (position 0 has none and is not scored). Every token appears once, so *which* tokens are in
# the sequence says nothing about the answer: only *where* they sit does.

# %% [markdown]
# ### Exercise 3.12 — predict: no positions, with and without a mask (2 pts, ~6 min)
#
# **Predict before you train.** A Transformer with **no** position encoding and **no** mask
# is trained on this task as long as you like. What token accuracy can it reach? Set
# `ANSWER_NO_POSITIONS` to `"A"`, `"B"` or `"C"`.
#
# * **A.** Close to 1, like a model with positions: attention compares every token with every
#   other, so with enough training it finds the previous one.
# * **B.** About 1/2: it can learn to rule out half of the candidates.
# * **C.** About 1/7, and never more, however long it trains.

# %% answer="ANSWER_NO_POSITIONS"
ANSWER_NO_POSITIONS = None  # "A", "B" or "C"
### BEGIN SOLUTION
ANSWER_NO_POSITIONS = "C"
### END SOLUTION

# %% test="test_ANSWER_NO_POSITIONS" points=1
"""ANSWER_NO_POSITIONS: the accuracy a model without positions or a mask can reach."""
from attention_lab.checks.positions_and_blocks import check_answer_no_positions

check_answer_no_positions(ANSWER_NO_POSITIONS)

# %% [markdown]
# Now the same model, still with **no** position encoding, but with a **causal mask** (query
# `i` sees keys `0 … i`; the cell at the end of section 4 showed what that changes). What token
# accuracy can it reach? Set `ANSWER_NOPE_CAUSAL` to `"A"`, `"B"` or `"C"`.
#
# * **A.** The same as without the mask: a mask is not a position encoding.
# * **B.** About 0.37, no more: at position `i` it can guess among the `i` tokens it sees
#   (`(1 + 1/2 + … + 1/7) / 7 ≈ 0.37`), but it cannot tell them apart.
# * **C.** Close to 1: the mask alone gives it enough order to find the previous token.

# %% answer="ANSWER_NOPE_CAUSAL"
ANSWER_NOPE_CAUSAL = None  # "A", "B" or "C"
### BEGIN SOLUTION
ANSWER_NOPE_CAUSAL = "C"
### END SOLUTION

# %% test="test_ANSWER_NOPE_CAUSAL" points=1
"""ANSWER_NOPE_CAUSAL: the accuracy a model with a causal mask and no positions can reach."""
from attention_lab.checks.positions_and_blocks import check_answer_nope_causal

check_answer_nope_causal(ANSWER_NOPE_CAUSAL)

# %% [markdown]
# ### Exercise 3.13 — OrderTransformer, and a head detector (6 pts, ~30 min)
#
# (2 points for the module, 2 for what it learns, 2 for the head detector further down.)
#
# A complete model around your `Transformer`:
#
# 1. `token_embedding`: an `nn.Embedding` with a learned `embed_dim` vector per token id,
#    **not** scaled (`nn.Embedding` starts at N(0, 1), the scale of the table's entries;
#    the sqrt(D) of Vaswani et al. is for embeddings that start small).
# 2. positions, by the `positions` argument: `"sinusoidal"` — `sinusoidal_positions(max_len,
#    embed_dim)` kept as a buffer (`register_buffer(..., persistent=False)`: fixed, but it
#    moves with `.to()`); `"learned"` — a trainable `[max_len, embed_dim]` table
#    (`nn.Parameter`, e.g. `0.02 * torch.randn(...)`, or `nn.Embedding(max_len, embed_dim)`);
#    `"none"` — nothing. Anything else raises a `ValueError` naming it.
# 3. `transformer`: your `Transformer` with `embed_dim`, `num_heads` and `num_layers`.
# 4. `head`: an `nn.Linear` from `embed_dim` to one logit per token id.
#
# `forward(tokens [B, S] (long), mask=None)`: add the rows `0 … S-1` of the table to the
# token vectors (`S` may be smaller than `max_len`), run the Transformer with the mask, apply
# the head: logits `[B, S, vocab_size]`, in the module's dtype.

# %% answer="OrderTransformer"
class OrderTransformer(nn.Module):
    """Token embedding + positions + your Transformer + a linear head.

    forward(tokens [B, S] long, mask bool [S, S] or None) -> logits [B, S, vocab_size]
    positions: "sinusoidal", "learned" or "none".

    Example: OrderTransformer(16, 32, 2, 2, max_len=8)(torch.randint(16, (4, 8))).shape
             == (4, 8, 16)
    """

    def __init__(self, vocab_size, embed_dim, num_heads, num_layers, max_len,
                 positions="sinusoidal"):
        super().__init__()
        ### BEGIN SOLUTION
        if positions not in ("sinusoidal", "learned", "none"):
            raise ValueError(f"positions = {positions!r}: use 'sinusoidal', 'learned' or 'none'")
        self.token_embedding = nn.Embedding(vocab_size, embed_dim)
        if positions == "sinusoidal":
            table = sinusoidal_positions(max_len, embed_dim)                  # [max_len, D]
            self.register_buffer("position_table", table, persistent=False)
        elif positions == "learned":
            self.position_table = nn.Parameter(0.02 * torch.randn(max_len, embed_dim))
        else:
            self.position_table = None
        self.transformer = Transformer(embed_dim, num_heads, num_layers)
        self.head = nn.Linear(embed_dim, vocab_size)
        ### END SOLUTION

    def forward(self, tokens, mask=None):
        ### BEGIN SOLUTION
        x = self.token_embedding(tokens)                                     # [B, S, D]
        if self.position_table is not None:
            x = x + self.position_table[: tokens.shape[1]]                   # rows 0 ... S-1
        return self.head(self.transformer(x, mask))                          # [B, S, V]
        ### END SOLUTION


# %% test="test_OrderTransformer" points=2
"""OrderTransformer: its parts; each positions variant equals head(transformer(embed + PE[:S]))."""
from attention_lab.checks.positions_and_blocks import check_order_transformer

check_order_transformer(OrderTransformer)
### BEGIN HIDDEN TESTS
check_order_transformer(OrderTransformer, seed=3131, device="cpu")
### END HIDDEN TESTS

# %% [markdown]
# **The training loop** (given; the check below runs the same one). Adam, 200 steps of 32
# fresh sequences, cross-entropy on positions `1 … S-1` (`ignore_index` skips position 0).
# `fused=True` does Adam's update of all the parameters in one operation instead of several
# per tensor: the same update up to rounding, about a fifth less time per step for a model
# this small.

# %%
VOCAB, SEQ_LEN, IGNORE = 16, 8, -100


def previous_token_batch(batch_size, generator):
    """tokens [B, S]: distinct ids per row; targets [B, S]: the previous token, -100 at 0."""
    tokens = torch.rand(batch_size, VOCAB, generator=generator).argsort(dim=-1)[:, :SEQ_LEN]
    targets = torch.full_like(tokens, IGNORE)
    targets[:, 1:] = tokens[:, :-1]
    return tokens, targets


def train_order_model(model, attend_mask=None, steps=200, batch_size=32, lr=1e-2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    adam = torch.optim.Adam(model.parameters(), lr=lr, fused=True)
    model.train()
    for _ in range(steps):
        batch, targets = previous_token_batch(batch_size, generator)
        logits = model(batch.to(device), attend_mask)                 # [B, S, V]
        loss = F.cross_entropy(logits.flatten(0, 1), targets.to(device).flatten(),
                               ignore_index=IGNORE)
        adam.zero_grad()
        loss.backward()
        adam.step()
    return model.eval()


def token_accuracy(model, attend_mask=None, num_sequences=500, seed=1234):
    """Accuracy on fresh sequences, and per position 1 ... S-1."""
    batch, targets = previous_token_batch(num_sequences, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        predictions = model(batch.to(device), attend_mask).argmax(dim=-1).cpu()
    correct = (predictions == targets)[:, 1:].float()                 # [N, S-1]
    return float(correct.mean()), correct.mean(dim=0)


# %% [markdown]
# Four models, same seed and budget: sinusoidal positions, learned positions, no positions,
# and no positions with a causal mask (a few seconds each).

# %%
causal_order = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool, device=device).tril()
experiments = {"sinusoidal": ("sinusoidal", None), "learned": ("learned", None),
               "no positions": ("none", None), "no positions, causal": ("none", causal_order)}
trained, masks_used = {}, {}
threads = torch.get_num_threads()
torch.set_num_threads(1)  # a model this small: one CPU thread beats two that wait on each other
try:
    for name, (kind, attend_mask) in experiments.items():
        torch.manual_seed(0)
        model = OrderTransformer(VOCAB, 32, 2, 2, SEQ_LEN, positions=kind).to(device)
        trained[name] = train_order_model(model, attend_mask)
        masks_used[name] = attend_mask
finally:
    torch.set_num_threads(threads)
for name, attend_mask in masks_used.items():
    accuracy, per_position = token_accuracy(trained[name], attend_mask)
    print(f"{name:22s} token accuracy {accuracy:.3f}   per position 1..7:",
          " ".join(f"{a:.2f}" for a in per_position.tolist()))
print(f"ceiling without positions or mask: 1/(S-1) = {1 / (SEQ_LEN - 1):.3f}")

# %% test="test_OrderTransformer_outcome" points=2
"""Outcome: trained, your OrderTransformer reaches >= 0.9 with positions and <= 1/(S-1) without."""
from attention_lab.checks.positions_and_blocks import check_order_transformer_outcome

check_order_transformer_outcome(OrderTransformer)

# %% [markdown]
# Both position encodings solve the task; no positions stays at the ceiling; and the causal
# model without positions (NoPE) comes close to the models with positions. How? Do not guess:
# measure what the heads do.
#
# **A head detector.** Write `previous_token_score(attention)`: for every layer and head, the
# mean weight a query puts on the key just before it — over the batch, and over the queries
# `i = 1 … S-1` (query 0 has no previous token). Rows of a map are queries, columns keys, so the
# weights in question sit on the diagonal just below the main one.
#
# | name | signature | contract |
# | --- | --- | --- |
# | `previous_token_score` | `(attention) -> Tensor` | `attention`: a tensor `[B, layers, heads, S, S]`, or a list (one per layer) of `[B, heads, S, S]` (what `attention_maps` returns) → `[layers, heads]`; the input's dtype and device; `ValueError` for another rank, maps that are not square, or `S = 1` |
#
# A head with a score near 1 is a **previous-token head**. Uniform attention scores `1/S`
# without a mask, and `(1/2 + 1/3 + … + 1/8) / 7 ≈ 0.25` under a causal mask (query `i`
# spreads over its `i + 1` visible keys): compare the heads with those baselines.

# %% answer="previous_token_score"
def previous_token_score(attention):
    """Mean weight on key i-1, per layer and head.

    attention: [B, layers, heads, S, S] tensor, or a list of [B, heads, S, S] (one per layer)
    returns: [layers, heads], the mean over the batch and over queries i = 1 ... S-1 of
    attention[b, layer, head, i, i-1]; the input's dtype and device.

    Example: for maps that put all weight on key i-1 (and query 0 on itself), every entry is 1.
    Raises ValueError for another rank, non-square maps or S = 1.
    """
    ### BEGIN SOLUTION
    if isinstance(attention, (list, tuple)):
        attention = torch.stack(list(attention), dim=1)            # [B, layers, heads, S, S]
    if attention.dim() != 5:
        raise ValueError(f"attention has rank {attention.dim()}: expected [B, layers, heads, S, S] "
                         "or a list of [B, heads, S, S]")
    if attention.shape[-1] != attention.shape[-2]:
        raise ValueError(f"attention maps are {attention.shape[-2]} x {attention.shape[-1]}: "
                         "expected square maps (self-attention)")
    if attention.shape[-1] < 2:
        raise ValueError("S = 1: no query has a previous token")
    below_diagonal = attention.diagonal(offset=-1, dim1=-2, dim2=-1)  # [B, layers, heads, S-1]
    return below_diagonal.mean(dim=(0, -1))
    ### END SOLUTION


# %% test="test_previous_token_score" points=2
"""previous_token_score: mean weight on key i-1 per layer and head; tensor or list; bad input."""
from attention_lab.checks.positions_and_blocks import check_previous_token_score

check_previous_token_score(previous_token_score)
### BEGIN HIDDEN TESTS
check_previous_token_score(previous_token_score, seed=3132, device="cpu")
### END HIDDEN TESTS

# %% [markdown]
# Run it on the four trained models, over 500 test sequences: one row per layer, one column
# per head. Then the **length probe**: the two models without a position table can read
# sequences longer than the 8 they were trained on, so give the causal one sequences of 14 and
# see how far what it learned carries.

# %%
from attention_lab.widgets.trained_heads import attention_maps

if not trained:  # the training cell stopped before any model was trained
    raise NotImplementedError("Exercise 3.13: implement OrderTransformer, then train (cell above)")
probe, _ = previous_token_batch(500, torch.Generator().manual_seed(99))
for name, model in trained.items():
    scores = previous_token_score(attention_maps(model, probe.to(device), masks_used[name]))
    rows = " | ".join(" ".join(f"{v:.2f}" for v in layer) for layer in scores.tolist())
    print(f"{name:22s} weight on i-1, layer 0 | layer 1 (heads): {rows}")

nope = trained["no positions, causal"]
for back in (1, 2, 3):  # how the causal model's weight falls off with distance
    maps = torch.stack(attention_maps(nope, probe.to(device), causal_order), dim=1)
    keys = torch.arange(back, SEQ_LEN)
    print(f"no positions, causal: mean weight on i-{back} per layer:",
          [round(v, 2) for v in maps[:, :, :, keys, keys - back].mean(dim=(0, 2, 3)).tolist()])
LONG = 14  # longer than the 8 positions seen in training (16 distinct tokens exist)
long_generator = torch.Generator().manual_seed(5)
long_tokens = torch.rand(500, VOCAB, generator=long_generator).argsort(dim=-1)[:, :LONG]
long_mask = torch.ones(LONG, LONG, dtype=torch.bool, device=device).tril()
with torch.no_grad():
    predicted = nope(long_tokens.to(device), long_mask).argmax(dim=-1).cpu()
per_position = (predicted[:, 1:] == long_tokens[:, :-1]).float().mean(dim=0)
print("no positions, causal, sequences of 14: accuracy per position 1..13:",
      " ".join(f"{a:.2f}" for a in per_position.tolist()))

# %% [markdown]
# **Reading the numbers.** Under a causal mask "the previous token" is "the most recent token
# the query can see", and part of a causal model's score is free: at position `i` it sees only
# tokens `0 … i`, so even guessing at random among the `i` earlier ones would score `1/i`, on
# average `(1 + 1/2 + … + 1/7) / 7 ≈ 0.37`. The rest it learns. How, the numbers above say if
# you compare them with the baselines (`1/S` without a mask, ≈ 0.25 under one): which layer of
# which model puts how much weight on `i - 1`, how the NoPE model's weight falls off with the
# distance, and — read position by position — where the length probe's accuracy starts to fall:
# at position 8, the first one the model never saw, or elsewhere? (Measured with seed 0 on a
# CPU; other seeds move the numbers by a few hundredths.)
#
# The last line measures section 2's question on the trained sinusoidal model: its position
# table alone through its first layer's `W_q` and `W_k` (bias included), head by head, and how
# much the scores at one offset differ — 0 if they depended on the offset alone.

# %%
if "sinusoidal" not in trained:  # the training cell stopped before this model was trained
    raise NotImplementedError("Exercise 3.13: implement OrderTransformer, then train (cell above)")
from attention_lab.widgets.trained_heads import attention_layers

first_layer = attention_layers(trained["sinusoidal"])[0].attn  # layer 0's nn.MultiheadAttention
with torch.no_grad():
    table_alone = sinusoidal_positions(SEQ_LEN, 32).double()  # the model's table: [S, D]
    q_rows, k_rows, _ = F.linear(table_alone, first_layer.in_proj_weight.double(),
                                 first_layer.in_proj_bias.double()).chunk(3, dim=-1)
    head_width = q_rows.shape[-1] // first_layer.num_heads
    spreads = []
    for head in range(first_layer.num_heads):
        columns = slice(head * head_width, (head + 1) * head_width)
        position_scores = q_rows[:, columns] @ k_rows[:, columns].T / math.sqrt(head_width)
        spreads.append(max(float(d.max() - d.min()) for d in
                           (position_scores.diagonal(o) for o in range(2 - SEQ_LEN, SEQ_LEN - 1))))
print("sinusoidal model, layer 0: position-only scores at one offset differ by up to",
      [round(v, 1) for v in spreads], "(per head)")

# %% [markdown]
# **Look inside.** Each map below is one head of one layer (rows: queries, columns: keys)
# on one test sequence; the labels are `position:token`. Switch between the models and the
# sequences.

# %%
from attention_lab.widgets.trained_heads import trained_heads_explorer

if not trained:  # the training cell stopped before any model was trained
    raise NotImplementedError("Exercise 3.13: implement OrderTransformer, then train (cell above)")
examples, _ = previous_token_batch(8, torch.Generator().manual_seed(7))
trained_heads_explorer(trained, examples, masks_used)

# %% [markdown]
# ### Exercise 3.14 — written: what do the heads do? (2 pts, ~5 min)
#
# Answer from **your** numbers (the detector's table, the fall-off with distance, the length
# probe) and the maps, in four or five sentences: which models have a head that does the
# task's job, in which layer, and how cleanly (how much weight on `i - 1`)? Is it
# `pe_shift_matrix`'s property that makes the sinusoidal model's head work — compare it with
# the learned table, which has no such property? How does the causal model without positions
# do it, and what does the length probe tell you that accuracy at length 8 does not? This
# answer is graded by hand.

# %% [markdown] manual="what_one_head_does" points=2
# *Model answer* (numbers of seed 0 on a CPU; yours may differ by a few hundredths). Both
# models with a position table have heads in layer 0 that read the previous token: 0.68 and
# 0.72 of their weight on `i - 1` with sinusoidal positions (about 0.1 on `i - 2`), 0.99 and
# 0.92 with the learned table. So the offset-only property of the sinusoidal table is not what
# makes the head work: the trained sinusoidal model's position-only scores at one offset differ
# by 4 to 5 from one position to another (it did not learn section 2's scaled rotations), and with
# 8 positions a learned table that has no such property does as well or better — any table that
# gives the 8 positions vectors the query and key projections can tell apart will do;
# shift-invariance would matter for positions never trained on. The head copies the previous
# token into position `i`, where the linear head reads it out. The causal model without
# positions has no clean previous-token head: its layer 1 does recency (about 0.5, 0.15, 0.06 on
# `i - 1, i - 2, i - 3`), which the mask makes possible (through the mask, a token's average over
# the `i + 1` tokens it sees depends on where it sits; Haviv et al., 2022, found causal language
# models without position encodings learning order the same way). The length probe shows what
# limits it: the accuracy falls smoothly with the position, already inside the training length
# (0.97 and 0.95 at positions 6 and 7) and on past it (0.92 at 8, about 0.7 at 12 and 13), with
# no step at 8 — recency is not tied to absolute positions, but the more keys a query sees, the
# more weight the older ones take together. A model with an 8-row table cannot even be run on
# 14 tokens. Position 0 has no previous token and is never scored.

# %% [markdown]
# ## 6. One step deeper: an induction head, built by hand
#
# A previous-token head looks one position back. Put a second head on top of it, and the pair
# can do what no single head can: **copy from the context**. In `… A B … A`, predict `B`: find
# the last time the current token appeared, and read the token that came after it. Olsson et
# al. (2022) called the second head an **induction head**; they found such pairs in the
# Transformer language models they studied, forming during training at the point where
# in-context learning improves.
#
# The task makes it concrete: `half` distinct random tokens, then the same tokens once more.
# In the first half the next token is a fresh random token, and nothing predicts it better than
# chance; in the second half every next token can be copied from the first.
#
# Two heads do it, each adding what it finds to the **residual stream** (the running vector `x`
# of section 4; here with no MLP and no LayerNorm):
#
# 1. **Layer 1, a previous-token head.** Query `i` attends to key `i - 1` and copies the token it
#    finds there into a free part of the stream: every position now also carries *the token
#    before it*.
# 2. **Layer 2, the induction head.** Its **query** is the current token; its **key** is the
#    *previous* token that layer 1 wrote — a key built from another head's output, what Elhage
#    et al. (2021) call **K-composition**. Query `i` matches key `j` exactly when the token
#    before `j` is the token at `i`: `j` is the position *after* an earlier occurrence. Its
#    **value** is the token at `j`, the prediction.
#
# ```
# position        0  1  2  3  4  5  6  7
# token           A  B  C  D  A  B  C  D
# previous token  -  A  B  C  D  A  B  C      (written by layer 1)
# ```
#
# Query 5 holds `B`; the keys whose previous token is `B` are 2 and 6, and 6 is in its future:
# it attends to key 2, which holds `C`, and predicts `C` — the token at position 6.

# %% [markdown]
# ### Exercise 3.15 — induction_score (2 pts, ~10 min)
#
# The detector first, beside `previous_token_score`: how much of its weight does a head put
# where an induction head looks? For query `i`, take every earlier position `j < i - 1` that
# holds the same token as `i`; the keys an induction head reads are the positions after them,
# `j + 1` (`j = i - 1` is left out: its `j + 1` is the query itself). A (sequence, query) pair
# scores the total weight on those keys. A head's score is the mean over every pair that has at
# least one such `j` — a query whose token never appeared before has nowhere to look, and is
# left out — and 0 where no pair has one.
#
# Worked on one sequence, `A B C A B A` (positions 0 … 5): query 3 (`A`) has `j = 0`, so key
# 1; query 4 (`B`) has `j = 1`, so key 2; query 5 (`A`) has `j = 0` (and `j = 3`, whose key 4 is
# fine too: `3 < 5 - 1`), so keys 1 and 4; queries 0, 1 and 2 are left out. The score is the
# mean of `attention[3, 1]`, `attention[4, 2]` and `attention[5, 1] + attention[5, 4]`.
#
# | name | signature | contract |
# | --- | --- | --- |
# | `induction_score` | `(attention, tokens) -> Tensor` | `attention` as in `previous_token_score` (a tensor `[B, layers, heads, S, S]` or a list of `[B, heads, S, S]`), `tokens [B, S]` → `[layers, heads]`: the mean, over every (sequence, query) pair that has an earlier `j < i - 1` with `tokens[j] == tokens[i]`, of the total weight on the keys `j + 1` (each key once); 0 where no pair has one; the input's dtype and device; `ValueError` for another rank, maps that are not square, or `tokens` that do not match the maps' batch and length |

# %% answer="induction_score"
def induction_score(attention, tokens):
    """Mean weight on the keys after earlier occurrences of the query's token, per layer and head.

    attention: [B, layers, heads, S, S] tensor, or a list of [B, heads, S, S] (one per layer);
    tokens: [B, S]. returns: [layers, heads], pooled over the (sequence, query) pairs that have an
    earlier position j < i - 1 holding the query's token; 0 where none has; the input's dtype.

    Example: for tokens A B C A B and maps whose query 3 puts all its weight on key 1 and query 4
    on key 2, every entry is 1.
    Raises ValueError for another rank, non-square maps, or tokens that do not match the maps.
    """
    ### BEGIN SOLUTION
    if isinstance(attention, (list, tuple)):
        attention = torch.stack(list(attention), dim=1)            # [B, layers, heads, S, S]
    if attention.dim() != 5 or attention.shape[-1] != attention.shape[-2]:
        raise ValueError(f"attention has shape {tuple(attention.shape)}: expected square maps "
                         "[B, layers, heads, S, S] or a list of [B, heads, S, S]")
    batch, seq_len = attention.shape[0], attention.shape[-1]
    if tuple(tokens.shape) != (batch, seq_len):
        raise ValueError(f"tokens have shape {tuple(tokens.shape)}: expected [B, S] = "
                         f"[{batch}, {seq_len}], as the maps")
    positions = torch.arange(seq_len, device=tokens.device)
    same = tokens[:, :, None] == tokens[:, None, :]                 # [B, i, j]: same token
    earlier = same & (positions[None, :] < positions[:, None] - 1)  # j < i - 1
    keys = torch.zeros_like(earlier)
    keys[:, :, 1:] = earlier[:, :, :-1]                             # key j + 1 for every such j
    has_one = earlier.any(dim=-1)                                   # [B, i]: pairs that count
    weight = (attention * keys[:, None, None].to(attention.dtype)).sum(dim=-1)  # [B, L, H, S]
    total = (weight * has_one[:, None, None].to(attention.dtype)).sum(dim=(0, -1))
    return total / has_one.sum().clamp(min=1)                       # 0 where no pair has one
    ### END SOLUTION


# %% test="test_induction_score" points=2
"""induction_score: weight on the keys after earlier occurrences; pooled pairs; tensor or list."""
from attention_lab.checks.positions_and_blocks import check_induction_score

check_induction_score(induction_score)
### BEGIN HIDDEN TESTS
check_induction_score(induction_score, seed=3151, device="cpu")
### END HIDDEN TESTS

# %% [markdown]
# **The model.** Two causal heads on a residual stream, given: no training, you will set every
# weight. Each head reads the stream `x` (`[B, S, D]`) with four `[D, D]` matrices that start at
# zero: `q = x W_q`, `k = x W_k`, `v = x W_v`, weights `softmax(q kᵀ)` over the keys `0 … i`,
# output `(weights v) W_o`, added to `x`. There is no `1/sqrt(d)`: the size of what you set is
# the softmax's temperature.

# %%
class CausalHead(nn.Module):
    """One causal attention head reading and writing a residual stream of width d_model."""

    def __init__(self, d_model):
        super().__init__()
        self.W_q, self.W_k, self.W_v, self.W_o = (nn.Parameter(torch.zeros(d_model, d_model))
                                                  for _ in range(4))

    def forward(self, x):                                    # x: [B, S, D]
        scores = (x @ self.W_q) @ (x @ self.W_k).transpose(-2, -1)     # [B, S, S]
        seq_len = x.shape[1]
        later = torch.ones(seq_len, seq_len, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(later, float("-inf")).softmax(dim=-1)
        return (weights @ (x @ self.W_v)) @ self.W_o, weights[:, None]   # [B, S, D], [B, 1, S, S]


class AttentionOnlyModel(nn.Module):
    """Token and position embeddings, two CausalHeads on a residual stream, an unembedding."""

    def __init__(self, vocab_size, max_len, d_model):
        super().__init__()
        self.token_embedding = nn.Parameter(torch.zeros(vocab_size, d_model))
        self.position_embedding = nn.Parameter(torch.zeros(max_len, d_model))
        self.layers = nn.ModuleList([CausalHead(d_model), CausalHead(d_model)])
        self.unembedding = nn.Parameter(torch.zeros(d_model, vocab_size))

    def run(self, tokens):                                   # tokens: [B, S] (long)
        x = self.token_embedding[tokens] + self.position_embedding[:tokens.shape[1]]
        maps = []
        for layer in self.layers:
            out, weights = layer(x)
            x = x + out                                      # the residual stream
            maps.append(weights)
        return x @ self.unembedding, maps                    # [B, S, vocab], 2 × [B, 1, S, S]

    def forward(self, tokens):
        return self.run(tokens)[0]

    def attention(self, tokens):
        return self.run(tokens)[1]

# %% [markdown]
# ### Exercise 3.16 — induction_model: the two heads, by hand (4 pts, ~20 min)
#
# (3 points for what it predicts, 1 for its attention maps.)
#
# Write `induction_model(vocab_size, max_len)`: build an `AttentionOnlyModel` and set its
# weights (inside `torch.no_grad()`) so that it does the two steps above. A layout of the
# stream that works — any other that keeps the four parts apart works too — with
# `V = vocab_size`, `L = max_len` and `D = 3·V + L` features:
#
# | features | hold | written by | read by |
# | --- | --- | --- | --- |
# | `token`: `0 … V-1` | the one-hot of this position's token | the token embedding | layer 2's query and value |
# | `position`: the next `L` | the one-hot of the position | the position embedding | layer 1's query and key |
# | `previous`: the next `V` | the one-hot of the token one position back | layer 1 (`W_v`, `W_o`) | layer 2's key |
# | `copied`: the last `V` | the token layer 2 attended to | layer 2 (`W_v`, `W_o`) | the unembedding |
#
# Row `r` of `W_q` says what feature `r` of the stream adds to each of the head's `D` query
# coordinates (the same for `W_k`); a query and a key *meet* on a coordinate where both are
# large. For example `W_k[position, position] = torch.eye(L)` gives the key of position `j` a 1
# in head coordinate `j`: a query that puts 20 in coordinate `j` then scores 20 on key `j` and 0
# on the others, which leaves the others `e^-20 ≈ 2·10⁻⁹` of its weight each.
#
# One trap, at position 0: it has no previous token, so its layer-1 query can only attend to
# itself and writes its *own* token as "previous". The query at position `half` (the first
# token, repeated) then matches key 0 as well as key 1, splits its weight, and guesses. Keep
# layer 2 off key 0 with a large negative score (every query has exactly one 1 in its
# `position` block: a constant it can contribute).
#
# | name | signature | contract |
# | --- | --- | --- |
# | `induction_model` | `(vocab_size, max_len) -> nn.Module`; `forward(tokens [B, S]) -> logits [B, S, vocab_size]`; `.attention(tokens)` → a list of two `[B, 1, S, S]` maps | two attention-only layers (one causal head each, no MLP, a residual stream), weights set by hand; on `half` distinct random tokens repeated once, the predictions of `tokens[i + 1]` at positions `half … 2·half − 2` are right ≥ 0.95 of the time, the first half stays near chance; causal maps; layer 2's `induction_score` ≥ 0.9 |
#
# The checks build your model for several vocabularies and lengths and run it on 100 such
# sequences each: the first on its predictions, the second on its maps (layer 1's
# `previous_token_score` and layer 2's `induction_score` at least 0.9, with their own
# detectors). They name what they see wrong: the order of the layers, the shift, the roles of
# query and key, the value.

# %% answer="induction_model"
def induction_model(vocab_size, max_len):
    """A two-layer attention-only model with hand-set weights: a previous-token head, then an
    induction head that copies the token after the last occurrence of the current one.

    returns an AttentionOnlyModel (or any nn.Module with forward(tokens) -> [B, S, vocab_size]
    logits and attention(tokens) -> [layer-1 map, layer-2 map], each [B, 1, S, S]).

    Example: on tokens A B C D A B C, its prediction at position 5 (B) is C.
    """
    ### BEGIN SOLUTION
    V, L, strength = vocab_size, max_len, 20.0
    token, position = slice(0, V), slice(V, V + L)
    previous, copied = slice(V + L, 2 * V + L), slice(2 * V + L, 3 * V + L)
    model = AttentionOnlyModel(V, L, d_model=3 * V + L)
    first, second = model.layers
    with torch.no_grad():
        model.token_embedding[:, token] = torch.eye(V)
        model.position_embedding[:, position] = torch.eye(L)
        # Layer 1: the query of position p asks for coordinate p - 1, the key of j answers in j.
        first.W_q[position, position] = strength * torch.eye(L).roll(-1, dims=1)
        first.W_k[position, position] = torch.eye(L)
        first.W_v[token, token] = torch.eye(V)                 # what it finds: the token there ...
        first.W_o[token, previous] = torch.eye(V)              # ... written as "previous"
        # Layer 2: query = the current token, key = the previous token layer 1 wrote.
        second.W_q[token, token] = strength * torch.eye(V)
        second.W_k[previous, token] = torch.eye(V)
        second.W_q[position, V] = 1.0                          # every query: a 1 in coordinate V ...
        second.W_k[V, V] = -strength                           # ... and key 0 answers -strength
        second.W_v[token, token] = torch.eye(V)                # what it finds: the token there ...
        second.W_o[token, copied] = torch.eye(V)               # ... written as "copied"
        model.unembedding[copied, :] = torch.eye(V)            # the logits read "copied"
    return model
    ### END SOLUTION


# %% test="test_induction_model" points=3
"""induction_model: repeated random sequences, >= 0.95 of the second half right, first at chance."""
from attention_lab.checks.positions_and_blocks import check_induction_model

check_induction_model(induction_model)
### BEGIN HIDDEN TESTS
check_induction_model(induction_model, seed=3161, device="cpu")
### END HIDDEN TESTS

# %% test="test_induction_model_properties" points=1
"""induction_model: causal maps; layer 1 a previous-token head, layer 2 an induction head."""
from attention_lab.checks.positions_and_blocks import check_induction_model_properties

check_induction_model_properties(induction_model)
### BEGIN HIDDEN TESTS
check_induction_model_properties(induction_model, seed=3162, device="cpu")
### END HIDDEN TESTS

# %% [markdown]
# Your two heads on one sequence of 8 distinct tokens repeated (rows: queries, columns: keys),
# and both detectors on 200 such sequences. Layer 1 is the sub-diagonal; layer 2 is the
# diagonal `half - 1` below the main one — each query of the second half looks `half - 1`
# positions back, at the token after the first occurrence of its own.

# %%
import matplotlib.pyplot as plt


def repeated_sequences(batch_size, vocab_size, half, generator):
    """[B, 2·half]: `half` distinct random tokens, then the same tokens again."""
    first = torch.rand(batch_size, vocab_size, generator=generator).argsort(dim=-1)[:, :half]
    return torch.cat([first, first], dim=1)


hand_built = induction_model(16, 32)
probe_tokens = repeated_sequences(200, 16, 8, torch.Generator().manual_seed(3))
with torch.no_grad():
    predicted = hand_built(probe_tokens).argmax(dim=-1)
    maps = hand_built.attention(probe_tokens)
print("right next tokens, first half:",
      f"{float((predicted[:, :7] == probe_tokens[:, 1:8]).float().mean()):.2f}",
      "| second half:", f"{float((predicted[:, 8:15] == probe_tokens[:, 9:]).float().mean()):.2f}")
print("previous_token_score per layer:",
      [round(v, 2) for v in previous_token_score(maps).flatten().tolist()],
      "| induction_score per layer:",
      [round(v, 2) for v in induction_score(maps, probe_tokens).flatten().tolist()])
figure, axes = plt.subplots(1, 2, figsize=(9, 4))
labels = [f"{p}:{t}" for p, t in enumerate(probe_tokens[0].tolist())]
for layer_index, axis in enumerate(axes):
    axis.imshow(maps[layer_index][0, 0], cmap="viridis", vmin=0, vmax=1)
    axis.set(title=f"layer {layer_index + 1}", xticks=range(16), yticks=range(16), xlabel="key",
             ylabel="query")
    axis.set_xticklabels(labels, rotation=90, fontsize=7)
    axis.set_yticklabels(labels, fontsize=7)
figure.tight_layout()
plt.show()

# %% [markdown]
# ## What you built
#
# * Self-attention is permutation-**equivariant**; position encodings break the symmetry.
# * `sinusoidal_positions`: the Transformer's fixed, absolute encoding, whose raw dot products
#   depend only on the offset between positions — not always once `W_q` and `W_k` project
#   them, which is why RoPE (notebook 05) rotates after the projections.
# * `FourierFeatures` + `CoordinateMLP`: sines and cosines of coordinates at increasing
#   frequencies let a small MLP draw fine detail; `psnr` measured how much better.
# * `TransformerLayer` / `Transformer`: pre-norm residual blocks, equal to
#   `nn.TransformerEncoderLayer(D, H, dim_feedforward=int(mlp_ratio·D), dropout=0.0,
#   activation="gelu", layer_norm_eps=1e-6, batch_first=True, norm_first=True)` (every one of
#   those arguments matters) — with the mask converted to PyTorch's True = blocked — and a
#   final LayerNorm for the un-normalised residual stream.
# * `pe_shift_matrix` and `offset_only_qk`: a shift of a sinusoidal encoding is a fixed
#   rotation; a generic pair of projections breaks the offset-only property of the raw table,
#   a `W_qᵀ W_k` of scaled rotations per pair keeps it, and RoPE guarantees it for every pair
#   by rotating after them.
# * `OrderTransformer` and `previous_token_score`: four models trained on a task that needs
#   order, and a detector that measures what their heads learned, at the lengths they saw and
#   beyond.
# * `induction_score` and `induction_model`: two heads composed by hand — a previous-token head,
#   then an induction head whose key reads what the first wrote — copy the second half of a
#   repeated sequence from its first, and a detector that finds such heads.
#
# Next: notebook 04 cuts images into patches and feeds them to these blocks (a Vision
# Transformer).
