# %% [markdown]
# # 06 — Efficient attention: from the S×S table to a FlashAttention kernel
#
# Every notebook so far built the `[S, S]` table of scores and softmaxed it. That table is what
# limits the context length of a Transformer. Here you will measure it, then remove it step by
# step: query chunks, the online softmax, FlashAttention's tiled forward and backward passes in
# PyTorch. Then you count why a fused kernel is faster, and write the forward pass as a Triton
# GPU kernel, which is checked on the CPU by Triton's interpreter and runs natively on a CUDA
# GPU (Colab).
#
# **27 points, about 156 minutes.** Then a **challenge part** for those who will write GPU
# kernels — the backward pass as Triton kernels, section 9: **4 points, about 38 minutes.**
#
# **Notation**: `B` batch, `H` heads, `S_q` query tokens, `S_k` key/value tokens, `d` the
# per-head width. q is `[B, H, S_q, d]`, k and v are `[B, H, S_k, d]`. **Masks** are boolean
# with **True = may attend**.
#
# **Causal, everywhere in this notebook**: query `i` sees keys `j ≤ i + (S_k − S_q)`. The
# triangle is aligned to the *bottom-right* corner, as in KV-cache decoding (notebook 05): the
# last query sees every key. When `S_q = S_k` it is the usual lower triangle. With *more* queries
# than keys, the first `S_q − S_k` queries see no key at all, and every function here gives them
# what `F.scaled_dot_product_attention` gives them with the same boolean mask: an output row of
# **0**, `lse = −inf` (the log of an empty sum, as `torch.logsumexp` says), and no gradient
# (their `dq` row is 0 and they add nothing to `dk`, `dv`). Measured in PyTorch 2.13: SDPA with
# that mask returns 0 for those rows, and autograd through it gives 0. A naive softmax gives NaN
# instead (`exp(−inf − (−inf))` and `0 / 0`); a finite fill such as `−1e9` gives the mean of all
# the values. The checks give such queries to every function with `causal` and name both
# mistakes. Production kernels guard these rows too, for padded batches and left-truncated
# caches: flash-attn's CUDA kernels divide by 1 where the running sum is 0, so the output row is
# 0 — but they store `lse = +∞` for it, not `−∞`, so that the backward's `P = exp(s − lse)` is 0
# without a special case, and `−∞` only in the partial results of a split pass, the value that
# gives a part no weight when parts are merged (section 5). This notebook stores `−∞`, as
# `torch.logsumexp` does, and guards the backward instead. (SDPA's own `is_causal=True` aligns
# the triangle *top-left*, `j ≤ i`, so with `S_q > S_k` every query sees key 0 there: this
# notebook passes it an explicit mask instead, or `torch.nn.attention.bias.causal_lower_right`.)
#
# **Precision**: your functions may compute in float32 inside even when they are given float64;
# the checks then accept float32 accuracy and print a one-line note. (FlashAttention on a GPU
# takes float16 or bfloat16 inputs and *accumulates* in float32: its matrix products sum in
# float32 and its softmax statistics are float32. The PyTorch versions here go one step further
# and compute every tile in float32.)

# %%
import math

import torch
import torch.nn.functional as F

# %% [markdown]
# ## 1. How big is the score table?
#
# For one layer, every head of every sequence of the batch computes the scores `q·kᵀ` of its
# own queries against its own keys. Notebook 05 computed the KV cache, which grows like `S`.
# How does the score table grow?

# %% [markdown]
# ### Exercise 6.1 — attention_matrix_bytes (1 pt, ~3 min)
#
# Return the number of bytes of one layer's score table (self-attention, `S` tokens), as an
# `int`. Work it out from the shapes: q and k are `[B, H, S, d]`; what is the shape of
# `q @ k.transpose(-2, -1)`, and how many bytes does each of its numbers take?

# %% answer="attention_matrix_bytes"
def attention_matrix_bytes(batch_size, num_heads, seq_len, bytes_per_element):
    """Bytes of one layer's score table for batch_size sequences of seq_len tokens, num_heads heads.

    Example: attention_matrix_bytes(1, 2, 3, 4) == 72
    """
    ### BEGIN SOLUTION
    return batch_size * num_heads * seq_len * seq_len * bytes_per_element
    ### END SOLUTION


# %% test="test_attention_matrix_bytes" points=1
"""attention_matrix_bytes: B·H·S²·bytes, as an int."""
from attention_lab.checks.efficient_attention import check_attention_matrix_bytes

check_attention_matrix_bytes(attention_matrix_bytes)
### BEGIN HIDDEN TESTS
check_attention_matrix_bytes(attention_matrix_bytes, seed=6101)
### END HIDDEN TESTS

# %% [markdown]
# Llama-3-8B (its `config.json` on the Hugging Face Hub): 32 layers, 32 query heads and 8
# key/value heads of 128, in 16-bit precision. Its KV cache is notebook 05's
# `2 · L · H_kv · d · S · B · bytes`; the score table is one layer's, computed once per layer:

# %%
GiB = 2**30
layers, query_heads, kv_heads, head_size = 32, 32, 8, 128
for context in (8192, 131072):
    table = attention_matrix_bytes(batch_size=1, num_heads=query_heads, seq_len=context,
                                   bytes_per_element=2)
    kv_cache = 2 * layers * kv_heads * head_size * context * 1 * 2  # notebook 05's kv_cache_bytes
    print(f"S = {context:>7,}: score table of ONE layer {table / GiB:>8,.0f} GiB | "
          f"KV cache of all 32 layers "
          f"{kv_cache / GiB:>5,.0f} GiB")

# %% [markdown]
# At 8k tokens one layer's table (4 GiB) is already four times the whole KV cache (1 GiB); at
# 128k tokens it is 1,024 GiB — more than any GPU holds — while the cache is 16 GiB. Yet models
# serve 128k-token contexts: they never build the table. The rest of this notebook shows how.
#
# ## 2. Chunks of queries
#
# Each query row of the output needs only its own row of scores. So compute the rows
# `chunk_size` at a time: the largest intermediate is `[B, H, chunk_size, S_k]`, and the result
# is *exactly* the same attention.
#
# ```
# for each chunk of query rows [start, start + chunk_size):
#     scores = q_chunk @ kᵀ · scale            # [B, H, chunk, S_k]
#     (causal: hide keys j > i + S_k − S_q, with i the *global* query index)
#     out_chunk = softmax(scores) @ v          # [B, H, chunk, d]
# ```

# %% [markdown]
# ### Exercise 6.2 — chunked_attention (2 pts, ~10 min)
#
# Write `chunked_attention`. The scale is `1/sqrt(d)`. The last chunk is shorter when `S_q` is
# not a multiple of `chunk_size`. Build the causal mask for each chunk's rows only (a full
# `[S_q, S_k]` mask would be the very table we avoid). You may use `torch.softmax`, or
# `F.scaled_dot_product_attention` on a chunk with an explicit `attn_mask` (careful: its
# `is_causal=True` aligns the triangle to the chunk's top-left corner). A query that sees no
# key (causal, `S_q > S_k`) gets 0, as SDPA gives it.

# %% answer="chunked_attention"
def chunked_attention(q, k, v, chunk_size, causal=False):
    """Exact attention, computed chunk_size query rows at a time.

    q: [B, H, S_q, d], k and v: [B, H, S_k, d] -> [B, H, S_q, d].
    causal: query i sees keys j <= i + (S_k - S_q); a query that sees no key gets 0.
    Example: chunked_attention(q, k, v, 16) equals F.scaled_dot_product_attention(q, k, v).
    """
    ### BEGIN SOLUTION
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5
    outputs = []
    for start in range(0, seq_q, chunk_size):
        q_chunk = q[..., start:start + chunk_size, :]  # [B, H, c, d] (c < chunk_size at the end)
        scores = q_chunk @ k.transpose(-2, -1) * scale  # [B, H, c, S_k]
        if not causal:
            weights = scores.softmax(dim=-1)
        else:
            # the global query index of each row of the chunk
            rows = torch.arange(start, start + q_chunk.shape[-2], device=q.device)[:, None]
            cols = torch.arange(seq_k, device=q.device)[None, :]
            keep = cols <= rows + (seq_k - seq_q)  # [c, S_k]
            weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
            # a query that sees no key (S_q > S_k): softmax of -inf only is NaN; SDPA gives 0
            weights = weights.masked_fill(~keep.any(dim=-1, keepdim=True), 0.0)
        outputs.append(weights @ v)  # [B, H, c, d]
    return torch.cat(outputs, dim=-2)
    ### END SOLUTION


# %% test="test_chunked_attention" points=2
"""chunked_attention: equals SDPA; ragged last chunk; causal bottom-right; no [S_q, S_k]."""
from attention_lab.checks.efficient_attention import check_chunked_attention

check_chunked_attention(chunked_attention)
### BEGIN HIDDEN TESTS
check_chunked_attention(chunked_attention, seed=6201)
check_chunked_attention(chunked_attention, seed=6202, device="cpu")
### END HIDDEN TESTS

# %%
q_demo = torch.randn(1, 2, 50, 16, device=device)
k_demo, v_demo = torch.randn(1, 2, 70, 16, device=device), torch.randn(1, 2, 70, 16, device=device)
bottom_right = torch.ones(50, 70, dtype=torch.bool, device=device).tril(diagonal=70 - 50)
reference_out = F.scaled_dot_product_attention(q_demo, k_demo, v_demo, attn_mask=bottom_right)
print("chunked (chunk 16, causal) vs SDPA, max difference:",
      float((chunked_attention(q_demo, k_demo, v_demo, 16, causal=True) - reference_out)
            .abs().max()))

