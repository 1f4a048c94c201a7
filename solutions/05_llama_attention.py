# %% [markdown]
# # 05 — Llama attention: GQA, RoPE, QK norm, KV cache
#
# **32 points, about 111 minutes.**
#
# The attention layer of a modern decoder (Llama 3 and 4, Mistral, Qwen, Gemma …) is the
# multi-head attention of notebook 01 plus a few ideas:
#
# * **grouped-query attention (GQA)** — fewer key/value heads than query heads (Llama 3,
#   Llama 4, Mistral, Qwen2 and Qwen3, Gemma 3 all use it);
# * **rotary position embeddings (RoPE)** — positions enter by *rotating* q and k (all of the
#   above, though Llama 4 leaves it out of every fourth layer, which attends without positions);
# * **QK norm** — q and k are normalised before their dot product. Only *some* models do
#   this. Qwen3 and Gemma 3 normalise every head's q and k on its own (an RMSNorm over
#   `head_dim` with a learned weight); OLMo 2 normalises the whole projected q and k before they
#   are split into heads (an RMSNorm over all `H·d_head` features, also with a learned weight);
#   and Llama 4 — with a caveat: Llama 4 Scout uses a weightless norm, only on its RoPE layers (every fourth
#   layer has neither RoPE nor QK norm), and Llama 4 Maverick uses none. Llama 3, Mistral and
#   Qwen2 do not normalise q and k at all;
# * **the KV cache** — when generating, keys and values of past tokens are kept, not recomputed.
#
# You will build each piece, check it against PyTorch or against a mathematical property,
# then assemble `LlamaAttention` from scratch, decode through a KV cache, and see how inference
# engines lay the cache out.
#
# The walk follows a set of study notes on Llama 4's attention code. They are mostly right;
# where they are not (RoPE's two layouts, an "L2 norm" that is really RMS, a silent float64 →
# float32 cast), this notebook says so and teaches the correct version.
#
# **Notation**: `B` batch, `S` tokens, `H` query heads, `H_kv` key/value heads, `d_head` (the
# config's `head_dim`) per-head width, `n_rep = H / H_kv` query heads per KV head. **Masks**
# are boolean with **True = may attend**.
#
# **Precision**: the checks compare your answers with float64 references. Computing in
# float32 inside and casting back (`x.float() … .type_as(x)`, as Hugging Face's and Meta's code
# do) is accepted, with a one-line note — except in `apply_rope`, whose text asks you to keep
# float64 throughout.

# %%
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# %% [markdown]
# ## 1. The configuration
#
# | field | value | meaning |
# | --- | --- | --- |
# | `hidden_size` | 128 | width `D` of each token's vector |
# | `num_attention_heads` | 16 | query heads `H` |
# | `num_key_value_heads` | 4 | key/value heads `H_kv`: each is shared by `n_rep = 4` query heads |
# | `head_dim` | 8 | `d_head`, a field of its own |
# | `max_position_embeddings` | 256 | size of *this code's* precomputed RoPE table |
# | `rope_theta` | 10000.0 | RoPE's base: the slowest pair turns `base^(-(d-2)/d)` rad per token |
# | `rms_norm_eps` | 1e-5 | the `eps` of QK norm |
# | `attention_bias` | False | biases in the four projections |
# | `use_qk_norm` | True | normalise q and k (after RoPE) |
#
# Two corrections to the notes. `head_dim` is *not* `hidden_size // num_attention_heads` in
# general: real configs set it on its own (Gemma-7B: `hidden_size` 3072, 16 heads of
# `head_dim` 256), so `q_proj` is `Linear(D, H·d_head)` and the output projection maps
# `H·d_head` back to `D`. And "sequences longer than 256 tokens must be truncated" is a limit of
# the precomputed table in this code, not of RoPE, whose rotation can be computed at any
# position. (Whether a model *trained* on shorter sequences still works beyond them is another
# matter: without scaling tricks such as position interpolation, NTK scaling or YaRN it
# usually does not.)

# %% [markdown]
# ### Exercise 5.1 — LlamaAttentionConfig (1 pt, ~5 min)
#
# Here is the configuration as a `@dataclass` with the nine fields of the table. A config that
# cannot work should fail when it is *created*, with a message that says why, not later deep
# inside a matrix product. Write `__post_init__` (a dataclass calls it right after `__init__`)
# so that it raises a `ValueError` naming the numbers when
#
# * `num_attention_heads` is not a multiple of `num_key_value_heads` (each KV head serves a
#   whole group of `n_rep` query heads), or
# * `head_dim` is odd (RoPE rotates *pairs* of features).
#
# Do **not** require `hidden_size` to be divisible by the number of heads: `head_dim` is
# independent of it.

# %% answer="LlamaAttentionConfig"
@dataclass
class LlamaAttentionConfig:
    """Hyper-parameters of one Llama attention layer.

    Example: LlamaAttentionConfig().num_key_value_heads == 4;
    LlamaAttentionConfig(head_dim=32).head_dim == 32 (not derived from hidden_size);
    LlamaAttentionConfig(num_attention_heads=6) raises ValueError (6 query heads, 4 KV heads).
    """

    hidden_size: int = 128
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 8
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    use_qk_norm: bool = True

    def __post_init__(self):
        ### BEGIN SOLUTION
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(f"num_attention_heads = {self.num_attention_heads} must be a multiple "
                             f"of num_key_value_heads = {self.num_key_value_heads}: each KV head "
                             "serves a whole group of query heads")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim = {self.head_dim} must be even: RoPE rotates pairs of "
                             "features")
        ### END SOLUTION


# %% test="test_LlamaAttentionConfig" points=1
"""LlamaAttentionConfig: nine fields, defaults; ValueError for H % H_kv or odd head_dim."""
from attention_lab.checks.llama_attention import check_llama_attention_config

check_llama_attention_config(LlamaAttentionConfig)
### BEGIN HIDDEN TESTS
check_llama_attention_config(LlamaAttentionConfig, seed=5101)
### END HIDDEN TESTS

