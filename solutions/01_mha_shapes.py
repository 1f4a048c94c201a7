# %% [markdown]
# # 01 — Multi-head attention, shape by shape
#
# You will build multi-head self-attention from `nn.Linear`, `view`, `permute`, `matmul`
# and `softmax`, one shape at a time, and prove that it computes exactly what PyTorch's
# `nn.MultiheadAttention` computes.
#
# **22 points, about 103 minutes.**
#
# **Notation** (used in every notebook): `B` batch, `S` sequence length (tokens), `D` model
# width, `H` heads, `d_head = D // H`. Shapes are written `[B, H, S, d_head]`.
#
# **Masks** are boolean with **True = may attend** (the convention of
# `F.scaled_dot_product_attention`). Careful: `nn.MultiheadAttention` uses the opposite
# meaning (True = blocked); exercise 1.7 meets it.
#
# **Dtypes: keep the input's dtype.** Every function returns the dtype it was given (float64
# in, float64 out) and creates new tensors with `dtype=x.dtype, device=x.device`. The checks
# call your code in float64 as well as float32: float64 rounds about 500 million times more
# finely (2·10⁻¹⁶ against 1·10⁻⁷), so a wrong line cannot hide behind rounding errors.
#
# After each exercise, run the check cell below it: it tells you, with shapes and numbers,
# whether your answer is right and what you most likely got wrong.

# %%
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# %% [markdown]
# ## 1. Projections: one token in, three views of it out
#
# Self-attention starts by projecting every token `x` (a row of `D` features) three times:
# the **query** (what this token looks for), the **key** (what it offers to others) and the
# **value** (what it hands over when attended to). Each is an `nn.Linear(D, D)`, applied to
# every token of every sequence at once:

# %%
B, S, D, H = 2, 5, 12, 3
x = torch.randn(B, S, D, device=device)
q_linear = nn.Linear(D, D).to(device)
Q = q_linear(x)
print("x:", tuple(x.shape), "-> Q:", tuple(Q.shape))
print("nn.Linear stores its weight as [out, in]:", tuple(q_linear.weight.shape),
      "so Q = x @ W.T + b")
assert torch.allclose(Q, x @ q_linear.weight.T + q_linear.bias, atol=1e-6)

# %% [markdown]
# Note that every feature of `Q` is a combination of **all** `D` features of the token. When
# we split `Q` into heads next, each head gets its own `d_head` columns of the *projected*
# `Q`, but each of those columns was computed from the whole token. (A common explanation
# says "each head sees only a slice of the token's features": that is not so.)

# %% [markdown]
# ### Exercise 1.1 — split_heads (2 pts, ~10 min)
#
# Split the last axis of `[B, S, D]` into `H` heads of `d_head = D // H` features and move the
# head axis in front of the sequence axis: `[B, S, D] -> [B, S, H, d_head] -> [B, H, S, d_head]`.
# Head `h` must hold features `h*d_head ... (h+1)*d_head - 1` of every token.
#
# Use `view` (reinterpret the same memory with a new shape, no copy) and then `permute`.
# If `D` is not divisible by `H`, raise a `ValueError` that names `D` and `H`.

# %% answer="split_heads"
def split_heads(x, num_heads):
    """Split the feature axis into heads.

    x: [B, S, D]  ->  [B, H, S, D // H]   (H = num_heads)

    Example: x of shape [2, 5, 12] with num_heads=3 gives [2, 3, 5, 4], and
    split_heads(x, 3)[0, 1, 0] equals x[0, 0, 4:8].
    Raises ValueError if D is not divisible by num_heads.
    """
    ### BEGIN SOLUTION
    batch, seq_len, d_model = x.shape
    if d_model % num_heads != 0:
        raise ValueError(f"D = {d_model} is not divisible by H = {num_heads}")
    d_head = d_model // num_heads
    return x.view(batch, seq_len, num_heads, d_head).permute(0, 2, 1, 3)  # [B, H, S, d_head]
    ### END SOLUTION


# %% test="test_split_heads" points=2
"""split_heads: [B, S, D] -> [B, H, S, D//H], values, edge cases and the ValueError."""
from attention_lab.checks.mha_shapes import check_split_heads

check_split_heads(split_heads)
### BEGIN HIDDEN TESTS
check_split_heads(split_heads, seed=1101, device="cpu")
check_split_heads(split_heads, seed=1102)
### END HIDDEN TESTS

# %%
Q_heads = split_heads(Q, H)
print("Q:", tuple(Q.shape), "-> Q_heads:", tuple(Q_heads.shape))

# %% [markdown]
# ### Exercise 1.2 — merge_heads (2 pts, ~8 min)
#
# The inverse: `[B, H, S, d_head] -> [B, S, H, d_head] -> [B, S, H * d_head]`. One point for
# the function, one for a written question after its check.
#
# Careful with the last step. Run the cell below: the obvious `.view` fails on a permuted tensor.