# %% [markdown]
# Chunking cuts the memory to `chunk/S` of the table, but each chunk still holds scores
# against *all* keys. To go further we must split the keys too — and the softmax of a row
# needs the whole row: its max (for stability) and its sum (to normalise). The next idea fixes
# that.
#
# ## 3. The online softmax
#
# A logsumexp, `log Σ e^{x_j}`, is computed stably as `m + log Σ e^{x_j − m}` with `m = max x`.
# It can also be computed in **one pass** over blocks of `x`: keep a running max `m` and a
# running sum `s` *relative to* `m`. When a block brings a larger max `m'`, the old sum is
# rescaled:
#
# $$m' = \max(m, \max x_{\text{blk}}), \qquad s' = s\,e^{m - m'} + \sum e^{x_{\text{blk}} - m'}.$$
#
# At the start `m = −∞` and `s = 0` (then `e^{m − m'} = 0`). Careful with a block of `−∞`
# entries while `m` is still `−∞`: `e^{−∞ − (−∞)}` is `NaN`. Exponentiate with a "safe" max
# (e.g. 0 where `m'` is `−∞`).

# %% [markdown]
# ### Exercise 6.3 — streaming_logsumexp (2 pts, ~10 min)
#
# Write the one-pass logsumexp over the last axis, reading `x` one block of `block_size` columns
# at a time (`x[..., start:start + block_size]`). It must equal `torch.logsumexp(x, dim=-1)`
# (not to be called), overflow neither at +1000 nor at −1000, and allow `−inf` entries (a row
# of only `−inf` gives `−inf`). The check watches that no operation reads a whole row at once.

# %% answer="streaming_logsumexp"
def streaming_logsumexp(x, block_size):
    """log Σ_j exp(x[..., j]) in one pass over blocks of block_size columns.

    x: [..., N] -> [...], same dtype and device.
    Example: streaming_logsumexp(torch.tensor([0.0, 0.0]), 1) == log(2)
    """
    ### BEGIN SOLUTION
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)  # running max
    s = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)  # running sum of e^(x - m)
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size]
        m_new = torch.maximum(m, block.amax(dim=-1))
        # rows still at -inf: exponentiate with 0, never -inf - -inf
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        s = s * torch.exp(m - safe) + torch.exp(block - safe[..., None]).sum(dim=-1)
        m = m_new
    return m + torch.log(s)
    ### END SOLUTION


# %% test="test_streaming_logsumexp" points=2
"""streaming_logsumexp: equals torch.logsumexp in one pass; stable at ±1000; -inf allowed."""
from attention_lab.checks.efficient_attention import check_streaming_logsumexp

check_streaming_logsumexp(streaming_logsumexp)
### BEGIN HIDDEN TESTS
check_streaming_logsumexp(streaming_logsumexp, seed=6301)
### END HIDDEN TESTS

# %%
row = torch.tensor([[1000.0, 999.0, -5.0, 1001.0], [float("-inf"), 0.0, 0.0, float("-inf")]],
                   device=device)
print("streaming:", streaming_logsumexp(row, 2).tolist(),
      "| torch.logsumexp:", torch.logsumexp(row, dim=-1).tolist())

# %% [markdown]
# The same trick carries the softmax-weighted sum of the values. For a block of scores
# `S_blk` (`[..., S_q, block]`) and its values `V_blk` (`[..., block, d]`), keep per query row
# the running max `m`, the running sum `l` and the unnormalised output `acc`:
#
# $$m' = \max(m, \text{rowmax}\,S_{\text{blk}}),\quad
#   l' = l\,e^{m - m'} + \text{rowsum}\,e^{S_{\text{blk}} - m'},\quad
#   acc' = acc\,e^{m - m'} + e^{S_{\text{blk}} - m'}\,V_{\text{blk}}.$$
#
# After the last block, `out = acc / l` is exactly `softmax(S) @ V`, and `m + log l` is the
# row's logsumexp.

# %% [markdown]
# ### Exercise 6.4 — online_softmax_step (2 pts, ~10 min)
#
# One step of FlashAttention's inner loop. Shapes: `m, l: [..., S_q]`, `acc: [..., S_q, d]`,
# `scores_block: [..., S_q, block]`, `v_block: [..., block, d]`. Return the new `(m, l, acc)`
# with the same shapes and dtypes. Divide by `l` only at the very end, outside this step.

# %% answer="online_softmax_step"
def online_softmax_step(m, l, acc, scores_block, v_block):
    """Fold one block of scores and values into the running (m, l, acc).

    Starts from m = -inf, l = 0, acc = 0. Returns (m', l', acc').
    Example: from the start, one block gives m' = rowmax(S), l' = rowsum(e^(S - m')),
    acc' = e^(S - m') @ V, and acc' / l' = softmax(S) @ V.
    """
    ### BEGIN SOLUTION
    m_new = torch.maximum(m, scores_block.amax(dim=-1))  # [..., S_q]
    correction = torch.exp(m - m_new)  # e^(m - m'): 0 on the first block (m = -inf)
    p = torch.exp(scores_block - m_new[..., None])  # [..., S_q, block]
    l_new = l * correction + p.sum(dim=-1)
    acc_new = acc * correction[..., None] + p @ v_block  # [..., S_q, d]
    return m_new, l_new, acc_new
    ### END SOLUTION


# %% test="test_online_softmax_step" points=2
"""online_softmax_step: the update of m, l, acc; four steps equal softmax(S) @ V."""
from attention_lab.checks.efficient_attention import check_online_softmax_step

check_online_softmax_step(online_softmax_step)
### BEGIN HIDDEN TESTS
check_online_softmax_step(online_softmax_step, seed=6401)
### END HIDDEN TESTS

# %%
scores_demo = torch.randn(3, 8, device=device) * 3
values_demo = torch.randn(8, 5, device=device)
state = (torch.full((3,), float("-inf"), device=device), torch.zeros(3, device=device),
         torch.zeros(3, 5, device=device))
for start in range(0, 8, 3):  # blocks of 3, 3 and 2 keys
    state = online_softmax_step(*state, scores_demo[:, start:start + 3],
                                values_demo[start:start + 3])
m_demo, l_demo, acc_demo = state
print("online, block by block vs softmax(S) @ V, max difference:",
      float((acc_demo / l_demo[:, None] - torch.softmax(scores_demo, dim=-1) @ values_demo)
            .abs().max()))

# %% [markdown]
# **Find the bug.** Here is a draft of the step, as you may meet it. It runs, it is right on
# the first block — and wrong as soon as there are two. Run the cell: what is missing?

# %%
def draft_online_step(m, l, acc, scores_block, v_block):
    m_new = torch.maximum(m, scores_block.amax(dim=-1))
    p = torch.exp(scores_block - m_new[..., None])
    l_new = l * torch.exp(m - m_new) + p.sum(dim=-1)
    return m_new, l_new, acc + p @ v_block


for blocks in (1, 2):
    state = (torch.full((3,), float("-inf"), device=device), torch.zeros(3, device=device),
             torch.zeros(3, 5, device=device))
    width = 8 // blocks
    for start in range(0, 8, width):
        state = draft_online_step(*state, scores_demo[:, start:start + width],
                                  values_demo[start:start + width])
    reference = torch.softmax(scores_demo, dim=-1) @ values_demo
    error = float((state[2] / state[1][:, None] - reference).abs().max())
    print(f"{blocks} block(s) of {width} keys: max difference from softmax(S) @ V = {error:.2e}")

# %% [markdown]
# The draft rescales `l` but not `acc`. When a later block raises the max from `m` to `m'`, the
# terms already in `acc` were weighted by `e^{S − m}` and must be multiplied by `e^{m − m'}`
# like those in `l`; otherwise early keys get too much weight. (On one block there is nothing
# to rescale, so a test with a single block would not see the bug.)
#
# ## 4. FlashAttention's forward pass, in PyTorch
#
# Now tile both sides: for each block of `block_q` queries, loop over blocks of `block_k` keys,
# compute the `[block_q, block_k]` tile of scores, and fold it in with `online_softmax_step`.
# Only one tile of scores exists at a time.
#
# Queries outside, keys inside is **FlashAttention-2**'s order (Dao, 2023): each query block's
# `m`, `l` and `acc` stay in registers until its output is written once. The first
# FlashAttention (Dao et al., 2022) looped over key blocks outside and queries inside, so it
# read and rewrote every query block's partial output (and `m`, `l`) once per key block.
#
# ```
# for each query block rows [q_start, q_end):
#     m = −∞, l = 0, acc = 0                         # [B, H, bq], [B, H, bq], [B, H, bq, d]
#     for each key block [k_start, k_end) that some row may see:
#         S_blk = q_blk @ k_blkᵀ · scale              # [B, H, bq, bk]
#         causal: S_blk[i, j] = −∞ where j > i + (S_k − S_q)   (global indices)
#         m, l, acc = online_softmax_step(m, l, acc, S_blk, v_blk)
#     out_blk = acc / l ;  lse_blk = m + log l
# ```
#
# With `causal`, a key block whose *first* key is beyond the reach of the block's *last* query
# (`k_start > q_end − 1 + S_k − S_q`) holds nothing any of these queries may see: **skip it**,
# do not compute and mask it. That is where causal FlashAttention saves work — close to half at
# long sequences, not at short ones: with `n` blocks on each side it computes the `n(n+1)/2`
# tiles on and below the diagonal, out of `n²` — 10 of 16 in the explorer below (`n = 4`),
# 528 of 1,024 at `n = 32`. The explorer shows which tiles a causal pass computes:

