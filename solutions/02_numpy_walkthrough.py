# %% [markdown]
# # 02 — The NumPy walkthrough
#
# Notebook 01 built multi-head attention from PyTorch modules. Here you do the same maths by
# hand in **NumPy**, on a configuration small enough to print whole — `B = 2` sequences of
# `S = 6` tokens with `D = 4` features, split into `H = 2` heads of `d_head = 2` — and look at
# every intermediate array. Then you measure *why* the scores are divided by `sqrt(d_head)`, and
# finally write the **backward pass** by hand: the gradients that training needs, and what they
# cost in memory.
#
# **34 points, about 135 minutes.**
#
# **Notation** (as in every notebook): `B` batch, `S` sequence length, `D` model width, `H`
# heads, `d_head = D // H`. The walkthrough this notebook grew from calls the feature width
# `N`; we call it `D`.
#
# **Rules of this notebook.**
#
# * Your answers use **NumPy only** (no torch, not even "compute in torch and convert back":
#   the checks notice and say so). The checks compare your arrays with PyTorch in float64.
# * **float32 in, float32 out**: every answer returns arrays of its input's dtype, as NumPy and
#   PyTorch functions do. Watch the one trap: NumPy 2 keeps a float32 array float32 when it
#   meets a Python float (`x / math.sqrt(d)`), but a NumPy float64 scalar promotes it
#   (`x / np.sqrt(d)` is float64). Use `math.sqrt`, or cast back with `.astype(x.dtype)`.
# * Masks are boolean with **True = may attend**.

# %%
import math

import matplotlib.pyplot as plt
import numpy as np
import torch  # only the demo cells use it, to compare with PyTorch; your answers do not

# %% [markdown]
# ## 1. The input: a `(B, S, D)` array
#
# One fixed generator, `np.random.default_rng(2024)`, makes every number below reproducible:
# run the notebook twice and you get the same arrays. (Without a seed, printed numbers can
# never be checked again.)

# %%
B, S, D, H = 2, 6, 4, 2
d_head = D // H

rng = np.random.default_rng(2024)
X = rng.standard_normal((B, S, D)).round(2)  # [B, S, D]
print(X)
print("shape:", X.shape)

# %% [markdown]
# Read a 3-D array from the outside in: `X[b]` is sequence `b` (a `(6, 4)` block), `X[b, s]` is
# token `s` of that sequence (a row of `D = 4` features), `X[b, s, i]` is one feature.

# %%
print("sequence 1, token 0:", X[1, 0], "| feature 2 of it:", X[1, 0, 2])

# %% [markdown]
# ## 2. Weights, in `(in, out)` layout
#
# Queries, keys and values are three linear projections of every token, plus a fourth, the
# **output projection** `W_o`, applied after the heads are merged. As in the walkthrough, a
# projection is written `X @ W` with `W` of shape `(in, out)`.
#
# Careful when you compare with PyTorch: `nn.Linear.weight` (and `nn.MultiheadAttention`'s
# `in_proj_weight`) is stored the other way round, `(out, in)`, and computes `x @ weight.T`.
# Moving weights between the two conventions means transposing them (section 9 does it).

# %%
W_q = rng.standard_normal((D, D)).round(2)  # (in, out): Q = X @ W_q
W_k = rng.standard_normal((D, D)).round(2)
W_v = rng.standard_normal((D, D)).round(2)
W_o = rng.standard_normal((D, D)).round(2)  # the output projection
print("W_q =\n", W_q)

# %% [markdown]
# ## 3. Projections: what `@` does with a 3-D array
#
# `Q_total = X @ W_q` multiplies a `(B, S, D)` array by a `(D, D)` matrix and gives `(B, S, D)`.
# (The walkthrough's comment says `(S, B, N)`: the batch axis comes first, `(B, S, D)`.)
#
# `@` treats every axis but the last two as a batch: for **each** `(b, s)` it multiplies the
# row `X[b, s]` (shape `(D,)`) by `W_q`. The same weights, applied independently to every
# token of every sequence. For one row `x` and a matrix `W` of shape `(N, M)`:
#
# $$ (x\,W)_j = \sum_{i=0}^{N-1} x_i\, W_{i j}, \qquad j = 0, \dots, M-1 $$
#
# Each output feature `j` walks `x` down column `j` of `W`.

# %%
Q_total = X @ W_q  # (B, S, D) @ (D, D) -> (B, S, D)
K_total = X @ W_k
V_total = X @ W_v
print("Q_total:", Q_total.shape)
print("token (b=0, s=0):", X[0, 0], "@ W_q =", Q_total[0, 0])

# %% [markdown]
# ### Exercise 2.1 — row_times_matrix (2 pts, ~10 min)
#
# Write one row-times-matrix product **as explicit sums**: loops over `j` (output features)
# and `i` (input features). `x_row` has shape `(N,)`, `W` has shape `(N, M)`; return shape
# `(M,)`, in the inputs' dtype. Do not use `@`, `np.dot`, `np.matmul` or `np.einsum` here, nor
# a product of whole arrays summed at once (`np.sum(x_row[:, None] * W, axis=0)` is `@` in
# disguise): the exercise is what they do inside, and the check reads your code to see that it
# loops. The check uses weights that are **not square**, where mixing up `i` and `j` cannot
# hide: it names the mix-up.

# %% answer="row_times_matrix"
def row_times_matrix(x_row, W):
    """x_row @ W written as sums: out[j] = sum_i x_row[i] * W[i, j].

    x_row: (N,), W: (N, M)  ->  (M,), same dtype as the inputs.

    Example: row_times_matrix(np.array([1., 2.]), np.array([[1., 0., 2.], [0., 1., 3.]]))
    gives array([1., 2., 8.]).
    """
    ### BEGIN SOLUTION
    num_in, num_out = W.shape
    out = np.zeros(num_out, dtype=np.result_type(x_row, W))
    for j in range(num_out):
        total = 0.0
        for i in range(num_in):
            total += x_row[i] * W[i, j]
        out[j] = total
    return out
    ### END SOLUTION


# %% test="test_row_times_matrix" points=2
"""row_times_matrix: loops (no @), equal to x_row @ W for square and non-square W, dtype kept."""
from attention_lab.checks.numpy_walkthrough import check_row_times_matrix

check_row_times_matrix(row_times_matrix)
### BEGIN HIDDEN TESTS
check_row_times_matrix(row_times_matrix, seed=2101)
check_row_times_matrix(row_times_matrix, seed=2102)
### END HIDDEN TESTS

# %%
# Every (b, s) of the batched product is one row_times_matrix.
by_hand = np.array([[row_times_matrix(X[b, s], W_q) for s in range(S)]
                    for b in range(B)])  # [B, S, D]
print("all B·S rows equal X @ W_q:", np.allclose(by_hand, X @ W_q))
W_narrow = rng.standard_normal((D, 3))  # (in=4, out=3): not square
print("non-square:", row_times_matrix(X[0, 0], W_narrow), "vs", X[0, 0] @ W_narrow)

