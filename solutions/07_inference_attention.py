# %% [markdown]
# # 07 — Attention at inference scale: merged states, split-K decoding, a paged KV cache, windows and sinks, latent attention
#
# **41 points, about 209 minutes.**
#
# Notebooks 05 and 06 stop where serving begins. A model that answers many users at once decodes
# **one new token per sequence** at a time, over caches of very different lengths — and there the
# KV cache, not the arithmetic, is what runs out. This notebook builds what serving systems (vLLM,
# SGLang, FlashInfer, TensorRT-LLM) and recent models (Mistral, DeepSeek, gpt-oss) do about it,
# and checks every piece against plain attention over the whole context:
#
# 1. **attention states merge exactly** — the `(out, lse)` of notebook 06 is a state, and the states
#    of disjoint key sets combine into the state of their union;
# 2. **split-K decoding** (Flash-Decoding) — one query per sequence, its keys split across
#    programs, in PyTorch and then as a Triton kernel;
# 3. **a paged KV cache** (PagedAttention) — blocks from a free list, block tables, forks that
#    copy on write, and attention that reads only its own sequence's slots;
# 4. **windows and sinks** — Mistral's sliding window, StreamingLLM's sinks and its re-rotation
#    of cached keys, gpt-oss's learned sinks;
# 5. **latent attention** (DeepSeek's MLA) — a cache with no head axis, and the "absorbed" form
#    that never builds a per-head key or value;
# 6. **speculative decoding's draft trees** — one forward pass that verifies a whole tree of
#    guesses.
#
# **Notation**: `B` batch, `H_q` query heads, `H_kv` key/value heads (`H_q` a multiple of it;
# query head `h` reads KV head `h // (H_q / H_kv)`, as in notebook 05), `L` cached tokens of a
# sequence, `d` the per-head width. A decoding step's query is `q [B, H_q, d]`, one token per
# sequence. **Masks** are boolean with **True = may attend**; *causal* means, as in 05 and 06, that
# a query at position `p` sees the keys at positions `≤ p` (aligned bottom-right when there are
# fewer queries than keys).
#
# **Precision**: as in notebook 06, your functions may compute in float32 inside on float64 input;
# the checks then accept float32 accuracy with a one-line note. Two exceptions say so where they
# are: latent attention's two forms must agree in float64.

# %%
import math

import torch
import torch.nn.functional as F

# %% [markdown]
# Two helpers used throughout, given. `attention_state` is plain attention that also returns
# what notebook 06's `flash_attention_forward` returned, the **log-sum-exp** of each query's
# scores; `apply_rope_at` is notebook 05's RoPE in Meta's layout (pairs `(2j, 2j+1)` rotated by
# `position · θ_j`, `θ_j = base^(−2j/d)`), taking the positions directly.

# %%
def attention_state(q, k, v, scale=None):
    """(out, lse) of softmax attention of q [..., S_q, d] over k, v [..., S_k, d] (no mask).

    out [..., S_q, d_v], lse [..., S_q] = log Σ_j exp(scale · q·k_j) (natural log).
    """
    if scale is None:
        scale = 1 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1) * scale  # [..., S_q, S_k]
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ v, lse


def apply_rope_at(x, positions, base=10000.0):
    """Rotate x [..., T, d] (d even) at positions [T] (Meta's layout: pairs (2j, 2j+1)).

    Computed in float64 (the angles of large positions need it), returned in x's dtype.
    """
    half = torch.arange(0, x.shape[-1], 2, dtype=torch.float64, device=x.device)
    theta = base ** (-half / x.shape[-1])  # θ_j, [d/2]
    angles = positions.to(device=x.device, dtype=torch.float64)[:, None] * theta  # [T, d/2]
    pairs = torch.view_as_complex(x.to(torch.float64).reshape(*x.shape[:-1], -1, 2).contiguous())
    rotated = torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles))
    return rotated.flatten(-2).to(x.dtype)


# %% [markdown]
# ## 1. Attention states merge exactly
#
# Take one query and a set `A` of keys. Its attention over `A` is a **state**: the output vector
# `out_A` and one number, `lse_A`. With scores `s_j = scale · q·k_j`,
#
# $$\text{lse}_A = \log \sum_{j \in A} e^{s_j}, \qquad
#   \text{out}_A = \sum_{j \in A} e^{s_j - \text{lse}_A}\, v_j .$$
#
# Now split the keys into two disjoint sets `A` and `B`. The union's sum of exponentials is the sum
# of the two sums: $e^{\text{lse}} = e^{\text{lse}_A} + e^{\text{lse}_B}$. And its output regroups:
#
# $$\text{out} = \sum_{j \in A \cup B} e^{s_j - \text{lse}}\, v_j
#   = e^{\text{lse}_A - \text{lse}} \sum_{j \in A} e^{s_j - \text{lse}_A} v_j
#   + e^{\text{lse}_B - \text{lse}} \sum_{j \in B} e^{s_j - \text{lse}_B} v_j
#   = e^{\text{lse}_A - \text{lse}}\, \text{out}_A + e^{\text{lse}_B - \text{lse}}\, \text{out}_B .$$
#
# Exactly, not approximately. The weight `e^{lse_A − lse}` is the share of the softmax's mass that
# lies on `A`'s keys; the weights of the parts sum to 1. With `n` parts the same regrouping gives
#
# $$\text{lse} = \log \sum_i e^{\text{lse}_i}, \qquad \text{out} = \sum_i e^{\text{lse}_i - \text{lse}}\, \text{out}_i ,$$
#
# and it is computed stably like any log-sum-exp (every `lse_i − lse ≤ 0`). Nothing requires the
# parts to be contiguous, nor to be merged in one go: merging is commutative and associative, so
# parts can be combined in any order, pairwise in a tree, or one at a time as they arrive. This is
# how split-K decoding, ring attention across GPUs, and cascade attention (a shared prefix computed
# once for many sequences) combine partial results.

# %%
torch.manual_seed(0)
q_demo = torch.randn(2, 1, 16, dtype=torch.float64)  # two sequences, one query each
k_demo = torch.randn(2, 12, 16, dtype=torch.float64)  # 12 keys
v_demo = torch.randn(2, 12, 16, dtype=torch.float64)
whole_out, whole_lse = attention_state(q_demo, k_demo, v_demo)
out_a, lse_a = attention_state(q_demo, k_demo[:, :5], v_demo[:, :5])  # keys 0-4
out_b, lse_b = attention_state(q_demo, k_demo[:, 5:], v_demo[:, 5:])  # keys 5-11
lse_ab = torch.logaddexp(lse_a, lse_b)
merged = torch.exp(lse_a - lse_ab)[..., None] * out_a + torch.exp(lse_b - lse_ab)[..., None] * out_b
print("merged vs whole: out", float((merged - whole_out).abs().max()),
      "| lse", float((lse_ab - whole_lse).abs().max()))
print("shares of the mass on A and B:", torch.exp(lse_a - lse_ab).flatten().tolist(), "and",
      torch.exp(lse_b - lse_ab).flatten().tolist())

# %% [markdown]
# **Which logarithm?** The `lse` above is a natural log. Kernels that compute with `exp2` (faster
# on GPUs) keep their running maximum and sum in base 2; FlashInfer, for one, returns its `lse` in
# base 2, `lse₂ = log₂ Σ 2^{s·log₂e} = lse · log₂ e`. Merged as if it were natural, the weights still
# sum to 1 (they are normalised by the merged total), but each is proportional to
# `e^{lse₂,i} = e^{lse_i · 1.44}`, that is to `share_i^{1.44}` instead of `share_i`: the part with the
# most mass gets too much weight, the others too little — and nothing fails loudly:

# %%
log2_e = 1 / math.log(2)
lse2_a, lse2_b = lse_a * log2_e, lse_b * log2_e  # what a base-2 kernel returns
lse2_ab = torch.logaddexp(lse2_a, lse2_b)  # the merge's formula, as if they were natural logs
weight_a, weight_b = torch.exp(lse2_a - lse2_ab), torch.exp(lse2_b - lse2_ab)
wrong = weight_a[..., None] * out_a + weight_b[..., None] * out_b
print("true shares of A:", torch.exp(lse_a - lse_ab).flatten().tolist())
print("weights of A, base 2 merged as natural:", weight_a.flatten().tolist(),
      "| out off by", float((wrong - whole_out).abs().max()))
print("converted back (× ln 2) before merging, off by:",
      float((torch.logaddexp(lse2_a * math.log(2), lse2_b * math.log(2)) - whole_lse).abs().max()))

# %% [markdown]
# The shares 0.27 and 0.64 became 0.19 and 0.69: pushed away from ½, so the output is off. One unit
# convention for the whole pipeline — natural here, as in `torch.logsumexp` and notebook 06 — or a
# conversion (`× ln 2`) at the boundary.
#
# **An empty part.** Splitting `L` keys into `n` parts can leave a part with no key (`n > L`, or a
# sequence shorter than the others in a batch). Its sum of exponentials is an empty sum, 0, so its
# `lse` is `log 0 = −∞`, and its `out` is `0 / 0`: whatever the kernel left there, often NaN. Its
# weight must be `e^{−∞} = 0`, and it must contribute nothing. But `0 · NaN = NaN` in floating point,
# and if *every* part is empty, `lse − lse` is `−∞ − (−∞) = NaN` too:

# %%
nan_out = torch.full_like(out_a, float("nan"))  # an empty part's 0 / 0
empty_lse = torch.full_like(lse_a, float("-inf"))
lses = torch.stack([lse_a, empty_lse])  # [2 parts, B, 1]
total = torch.logsumexp(lses, dim=0)
weights = torch.exp(lses - total)  # [2, B, 1]: 1 and 0
naive = (weights[..., None] * torch.stack([out_a, nan_out])).sum(dim=0)
print("weights:", weights.flatten().tolist(), "| naive merge with an empty part:",
      naive.flatten()[:3].tolist())
all_empty = torch.stack([empty_lse, empty_lse])
print("every part empty: e^(lse_i - lse) =", torch.exp(all_empty - torch.logsumexp(all_empty, 0))
      .flatten().tolist())

# %% [markdown]
# An empty part must be the **identity** of merging: `merge(state, empty) = state`. So choose
# instead of multiplying (`torch.where(weight > 0, weight · out_i, 0)`), and subtract 0 instead of
# `−∞` where every part is empty (whose merged state is itself empty: `out = 0`, `lse = −∞`, what
# `F.scaled_dot_product_attention` gives a query that sees no key).