# %%
from attention_lab.widgets.efficient_attention import block_map_explorer

block_map_explorer(seq_q=256, seq_k=256, block_q=64, block_k=64)

# %% [markdown]
# ### Exercise 6.5 — flash_attention_forward (4 pts, ~20 min)
#
# Write the tiled forward pass on top of your `online_softmax_step`. Return `(out, lse)`: `out`
# `[B, H, S_q, d]` in q's dtype, and `lse` `[B, H, S_q]`, the natural-log logsumexp of each row
# of *scaled, masked* scores (float32 or q's dtype). `scale` defaults to `1/sqrt(d)`. Compute in
# at least float32 (`torch.promote_types(q.dtype, torch.float32)`), so float16 input is safe.
# The last blocks may be shorter. A query that sees no key (causal, `S_q > S_k`) gets `out` 0
# and `lse = −inf`, as at the top of the notebook. The checks watch every operation your code
# runs: no tensor may be as wide as all the keys (neither `[S_q, S_k]` nor `[block_q, S_k]`),
# and with `causal` only the tiles on and below the diagonal may be computed (`n(n+1)/2` of
# `n²`).

# %% answer="flash_attention_forward"
def flash_attention_forward(q, k, v, block_q=64, block_k=64, causal=False, scale=None):
    """Tiled exact attention with the online softmax; never builds an [S_q, S_k] tensor.

    q: [B, H, S_q, d], k: [B, H, S_k, d], v: [B, H, S_k, d_v]
    -> out [B, H, S_q, d_v] (q's dtype), lse [B, H, S_q] (logsumexp of the scaled, masked scores).
    causal: query i sees keys j <= i + (S_k - S_q); key blocks no query of a block may see
    are skipped; a query that sees no key gets out 0 and lse -inf.
    Example: out equals F.scaled_dot_product_attention(q, k, v), for any block sizes.
    """
    ### BEGIN SOLUTION
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    compute = torch.promote_types(q.dtype, torch.float32)  # at least float32
    q_c, k_c, v_c = q.to(compute), k.to(compute), v.to(compute)
    offset = seq_k - seq_q  # causal: aligned bottom-right
    outs, lses = [], []
    for q_start in range(0, seq_q, block_q):
        q_block = q_c[..., q_start:q_start + block_q, :] * scale  # [B, H, bq, d]
        q_end = q_start + q_block.shape[-2]
        m = torch.full(q_block.shape[:-1], float("-inf"), dtype=compute,
                       device=q.device)  # [B, H, bq]
        l = torch.zeros_like(m)
        acc = torch.zeros(*q_block.shape[:-1], v.shape[-1], dtype=compute,
                          device=q.device)  # [B, H, bq, d_v]
        # causal: the keys after q_end - 1 + offset are seen by no query of this block
        k_stop = min(seq_k, q_end + offset) if causal else seq_k
        for k_start in range(0, k_stop, block_k):
            k_block = k_c[..., k_start:k_start + block_k, :]  # [B, H, bk, d]
            scores = q_block @ k_block.transpose(-2, -1)  # [B, H, bq, bk]
            if causal:
                rows = torch.arange(q_start, q_end, device=q.device)[:, None]
                cols = torch.arange(k_start, k_start + k_block.shape[-2], device=q.device)[None, :]
                scores = scores.masked_fill(cols > rows + offset, float("-inf"))
            v_block = v_c[..., k_start:k_start + block_k, :]
            m, l, acc = online_softmax_step(m, l, acc, scores, v_block)
        # A query that saw no key (causal, S_q > S_k) ends with l = 0 (NaN, if the step computed
        # exp(-inf - (-inf))): SDPA gives it out = 0, and its lse is -inf.
        seen = l > 0
        outs.append(torch.where(seen[..., None], acc / l[..., None], 0.0))
        lses.append(torch.where(seen, m + torch.log(l), float("-inf")))
    return torch.cat(outs, dim=-2).to(q.dtype), torch.cat(lses, dim=-1)
    ### END SOLUTION


# %% test="test_flash_attention_forward" points=2
"""flash_attention_forward: out equals SDPA, lse logsumexp; ragged; causal; any blocks."""
from attention_lab.checks.efficient_attention import check_flash_attention_forward

check_flash_attention_forward(flash_attention_forward)
### BEGIN HIDDEN TESTS
check_flash_attention_forward(flash_attention_forward, seed=6501)
### END HIDDEN TESTS

# %% test="test_flash_attention_forward_memory" points=2
"""flash_attention_forward: nothing as wide as all the keys; causal skips future blocks."""
from attention_lab.checks.efficient_attention import check_flash_attention_forward_memory

check_flash_attention_forward_memory(flash_attention_forward)
### BEGIN HIDDEN TESTS
check_flash_attention_forward_memory(flash_attention_forward, seed=6502)
### END HIDDEN TESTS

# %%
out_flash, lse_flash = flash_attention_forward(q_demo, k_demo, v_demo, block_q=16, block_k=32,
                                               causal=True)
scaled_scores = (q_demo @ k_demo.transpose(-2, -1) / 4.0).masked_fill(~bottom_right, float("-inf"))
print("out vs SDPA:", float((out_flash - reference_out).abs().max()),
      "| lse vs torch.logsumexp:",
      float((lse_flash - torch.logsumexp(scaled_scores, dim=-1)).abs().max()))
# More queries (6) than keys (3), causal: queries 0-2 see no key, and get 0 from both
q_more, k_few, v_few = torch.randn(1, 1, 6, 16), torch.randn(1, 1, 3, 16), torch.randn(1, 1, 3, 16)
no_key_mask = torch.ones(6, 3, dtype=torch.bool).tril(diagonal=3 - 6)
print("S_q > S_k, first value of each row, yours:",
      flash_attention_forward(q_more, k_few, v_few, causal=True)[0][0, 0, :, 0].round(decimals=2))
print("                                     SDPA:",
      F.scaled_dot_product_attention(q_more, k_few, v_few, attn_mask=no_key_mask)[0, 0, :, 0]
      .round(decimals=2))
print("              SDPA is_causal=True (top-left):",
      F.scaled_dot_product_attention(q_more, k_few, v_few, is_causal=True)[0, 0, :, 0]
      .round(decimals=2))

# %% [markdown]
# ## 5. Why return `lse`: merging attention over two halves of the keys
#
# Split the keys in two halves, `A` and `B` (two GPUs, or two chunks of a long KV cache). Each
# side computes its own attention `out_A, lse_A` and `out_B, lse_B`. The whole attention is
#
# $$\text{lse} = \log(e^{\text{lse}_A} + e^{\text{lse}_B}),\qquad
#   \text{out} = e^{\text{lse}_A - \text{lse}}\,\text{out}_A + e^{\text{lse}_B - \text{lse}}\,\text{out}_B,$$
#
# exactly. This is how split-KV decoding (FlashDecoding) and ring attention combine partial
# results, and why FlashAttention returns `lse` (its backward pass needs it too).

# %%
half = 35
out_a, lse_a = flash_attention_forward(q_demo, k_demo[:, :, :half], v_demo[:, :, :half],
                                       block_q=16, block_k=16)
out_b, lse_b = flash_attention_forward(q_demo, k_demo[:, :, half:], v_demo[:, :, half:],
                                       block_q=16, block_k=16)
lse_all = torch.logaddexp(lse_a, lse_b)
share_a, share_b = torch.exp(lse_a - lse_all)[..., None], torch.exp(lse_b - lse_all)[..., None]
merged = share_a * out_a + share_b * out_b
full_out = F.scaled_dot_product_attention(q_demo, k_demo, v_demo)
print("merged halves vs attention over all keys:", float((merged - full_out).abs().max()))
print("plain average of the halves vs all keys: ",
      float(((out_a + out_b) / 2 - full_out).abs().max()))

# %% [markdown]
# ### Exercise 6.6 — merging with lse, a written answer (2 pts, ~5 min)
#
# In two or three sentences: why is the plain average `(out_A + out_B) / 2` wrong, and what
# does `e^{lse_A − lse}` measure? Write your answer in the cell below.

# %% [markdown] manual="merge_with_lse" points=2
# `out_A` is a softmax-weighted average over the keys of A only, normalised by A's own sum
# `e^{lse_A} = Σ_{j∈A} e^{s_j}`; the true weights are normalised by the sum over *all* keys.
# `e^{lse_A − lse} = Σ_{A} e^{s_j} / Σ_{all} e^{s_j}` is the share of the total softmax mass
# that falls on A's keys, so the right combination weights each half by its share; the plain
# average gives each half weight ½ whatever its scores, which is right only when both halves
# carry equal mass.