# %% [markdown]
# ## 4. Heads: split and merge
#
# Each head works on its own `d_head` columns of the projected `Q`, `K`, `V`. Splitting is a
# reshape of the feature axis, `(B, S, D) -> (B, S, H, d_head)`, then a transpose that moves
# the head axis in front of the sequence axis, `-> (B, H, S, d_head)`. Why that order? `@`
# batches over all leading axes, so with `(B, H)` in front every head of every sequence gets
# its own `(S, d_head)` matrix and one `@` computes them all. (The walkthrough calls
# `(B, S, H, d_head)` "the paper convention": the paper specifies no array layout at all.)
#
# ### Exercise 2.2 — np_split_heads (2 pts, ~5 min)
#
# A quick one: notebook 01's `split_heads` in NumPy's words. Why write it again? Every later
# answer of this notebook is NumPy only, so it needs its own split and merge; and the NumPy
# spelling is what you will read in NumPy and JAX code: `reshape` where notebook 01 used `view`,
# and `transpose(0, 2, 1, 3)` — every axis in its new order — where it used `permute`.
#
# `(B, S, D) -> (B, H, S, D // H)`, head `h` holding features `h*d_head … (h+1)*d_head - 1` of
# every token; a `ValueError` naming both numbers if `D` is not divisible by `num_heads`.

# %% answer="np_split_heads"
def np_split_heads(t, num_heads):
    """Split the feature axis into heads.

    t: (B, S, D)  ->  (B, H, S, D // H)   (H = num_heads)

    Example: t of shape (2, 6, 4) with num_heads=2 gives (2, 2, 6, 2), and
    np_split_heads(t, 2)[0, 1, 0] equals t[0, 0, 2:4].
    Raises ValueError if D is not divisible by num_heads.
    """
    ### BEGIN SOLUTION
    batch, seq_len, width = t.shape
    if width % num_heads != 0:
        raise ValueError(f"D = {width} is not divisible by num_heads = {num_heads}")
    d = width // num_heads
    return t.reshape(batch, seq_len, num_heads, d).transpose(0, 2, 1, 3)  # (B, H, S, d_head)
    ### END SOLUTION


# %% test="test_np_split_heads" points=2
"""np_split_heads: (B, S, D) -> (B, H, S, D//H): numbers, edge cases, the ValueError."""
from attention_lab.checks.numpy_walkthrough import check_np_split_heads

check_np_split_heads(np_split_heads)
### BEGIN HIDDEN TESTS
check_np_split_heads(np_split_heads, seed=2201)
### END HIDDEN TESTS

# %%
Q = np_split_heads(X @ W_q, H)  # (B, H, S, d_head)
print("Q:", Q.shape)
print("head 1 of token 0 (sequence 0):", Q[0, 1, 0], "= features 2..3 of", (X @ W_q)[0, 0])

# %% [markdown]
# ### Exercise 2.3 — np_merge_heads (1 pt, ~3 min)
#
# The inverse: `(B, H, S, d) -> (B, S, H, d) -> (B, S, H * d)`. Transpose first, then reshape
# (NumPy's `reshape` copies when it has to, so the transposed array is no problem: no
# `.contiguous()` step as in notebook 01).

# %% answer="np_merge_heads"
def np_merge_heads(t):
    """Concatenate the heads' features back into one axis.

    t: (B, H, S, d)  ->  (B, S, H * d)

    Example: np_merge_heads(np_split_heads(t, 2)) equals t.
    """
    ### BEGIN SOLUTION
    batch, num_heads, seq_len, d = t.shape
    return t.transpose(0, 2, 1, 3).reshape(batch, seq_len, num_heads * d)  # (B, S, D)
    ### END SOLUTION


# %% test="test_np_merge_heads" points=1
"""np_merge_heads: (B, H, S, d) -> (B, S, H*d), on a transposed view too; inverts the split."""
from attention_lab.checks.numpy_walkthrough import check_np_merge_heads

check_np_merge_heads(np_merge_heads)
### BEGIN HIDDEN TESTS
check_np_merge_heads(np_merge_heads, seed=2301)
### END HIDDEN TESTS

# %%
print("round trip exact:", np.array_equal(np_merge_heads(np_split_heads(X, H)), X))

# %% [markdown]
# ## 5. Raw scores, and why `K` is transposed
#
# The score of query `i` against key `j` (in one head of one sequence) is the dot product
# `Q[b, h, i] · K[b, h, j]`, a sum over the `d_head` features. All `S × S` of them at once are
# a matrix product `Q Kᵀ`: `Q` is `(S, d_head)`, so `K` must be turned into `(d_head, S)` for
# the inner axes to meet. In the batched form only the **last two** axes are swapped:
#
# `(B, H, S, d_head) @ (B, H, d_head, S) -> (B, H, S, S)`
#
# The product sums over `d_head` — the per-head feature axis, not the head axis `H` (each head
# is computed separately). `K.T` would reverse all four axes: use `K.transpose(0, 1, 3, 2)` or
# `np.swapaxes(K, -1, -2)`.

# %%
Q = np_split_heads(X @ W_q, H)  # (B, H, S, d_head)
K = np_split_heads(X @ W_k, H)
# (B, H, S, d_head) @ (B, H, d_head, S) -> (B, H, S, S)
raw_scores = Q @ K.transpose(0, 1, 3, 2)
print("scores:", raw_scores.shape)
print("batch 0, head 0:\n", raw_scores[0, 0].round(2))
one_dot_product = Q[0, 0, 2] @ K[0, 0, 4]
print("entry (i=2, j=4) is one dot product:", np.isclose(raw_scores[0, 0, 2, 4], one_dot_product))

# %% [markdown]
# ## 6. Why divide by `sqrt(d_head)`? The variance argument, done right
#
# Take `q` and `k` with independent entries of mean 0 and variance `σ²`. Their dot product
# `q · k = Σ_i q_i k_i` is a sum of `d` independent terms, each with mean 0 and variance
#
# $$ \mathrm{Var}(q_i k_i) = \mathbb{E}[q_i^2]\,\mathbb{E}[k_i^2] = \sigma^2 \cdot \sigma^2 = \sigma^4 ,$$
#
# so **`Var(q · k) = d · σ⁴`**. (The walkthrough writes `d · σ²`; that holds only when `σ = 1`.)
# Dividing the scores by `sqrt(d)` divides the variance by `d`: the scaled scores have variance
# `σ⁴` whatever the head width. That is the point of the factor: the spread of the scores no
# longer grows with `d_head`. (What it does *not* promise is the subject of a written question
# after the next exercise.)
#
# Is `1/sqrt(d_head)` "the only mathematically correct factor"? No: it is the one that keeps the
# variance constant under this independence assumption. Other choices are in use:
#
# * **μP** (maximal-update parametrisation) scales by `1/d_head`, with an initialisation and
#   learning rates of its own.
# * **Gemma 2 27B** scales by `1/sqrt(d_model / H) = 1/sqrt(4608 / 32) = 1/sqrt(144)` (its
#   `query_pre_attn_scalar`), although its heads are 128 wide; the model's configuration, not
#   `head_dim`, sets the factor.
# * **Cosine attention** (`q` and `k` divided by their length, so every score lies in `[-1, 1]`:
#   Swin V2) replaces the factor by a learned temperature.
# * Models with **QK-norm** — a LayerNorm on `q` and `k` in ViT-22B, an RMSNorm in OLMo 2 and
#   Qwen3 — keep `head_dim**-0.5`. The norm does not fix the entries' scale: it has a learned
#   gain per feature, which training can grow. What it removes is the growth of the logits
#   *through the activations* — the product of two unnormalised `q` and `k` that made
#   ViT-22B's training diverge — and leaves the logits bounded by the gains.