# %%
# Like attention's output: a fresh tensor laid out as [B, H, S, d_head] (head by head in memory).
context_heads = torch.randn(B, H, S, D // H)
heads_back = context_heads.transpose(1, 2)  # [B, S, H, d_head]: the same memory, strides swapped
try:
    heads_back.view(B, S, D)
except RuntimeError as error:
    print("view refuses:", str(error).split(".")[0] + ".")
print("contiguous?", heads_back.is_contiguous(),
      "| after .contiguous():", heads_back.contiguous().is_contiguous())
print("reshape works:", tuple(heads_back.reshape(B, S, D).shape))
# Undoing split_heads' own permute is a case where .view works: the memory is Q's, in order.
print("split_heads(Q, H).transpose(1, 2) contiguous?",
      split_heads(Q, H).transpose(1, 2).is_contiguous())

# %% [markdown]
# After `permute`/`transpose`, the tensor's memory is no longer laid out in row-major order for
# its new shape, so `.view` cannot flatten it. Either call `.contiguous()` first (it copies
# **only if** the tensor is not already contiguous — after a `permute` it usually is not), or
# use `.reshape`, which does the same thing for you.

# %% answer="merge_heads"
def merge_heads(x):
    """Concatenate the heads' features back into one axis.

    x: [B, H, S, d]  ->  [B, S, H * d]

    Example: merge_heads(split_heads(x, 3)) equals x.
    """
    ### BEGIN SOLUTION
    batch, num_heads, seq_len, d_head = x.shape
    return x.transpose(1, 2).reshape(batch, seq_len, num_heads * d_head)  # [B, S, D]
    ### END SOLUTION


# %% test="test_merge_heads" points=1
"""merge_heads: [B, H, S, d] -> [B, S, H*d], accepts permuted input, inverts split_heads."""
from attention_lab.checks.mha_shapes import check_merge_heads

check_merge_heads(merge_heads)
### BEGIN HIDDEN TESTS
check_merge_heads(merge_heads, seed=1201, device="cpu")
### END HIDDEN TESTS

# %%
print("round trip exact:", torch.equal(merge_heads(split_heads(Q, H)), Q))
print("is split_heads(Q) contiguous?", split_heads(Q, H).is_contiguous())

# %% [markdown]
# **Written question (1 pt).** The demo above shows both cases: `.view(B, S, D)` refuses the
# transposed `context_heads` (a tensor laid out as `[B, H, S, d_head]`, like attention's
# output), yet `split_heads(Q, H).transpose(1, 2)` is contiguous, so `.view` would work on it.
# Explain in two or three sentences what makes the difference (where do a token's features lie
# in memory in each case?), and what `.contiguous()` costs. Write your answer in the cell below.

# %% [markdown] manual="why_contiguous" points=1
# *Model answer.* `view`, `permute` and `transpose` only change the shape and the strides,
# never the data. `split_heads(Q, H)` is a permuted view of `Q`, whose memory holds each
# token's `D` features side by side; transposing it back restores exactly that layout, so
# merging `H` and `d_head` is one stride again. `context_heads` was created as `[B, H, S,
# d_head]`: head `h+1` of the same token lies `S·d_head` elements after head `h`, so after the
# transpose no single stride steps through one token's features, and the elements must be
# copied into a new block. `.contiguous()` (or `.reshape`, which calls it when needed) makes
# that one copy of `B·S·D` numbers; on an already contiguous tensor it costs nothing.

# %% [markdown]
# ### Exercise 1.3 — split_heads_einops (1 pt, ~5 min)
#
# [einops](https://einops.rocks) writes the same reshuffle as a sentence:
# `"b s (h d) -> b h s d"` says "the last axis is h groups of d; put h before s". The
# grouping `(h d)` means `h` varies slowest, exactly as in `split_heads`. Write it with
# `einops.rearrange` (or its layer, `einops.layers.torch.Rearrange`): einops itself must do the
# split (the check notices a `split_heads` call dressed up with a rearrange that changes nothing).
#
# The contract is `split_heads`' contract, **including the `ValueError`** that names `D` and `H`
# when `D` is not divisible by `H`. einops does complain on its own, but with an `EinopsError`,
# a subclass of `RuntimeError`, not `ValueError`: code that catches `ValueError` for bad shapes
# would miss it. Check divisibility yourself first.

# %% answer="split_heads_einops"
from einops import rearrange


def split_heads_einops(x, num_heads):
    """split_heads written with einops.rearrange: [B, S, D] -> [B, H, S, D // H].

    Example: split_heads_einops(x, 3) equals split_heads(x, 3).
    Raises ValueError if D is not divisible by num_heads.
    """
    ### BEGIN SOLUTION
    if x.shape[-1] % num_heads != 0:
        raise ValueError(f"D = {x.shape[-1]} is not divisible by H = {num_heads}")
    return rearrange(x, "b s (h d) -> b h s d", h=num_heads)
    ### END SOLUTION


# %% test="test_split_heads_einops" points=1
"""split_heads_einops: uses einops.rearrange and meets split_heads' contract."""
from attention_lab.checks.mha_shapes import check_split_heads_einops

check_split_heads_einops(split_heads_einops)
### BEGIN HIDDEN TESTS
check_split_heads_einops(split_heads_einops, seed=1301, device="cpu")
### END HIDDEN TESTS

# %% [markdown]
# ## 2. Scores, softmax, weighted sum
#
# For one head, the **score** of query `i` against key `j` is the dot product `q_i · k_j`.
# All of them at once: `Q @ Kᵀ`, with `K.transpose(-2, -1)` turning `[S_k, d_head]` into
# `[d_head, S_k]`, so the product is `[S_q, S_k]` (the dot product sums over `d_head`).
#
# **Why divide by `sqrt(d_head)`?** If the entries of `q` and `k` are independent with mean 0
# and variance 1, `q · k` is a sum of `d_head` terms of variance 1: its variance is `d_head`.
# Large scores push the softmax into one-hot rows whose gradients vanish; dividing by
# `sqrt(d_head)` brings the variance back to 1. (Notebook 02 measures this, including what
# happens when the variance is not 1.)
#
# The **softmax** runs over the keys (the last axis), so each query's weights sum to 1. A
# **mask** sets the scores of forbidden keys to `-inf` before the softmax, which gives them
# weight exactly 0 (`exp(-inf) = 0`). Two masks you will meet everywhere: the **causal** mask
# (query `i` may attend to keys `0…i`, for text generation) and the **padding** mask (a batch
# holds sequences of different lengths, padded to one `S`; no query may attend to a padding key).

# %% [markdown]
# ### Exercise 1.4 — attention_weights (3 pts, ~15 min)
#
# `softmax(q @ kᵀ / sqrt(d_head))` over the keys, for inputs `[..., S_q, d_head]` and
# `[..., S_k, d_head]` (any number of leading axes). `mask` is `None` or boolean,
# broadcastable to `[..., S_q, S_k]`, **True = may attend**; every query row the check gives
# you may attend to at least one key. From scratch: do not call
# `F.scaled_dot_product_attention` (the check compares you with it).

# %% answer="attention_weights"
def attention_weights(q, k, mask=None):
    """Scaled dot-product attention weights.

    q: [..., S_q, d_head], k: [..., S_k, d_head], mask: bool, broadcastable to [..., S_q, S_k]
    returns: [..., S_q, S_k]; each row sums to 1; weight 0 where mask is False.

    Example: with a causal mask (torch.ones(S, S, dtype=torch.bool).tril()), row i has
    non-zero weights only in columns 0..i.
    """
    ### BEGIN SOLUTION
    d_head = q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_head)  # [..., S_q, S_k]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)
    ### END SOLUTION