# %% [markdown]
# ## 6. The backward pass
#
# Training needs `dQ, dK, dV` from `dO = ∂loss/∂out`. Autograd through the naive attention keeps
# the `[S_q, S_k]` weights `P` between the passes: exactly the table the forward pass avoided.
# FlashAttention keeps only `q, k, v, out` and the `lse` of each row, and *recomputes* `P`,
# one tile at a time, in the backward pass.
#
# **Derive it.** With `S = scale · q kᵀ`, `P = softmax(S)` row by row and `out = P V`:
#
# * `out` is linear in `V` and in `P`: `dV = Pᵀ dO` and `dP = dO Vᵀ`.
# * The softmax's vector-Jacobian product (notebook 02): `dS_ij = P_ij (dP_ij − Σ_l P_il dP_il)`.
#   The row sum `Σ_l P_il dP_il = Σ_l P_il (dO_i · v_l) = dO_i · out_i`: call it `D_i`. It needs
#   no row of `P` at all — one dot product per query row, computed before the loop.
# * `S` is linear in `q` and `k`, times `scale`: `dQ = scale · dS K`, `dK = scale · dSᵀ Q`.
# * `P_ij = exp(S_ij − lse_i)`: the saved `lse` normalises a tile of `P` without the rest of
#   its row.
#
# Every formula is per tile: a `(query block, key block)` tile of `P` and `dS` contributes to
# `dV` and `dK` of its keys and to `dQ` of its queries. FlashAttention-2 puts the loop over
# **key blocks outside** (each program owns the `dK, dV` of one key block and accumulates
# them in registers) and the query blocks inside; `dQ` is accumulated across key blocks. In
# flash-attn's FlashAttention-2 CUDA backward that is **one main kernel**, between two small
# ones: a pre-pass computes `D`, the main kernel does the tiles, and a last launch converts the
# float32 `dQ` it accumulated to the inputs' dtype. In the main kernel every key-block program
# adds its share of `dQ` to the same rows in global memory with **atomic adds** (many programs
# write the same `dQ` rows at once, so each addition must be atomic). The programs finish in no
# fixed order, and float additions in another order round differently: `dQ` can differ in its
# last bits from one run to the next. flash-attn's `deterministic=True` gives each key-block
# program its own `dQ` buffer instead and sums them in a fixed order — slower, and more memory.
# Section 9 builds a design without atomics.

# %% [markdown]
# ### Exercise 6.7 — flash_attention_backward (4 pts, ~25 min)
#
# Write the tiled backward pass. Inputs: q, k, v, the forward's `out` and `lse`, and `dout`
# (`[B, H, S_q, d_v]`). Return `(dq, dk, dv)` with the shapes and dtype of q, k and v. Compute
# in at least float32. No tensor may be as wide as all the keys or all the queries (the check
# watches every operation), and with `causal` the tiles no query may see are skipped, as in
# the forward pass (the mask inside a diagonal tile is the forward's: bottom-right). A query
# that saw no key has `lse = −inf` and contributes nothing: its `P` is 0.

# %% answer="flash_attention_backward"
def flash_attention_backward(q, k, v, out, lse, dout, block_q=64, block_k=64, causal=False,
                             scale=None):
    """dq, dk, dv of attention from the saved out and lse; P recomputed tile by tile.

    q: [B, H, S_q, d], k: [B, H, S_k, d], v: [B, H, S_k, d_v], out and dout: [B, H, S_q, d_v],
    lse: [B, H, S_q] -> (dq, dk, dv) shaped and typed like q, k, v.
    Example: equals torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), dout).
    """
    ### BEGIN SOLUTION
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    compute = torch.promote_types(q.dtype, torch.float32)
    q_c, k_c, v_c, out_c, dout_c = (t.to(compute) for t in (q, k, v, out, dout))
    # A query that sees no key (causal, S_q > S_k) has lse = -inf and P = 0: exp(s - 0), not
    # exp(-inf - (-inf)) = NaN, which the sums over query rows would spread to every dk and dv.
    lse_c = lse.to(compute).masked_fill(lse == float("-inf"), 0.0)
    delta = (dout_c * out_c).sum(dim=-1)  # D = rowsum(dO ∘ O): [B, H, S_q]
    dq, dk, dv = torch.zeros_like(q_c), torch.zeros_like(k_c), torch.zeros_like(v_c)
    offset = seq_k - seq_q
    for k_start in range(0, seq_k, block_k):  # FlashAttention-2: key blocks outside
        k_end = min(seq_k, k_start + block_k)
        k_blk, v_blk = k_c[..., k_start:k_end, :], v_c[..., k_start:k_end, :]
        for q_start in range(0, seq_q, block_q):
            q_end = min(seq_q, q_start + block_q)
            if causal and k_start > q_end - 1 + offset:
                continue  # no query of this block sees any key of this block
            q_blk, do_blk = q_c[..., q_start:q_end, :], dout_c[..., q_start:q_end, :]
            scores = q_blk @ k_blk.transpose(-2, -1) * scale  # [B, H, bq, bk]
            if causal:
                rows = torch.arange(q_start, q_end, device=q.device)[:, None]
                cols = torch.arange(k_start, k_end, device=q.device)[None, :]
                scores = scores.masked_fill(cols > rows + offset, float("-inf"))
            # the tile of P, normalised by the saved lse
            p = torch.exp(scores - lse_c[..., q_start:q_end, None])
            dv[..., k_start:k_end, :] += p.transpose(-2, -1) @ do_blk
            dp = do_blk @ v_blk.transpose(-2, -1)
            ds = p * (dp - delta[..., q_start:q_end, None])
            dq[..., q_start:q_end, :] += scale * ds @ k_blk
            dk[..., k_start:k_end, :] += scale * ds.transpose(-2, -1) @ q_blk
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    ### END SOLUTION


# %% test="test_flash_attention_backward" points=3
"""flash_attention_backward: dq, dk, dv equal autograd through SDPA; ragged; causal; any blocks."""
from attention_lab.checks.efficient_attention import check_flash_attention_backward

check_flash_attention_backward(flash_attention_backward)
### BEGIN HIDDEN TESTS
check_flash_attention_backward(flash_attention_backward, seed=6801)
### END HIDDEN TESTS

# %% test="test_flash_attention_backward_memory" points=1
"""flash_attention_backward: no tensor as wide as all the keys; causal skips the future tiles."""
from attention_lab.checks.efficient_attention import check_flash_attention_backward_memory

check_flash_attention_backward_memory(flash_attention_backward)
### BEGIN HIDDEN TESTS
check_flash_attention_backward_memory(flash_attention_backward, seed=6802)
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 6.8 — FlashAttention, an autograd Function (2 pts, ~10 min)
#
# Wrap both passes in a `torch.autograd.Function`: `forward(ctx, q, k, v, causal=False)` runs
# your `flash_attention_forward`, keeps **only** what the backward pass needs (the check
# inspects what your `forward` saved: q, k, v, out and lse, with `ctx.save_for_backward`) and
# returns `out`; `backward(ctx, dout)` returns one gradient per input of `forward`. The check
# also runs `torch.autograd.gradcheck` on it in float64.

# %% answer="FlashAttention"
class FlashAttention(torch.autograd.Function):
    """Attention whose backward pass recomputes P from the saved lse.

    Usage: FlashAttention.apply(q, k, v, causal).
    """

    @staticmethod
    def forward(ctx, q, k, v, causal=False):
        ### BEGIN SOLUTION
        out, lse = flash_attention_forward(q, k, v, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal = causal
        return out
        ### END SOLUTION

    @staticmethod
    def backward(ctx, dout):
        ### BEGIN SOLUTION
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(q, k, v, out, lse, dout, causal=ctx.causal)
        return dq, dk, dv, None  # no gradient for causal
        ### END SOLUTION


def flash_attention(q, k, v, causal=False):
    """Differentiable FlashAttention: out [B, H, S_q, d_v]."""
    return FlashAttention.apply(q, k, v, causal)


# %% test="test_FlashAttention" points=2
"""FlashAttention: saves only q, k, v, out, lse; gradients equal SDPA's; gradcheck."""
from attention_lab.checks.efficient_attention import check_flash_attention_function

check_flash_attention_function(FlashAttention)
### BEGIN HIDDEN TESTS
check_flash_attention_function(FlashAttention, seed=6901)
### END HIDDEN TESTS

# %% [markdown]
# **Train with it.** Two copies of the same small causal attention model, trained on the same
# batches of 150 tokens — three query blocks and three key blocks of 64 (the last one ragged),
# so that the causal skipping, the rescaling across key blocks and the sums over query blocks
# all run: one copy calls your `flash_attention`, the other `F.scaled_dot_product_attention`. If
# your backward pass is right, the two loss curves are the same curve (up to float32 rounding).

# %%
import copy

import matplotlib.pyplot as plt


class TinyCausalModel(torch.nn.Module):
    def __init__(self, attend, width=32, heads=2):
        super().__init__()
        self.attend, self.heads = attend, heads
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x):  # x: [B, S, width]
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, -1))
        return self.proj(self.attend(q, k, v).transpose(1, 2).flatten(2))


def train_losses(model, steps=20, seed=0, seq_len=150):
    data = torch.Generator().manual_seed(seed)
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, seq_len, 32, generator=data).to(device)
        # the running mean of the tokens so far: a causal task
        target = x.cumsum(dim=1) / torch.arange(1, seq_len + 1, device=device)[:, None]
        loss = F.mse_loss(model(x), target)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    return losses


torch.manual_seed(0)
sdpa_model = TinyCausalModel(
    lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)).to(device)