# %% [markdown]
# ### Exercise 7.1 — merge_attention_states (3 pts, ~15 min)
#
# `outs [n, ..., S_q, d_v]` and `lses [n, ..., S_q]` hold `n ≥ 1` parts' states, stacked on a
# leading axis. Return the merged `(out, lse)`, `out [..., S_q, d_v]` in `outs`' dtype and
# `lse [..., S_q]` in `lses`' dtype, computed in at least float32
# (`torch.promote_types(lses.dtype, torch.float32)`). A part with `lse = −∞` contributes nothing,
# whatever its `out` holds, and never makes NaN; if every part is `−∞`, return `out = 0` and
# `lse = −∞`.

# %% answer="merge_attention_states"
def merge_attention_states(outs, lses):
    """The attention state of the union of n disjoint key sets, from each set's state.

    outs: [n, ..., S_q, d_v], lses: [n, ..., S_q] (natural log)
    -> (out [..., S_q, d_v] in outs' dtype, lse [..., S_q] in lses' dtype).
    Example: merging the states of keys 0-4 and of keys 5-11 gives the state of keys 0-11.
    """
    ### BEGIN SOLUTION
    compute = torch.promote_types(lses.dtype, torch.float32)
    lses_c = lses.to(compute)
    lse = torch.logsumexp(lses_c, dim=0)  # [..., S_q]; -inf where every part is empty
    # e^(lse_i - lse), with 0 subtracted where every part is empty (never -inf - (-inf)):
    weights = torch.exp(lses_c - torch.where(torch.isfinite(lse), lse, 0.0))  # [n, ..., S_q]
    weights = weights[..., None]  # [n, ..., S_q, 1]
    # An empty part's out may hold anything (0 / 0 is NaN): choose, never multiply by 0.
    parts = torch.where(weights > 0, weights * outs.to(compute), 0.0)
    return parts.sum(dim=0).to(outs.dtype), lse.to(lses.dtype)
    ### END SOLUTION


# %% test="test_merge_attention_states" points=3
"""merge_attention_states: the state of the union; an empty part is the identity; any order."""
from attention_lab.checks.inference_attention import check_merge_attention_states

check_merge_attention_states(merge_attention_states)
### BEGIN HIDDEN TESTS
check_merge_attention_states(merge_attention_states, seed=7101)
### END HIDDEN TESTS

# %%
parts_out = torch.stack([out_a, torch.full_like(out_b, float("nan")), out_b])
parts_lse = torch.stack([lse_a, torch.full_like(lse_b, float("-inf")), lse_b])
merged_out, merged_lse = merge_attention_states(parts_out, parts_lse)
print("A, an empty part and B merged vs the whole: out",
      float((merged_out - whole_out).abs().max()),
      "| lse", float((merged_lse - whole_lse).abs().max()))

# %% [markdown]
# ## 2. Split-K decoding (Flash-Decoding)
#
# Notebook 06's FlashAttention kernel runs one program per *block of queries*. At a decoding step
# there is one query per sequence and head: a batch of 4 sequences with 32 query heads makes
# 128 programs — on a GPU with 132 multiprocessors (an H100), one program each, and every program
# walks its whole cache alone, one block of keys after another. With a long cache, a few programs
# do all the work while the GPU waits. **Flash-Decoding** (Dao, Haziza, Massa and Sizov, 2023)
# also splits the *keys*: program `(b·H_q + h, s)` attends the query of head `h` to the `s`-th of
# `num_splits` contiguous parts of the keys, writes that part's `(out, lse)`, and a last step merges
# the parts with exactly the rule of section 1. More programs, each with less to do; the same
# result.
#
# With grouped-query attention (notebook 05) the query heads `h = g·n_rep … g·n_rep + n_rep − 1`
# share KV head `g`, where `n_rep = H_q / H_kv`. Do **not** repeat K and V per query head (what 05's
# `repeat_kv` did, a copy `n_rep` times the cache) — reshape the queries instead:
# `q.reshape(B, H_kv, n_rep, d)` puts each KV head's query heads side by side, and a matrix product
# with that head's keys scores all of them at once.

# %% [markdown]
# ### Exercise 7.2 — split_kv_decode (3 pts, ~15 min)
#
# `q [B, H_q, d]`, `k, v [B, H_kv, L, d]`. Cut the `L` keys into `num_splits` contiguous parts of
# `ceil(L / num_splits)` keys (the last shorter; trailing parts empty when `num_splits > L`), compute
# each part's `(out, lse)` on its own, and merge them with your `merge_attention_states`. Return
# `out [B, H_q, d]` in q's dtype and `lse [B, H_q]` (natural log, at least float32). The default
# scale is `1/sqrt(d)`. Raise `ValueError` (naming the numbers) for `num_splits < 1`, `L < 1`, or
# `H_q` not a multiple of `H_kv`. The check watches every tensor your code creates: none may be a
# copy of K or V per query head.