# %%
Q, K = np_split_heads(X @ W_q, H), np_split_heads(X @ W_k, H)
raw_scores = Q @ K.transpose(0, 1, 3, 2)  # (B, H, S, S), as above
scaled_scores = raw_scores / math.sqrt(d_head)  # a Python float keeps the array's dtype
print("scaled scores, batch 0, head 0:\n", scaled_scores[0, 0].round(2))

# %% [markdown]
# ### Exercise 2.4 — dot_product_variance (5 pts, ~18 min)
#
# Three points for the measurement below, two for a written question after its check.
# Measure it. Draw `n_samples` pairs `(q, k)` of vectors of `d_head` entries, all independent
# `N(0, σ²)`, and return the empirical variance of their dot products as a float. Draw every
# number from the generator `rng` you are given (`rng.normal(0.0, sigma, size=...)` — note
# that its `scale` is the standard deviation `σ`, not the variance): then a seeded `rng` gives
# the same answer every time.

# %% answer="dot_product_variance"
def dot_product_variance(d_head, sigma, n_samples, rng):
    """Empirical Var(q · k) for q, k in R^d_head with iid N(0, sigma²) entries.

    rng: a np.random.Generator; every sample is drawn from it.
    Returns a float, close to d_head * sigma**4 for large n_samples.

    Example: dot_product_variance(64, 2.0, 20_000, np.random.default_rng(0)) is about 1024.
    """
    ### BEGIN SOLUTION
    q = rng.normal(0.0, sigma, size=(n_samples, d_head))
    k = rng.normal(0.0, sigma, size=(n_samples, d_head))
    dots = np.sum(q * k, axis=-1)  # (n_samples,)
    return float(np.var(dots))
    ### END SOLUTION


# %% test="test_dot_product_variance" points=3
"""dot_product_variance: d·σ⁴ within the sampling error, reproducible from the given rng."""
from attention_lab.checks.numpy_walkthrough import check_dot_product_variance

check_dot_product_variance(dot_product_variance)
### BEGIN HIDDEN TESTS
check_dot_product_variance(dot_product_variance, seed=2401)
### END HIDDEN TESTS

# %%
print(f"{'d_head':>6} {'σ':>4} {'measured':>10} {'d·σ²':>8} {'d·σ⁴':>8}")
for sigma in (1.0, 2.0):
    for d in (1, 4, 16, 64):
        measured = dot_product_variance(d, sigma, 20_000, np.random.default_rng(0))
        print(f"{d:>6} {sigma:>4} {measured:>10.1f} {d * sigma**2:>8.0f} {d * sigma**4:>8.0f}")

# %% [markdown]
# **Look at it.** Vary `d_head`, the entries' standard deviation `σ` and the scaling. Left: the
# scores of 4000 random pairs, with the variance *your* `dot_product_variance` measures and the
# prediction. Right: what the softmax makes of 16 such scores — the mean weight of the largest,
# second largest, … key (uniform is 1/16 each).

# %%
from attention_lab.widgets.numpy_scores import variance_explorer

variance_explorer(dot_product_variance)

# %% [markdown]
# **Written question (2 pts).** Dividing by `sqrt(d_head)` turns `Var(q · k) = d · σ⁴` into
# `σ⁴`. (a) With `σ = 2`, what is the variance of the scaled scores, and what does the softmax
# over 16 keys look like (use the explorer)? (b) So what does the factor `1/sqrt(d_head)`
# guarantee, and what does it not? What in a real Transformer keeps the entries of `q` and `k`
# near unit variance — or replaces the factor altogether? Write your answer in the cell below.

# %% [markdown] manual="scaling_assumes_unit_variance" points=2
# *Model answer.* (a) `σ⁴ = 16`, a standard deviation of 4: the largest of 16 weights averages
# about 0.73 — the rows are close to one-hot even though the scale is the "right" one, whatever
# `d_head` is. (b) The factor only guarantees that the spread of the scores does not grow with
# `d_head`; it normalises the variance to 1 **only** when the entries of `q` and `k` have unit
# variance. Nothing in the factor itself controls `σ`: LayerNorm before the projections and an
# initialisation of the weights with standard deviation about `1/sqrt(D)` keep the entries of order
# 1 at the start of training, but training can grow them. QK-norm (a LayerNorm or RMSNorm on
# `q` and `k`, with a learned gain) bounds their growth through the activations and keeps
# `1/sqrt(d_head)`; cosine attention (unit-length `q` and `k`) replaces the factor by a learned
# temperature; μP scales by `1/d_head`, Gemma 2 27B by `1/sqrt(d_model / H)`.
# `1/sqrt(d_head)` is a convention resting on the unit-variance assumption, not the only correct
# factor.

# %% [markdown]
# ## 7. Softmax, without overflow
#
# The softmax turns each row of scores into weights that are positive and sum to 1:
# `softmax(x)_j = exp(x_j) / Σ_l exp(x_l)`. Written like that it breaks on real numbers:

# %%
def naive_softmax(x):
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


with np.errstate(over="ignore", invalid="ignore"):
    print("scores near 1000:", naive_softmax(np.array([1000.0, 999.0, 998.0])))  # inf / inf = nan
print("the same shifted by -1000:", naive_softmax(np.array([0.0, -1.0, -2.0])))

# %% [markdown]
# Adding a constant `c` to every entry of a row does not change its softmax (the factor
# `exp(c)` cancels). So subtract each row's **own** maximum first: the largest exponent is then
# `exp(0) = 1`, nothing overflows, and the sum is at least 1, so nothing divides by 0 — as long
# as the row has at least one finite entry.
#
# Two traps: one maximum for the whole array is not enough (a row far below it underflows to
# all zeros, 0/0), and the reductions must keep their axis (`keepdims=True`) to broadcast back.
# A `-inf` entry (a masked position) simply gets `exp(-inf) = 0`. A row that is **all** `-inf`
# (a query with nothing to attend to, e.g. a padding token) has maximum `-inf`, and
# `-inf - (-inf)` is NaN: no softmax formula can give it a meaning. The next section says what
# libraries do about it.
#
# The shift protects against large *finite* scores only. A `+inf` score (an overflow upstream, a
# bad fill value) breaks it: the row's maximum is `+inf`, and `+inf - (+inf)` is NaN, so the whole
# row becomes NaN — and a NaN in the weights spreads to every output that reads them. The demo
# after the check shows it.
#
# ### Exercise 2.5 — np_softmax (3 pts, ~10 min)
#
# A numerically stable softmax over `axis` (default: the last). Same shape and dtype as `x`
# (float32 in, float32 out); do not modify `x` in place. It must be right at inputs like 1000,
# on rows of very different scales, with `-inf` on part of a row, and along any axis. Every row
# the check gives you has at least one finite entry. Write it with `np.max`, `np.exp` and
# `np.sum`: `scipy.special.softmax` (or `logsumexp`) would do the stable shift for you, and the
# check says so.