flash_model = copy.deepcopy(sdpa_model)
flash_model.attend = lambda q, k, v: flash_attention(q, k, v, causal=True)
threads = torch.get_num_threads()
torch.set_num_threads(1)  # tensors this small: one CPU thread beats two that wait on each other
try:
    with_sdpa, with_flash = train_losses(sdpa_model), train_losses(flash_model)
finally:
    torch.set_num_threads(threads)
figure, axis = plt.subplots(figsize=(6, 3))
axis.plot(with_sdpa, label="SDPA", linewidth=3, alpha=0.5)
axis.plot(with_flash, "--", label="your FlashAttention")
axis.set(xlabel="step", ylabel="MSE loss", yscale="log", title="the same training, two attentions")
axis.legend()
plt.show()
print("largest difference between the two loss curves:",
      f"{max(abs(a - b) for a, b in zip(with_sdpa, with_flash)):.1e}")

# %% [markdown]
# ## 7. Why a fused kernel is faster: FLOPs, bytes, and the clock
#
# **Count before you measure.** For one head with `S_q = S_k = S` and width `d`, the two matrix
# products `q kᵀ` and `P v` are `S²·d` multiply-adds each: `4·S²·d` FLOPs, naive or tiled. What
# differs is the memory traffic (in elements; multiply by 2 bytes in float16):
#
# * naive, with the scale folded into `q` first (as the timed version below does): read q and k
#   (`2·S·d`), **write the `S²` scores, read them and write `P` (`2·S²`), read `P`** and v
#   (`S² + S·d`), write out (`S·d`): about `4·S²` elements. (Scaling the `[S, S]` scores
#   instead, as notebook 01 did, reads and writes the table once more: `6·S²`.)
# * tiled: read q and write out once (`2·S·d`); read k and v once **per query block**
#   (`2·S·d · S/block_q`); the tiles never leave the chip.
#
# Their *arithmetic intensity*, FLOPs per byte, decides what bounds them: a GPU that does `F`
# FLOP/s and moves `W` bytes/s waits for memory whenever a kernel does fewer than `F / W` FLOPs
# per byte. Dense float16 peaks over memory bandwidth, from the data sheets (the H100 and the
# H200 differ by model; `torch.cuda.get_device_name()` says which one you have): H100 SXM 989
# TFLOP/s over 3.35 TB/s ≈ 295; H100 NVL 835 over 3.9 ≈ 214; H100 PCIe 756 over 2.0 ≈ 378; H200
# (SXM) 989 over 4.8 ≈ 206; H200 NVL 835 over 4.8 ≈ 174; A100 80 GB 312 over 2.0 ≈ 156; Colab's
# T4 65 over 0.32 ≈ 203. **Predict** before running the cell: at `d = 64` and `block_q = 128`,
# which of the two passes is below these balances, and by how much?

# %%
from attention_lab.widgets.efficient_attention import attention_traffic

for seq_len in (1024, 4096, 16384):
    traffic = attention_traffic(seq_len, head_dim=64, bytes_per_element=2, block_q=128)
    print(f"S = {seq_len:>6}: " + " | ".join(
        f"{name}: {flops / 1e9:6.2f} GFLOP, {moved / 2**20:8.1f} MiB, "
        f"{flops / moved:5.0f} FLOP/byte" for name, (flops, moved) in traffic.items()))

# %% [markdown]
# The naive pass does about `d/2` = 32 FLOPs per byte at any `S`: five to twelve times below
# every balance above, so it runs at the speed of its memory traffic — and its traffic grows like
# `S²`. The tiled pass does about `block_q` FLOPs per byte (114 at `S = 1k` to 127 at 16k; bigger
# query blocks, fewer re-reads of k and v): four times the naive intensity — and by this model
# *still* below every balance quoted: from 0.3× an H100 PCIe's (at `S = 1k`) to 0.8× an A100's
# (at 16k). The model is pessimistic for the tiled pass: it charges every re-read of k and v to
# the GPU's memory, while many are served by its L2 cache, and FlashAttention-2 measures 50–73%
# of an A100's peak in its forward pass (Dao, 2023) — compute-bound in practice. So the honest
# prediction is: naive, memory-bound by a wide margin; tiled, near the balance on paper and above
# it once the cache helps. Same FLOPs, several times fewer bytes: that is FlashAttention's
# speed-up.
#
# **Measure.** Naive attention (the `[S, S]` table, as in notebook 01), your `chunked_attention`
# and `flash_attention_forward`, and PyTorch's SDPA, on this notebook's device (on a GPU in
# float16; section 8 adds your Triton kernel to the GPU's measurement). On Colab's T4, SDPA has
# no flash backend (its FlashAttention kernels need an Ampere GPU or newer), so it runs its
# memory-efficient kernel there. On the CPU the measurement runs on one thread (a thread pool
# that changes size under a shared machine's load bends the curves), and each time is the median
# of rounds of three runs after a warm-up run (the first call pays for allocations and, on a GPU,
# kernel set-up), repeated until a round moves the median by less than 5% (at most 30 runs); the
# bars go from the fastest run to the slowest. Peak memory is that of the tensors each call
# creates; on the CPU it is followed tensor by tensor (SDPA's fused CPU kernel allocates its
# small buffers out of sight). Both panels are log-log, so growth like `S^p` is a straight line
# of slope `p`: the legend gives each line's fitted slope. On a GPU the plot also prints the
# achieved TFLOP/s (`4·B·H·S²·d` over the median time) against the card's float16 peak — a fair
# yardstick for SDPA, not for the PyTorch flash pass, which computes its tiles in float32.
# Ungraded; a few seconds on the CPU.

# %%
from attention_lab.widgets.efficient_attention import (attention_costs_view, gpu_peak_tflops,
                                                      measure_attention_costs)


def naive_attention(q, k, v):
    scores = (q / math.sqrt(q.shape[-1])) @ k.transpose(-2, -1)  # [B, H, S, S], scaled via q
    weights = torch.softmax(scores, dim=-1)
    return weights @ v


contenders = {
    "naive": naive_attention,
    "chunked (128)": lambda q, k, v: chunked_attention(q, k, v, 128),
    "flash, PyTorch (128)": lambda q, k, v: flash_attention_forward(q, k, v, 128, 128)[0],
    "SDPA": F.scaled_dot_product_attention,
}
if device.type == "cuda":
    costs = measure_attention_costs(contenders, [1024, 2048, 4096, 8192], batch_size=4,
                                    num_heads=16, dtype=torch.float16, device=device)
else:
    costs = measure_attention_costs(contenders, [128, 256, 512, 1024], num_heads=2, device=device)
attention_costs_view(costs, peak_tflops=gpu_peak_tflops(device))

# %% [markdown]
# **What to expect.** Memory: the naive table's slope is about 2 (×4 per doubling of `S`);
# chunked attention's about 1 (`chunk · S`; 1.15 measured on this course's CPU, `S = 128` to
# 1,024). The tiled pass holds the output plus tiles of a fixed size, so its slope tends to 1 as
# the output outgrows the tiles, and is well below 1 at the CPU's small sizes, where the tiles
# are still a large part of the total (0.62 measured here). Time: every exact method does the
# same `4·S²·d` FLOPs, so at large `S` every time line tends to slope 2 — FlashAttention does not
# do less arithmetic, it moves fewer bytes. **CPU and GPU differ**: a CPU has caches large enough
# for small tables and no separate "on-chip" tile memory to exploit, and Python pays a fixed
# overhead per tile, so on the CPU the PyTorch tiles are the slowest line and small `S` shows
# slopes below 2 (overheads, not arithmetic, dominate). On a GPU the naive version waits for its
# `S²` traffic and runs out of memory first, while the fused kernels (SDPA's flash backend, or
# the one you write next) are faster and reach a larger share of the card's peak. That is why the
# rest of this notebook writes the tiled pass as one GPU kernel.
#
# **What a CPU slope can and cannot show.** It shows how the cost of each method grows on this
# machine once fixed overheads are small: the table's `S²` memory, and (at large `S`) the `S²`
# arithmetic. It cannot show what the GPU section is about — a pass bound by memory traffic
# against one bound by arithmetic, or tiles that stay on chip — because a CPU's caches serve
# small tables either way. And it is fragile: on this course's shared 2-core machine, with the
# thread pool left to PyTorch and the median of just three runs, the same code gave slopes from
# 0.17 to 4.1 in three trials; on one thread with the repeat-until-stable median, 2.3 to 3.0
# (slopes above 2: the table outgrows a cache as `S` doubles). Look at the spread bars before
# reading a slope.