# %% answer="split_kv_decode"
def split_kv_decode(q, k, v, num_splits, scale=None):
    """Flash-Decoding in PyTorch: attention of one query per sequence over L keys cut in num_splits.

    q: [B, H_q, d], k and v: [B, H_kv, L, d] -> (out [B, H_q, d] in q's dtype, lse [B, H_q]).
    Example: equals F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]
    for any num_splits.
    """
    ### BEGIN SOLUTION
    batch, heads, head_dim = q.shape
    kv_heads, seq_len = k.shape[1], k.shape[2]
    if num_splits < 1 or seq_len < 1:
        raise ValueError(f"num_splits = {num_splits} and L = {seq_len} must both be at least 1")
    if heads % kv_heads:
        raise ValueError(f"H_q = {heads} query heads is not a multiple of H_kv = {kv_heads}")
    scale = head_dim ** -0.5 if scale is None else scale
    compute = torch.promote_types(q.dtype, torch.float32)
    # query head h = g·n_rep + r sits at [g, r]: the n_rep heads of KV head g side by side
    grouped = q.to(compute).reshape(batch, kv_heads, heads // kv_heads, head_dim)
    split_len = math.ceil(seq_len / num_splits)
    outs, lses = [], []
    for split in range(num_splits):
        keys = k[:, :, split * split_len:(split + 1) * split_len].to(compute)  # [B, H_kv, n, d]
        values = v[:, :, split * split_len:(split + 1) * split_len].to(compute)
        scores = grouped @ keys.transpose(-2, -1) * scale  # [B, H_kv, n_rep, n]
        lse = torch.logsumexp(scores, dim=-1)  # -inf for an empty part
        weights = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
        outs.append(weights @ values)  # [B, H_kv, n_rep, d]: 0 for an empty part
        lses.append(lse)
    out, lse = merge_attention_states(torch.stack(outs), torch.stack(lses))
    return out.reshape(batch, heads, head_dim).to(q.dtype), lse.reshape(batch, heads)
    ### END SOLUTION


# %% test="test_split_kv_decode" points=3
"""split_kv_decode: equals SDPA (enable_gqa) for any split; GQA without a per-head copy of K/V."""
from attention_lab.checks.inference_attention import check_split_kv_decode

check_split_kv_decode(split_kv_decode)
### BEGIN HIDDEN TESTS
check_split_kv_decode(split_kv_decode, seed=7201)
### END HIDDEN TESTS

# %%
q_step = torch.randn(3, 8, 32, device=device)  # 3 sequences, 8 query heads
k_cache = torch.randn(3, 2, 300, 32, device=device)  # 2 KV heads, 300 cached tokens
v_cache = torch.randn(3, 2, 300, 32, device=device)
reference_step = F.scaled_dot_product_attention(q_step[:, :, None], k_cache, v_cache,
                                                enable_gqa=True)[:, :, 0]
for splits in (1, 4, 7, 400):
    out_step, _ = split_kv_decode(q_step, k_cache, v_cache, splits)
    difference = float((out_step - reference_step).abs().max())
    print(f"{splits:>3} splits: max difference from SDPA {difference:.1e}")

# %% [markdown]
# The result does not depend on the number of splits — 400 splits of 300 keys leave 100 of them
# empty, and they change nothing. What the number of splits changes is *how the work is spread*,
# which matters only on hardware that runs the parts at once.
#
# ### The same as a Triton kernel
#
# The launcher is given: `launch_split_kv_decode(kernel, q, k, v, num_splits, block=16,
# merge=None)` (read it with `launch_split_kv_decode??`). Its grid is `(B·H_q, num_splits)`;
# program `(b·H_q + h, s)` writes the state of split `s` for query head `h` of sequence `b` into
# `OutParts [B, H_q, num_splits, d]` and `LseParts [B, H_q, num_splits]` (float32), and the
# launcher merges them with the `merge` you pass (your `merge_attention_states`). Here is the
# argument list it passes, which fixes the kernel's signature:
#
# | arguments | meaning |
# | --- | --- |
# | `Q, K, V` | q `[B, H_q, d]`; k and v `[B, H_kv, L, d]`; the last axis is contiguous |
# | `OutParts, LseParts` | the parts' `out` (float32) and `lse` (natural log, float32) |
# | `stride_qb, stride_qh` | element `i` of query head `h` of sequence `b`: `Q + b·stride_qb + h·stride_qh + i` |
# | `stride_kb, stride_kh, stride_ks` (and `v`'s) | key `j` of KV head `g`: `K + b·stride_kb + g·stride_kh + j·stride_ks + i` |
# | `stride_ob, stride_oh, stride_os`, `stride_lb, stride_lh` | split `s` of `(b, h)`: `OutParts + b·stride_ob + h·stride_oh + s·stride_os + i`, `LseParts + b·stride_lb + h·stride_lh + s` |
# | `num_heads, num_kv_heads, seq_len, split_len, head_dim, sm_scale` | `H_q`, `H_kv`, `L`, `ceil(L / num_splits)`, `d`, `1/sqrt(d)` |
# | `BLOCK, BLOCK_D` | keys per tile; the next power of two `≥ d` (`tl.arange` needs one: mask the lanes `≥ head_dim`) |
#
# One query meets a tile of keys without a matrix product: `tl.sum(k * q[None, :], axis=1)` gives
# the tile's `BLOCK` scores, and `tl.sum(p[:, None] * v, axis=0)` its weighted values. (Decoding
# kernels do this: a `tl.dot` needs 16 rows on each side, and there is one query.)

# %%
from attention_lab.triton_kernels import (TRITON_AVAILABLE, interpreter_active,
                                          launch_split_kv_decode, tl, triton)

print("Triton available:", TRITON_AVAILABLE,
      "| runs in the interpreter (TRITON_INTERPRET=1):", interpreter_active())

# %% [markdown]
# ### Exercise 7.3 — split_kv_decode_kernel (3 pts, ~25 min)
#
# The prologue (which program this is, the query's load) and the stores are given. Write, in
# between:
#
# * **the KV head** of query head `h` (consecutive groups, as in notebook 05);
# * **the split's keys**: from `split·split_len` up to `min((split + 1)·split_len, seq_len)`; a
#   split past the end has none;
# * **the loop over tiles** of `BLOCK` keys, with notebook 06's online softmax (a running max
#   `m_i`, a rescaled sum `l_i`, an accumulator `acc`, all float32 and in registers). Mask every
#   tile at the **split's** end, not only at `seq_len`: the keys after it belong to the next split,
#   and a tile that reads them counts them twice. Mask the head dimension too;
# * **the state**: `out = acc / l_i` and `lse = m_i + log l_i` (natural log, if you used `tl.exp`);
#   an empty split writes `out = 0` and `lse = −∞` (and divides by nothing: `tl.where` first).
#
# Start `m_i` and `l_i` as float32 scalars the loop can update, as in 06's
# `online_softmax_kernel`: `tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)`. The check
# runs your kernel on lengths that are multiples of no block, head sizes that are not powers of
# two, with NaN stored right after every head's keys, values and features.

# %% answer="split_kv_decode_kernel"
@triton.jit
def split_kv_decode_kernel(Q, K, V, OutParts, LseParts,
                           stride_qb, stride_qh, stride_kb, stride_kh, stride_ks,
                           stride_vb, stride_vh, stride_vs,
                           stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                           num_heads, num_kv_heads, seq_len, split_len, head_dim, sm_scale,
                           BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """The state (out, lse) of one query head of one sequence over one split of its keys."""
    sequence_head = tl.program_id(0)  # b · H_q + h
    split = tl.program_id(1)
    b = sequence_head // num_heads
    h = sequence_head % num_heads
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    ### BEGIN SOLUTION
    kv_head = h // (num_heads // num_kv_heads)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    m_i = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    k_head = K + b * stride_kb + kv_head * stride_kh
    v_head = V + b * stride_vb + kv_head * stride_vh
    for block_start in range(start, end, BLOCK):
        offs = block_start + tl.arange(0, BLOCK)
        inside = offs < end  # the split's end: the next keys are the next split's
        tile_ok = inside[:, None] & d_ok[None, :]
        k = tl.load(k_head + offs[:, None] * stride_ks + offs_d[None, :], mask=tile_ok, other=0.0)
        v = tl.load(v_head + offs[:, None] * stride_vs + offs_d[None, :], mask=tile_ok, other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * sm_scale  # [BLOCK]
        s = tl.where(inside, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m_i = m_new
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)  # an empty split: divide by 1, then write 0 and -inf
    out = tl.where(has_keys, acc / l_safe, 0.0)
    lse = tl.where(has_keys, m_i + tl.log(l_safe), float("-inf"))
    ### END SOLUTION
    tl.store(OutParts + b * stride_ob + h * stride_oh + split * stride_os + offs_d, out, mask=d_ok)
    tl.store(LseParts + b * stride_lb + h * stride_lh + split, lse)


def triton_split_kv_decode(q, k, v, num_splits, block=16):
    """(out, lse) from your kernel, its parts merged by your merge_attention_states."""
    return launch_split_kv_decode(split_kv_decode_kernel, q, k, v, num_splits, block=block,
                                  merge=merge_attention_states)


# %% test="test_split_kv_decode_kernel" points=3
"""split_kv_decode_kernel: each split's (out, lse); GQA; ragged splits and tiles; empty splits."""
from attention_lab.checks.inference_attention import check_split_kv_decode_kernel

check_split_kv_decode_kernel(split_kv_decode_kernel)
### BEGIN HIDDEN TESTS
check_split_kv_decode_kernel(split_kv_decode_kernel, seed=7301, sizes="more")
### END HIDDEN TESTS

# %%
if TRITON_AVAILABLE:
    q_small, k_small, v_small = q_step[:1], k_cache[:1, :, :90], v_cache[:1, :, :90]
    out_kernel, lse_kernel = triton_split_kv_decode(q_small, k_small, v_small, num_splits=4)
    out_torch, lse_torch = split_kv_decode(q_small, k_small, v_small, num_splits=4)
    print("Triton vs PyTorch split-K: out", float((out_kernel - out_torch).abs().max()),
          "| lse", float((lse_kernel - lse_torch).abs().max()))
else:
    print("Triton is not installed here: open this notebook on Colab to run the kernel.")

# %% [markdown]
# **Where Flash-Decoding wins** is a question for a GPU, and this notebook does not answer it on
# the CPU: Triton's interpreter runs programs one after another. `make gpu-check` times the
# kernel against SDPA for one query per sequence over 1k … 128k keys at batch 1 and 4, on the
# GPU it is given.

# %% [markdown]
# ## 3. A paged KV cache (PagedAttention)
#
# Notebook 05's inference engines preallocate a cache of `max_len` tokens per sequence. A serving
# system does not know how long each answer will be, so it reserves `max_len` for every sequence
# it admits. Measure what that costs on a batch of uneven lengths: 16 sequences whose lengths
# (prompt and answer so far) follow a long-tailed distribution, with room for 2,048 tokens each,
# for one layer of 2 KV heads of 64 in 16-bit precision:

# %%
torch.manual_seed(7)
lengths = torch.distributions.LogNormal(math.log(300.0), 0.9).sample((16,)).clamp(8, 2048).long()
max_len, kv_heads_demo, head_dim_demo = 2048, 2, 64
contiguous = [torch.empty(2, max_len, kv_heads_demo, head_dim_demo, dtype=torch.float16)
              for _ in lengths]  # K and V of each sequence, max_len slots
reserved = sum(cache.untyped_storage().nbytes() for cache in contiguous)
bytes_per_token = 2 * kv_heads_demo * head_dim_demo * 2  # K and V, 2 bytes each
used = int(lengths.sum()) * bytes_per_token
print("lengths:", sorted(lengths.tolist()))
print(f"reserved {reserved / 2**20:.1f} MiB, holding tokens {used / 2**20:.2f} MiB: "
      f"{100 * used / reserved:.0f}% used, {100 * (1 - used / reserved):.0f}% wasted")
del contiguous

# %% [markdown]
# Most of the memory holds nothing. (The ratio does not depend on the heads or the precision:
# only on the lengths against `max_len`.) Kwon et al. (2023), who built vLLM, measured 20–38% of
# the cache holding tokens in the serving systems of the time; the rest was reserved for tokens not
# yet written, padding, and fragments too small for another request.
#
# **PagedAttention** borrows the operating system's answer: pages. The cache is one **pool** of
# `num_blocks` blocks of `block_size` token slots, `k_pool, v_pool [num_blocks, block_size, H_kv,
# d]`. Each sequence owns a **block table**, the list of the blocks it uses, in order; a sequence
# takes a block from a **free list** only when its length passes a multiple of `block_size`, so it
# wastes at most `block_size − 1` slots. Token `p` of a sequence lives in block
# `block_table[p // block_size]`, at offset `p % block_size`: its **slot** in the pool, flattened
# to `[num_blocks · block_size, H_kv, d]`, is
#
# $$\text{slot}(p) = \text{block\_table}[\lfloor p / \text{block\_size} \rfloor] \cdot \text{block\_size} + p \bmod \text{block\_size}.$$
#
# (vLLM computes this `slot_mapping` for every new token before writing it into the pool.)

# %% [markdown]
# ### Exercise 7.4 — slot_mapping (1 pt, ~5 min)
#
# Return the slots of positions `start ≤ p < end` as a LongTensor `[end − start]` (on the block
# table's device, when it is a tensor; `block_table` may also be a list). Raise `ValueError` when
# `start > end` or when the table has too few blocks for position `end − 1`.

# %% answer="slot_mapping"
def slot_mapping(block_table, start, end, block_size):
    """Pool slots of positions start ... end - 1 of a sequence with this block table.

    block_table: list or LongTensor [num_blocks_of_the_sequence] -> LongTensor [end - start].
    Example: slot_mapping([7, 2], 2, 6, 4) == [30, 31, 8, 9]
    """
    ### BEGIN SOLUTION
    table = torch.as_tensor(block_table, dtype=torch.long)
    if start > end:
        raise ValueError(f"start = {start} is after end = {end}")
    if end > table.numel() * block_size:
        raise ValueError(f"a block table of {table.numel()} blocks of {block_size} slots holds "
                         f"positions 0 ... {table.numel() * block_size - 1}, not {end - 1}")
    positions = torch.arange(start, end, device=table.device)
    return table[positions // block_size] * block_size + positions % block_size
    ### END SOLUTION


# %% test="test_slot_mapping" points=1
"""slot_mapping: block_table[p // block_size]·block_size + p % block_size; ValueError."""
from attention_lab.checks.inference_attention import check_slot_mapping

check_slot_mapping(slot_mapping)
### BEGIN HIDDEN TESTS
check_slot_mapping(slot_mapping, seed=7401)
### END HIDDEN TESTS

# %%
print("slots of positions 2-5 with blocks [7, 2] of 4:", slot_mapping([7, 2], 2, 6, 4).tolist())

# %% [markdown]
# **Forks and copy-on-write.** Parallel sampling (several answers to one prompt) and beam search
# make sequences that share a prefix. A `fork` gives the new sequence the *same* blocks — no copy —
# and counts the owners of each block (a **reference count**). Full blocks are never written again,
# so they can stay shared forever. The last block is partly filled: the first of the two sequences
# that writes into it must first get a **copy** of it (copy-on-write), or it would overwrite the
# other's tokens. A block goes back to the free list when its count falls to 0.

# %% [markdown]
# ### Exercise 7.5 — PagedKVCache (4 pts, ~30 min)
#
# * `PagedKVCache(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32,
#   device=None)`: the pools `k_pool, v_pool [num_blocks, block_size, H_kv, d]` and a free list of
#   every block; `num_free_blocks` says how many are free.
# * `new_sequence() -> int`: a new, empty sequence's id (ids are never reused).
# * `append(seq, k, v)` with `k, v [H_kv, n, d]` (n new tokens): take the blocks the new length needs
#   (exactly when it passes a multiple of `block_size`), copy the last block first if it is shared
#   and the new tokens go into it, then write the tokens into their slots (`slot_mapping`), cast to
#   the pool's dtype. If the free list cannot give every block this needs (the copy included),
#   raise `MemoryError` naming the blocks needed and the blocks free, and change nothing.
# * `block_table(seq) -> list[int]`, `seq_len(seq) -> int`.
# * `fork(seq) -> int`: a new sequence sharing every block of `seq`.
# * `free(seq)`: the sequence is gone; each of its blocks whose count reaches 0 is free again.
#
# An unknown or freed id raises `KeyError`; `k` or `v` of the wrong shape `ValueError`. Which block
# ids you hand out is your choice: the checks read what the blocks hold, not their numbers.

# %% answer="PagedKVCache"
class PagedKVCache:
    """Keys and values of many sequences in one pool of fixed-size blocks.

    Example: cache = PagedKVCache(8, 4, 2, 16); s = cache.new_sequence();
    cache.append(s, k, v) with k, v [2, 5, 16] takes 2 blocks: cache.num_free_blocks == 6.
    """

    def __init__(self, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32,
                 device=None):
        ### BEGIN SOLUTION
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size, self.num_kv_heads, self.head_dim = block_size, num_kv_heads, head_dim
        self.k_pool = torch.zeros(shape, dtype=dtype, device=device)
        self.v_pool = torch.zeros(shape, dtype=dtype, device=device)
        self.free_blocks = list(range(num_blocks))[::-1]  # a stack: pop() hands out 0, 1, 2 ...
        self.owners = [0] * num_blocks  # reference count of each block
        self.tables, self.lengths = {}, {}  # sequence id -> its blocks, its number of tokens
        self.next_id = 0
        ### END SOLUTION

    @property
    def num_free_blocks(self):
        ### BEGIN SOLUTION
        return len(self.free_blocks)
        ### END SOLUTION

    def new_sequence(self):
        ### BEGIN SOLUTION
        seq, self.next_id = self.next_id, self.next_id + 1
        self.tables[seq], self.lengths[seq] = [], 0
        return seq
        ### END SOLUTION

    def block_table(self, seq):
        ### BEGIN SOLUTION
        return list(self.tables[seq])
        ### END SOLUTION

    def seq_len(self, seq):
        ### BEGIN SOLUTION
        return self.lengths[seq]
        ### END SOLUTION

    def append(self, seq, k, v):
        ### BEGIN SOLUTION
        table, length = self.tables[seq], self.lengths[seq]
        expected = (self.num_kv_heads, k.shape[1] if k.dim() == 3 else -1, self.head_dim)
        if k.dim() != 3 or tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(f"k and v must be [H_kv={self.num_kv_heads}, n, d={self.head_dim}], "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        new_length = length + k.shape[1]
        new_blocks = -(-new_length // self.block_size) - len(table)
        # the new tokens go into the last, partly filled block: copy it first if it is shared
        copy_last = k.shape[1] > 0 and length % self.block_size != 0 and self.owners[table[-1]] > 1
        needed = new_blocks + copy_last
        if needed > len(self.free_blocks):
            raise MemoryError(f"appending {k.shape[1]} tokens needs {needed} blocks, "
                              f"{len(self.free_blocks)} are free")
        if copy_last:
            shared, copy = table[-1], self.free_blocks.pop()
            self.k_pool[copy], self.v_pool[copy] = self.k_pool[shared], self.v_pool[shared]
            self.owners[shared] -= 1
            self.owners[copy] = 1
            table[-1] = copy
        for _ in range(new_blocks):
            block = self.free_blocks.pop()
            self.owners[block] = 1
            table.append(block)
        slots = slot_mapping(table, length, new_length, self.block_size).to(self.k_pool.device)
        flat_k = self.k_pool.view(-1, self.num_kv_heads, self.head_dim)  # a view of the pool
        flat_v = self.v_pool.view(-1, self.num_kv_heads, self.head_dim)
        flat_k[slots] = k.transpose(0, 1).to(self.k_pool.dtype)  # [n, H_kv, d] into n slots
        flat_v[slots] = v.transpose(0, 1).to(self.v_pool.dtype)
        self.lengths[seq] = new_length
        ### END SOLUTION

    def fork(self, seq):
        ### BEGIN SOLUTION
        table, length = list(self.tables[seq]), self.lengths[seq]  # KeyError before a new id
        child = self.new_sequence()
        self.tables[child], self.lengths[child] = table, length
        for block in table:
            self.owners[block] += 1
        return child
        ### END SOLUTION

    def free(self, seq):
        ### BEGIN SOLUTION
        for block in self.tables.pop(seq):
            self.owners[block] -= 1
            if self.owners[block] == 0:
                self.free_blocks.append(block)
        del self.lengths[seq]
        ### END SOLUTION


# %% test="test_PagedKVCache" points=2
"""PagedKVCache: blocks taken when needed; K/V recoverable; free; MemoryError; ids; shapes."""
from attention_lab.checks.inference_attention import check_paged_kv_cache

check_paged_kv_cache(PagedKVCache)
### BEGIN HIDDEN TESTS
check_paged_kv_cache(PagedKVCache, seed=7501)
### END HIDDEN TESTS

# %% test="test_PagedKVCache_fork" points=2
"""PagedKVCache.fork: blocks shared by count; copy-on-write leaves the other sequence as it was."""
from attention_lab.checks.inference_attention import check_paged_kv_cache_fork

check_paged_kv_cache_fork(PagedKVCache)
### BEGIN HIDDEN TESTS
check_paged_kv_cache_fork(PagedKVCache, seed=7502)
### END HIDDEN TESTS

# %% [markdown]
# **Look at it.** The view replays a short story with your `PagedKVCache` (pool of 12 blocks of 4
# slots): sequence A takes its prompt, grows token by token, is forked twice (two samples of the
# same prompt), and the samples write their own tokens. Slide through the steps: each block of the
# pool is coloured by its owners (striped when shared); the tables below show which blocks each
# sequence reads, in order. Watch the step where a sample first writes into the shared, partly
# filled block.

# %%
from attention_lab.widgets.inference_attention import block_table_view

block_table_view(PagedKVCache)

# %% [markdown]
# ### Attention over the paged cache
#
# At a decoding step the batch's sequences have their own lengths `seq_lens [B]` and block tables,
# padded to one width with `−1`: `block_tables [B, max_blocks]`. Attention for sequence `b` reads
# its own first `seq_lens[b]` slots and nothing else — not the slots after its last token (they hold
# whatever the block held before: another sequence's old tokens), and not the pool past its table.
# (vLLM's `paged_attention` kernel reads the pool in place, block by block; in PyTorch, gather the
# sequence's slots.)

# %% [markdown]
# ### Exercise 7.6 — paged_decode_attention (3 pts, ~15 min)
#
# `q [B, H_q, d]`, pools `[num_blocks, block_size, H_kv, d]`, `block_tables [B, max_blocks]`
# (LongTensor, padded with −1), `seq_lens [B]` (each ≥ 1). Return `out [B, H_q, d]` in q's dtype:
# sequence `b`'s query heads attend to the keys and values in its first `seq_lens[b]` slots (GQA as in
# 7.2; default scale `1/sqrt(d)`). Raise `ValueError` when a table has too few blocks for its
# sequence. The check fills every slot no sequence may read, and the pool's unused blocks, with
# NaN, and watches that no tensor as large as the pool is made.

# %% answer="paged_decode_attention"
def paged_decode_attention(q, k_pool, v_pool, block_tables, seq_lens, scale=None):
    """Decoding attention over a paged cache: each sequence reads only its own slots.

    q: [B, H_q, d], k_pool and v_pool: [num_blocks, block_size, H_kv, d],
    block_tables: [B, max_blocks] (-1: no block), seq_lens: [B] -> out [B, H_q, d].
    Example: equals SDPA over each sequence's keys gathered in order.
    """
    ### BEGIN SOLUTION
    batch, heads, head_dim = q.shape
    block_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    compute = torch.promote_types(q.dtype, torch.float32)
    flat_k = k_pool.view(-1, kv_heads, head_dim)  # [num_blocks · block_size, H_kv, d]: a view
    flat_v = v_pool.view(-1, kv_heads, head_dim)
    outs = []
    for b in range(batch):
        length = int(seq_lens[b])
        blocks = block_tables[b, :-(-length // block_size)]
        if blocks.numel() * block_size < length or bool((blocks < 0).any()):
            raise ValueError(f"sequence {b} has {length} tokens, more than its block table "
                             f"{block_tables[b].tolist()} holds")
        slots = slot_mapping(blocks, 0, length, block_size).to(q.device)
        keys, values = flat_k[slots].to(compute), flat_v[slots].to(compute)  # [len, H_kv, d]
        grouped = q[b].to(compute).reshape(kv_heads, heads // kv_heads, head_dim)
        scores = torch.einsum("grd,tgd->grt", grouped, keys) * scale  # [H_kv, n_rep, len]
        weights = torch.softmax(scores, dim=-1)
        outs.append(torch.einsum("grt,tgd->grd", weights, values).reshape(heads, head_dim))
    return torch.stack(outs).to(q.dtype)
    ### END SOLUTION


# %% test="test_paged_decode_attention" points=3
"""paged_decode_attention: SDPA over each sequence's own slots; reads nothing else; ValueError."""
from attention_lab.checks.inference_attention import check_paged_decode_attention

check_paged_decode_attention(paged_decode_attention)
### BEGIN HIDDEN TESTS
check_paged_decode_attention(paged_decode_attention, seed=7601)
### END HIDDEN TESTS

# %% [markdown]
# **Decode through the cache.** Three sequences of different lengths in one pool, decoded together
# for a few steps with your `PagedKVCache` and `paged_decode_attention`, against SDPA over each
# sequence's keys kept contiguous:

# %%
torch.manual_seed(1)
pool = PagedKVCache(num_blocks=16, block_size=4, num_kv_heads=2, head_dim=16)
prompts = [5, 9, 2]
kept_keys = [torch.randn(2, n, 16) for n in prompts]  # the contiguous reference
kept_values = [torch.randn(2, n, 16) for n in prompts]
ids = [pool.new_sequence() for _ in prompts]
for seq, k_seq, v_seq in zip(ids, kept_keys, kept_values):
    pool.append(seq, k_seq, v_seq)
worst = 0.0
for step in range(3):
    for index, seq in enumerate(ids):  # every sequence writes its new token first
        k_new, v_new = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
        pool.append(seq, k_new, v_new)
        kept_keys[index] = torch.cat([kept_keys[index], k_new], dim=1)
        kept_values[index] = torch.cat([kept_values[index], v_new], dim=1)
    width = max(len(pool.block_table(seq)) for seq in ids)
    tables = torch.tensor([pool.block_table(seq) + [-1] * (width - len(pool.block_table(seq)))
                           for seq in ids])
    lens = torch.tensor([pool.seq_len(seq) for seq in ids])
    q_now = torch.randn(3, 4, 16)  # 4 query heads, 2 KV heads
    paged = paged_decode_attention(q_now, pool.k_pool, pool.v_pool, tables, lens)
    for index in range(3):
        expected = F.scaled_dot_product_attention(q_now[index][:, None], kept_keys[index],
                                                  kept_values[index], enable_gqa=True)[:, 0]
        worst = max(worst, float((paged[index] - expected).abs().max()))
print("lengths", lens.tolist(), "| blocks taken", 16 - pool.num_free_blocks,
      "| max difference from contiguous SDPA:", worst)

# %% [markdown]
# **Measure it again**, paged. The same batch of uneven lengths, appended into your
# `PagedKVCache` with blocks of 16 slots (vLLM's default): what the pool hands out, against the
# contiguous `max_len` reservation measured above. The view counts the blocks your cache took for
# each block size; a block size of 1 wastes nothing but makes a table as long as the sequence.

# %%
from attention_lab.widgets.inference_attention import cache_memory_view

cache_memory_view(PagedKVCache, lengths.tolist(), max_len=max_len, block_size=16)

# %% [markdown]
# ### Exercise 7.7 — what a prefix cache can share (2 pts, ~5 min)
#
# vLLM and SGLang keep the blocks of finished requests and hand them to new requests whose tokens
# begin the same way (a **prefix cache**): the new request forks them instead of computing them. For
# each case, say whether the cached blocks can be reused, how much of them, and why: (a) two chats
# with the same 500-token system prompt and different questions; (b) the same prompt sent again with
# another sampling temperature; (c) the same question with the system prompt after it instead of
# before; (d) the same prompt sent to a model that uses a sliding window of 128 tokens in every layer.

# %% [markdown] manual="prefix_cache_sharing" points=2
# A cached key or value of token `p` depends on the tokens `0 … p` (through every layer below it)
# and on the position `p` (RoPE); it depends on nothing after `p`, and not on how the next tokens
# are sampled. So a cached block can be reused exactly when the new request's tokens up to the
# block's last position are the same tokens, at the same positions.
#
# (a) Yes: the blocks of the 500-token system prompt (the full ones: 31 blocks of 16, plus the
# partial 32nd's first 4 tokens, which copy-on-write protects); the question differs, so its blocks
# are computed anew. (b) Yes, all of the prompt: sampling happens after attention; only the new,
# sampled tokens differ. (c) No: the first tokens differ, and every later token's keys and values
# depend on them (and the system prompt sits at other positions, so even its own tokens rotate
# differently). (d) Yes, as far as the tokens agree: a window changes what each query reads, not
# what a key or value is, and the K/V of token `p` still depends on earlier tokens (a window lets
# layer `l` reach back `l·(W − 1)` tokens, not only `W`); but the model only ever reads the last
# `W` positions per layer, so only the blocks of the last `W` tokens of the shared prefix need to be
# kept in memory for the next tokens.

# %% [markdown]
# ## 4. Windows and sinks
#
# A sliding window bounds what each query reads: the query at position `p` attends to the keys
# `p − W < j ≤ p`, the `W` most recent including itself (fewer at the start). Mistral 7B uses a
# window of 4,096 in every layer; Gemma 2 and 3, and gpt-oss, mix windowed layers with layers that
# see everything. A windowed layer's cache needs only the last `W` tokens.

# %% [markdown]
# ### Exercise 7.8 — sliding_window_mask (1 pt, ~5 min)
#
# Return the `[q_len, kv_len]` boolean mask, True where query `i` may attend to key `j`. Query `i` is
# at position `p = i + kv_len − q_len` (bottom-right, as in 05 and 06) and sees keys
# `p − window < j ≤ p`: exactly `window` keys including itself, fewer at the start (a query at a
# negative position, possible when `q_len > kv_len`, sees none). `window < 1` raises `ValueError`.

# %% answer="sliding_window_mask"
def sliding_window_mask(q_len, kv_len, window):
    """Causal sliding-window mask, aligned bottom-right: True where query i may attend to key j.

    returns: BoolTensor [q_len, kv_len], True where p - window < j <= p, p = i + kv_len - q_len.
    Example: sliding_window_mask(3, 3, 2).int() == [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    ### BEGIN SOLUTION
    if window < 1:
        raise ValueError(f"window = {window}: a query must see at least itself (window >= 1)")
    positions = torch.arange(q_len)[:, None] + (kv_len - q_len)  # each query's position p
    keys = torch.arange(kv_len)[None, :]
    return (keys <= positions) & (keys > positions - window)
    ### END SOLUTION


# %% test="test_sliding_window_mask" points=1
"""sliding_window_mask: p - window < j <= p, bottom-right; exactly window keys; ValueError."""
from attention_lab.checks.inference_attention import check_sliding_window_mask

check_sliding_window_mask(sliding_window_mask)
### BEGIN HIDDEN TESTS
check_sliding_window_mask(sliding_window_mask, seed=7801)
### END HIDDEN TESTS

# %%
print(sliding_window_mask(6, 6, 3).int())

# %% [markdown]
# ### Exercise 7.9 — the reach of a window (2 pts, ~5 min)
#
# Mistral 7B has 32 layers, each with a window of 4,096 tokens. A query in the last layer reads only
# 4,096 positions. How far back can information from the prompt still reach it, and why? What does
# that say about what a windowed model "remembers", and what can it not do that full attention can?

# %% [markdown] manual="window_reach" points=2
# Each layer moves information at most `W − 1` positions forward: the output at position `p` of
# layer `l` mixes the layer's inputs at `p − W + 1 … p`, and those inputs were themselves computed
# by layer `l − 1` from their own windows. Over `L` layers the reach adds up: position `p` of the last
# layer depends on inputs as far back as `p − L·(W − 1)`, about 32 × 4,095 ≈ 131k tokens for Mistral 7B
# (the receptive field of a stack of convolutions). But it is reach, not memory: whatever crosses
# more than one window must be carried forward in the hidden states of intermediate tokens, compressed
# and overwritten layer by layer, while full attention can read any earlier token directly, in one
# step, exactly. A windowed model cannot copy an exact long string (a number, a quote) from far back
# the way full attention can; that is why recent models mix windowed layers with full ones.

# %% [markdown]
# ### StreamingLLM: sinks and a rolling window
#
# A rolling window that drops the oldest tokens sounds free: keep the last `n_recent` keys. Xiao et
# al. (2023) report that it is not: in the models they measured (Llama 2, MPT, Falcon, Pythia), the
# perplexity exploded as soon as the *first* tokens left the cache, although those tokens carried
# little meaning. Their attention heads put large weight on the first tokens whatever the content —
# "attention sinks": the softmax must give its mass to some key, and training teaches heads to park
# it there. Their fix, **StreamingLLM**: keep the first `n_sink` tokens (4 in the paper) and the
# last `n_recent`.
#
# We cannot measure their perplexities here (that takes a trained model); we can measure the
# mechanism that forces a sink: a softmax row always sums to 1. A query whose keys are all
# unrelated (scores near 0) must still spread all of its weight over them:

# %%
unrelated = torch.zeros(1, 6) + 0.05 * torch.randn(1, 6)  # a query that matches no key
related = torch.tensor([[4.0, 0.1, -0.2, 0.0, 0.3, 0.1]])  # a query that matches key 0
for name, row in (("matches no key", unrelated), ("matches key 0", related)):
    weights_row = torch.softmax(row, dim=-1)
    print(f"{name:>15}: weights {[round(w, 2) for w in weights_row[0].tolist()]}, "
          f"sum {float(weights_row.sum()):.2f}")

# %% [markdown]
# With nothing to attend to, the output is still an average of the values, `(1/n) Σ v_j`, and that
# average changes whenever a token enters or leaves the cache. A head that learned to send such mass
# to the first token depends on the first token staying.
#
# **Positions in the cache.** StreamingLLM's second point: RoPE rotates each key by a position, and
# a cache that drops tokens must decide which. It rotates the keys by their position **in the cache**,
# `0 … len − 1`, and the query by `len − 1`, so the distances the model sees stay within those it
# was trained on, however long the stream. That means caching keys **before** RoPE and rotating the
# kept ones at every step (or re-rotating them when the cache shifts).

# %% [markdown]
# ### Exercise 7.10 — streaming_kept_positions (1 pt, ~3 min)
#
# Return the token positions StreamingLLM keeps for a sequence of `seq_len` tokens: the first
# `n_sink` and the last `n_recent`, in order and without duplicates (all `seq_len` when
# `seq_len ≤ n_sink + n_recent`), as a LongTensor. A negative argument raises `ValueError`.

# %% answer="streaming_kept_positions"
def streaming_kept_positions(seq_len, n_sink, n_recent):
    """Positions StreamingLLM keeps: the first n_sink and the last n_recent tokens.

    returns: LongTensor [min(seq_len, n_sink + n_recent)], increasing.
    Example: streaming_kept_positions(10, 2, 3) == [0, 1, 7, 8, 9]
    """
    ### BEGIN SOLUTION
    if min(seq_len, n_sink, n_recent) < 0:
        raise ValueError(f"seq_len = {seq_len}, n_sink = {n_sink} and n_recent = {n_recent} must "
                         "not be negative")
    if seq_len <= n_sink + n_recent:
        return torch.arange(seq_len)
    return torch.cat([torch.arange(n_sink), torch.arange(seq_len - n_recent, seq_len)])
    ### END SOLUTION


# %% test="test_streaming_kept_positions" points=1
"""streaming_kept_positions: the first n_sink and last n_recent, in order, no duplicates."""
from attention_lab.checks.inference_attention import check_streaming_kept_positions

check_streaming_kept_positions(streaming_kept_positions)
### BEGIN HIDDEN TESTS
check_streaming_kept_positions(streaming_kept_positions, seed=7901)
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 7.11 — streaming_decode (3 pts, ~15 min)
#
# One decoding step of StreamingLLM. `q_raw [B, H, d]` is the newest token's query before RoPE;
# `k_raw, v [B, H, T, d]` are the keys (before RoPE) and values of all `T` tokens so far, the newest
# included. Keep the positions `streaming_kept_positions(T, n_sink, n_recent)`, rotate the kept keys
# at their positions in the cache `0 … len − 1` and the query at `len − 1` (with `apply_rope_at`, or
# your own RoPE in Meta's layout with `θ_j = rope_base^(−2j/d)`), and attend with scale
# `1/sqrt(d)`. Return `out [B, H, d]` in q's dtype.

# %% answer="streaming_decode"
def streaming_decode(q_raw, k_raw, v, n_sink, n_recent, rope_base=10000.0):
    """StreamingLLM's decoding step: attention sinks + recent tokens, rotated at cache positions.

    q_raw: [B, H, d], k_raw and v: [B, H, T, d] (before RoPE; the newest token last)
    -> out [B, H, d].
    Example: with T <= n_sink + n_recent it is causal attention at positions 0 ... T - 1.
    """
    ### BEGIN SOLUTION
    kept = streaming_kept_positions(k_raw.shape[2], n_sink, n_recent).to(k_raw.device)
    cache_positions = torch.arange(len(kept), device=k_raw.device)  # 0 ... len - 1
    keys = apply_rope_at(k_raw[:, :, kept], cache_positions, rope_base)  # [B, H, len, d]
    query = apply_rope_at(q_raw[:, :, None], cache_positions[-1:], rope_base)  # at len - 1
    out = F.scaled_dot_product_attention(query, keys, v[:, :, kept])  # [B, H, 1, d]
    return out[:, :, 0]
    ### END SOLUTION


# %% test="test_streaming_decode" points=3
"""streaming_decode: kept keys rotated at cache positions 0..len-1, the query at len-1."""
from attention_lab.checks.inference_attention import check_streaming_decode

check_streaming_decode(streaming_decode)
### BEGIN HIDDEN TESTS
check_streaming_decode(streaming_decode, seed=8001)
### END HIDDEN TESTS

# %% [markdown]
# **Keys cached after RoPE.** An engine that caches keys the usual way — rotated once, at their
# original positions, as notebook 05's `KVCache` held them — and drops tokens from the middle gets
# something else. Until the first eviction, both are plain causal attention and agree; after it, the
# after-RoPE cache sees distances that grow with the stream (the newest query at position `T − 1`
# against sinks at 0 … 3), while StreamingLLM's stay below `n_sink + n_recent`:

# %%
torch.manual_seed(3)
stream_q = torch.randn(1, 2, 16, dtype=torch.float64)
stream_k = torch.randn(1, 2, 40, 16, dtype=torch.float64)
stream_v = torch.randn(1, 2, 40, 16, dtype=torch.float64)
for length in (8, 12, 13, 20, 40):
    ours = streaming_decode(stream_q, stream_k[:, :, :length], stream_v[:, :, :length], 4, 8)
    kept = streaming_kept_positions(length, 4, 8)
    after_rope = F.scaled_dot_product_attention(  # keys rotated at their original positions
        apply_rope_at(stream_q[:, :, None], torch.tensor([length - 1])),
        apply_rope_at(stream_k[:, :, :length], torch.arange(length))[:, :, kept],
        stream_v[:, :, kept])[:, :, 0]
    print(f"T = {length:>2}: kept {len(kept):>2} keys, largest distance "
          f"{length - 1:>2} (after RoPE) vs {len(kept) - 1:>2} (StreamingLLM); "
          f"outputs differ by {float((ours - after_rope).abs().max()):.2e}")

# %% [markdown]
# Up to 12 tokens (4 sinks + 8 recent) nothing is evicted and the two agree to rounding; from the
# 13th on, the cache has a gap and the two compute different things. StreamingLLM rotates at cache
# positions; this cell shows only that the choice changes the result, not which one a trained model
# handles better (that takes a trained model).
#
# ### gpt-oss's learned sinks
#
# gpt-oss builds the sink into the softmax instead: each head has one learned logit `sink_h` that
# joins every row's denominator and attends to nothing,
#
# $$w_j = \frac{e^{s_j}}{e^{\text{sink}_h} + \sum_{j'} e^{s_{j'}}},\qquad \text{out} = \sum_j w_j v_j .$$
#
# A row's weights now sum to `1 − p_sink`, where `p_sink = e^{sink}/(e^{sink} + Σ e^{s})`: a query
# with nothing to read can give its mass away instead of averaging values. (The sink is a logit, not a
# score: it is **not** multiplied by the scale.) gpt-oss uses it in every layer, with a window of 128
# tokens in every other layer.

# %% [markdown]
# ### Exercise 7.12 — attention_with_sinks (2 pts, ~10 min)
#
# `q [B, H, S_q, d]`, `k, v [B, H, S_k, d]`, `sinks [H]`. Causal (bottom-right) attention, windowed
# as `sliding_window_mask` when `window` is given, with each head's sink logit in the denominator:
# `softmax([scores, sink])[..., :-1] @ v`. Default scale `1/sqrt(d)`; `sinks = −∞` gives plain
# attention; a query that sees no key gives 0. Return q's dtype (computed in at least float32).

# %% answer="attention_with_sinks"
def attention_with_sinks(q, k, v, sinks, window=None, scale=None):
    """Causal attention whose softmax has one extra logit per head that attends to nothing.

    q: [B, H, S_q, d], k and v: [B, H, S_k, d], sinks: [H] -> out [B, H, S_q, d].
    Example: with sinks = -inf it equals causal (windowed) attention.
    """
    ### BEGIN SOLUTION
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = q.to(compute) @ k.to(compute).transpose(-2, -1) * scale  # [B, H, S_q, S_k]
    allowed = sliding_window_mask(seq_q, seq_k, window if window is not None else seq_k + seq_q)
    scores = scores.masked_fill(~allowed.to(q.device), float("-inf"))
    sink = sinks.to(device=q.device, dtype=compute).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    logits = torch.cat([scores, sink], dim=-1)  # [B, H, S_q, S_k + 1]
    top = logits.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)  # a row of -inf only: subtract 0
    exps = torch.exp(logits - top)
    total = exps.sum(dim=-1, keepdim=True)
    weights = exps[..., :-1] / torch.where(total > 0, total, 1.0)  # the sink's column dropped
    return (weights @ v.to(compute)).to(q.dtype)
    ### END SOLUTION


# %% test="test_attention_with_sinks" points=2
"""attention_with_sinks: the sink in the denominator only; causal, windowed; -inf is plain."""
from attention_lab.checks.inference_attention import check_attention_with_sinks

check_attention_with_sinks(attention_with_sinks)
### BEGIN HIDDEN TESTS
check_attention_with_sinks(attention_with_sinks, seed=8101)
### END HIDDEN TESTS

# %%
q_probe = torch.zeros(1, 1, 2, 6)
k_probe = torch.eye(6)[None, None] * math.sqrt(6)  # key j = e_j: the score of key j is q_j
q_probe[0, 0, 0], q_probe[0, 0, 1] = unrelated[0], related[0]
for sink_logit in (float("-inf"), 0.0, 2.0):
    out_sink = attention_with_sinks(q_probe, k_probe, torch.eye(6)[None, None],
                                    torch.tensor([sink_logit]))
    print(f"sink logit {sink_logit:>4}: weight left for the keys, no match "
          f"{float(out_sink[0, 0, 0].sum()):.2f}, a match {float(out_sink[0, 0, 1].sum()):.2f}")

# %% [markdown]
# (The values are the identity, so each output row *is* the row of weights, and its sum is the
# mass left for the keys.) With a sink logit of 2, a query that matches nothing gives most of its mass
# away, while a query that matches key 0 keeps nearly all of it: what the learned logit is for.

# %% [markdown]
# ## 5. Latent attention (DeepSeek's MLA)
#
# GQA shrinks the cache by sharing K/V heads. DeepSeek-V2 and V3 go further with **multi-head
# latent attention**: every head's key and value are linear functions of one small **latent** vector
# per token, and only the latent is cached — no head axis at all. Per token, with
# `x [D]` (rows of the weights as `nn.Linear` stores them, `[out, in]`):
#
# * the cache entry: `c = RMSNorm(W_DKV^c x)` (`kv_lora_rank` numbers), plus one small key part
#   `k_pe = RoPE(W_DKV^pe x)` (`qk_rope_dim` numbers) **shared by every head**;
# * head `h`'s key: `[W_UK,h c ; k_pe]` (its `qk_nope_dim` "no position" features, then the shared
#   rotated part); its value: `W_UV,h c` (`v_dim`);
# * head `h`'s query: `[q_nope,h ; RoPE(q_pe,h)]` from `W_Q x`;
# * scores `q·k / sqrt(qk_nope_dim + qk_rope_dim)`, causal softmax, the heads' outputs through `W_O`.
#
# `MLAWeights` (given) holds the matrices in DeepSeek's layout: `w_q [H·(nope + rope), D]`;
# `w_dkv [kv_lora_rank + rope, D]` (the latent's rows first); `kv_norm_weight`;
# `w_ukv [H·(nope + v), kv_lora_rank]` with, **per head**, its `qk_nope_dim` key rows (`W_UK,h`)
# then its `v_dim` value rows (`W_UV,h`), as DeepSeek's `wkv_b`; `w_o [D, H·v_dim]`.
#
# **Why a separate RoPE part?** RoPE multiplies the key by a rotation that depends on the key's
# position. If the whole key were rotated, `q·R_p k` would tie `W_UK` to each position, and it could
# not be folded into the query once for all cached tokens (the absorbed form below). So MLA
# rotates only a small extra part, `k_pe`, and leaves the latent's part without positions.

# %%
from attention_lab.latent_attention import MLAWeights

torch.manual_seed(0)
mla_weights = MLAWeights.random(hidden_size=64, n_heads=4, kv_lora_rank=16, qk_nope_dim=8,
                                qk_rope_dim=4, v_dim=8, dtype=torch.float64)
print({name: tuple(getattr(mla_weights, name).shape)
       for name in ("w_q", "w_dkv", "kv_norm_weight", "w_ukv", "w_o")})

# %% [markdown]
# ### Exercise 7.13 — mla_cache_entry (2 pts, ~10 min)
#
# `x [B, T, D]`, `positions` LongTensor `[T]`. Return what MLA caches for these tokens:
# `latent [B, T, kv_lora_rank]` (the first `kv_lora_rank` outputs of `x @ w_dkvᵀ`, RMS-normalised
# over that axis with `eps = w.norm_eps` and multiplied by `w.kv_norm_weight`) and
# `k_pe [B, T, qk_rope_dim]` (the remaining outputs, rotated at `positions` by RoPE in Meta's layout
# with `w.rope_base`) — no head axis.

# %% answer="mla_cache_entry"
def mla_cache_entry(x, w, positions):
    """MLA's cache entry of each token: the normalised latent and the shared rotated key part.

    x: [B, T, D], positions: [T] -> (latent [B, T, kv_lora_rank], k_pe [B, T, qk_rope_dim]).
    Example: for w with kv_lora_rank 16 and qk_rope_dim 4, shapes [B, T, 16] and [B, T, 4].
    """
    ### BEGIN SOLUTION
    compressed = x @ w.w_dkv.T  # [B, T, kv_lora_rank + qk_rope_dim]
    latent, k_pe = compressed.split([w.kv_lora_rank, w.qk_rope_dim], dim=-1)
    rms = torch.rsqrt(latent.pow(2).mean(dim=-1, keepdim=True) + w.norm_eps)
    latent = latent * rms * w.kv_norm_weight
    return latent, apply_rope_at(k_pe, positions, w.rope_base)
    ### END SOLUTION


# %% test="test_mla_cache_entry" points=2
"""mla_cache_entry: RMS-normed latent and one RoPE key part per token, no head axis."""
from attention_lab.checks.inference_attention import check_mla_cache_entry

check_mla_cache_entry(mla_cache_entry)
### BEGIN HIDDEN TESTS
check_mla_cache_entry(mla_cache_entry, seed=8301)
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 7.14 — mla_attention_naive (2 pts, ~10 min)
#
# `x [B, T_q, D]` are the new tokens at `positions [T_q]`; `latent [B, T_k, kv_lora_rank]` and
# `k_pe [B, T_k, qk_rope_dim]` are the whole cache, x's own tokens included (its last `T_q`). Rebuild
# every head's key (`latent @ W_UK,hᵀ` concatenated with the shared `k_pe`) and value
# (`latent @ W_UV,hᵀ`), then causal attention (bottom-right) with scale
# `1/sqrt(qk_nope_dim + qk_rope_dim)`, and `w_o`. Return `[B, T_q, D]`.

# %% answer="mla_attention_naive"
def mla_attention_naive(x, w, latent, k_pe, positions):
    """MLA by rebuilding every head's keys and values from the cached latent.

    x: [B, T_q, D], latent: [B, T_k, kv_lora_rank], k_pe: [B, T_k, qk_rope_dim],
    positions: [T_q] -> [B, T_q, D].
    """
    ### BEGIN SOLUTION
    batch, seq_q, _ = x.shape
    seq_k = latent.shape[1]
    heads, nope, rope, v_dim = w.n_heads, w.qk_nope_dim, w.qk_rope_dim, w.v_dim
    q = (x @ w.w_q.T).view(batch, seq_q, heads, nope + rope).transpose(1, 2)  # [B, H, T_q, n+r]
    q_nope, q_pe = q.split([nope, rope], dim=-1)
    q_pe = apply_rope_at(q_pe, positions, w.rope_base)
    w_uk, w_uv = w.w_ukv.view(heads, nope + v_dim, -1).split([nope, v_dim], dim=1)
    k_nope = torch.einsum("btr,hnr->bhtn", latent, w_uk)  # [B, H, T_k, nope]: per-head keys
    values = torch.einsum("btr,hvr->bhtv", latent, w_uv)  # [B, H, T_k, v_dim]
    keys = torch.cat([k_nope, k_pe[:, None].expand(batch, heads, seq_k, rope)], dim=-1)
    queries = torch.cat([q_nope, q_pe], dim=-1)
    scores = queries @ keys.transpose(-2, -1) / math.sqrt(nope + rope)  # [B, H, T_q, T_k]
    causal = torch.ones(seq_q, seq_k, dtype=torch.bool, device=x.device).tril(seq_k - seq_q)
    weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    heads_out = (weights @ values).transpose(1, 2).reshape(batch, seq_q, heads * v_dim)
    return heads_out @ w.w_o.T
    ### END SOLUTION


# %% test="test_mla_attention_naive" points=2
"""mla_attention_naive: per-head keys and values from the latent; scale 1/sqrt(nope + rope)."""
from attention_lab.checks.inference_attention import check_mla_attention_naive

check_mla_attention_naive(mla_attention_naive)
### BEGIN HIDDEN TESTS
check_mla_attention_naive(mla_attention_naive, seed=8401)
### END HIDDEN TESTS

# %% [markdown]
# **Absorb the up-projections.** The naive form rebuilds `[B, H, T_k, nope]` keys and
# `[B, H, T_k, v_dim]` values at every step: per head, over the whole cache — the memory the latent
# saved, spent again. But the products regroup. For head `h`, with `q_nope,h` a row vector:
#
# $$q_{\text{nope},h} \cdot (W_{UK,h}\, c_j) = (q_{\text{nope},h} W_{UK,h}) \cdot c_j ,\qquad
#   \sum_j w_j\, W_{UV,h} c_j = W_{UV,h} \Big(\sum_j w_j c_j\Big).$$
#
# Multiply the query by `W_UK,h` once (a `[kv_lora_rank]` vector per head and query) and score it
# against the cached latents directly; sum the latents with the attention weights, and apply `W_UV,h`
# once, after. (The DeepSeek-V2 paper notes that `W_UV` can be folded further into `W_O`.) No
# per-head key or value over the cache ever exists.

# %% [markdown]
# ### Exercise 7.15 — mla_attention_absorbed (3 pts, ~20 min)
#
# The same signature and result as `mla_attention_naive`, without forming a per-head key or value:
# no tensor `[B, H, T_k, qk_nope_dim]` or `[B, H, T_k, v_dim]` (in any axis order) may appear — the
# check watches every tensor your code creates during a decoding step. Scores `[…, H, T_q, T_k]`
# and per-head outputs after `W_UV` are fine. In float64 it must equal your naive form to `1e-10`:
# keep float64 throughout here.

# %% answer="mla_attention_absorbed"
def mla_attention_absorbed(x, w, latent, k_pe, positions):
    """MLA with W_UK absorbed into the query and W_UV applied after the weighted sum.

    Same arguments and result as mla_attention_naive; never a per-head key or value.
    """
    ### BEGIN SOLUTION
    batch, seq_q, _ = x.shape
    seq_k = latent.shape[1]
    heads, nope, rope, v_dim = w.n_heads, w.qk_nope_dim, w.qk_rope_dim, w.v_dim
    q = (x @ w.w_q.T).view(batch, seq_q, heads, nope + rope).transpose(1, 2)
    q_nope, q_pe = q.split([nope, rope], dim=-1)
    q_pe = apply_rope_at(q_pe, positions, w.rope_base)  # [B, H, T_q, rope]
    w_uk, w_uv = w.w_ukv.view(heads, nope + v_dim, -1).split([nope, v_dim], dim=1)
    q_latent = torch.einsum("bhqn,hnr->bhqr", q_nope, w_uk)  # W_UK absorbed: [B, H, T_q, rank]
    scores = (torch.einsum("bhqr,btr->bhqt", q_latent, latent)  # against the latents directly
              + torch.einsum("bhqe,bte->bhqt", q_pe, k_pe)) / math.sqrt(nope + rope)
    causal = torch.ones(seq_q, seq_k, dtype=torch.bool, device=x.device).tril(seq_k - seq_q)
    weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    latent_out = torch.einsum("bhqt,btr->bhqr", weights, latent)  # [B, H, T_q, rank]
    heads_out = torch.einsum("bhqr,hvr->bqhv", latent_out, w_uv)  # W_UV after: [B, T_q, H, v]
    return heads_out.reshape(batch, seq_q, heads * v_dim) @ w.w_o.T
    ### END SOLUTION


# %% test="test_mla_attention_absorbed" points=2
"""mla_attention_absorbed: equals the naive form in float64 for a prefill and decode steps."""
from attention_lab.checks.inference_attention import check_mla_attention_absorbed

check_mla_attention_absorbed(mla_attention_absorbed)
### BEGIN HIDDEN TESTS
check_mla_attention_absorbed(mla_attention_absorbed, seed=8501)
### END HIDDEN TESTS

# %% test="test_mla_attention_absorbed_memory" points=1
"""mla_attention_absorbed: no per-head key or value over the cache while decoding."""
from attention_lab.checks.inference_attention import check_mla_attention_absorbed_memory

check_mla_attention_absorbed_memory(mla_attention_absorbed)
### BEGIN HIDDEN TESTS
check_mla_attention_absorbed_memory(mla_attention_absorbed, seed=8502)
### END HIDDEN TESTS

# %% [markdown]
# **Prefill, then decode, both ways.** A prompt of 6 tokens, then 4 new tokens one at a time, each
# step appending its cache entry; the two forms at every step:

# %%
tokens = torch.randn(1, 10, 64, dtype=torch.float64)
cache_latent, cache_pe = mla_cache_entry(tokens[:, :6], mla_weights, torch.arange(6))
largest = float((mla_attention_naive(tokens[:, :6], mla_weights, cache_latent, cache_pe,
                                     torch.arange(6))
                 - mla_attention_absorbed(tokens[:, :6], mla_weights, cache_latent, cache_pe,
                                          torch.arange(6))).abs().max())
for position in range(6, 10):
    new_latent, new_pe = mla_cache_entry(tokens[:, position:position + 1], mla_weights,
                                         torch.tensor([position]))
    cache_latent = torch.cat([cache_latent, new_latent], dim=1)
    cache_pe = torch.cat([cache_pe, new_pe], dim=1)
    step_args = (tokens[:, position:position + 1], mla_weights, cache_latent, cache_pe,
                 torch.tensor([position]))
    largest = max(largest, float((mla_attention_naive(*step_args)
                                  - mla_attention_absorbed(*step_args)).abs().max()))
print("cache:", tuple(cache_latent.shape), "+", tuple(cache_pe.shape),
      "| naive vs absorbed, largest difference over the prefill and 4 steps:", largest)

# %% [markdown]
# ### Exercise 7.16 — why the decoupled RoPE part (2 pts, ~5 min)
#
# Suppose MLA rotated the whole key, `k_h = RoPE_j(W_UK,h c_j)` (position `j`), with no separate
# `k_pe`. Show why `W_UK,h` can then no longer be absorbed into the query, and say what the
# decoupled `k_pe` costs in the cache.

# %% [markdown] manual="decoupled_rope" points=2
# RoPE is a rotation `R_j` that depends on the key's position: `q_i · k_j` becomes
# `(R_i q)ᵀ R_j W_UK c_j = qᵀ R_{j−i} W_UK c_j` (rotations compose to the offset). The matrix between
# the query and the latent, `R_{j−i} W_UK`, now differs for every pair of positions, so there is no
# single `q W_UK` to compute once and score against all cached latents: absorbing it would need one
# absorbed query per cached position, or rebuilding every key (the naive form). Rotating only a
# separate part keeps the product `q_nope W_UK · c_j` free of positions, while `q_pe · k_pe` carries
# them. The cost is small: `qk_rope_dim` more numbers per token, shared by all heads (64 beside a
# latent of 512 in DeepSeek-V3: 576 numbers per token and layer).

# %% [markdown]
# ### Exercise 7.17 — mla_cache_bytes (1 pt, ~3 min)
#
# The bytes of an MLA cache: for every layer, token and sequence, the latent and the shared RoPE key
# part (no head axis, no separate value), `bytes_per_element` each. Return an `int`, rounded up when
# `bytes_per_element` is a fraction (0.5 for a 4-bit cache).

# %% answer="mla_cache_bytes"
def mla_cache_bytes(num_layers, kv_lora_rank, qk_rope_dim, seq_len, batch_size, bytes_per_element):
    """Bytes of an MLA cache: latent and RoPE key part per layer, token and sequence.

    Example: mla_cache_bytes(1, 4, 2, 10, 1, 2) == 120
    """
    ### BEGIN SOLUTION
    numbers = num_layers * (kv_lora_rank + qk_rope_dim) * seq_len * batch_size
    return math.ceil(numbers * bytes_per_element)
    ### END SOLUTION


# %% test="test_mla_cache_bytes" points=1
"""mla_cache_bytes: L·(kv_lora_rank + qk_rope_dim)·S·B·bytes, an int rounded up."""
from attention_lab.checks.inference_attention import check_mla_cache_bytes

check_mla_cache_bytes(mla_cache_bytes)
### BEGIN HIDDEN TESTS
check_mla_cache_bytes(mla_cache_bytes, seed=8701)
### END HIDDEN TESTS

# %% [markdown]
# **Per token, for real configurations** (their `config.json` on the Hugging Face Hub; MHA and GQA
# by notebook 05's `2·L·H_kv·d·bytes`, MLA by your function): Llama-2-7B (MHA: 32 layers, 32 KV
# heads of 128), Llama-3-70B (GQA: 80 layers, 8 KV heads of 128), DeepSeek-V3 (MLA: 61 layers,
# `kv_lora_rank` 512, `qk_rope_dim` 64), and DeepSeek-V3's attention as if it cached every head's
# key and value (128 heads, keys of 128 + 64, values of 128). Pick the precision:

# %%
from attention_lab.widgets.inference_attention import cache_bytes_view

cache_bytes_view(mla_cache_bytes)

# %% [markdown]
# ## 6. Speculative decoding's draft trees
#
# Decoding is one token per forward pass, and each pass reads every weight. **Speculative decoding**
# lets a small draft model guess several tokens ahead, and the big model checks them all in **one**
# forward pass: each guess whose every predecessor was accepted and that the big model would have
# chosen too is kept. Medusa, EAGLE and SpecInfer guess a **tree** — several candidates per step —
# and verify the whole tree at once. For that pass, each draft token must attend to the prompt, its
# own ancestors and itself, **not** to its siblings or cousins (other branches), and it must sit at
# the position it would have in its branch: the prompt's length plus its depth.
#
# The tree is given by `parents`: `parents[i]` is the index of node `i`'s parent among the `N` draft
# tokens, `−1` for a child of the prompt's last token; parents come before their children.

# %% [markdown]
# ### Exercise 7.18 — tree_attention_mask (2 pts, ~10 min)
#
# Return the `[N, prefix_len + N]` boolean mask of the verification pass: node `i` sees the whole
# prefix (the first `prefix_len` columns), its ancestors and itself (column `prefix_len + j` for
# each such node `j`), nothing else. `parents` is a list of ints or a LongTensor. Raise `ValueError`
# when a parent index is not before its child, or is below −1, or `prefix_len < 0`.

# %% answer="tree_attention_mask"
def tree_attention_mask(parents, prefix_len):
    """The mask of a draft tree: each node sees the prefix, its ancestors and itself.

    returns: BoolTensor [N, prefix_len + N].
    Example: tree_attention_mask([-1, 0, 0], 1).int() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]
    """
    ### BEGIN SOLUTION
    parents = [int(parent) for parent in parents]
    if prefix_len < 0:
        raise ValueError(f"prefix_len = {prefix_len} must not be negative")
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            raise ValueError(f"node {node} has parent {parent}: a parent comes before its child "
                             "(an index in -1 ... node - 1)")
    count = len(parents)
    allowed = torch.zeros(count, prefix_len + count, dtype=torch.bool)
    allowed[:, :prefix_len] = True  # the prompt, for every node
    for node, parent in enumerate(parents):
        if parent >= 0:
            allowed[node] = allowed[parent]  # everything its parent sees (the ancestors) ...
        allowed[node, prefix_len + node] = True  # ... and itself
    return allowed
    ### END SOLUTION


# %% test="test_tree_attention_mask" points=2
"""tree_attention_mask: the prefix, the ancestors and itself; no sibling; ValueError."""
from attention_lab.checks.inference_attention import check_tree_attention_mask

check_tree_attention_mask(tree_attention_mask)
### BEGIN HIDDEN TESTS
check_tree_attention_mask(tree_attention_mask, seed=8801)
### END HIDDEN TESTS

# %% [markdown]
# ### Exercise 7.19 — tree_position_ids (1 pt, ~3 min)
#
# Return the positions of the draft nodes, a LongTensor `[N]`: `prefix_len + depth(i)`, where a
# child of the prompt has depth 0 and every other node is one deeper than its parent.

# %% answer="tree_position_ids"
def tree_position_ids(parents, prefix_len):
    """Position of each draft node in its own branch: prefix_len + its depth.

    Example: tree_position_ids([-1, 0, 0, 1], 5) == [5, 6, 6, 7]
    """
    ### BEGIN SOLUTION
    depths = []
    for parent in (int(parent) for parent in parents):
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return prefix_len + torch.tensor(depths, dtype=torch.long)
    ### END SOLUTION


# %% test="test_tree_position_ids" points=1
"""tree_position_ids: prefix_len + depth, not prefix_len + index."""
from attention_lab.checks.inference_attention import check_tree_position_ids

check_tree_position_ids(tree_position_ids)
### BEGIN HIDDEN TESTS
check_tree_position_ids(tree_position_ids, seed=8901)
### END HIDDEN TESTS

# %% [markdown]
# **One pass verifies every branch.** A prompt of 5 tokens and a tree of 7 drafts (two candidates
# for the next token, then children of each). One attention pass over prompt + tree, with your mask
# and positions (RoPE at those positions), against each branch run on its own as an ordinary causal
# sequence, prompt then the branch's tokens:

# %%
torch.manual_seed(5)
draft_parents = [-1, -1, 0, 0, 1, 2, 4]
prompt_len, width = 5, 16
token_q = torch.randn(prompt_len + len(draft_parents), width, dtype=torch.float64)
token_k = torch.randn_like(token_q)
token_v = torch.randn_like(token_q)
tree_positions = torch.cat([torch.arange(prompt_len), tree_position_ids(draft_parents, prompt_len)])
tree_rows = tree_attention_mask(draft_parents, prompt_len)  # [7, 12]
one_pass = F.scaled_dot_product_attention(
    apply_rope_at(token_q[prompt_len:], tree_positions[prompt_len:]),
    apply_rope_at(token_k, tree_positions), token_v, attn_mask=tree_rows)
largest = 0.0
for node in range(len(draft_parents)):
    path = [node]  # the branch that ends at this node: its ancestors, then itself
    while draft_parents[path[0]] >= 0:
        path.insert(0, draft_parents[path[0]])
    rows = list(range(prompt_len)) + [prompt_len + i for i in path]
    branch = F.scaled_dot_product_attention(  # an ordinary causal pass over prompt + branch
        apply_rope_at(token_q[rows], torch.arange(len(rows))),
        apply_rope_at(token_k[rows], torch.arange(len(rows))), token_v[rows], is_causal=True)
    largest = max(largest, float((branch[-1] - one_pass[node]).abs().max()))
print(f"{len(draft_parents)} drafts in one pass vs each branch on its own: largest difference "
      f"{largest:.1e}")

# %% [markdown]
# **Look at the masks.** The explorer draws, with your functions, which keys each query may read:
# causal, a sliding window, StreamingLLM's sinks with a rolling window, gpt-oss's learned sink (the
# weights of one head: the mass left for the keys shrinks with the sink logit), and the draft tree
# above (with each node's position).

# %%
from attention_lab.widgets.inference_attention import mask_explorer

mask_explorer(sliding_window_mask, streaming_kept_positions, attention_with_sinks,
              tree_attention_mask, tree_position_ids, draft_parents=draft_parents)

# %% [markdown]
# ## What you built
#
# * `merge_attention_states`: the `(out, lse)` of disjoint key sets combine exactly; an empty part is
#   the identity; a base-2 `lse` must be converted first.
# * `split_kv_decode` and `split_kv_decode_kernel`: Flash-Decoding, one query per sequence with its
#   keys split across programs, grouped-query heads without a copy of K/V per head.
# * `slot_mapping`, `PagedKVCache` and `paged_decode_attention`: PagedAttention's pool, block tables,
#   forks with copy-on-write, and attention that reads only its own slots — measured against a
#   contiguous `max_len` cache on a batch of uneven lengths.
# * `sliding_window_mask`, `streaming_kept_positions`, `streaming_decode`, `attention_with_sinks`:
#   Mistral's window, StreamingLLM's sinks and re-rotated positions, gpt-oss's learned sinks.
# * `mla_cache_entry`, `mla_attention_naive`, `mla_attention_absorbed`, `mla_cache_bytes`:
#   DeepSeek's latent attention, equal in float64 with and without the absorbed up-projections.
# * `tree_attention_mask` and `tree_position_ids`: a whole tree of drafts verified in one pass.