# %% answer="np_softmax"
def np_softmax(x, axis=-1):
    """Numerically stable softmax along `axis`.

    x: any shape  ->  same shape; values >= 0 summing to 1 along `axis`.

    Example: np_softmax(np.array([1000., 1000.])) gives array([0.5, 0.5]).
    """
    ### BEGIN SOLUTION
    shifted = x - np.max(x, axis=axis, keepdims=True)  # each row's own max becomes 0
    exponentials = np.exp(shifted)
    return exponentials / np.sum(exponentials, axis=axis, keepdims=True)
    ### END SOLUTION


# %% test="test_np_softmax" points=3
"""np_softmax: equals torch.softmax at 1000, on rows of different scales, -inf, other axes."""
from attention_lab.checks.numpy_walkthrough import check_np_softmax

check_np_softmax(np_softmax)
### BEGIN HIDDEN TESTS
check_np_softmax(np_softmax, seed=2501)
### END HIDDEN TESTS

# %%
print("near 1000:", np_softmax(np.array([1000.0, 999.0, 998.0])).round(3))
two_scales = np.array([[0.0, 1.0, 2.0], [-1000.0, -999.0, -998.0]])
print("two rows, very different scales:\n", np_softmax(two_scales).round(3))
print("-inf on part of a row:", np_softmax(np.array([1.0, -np.inf, 1.0])))
columns = np_softmax(np.array([[1.0, 2.0], [3.0, 4.0]]), axis=0)
print("over axis 0 (columns sum to 1):", columns.sum(axis=0))
with np.errstate(invalid="ignore"):  # inf - inf: NumPy warns, then returns NaN
    print("+inf in a row (max = inf, inf - inf = nan):", np_softmax(np.array([1.0, np.inf, 2.0])))

# %% [markdown]
# ## 8. Weights, and the weighted sum of values
#
# Put it together for one layer of heads: scores → scale → (mask) → softmax → weighted sum.
# The weights are `(B, H, S, S)`: row `i` says how much query `i` takes from each key. The
# output is `weights @ V` — **weights**, not scores, times `V` —
# `(B, H, S, S) @ (B, H, S, d_head) -> (B, H, S, d_head)`: each output row is a weighted
# average of the value rows.
#
# ### Exercise 2.6 — np_attention (3 pts, ~12 min)
#
# Scaled dot-product attention on `(B, H, S, d)` arrays: return `(out, weights)`. `mask` is
# `None` or boolean, broadcastable to `(B, H, S_q, S_k)`, **True = may attend**: set the scores
# where it is False to `-inf` before the softmax (`np.where`). Use your `np_softmax`. The check
# compares you with `F.scaled_dot_product_attention`, on masks that leave every query at least
# one key. **float32 in, float32 out**: both arrays you return have `Q`'s dtype (divide by
# `math.sqrt(d)`, not `np.sqrt(d)`).
#
# What about a query whose mask row is all False? Your `-inf` recipe gives NaN there.
# `F.scaled_dot_product_attention` (PyTorch 2.5 and later) returns zeros for such a row;
# filling with the dtype's most negative finite number, `np.finfo(scores.dtype).min` (or `-1e9`,
# common in real code), gives uniform weights — the mean of the values. None of these outputs
# means anything (they are masked out of the loss later); being finite is what matters, so a
# NaN cannot spread into the rest of the batch.

# %% answer="np_attention"
def np_attention(Q, K, V, mask=None):
    """softmax(Q Kᵀ / sqrt(d_head)) V, with an optional boolean mask (True = may attend).

    Q: (B, H, S_q, d), K: (B, H, S_k, d), V: (B, H, S_k, d_v),
    mask: bool, broadcastable to (B, H, S_q, S_k)
    returns (out (B, H, S_q, d_v), weights (B, H, S_q, S_k)); masked weights are exactly 0.

    Example: with a causal mask np.tril(np.ones((S, S), dtype=bool)),
    weights[..., i, j] == 0 for j > i.
    """
    ### BEGIN SOLUTION
    d = Q.shape[-1]
    scores = Q @ np.swapaxes(K, -1, -2) / math.sqrt(d)  # (B, H, S_q, S_k)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    weights = np_softmax(scores, axis=-1)
    return weights @ V, weights  # (B, H, S_q, d_v)
    ### END SOLUTION


# %% test="test_np_attention" points=3
"""np_attention: (out, weights) equal F.scaled_dot_product_attention, with masks, large scores."""
from attention_lab.checks.numpy_walkthrough import check_np_attention

check_np_attention(np_attention)
### BEGIN HIDDEN TESTS
check_np_attention(np_attention, seed=2601)
### END HIDDEN TESTS

# %%
Q, K, V = (np_split_heads(X @ W, H) for W in (W_q, W_k, W_v))  # (B, H, S, d_head) each
context, head_weights = np_attention(Q, K, V)
print("weights:", head_weights.shape, "| context:", context.shape)
print("batch 0, head 0 (each row sums to 1):\n", head_weights[0, 0].round(2))
causal = np.tril(np.ones((S, S), dtype=bool))
_, causal_weights = np_attention(Q, K, V, causal)
print("with a causal mask:\n", causal_weights[0, 0].round(2))

# %% [markdown]
# ## 9. Concatenate — and project
#
# Merging the heads gives `(B, S, D)` again: each token's output is its `H` heads' context
# vectors side by side. The walkthrough's section "Concatenation and Final Projection" stops
# there, but **multi-head attention ends with the output projection** `W_o`:
# `out = merge(heads) @ W_o`. Without it, head `h` could only ever write to its own `d_head`
# output features; `W_o` mixes what the heads found.
#
# ### Exercise 2.7 — np_multi_head_attention (4 pts, ~15 min)
#
# The whole layer: project (`X @ W_q` etc., weights `(in, out)`), split, attend (with the
# mask), merge, project with `W_o`. Returns `(B, S, D)`, in `X`'s dtype (float32 in, float32
# out). The check loads your four matrices into `nn.MultiheadAttention` — transposed, since
# PyTorch stores `(out, in)` — and compares.

# %% answer="np_multi_head_attention"
def np_multi_head_attention(X, W_q, W_k, W_v, W_o, num_heads, mask=None):
    """Multi-head self-attention in NumPy, weights in (in, out) layout.

    X: (B, S, D); W_q, W_k, W_v, W_o: (D, D);
    mask: bool, broadcastable to (B, H, S, S), True = may attend
    returns (B, S, D) = merge(attention(split(X @ W_q), split(X @ W_k), split(X @ W_v))) @ W_o

    Example: np_multi_head_attention(X, W_q, W_k, W_v, W_o, 2).shape == X.shape
    """
    ### BEGIN SOLUTION
    Q = np_split_heads(X @ W_q, num_heads)  # (B, H, S, d_head)
    K = np_split_heads(X @ W_k, num_heads)
    V = np_split_heads(X @ W_v, num_heads)
    context, _ = np_attention(Q, K, V, mask)  # (B, H, S, d_head)
    return np_merge_heads(context) @ W_o  # (B, S, D)
    ### END SOLUTION