# %% [markdown]
# ## 8. The same algorithm as a Triton kernel
#
# A GPU kernel in [Triton](https://triton-lang.org) is a Python function run by many
# *programs* at once. Here program `(i, bh)` computes query rows `i·BLOCK_Q … i·BLOCK_Q +
# BLOCK_Q − 1` of head `bh`: it loads its queries once, loops over key blocks, and keeps
# `m_i`, `l_i` and `acc` in registers — the `[BLOCK_Q, BLOCK_K]` tile of scores never leaves
# the chip. This is FlashAttention, and the reason section 7 gave for its speed: the same
# FLOPs, with the bytes of one read of q, k and v per query block instead of the `S²` table.
#
# **Where it runs.** On a CUDA GPU (Colab: *Runtime → Change runtime type → GPU*) the kernel is
# compiled for the GPU. Without a GPU, the setup cell at the top of this notebook has set
# `TRITON_INTERPRET=1` *before any kernel is defined* (Triton reads it when `@triton.jit`
# runs): the kernel then runs in Triton's **interpreter** on CPU tensors, with NumPy, slowly but
# with the same semantics. The interpreter is more lenient than the GPU compiler in two ways
# the launchers guard against. It accepts a `tl.dot` of any size, while Triton's compiler for
# NVIDIA GPUs (version 3.7) requires the *reduction* dimension — the `K` of `[M, K] @ [K, N]` —
# to be at least 16 (32 for 8-bit inputs; `M` and `N` may be smaller). In this notebook's
# kernels every block size is the reduction dimension of some product (`BLOCK_K` and the head
# width in the forward's `q kᵀ` and `P V`, `BLOCK_Q` in the backward's `Pᵀ dO`), so the
# launchers ask at least 16 of each. And the interpreter's bfloat16 `tl.dot` is wrong, so the
# CPU check uses float32 and float16.
# Timing tools such as `triton.testing.do_bench` and `@triton.autotune` need a GPU.
#
# **Loads and stores.** `tl.load(pointers, mask=..., other=0.0)` reads a whole block; lanes
# where `mask` is False read nothing and give `other`. A load **without** a mask past the end of
# a tensor reads memory that is not yours: on a GPU it may crash, and in the interpreter it can
# kill the notebook's kernel ("kernel restarting"). If that happens, restart, re-run from the
# top, and add the mask. (Grading runs each notebook in its own process and survives a crashed
# kernel: you lose this exercise's points, not the others'.)
#
# **Triton's vocabulary** for the loop: `tl.arange(0, N)` (a block of indices), `tl.load` /
# `tl.store`, `tl.dot(a, b)` (a block matrix product, float32 accumulation; on float32 blocks a
# GPU of the Ampere generation or newer rounds the inputs to **TF32** — 10 bits of mantissa —
# unless told `input_precision="ieee"`, while the interpreter multiplies in full float32, so a
# float32 kernel differs between the two by about 1e-3), `tl.trans(k)`,
# `tl.max(x, axis=1)`, `tl.sum(x, axis=1)`, `tl.maximum`, `tl.where(condition, a, b)`,
# `tl.exp2`, `x[:, None]` / `x[None, :]` broadcasting, `p.to(v.dtype)`. Plain Python `for` loops
# over `range(start, stop, step)` work, with `stop` a runtime value.

# %%
from attention_lab.triton_kernels import (TRITON_AVAILABLE, interpreter_active,
                                          launch_flash_attention, launch_flash_attention_backward,
                                          launch_matmul, launch_online_softmax, launch_row_softmax,
                                          launch_scale, tl, triton)

print("Triton available:", TRITON_AVAILABLE,
      "| runs in the interpreter (TRITON_INTERPRET=1):", interpreter_active())

# %% [markdown]
# ### Warm-up: three small kernels before FlashAttention's
#
# Each exercise below is one idea the FlashAttention kernel needs, on its own. Their launchers
# are given (read them with `launch_scale??` and the like); the checks run each kernel on
# lengths that are multiples of no block, with NaN stored right after every input, and name a
# load or a store that goes past the end.

# %% [markdown]
# ### Exercise 6.9 — scale_kernel: a masked load and store (1 pt, ~5 min)
#
# `out = alpha · x` for a 1-D `x` of `n` elements. Program `i` handles elements
# `i·BLOCK … i·BLOCK + BLOCK − 1`; the last program's block runs past `n`. Its lanes past the
# end must neither read `x` nor write `out`.

# %% answer="scale_kernel"
@triton.jit
def scale_kernel(X, Out, n, alpha, BLOCK: tl.constexpr):
    """Out[i] = alpha · X[i] for i < n; one program per BLOCK elements."""
    ### BEGIN SOLUTION
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    x = tl.load(X + offsets, mask=inside, other=0.0)
    tl.store(Out + offsets, alpha * x, mask=inside)
    ### END SOLUTION


# %% test="test_scale_kernel" points=1
"""scale_kernel: alpha · x, masked loads and stores, any length."""
from attention_lab.checks.efficient_attention import check_scale_kernel

check_scale_kernel(scale_kernel)
### BEGIN HIDDEN TESTS
check_scale_kernel(scale_kernel, seed=6711)
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 6.10 — matmul_kernel: a tiled matrix product (1 pt, ~10 min)
#
# `C = A @ B` with `A [M, K]`, `B [K, N]`. Program `(i, j)` owns the `[BLOCK_M, BLOCK_N]` block
# of `C` at rows `i·BLOCK_M …` and columns `j·BLOCK_N …`: it walks along `K` one `BLOCK_K` slice
# at a time, multiplies a block of `A` by a block of `B` with `tl.dot`, and accumulates in
# float32. An element of `A` at `(r, c)` is at `A + r·stride_am + c·stride_ak`. Any of `M`, `N`
# and `K` may stop in the middle of a block.