# %%
config = LlamaAttentionConfig()
print(config)
print("query heads per KV head, n_rep =", config.num_attention_heads // config.num_key_value_heads)
try:
    LlamaAttentionConfig(num_attention_heads=6)
except ValueError as error:
    print("ValueError:", error)

# %% [markdown]
# ## 2. Projections with grouped-query shapes
#
# The queries get `H = 16` heads; keys and values only `H_kv = 4`. So `q_proj` is
# `Linear(128, 16·8)` while `k_proj` and `v_proj` are `Linear(128, 4·8)`: a quarter of the
# K/V weights and — what matters at inference — a quarter of the K/V memory (section 12).
# Each head is then split off exactly as in notebook 01: `view` to `[B, S, heads, d_head]`,
# `transpose(1, 2)` to `[B, heads, S, d_head]`.

# %%
B, S = 2, 10
hidden_size, H, H_kv, d_head = 128, 16, 4, 8  # LlamaAttentionConfig's defaults
rope_theta, rms_norm_eps = 10000.0, 1e-5
hidden_states = torch.randn(B, S, hidden_size, device=device)
position_ids = torch.arange(S, device=device).expand(B, S)  # [B, S]: 0 ... S-1 for each sequence
q_proj = nn.Linear(hidden_size, H * d_head, bias=False).to(device)
k_proj = nn.Linear(hidden_size, H_kv * d_head, bias=False).to(device)
v_proj = nn.Linear(hidden_size, H_kv * d_head, bias=False).to(device)
with torch.no_grad():  # no training in this notebook's demos
    q = q_proj(hidden_states).view(B, S, H, d_head).transpose(1, 2)  # [B, H, S, d_head]
    k = k_proj(hidden_states).view(B, S, H_kv, d_head).transpose(1, 2)  # [B, H_kv, S, d_head]
    v = v_proj(hidden_states).view(B, S, H_kv, d_head).transpose(1, 2)  # [B, H_kv, S, d_head]
print("q:", tuple(q.shape), " k:", tuple(k.shape), " v:", tuple(v.shape))
print("W_q:", tuple(q_proj.weight.shape), " W_k:", tuple(k_proj.weight.shape),
      "(nn.Linear stores [out, in])")

# %% [markdown]
# ## 3. The causal mask
#
# A decoder predicts token `i + 1` from tokens `0 … i`, so query `i` may attend to keys
# `0 … i` and never to a later one. As a boolean mask (True = may attend) that is the lower
# triangle, diagonal included. The notes build a float mask of `0` and `-inf` and *add* it to
# the scores; we keep the mask boolean, say what it means, and fill the blocked scores in one
# place: `scores.masked_fill(~mask, float("-inf"))`. The softmax is the same.
#
# Neither form protects a row in which **no** key is allowed. That row is real: batches of
# sequences of different lengths are padded to one length, and the padded *keys* are masked
# too. A real token always sees at least itself, but a padded *query* (say, the first position
# of a left-padded sequence, under the causal mask) may see nothing. Its softmax is then
# `0 / 0 = NaN`, with an additive `-inf` mask and with `masked_fill(-inf)` alike — and the NaN
# does not stay in that row: in the next layer the padded token's value row gets weight 0, and
# `0 · NaN = NaN` spreads to every token. The cell below shows what each recipe gives.

# %%
row_scores = torch.tensor([[0.5, -1.0, 2.0]])  # one query, three keys
nothing_allowed = torch.zeros(1, 3, dtype=torch.bool)  # a padded query: no key may be attended
most_negative = torch.finfo(row_scores.dtype).min
print("masked_fill(-inf):      ",
      torch.softmax(row_scores.masked_fill(~nothing_allowed, float("-inf")), dim=-1))
print("masked_fill(finfo.min): ",
      torch.softmax(row_scores.masked_fill(~nothing_allowed, most_negative), dim=-1))
one_head = torch.randn(1, 1, 1, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)  # q, k, v
print("SDPA with a boolean mask, output:",
      F.scaled_dot_product_attention(*one_head, attn_mask=nothing_allowed))

# %% [markdown]
# Three answers to one question. `-inf` gives NaN. The dtype's most negative finite number,
# `torch.finfo(dtype).min` (Hugging Face's choice), keeps the row finite — but as a *uniform*
# average over keys that were meant to be hidden: harmless only because a padded token's
# output is never used. PyTorch's `scaled_dot_product_attention` returns zeros for such a row
# (the version installed here does; the outputs above are computed, not quoted). In this
# notebook every row has at least one allowed key (the token itself), so `-inf` is safe; with
# padding, use `finfo.min` or SDPA, and ignore the padded positions' outputs.

# %% [markdown]
# ### Exercise 5.2 — causal_mask (1 pt, ~3 min)
#
# Return the `[S, S]` boolean mask that is True on and below the diagonal, created on `device`.

# %% answer="causal_mask"
def causal_mask(seq_len, device=None):
    """Causal mask: True where query i may attend to key j, i.e. j <= i.

    returns: BoolTensor [seq_len, seq_len] on device.

    Example: causal_mask(3).int() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    ### BEGIN SOLUTION
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    ### END SOLUTION


# %% test="test_causal_mask" points=1
"""causal_mask: [S, S] bool, True on and below the diagonal, on the requested device."""
from attention_lab.checks.llama_attention import check_causal_mask

check_causal_mask(causal_mask)
### BEGIN HIDDEN TESTS
check_causal_mask(causal_mask, seed=5201, device="cpu")
### END HIDDEN TESTS

# %%
print(causal_mask(5).int())

# %% [markdown]
# ## 4. RoPE, the Meta way: pairs as complex numbers
#
# Split a head vector's `d` features into `d/2` **pairs** and treat each pair as a point in the
# plane. RoPE rotates pair `j` of the token at position `p` by the angle `p · θ_j`, with
#
# $$\theta_j = \text{base}^{-2j/d}, \qquad j = 0, 1, \dots, d/2 - 1 .$$
#
# Pair 0 turns 1 radian per token; the last pair barely moves. Both q and k are rotated, and
# since rotating both vectors of a dot product by the *same* angle does not change it,
# `rot(q, m) · rot(k, n)` depends only on the **offset** `m - n`: absolute positions go in,
# relative positions come out.
#
# A rotation of the pair `(a, b)` by `φ` is the complex product `(a + i·b) · e^{iφ}`. Meta's
# Llama code (and the notes) uses exactly that: it pairs **adjacent features** `(2j, 2j+1)` as
# one complex number and precomputes the table `freqs_cis[p, j] = e^{i·p·θ_j}`.

# %% [markdown]
# ### Exercise 5.3 — rope_frequencies (2 pts, ~8 min)
#
# Return the complex table `[max_positions, head_dim // 2]` with entry `[p, j] = exp(i·p·θ_j)`.
# Compute the angles in float64 (`p · θ_j` at large `p` loses digits in float32) and build the
# complex numbers with `torch.polar(magnitude, angle)`. (Meta's code computes the angles in
# float32 and stores a complex64 table: less precise at large positions, but correct, and
# accepted here and by every later exercise.)
#
# Mind the notes' version: it duplicates the table with `torch.cat((freqs, freqs))` and then
# slices `[..., :d/2]`, which just undoes the duplication. One angle per pair is all it needs.

# %% answer="rope_frequencies"
def rope_frequencies(head_dim, max_positions, base=10000.0):
    """RoPE's rotation table for the Meta (complex, adjacent pairs) layout.

    returns: complex Tensor [max_positions, head_dim // 2], entry [p, j] = exp(i · p · θ_j)
    with θ_j = base ** (-2j / head_dim).

    Example: rope_frequencies(4, 3)[2, 0] == exp(2i) (θ_0 = 1);
    rope_frequencies(4, 3)[0] is all ones.
    """
    ### BEGIN SOLUTION
    pair_features = torch.arange(0, head_dim, 2, dtype=torch.float64)  # 2j = 0, 2, 4, ...
    inverse_frequencies = base ** (-pair_features / head_dim)  # θ_j, [d/2]
    positions = torch.arange(max_positions, dtype=torch.float64)  # [P]
    angles = torch.outer(positions, inverse_frequencies)  # [P, d/2]: angle p·θ_j
    return torch.polar(torch.ones_like(angles), angles)  # e^{i·angle}, complex128
    ### END SOLUTION


# %% test="test_rope_frequencies" points=2
"""rope_frequencies: [P, head_dim/2] complex, exp(i·p·θ_j) with θ_j = base^(-2j/head_dim)."""
from attention_lab.checks.llama_attention import check_rope_frequencies

check_rope_frequencies(rope_frequencies)
### BEGIN HIDDEN TESTS
check_rope_frequencies(rope_frequencies, seed=5301)
### END HIDDEN TESTS

# %%
freqs_cis = rope_frequencies(d_head, 256, rope_theta)
print("freqs_cis:", tuple(freqs_cis.shape), freqs_cis.dtype)
print("θ_j (the angles at position 1):", torch.angle(freqs_cis[1]).tolist())

# %% [markdown]
# ### Exercise 5.4 — apply_rope (3 pts, ~15 min)
#
# Rotate `x [B, H, S, head_dim]` (queries or keys): view the last axis as `head_dim/2` pairs
# (`reshape(..., head_dim // 2, 2)`), turn them into complex numbers (`torch.view_as_complex`),
# multiply by each token's row of the table, and go back (`torch.view_as_real(...).flatten(-2)`).
#
# * The rows come from the **`position_ids [B, S]` argument**: `freqs_cis[position_ids]` is
#   `[B, S, head_dim/2]`; add a head axis (`[:, None]`) so every head of a token gets the same
#   rotation. (The notes read a global `position_ids` instead: the function then silently
#   uses whatever that global holds.)
# * Keep x's dtype **and its precision**. The notes call `xq.float()`, which downcasts float64
#   to float32 (Meta's code does the same, then casts back with `.type_as(xq)`). Compute in
#   `torch.promote_types(x.dtype, torch.float32)` — float64 stays float64, half precision is
#   computed in float32 — and return `.to(x.dtype)`. This is the one exercise of the notebook
#   that asks for float64 internals: on float64 input its check wants float64 accuracy, so
#   computing in float32 and casting back fails here.
# * Move the table to `x.device` (it is built on the CPU).

# %% answer="apply_rope"
def apply_rope(x, freqs_cis, position_ids):
    """Rotary position embedding, Meta layout: rotate features (2j, 2j+1) by position · θ_j.

    x: [B, H, S, head_dim], freqs_cis: complex [max_positions, head_dim // 2],
    position_ids: LongTensor [B, S]  ->  [B, H, S, head_dim], same dtype and device as x.

    Example: with position_ids all 0, apply_rope(x, freqs_cis, position_ids) equals x.
    """
    ### BEGIN SOLUTION
    compute_dtype = torch.promote_types(x.dtype, torch.float32)  # float64 stays float64
    pairs = x.to(compute_dtype).reshape(*x.shape[:-1], -1, 2).contiguous()  # [B, H, S, d/2, 2]
    x_complex = torch.view_as_complex(pairs)  # [B, H, S, d/2]: a + i·b per pair
    rotation = freqs_cis.to(x.device)[position_ids][:, None]  # [B, 1, S, d/2], shared by the heads
    rotated = torch.view_as_real(x_complex * rotation).flatten(-2)  # [B, H, S, d]
    return rotated.to(x.dtype)
    ### END SOLUTION


# %% test="test_apply_rope" points=3
"""apply_rope: Meta layout at position_ids; dtype and norms kept; q·k depends on the offset."""
from attention_lab.checks.llama_attention import check_apply_rope

check_apply_rope(apply_rope)
### BEGIN HIDDEN TESTS
check_apply_rope(apply_rope, seed=5401, device="cpu")
check_apply_rope(apply_rope, seed=5402)
### END HIDDEN TESTS

# %%
q_rot = apply_rope(q, rope_frequencies(d_head, 64), position_ids)
print("q_rot:", tuple(q_rot.shape),
      "| norms kept:", torch.allclose(q_rot.norm(dim=-1), q.norm(dim=-1), atol=1e-5))
x64 = torch.randn(1, 1, 3, 8, dtype=torch.float64, device=device)
x64_rotated = apply_rope(x64, rope_frequencies(8, 8), torch.arange(3, device=device)[None])
print("float64 in ->", x64_rotated.dtype, "out")

# %% [markdown]
# **Look at it.** The explorer runs your `rope_frequencies` and `apply_rope` on a random head
# vector `q` (8 features, so 4 pairs). Top: each pair's path as the position grows — pair 0
# turns a full circle every 2π ≈ 6.3 tokens, pair 3 hardly moves. Bottom: `q·k` as a function
# of the offset between query and key, once with the key at position 0 and once with the key at
# the slider's position. The curves lie on top of each other: only the offset matters. Try a
# base of 100 (fast rotations everywhere) or 500,000 (Llama 3's: the slow pairs barely turn).

# %%
from attention_lab.widgets.rope import rope_explorer

rope_explorer(apply_rope, rope_frequencies, head_dim=8)

# %% [markdown]
# ## 5. RoPE, the Hugging Face way: `rotate_half`
#
# Hugging Face's Llama code rotates the same kind of pairs, but pairs feature `j` with feature
# `j + d/2` (the two **halves** of the head) instead of adjacent features, and it needs no
# complex numbers. With `x1, x2` the halves and `rotate_half(x) = cat(-x2, x1)`:
#
# $$\text{rope}(x) = x \cdot \cos + \text{rotate\_half}(x) \cdot \sin$$
#
# where `cos` and `sin` repeat the `d/2` angles twice, `cat(angles, angles)`, so that feature
# `j` and feature `j + d/2` use the same angle. *This* is what the notes' duplicated table is
# for — but they then use it in the complex (adjacent-pairs) layout, where it does not belong.

# %% [markdown]
# ### Exercise 5.5 — rotate_half (1 pt, ~3 min)

# %% answer="rotate_half"
def rotate_half(x):
    """Quarter turn of every (j, j + d/2) pair: (x1, x2) -> (-x2, x1), x1, x2 the last axis' halves.

    x: [..., d]  ->  [..., d]

    Example: rotate_half(torch.tensor([1., 2., 3., 4.])) == [-3., -4., 1., 2.]
    """
    ### BEGIN SOLUTION
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
    ### END SOLUTION


# %% test="test_rotate_half" points=1
"""rotate_half: cat(-x2, x1) of the two halves; shape and dtype kept."""
from attention_lab.checks.llama_attention import check_rotate_half

check_rotate_half(rotate_half)
### BEGIN HIDDEN TESTS
check_rotate_half(rotate_half, seed=5501, device="cpu")
### END HIDDEN TESTS

# %%
print(rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0])))

# %% [markdown]
# ### Exercise 5.6 — rope_cos_sin (2 pts, ~8 min)
#
# The tables for the rotate_half layout, per token: `angles[b, s, j] = position_ids[b, s] · θ_j`
# (`[B, S, head_dim/2]`), then `cos(cat(angles, angles))` and `sin(...)`, each
# `[B, S, head_dim]`, on `position_ids`' device. Compute them in float64 (Hugging Face's
# float32 tables are accepted too, with float32's tolerance).

# %% answer="rope_cos_sin"
def rope_cos_sin(head_dim, position_ids, base=10000.0):
    """cos and sin tables for the rotate_half layout.

    position_ids: LongTensor [B, S]  ->  (cos, sin), each float64 [B, S, head_dim], where
    columns j and j + head_dim/2 hold the angle position · θ_j, θ_j = base ** (-2j / head_dim).

    Example: rope_cos_sin(4, torch.tensor([[0]]))[0] is all ones.
    """
    ### BEGIN SOLUTION
    pair_features = torch.arange(0, head_dim, 2, dtype=torch.float64, device=position_ids.device)
    inverse_frequencies = base ** (-pair_features / head_dim)  # θ_j, [d/2]
    angles = position_ids.to(torch.float64)[..., None] * inverse_frequencies  # [B, S, d/2]
    angles = torch.cat((angles, angles), dim=-1)  # [B, S, d]: angle j drives features j and j + d/2
    return angles.cos(), angles.sin()
    ### END SOLUTION


# %% test="test_rope_cos_sin" points=2
"""rope_cos_sin: (cos, sin) of cat(angles, angles) at position_ids, [B, S, head_dim]."""
from attention_lab.checks.llama_attention import check_rope_cos_sin

check_rope_cos_sin(rope_cos_sin)
### BEGIN HIDDEN TESTS
check_rope_cos_sin(rope_cos_sin, seed=5601, device="cpu")
### END HIDDEN TESTS

# %%
cos_table, sin_table = rope_cos_sin(d_head, position_ids, rope_theta)
print("cos, sin:", tuple(cos_table.shape), cos_table.dtype,
      "| cos at position 1:", cos_table[0, 1].round(decimals=3).tolist())

# %% [markdown]
# ### Exercise 5.7 — apply_rope_rotate_half (2 pts, ~5 min)
#
# `x * cos + rotate_half(x) * sin` for `x [B, H, S, head_dim]` and tables `[B, S, head_dim]`:
# add the head axis to the tables (`cos[:, None]`), and cast them to `x.dtype` so that the
# output keeps x's dtype.

# %% answer="apply_rope_rotate_half"
def apply_rope_rotate_half(x, cos, sin):
    """Rotary position embedding, Hugging Face layout: rotate features (j, j + d/2).

    x: [B, H, S, head_dim], cos and sin: [B, S, head_dim]  ->  [B, H, S, head_dim], x's dtype.

    Example: with cos all ones and sin all zeros (position 0) the result equals x.
    """
    ### BEGIN SOLUTION
    cos = cos.to(x.dtype)[:, None]  # [B, 1, S, d]: the same rotation for every head
    sin = sin.to(x.dtype)[:, None]
    return x * cos + rotate_half(x) * sin
    ### END SOLUTION


# %% test="test_apply_rope_rotate_half" points=2
"""apply_rope_rotate_half: x*cos + rotate_half(x)*sin over [B, H, S, d]; dtype kept."""
from attention_lab.checks.llama_attention import check_apply_rope_rotate_half

check_apply_rope_rotate_half(apply_rope_rotate_half)
### BEGIN HIDDEN TESTS
check_apply_rope_rotate_half(apply_rope_rotate_half, seed=5701, device="cpu")
### END HIDDEN TESTS

# %%
cos_table, sin_table = rope_cos_sin(d_head, position_ids, rope_theta)
q_meta = apply_rope(q, rope_frequencies(d_head, 64), position_ids)
q_half = apply_rope_rotate_half(q, cos_table, sin_table)
print("same input, two layouts: max difference", float((q_meta - q_half).abs().max()))

# %% [markdown]
# ## 6. The two layouts are the same maths in a different feature order
#
# On the same input they disagree (the cell above: a difference of order 1). But they rotate
# the same *kind* of pairs with the same angles; only *which* features form pair `j` differs:
# `(2j, 2j+1)` for Meta, `(j, j + d/2)` for Hugging Face. So some reordering `π` of the
# features moves every Meta pair to the places where rotate_half expects a pair, and then:
#
# $$\text{apply\_rope}(x)[\dots, \pi] = \text{apply\_rope\_rotate\_half}(x[\dots, \pi]).$$

# %% [markdown]
# ### Exercise 5.8 — interleave_to_half_permutation (2 pts, ~5 min)
#
# Find `π` and return it as a LongTensor `[head_dim]`. Indexing `x[..., π]` puts feature `π[i]`
# at place `i`. Ask, for each place of the rotate_half layout, which Meta feature must land
# there: place `j` (for `j < d/2`) holds the *first* element of rotate_half's pair `j`, place
# `j + d/2` its *second* element — and Meta's pair `j` is features `(2j, 2j+1)`. Write out `π`
# for `head_dim = 4` on paper first, then build it for any even `head_dim` (with
# `torch.arange`; no loop needed).

# %% answer="interleave_to_half_permutation"
def interleave_to_half_permutation(head_dim):
    """The feature order under which Meta RoPE and rotate_half RoPE agree.

    returns: LongTensor perm [head_dim] such that
    apply_rope(x, ...)[..., perm] == apply_rope_rotate_half(x[..., perm], ...).

    Example: interleave_to_half_permutation(2) == [0, 1] (one pair: the layouts coincide).
    """
    ### BEGIN SOLUTION
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    ### END SOLUTION


# %% test="test_interleave_to_half_permutation" points=2
"""interleave_to_half_permutation: the layouts agree under it, on x and on W_q/W_k rows."""
from attention_lab.checks.llama_attention import check_interleave_to_half_permutation

check_interleave_to_half_permutation(interleave_to_half_permutation)
### BEGIN HIDDEN TESTS
check_interleave_to_half_permutation(interleave_to_half_permutation, seed=5801, device="cpu")
### END HIDDEN TESTS

# %%
perm = interleave_to_half_permutation(d_head).to(device)
cos_table, sin_table = rope_cos_sin(d_head, position_ids, rope_theta)
meta_then_permute = apply_rope(q, rope_frequencies(d_head, 64), position_ids)[..., perm]
permute_then_half = apply_rope_rotate_half(q[..., perm], cos_table, sin_table)
print("perm:", perm.tolist(), "| max difference after permuting:",
      float((meta_then_permute - permute_then_half).abs().max()))

# %% [markdown]
# **How real checkpoints are converted.** Nobody permutes activations at run time. The
# features of head `h` are rows `h·d … h·d + d - 1` of `W_q` (and of `W_k`), so permuting the
# **rows of each head's block** of `W_q` and `W_k` once gives weights whose q and k come out
# already in the rotate_half order. Dot products do not care about the order of features, so
# the attention scores — and everything after them — are unchanged. (V and `o_proj` are not
# touched: RoPE never acts on them.) That is what Hugging Face's Llama conversion script does
# to Meta's checkpoints.

# %%
perm = interleave_to_half_permutation(d_head).to(device)
meta_table = rope_frequencies(d_head, 64)
cos_table, sin_table = rope_cos_sin(d_head, position_ids, rope_theta)
n_rep = H // H_kv


def rows_permuted_per_head(weight, num_heads):
    """Permute the rows of each head's [d_head, D] block of a projection weight."""
    return weight.view(num_heads, d_head, -1)[:, perm].reshape(num_heads * d_head, -1)


with torch.no_grad():
    q_meta = q_proj(hidden_states).view(B, S, H, d_head).transpose(1, 2)
    k_meta = k_proj(hidden_states).view(B, S, H_kv, d_head).transpose(1, 2)
    W_q_hf = rows_permuted_per_head(q_proj.weight, H)
    W_k_hf = rows_permuted_per_head(k_proj.weight, H_kv)
    q_hf = (hidden_states @ W_q_hf.T).view(B, S, H, d_head).transpose(1, 2)
    k_hf = (hidden_states @ W_k_hf.T).view(B, S, H_kv, d_head).transpose(1, 2)
    # Query head h reads KV head h // n_rep (section 8): heads 0, 4, 8, 12 read KV heads 0, 1, 2, 3.
    first_of_each_group = slice(None, None, n_rep)
    scores_meta = (apply_rope(q_meta[:, first_of_each_group], meta_table, position_ids)
                   @ apply_rope(k_meta, meta_table, position_ids).transpose(-2, -1))
    scores_hf = (apply_rope_rotate_half(q_hf[:, first_of_each_group], cos_table, sin_table)
                 @ apply_rope_rotate_half(k_hf, cos_table, sin_table).transpose(-2, -1))
print("scores of query heads 0, 4, 8, 12 with their KV heads,\n"
      "Meta weights + Meta RoPE vs permuted weights + rotate_half RoPE:",
      float((scores_meta - scores_hf).abs().max()))

# %% [markdown]
# ## 7. QK norm: RMS normalisation without a weight
#
# The notes normalise q and k with a module called `SimpleL2Norm`:
# `x * rsqrt(mean(x²) + eps)`. That is not L2 normalisation. It divides by the **root mean
# square** `sqrt(mean(x²))`, not by the L2 norm `sqrt(sum(x²))`, so the output has RMS 1 and
# therefore **norm `sqrt(d_head)`**, not 1. It is `nn.RMSNorm(d_head, elementwise_affine=False)`
# — RMSNorm without its learned weight — and the same maths as Llama 4's QK norm (which
# Hugging Face's code also calls an L2 norm). We call it what it is: `qk_norm`.
#
# Why normalise q and k? Their dot product can grow without bound during training and saturate
# the softmax (the problem of notebook 01's scale slider). After QK norm every q·k lies in
# `[-d_head, d_head]`, and the scores divided by `sqrt(d_head)` in `[-sqrt(d_head), sqrt(d_head)]`.
#
# Two details. `eps` belongs **inside** the root (`rsqrt(mean + eps)`), and it is the config's
# `rms_norm_eps = 1e-5` (the notes' module defaults to its own 1e-6 and never uses the config).
# And the order with RoPE does not matter *here*: a rotation preserves the RMS, so a weightless
# norm before or after RoPE gives the same result (with a learned per-feature weight, as in
# Qwen3, it would not). We apply it after RoPE, as Llama 4 does.

# %% [markdown]
# ### Exercise 5.9 — qk_norm (2 pts, ~5 min)
#
# `x · rsqrt(mean(x², last axis) + eps)`, from scratch (no `F.rms_norm` / `nn.RMSNorm`).

# %% answer="qk_norm"
def qk_norm(x, eps):
    """Weightless RMS normalisation over the last axis (the notes' "SimpleL2Norm").

    x: [..., d]  ->  [..., d], x / sqrt(mean(x²) + eps); for |x| >> eps the output has norm sqrt(d).

    Example: qk_norm(torch.tensor([3., 4.]), 0.0) == [0.8485, 1.1314]
    (RMS 3.5355; norm sqrt(2), not 1).
    """
    ### BEGIN SOLUTION
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    ### END SOLUTION


# %% test="test_qk_norm" points=2
"""qk_norm: x·rsqrt(mean(x²) + eps) over the last axis (weightless RMSNorm); from scratch."""
from attention_lab.checks.llama_attention import check_qk_norm

check_qk_norm(qk_norm)
### BEGIN HIDDEN TESTS
check_qk_norm(qk_norm, seed=5901, device="cpu")
### END HIDDEN TESTS

# %%
q_normed = qk_norm(q, rms_norm_eps)
print("norm of each normed q (sqrt(8) = 2.828):", q_normed.norm(dim=-1)[0, 0, :4].tolist())
rope_table = rope_frequencies(d_head, 64)
norm_after = qk_norm(apply_rope(q, rope_table, position_ids), rms_norm_eps)
norm_before = apply_rope(qk_norm(q, rms_norm_eps), rope_table, position_ids)
print("norm before RoPE vs after RoPE, max difference:",
      float((norm_after - norm_before).abs().max()))

# %% [markdown]
# ## 8. Grouped-query attention: `repeat_kv`
#
# With 16 query heads and 4 KV heads, query heads 0–3 share KV head 0, heads 4–7 share KV
# head 1, and so on: **query head `h` reads KV head `h // n_rep`**. Real checkpoints are
# trained with this consecutive grouping, so the K/V heads must be repeated as
# `k0, k0, k0, k0, k1, k1, …` — not tiled as `k0, k1, k2, k3, k0, k1, …` (which is what
# `x.repeat(1, n_rep, 1, 1)` gives: it runs, has the right shape, and pairs the wrong heads).
# PyTorch's `scaled_dot_product_attention(..., enable_gqa=True)` groups the same way.
#
# `expand` creates the repeats as a view (no copy) and `reshape` merges the axes.

# %% [markdown]
# ### Exercise 5.10 — repeat_kv (2 pts, ~5 min)

# %% answer="repeat_kv"
def repeat_kv(x, n_rep):
    """Repeat each KV head n_rep times, consecutively, to match the query heads.

    x: [B, H_kv, S, d]  ->  [B, H_kv * n_rep, S, d]; output head h is input head h // n_rep.

    Example: heads (k0, k1) with n_rep=2 become (k0, k0, k1, k1).
    """
    ### BEGIN SOLUTION
    batch, num_kv_heads, seq_len, head_dim = x.shape
    if n_rep == 1:
        return x
    # [B, H_kv, n_rep, S, d], a view: no copy
    x = x[:, :, None].expand(batch, num_kv_heads, n_rep, seq_len, head_dim)
    return x.reshape(batch, num_kv_heads * n_rep, seq_len, head_dim)
    ### END SOLUTION


# %% test="test_repeat_kv" points=2
"""repeat_kv: [B, H_kv*n_rep, S, d], head h = KV head h // n_rep; n_rep = 1; MQA."""
from attention_lab.checks.llama_attention import check_repeat_kv

check_repeat_kv(repeat_kv)
### BEGIN HIDDEN TESTS
check_repeat_kv(repeat_kv, seed=6001, device="cpu")
### END HIDDEN TESTS

# %%
heads = torch.arange(3.0).view(1, 3, 1, 1)  # KV heads 0, 1, 2 (one number each)
print("repeat_kv:", repeat_kv(heads, 2).flatten().tolist(),
      "  (tiled would be", heads.repeat(1, 2, 1, 1).flatten().tolist(), ")")

# %% [markdown]
# **Look at it.** Which KV head does each query head read? The map runs *your* `repeat_kv` on KV
# heads that hold their own index, so each line goes from a query head to the KV head whose keys
# and values it gets. Switch the layout to *tiled* (`x.repeat(1, n_rep, 1, 1)`): the shapes are
# the same, but query head 1 now reads KV head 1 instead of KV head 0 — for a checkpoint trained
# with consecutive groups, the wrong keys and values. Change `H_kv` to see the two extremes:
# 1 (multi-query attention, every head shares one K/V head) and 16 (plain multi-head attention).

# %%
from attention_lab.widgets.rope import kv_head_map

kv_head_map(repeat_kv, num_heads=H)

# %% [markdown]
# ## 9. The KV cache
#
# A decoder generates one token at a time. At step `t` the new token's query must meet the
# keys and values of **all** tokens `0 … t`; those of tokens `0 … t-1` were already computed at
# earlier steps, and (being causal) they have not changed. So we keep them: a **KV cache** holds
# every layer's keys (after RoPE and QK norm) and values, and each step appends one token's
# worth. Generation then costs one token's projections per step instead of the whole prefix.
#
# Two things change in the attention layer when a cache holds `past` tokens:
# * **positions continue**: the new tokens sit at positions `past, past + 1, …`, so the
#   default `position_ids` are `past + arange(S_new)`;
# * **the mask is offset**: new token `i` (at position `past + i`) may see all `past` cached
#   keys and the new keys up to itself — rows `past … past + S_new - 1` of
#   `causal_mask(past + S_new)`.

# %% [markdown]
# ### Exercise 5.11 — KVCache (2 pts, ~8 min)
#
# `KVCache()` starts empty (`seq_len == 0`). `update(k, v)` appends `k, v [B, H_kv, S_new, d]`
# along the sequence axis and returns `(k_all, v_all)`, everything cached so far. `seq_len` is
# the number of cached tokens (a property). Create the storage in `__init__`: a class attribute
# would be shared by every cache.

# %% answer="KVCache"
class KVCache:
    """Keys and values of the tokens seen so far (one attention layer).

    update(k [B, H_kv, S_new, d], v [B, H_kv, S_new, d]) -> (k_all, v_all), [B, H_kv, seq_len, d]

    Example: cache = KVCache(); cache.update(k, v) with S_new = 3, then again with S_new = 1:
    cache.seq_len == 4.
    """

    def __init__(self):
        ### BEGIN SOLUTION
        self.keys = None  # [B, H_kv, seq_len, d] once something is cached
        self.values = None
        ### END SOLUTION

    @property
    def seq_len(self):
        ### BEGIN SOLUTION
        return 0 if self.keys is None else self.keys.shape[2]
        ### END SOLUTION

    def update(self, k, v):
        ### BEGIN SOLUTION
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=2)  # append along the sequence axis
            self.values = torch.cat([self.values, v], dim=2)
        return self.keys, self.values
        ### END SOLUTION


# %% test="test_KVCache" points=2
"""KVCache: starts empty; update appends along the sequence axis, returns all K/V; independent."""
from attention_lab.checks.llama_attention import check_kv_cache

check_kv_cache(KVCache)
### BEGIN HIDDEN TESTS
check_kv_cache(KVCache, seed=6101, device="cpu")
### END HIDDEN TESTS

# %%
demo_cache = KVCache()
for new_tokens in (3, 1, 1):
    new_k = torch.randn(B, H_kv, new_tokens, d_head)
    new_v = torch.randn(B, H_kv, new_tokens, d_head)
    k_all, v_all = demo_cache.update(new_k, new_v)
    print(f"appended {new_tokens}: seq_len {demo_cache.seq_len}, k_all {tuple(k_all.shape)}")

# %% [markdown]
# ## 10. `LlamaAttention`, from scratch
#
# | step | operation | shape |
# | --- | --- | --- |
# | input | `hidden_states` | `[B, S, D]` |
# | projections + split | `q_proj`, `k_proj`, `v_proj`; `view`, `transpose` | q `[B, H, S, d]`, k, v `[B, H_kv, S, d]` |
# | positions | `position_ids`, default `past + arange(S)` | `[B, S]` |
# | RoPE (q and k only) | `apply_rope` | unchanged |
# | QK norm (if `use_qk_norm`) | `qk_norm(·, rms_norm_eps)` | unchanged |
# | cache (if given) | `k, v = kv_cache.update(k, v)` | k, v `[B, H_kv, past + S, d]` |
# | GQA | `repeat_kv(·, n_rep)` | k, v `[B, H, past + S, d]` |
# | scores, mask, softmax | `q @ kᵀ / sqrt(d)`, rows `past…` of `causal_mask(past + S)` | `[B, H, S, past + S]` |
# | weighted sum, merge | `weights @ v`; `transpose`, `reshape` | `[B, S, H·d]` |
# | output projection | `o_proj` | `[B, S, D]` |
#
# Notes on the details, several of which the study notes get wrong:
# * merge the heads to `H·head_dim` (not `hidden_size`: they differ in general);
# * scale by `1/sqrt(head_dim)`; run the softmax in at least float32 (it matters for half
#   precision: `torch.softmax(scores, dim=-1, dtype=...)`), then cast back;
# * don't forget `o_proj`;
# * store the RoPE table as a plain attribute built with `rope_frequencies`, not as a buffer:
#   `model.to(torch.float64)` casts *complex* buffers to real, dropping the sines (PyTorch
#   warns "Casting complex values to real discards the imaginary part"). `apply_rope` moves it
#   to the right device.
#
# From scratch: no `F.scaled_dot_product_attention`, no `F.rms_norm`; use your functions.

# %% [markdown]
# ### Exercise 5.12 — LlamaAttention (7 pts, ~25 min)
#
# `LlamaAttention(config)` with attributes `q_proj, k_proj, v_proj, o_proj` (`nn.Linear`, bias
# per `config.attention_bias`). `forward(hidden_states, position_ids=None, kv_cache=None)`
# returns `[B, S, hidden_size]`, or `(out, kv_cache)` when a cache is given.

# %% answer="LlamaAttention"
class LlamaAttention(nn.Module):
    """Llama attention: GQA + RoPE (Meta layout) + optional QK norm + causal attention + KV cache.

    forward(hidden_states [B, S, D], position_ids [B, S] or None, kv_cache or None)
    -> out [B, S, D], or (out, kv_cache) when kv_cache is given.
    Default position_ids: kv_cache.seq_len + arange(S) (0 ... S-1 without a cache).

    Example: LlamaAttention(LlamaAttentionConfig())(torch.randn(2, 10, 128)).shape == (2, 10, 128)
    """

    def __init__(self, config):
        super().__init__()
        ### BEGIN SOLUTION
        if config.num_attention_heads % config.num_key_value_heads != 0:
            raise ValueError(f"num_attention_heads = {config.num_attention_heads} is not a "
                             f"multiple of num_key_value_heads = {config.num_key_value_heads}")
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.n_rep = self.num_heads // self.num_kv_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        # A plain attribute, not a buffer: Module.to(dtype) would cast a complex buffer to real.
        self.freqs_cis = rope_frequencies(self.head_dim, config.max_position_embeddings,
                                          config.rope_theta)
        ### END SOLUTION

    def forward(self, hidden_states, position_ids=None, kv_cache=None):
        ### BEGIN SOLUTION
        batch, seq_len, _ = hidden_states.shape
        device = hidden_states.device
        past = 0 if kv_cache is None else kv_cache.seq_len  # tokens already cached
        if position_ids is None:
            positions = past + torch.arange(seq_len, device=device)
            position_ids = positions.expand(batch, seq_len)  # [B, S]
        d, h, h_kv = self.head_dim, self.num_heads, self.num_kv_heads
        q = self.q_proj(hidden_states).view(batch, seq_len, h, d).transpose(1, 2)  # [B, H, S, d]
        k = self.k_proj(hidden_states).view(batch, seq_len, h_kv, d).transpose(1, 2)  # H_kv heads
        v = self.v_proj(hidden_states).view(batch, seq_len, h_kv, d).transpose(1, 2)
        q = apply_rope(q, self.freqs_cis, position_ids)  # [B, H, S, d]; V is not rotated
        k = apply_rope(k, self.freqs_cis, position_ids)  # [B, H_kv, S, d]
        if self.config.use_qk_norm:
            q = qk_norm(q, self.config.rms_norm_eps)
            k = qk_norm(k, self.config.rms_norm_eps)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)  # [B, H_kv, past + S, d]
        k = repeat_kv(k, self.n_rep)  # [B, H, past + S, d]
        v = repeat_kv(v, self.n_rep)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # [B, H, S, past + S]
        # [S, past + S]: new token i is token past + i
        mask = causal_mask(past + seq_len, device=device)[past:]
        scores = scores.masked_fill(~mask, float("-inf"))
        softmax_dtype = torch.promote_types(scores.dtype, torch.float32)
        weights = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(q.dtype)
        context = (weights @ v).transpose(1, 2).reshape(batch, seq_len, h * d)  # [B, S, H·d]
        out = self.o_proj(context)  # [B, S, D]
        return out if kv_cache is None else (out, kv_cache)
        ### END SOLUTION


# %% test="test_LlamaAttention" points=4
"""LlamaAttention: equals SDPA on the same q/k/v + o_proj; H_kv == H is MHA; from scratch."""
from attention_lab.checks.llama_attention import check_llama_attention

check_llama_attention(LlamaAttention)
### BEGIN HIDDEN TESTS
check_llama_attention(LlamaAttention, seed=6201, device="cpu")
### END HIDDEN TESTS

# %%
demo_layer = LlamaAttention(LlamaAttentionConfig()).to(device)
with torch.no_grad():
    print("out:", tuple(demo_layer(hidden_states).shape))

# %% [markdown]
# **Check it yourself against PyTorch.** Feed the same projected, rotated, normed q/k/v to
# `F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)` (which repeats the
# K/V heads consecutively, like `repeat_kv`) and apply `o_proj`: the result is your module's.

# %%
demo_layer = LlamaAttention(LlamaAttentionConfig()).to(device)
x = torch.randn(B, S, hidden_size, device=device)
ids = torch.arange(S, device=device).expand(B, S)
with torch.no_grad():
    table = rope_frequencies(d_head, 64)
    q_ = demo_layer.q_proj(x).view(B, S, H, d_head).transpose(1, 2)
    k_ = demo_layer.k_proj(x).view(B, S, H_kv, d_head).transpose(1, 2)
    q_ = qk_norm(apply_rope(q_, table, ids), rms_norm_eps)
    k_ = qk_norm(apply_rope(k_, table, ids), rms_norm_eps)
    v_ = demo_layer.v_proj(x).view(B, S, H_kv, d_head).transpose(1, 2)
    core = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=True)  # [B,H,S,d]
    reference = demo_layer.o_proj(core.transpose(1, 2).reshape(B, S, H * d_head))
    print("max difference from PyTorch's SDPA:", float((demo_layer(x) - reference).abs().max()))