# %% test="test_np_multi_head_attention" points=4
"""np_multi_head_attention: equals nn.MultiheadAttention holding the same weights, W_o included."""
from attention_lab.checks.numpy_walkthrough import check_np_multi_head_attention

check_np_multi_head_attention(np_multi_head_attention)
### BEGIN HIDDEN TESTS
check_np_multi_head_attention(np_multi_head_attention, seed=2701)
### END HIDDEN TESTS

# %%
causal = np.tril(np.ones((S, S), dtype=bool))  # True = may attend
out = np_multi_head_attention(X, W_q, W_k, W_v, W_o, H, causal)
print("out:", out.shape)

# The same layer in PyTorch: nn.MultiheadAttention stores (out, in) weights, so copy transposes.
torch_mha = torch.nn.MultiheadAttention(D, H, bias=False, batch_first=True, dtype=torch.float64)
stacked_qkv = np.concatenate([W_q.T, W_k.T, W_v.T])  # stacked q; k; v, each (out, in)
with torch.no_grad():
    torch_mha.in_proj_weight.copy_(torch.from_numpy(stacked_qkv))
    torch_mha.out_proj.weight.copy_(torch.from_numpy(W_o.T))
X_torch = torch.from_numpy(X)
blocked = torch.from_numpy(~causal)  # careful: nn.MultiheadAttention's mask means True = blocked
theirs, _ = torch_mha(X_torch, X_torch, X_torch, attn_mask=blocked)
difference = float(np.abs(out - theirs.detach().numpy()).max())
print("max difference from nn.MultiheadAttention:", difference)

# %% [markdown]
# ## 10. Experiment: why `1/sqrt(d_head)` and not `1/d_head`?
#
# Random queries and keys with unit-variance entries, 16 keys per query, for growing `d_head`.
# For each width we measure how peaked the weights are — the **largest weight** of a row (1/16 =
# uniform, 1 = one-hot), averaged over 200 queries — and how much gradient reaches the query:
# the size (Frobenius norm) of `∂weights/∂q`, for a typical query (the median over 200). By the
# chain rule through the scores `s = scale · K q`, it is the softmax's Jacobian
# `∂p/∂s = diag(p) − p pᵀ` (0 for a one-hot row) times `∂s/∂q = scale · K`. Three scalings:
# none (raw `q · k`), `1/sqrt(d_head)`, and `1/d_head`.
#
# ### Exercise 2.8 — predict, then measure (2 pts, ~5 min)
#
# Before you run the experiment: dividing by `d_head` shrinks the scores' variance to
# `σ⁴ / d_head`. What will the `1/d_head` curve of the largest weight do as `d_head` grows?
#
# * **A.** It stays level with the `1/sqrt(d_head)` curve: both factors keep the rows equally peaked.
# * **B.** It rises towards 1 (one-hot rows), like the raw scores.
# * **C.** It falls towards 1/16: the rows flatten towards uniform weights.
# * **D.** It is near 1 for small `d_head` and falls to 1/16 for large `d_head`.
#
# Set `ANSWER_SCALING` to your prediction, as a string (e.g. `ANSWER_SCALING = "A"`), and run its
# check (it runs the experiment itself); the experiment after it shows you the curves.

# %% answer="ANSWER_SCALING"
ANSWER_SCALING = None  # your prediction: "A", "B", "C" or "D"
### BEGIN SOLUTION
ANSWER_SCALING = "C"
### END SOLUTION

# %% test="test_ANSWER_SCALING" points=2
"""ANSWER_SCALING: what 1/d_head does as d_head grows (the check re-runs the experiment)."""
from attention_lab.checks.numpy_walkthrough import check_answer_scaling

check_answer_scaling(ANSWER_SCALING)
### BEGIN HIDDEN TESTS
check_answer_scaling(ANSWER_SCALING, seed=2801)
### END HIDDEN TESTS

# %%
def peakedness(d, scale, num_keys=16, num_queries=200, seed=0):
    """(mean largest weight, median |∂p/∂q|, median |∂p/∂s|) of rows of num_keys scores."""
    generator = np.random.default_rng(seed)
    q = generator.standard_normal((num_queries, 1, d))
    k = generator.standard_normal((num_queries, num_keys, d))  # fresh keys for every query
    p = np_softmax(scale * np.sum(q * k, axis=-1), axis=-1)  # (num_queries, num_keys)
    eye = np.eye(num_keys)
    jacobian = eye * p[:, :, None] - p[:, :, None] * p[:, None, :]  # ∂p/∂s = diag(p) - p pᵀ
    to_query = jacobian @ (scale * k)  # ∂p/∂q = ∂p/∂s · ∂s/∂q: (queries, keys, d)
    norm_q = np.median(np.linalg.norm(to_query, axis=(-2, -1)))
    norm_s = np.median(np.linalg.norm(jacobian, axis=(-2, -1)))
    return p.max(axis=-1).mean(), norm_q, norm_s


widths = [4, 16, 64, 256, 1024]
scalings = {"raw q·k": lambda d: 1.0, "q·k / sqrt(d_head)": lambda d: 1 / math.sqrt(d),
            "q·k / d_head": lambda d: 1 / d}
fig, (ax_max, ax_grad) = plt.subplots(1, 2, figsize=(10, 3.5))
print(f"{'scaling':>20} {'d_head':>6} {'largest weight':>14} {'|∂p/∂q|':>9} {'|∂p/∂s|':>9}")
for label, factor in scalings.items():
    curve = np.array([peakedness(d, factor(d)) for d in widths])
    ax_max.plot(widths, curve[:, 0], "o-", label=label)
    ax_grad.plot(widths, curve[:, 1], "o-", label=label)
    for d, (largest, norm_q, norm_s) in zip(widths, curve):
        print(f"{label:>20} {d:>6} {largest:>14.3f} {norm_q:>9.2g} {norm_s:>9.2g}")
ax_max.axhline(1 / 16, color="gray", linestyle=":", label="uniform (1/16)")
ax_grad.set_yscale("log")
for ax, name in ((ax_max, "mean largest weight"), (ax_grad, "median |∂weights/∂q|")):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("d_head")
    ax.set_ylabel(name)
    ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# The raw scores' rows go one-hot, and the gradient reaching a typical query collapses (by