# %% answer="matmul_kernel"
@triton.jit
def matmul_kernel(A, B, C, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                  stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[i-block, j-block] = Σ over K-slices of A[i-block, slice] @ B[slice, j-block] (float32)."""
    ### BEGIN SOLUTION
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        a = tl.load(A + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(B + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc += tl.dot(a, b)
    tl.store(C + rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc,
             mask=(rows[:, None] < M) & (cols[None, :] < N))
    ### END SOLUTION


# %% test="test_matmul_kernel" points=1
"""matmul_kernel: a tiled A @ B with a float32 accumulator; ragged M, N and K."""
from attention_lab.checks.efficient_attention import check_matmul_kernel

check_matmul_kernel(matmul_kernel)
### BEGIN HIDDEN TESTS
check_matmul_kernel(matmul_kernel, seed=6811)
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 6.11 — softmax kernels: a row in one block, then a row of many (3 pts, ~23 min)
#
# **First, `row_softmax_kernel`** (1 point). One program per row of `x [rows, n_cols]`; `BLOCK` is the next power of two `≥ n_cols`, so
# the whole row fits in one block. Make it stable for scores around ±1000, and think about what
# the lanes past `n_cols` must hold so that they change neither the max nor the sum.

# %% answer="row_softmax_kernel"
@triton.jit
def row_softmax_kernel(X, Out, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    """Out[r] = softmax(X[r]) for the row r = program_id(0)."""
    ### BEGIN SOLUTION
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf"))
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(Out + row * stride_out + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)
    ### END SOLUTION


# %% test="test_row_softmax_kernel" points=1
"""row_softmax_kernel: the softmax of each row, stable at ±1000, any row length."""
from attention_lab.checks.efficient_attention import check_row_softmax_kernel

check_row_softmax_kernel(row_softmax_kernel)
### BEGIN HIDDEN TESTS
check_row_softmax_kernel(row_softmax_kernel, seed=6911)
### END HIDDEN TESTS

# %% [markdown]
# **Then `online_softmax_kernel`** (2 points): the same softmax for rows **longer than one
# block** — the online softmax of 6.3 and 6.4, inside one Triton program. `BLOCK` is now given
# by the launcher (`launch_online_softmax(kernel, x, block=...)`; read it with
# `launch_online_softmax??`) and may be much shorter than the row, so the program loops over the
# row's column blocks twice:
#
# 1. a running max `m` and a running sum `l`: for each block, the new max
#    `m_new = max(m, max(x_blk))`, then `l = l · e^(m − m_new) + Σ e^(x_blk − m_new)` — the sum
#    taken so far is rescaled to the new max;
# 2. a second pass over the same blocks that writes `e^(x − m) / l`.
#
# This is exactly the loop of FlashAttention's kernel in 6.12, with a row of scores instead of
# `q kᵀ` and without the `V` accumulator. Compute in float32 (`x.to(tl.float32)` after the load;
# the store converts to `Out`'s dtype, float16 included). `m` and `l` are one number each for the
# whole row, carried from one iteration of the loop to the next: start them as float32
# *scalars*, `tl.full([], float("-inf"), tl.float32)` and `tl.full([], 0.0, tl.float32)` (plain
# `float("-inf")` and `0.0` give the same), and keep them scalars — reduce each block with
# `tl.max(x, axis=0)` and `tl.sum(..., axis=0)` before you combine it with them. A variable the
# loop carries must keep its type: the GPU compiler refuses an `m` that starts as a scalar and
# comes back as a `[BLOCK]` vector ("Loop-carried variable m_i has initial type fp32 but is
# re-assigned to <['16'], fp32> in loop"), though the interpreter lets it pass. The check gives
# rows whose maximum jumps by 1000 after the first blocks, and rows that fall by 2000 after them.
#
# | name | signature | contract |
# | --- | --- | --- |
# | `online_softmax_kernel` | `@triton.jit (X, Out, n_cols, stride_x, stride_out, BLOCK)` | one program per row; loop over column blocks with a running max and a rescaled running sum, then a second pass writes `exp(x − m) / l`; stable for rows spanning −1000 … 1000; float32 and float16 in, the input's dtype out; any row length |

# %% answer="online_softmax_kernel"
@triton.jit
def online_softmax_kernel(X, Out, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    """Out[r] = softmax(X[r]) for the row r = program_id(0), in column blocks of BLOCK."""
    ### BEGIN SOLUTION
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m_i = tl.full([], float("-inf"), tl.float32)  # running max: a float32 scalar
    l_i = tl.full([], 0.0, tl.float32)  # running sum against m_i
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf"))
        x = x.to(tl.float32)
        m_new = tl.maximum(m_i, tl.max(x, axis=0))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m_i = m_new
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf"))
        x = x.to(tl.float32)
        y = tl.exp(x - m_i) / l_i
        tl.store(Out + row * stride_out + cols, y.to(Out.dtype.element_ty), mask=cols < n_cols)
    ### END SOLUTION


# %% test="test_online_softmax_kernel" points=2
"""online_softmax_kernel: the softmax of rows longer than a block, stable from -1000 to 1000."""
from attention_lab.checks.efficient_attention import check_online_softmax_kernel

check_online_softmax_kernel(online_softmax_kernel)
### BEGIN HIDDEN TESTS
check_online_softmax_kernel(online_softmax_kernel, seed=6912)
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 6.12 — flash_attention_kernel (3 pts, ~25 min)
#
# The kernel's prologue (offsets, loading this program's queries, `m_i = −∞`, `l_i = 0`,
# `acc = 0`) and epilogue (`acc / l_i`, `lse`, 0 and `−inf` for a query that sees no key, the
# masked stores) are given. Write the loop over key blocks in between; everything it needs, you
# have written once already:
#
# * **which key blocks**: all of them, or with `CAUSAL` only those that hold a key some query
#   of this program may see (6.5's loop bound, with this program's rows; mind that `range`'s
#   stop is exclusive);
# * **the blocks of K and V**: masked loads, as in 6.9 — the last block runs past `seq_k`;
# * **the tile of scores**: a `tl.dot` as in 6.10, times `qk_scale`. A key that does not exist
#   (past `seq_k`) or, with `CAUSAL`, lies in a query's future (6.2's rule, bottom-right) must
#   get no weight: what score gives weight 0?
# * **the online-softmax update** of `m_i`, `l_i` and `acc` (6.4), in registers. The scores
#   are in base-2 units (`qk_scale` includes `log2(e)`, as the epilogue assumes), so use
#   `tl.exp2`; give `tl.dot` `p.to(v.dtype)` and `v` (float32 accumulation).

# %% answer="flash_attention_kernel"
@triton.jit
def flash_attention_kernel(Q, K, V, Out, Lse,
                           stride_qh, stride_qs, stride_kh, stride_ks, stride_vh, stride_vs,
                           seq_q, seq_k, sm_scale,
                           CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                           HEAD_DIM: tl.constexpr):
    """One program: BLOCK_Q query rows of one (batch, head); loop over key blocks.

    Q, Out: [B·H, S_q, HEAD_DIM]; K, V: [B·H, S_k, HEAD_DIM]; Lse: [B·H, S_q] float32.
    """
    block_index = tl.program_id(0)  # which block of query rows
    head_index = tl.program_id(1)  # which (batch, head)
    offs_q = block_index * BLOCK_Q + tl.arange(0, BLOCK_Q)  # [BLOCK_Q] query rows of this program
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + head_index * stride_qh + offs_q[:, None] * stride_qs + offs_d[None, :],
                mask=offs_q[:, None] < seq_q, other=0.0)  # [BLOCK_Q, HEAD_DIM]
    qk_scale = sm_scale * 1.4426950408889634  # × log2(e): scores in base-2 units, for tl.exp2
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)  # running max (base-2 units)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)  # running sum
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)  # unnormalised output
    ### BEGIN SOLUTION
    k_stop = seq_k
    if CAUSAL:
        k_stop = tl.minimum(seq_k, (block_index + 1) * BLOCK_Q + seq_k - seq_q)
    for k_start in range(0, k_stop, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        key_ok = offs_k[:, None] < seq_k
        k = tl.load(K + head_index * stride_kh + offs_k[:, None] * stride_ks + offs_d[None, :],
                    mask=key_ok, other=0.0)
        v = tl.load(V + head_index * stride_vh + offs_k[:, None] * stride_vs + offs_d[None, :],
                    mask=key_ok, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_Q, BLOCK_K]
        visible = offs_k[None, :] < seq_k
        if CAUSAL:
            visible = visible & (offs_k[None, :] <= offs_q[:, None] + seq_k - seq_q)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        correction = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    ### END SOLUTION
    # Epilogue (given): normalise once, lse back to natural log, store the rows that exist. A
    # query that sees no key (causal, S_q > S_k: the first S_q - S_k) gets out 0 and lse -inf,
    # as SDPA, whatever the loop left in its row (0 / 0, or a mean under a finite fill).
    sees_a_key = offs_q >= 0
    if CAUSAL:
        sees_a_key = offs_q >= seq_q - seq_k
    acc = tl.where(sees_a_key[:, None], acc / l_i[:, None], 0.0)
    lse = tl.where(sees_a_key, (m_i + tl.log2(l_i)) * 0.6931471805599453, float("-inf"))  # × ln 2
    row_ok = offs_q < seq_q
    tl.store(Out + head_index * stride_qh + offs_q[:, None] * stride_qs + offs_d[None, :],
             acc.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(Lse + head_index * seq_q + offs_q, lse, mask=row_ok)


# %% [markdown]
# The launcher is given: it sees q, k and v as `[B·H, S, d]` (row `s` of head `bh` at
# `bh·stride_h + s·stride_s`), allocates `out` and `lse`, and launches a grid of
# `(ceil(S_q / block_q), B·H)` programs. Read it with `launch_flash_attention??`. The check
# runs your kernel on lengths that are multiples of no block, with rows of NaN stored right
# after each head's last row of q, k and v: a load without a mask reads them, and Triton's
# interpreter tells the check which load it was.

# %%
def triton_flash_attention(q, k, v, causal=False):
    """(out, lse) from your kernel: q [B, H, S_q, d], k and v [B, H, S_k, d].

    d must be a power of two >= 16.
    """
    return launch_flash_attention(flash_attention_kernel, q, k, v, causal=causal)


# %% test="test_flash_attention_kernel" points=3
"""flash_attention_kernel: equals SDPA and logsumexp (fp32, fp16); ragged; causal; masked."""
from attention_lab.checks.efficient_attention import check_flash_attention_kernel

check_flash_attention_kernel(flash_attention_kernel)
### BEGIN HIDDEN TESTS
check_flash_attention_kernel(flash_attention_kernel, seed=6701, sizes="more")
### END HIDDEN TESTS

# %%
if TRITON_AVAILABLE:
    q_small, k_small, v_small = (torch.randn(1, 2, 64, 16, device=device) for _ in range(3))
    out_triton, lse_triton = triton_flash_attention(q_small, k_small, v_small, causal=True)
    out_torch, lse_torch = flash_attention_forward(q_small, k_small, v_small, causal=True)
    print("Triton vs PyTorch flash: out", float((out_triton - out_torch).abs().max()),
          "| lse", float((lse_triton - lse_torch).abs().max()))
else:
    print("Triton is not installed here: open this notebook on Colab to run the kernel.")

# %% [markdown]
# **On a GPU, measure it** against SDPA and section 7's naive pass, in float16 (on the CPU the
# interpreter's times say nothing about a GPU, and this cell only says so). Your kernel runs
# with the launcher's fixed 32 × 32 tiles and no autotuning, so it is far from the best that
# kernel could do, while SDPA picks its kernel per GPU; the printed TFLOP/s are a fair
# yardstick for both, against the card's float16 peak.

# %%
if device.type == "cuda" and TRITON_AVAILABLE:
    kernel_costs = measure_attention_costs(
        {"naive": naive_attention, "SDPA": F.scaled_dot_product_attention,
         "flash, Triton": lambda q, k, v: triton_flash_attention(q, k, v)[0]},
        [1024, 2048, 4096, 8192], batch_size=4, num_heads=16, dtype=torch.float16, device=device)
    attention_costs_view(kernel_costs, peak_tflops=gpu_peak_tflops(device))
else:
    print("No CUDA GPU here: open this notebook on Colab (a GPU runtime) to time your kernel.")

# %% [markdown]
# ## 9. Challenge: the backward pass as Triton kernels
#
# For those who will write GPU kernels: 4 points, about 38 minutes; the notebook's core ends
# with section 8.
#
# Two designs of the backward pass run on GPUs. **FlashAttention-2's** (section 6) has one main
# kernel: one program per key block accumulates its `dK` and `dV` in registers and adds its
# share of `dQ` to global memory with atomic adds. The design here needs no atomics: the dK/dV
# work per key block, the dQ work per query block. Triton's fused-attention tutorial splits the
# work the same way, inside one kernel, `_attn_bwd` (after a small pre-pass for `D`): each of
# its programs computes one key block's `dK` and `dV`, then one query block's `dQ`. Here the two
# parts are **two kernels**. The first runs **one program per key block**: it loads its block
# of K and V once, loops over the query blocks that see it, recomputes each tile of `P` from q,
# k and `lse`, and accumulates `dK` and `dV` in registers. The second runs one program per query
# block, like the forward pass, loops over the key blocks, computes from q, k, v, `dO`, `lse`
# and `D` what `dQ` needs, and accumulates `dQ` in registers. In both kernels no two programs
# write the same rows: no atomics, a result that does not depend on the order programs finish
# in (atomic float additions do), and simple code — at a price in arithmetic that exercise 6.13
# asks you to count first.
# `D = rowsum(dO ∘ O)` is computed by the given launcher before both (read it with
# `launch_flash_attention_backward??`: the arguments and grids of both kernels).
#
# Everything is in 6.7, written per tile, with the masks and loop bounds of 6.12. Think about
# which query blocks a key block must visit when `CAUSAL` (the first one that has a query
# seeing one of its keys), and keep the scale: `dK` and `dQ` need it.

# %% [markdown]
# ### Exercise 6.13 — count the backward pass (2 pts, ~8 min)
#
# The forward pass runs two matrix products of `S²·d` multiply-adds per head (`q kᵀ` and `P v`;
# masks and causal skipping aside). Count the backward's, from section 6's formulas and from what
# each kernel has in memory, for two designs:
#
# 1. **FlashAttention-2**: one main kernel; each program owns a key block, loops over the query
#    blocks, and adds its share of `dQ` to global memory with atomic adds.
# 2. **Two kernels**: one computes `dK` and `dV` (a program per key block, looping over query
#    blocks); the other computes `dQ` (a program per query block, looping over key blocks).
#    Neither kernel sees the other's tiles: each has only `q, k, v, dO, lse` and `D` in memory.
#
# Set `ANSWER_BACKWARD_FLOPS` to a pair: each design's backward matmul FLOPs divided by the
# forward's, e.g. `(1.0, 1.0)` if each did as much as the forward.

# %% answer="ANSWER_BACKWARD_FLOPS"
ANSWER_BACKWARD_FLOPS = None  # (FlashAttention-2's ratio, the two kernels' ratio)
### BEGIN SOLUTION
ANSWER_BACKWARD_FLOPS = (5 / 2, 7 / 2)
### END SOLUTION

# %% test="test_ANSWER_BACKWARD_FLOPS" points=2
"""ANSWER_BACKWARD_FLOPS: the backward's matmul FLOPs over the forward's, for both designs."""
from attention_lab.checks.efficient_attention import check_answer_backward_flops

check_answer_backward_flops(ANSWER_BACKWARD_FLOPS)

# %% [markdown]
# **Units of `Lse` and `sm_scale`.** The forward kernel of 6.12 worked in base 2: its scores
# were multiplied by `sm_scale · log2(e)` for `tl.exp2`, and its epilogue converted the result
# back, storing `Lse` in **natural-log** units (`× ln 2`), the units of `flash_attention_forward`'s
# `lse`. The backward kernels receive that `Lse` and the plain `sm_scale = 1/sqrt(d)`, without
# `log2(e)`. So either stay in natural units, `p = exp(s · sm_scale − lse)` with `tl.exp`, or
# convert *both* to base 2, `exp2(s · sm_scale · log2(e) − lse · log2(e))`. Mixing the two gives a
# `P` that is wrong by a factor that depends on the row, and gradients that look plausible.
#
# ### Exercise 6.14 — flash_attention_backward_kernel (2 pts, ~30 min)
#
# Write the two loops (the loads of the program's own block and the stores are given).

# %% answer="flash_attention_backward_kernel"
@triton.jit
def flash_attention_backward_kernel(Q, K, V, DO, Lse, Delta, DK, DV,
                                    stride_qh, stride_qs, stride_kh, stride_ks,
                                    stride_vh, stride_vs, seq_q, seq_k, sm_scale,
                                    CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                                    BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr):
    """dK and dV of one key block of one (batch, head): loop over the query blocks that see it."""
    key_block = tl.program_id(0)
    head_index = tl.program_id(1)
    offs_k = key_block * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_k < seq_k
    k_block = K + head_index * stride_kh + offs_k[:, None] * stride_ks + offs_d[None, :]
    v_block = V + head_index * stride_vh + offs_k[:, None] * stride_vs + offs_d[None, :]
    k = tl.load(k_block, mask=key_ok[:, None], other=0.0)
    v = tl.load(v_block, mask=key_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_K, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_K, HEAD_DIM], dtype=tl.float32)
    ### BEGIN SOLUTION
    q_start_first = 0
    if CAUSAL:  # queries before key_block·BLOCK_K − (S_k − S_q) see none of these keys
        q_start_first = tl.maximum(0, key_block * BLOCK_K - (seq_k - seq_q)) // BLOCK_Q * BLOCK_Q
    for q_start in range(q_start_first, seq_q, BLOCK_Q):
        offs_q = q_start + tl.arange(0, BLOCK_Q)
        in_q = offs_q < seq_q
        q_tile = head_index * stride_qh + offs_q[:, None] * stride_qs + offs_d[None, :]
        q = tl.load(Q + q_tile, mask=in_q[:, None], other=0.0)
        do = tl.load(DO + q_tile, mask=in_q[:, None], other=0.0)
        lse = tl.load(Lse + head_index * seq_q + offs_q, mask=in_q, other=0.0)
        delta = tl.load(Delta + head_index * seq_q + offs_q, mask=in_q, other=0.0)
        s = tl.dot(q, tl.trans(k)) * sm_scale  # [BLOCK_Q, BLOCK_K]
        visible = in_q[:, None] & key_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_k[None, :] <= offs_q[:, None] + seq_k - seq_q)
        p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
        dv += tl.dot(tl.trans(p).to(do.dtype), do)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds).to(q.dtype), q)
    dk = dk * sm_scale
    ### END SOLUTION
    cols = offs_k[:, None] * stride_ks + offs_d[None, :]
    tl.store(DK + head_index * stride_kh + cols, dk.to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(DV + head_index * stride_vh + cols, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


@triton.jit
def flash_attention_backward_dq_kernel(Q, K, V, DO, Lse, Delta, DQ,
                                       stride_qh, stride_qs, stride_kh, stride_ks,
                                       stride_vh, stride_vs, seq_q, seq_k, sm_scale,
                                       CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                                       BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr):
    """dQ of one query block of one (batch, head): loop over the key blocks it sees."""
    block_index = tl.program_id(0)
    head_index = tl.program_id(1)
    offs_q = block_index * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_q < seq_q
    rows = head_index * stride_qh + offs_q[:, None] * stride_qs + offs_d[None, :]
    q = tl.load(Q + rows, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + rows, mask=row_ok[:, None], other=0.0)
    lse = tl.load(Lse + head_index * seq_q + offs_q, mask=row_ok, other=0.0)
    delta = tl.load(Delta + head_index * seq_q + offs_q, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)
    ### BEGIN SOLUTION
    k_stop = seq_k
    if CAUSAL:
        k_stop = tl.minimum(seq_k, (block_index + 1) * BLOCK_Q + seq_k - seq_q)
    for k_start in range(0, k_stop, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        in_k = offs_k < seq_k
        k_tile = K + head_index * stride_kh + offs_k[:, None] * stride_ks + offs_d[None, :]
        v_tile = V + head_index * stride_vh + offs_k[:, None] * stride_vs + offs_d[None, :]
        k = tl.load(k_tile, mask=in_k[:, None], other=0.0)
        v = tl.load(v_tile, mask=in_k[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * sm_scale
        visible = row_ok[:, None] & in_k[None, :]
        if CAUSAL:
            visible = visible & (offs_k[None, :] <= offs_q[:, None] + seq_k - seq_q)
        p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    dq = dq * sm_scale
    ### END SOLUTION
    tl.store(DQ + rows, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


def triton_flash_attention_backward(q, k, v, out, lse, dout, causal=False):
    """(dq, dk, dv) from your two kernels; d a power of two >= 16."""
    return launch_flash_attention_backward(flash_attention_backward_kernel,
                                           flash_attention_backward_dq_kernel,
                                           q, k, v, out, lse, dout, causal=causal)


# %% test="test_flash_attention_backward_kernel" points=2
"""flash_attention_backward_kernel: dq, dk, dv equal SDPA's (fp32, fp16); ragged; causal."""
from attention_lab.checks.efficient_attention import check_flash_attention_backward_kernel

check_flash_attention_backward_kernel(flash_attention_backward_kernel,
                                      flash_attention_backward_dq_kernel)
### BEGIN HIDDEN TESTS
backward_kernels = (flash_attention_backward_kernel, flash_attention_backward_dq_kernel)
check_flash_attention_backward_kernel(*backward_kernels, seed=6131, sizes="more")
### END HIDDEN TESTS

# %% [markdown]
# ## What you built
#
# * `attention_matrix_bytes`: the `[S, S]` table outgrows the KV cache from a few thousand
#   tokens on.
# * `chunked_attention`: exact attention in `[chunk, S_k]` pieces.
# * `streaming_logsumexp` and `online_softmax_step`: a running max and rescaled sums make the
#   softmax a one-pass, block-by-block computation.
# * `flash_attention_forward`: tiles of queries × keys, no `[S_q, S_k]` tensor, future blocks
#   skipped, and `lse` — which merges partial results exactly.
# * `flash_attention_backward` and `FlashAttention`: the backward pass from `q, k, v, out, lse`
#   alone — `P` recomputed per tile, `D = rowsum(dO ∘ O)` — and training that matches SDPA's.
# * Why a fused kernel is faster: the same FLOPs, far fewer bytes.
# * `flash_attention_kernel`: the tiled forward pass as a Triton kernel, checked by the
#   interpreter on the CPU and run natively on a GPU.
# * `flash_attention_backward_kernel` (the challenge): the same backward pass as two Triton
#   kernels without atomics, dK/dV per key block and dQ per query block — the split of Triton's
#   tutorial in two kernels, not FlashAttention-2's main kernel with atomic `dQ`.