# %% test="test_attention_weights" points=3
"""attention_weights: [..., S_q, S_k], equals PyTorch, rows sum to 1, masked weights 0."""
from attention_lab.checks.mha_shapes import check_attention_weights

check_attention_weights(attention_weights)
### BEGIN HIDDEN TESTS
check_attention_weights(attention_weights, seed=1401, device="cpu")
check_attention_weights(attention_weights, seed=1402)
### END HIDDEN TESTS

# %%
Q_heads = split_heads(Q, H).detach()  # [B, H, S, d_head]; detached: we only look at numbers here
causal = torch.ones(S, S, dtype=torch.bool, device=device).tril()
print(causal.int())
demo_weights = attention_weights(Q_heads, Q_heads, causal)
print("weights:", tuple(demo_weights.shape), "| head 0, batch 0:")
print(demo_weights[0, 0].round(decimals=2))

# %% [markdown]
# **Look at it: why `1/sqrt(d_head)`.** The explorer runs *your* `attention_weights` on four
# heads of random queries and keys (entries of mean 0, variance 1) for a six-word sentence.
# Pick `d_head`, and switch the scaling between `÷ sqrt(d_head)` and none. The panel on the
# right is the mean row entropy against `d_head` (log 6 ≈ 1.79 nats = uniform weights, 0 =
# one-hot rows):
#
# * **without** the scaling the entropy falls as `d_head` grows — the mean largest weight goes
#   from about 0.55 at `d_head = 4` to 0.88 at 64 and over 0.95 at 256: nearly every row has
#   put almost all its weight on one key, and a saturated softmax passes back almost no gradient;
# * **with** it the entropy stays about level (mean largest weight about 0.4 for every `d_head`).
#
# The `× factor` slider multiplies the scores on top: at 10× with the scaling on, the mean
# largest weight is about 0.9 — most rows are nearly one-hot, a few still split their weight.

# %%
from attention_lab.widgets import attention_explorer

tokens = ["the", "cat", "sat", "on", "the", "mat"]
attention_explorer(attention_weights, tokens)

# %% [markdown]
# ### Exercise 1.5 — scaled_dot_product_attention (2 pts, ~10 min)
#
# The weighted sum of the values: `out = weights @ v`, `[..., S_q, S_k] @ [..., S_k, d_v]
# -> [..., S_q, d_v]`. Return `(out, weights)`. On every query row that may attend to at least
# one key it must equal `F.scaled_dot_product_attention(q, k, v, attn_mask=mask)` — without
# calling it. (A row that may attend to nothing is the subject of the next section.)

# %% answer="scaled_dot_product_attention"
def scaled_dot_product_attention(q, k, v, mask=None):
    """Attention: softmax(q kᵀ / sqrt(d_head)) v.

    q: [..., S_q, d_head], k: [..., S_k, d_head], v: [..., S_k, d_v]
    returns (out [..., S_q, d_v], weights [..., S_q, S_k])

    Example: with S_q = S_k = 1 the weight is 1 and out equals v.
    """
    ### BEGIN SOLUTION
    weights = attention_weights(q, k, mask)  # [..., S_q, S_k]
    return weights @ v, weights  # [..., S_q, d_v]
    ### END SOLUTION


# %% test="test_scaled_dot_product_attention" points=2
"""scaled_dot_product_attention: (out, weights) equal to F.scaled_dot_product_attention's."""
from attention_lab.checks.mha_shapes import check_scaled_dot_product_attention

check_scaled_dot_product_attention(scaled_dot_product_attention)
### BEGIN HIDDEN TESTS
check_scaled_dot_product_attention(scaled_dot_product_attention, seed=1501, device="cpu")
### END HIDDEN TESTS

# %%
Q_heads = split_heads(Q, H).detach()
V_heads = split_heads(torch.randn(B, S, D, device=device), H)
out, _ = scaled_dot_product_attention(Q_heads, Q_heads, V_heads, causal)
reference = F.scaled_dot_product_attention(Q_heads, Q_heads, V_heads, attn_mask=causal)
print("out:", tuple(out.shape), "| max difference from PyTorch:",
      float((out - reference).abs().max()))

# %% [markdown]
# ### Padding, and a query with nothing to attend to
#
# A batch holds sequences of different lengths, padded to one `S`. The **padding mask** says
# which keys are real: `[B, 1, 1, S]`, broadcast over heads and queries, so every query may
# attend to every real key of its own sequence (and to nothing else):