# orders of magnitude at `d_head = 1024`): the **vanishing gradient** the scaling prevents. For
# independent unit-variance entries `1/d_head` over-corrects: its scores shrink towards 0, every
# row tends to uniform weights, and attention stops distinguishing keys. It starves the gradient
# too, at least at initialisation (the random, independent `q` and `k` measured here). The
# softmax's own Jacobian `∂p/∂s` stays large for a near-uniform row: the last column of the
# table. But the factor `1/d_head` multiplies everything that flows back to `q` and `k` through
# the scores. So `|∂p/∂q|` falls like `1/sqrt(d_head)`: ÷ 2 each time `d_head` grows 4×.
# `1/sqrt(d_head)` keeps both curves level. (μP's `1/d_head` rests on other assumptions: its own
# initialisation and learning rates, and `q`, `k` that become correlated in training, so that
# `q · k` grows like `d_head` rather than `sqrt(d_head)`.)

# %% [markdown]
# ## 11. The backward pass, by hand
#
# Training needs the gradient of a loss `L` with respect to `Q`, `K` and `V`. Autograd computes
# it for you; here you write it, because *what the backward pass needs from the forward pass*
# is the whole story of memory-efficient attention (notebook 06).
#
# Notation: for an array `A` of the forward pass, `dA` is `∂L/∂A`, an array of `A`'s shape. The
# backward of a step `y = f(x)` receives `dy` and returns `dx`, with
# `dx_j = Σ_i dy_i · ∂y_i/∂x_j`: a **vector-Jacobian product**. It never needs the Jacobian
# `∂y/∂x` as a matrix, only its product with `dy`.
#
# ### The softmax
#
# For one row, `p = softmax(s)` over `n` entries has the Jacobian the experiment above built:
# `∂p_i/∂s_j = p_i (δ_ij − p_j)`, that is `diag(p) − p pᵀ` — every weight depends on every score
# of its row, through the shared sum. Work out `ds_j = Σ_i dp_i · ∂p_i/∂s_j` on paper: the sum
# over `i` splits into the diagonal term and one sum that is the same for every `j`. What you get
# costs one dot product per row, `O(n)` memory, where the Jacobian costs `n²` — for a row of
# 4096 keys, 16.8 million numbers, for every query of every head.
#
# Notice what it needs: only the softmax's **output** `p` (and `dp`), not the scores.
#
# ### Exercise 2.9 — softmax_backward (3 pts, ~12 min)
#
# Given `p = softmax(s, axis)` and `dp = ∂L/∂p` (same shape), return `ds = ∂L/∂s`, same shape
# and dtype (float32 in, float32 out), along any `axis`. Do not build the `[n, n]` Jacobian: the
# check gives you rows of 512 entries and measures the memory your code holds at once. Weights
# that are exactly 0 (masked keys) must pass exactly 0 to their scores.

# %% answer="softmax_backward"
def softmax_backward(p, dp, axis=-1):
    """Backward of the softmax: ds = ∂L/∂s from p = softmax(s, axis) and dp = ∂L/∂p.

    p, dp: same shape  ->  ds: same shape and dtype; along `axis`, without the [n, n] Jacobian.

    Example: for p = np.array([0.5, 0.5]) and dp = np.array([1.0, 0.0]), ds = [0.25, -0.25].
    """
    ### BEGIN SOLUTION
    row_dot = np.sum(dp * p, axis=axis, keepdims=True)  # Σ_i dp_i p_i, one per row
    return p * (dp - row_dot)
    ### END SOLUTION


# %% test="test_softmax_backward" points=3
"""softmax_backward: equals torch.autograd along any axis, masked weights get 0, no Jacobian."""
from attention_lab.checks.numpy_walkthrough import check_softmax_backward

check_softmax_backward(softmax_backward)
### BEGIN HIDDEN TESTS
check_softmax_backward(softmax_backward, seed=2901)
### END HIDDEN TESTS

# %%
# Your backward against autograd, on one row; and what the Jacobian would cost.
scores = np.array([2.0, 1.0, -1.0, 0.5])
upstream = np.array([0.3, -1.0, 2.0, 0.0])  # some dL/dp
scores_torch = torch.tensor(scores, requires_grad=True)
loss = (torch.softmax(scores_torch, -1) * torch.tensor(upstream)).sum()  # L = Σ p · dp
(autograd_ds,) = torch.autograd.grad(loss, scores_torch)
print("yours:   ", softmax_backward(np_softmax(scores), upstream).round(4))
print("autograd:", autograd_ds.numpy().round(4))
for n in (512, 4096, 32768):
    print(f"one row of {n:>5} keys: Jacobian {n * n * 4 / 1e6:>8.1f} MB in float32, "
          f"the VJP needs {n * 4 / 1e3:>6.1f} kB")

# %% [markdown]
# ### Attention
#
# Per head, the forward pass is `S = Q Kᵀ / sqrt(d)`, then masked scores set to `-inf`,
# `P = softmax(S)` over the keys, `out = P V`. The backward runs the same steps in reverse, given
# `dout`. Two rules are all you need:
#
# * **A product** `C = A @ B` sends back `dA = dC @ Bᵀ` and `dB = Aᵀ @ dC`. (Check it on the
#   shapes: each gradient has the shape of its array.)
# * **The softmax** sends back your `softmax_backward`.
#
# Where does the scale `1/sqrt(d)` go? Where are the masked scores? Think about which arrays
# each step touched. A masked weight is exactly 0, and the softmax's backward multiplies by the
# weight: no gradient flows into a masked score, so a key that no query may see gets `dK = 0`
# and `dV = 0`.
#
# **Fully masked rows.** A query whose mask row is all False (a padding token) has no keys. The
# `-inf` recipe of `np_attention` gives it NaN weights (0/0); PyTorch gives it zeros; a `-1e9`
# fill gives it the mean of the values. As section 8 said, its output means nothing and is masked
# out of the loss, so real training sends it `dout = 0`. The backward makes that a rule, whatever
# `dout` says: **a fully masked query has weights 0 and sends no gradient** — its row of `dQ` is 0,
# and it adds nothing to `dK` or `dV`. That is what autograd gives for
# `F.scaled_dot_product_attention`, which the check compares with. Beware the NaN: the backward
# sums over the queries (`dV` collects every query that read a key), so one NaN row of `P` would
# make NaN of every key's gradient.
#
# **What the backward keeps from the forward.** `dV` and the softmax's backward need `P`:
# `S_q × S_k` numbers per head. If the forward keeps `P`, at `B = 8`, `H = 32`, `S = 4096` in
# bfloat16 that is 8.6 GB (decimal gigabytes, 10⁹ bytes, as every size in this notebook) for
# *one* layer, about twenty times the bfloat16 weights of one layer of a 7-billion-parameter
# model (0.4 GB). And 8.6 GB is a lower bound: it counts `P` once, in bfloat16. Under CUDA
# autocast the softmax runs in float32, and autograd keeps both its float32 output (for the
# softmax's backward) and the bfloat16 copy that the product with `V` reads: 17.2 + 8.6 GB. (On
# a CPU, autocast keeps the softmax in bfloat16: the cell after exercise 2.11's check counts
# what autograd saves there.)
#
# The alternative is to keep almost nothing: the forward saves `out` and **one number per
# query**, the log-sum-exp of its row of scaled, masked scores, `lse_i = log Σ_j exp(s_ij)` —
# `B·H·S` numbers. With `Q`, `K` and `V` (which the backward needs anyway: `S·d` numbers per
# head, not `S²`), that is all it needs:
#
# * `P_ij = exp(s_ij) / Σ_l exp(s_il) = exp(s_ij − lse_i)`: the backward recomputes `s = Q Kᵀ /
#   sqrt(d)` (masked) and gets `P` without a softmax and without the rest of the row;
# * the softmax's backward needs `Σ_j dP_ij · P_ij` for every query `i`: call it `D_i`. It can
#   be computed from `dout` and `out` alone, without `P` — you will show how.
#
# **FlashAttention** (notebook 06) is built on exactly these two facts: it saves `out` and
# `lse`, and recomputes `P` tile by tile, so that no `S × S` array ever exists.
#
# ### Exercise 2.10 — what the forward saves: D, and np_attention_lse (4 pts, ~20 min)
#
# **First on paper** (1 point, graded by hand). With `dP = dout @ Vᵀ` (so `dP_ij = dout_i · V_j`)
# and `out_i = Σ_j P_ij V_j`, show that `D_i = Σ_j dP_ij · P_ij` equals a quantity that needs
# neither `P` nor `dP`, in two or three lines. Then say in one sentence what it costs per query,
# against `Σ_j dP_ij · P_ij`.