# %% [markdown]
# **Look at it.** One heatmap per query head of an *untrained* layer (random weights), rows =
# KV groups. Do not look for meaning in the patterns: with random weights there is none. Look
# at the structure: the upper triangle is blank in every head (the causal mask), and the four
# heads of a row read the same keys and values yet attend differently, because each has its own
# queries. Pick one group to see its heads larger.

# %%
from attention_lab.widgets.rope import kv_group_heatmaps


def llama_attention_weights(module, cfg, hidden_states):
    """The per-head attention weights [B, H, S, S] of `module` built from config `cfg` (no cache),
    computed with your functions."""
    num_sequences, length, _ = hidden_states.shape
    ids = torch.arange(length, device=hidden_states.device).expand(num_sequences, length)
    table = rope_frequencies(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = module.q_proj(hidden_states).view(num_sequences, length, heads, d).transpose(1, 2)
    k = module.k_proj(hidden_states).view(num_sequences, length, kv_heads, d).transpose(1, 2)
    q, k = apply_rope(q, table, ids), apply_rope(k, table, ids)
    if cfg.use_qk_norm:
        q, k = qk_norm(q, cfg.rms_norm_eps), qk_norm(k, cfg.rms_norm_eps)
    k = repeat_kv(k, cfg.num_attention_heads // cfg.num_key_value_heads)
    scores = q @ k.transpose(-2, -1) / math.sqrt(cfg.head_dim)
    scores = scores.masked_fill(~causal_mask(length, hidden_states.device), float("-inf"))
    return torch.softmax(scores, dim=-1)


tokens = ["the", "cat", "sat", "on", "the", "mat", "and", "purred"]
torch.manual_seed(0)
demo_config = LlamaAttentionConfig()
demo_attention = LlamaAttention(demo_config).to(device)
with torch.no_grad():
    demo_input = torch.randn(1, len(tokens), hidden_size, device=device) * 3
    demo_weights = llama_attention_weights(demo_attention, demo_config, demo_input)
kv_group_heatmaps(demo_weights[0], demo_config.num_key_value_heads, tokens)

# %% [markdown]
# ### Decoding with the cache
#
# Prefill the prompt in one call, then feed one token at a time: every step's output must
# equal that token's output in one full causal pass over the whole sequence.

# %%
demo_layer = LlamaAttention(LlamaAttentionConfig()).to(device)
sequence = torch.randn(1, 8, hidden_size, device=device)
with torch.no_grad():
    full_pass = demo_layer(sequence)  # one causal pass over all 8 tokens
    demo_cache = KVCache()
    prefill, demo_cache = demo_layer(sequence[:, :5], kv_cache=demo_cache)  # the prompt: tokens 0-4
    steps = [prefill]
    for t in range(5, 8):  # then one token at a time
        step, demo_cache = demo_layer(sequence[:, t:t + 1], kv_cache=demo_cache)
        steps.append(step)
print("cached tokens:", demo_cache.seq_len, "| max difference from the full pass:",
      float((torch.cat(steps, dim=1) - full_pass).abs().max()))

# %% test="test_LlamaAttention_kv_cache" points=3
"""LlamaAttention with a KV cache: prefill then token-by-token or chunks equal one causal pass."""
from attention_lab.checks.llama_attention import check_llama_attention_kv_cache

check_llama_attention_kv_cache(LlamaAttention, KVCache)
### BEGIN HIDDEN TESTS
check_llama_attention_kv_cache(LlamaAttention, KVCache, seed=6301, device="cpu")
### END HIDDEN TESTS

# %% [markdown]
# ## 11. How inference engines do it
#
# A `KVCache` that grows by `torch.cat` allocates a new tensor at every step and copies the
# whole cache into it, so generating `S` tokens copies `O(S²)` numbers. Inference engines
# instead **preallocate** the cache once, `[B, H_kv, max_len, d]`, and write each step's keys
# and values in place at their positions, `cache_position` (Hugging Face's `StaticCache`). The
# storage never moves or grows; `StaticCache` even runs attention over all `max_len` slots,
# masking the empty ones, so every step has the same shapes — what CUDA graphs and
# `torch.compile` need. The class below writes in place but returns only the filled part, with
# the same interface as your `KVCache`, so your `LlamaAttention` runs on it unchanged.
#
# Reserving `max_len` for every sequence wastes what short sequences never fill. vLLM's
# **PagedAttention** does the opposite: it hands out fixed-size blocks of cache *on demand*, as
# a sequence grows, and finds them through a per-sequence **block table** — no sequence reserves
# more than one partly filled block. Notebook 07 builds it.

# %%
class PreallocatedKVCache:
    """A KV cache allocated once; update writes the new keys/values at cache_position in place."""

    def __init__(self, batch_size, num_kv_heads, max_len, head_dim, dtype=torch.float32,
                 device=None):
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.filled = 0  # positions 0 ... filled - 1 hold real tokens

    @property
    def seq_len(self):
        return self.filled

    def update(self, k, v):
        # Where the new tokens go:
        cache_position = torch.arange(self.filled, self.filled + k.shape[2], device=k.device)
        self.keys.index_copy_(2, cache_position, k)  # [B, H_kv, max_len, d], written in place
        self.values.index_copy_(2, cache_position, v)
        self.filled += k.shape[2]
        return self.keys[:, :, :self.filled], self.values[:, :, :self.filled]  # views: no copy


demo_layer = LlamaAttention(LlamaAttentionConfig()).to(device)
with torch.no_grad():
    full_pass = demo_layer(sequence)  # one causal pass over the 8 tokens of the cell above
    static_cache = PreallocatedKVCache(1, H_kv, 16, d_head, device=device)  # room for 16 tokens
    prefill, static_cache = demo_layer(sequence[:, :5], kv_cache=static_cache)
    steps = [prefill] + [demo_layer(sequence[:, t:t + 1], kv_cache=static_cache)[0]
                         for t in range(5, 8)]
print("preallocated cache: max difference from the full pass:",
      float((torch.cat(steps, dim=1) - full_pass).abs().max()))

# %% [markdown]
# Engines also call a fused kernel — `F.scaled_dot_product_attention` or FlashAttention —
# rather than writing the softmax out, and here is a trap: the libraries do not agree on what
# "causal" means when there are fewer queries than keys. PyTorch's SDPA with `is_causal=True`
# builds the causal mask **aligned to the top left**: query `i` sees keys `0 … i`.
# (flash-attn's `flash_attn_func(..., causal=True)` did the same before its version 2.1 and
# aligns to the bottom right since then.) That is right only when the
# queries and keys are the same tokens (`q_len == kv_len`). In a decoding step, the single new
# query is the *last* of `kv_len` tokens and must see all of them; with `is_causal=True` it sees
# key 0 only, and nothing fails — the output is just wrong:

# %%
with torch.no_grad():
    q_new = torch.randn(1, H, 1, d_head, device=device)  # one new query (the 6th token) ...
    k_all = torch.randn(1, H, 6, d_head, device=device)  # ... 6 keys
    v_all = torch.randn(1, H, 6, d_head, device=device)
    top_left = F.scaled_dot_product_attention(q_new, k_all, v_all, is_causal=True)
    # The last token may see all 6 keys:
    sees_everything = F.scaled_dot_product_attention(q_new, k_all, v_all)
    sees_key_0 = F.scaled_dot_product_attention(q_new, k_all[:, :, :1], v_all[:, :, :1])
print("is_causal=True vs the right answer:", float((top_left - sees_everything).abs().max()),
      "| vs attending to key 0 only:", float((top_left - sees_key_0).abs().max()))

# %% [markdown]
# The right mask for `q_len` new queries after `kv_len - q_len` cached tokens is aligned to the
# **bottom right**: new query `i` is token `kv_len - q_len + i`, so it may see keys
# `0 … kv_len - q_len + i`. (That is rows `kv_len - q_len …` of `causal_mask(kv_len)`, what your
# `LlamaAttention` uses; PyTorch also ships it as `torch.nn.attention.bias.causal_lower_right`.)

# %% [markdown]
# ### Exercise 5.13 — causal_mask_lower_right (2 pts, ~8 min)
#
# Return the `[q_len, kv_len]` boolean mask, True where query `i` may attend to key `j`, i.e.
# `j <= i + (kv_len - q_len)`, created on `device`. The queries are the *last* `q_len` of the
# `kv_len` tokens, so `q_len > kv_len` is impossible: raise a `ValueError` that names both
# numbers. With `q_len == kv_len` it is `causal_mask(kv_len)`. (Notebook 06 uses the same
# bottom-right alignment and allows `q_len > kv_len` — it happens with a cache truncated on the
# left — where the first `q_len − kv_len` queries see no key at all: rows every function there
# must handle. Here the new queries always come after the whole cache, so it cannot happen.)

# %% answer="causal_mask_lower_right"
def causal_mask_lower_right(q_len, kv_len, device=None):
    """Causal mask for the last q_len of kv_len tokens: True where query i may attend to key j.

    returns: BoolTensor [q_len, kv_len] on device, True where j <= i + (kv_len - q_len).

    Example: causal_mask_lower_right(2, 4).int() == [[1, 1, 1, 0], [1, 1, 1, 1]];
    causal_mask_lower_right(1, 5) is all True; causal_mask_lower_right(3, 2) raises ValueError.
    """
    ### BEGIN SOLUTION
    if q_len > kv_len:
        raise ValueError(f"q_len = {q_len} queries cannot be the last tokens of only "
                         f"kv_len = {kv_len} keys")
    offset = kv_len - q_len  # tokens before the first query
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(diagonal=offset)
    ### END SOLUTION


# %% test="test_causal_mask_lower_right" points=2
"""causal_mask_lower_right: True where j <= i + kv_len - q_len; chunks = one pass; ValueError."""
from attention_lab.checks.llama_attention import check_causal_mask_lower_right

check_causal_mask_lower_right(causal_mask_lower_right)
### BEGIN HIDDEN TESTS
check_causal_mask_lower_right(causal_mask_lower_right, seed=6351, device="cpu")
### END HIDDEN TESTS

# %%
print(causal_mask_lower_right(2, 5).int())
with torch.no_grad():
    fixed = F.scaled_dot_product_attention(q_new, k_all, v_all,
                                           attn_mask=causal_mask_lower_right(1, 6, device))
print("with the lower-right mask vs the right answer:",
      float((fixed - sees_everything).abs().max()))

# %% [markdown]
# ## 12. What GQA saves: the size of the KV cache
#
# What does the cache hold? Go through section 9 again: at every layer, for every token of every
# sequence in the batch, the keys and the values that `LlamaAttention` hands to
# `kv_cache.update` — one vector of `head_dim` numbers per *KV* head (not per query head: GQA
# caches the shared heads only), each number stored in `bytes_per_element` bytes.
#
# The cache grows with the context length and the batch, and for long contexts it, not the
# weights, is what fills the GPU. GQA divides it by `n_rep`.

# %% [markdown]
# ### Exercise 5.14 — kv_cache_bytes (1 pt, ~3 min)
#
# Count the bytes of everything the cache holds, from the description above: multiply up what
# one cached number is repeated over.

# %% answer="kv_cache_bytes"
def kv_cache_bytes(num_layers, num_kv_heads, head_dim, seq_len, batch_size, bytes_per_element):
    """Bytes of a KV cache: keys and values for every layer, KV head, token and sequence.

    Example: kv_cache_bytes(1, 1, 4, 10, 1, 2) == 160
    """
    ### BEGIN SOLUTION
    return 2 * num_layers * num_kv_heads * head_dim * seq_len * batch_size * bytes_per_element
    ### END SOLUTION


# %% test="test_kv_cache_bytes" points=1
"""kv_cache_bytes: the bytes of every layer's cached keys and values, as an int."""
from attention_lab.checks.llama_attention import check_kv_cache_bytes

check_kv_cache_bytes(kv_cache_bytes)
### BEGIN HIDDEN TESTS
check_kv_cache_bytes(kv_cache_bytes, seed=6401)
### END HIDDEN TESTS

# %% [markdown]
# Two published configurations (their `config.json` on the Hugging Face Hub,
# `meta-llama/Llama-2-7b-hf` and `meta-llama/Meta-Llama-3-8B`):
#
# | model | layers `L` | `H` | `H_kv` | `head_dim` | context |
# | --- | --- | --- | --- | --- | --- |
# | Llama-2-7B | 32 | 32 | 32 (MHA) | 128 | 4,096 |
# | Llama-3-8B | 32 | 32 | 8 (GQA, `n_rep` = 4) | 128 | 8,192 |
#
# in 16-bit precision (2 bytes per element):

# %%
GiB = 2**30
models = {"Llama-2-7B (MHA)": dict(num_layers=32, num_kv_heads=32, head_dim=128),
          "Llama-3-8B (GQA)": dict(num_layers=32, num_kv_heads=8, head_dim=128)}
for name, shape in models.items():
    per_token = kv_cache_bytes(**shape, seq_len=1, batch_size=1, bytes_per_element=2)
    one_sequence = kv_cache_bytes(**shape, seq_len=4096, batch_size=1, bytes_per_element=2)
    batch_32 = kv_cache_bytes(**shape, seq_len=4096, batch_size=32, bytes_per_element=2)
    print(f"{name}: {per_token / 2**10:.0f} KiB per token "
          f"| 4,096 tokens: {one_sequence / GiB:.1f} GiB "
          f"| 32 sequences of 4,096: {batch_32 / GiB:.0f} GiB")

# %% [markdown]
# With the same 32 layers of 32 query heads of 128, Llama-3-8B's cache is a quarter of
# Llama-2-7B's: 128 KiB instead of 512 KiB per token; at Llama-2's full context of 4,096 tokens,
# 0.5 GiB instead of 2 GiB per sequence, and for a batch of 32 such sequences 16 GiB instead of
# 64 GiB.

# %% [markdown]
# ### Exercise 5.15 — what GQA saves, in your words (2 pts, ~5 min)
#
# Llama-3-8B's GQA makes its KV cache 4× smaller than with 32 KV heads, yet it removes only about
# a tenth of each layer's weights. Explain both numbers in a few sentences: which weights GQA
# shrinks and which it leaves alone, and why the cache, not the parameter count, is what matters
# when serving the model. (Llama-3-8B per layer: `D = 4096`, 32 query heads and 8 KV heads of
# 128, an MLP of three `4096 × 14336` matrices.)

# %% [markdown] manual="gqa_memory_vs_parameters" points=2
# GQA shrinks only `k_proj` and `v_proj`: from `D × H·d = 4096 × 4096` to `D × H_kv·d =
# 4096 × 1024` each. `q_proj` and `o_proj` keep all 32 heads, and the MLP (3 · 4096 · 14336 ≈
# 176M weights) is untouched. Per layer: MHA attention 4 · 4096² ≈ 67M weights, GQA ≈ 42M, so the
# layer goes from ≈ 243M to ≈ 218M weights — about 10% fewer.
#
# The KV cache, by contrast, holds *only* keys and values, `2 · L · H_kv · d · S · B` numbers,
# so it scales with `H_kv` and shrinks by `n_rep = 4`. It also grows with the context length and
# the batch while the weights do not: at 32 sequences of 4,096 tokens it is 64 GiB with 32 KV
# heads and 16 GiB with 8 — about as much as the ≈ 15 GiB of 16-bit weights, and the gap widens
# with every longer context or larger batch. What fits on the GPU — how many sequences, how long
# — is set by the cache. Each decoding step reads every weight matrix (the input embedding
# only row by row) and every sequence's whole cache, so the smaller cache also cuts the memory
# traffic per step, by much less than 4× for a single sequence of 4,096 tokens (1.21×, of which
# the cache alone 1.10× and the smaller k/v weights the rest: the weights dominate) and
# approaching 4× as the cache grows (2.65× at 32 × 4,096 tokens).

# %% [markdown]
# **The measurement behind your answer.** How does the cache compare with the weights? The cell
# below counts them from the same configs (plus each model's MLP width and vocabulary; the input
# embedding and the output head are separate matrices in both), and — since a decoding step
# reads every weight matrix once (shared by the whole batch; the input embedding is a lookup
# that reads one row per sequence, so it is left out) and every sequence's whole cache — the
# bytes one step reads with 8 KV heads and with 32. A model with 32 KV heads also has 4× larger
# `k_proj` and `v_proj`, so the saving has two parts; the last lines take them apart:

# %%
def decoder_parameters(layers, hidden, heads, kv_heads, head_dim, mlp_width, vocab):
    """Weights of a Llama-style decoder: attention, gated MLP (3 matrices), 2 RMSNorms a layer."""
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    per_layer = attention + 3 * hidden * mlp_width + 2 * hidden
    return layers * per_layer + hidden + 2 * vocab * hidden  # + final norm, embedding, output head


llama2 = dict(layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128, mlp_width=11008,
              vocab=32000)
llama3 = dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, mlp_width=14336,
              vocab=128256)
llama3_mha = {**llama3, "kv_heads": 32}  # the same model with one KV head per query head
cache_args = dict(seq_len=4096, bytes_per_element=2)
for name, cfg in (("Llama-2-7B (MHA)", llama2), ("Llama-3-8B (GQA)", llama3)):
    weight_bytes = 2 * decoder_parameters(**cfg)
    cache = kv_cache_bytes(cfg["layers"], cfg["kv_heads"], cfg["head_dim"], batch_size=32,
                           **cache_args)
    print(f"{name}: weights {weight_bytes / GiB:.1f} GiB; cache of 32 × 4,096 tokens "
          f"{cache / GiB:.0f} GiB = {cache / weight_bytes:.2f} × the weights")


def bytes_read_per_step(cfg, batch_size):
    """Weights (all but the input embedding: one row per sequence is read) + every cache."""
    weights = 2 * (decoder_parameters(**cfg) - cfg["vocab"] * cfg["hidden"])
    cache = kv_cache_bytes(cfg["layers"], cfg["kv_heads"], cfg["head_dim"], batch_size=batch_size,
                           **cache_args)
    return weights + cache


for batch_size in (1, 32):
    gqa, mha = bytes_read_per_step(llama3, batch_size), bytes_read_per_step(llama3_mha, batch_size)
    print(f"Llama-3-8B, one decoding step at 4,096 tokens, batch {batch_size:>2}: "
          f"reads {gqa / GiB:.1f} GiB "
          f"with 8 KV heads, {mha / GiB:.1f} GiB with 32: {mha / gqa:.2f}× less traffic, not 4×")
    gqa_cache, mha_cache = (kv_cache_bytes(32, heads, 128, batch_size=batch_size, **cache_args)
                            for heads in (8, 32))
    cache_only = (gqa - gqa_cache + mha_cache) / gqa  # GQA's weights, MHA's cache
    print(f"    of which the smaller cache alone: {cache_only:.2f}×; "
          "the rest is the smaller k/v weights")

# %% [markdown]
# At 32 sequences of 4,096 tokens, Llama-2-7B's 64 GiB of cache is five times its own weights
# and Llama-3-8B's 16 GiB is about as much as its weights (1.07×); at one sequence the cache is
# a small fraction of either. And the 4× smaller cache does *not* make a decoding step read 4×
# fewer bytes: the weights are read at every step too, so with one sequence of 4,096 tokens the
# saving is 1.21× — and half of that is not the cache at all: the smaller cache alone saves
# 1.10×, the smaller `k_proj`/`v_proj` the rest (1.5 GiB less of weights, as much as the cache
# saves). The saving grows towards 4× only as the batch and the context make the cache dominate
# (2.65× at 32 sequences of 4,096 tokens, 2.60× from the cache alone). That is the point of GQA — more and longer sequences per GPU
# at a small cost in quality, since four query heads now share each key/value head.

# %% [markdown]
# ## What you built
#
# * `apply_rope` (Meta: adjacent pairs as complex numbers) and `apply_rope_rotate_half`
#   (Hugging Face: the two halves): the same rotations up to the feature order
#   `[0, 2, 4, …, 1, 3, 5, …]`, which converted checkpoints bake into the rows of W_q and W_k.
#   RoPE preserves norms and makes q·k depend only on the offset.
# * `qk_norm`: weightless RMS normalisation (output norm `sqrt(d_head)`), not L2.
# * `repeat_kv`: consecutive grouping, head `h` reads KV head `h // n_rep`.
# * `LlamaAttention`: equal to PyTorch's SDPA with `is_causal=True, enable_gqa=True`, equal to
#   plain MHA when `H_kv = H`, and — with `KVCache` — equal to itself when decoding token by token.
# * `causal_mask_lower_right`: the mask for new queries after a cache, which `is_causal=True`
#   (aligned top left) does not give when `q_len != kv_len`.
# * `kv_cache_bytes`: why GQA exists.
#
# Next: notebook 06 looks at the cost of the `[S, S]` attention table itself.