# %%
lengths = torch.tensor([S, S - 2], device=device)  # sequence 1 ends with two padding tokens
real = torch.arange(S, device=device) < lengths[:, None]  # [B, S]: True for a real token
key_padding = real[:, None, None, :]  # [B, 1, 1, S]
print("key padding mask, per sequence:\n", key_padding[:, 0, 0].int())
q_pad = torch.randn(B, H, S, D // H, device=device)
padded_weights = attention_weights(q_pad, q_pad, key_padding)  # [B, H, S, S]
print("sequence 1, head 0: the two padding keys get weight 0\n",
      padded_weights[1, 0].round(decimals=2))

# %% [markdown]
# Combine it with a "query is real too" condition (`[B, 1, S, S]`), as some codebases do, and
# the padding *queries* are left with no key at all. Their scores are all `-inf`, and the
# softmax computes `exp(-inf) / Σ exp(-inf) = 0 / 0 = NaN`.
#
# **Worked by hand first**, on rows of three scores. The softmax subtracts the row's maximum,
# exponentiates and divides by the sum:
#
# | row (after the mask) | its maximum | `exp(score − max)` | sum | weights |
# | --- | --- | --- | --- | --- |
# | `[0.5, -inf, 2.0]`: key 1 masked | 2.0 | `[0.22, 0, 1]` | 1.22 | `[0.18, 0, 0.82]`: the masked key gets exactly 0 |
# | `[-inf, -inf, -inf]`: every key masked | `-inf` | `exp(-inf - (-inf)) = exp(NaN)` | NaN | NaN |
# | `[m, m, m]`, `m = finfo.min`: filled instead of `-inf` | `m` | `[1, 1, 1]` | 3 | `[1/3, 1/3, 1/3]`: the mean of the values |
#
# The cell below runs these rows, then three recipes on a query of the demo with no key.

# %%
worked_rows = torch.tensor([[0.5, float("-inf"), 2.0], [float("-inf")] * 3,
                            [torch.finfo(torch.float32).min] * 3])
print("softmax of the three rows:\n", torch.softmax(worked_rows, dim=-1).round(decimals=2))

# %%
keep = torch.ones(S, S, dtype=torch.bool, device=device)
keep[-1] = False  # the last query may attend to nothing (e.g. a padding token)
q_row, v_row = torch.randn(2, 1, 1, S, D // H, device=device)  # one head: [1, 1, S, d_head] each
scores_demo = q_row @ q_row.transpose(-2, -1) / math.sqrt(q_row.shape[-1])
for label, fill in (("-inf fill", float("-inf")),
                    ("finfo.min fill", torch.finfo(scores_demo.dtype).min)):
    filled = scores_demo.masked_fill(~keep, fill)
    last_row = (torch.softmax(filled, dim=-1) @ v_row)[0, 0, -1]
    print(f"{label:>15}: last row of out =", last_row.round(decimals=3))
sdpa_row = F.scaled_dot_product_attention(q_row, q_row, v_row, attn_mask=keep)[0, 0, -1]
print(f"{'PyTorch SDPA':>15}: last row of out =", sdpa_row.round(decimals=3))
print(f"{'mean of v':>15}:", v_row[0, 0].mean(0).round(decimals=3))

# %% [markdown]
# * **`-inf`** gives NaN, and NaN spreads: through the next matmul into every later layer, and
#   into the gradients. Your `attention_weights` does this too — which is fine for this course's
#   contract: every row the checks give it has a key to attend to.
# * **`torch.finfo(dtype).min`** (or `-1e9`, as in many codebases) *as a fill* keeps everything
#   finite: the row's scores are all equal, so the softmax is uniform and the output is the
#   **mean of all values** — harmless garbage that the loss then ignores. `-1e9` is not a float16
#   number, though: the cell below shows what it does there. And `finfo(dtype).min` is finite
#   only as a fill (`masked_fill`, `torch.where`). Many Hugging Face models *add* it to the
#   scores instead, as an additive mask, and that overflows in float16 as soon as the score is
#   below about −16 (`-20 + finfo(float16).min` is `-inf`; the cell below runs it): a row of
#   `-inf` is NaN again.
# * **`F.scaled_dot_product_attention`** (PyTorch 2.5 and later) returns **zeros** for a row whose
#   boolean mask is all False.
#
# None of the three is "right": the padding positions' outputs are meaningless and must be
# masked out of the loss. What matters is that they are finite, so they cannot poison the rest.
#
# Three more ways a row goes wrong, run below. `nn.MultiheadAttention` (its mask: True = blocked)
# gives NaN or zeros for the same row depending on the path it takes. In PyTorch 2.13 on a CPU
# (the cell runs on the CPU whatever this notebook's device): its fused inference **fast path**
# gives NaN; off that path, `need_weights=True` gives NaN too (it computes the weights with its
# own softmax), and `need_weights=False` gives zeros (it hands the work to SDPA). The fast path
# is taken only when *every* one of these holds: eval mode; no autograd (`torch.no_grad()`, or
# no parameter that requires a gradient); `batch_first=True`; the same tensor as query, key and
# value; no `kdim`/`vdim`; `bias=True` (the default); a boolean mask or none (a float mask
# leaves it); and an **even number of heads** — `(16, 4)` and `(12, 4)` take it, `(16, 1)` and
# `(12, 3)` do not; `embed_dim` does not decide it. `need_weights` is *not* one of the
# conditions: in eval mode without autograd, `need_weights=True` still takes the fast path (NaN
# either way), and `bias=False` leaves it (zeros with `need_weights=False`). The last lines of
# the cell below measure each case.
# A **+inf** score (an overflow upstream) defeats even the "stable" softmax: it subtracts the
# row's maximum, `inf - inf = NaN`, and the whole row is NaN.

# %%
keep_cpu = keep.cpu()  # the paths below are PyTorch's CPU paths, as the text says
mha = nn.MultiheadAttention(16, 4, batch_first=True)  # 4 heads: even, fast path allowed
x_row = torch.randn(1, S, 16)
paths = ((True, True, False), (True, True, True), (False, False, False), (False, False, True))
for training, autograd, need_weights in paths:
    mha.train(training)
    with torch.set_grad_enabled(autograd):
        row = mha(x_row, x_row, x_row, attn_mask=~keep_cpu, need_weights=need_weights)[0][0, -1]
    print(f"nn.MultiheadAttention, train={training!s:>5}, autograd={autograd!s:>5}, "
          f"need_weights={need_weights!s:>5}: last row", row.detach()[:3].round(decimals=3))
blocked_float = torch.zeros(S, S).masked_fill(~keep_cpu, float("-inf"))  # the same mask, as floats
gates = (("MultiheadAttention(16, 4)", dict(embed_dim=16, num_heads=4), ~keep_cpu),
         ("MultiheadAttention(12, 4)", dict(embed_dim=12, num_heads=4), ~keep_cpu),
         ("MultiheadAttention(16, 1)", dict(embed_dim=16, num_heads=1), ~keep_cpu),
         ("MultiheadAttention(12, 3)", dict(embed_dim=12, num_heads=3), ~keep_cpu),
         ("(16, 4), bias=False", dict(embed_dim=16, num_heads=4, bias=False), ~keep_cpu),
         ("(16, 4), a float mask", dict(embed_dim=16, num_heads=4), blocked_float))
with torch.no_grad():  # eval, no autograd: the fast path's other gates
    for label, options, blocked in gates:
        gated = nn.MultiheadAttention(**options, batch_first=True).eval()
        x_gate = torch.randn(1, S, options["embed_dim"])
        row = gated(x_gate, x_gate, x_gate, attn_mask=blocked, need_weights=False)[0][0, -1]
        print(f"eval, no grad, need_weights=False, {label:>25}: last row {row[:2]}")
half_scores = scores_demo.half()
try:
    half_scores.masked_fill(~keep, -1e9)
except RuntimeError as error:
    print("float16 masked_fill(-1e9) raises:", error)
print("float16 + a -1e9 mask converted to float16:", torch.tensor(-1e9).half())
half_min = torch.finfo(torch.float16).min
print("float16 scores [-3, -20] + finfo(float16).min:",
      torch.tensor([-3.0, -20.0], dtype=torch.float16) + half_min)
print("softmax of [1, +inf, 2]:", torch.softmax(torch.tensor([1.0, float("inf"), 2.0]), dim=-1))

# %% [markdown]
# **Dropout on the weights.** When training, many models drop attention *weights*: after the
# softmax, before `weights @ v`, each weight is zeroed with probability `p` and the survivors
# are scaled by `1/(1-p)` (a row then no longer sums to 1). `nn.MultiheadAttention(dropout=p)`
# does it inside; `F.scaled_dot_product_attention` takes `dropout_p` as an argument because
# its fused kernels never hand you the weights to drop. Pass `dropout_p=p` only in training,
# `0.0` in evaluation. This course's functions have no dropout.

# %% [markdown]
# ## 3. The whole module
#
# | step | operation | shape |
# | --- | --- | --- |
# | input | `x` | `[B, S, D]` |
# | projections | `q_linear(x)`, `k_linear(x)`, `v_linear(x)` | `[B, S, D]` each |
# | split | `split_heads` | `[B, H, S, d_head]` |
# | scores → weights | `attention_weights` | `[B, H, S, S]` |
# | weighted sum | `weights @ V` | `[B, H, S, d_head]` |
# | merge | `merge_heads` | `[B, S, D]` |
# | output projection | `out_linear` | `[B, S, D]` |
#
# The output projection mixes the heads' results; without it, head `h` could only ever
# write to its own `d_head` output features.
#
# There is **no parameter sharing between heads**: the `[D, D]` matrix of `q_linear` is `H`
# disjoint blocks of `d_head` rows (one per head), computed in one matmul for speed.

# %% [markdown]
# ### Exercise 1.6 — MultiHeadSelfAttention (4 pts, ~15 min)
#
# Put it together as an `nn.Module` with the attributes `q_linear, k_linear, v_linear,
# out_linear` (each `nn.Linear(embed_dim, embed_dim, bias=bias)`). `forward(x, mask=None,
# return_weights=False)` returns `[B, S, D]`, or `(out, weights [B, H, S, S])` with
# `return_weights=True`. Use your functions above; from scratch (no
# `F.scaled_dot_product_attention`, no `nn.MultiheadAttention`).

# %% answer="MultiHeadSelfAttention"
class MultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention.

    forward(x [B, S, D], mask bool broadcastable to [B, H, S, S] or None, return_weights)
    -> out [B, S, D], or (out, weights [B, H, S, S])

    Example: MultiHeadSelfAttention(16, 4)(torch.randn(2, 5, 16)).shape == (2, 5, 16)
    """

    def __init__(self, embed_dim, num_heads, bias=True):
        super().__init__()
        ### BEGIN SOLUTION
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim = {embed_dim} is not divisible by num_heads = {num_heads}")
        self.num_heads = num_heads
        self.q_linear = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_linear = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_linear = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_linear = nn.Linear(embed_dim, embed_dim, bias=bias)
        ### END SOLUTION

    def forward(self, x, mask=None, return_weights=False):
        ### BEGIN SOLUTION
        q = split_heads(self.q_linear(x), self.num_heads)  # [B, H, S, d_head]
        k = split_heads(self.k_linear(x), self.num_heads)
        v = split_heads(self.v_linear(x), self.num_heads)
        context, weights = scaled_dot_product_attention(q, k, v, mask)  # [B, H, S, d_head]
        out = self.out_linear(merge_heads(context))  # [B, S, D]
        return (out, weights) if return_weights else out
        ### END SOLUTION


# %% test="test_MultiHeadSelfAttention" points=4
"""MultiHeadSelfAttention: attributes, outputs and weights equal nn.MultiheadAttention's."""
from attention_lab.checks.mha_shapes import check_multi_head_self_attention

check_multi_head_self_attention(MultiHeadSelfAttention)
### BEGIN HIDDEN TESTS
check_multi_head_self_attention(MultiHeadSelfAttention, seed=1601, device="cpu")
### END HIDDEN TESTS

# %%
demo_layer = MultiHeadSelfAttention(D, H).to(device)
with torch.no_grad():  # only looking at shapes: no autograd graph needed
    out, demo_weights = demo_layer(x, causal, return_weights=True)
print("out:", tuple(out.shape), "weights:", tuple(demo_weights.shape))

# %% [markdown]
# ## 4. Where PyTorch keeps Q, K and V
#
# `nn.MultiheadAttention` stores the three projections stacked in **one** parameter,
# `in_proj_weight` of shape `[3·D, D]`: rows `0…D-1` are `W_q`, then `W_k`, then `W_v`, each in
# `nn.Linear`'s `[out, in]` layout — it computes `Q = x @ W_qᵀ + b_q`, not `x @ W_q` — with the
# biases stacked the same way in `in_proj_bias`. The output projection is an ordinary
# `nn.Linear` called `out_proj`.
#
# Everything built on `nn.MultiheadAttention` inherits this layout: `nn.TransformerEncoderLayer`
# (its `self_attn`), and ViTs that use it, such as torchvision's `vit_b_16`. Others write their
# own: timm's ViT has one `qkv = nn.Linear(D, 3·D)` whose weight is stacked q; k; v in the same
# order, Hugging Face's ViT has three separate `query`, `key`, `value` Linears. Always read the
# code before copying weights. And even `nn.MultiheadAttention` stacks only when it can: with
# `kdim` or `vdim` different from `embed_dim` the three matrices have different shapes, so
# `in_proj_weight` is `None` and they live in `q_proj_weight`, `k_proj_weight`, `v_proj_weight`.

# %%
torch_mha = nn.MultiheadAttention(D, H, batch_first=True)
print("in_proj_weight:", tuple(torch_mha.in_proj_weight.shape),
      "| in_proj_bias:", tuple(torch_mha.in_proj_bias.shape),
      "| out_proj.weight:", tuple(torch_mha.out_proj.weight.shape))
encoder_layer = nn.TransformerEncoderLayer(d_model=512, nhead=8)
print("nn.TransformerEncoderLayer(512, 8).self_attn.in_proj_weight:",
      tuple(encoder_layer.self_attn.in_proj_weight.shape), "= [3·512, 512]")
cross = nn.MultiheadAttention(D, H, kdim=4, vdim=6, batch_first=True)
print("with kdim=4, vdim=6: in_proj_weight is", cross.in_proj_weight,
      "| k_proj_weight:", tuple(cross.k_proj_weight.shape))

# %% [markdown]
# ### Exercise 1.7 — load_torch_mha_weights (2 pts, ~10 min)
#
# Copy a `nn.MultiheadAttention(batch_first=True)`'s parameters into your module so that
# both compute the same function. Copy values (`param.copy_(...)` inside `torch.no_grad()`):
# assigning a slice would make the two modules share memory. Handle `bias=False` too.
#
# Then compare them — and remember that `nn.MultiheadAttention`'s boolean `attn_mask` means
# **True = blocked**, the opposite of ours.

# %% answer="load_torch_mha_weights"
def load_torch_mha_weights(module, torch_mha):
    """Copy torch_mha's in_proj_weight/in_proj_bias (stacked q; k; v) and out_proj into module.

    module: a MultiHeadSelfAttention; torch_mha: nn.MultiheadAttention(batch_first=True)
    with the same embed_dim and bias setting. Modifies module in place; returns None.

    Example: after load_torch_mha_weights(m, t), m(x) equals t(x, x, x)[0].
    """
    ### BEGIN SOLUTION
    w_q, w_k, w_v = torch_mha.in_proj_weight.chunk(3, dim=0)  # three [D, D] blocks
    targets = (module.q_linear, module.k_linear, module.v_linear)
    with torch.no_grad():
        for linear, weight in zip(targets, (w_q, w_k, w_v)):
            linear.weight.copy_(weight)
        module.out_linear.weight.copy_(torch_mha.out_proj.weight)
        if torch_mha.in_proj_bias is not None:
            for linear, bias in zip(targets, torch_mha.in_proj_bias.chunk(3)):
                linear.bias.copy_(bias)
            module.out_linear.bias.copy_(torch_mha.out_proj.bias)
    ### END SOLUTION


# %% test="test_load_torch_mha_weights" points=2
"""load_torch_mha_weights: copies (not shares) the blocks; the module then equals PyTorch's."""
from attention_lab.checks.mha_shapes import check_load_torch_mha_weights

check_load_torch_mha_weights(load_torch_mha_weights, MultiHeadSelfAttention)
### BEGIN HIDDEN TESTS
check_load_torch_mha_weights(load_torch_mha_weights, MultiHeadSelfAttention, seed=1701,
                             device="cpu")
### END HIDDEN TESTS

# %%
mine = MultiHeadSelfAttention(D, H)
load_torch_mha_weights(mine, torch_mha)
x_cpu = x.cpu()
with torch.no_grad():
    # their mask: True = blocked
    theirs, _ = torch_mha(x_cpu, x_cpu, x_cpu, attn_mask=~causal.cpu())
    print("max difference:", float((mine(x_cpu, causal.cpu()) - theirs).abs().max()))

# %% [markdown]
# ## 5. What one layer costs
#
# For ViT-B/16 on a 224×224 image (196 patches + 1 class token, `D = 768`, `H = 12`) and a
# batch of 8, the table of section 3 reads: `x`, `Q`, the context and the output are
# `[8, 197, 768]`; the heads `[8, 12, 197, 64]`; the scores and weights `[8, 12, 197, 197]`.
# The layer's parameters are four `[D, D]` matrices and four bias vectors of `D`:
# `4·768² + 4·768 = 2,362,368`, whatever `H` is — more heads means narrower heads, not more
# weights:

# %%
for heads in (12, 1):
    count = sum(p.numel() for p in nn.MultiheadAttention(768, heads).parameters())
    print(f"nn.MultiheadAttention(768, {heads:>2}): {count:,} parameters")

# %% [markdown]
# Parameters say how much the layer stores; **FLOPs** (floating-point operations) say how much
# it computes. Nearly all of attention's work is matrix products. An `[m, k] @ [k, n]` product
# computes `m·n` dot products of length `k`: `m·k·n` multiply-adds, and a multiply-add counts
# as **2 FLOPs** (one multiply, one add). That is how PyTorch's own counter,
# `torch.utils.flop_counter.FlopCounterMode`, counts them; it ignores the cheap elementwise
# work (bias, scaling, mask, softmax).
#
# ### Exercise 1.8 — attention_layer_flops (2 pts, ~10 min)
#
# Count the FLOPs of one forward pass of your `MultiHeadSelfAttention` for a batch of
# `batch_size` sequences of `seq_len` tokens of width `d_model`, split in two:
#
# * `"projections"`: the four projections (`q_linear`, `k_linear`, `v_linear`, `out_linear`);
# * `"attention"`: the two products of attention itself (the scores, and the weighted sum of
#   the values), over all heads.
#
# Return a dict of two ints. Work out the shapes of each product from the table of section 3
# (does the number of heads matter?). The check runs `FlopCounterMode` on your own module and
# compares.

# %% answer="attention_layer_flops"
def attention_layer_flops(batch_size, seq_len, d_model):
    """FLOPs of one multi-head self-attention forward pass, as FlopCounterMode counts them.

    returns {"projections": int, "attention": int}

    Example: attention_layer_flops(1, 1, 1)["projections"] == 8 (four 1x1 products, 2 FLOPs each)
    """
    ### BEGIN SOLUTION
    tokens = batch_size * seq_len
    projections = 4 * 2 * tokens * d_model * d_model  # four [B·S, D] @ [D, D] products
    # per head: [S, d_head] @ [d_head, S] and [S, S] @ [S, d_head]; H · d_head = D
    attention = 2 * 2 * batch_size * seq_len * seq_len * d_model
    return {"projections": projections, "attention": attention}
    ### END SOLUTION


# %% test="test_attention_layer_flops" points=2
"""attention_layer_flops: equals FlopCounterMode's count on your MultiHeadSelfAttention."""
from attention_lab.checks.mha_shapes import check_attention_layer_flops

check_attention_layer_flops(attention_layer_flops, MultiHeadSelfAttention)
### BEGIN HIDDEN TESTS
check_attention_layer_flops(attention_layer_flops, MultiHeadSelfAttention, seed=1801,
                            device="cpu")
### END HIDDEN TESTS

# %%
from torch.utils.flop_counter import FlopCounterMode

layer = MultiHeadSelfAttention(64, 4)
with torch.no_grad(), FlopCounterMode(display=False) as counter:
    layer(torch.randn(2, 50, 64))
print(f"FlopCounterMode on your layer: {counter.get_total_flops():,} FLOPs")
print("attention_layer_flops(2, 50, 64):", attention_layer_flops(2, 50, 64))

# %% [markdown]
# ### Exercise 1.9 — the whole block, and where attention takes half (3 pts, ~15 min)
#
# A Transformer block is more than attention: after it comes an **MLP**, two `nn.Linear`s through
# a hidden width `int(mlp_ratio · D)` (4·D in GPT-2 and ViT-B) with a GELU between them.
# (Notebook 03 builds the whole block. A *pre-norm* block normalises each sublayer's input with a
# LayerNorm and adds the sublayer's output back to its input, a *residual* connection: `x = x +
# attn(norm1(x))`, then `x = x + mlp(norm2(x))`.) Write `block_flops(batch_size, seq_len,
# d_model, mlp_ratio=4)`: the matmul FLOPs of one forward pass of a pre-norm block, as a dict of
# three ints —
#
# * `"projections"` and `"attention"`: as in `attention_layer_flops`;
# * `"mlp"`: the two products of the MLP (up to the hidden width, and back down to `D`).
#
# The LayerNorms, the GELU and the residual additions are elementwise and, like the softmax,
# not counted. The check runs `FlopCounterMode` on a reference block whose attention is
# written with explicit matmuls (the counter does not see inside SDPA's fused kernels on a
# CPU), at `mlp_ratio = 4` and at other ratios.
#
# | name | signature | contract |
# | --- | --- | --- |
# | `block_flops` | `(batch_size, seq_len, d_model, mlp_ratio=4) -> dict` | keys `projections`, `attention`, `mlp`, each an `int`: matmul FLOPs, a multiply-add = 2 |

# %% answer="block_flops"
def block_flops(batch_size, seq_len, d_model, mlp_ratio=4):
    """Matmul FLOPs of one pre-norm Transformer block's forward pass, by part.

    returns {"projections": int, "attention": int, "mlp": int}; the MLP's hidden width is
    int(mlp_ratio * d_model).

    Example: block_flops(1, 1, 1)["mlp"] == 16 (a [1, 1] @ [1, 4] and a [1, 4] @ [4, 1] product)
    """
    ### BEGIN SOLUTION
    flops = attention_layer_flops(batch_size, seq_len, d_model)
    hidden = int(mlp_ratio * d_model)
    flops["mlp"] = 2 * 2 * batch_size * seq_len * d_model * hidden  # up and down, D x hidden each
    return flops
    ### END SOLUTION


# %% test="test_block_flops" points=2
"""block_flops: equals FlopCounterMode's count on a pre-norm block, part by part."""
from attention_lab.checks.mha_shapes import check_block_flops

check_block_flops(block_flops)
### BEGIN HIDDEN TESTS
check_block_flops(block_flops, seed=1902)
### END HIDDEN TESTS

# %% [markdown]
# Now answer **before** you run the cell after the check. The projections and the MLP grow
# with `S`, attention with `S²`, so for long enough sequences attention costs more than all
# the rest of the block. For a block of width `D = 768` with a 4·D MLP (GPT-2 small, ViT-B),
# at which sequence length `S` is attention exactly **half** of the block's matmul FLOPs
# (attention = projections + MLP)? Work it out from your counts on paper: one equation in `S`.
#
# Set `ANSWER_ATTENTION_CROSSOVER` to that number.

# %% answer="ANSWER_ATTENTION_CROSSOVER"
ANSWER_ATTENTION_CROSSOVER = None  # your answer: a sequence length, a number
### BEGIN SOLUTION
ANSWER_ATTENTION_CROSSOVER = 6 * 768
### END SOLUTION

# %% test="test_ANSWER_ATTENTION_CROSSOVER" points=1
"""ANSWER_ATTENTION_CROSSOVER: the sequence length where attention is half the block's FLOPs."""
from attention_lab.checks.mha_shapes import check_answer_attention_crossover

check_answer_attention_crossover(ANSWER_ATTENTION_CROSSOVER)
### BEGIN HIDDEN TESTS
check_answer_attention_crossover(ANSWER_ATTENTION_CROSSOVER, seed=1901)
### END HIDDEN TESTS

# %%
for seq_len in (197, 1024, 2048, 4096, 8192, 32768):
    flops = block_flops(1, seq_len, 768)
    share = flops["attention"] / sum(flops.values())
    versus_projections = flops["attention"] / flops["projections"]
    print(f"S = {seq_len:>5}: attention / projections = {versus_projections:6.3f}, "
          f"attention's share of the block {share:.2f}")

# %% [markdown]
# Two crossovers, and it matters which one a sentence means: attention passes the four
# projections early, and the whole rest of the block only at a sequence three times longer.
# At 32k tokens attention is most of the block's work, and its `[S, S]` scores also fill the
# memory. Notebook 06 is about that wall.
#
# ## 6. Find the bug
#
# ### Exercise 1.10 — predict what the draft does (1 pt, ~5 min)
#
# Here is a compact einops version of multi-head attention from a draft you may meet online.
# It runs and its shapes are right — and it is not the attention of the paper. Read it (running
# the cell only defines the class):

# %%
from einops import rearrange


class DraftMultiHeadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.in_proj_q = nn.Linear(embed_dim, embed_dim)
        self.in_proj_k = nn.Linear(embed_dim, embed_dim)
        self.in_proj_v = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.num_heads = num_heads

    def forward(self, q, k, v):
        r_q = rearrange(self.in_proj_q(q), "b m (h d) -> b h m d", h=self.num_heads)
        r_k = rearrange(self.in_proj_k(k), "b n (h d) -> b h n d", h=self.num_heads)
        r_v = rearrange(self.in_proj_v(v), "b n (h d) -> b h n d", h=self.num_heads)
        scores = torch.einsum("b h m d, b h n d -> b h m n", r_q, r_k)
        attn = torch.softmax(scores, dim=-1)
        result = torch.einsum("b h m n, b h n d -> b h m d", attn, r_v)
        return self.out_proj(rearrange(result, "b h m d -> b m (h d)"))

# %% [markdown]
# Predict, before running anything: the draft and a correct layer with the **same weights**
# see the same six random tokens, with `embed_dim = 512` and 8 heads (`d_head = 64`). Compared
# with the correct layer's attention weights, the draft's are:
#
# * **A.** identical: the two layers compute the same function.
# * **B.** much peakier: most rows put most of their weight on a single key.
# * **C.** flatter: closer to uniform.
# * **D.** identical; only the output differs, because the heads are never mixed.
#
# Set `ANSWER_DRAFT_BUG` to the letter, as a string. The cell after the check shows the evidence.

# %% answer="ANSWER_DRAFT_BUG"
ANSWER_DRAFT_BUG = None  # your prediction: "A", "B", "C" or "D"
### BEGIN SOLUTION
ANSWER_DRAFT_BUG = "B"
### END SOLUTION

# %% test="test_ANSWER_DRAFT_BUG" points=1
"""ANSWER_DRAFT_BUG: how the einops draft's attention differs from the paper's."""
from attention_lab.checks.mha_shapes import check_answer_draft_bug

check_answer_draft_bug(ANSWER_DRAFT_BUG)
### BEGIN HIDDEN TESTS
check_answer_draft_bug(ANSWER_DRAFT_BUG, seed=11001)
### END HIDDEN TESTS

# %% [markdown]
# The evidence: the largest weight of each row, averaged (1/6 ≈ 0.17 would be uniform), and the
# draft's output against PyTorch's SDPA (on the draft's own projections) with either scale.

# %%
draft = DraftMultiHeadAttention(512, 8)
x_cpu = torch.randn(4, 6, 512)
with torch.no_grad():
    draft_q, draft_k, draft_v = (rearrange(linear(x_cpu), "b s (h d) -> b h s d", h=8)
                                 for linear in (draft.in_proj_q, draft.in_proj_k, draft.in_proj_v))
    raw_scores = draft_q @ draft_k.transpose(-2, -1)
    for label, scores in (("draft (scale 1)", raw_scores),
                          ("correct (1/sqrt(64))", raw_scores / 8)):
        print(f"{label:>21}: mean largest weight {scores.softmax(-1).amax(-1).mean():.2f}")
    for scale in (1 / math.sqrt(64), 1.0):
        context = F.scaled_dot_product_attention(draft_q, draft_k, draft_v, scale=scale)
        expected = draft.out_proj(rearrange(context, "b h s d -> b s (h d)"))
        same = torch.allclose(draft(x_cpu, x_cpu, x_cpu), expected, atol=1e-5)
        print(f"draft equals SDPA with scale={scale:.3f}:", same)

# %% [markdown]
# The draft never divides the scores by `sqrt(d_head)`: it computes attention with scale 1.0.
# With `d_head = 64` its scores are 8× too large, and its softmax is far peakier: a mean largest
# weight of about 0.7 against about 0.25 with the scale (1/6 ≈ 0.17 would be uniform; set the
# explorer's scaling to "none" to see how it goes on growing with `d_head`). One more detail: a
# module built this way returns a tensor, so code written for `nn.MultiheadAttention` that takes
# `[0]` of its result would silently take batch element 0 instead of the output.
#
# ## What you built
#
# * `split_heads` / `merge_heads`: `view` + `permute`, and why `.contiguous()`/`.reshape` is
#   needed after a permute.
# * `attention_weights` / `scaled_dot_product_attention`: equal to PyTorch's SDPA, masks with
#   True = may attend — and what each recipe does to a row with nothing to attend to.
# * `MultiHeadSelfAttention`: equal to `nn.MultiheadAttention` once the weights are loaded —
#   with the stacked `in_proj_weight` in `[out, in]` layout and the opposite mask polarity.
# * `attention_layer_flops` and `block_flops`: what one layer and one whole block compute,
#   counted the way `FlopCounterMode` counts, and where attention takes over.
#
# Next: notebook 02 does the same maths by hand in NumPy.