# %% [markdown] manual="derive_delta" points=1
# `D_i = Σ_j P_ij dP_ij = Σ_j P_ij (dout_i · V_j) = dout_i · (Σ_j P_ij V_j) = dout_i · out_i`
# (the dot product is linear, so the weighted sum moves inside it). So `D = rowsum(dout ∘
# out)`: one dot product of length `d_v` per query, from two arrays of shape `(S_q, d_v)` that
# the backward has anyway — where `Σ_j dP_ij P_ij` needs a whole row of `P` and of `dP`
# (`S_k` numbers each).

# %% [markdown]
# **Then the forward that saves `lse`** (3 points). `np_attention_lse(Q, K, V, mask=None)`
# returns `(out, lse)`: `out` as `np_attention`'s, and `lse` of shape `(B, H, S_q)`, the
# natural-log log-sum-exp of each row of **scaled, masked** scores — computed stably, as your
# `np_softmax` does, `lse = m + log Σ_j exp(s_j − m)` with `m` the row's maximum. Both in `Q`'s
# dtype.
#
# This time a query whose mask row is all False gets the answer PyTorch gives: `out = 0` and
# `lse = -inf` (`torch.logsumexp` of a row of `-inf`), **without a NumPy warning** — so no
# `-inf − (−inf)`, no `log(0)`, no `0/0` may run: where a row's maximum is `-inf`, subtract 0
# instead; where its sum is 0, divide by 1 (`np.where` picks, and computes nothing invalid if
# its inputs are valid).
#
# **Worked by hand**, two queries over three keys (their scaled scores after the mask):
#
# | query | scores | row max `m` | subtract | `exp(·)` | sum | `out` | `lse` |
# | --- | --- | --- | --- | --- | --- | --- | --- |
# | 0 | `[1.0, -inf, 0.0]` | 1.0 | `m` | `[1, 0, 0.37]` | 1.37 | `(V_0 + 0.37·V_2) / 1.37` | `1 + log 1.37 = 1.31` |
# | 1, no key | `[-inf, -inf, -inf]` | `-inf` | **0**, not `m` | `[0, 0, 0]` | 0 | divide by **1**: `0` | `-inf` |
#
# Subtracting `m` on row 1 would compute `-inf − (−inf) = NaN`, and dividing by its sum `0/0`.
#
# | name | signature | contract |
# | --- | --- | --- |
# | `np_attention_lse` | `(Q, K, V, mask=None) -> (out, lse)` | `out (B, H, S_q, d_v)`, `lse (B, H, S_q)`, natural log of the scaled, masked scores; no key: `out = 0`, `lse = -inf`, no warning; Q's dtype |

# %% answer="np_attention_lse"
def np_attention_lse(Q, K, V, mask=None):
    """Attention that returns what the backward needs: (out, lse).

    Q: (B, H, S_q, d), K: (B, H, S_k, d), V: (B, H, S_k, d_v), mask: None or bool
    broadcastable to (B, H, S_q, S_k), True = may attend.
    returns out (B, H, S_q, d_v) and lse (B, H, S_q) = log Σ_j exp(scaled, masked score),
    in Q's dtype; a query with no key gets out = 0 and lse = -inf, without a NumPy warning.

    Example: without a mask, np.exp(scores - lse[..., None]) are np_attention's weights.
    """
    ### BEGIN SOLUTION
    scores = Q @ np.swapaxes(K, -1, -2) / math.sqrt(Q.shape[-1])  # (B, H, S_q, S_k)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    row_max = np.max(scores, axis=-1, keepdims=True)  # -inf for a query with no key
    shift = np.where(np.isfinite(row_max), row_max, 0.0)  # no -inf - (-inf)
    exps = np.exp(scores - shift)  # masked: exp(-inf) = 0
    total = np.sum(exps, axis=-1, keepdims=True)  # 0 for a query with no key
    has_key = total > 0
    out = (exps / np.where(has_key, total, 1.0)) @ V  # no 0/0: such a row is 0
    lse = np.where(has_key, shift + np.log(np.where(has_key, total, 1.0)), -np.inf)
    return out.astype(Q.dtype, copy=False), lse[..., 0].astype(Q.dtype, copy=False)
    ### END SOLUTION


# %% test="test_np_attention_lse" points=3
"""np_attention_lse: out equals SDPA, lse torch.logsumexp; no key: 0 and -inf, no warning."""
from attention_lab.checks.numpy_walkthrough import check_np_attention_lse

check_np_attention_lse(np_attention_lse)
### BEGIN HIDDEN TESTS
check_np_attention_lse(np_attention_lse, seed=3101)
### END HIDDEN TESTS

# %%
Q, K, V = (np_split_heads(X @ W, H) for W in (W_q, W_k, W_v))  # (B, H, S, d_head) each
causal = np.tril(np.ones((S, S), dtype=bool))
out_saved, lse_saved = np_attention_lse(Q, K, V, causal)
scaled_causal = np.where(causal, Q @ np.swapaxes(K, -1, -2) / math.sqrt(d_head), -np.inf)
print("out as np_attention's:", np.allclose(out_saved, np_attention(Q, K, V, causal)[0]))
print("exp(scores - lse) are the weights:",
      np.allclose(np.exp(scaled_causal - lse_saved[..., None]), np_attention(Q, K, V, causal)[1]))
no_key = np.zeros((S, S), dtype=bool)  # nobody may attend to anything
print("a query with no key: out", np_attention_lse(Q, K, V, no_key)[0][0, 0, 0],
      "| lse", np_attention_lse(Q, K, V, no_key)[1][0, 0, 0])

# %% [markdown]
# ### Exercise 2.11 — np_attention_backward (5 pts, ~25 min)
#
# The gradients of attention's `out` with respect to `Q`, `K` and `V`, from what the forward
# saved: given `Q, K, V`, the forward's `out` and `lse` (as `np_attention_lse` returns them),
# `dout` of `out`'s shape `(B, H, S_q, d_v)` and the same `mask` as the forward (or `None`),
# return `(dQ, dK, dV)`, shaped like `Q`, `K`, `V`, in `Q`'s dtype — even when `out` and `lse`
# come in another dtype. NumPy only, and no softmax: recompute `P = exp(s − lse)` from the
# scaled, masked scores (masked entries 0), and take `D` the way you derived it in 2.10.
#
# A fully masked query arrives with `lse = -inf` and an `out` that is 0 (from `np_attention_lse`,
# or PyTorch) or NaN (from `np_attention`'s `-inf` recipe): its row of `P` and its `D` must be 0,
# never NaN. On query 1 of the worked example in 2.10, `exp(s − lse)` would be `exp(−inf −
# (−inf))`, NaN in every column, and one NaN row spreads to every key's gradient (`dK` and `dV`
# sum over the queries). Guarded, its `P` row is `[0, 0, 0]` and its `D` is 0 whatever its `out`
# holds: its row of `dQ` is 0, and it adds nothing to `dK` or `dV`. The check compares with
# `torch.autograd` through `F.scaled_dot_product_attention` in float64: with and without masks,
# fully masked rows included, at large scores.

# %% answer="np_attention_backward"
def np_attention_backward(Q, K, V, out, lse, dout, mask=None):
    """Gradients of out = softmax(Q Kᵀ / sqrt(d) [masked]) V from the saved out and lse.

    Q: (B, H, S_q, d), K: (B, H, S_k, d), V: (B, H, S_k, d_v), out and dout: (B, H, S_q, d_v),
    lse: (B, H, S_q), mask: None or bool broadcastable to (B, H, S_q, S_k), True = may attend.
    returns (dQ, dK, dV), shaped like Q, K, V, in Q's dtype. A fully masked query sends nothing.

    Example: with dout = np.ones_like(out), dV[..., j, :] is the total weight key j receives.
    """
    ### BEGIN SOLUTION
    scale = 1.0 / math.sqrt(Q.shape[-1])
    scores = Q @ np.swapaxes(K, -1, -2) * scale  # (B, H, S_q, S_k), recomputed as in the forward
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    has_key = np.isfinite(lse)[..., None]  # False for a fully masked query
    P = np.exp(scores - np.where(has_key, lse[..., None], 0.0))  # masked entries: exp(-inf) = 0
    P = np.where(has_key, P, 0.0)
    D = np.sum(np.where(has_key, dout * out, 0.0), axis=-1, keepdims=True)  # rowsum(dout ∘ out)
    dV = np.swapaxes(P, -1, -2) @ dout  # out = P V
    dP = dout @ np.swapaxes(V, -1, -2)
    dS = P * (dP - D) * scale  # the softmax's backward with D; the scale sits inside the scores
    dQ = dS @ K
    dK = np.swapaxes(dS, -1, -2) @ Q
    return tuple(g.astype(Q.dtype, copy=False) for g in (dQ, dK, dV))
    ### END SOLUTION


# %% test="test_np_attention_backward" points=5
"""np_attention_backward: dQ, dK, dV equal torch.autograd, with masks and fully masked rows."""
from attention_lab.checks.numpy_walkthrough import check_np_attention_backward

check_np_attention_backward(np_attention_backward)
### BEGIN HIDDEN TESTS
check_np_attention_backward(np_attention_backward, seed=3001)
### END HIDDEN TESTS

# %%
# Finite differences: nudge one entry of Q, K or V and watch the loss L = Σ out · dout move.
Q, K, V = (np_split_heads(X @ W, H) for W in (W_q, W_k, W_v))  # (B, H, S, d_head) each
causal = np.tril(np.ones((S, S), dtype=bool))
dout = np.random.default_rng(7).standard_normal((B, H, S, d_head))
out_saved, lse_saved = np_attention_lse(Q, K, V, causal)
gradients = dict(zip("QKV", np_attention_backward(Q, K, V, out_saved, lse_saved, dout, causal)))
loss = np.sum(out_saved * dout)
step = 1e-6
for name, index in (("Q", (0, 1, 3, 0)), ("K", (1, 0, 2, 1)), ("V", (0, 0, 4, 1))):
    arrays = {"Q": Q.copy(), "K": K.copy(), "V": V.copy()}
    arrays[name][index] += step
    nudged_out, _ = np_attention(arrays["Q"], arrays["K"], arrays["V"], causal)
    slope = (np.sum(nudged_out * dout) - loss) / step
    print(f"∂L/∂{name}{list(index)}: yours {gradients[name][index]:+.6f}, "
          f"finite difference {slope:+.6f}")
batch, heads, length = 8, 32, 4096
print(f"P for B={batch}, H={heads}, S={length} in bfloat16: "
      f"{batch * heads * length * length * 2 / 1e9:.1f} GB; one log-sum-exp per query instead: "
      f"{batch * heads * length * 4 / 1e6:.1f} MB")


def saved_bytes_per_score(length=64):
    """Bytes autograd keeps per attention score ([S, S] tensors only, each storage once)."""
    q, k, v = (torch.randn(1, 2, length, 16, requires_grad=True) for _ in range(3))
    saved = {}

    def keep(tensor):
        if tensor.shape[-2:] == (length, length):
            storage = tensor.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.softmax(q @ k.transpose(-2, -1) / 4, dim=-1) @ v
    return sum(saved.values()) / (2 * length * length)


print("CPU autocast to bfloat16: autograd keeps", saved_bytes_per_score(), "bytes per score")

# %% [markdown]
# ## What you built
#
# | step | operation | shape |
# | --- | --- | --- |
# | input | `X` | `(2, 6, 4)` = `(B, S, D)` |
# | projections | `X @ W_q`, `X @ W_k`, `X @ W_v` (`W` is `(in, out)`) | `(2, 6, 4)` each |
# | split | `np_split_heads` (reshape + transpose) | `(2, 2, 6, 2)` = `(B, H, S, d_head)` |
# | scores | `Q @ Kᵀ` (last two axes of `K` swapped; sums over `d_head`) | `(2, 2, 6, 6)` |
# | scale | `/ sqrt(d_head)`: the variance `d·σ⁴` becomes `σ⁴` | `(2, 2, 6, 6)` |
# | softmax | `np_softmax` over the keys, row max subtracted | `(2, 2, 6, 6)` |
# | context | **weights** `@ V` | `(2, 2, 6, 2)` |
# | merge | `np_merge_heads` (transpose + reshape) | `(2, 6, 4)` |
# | output projection | `@ W_o` | `(2, 6, 4)` = `(B, S, D)` |
# | backward | `np_attention_backward`: `dQ`, `dK`, `dV` from `dout` | shaped like `Q`, `K`, `V` |
#
# You wrote every step in NumPy and matched `nn.MultiheadAttention` to float64 precision —
# after transposing the weights into PyTorch's `(out, in)` layout and flipping the mask's
# meaning — then its gradients, and saw that the backward needs the `S × S` weights again:
# notebook 06's FlashAttention recomputes them instead of storing them. Next: positions and the
# Transformer block (notebook 03).
