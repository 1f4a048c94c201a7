"""Checks for notebook 06 -- efficient attention: from the S×S table to a FlashAttention kernel.

The checks prove the algorithm, not only the numbers:

* outputs against ``F.scaled_dot_product_attention`` (math backend) and ``torch.logsumexp``
  in float64, then on the student's device and dtype; ragged sizes; causal masks aligned
  bottom-right (query i sees keys j <= i + S_k - S_q); several block sizes;
* **memory**: a ``TorchFunctionMode`` watches the output of every PyTorch call the answer makes
  and names the first one that builds a table as wide as all the keys (the ``[S_q, S_k]``
  score table, or a row block of it), with the student's line;
* **work**: the same watch counts the block score products, so a causal pass that masks
  future key blocks instead of skipping them is caught;
* **split-KV identity**: two halves of the keys, merged with their ``lse``, give the
  whole attention exactly;
* **diagnosis**: a float64 emulation of the tiled loop with each classic mistake (no rescale
  of ``acc`` or ``l``, normalising inside the loop, a stale max, the diagonal block skipped,
  top-left alignment, log2 ``lse`` ...) names the mistake a wrong output matches.

Precision: the framework's policy (:func:`attention_lab.checking.expect_close`): a float64
input may be computed with float32 internals (the contract asks for *at least* float32); such
an answer passes with a one-line note.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from typing import Any, Callable, Sequence

import torch

from attention_lab.bridge import checker_side, probes, wire
from attention_lab.bridge.probes import Probe
from attention_lab.checking import (
    CallTrace,
    CheckFailure,
    FunctionWatch,
    RuleFailure,
    Variant,
    call_student,
    check,
    crash_message,
    describe,
    expect_close,
    expect_signature,
    expect_tensor,
    expect_true,
    is_integer,
    is_number,
    freeze_module,
    randint,
    randn,
    random_generator,
    reference_sdpa,
    shape_str,
    student_line,
    tolerance,
)
from attention_lab.checking import _student_namespace

LN_2 = math.log(2.0)
LOG2_E = 1.0 / LN_2

HINTS = {
    # attention_matrix_bytes
    "bytes_heads": "every head has its own score table: multiply by num_heads.",
    "bytes_batch": "every sequence of the batch has its own score tables: multiply by batch_size.",
    "bytes_square": "the table is S × S: seq_len appears squared.",
    "bytes_elements": "that is a number of elements: multiply by bytes_per_element to get bytes.",
    # chunked attention
    "no_scale": "the scores are not scaled: multiply q·kᵀ by 1/sqrt(d_head) (or by the scale argument).",
    "top_left": "the causal mask is aligned top-left: with S_q != S_k, query i sees keys j <= i + (S_k - S_q) "
    "(the last query sees every key, as in KV-cache decoding), not j <= i.",
    "chunk_rows": "the causal mask of a chunk must use the chunk's own query positions: row r of the chunk that "
    "starts at `start` is query start + r, so it sees keys j <= start + r + (S_k - S_q).",
    "strict_mask": "the causal mask excludes the diagonal: query i may also attend to its own key (j <= i + offset, "
    "not j < i + offset).",
    "sdpa_is_causal": "F.scaled_dot_product_attention(..., is_causal=True) on a chunk aligns its triangle to the "
    "chunk's top-left corner, which is wrong for every chunk but the first: pass an explicit boolean attn_mask "
    "for the chunk's rows instead.",
    "last_chunk": "the last chunk is shorter when S_q is not a multiple of chunk_size: loop with "
    "range(0, S_q, chunk_size) and slice q[..., start:start + chunk_size, :] (slicing stops at the end).",
    "full_table": "this builds a table as wide as all the keys for all queries: compute one chunk of query "
    "rows at a time and build the causal mask for those rows only.",
    # streaming logsumexp
    "overflow": "the result overflows (inf or NaN) for large inputs: subtract the running max before "
    "exponentiating, e^(x - m), and add m back at the end.",
    "sum_not_rescaled": "when the running max grows from m to m', the running sum must be rescaled: "
    "s' = s·e^(m - m') + Σ e^(x_block - m'). Without the factor e^(m - m') the old terms keep the old max.",
    "neg_inf_block": "NaN from a block whose entries are all -inf while the running max is still -inf: "
    "e^(m - m') with m = m' = -inf is e^(nan). Use a safe max, e.g. torch.where(m_new == -inf, 0, m_new), "
    "when exponentiating.",
    "two_passes": "this reduces the whole row at once (a full-row max is a pass of its own over the data): "
    "slice one block at a time, x[..., start:start + block_size], and keep a running max and a rescaled sum.",
    "log2": "that is a base-2 logarithm: logsumexp uses the natural log, log(Σ e^x). With exp2/log2 inside, "
    "multiply by ln 2 at the end (or use torch.exp/torch.log).",
    # online softmax step
    "no_rescale_acc": "acc is not rescaled: when the max grows from m to m', the old accumulator must be "
    "multiplied by e^(m - m') before adding e^(S_blk - m') @ V_blk.",
    "no_rescale_l": "l is not rescaled: l' = l·e^(m - m') + rowsum(e^(S_blk - m')).",
    "stale_max": "the max is stale: return the new running max m' = max(m, rowmax(S_blk)) and use it for "
    "e^(S_blk - m') and e^(m - m').",
    "old_max_in_exp": "e^(S_blk - m) uses the old max: exponentiate with the new max m' (the old one may be "
    "-inf or smaller than the block's scores, and overflow).",
    "block_max_only": "m' must be the max over everything seen so far, max(m, rowmax(S_blk)), not the block's "
    "rowmax alone.",
    "causal_ignored": "causal=True was ignored: the output equals attention over every key. Mask the future keys "
    "(key j > i + (S_k - S_q)) with -inf in each tile that holds the diagonal, and skip the key blocks wholly in "
    "the future.",
    "normalise_inside": "acc is normalised inside the loop: keep acc unnormalised (a weighted sum) and divide "
    "by l once, after the last block.",
    # flash attention forward
    "skip_diagonal": "the causal loop stops one key block too early: the block that contains the diagonal "
    "must be visited (and masked inside); skip only the blocks whose first key is beyond the last query's "
    "reach, start_k > q_end - 1 + (S_k - S_q).",
    "lse_log2": "lse is in base 2 (log2 Σ e^s·...): with exp2 and scores scaled by log2(e), convert back at the "
    "end, lse = (m₂ + log2 l)·ln 2.",
    "lse_mixed": "lse mixes bases: m + log2(l). With natural exp, lse = m + log(l).",
    "lse_unscaled": "lse is the logsumexp of the *unscaled* scores: it must be logsumexp(scale · q·kᵀ) with "
    "the mask applied, the same scores the softmax used.",
    "lse_no_max": "lse is missing the running max: lse = m + log(l), not log(l) (l was summed relative to m).",
    "exp2_unscaled": "exp2 without log2(e): 2^(s - m) is e^((s - m)·ln 2), a softmax at the wrong temperature. "
    "Multiply the scores by log2(e) = 1.4427 before exp2 (or use exp).",
    "exp_with_log2e": "the scores are in base-2 units (qk_scale includes log2(e)), so exponentiate with tl.exp2, "
    "not tl.exp.",
    "block_dependent": "the result changes with the block sizes: some block's keys or queries are lost or "
    "counted twice (look at the last, shorter block: slices q[..., start:start + block, :] stop at the end).",
    "bound_no_offset": "the causal loop bound forgets the offset S_k - S_q: it stops at the query block's own "
    "last index, so the S_k - S_q keys after it that its queries may see (many blocks when S_k is much larger "
    "than S_q, as in decoding) are never visited. The last key the block may see is q_end - 1 + (S_k - S_q).",
    "bound_inclusive": "the causal loop bound is one key short: q_end - 1 + (S_k - S_q) is the last key the block "
    "may see (inclusive), but range(start, stop, step) stops before `stop`, so the key block that starts exactly "
    "at that key is dropped. The stop is one past the last key: q_end + (S_k - S_q).",
    "future_blocks": "with causal=True the loop still computes every key block: stop the key loop at the last "
    "block any query of this query block may see (start_k <= q_end - 1 + S_k - S_q), and mask only inside it.",
    "bound_first_query": "the causal loop bound comes from the query block's first query: its other queries see "
    "more keys (up to block_q - 1 more), and the key blocks only they see are never visited. The bound is the last "
    "key the block's *last* query may see, q_end - 1 + (S_k - S_q).",
    "no_tiles": "the pass computes no tile of scores: FlashAttention is made of [block_q, block_k] products of a "
    "query block and a key block, q_blk @ k_blkᵀ, each given to online_softmax_step. (Attention over every key at "
    "once -- SDPA, or a softmax of the whole table -- gives the same numbers without tiles.)",
    "merge": "two halves of the keys merged with their lse do not give the whole attention: lse must be the "
    "natural-log logsumexp of exactly the scores each half's softmax used.",
    # float16 / bfloat16 in: the contract "keeps dtype, computes in at least float32"
    "cast_back": "Likely mistake: the outputs keep the inputs' dtype (float16 in, float16 out) while the work inside "
    "runs in at least float32: cast the results back at the end, e.g. dq.to(q.dtype).",
    "half_internals": "your code computes in {dtype}, the inputs' dtype: the result is {ulps:.0f} units in the last "
    "place of {dtype} off, where float32 inside gives at most one (the rounding of the result). Compute in at "
    "least float32 -- work = torch.promote_types(q.dtype, torch.float32), q.to(work), ... -- and cast the results "
    "back with .to(q.dtype) at the end.",
    # flash attention backward
    "bwd_D_dout": "D uses dout twice: D = rowsum(dout ∘ out) (the output, not the gradient again). D_i = Σ_j P_ij "
    "dP_ij is the softmax's Jacobian term, and Σ_j P_ij (dO_i · v_j) = dO_i · out_i.",
    "bwd_no_D": "dS = P ∘ dP is missing the softmax's correction: dS = P ∘ (dP - D) with D = rowsum(dout ∘ out), one "
    "number per query row (the rowsum(dP ∘ P) term of the softmax's backward, computed from out).",
    "bwd_no_scale": "dQ and dK miss the scale: the scores are scale · q kᵀ, so dQ += scale · dS K and "
    "dK += scale · dSᵀ Q.",
    "bwd_no_lse": "P is not normalised: recompute it as P = exp(scale · q kᵀ - lse) with the saved lse of each "
    "query row (exp(S) alone is the unnormalised numerator; a softmax of one tile normalises over that tile only).",
    "bwd_tile_softmax": "P is a softmax over one tile of keys: each row's weights must be normalised over *all* its "
    "keys, which is what the saved lse gives without seeing them: P = exp(scale · q kᵀ - lse).",
    "bwd_dS_not_transposed": "dK needs dSᵀ: dK_blk += scale · dS_tileᵀ @ Q_blk (dS is [queries, keys]; dK is per key).",
    "bwd_P_not_transposed": "dV needs Pᵀ: dV_blk += P_tileᵀ @ dO_blk (P is [queries, keys]; dV is per key).",
    "bwd_no_mask": "the causal mask is missing in the backward pass: P recomputed on a tile that holds the diagonal "
    "must be 0 where key j > i + (S_k - S_q), as in the forward pass (exp(-inf - lse) = 0).",
    "bwd_top_left": "the causal mask of the backward pass is aligned top-left: query i sees keys j <= i + (S_k - S_q), "
    "as in the forward pass.",
    "bwd_future_blocks": "with causal=True the backward pass still computes every tile: skip the (query block, key "
    "block) tiles whose first key is beyond the reach of the block's last query, as the forward pass does.",
    "bwd_no_tiles": "the backward pass computes no tile of scores: FlashAttention's backward recomputes P one "
    "[block_q, block_k] tile at a time, P = exp(scale · q_blk k_blkᵀ - lse), from a product of a query block and a "
    "key block. (autograd through SDPA, or through your forward pass, computes the gradients without any tile.)",
    "bwd_autograd": "the backward pass is the exercise: autograd (torch.autograd.grad, .backward()) through SDPA or "
    "through your forward pass computes the gradients for you, keeping the very [S_q, S_k] table FlashAttention "
    "avoids. Write the tiled loops: P recomputed per tile from q, k and lse, then dV, dP, dS, dQ and dK.",
    "bwd_lse_recomputed": "your backward recomputes the softmax instead of using lse: its gradients stay the same "
    "whatever lse it is given. P = exp(scale · q kᵀ - lse) with the lse it is given, tile by tile -- no max and no "
    "sum over the keys again: that is what lets the backward pass see one tile at a time.",
    "bwd_delta_recomputed": "your backward computes D without the out it is given (from P and dP, or from an out of "
    "its own): its gradients stay the same whatever out it is given. D = rowsum(dout ∘ out), with the given out, "
    "one number per query row, computed before the loops.",
    "bwd_D_tile": "D is computed per tile, as rowsum(P_tile ∘ dP_tile) over this tile's keys only: D_i = Σ_j P_ij dP_ij "
    "runs over *all* the keys of row i. Compute it once per query row, before the loops, as D = rowsum(dout ∘ out).",
    "bwd_late_queries": "the loop over query blocks starts one block late: the first query block that sees a key "
    "block is the one that holds the diagonal (query k_start - (S_k - S_q), rounded down to a multiple of block_q), "
    "and that block's tile must be visited (and masked inside).",
    "bwd_exp2_natural": "P = exp2(s - lse) on natural-log scores: the backward's scores (scale · q kᵀ) and lse are "
    "in natural log, so P = exp(s - lse) (tl.exp); exp2 needs both multiplied by log2(e) first.",
    "bwd_causal_not_kept": "the backward ran without the causal mask, although forward got causal=True: keep it for "
    "backward (ctx.causal = causal) and pass it on, flash_attention_backward(..., causal=ctx.causal).",
    "bwd_saved": "save exactly q, k, v, out and lse with ctx.save_for_backward(q, k, v, out, lse): the backward pass "
    "recomputes P from them, which is the point of FlashAttention (no [S_q, S_k] tensor is kept between the passes).",
    "function_passes": "FlashAttention wraps your two passes: forward calls flash_attention_forward(q, k, v, "
    "causal=causal) and saves q, k, v, out and lse; backward calls flash_attention_backward(q, k, v, out, lse, dout, "
    "causal=ctx.causal). (SDPA, torch.logsumexp or autograd inside it give the same numbers without either pass.)",
    "bwd_gradients": "backward returns one gradient per input of forward, in order: (dq, dk, dv, None) -- None for "
    "causal, which is not a tensor.",
    # a query that sees no key (causal, S_q > S_k): out 0, lse -inf, no gradient -- what SDPA gives it
    "no_key_softmax_nan": "a query that sees no key is NaN: the softmax of a row whose scores are all -inf is 0 / 0. "
    "F.scaled_dot_product_attention gives such a row 0 (with a boolean attn_mask, on a chunk too): zero the weights "
    "of the rows that see no key, e.g. weights.masked_fill(~keep.any(-1, keepdim=True), 0.0).",
    "no_key_flash_nan": "a query that sees no key is NaN: its running max stays -inf, so exp(m - m_new) is "
    "exp(-inf - (-inf)) and acc / l is 0 / 0. SDPA gives it out = 0 and its lse is -inf (the log of an empty sum): "
    "divide by 1 where l is 0, e.g. torch.where(l > 0, acc / l, 0.0) and torch.where(l > 0, m + log(l), -inf) "
    "(or subtract 0 instead of a running max of -inf, as production kernels do).",
    "no_key_finite_fill": "a query that sees no key must get 0 (what SDPA gives it) and lse = -inf; yours got a "
    "weighted mean of values it may not see. A finite fill (-1e9, finfo.min) gives every key of a row whose keys "
    "are all masked the same weight: zero the rows that see no key.",
    "no_key_bwd_nan": "the gradients are NaN: a query that sees no key has lse = -inf, and exp(s - lse) is "
    "exp(-inf - (-inf)) = NaN on its row, which the sums over query rows (Pᵀ dO, dSᵀ Q) spread to every key. Its P "
    "is 0: replace lse = -inf by 0 first (lse.masked_fill(lse == -inf, 0.0)), or keep exp only where the key is "
    "visible (torch.where(keep, exp(...), 0), tl.where in a kernel).",
    # the warm-up kernels
    "ladder_unmasked_load": "a tl.load without a mask reads memory after the tensor: here the check put NaN there; "
    "on a GPU it may crash the kernel. Load with mask=offs < n (one condition per axis that can run past the "
    "end), other=... for the lanes left out.",
    "ladder_unmasked_store": "a tl.store without a mask writes past the end of out, into memory that is not "
    "yours (here the check's sentinel changed; on a GPU another tensor's data, or a crash). Store with the "
    "same mask as the load, offs < n.",
    "mask_last_lane": "the mask lets one lane too many through: indices run 0 … n − 1, so `offs <= n` also enables "
    "lane n, the first element past the end. Compare with `offs < n`.",
    "mask_past_end": "there is a mask, but it lets lanes past the end through: give it one condition per axis that "
    "can run past the end, each comparing that axis's index with that axis's length (in a matmul: rows < M and "
    "ks < K for A, ks < K and cols < N for B; in the last K slice, ks runs past K).",
    "wrong_address": "the addresses are computed wrongly, whatever the mask: the element (r, c) of a tensor is at "
    "X + r·stride_r + c·stride_c, each index times its own stride (not swapped), and a row starts at "
    "row·stride_x, not row·n_cols (the checks' rows are further apart than n_cols, as a slice's may be).",
    "program_offset": "the program's offset forgets the block size: program i owns elements i·BLOCK … i·BLOCK + "
    "BLOCK − 1, so offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), not program_id(0) + arange "
    "(programs then overlap, and most elements are never written).",
    "ladder_nan_past_end": "NaN in the result where the inputs are finite: the check stores NaN right after every "
    "input, so a tl.load read past the end (no mask, or one that lets lanes past the end through). Mask every load "
    "with one condition per axis that can run past the end.",
    "ladder_unwritten": "no program stored these elements (they still hold the check's NaN): the programs must "
    "cover every element, program i at i·BLOCK (not i), and the store's mask must not leave lanes inside the "
    "tensor out.",
    "matmul_last_slice": "the loop over K drops the last slice: range(0, K, BLOCK_K) visits every slice, the "
    "last (shorter) one too, with ks < K in the mask (range(0, K - BLOCK_K, BLOCK_K) or K // BLOCK_K "
    "iterations stop before it).",
    "matmul_half_accumulator": "C is only float16-accurate: the accumulator is float16 (dtype=tl.float16, or a "
    "tl.zeros in the inputs' dtype, or each product cast down). Accumulate in float32, "
    "acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32): every K slice adds to it, and float16 rounds each "
    "partial sum.",
    "matmul_one_k_block": "only the first BLOCK_K columns of A (rows of B) are used: loop over K in steps of BLOCK_K, "
    "accumulating tl.dot(a_block, b_block) into a float32 [BLOCK_M, BLOCK_N] accumulator.",
    "softmax_other_zero": "the lanes past n_cols were loaded as 0 (other=0.0, or no other): they take part in the max "
    "and add e^(0 - max) to the sum. Load them as other=float('-inf'), so that e^(-inf) = 0.",
    "softmax_no_max": "the row softmax overflows (inf/NaN) on large scores: subtract the row's max before tl.exp.",
    # Triton kernel
    "kernel_unmasked_store": "a tl.store without a mask writes the rows past the end (of out, lse or a gradient) "
    "into memory that is not theirs (here the check's sentinel changed; on a GPU another tensor's data, or a "
    "crash). Store with the row mask, offs[:, None] < seq (seq_q for out, lse and dq; seq_k for dk and dv).",
    "unmasked_load": "a tl.load without a mask (or with a mask that lets rows past the end through) reads memory "
    "after the tensor: here the check put NaN there; on a GPU it is another tensor's data or an illegal address "
    "that can crash the notebook's kernel. Give every load of a block that may run past the end "
    "mask=offs[:, None] < seq (seq_k for K and V, seq_q for Q) and other=0.0.",
    "nan_past_end": "NaN in out where attention is finite: the rows after the last query, key and value hold NaN "
    "in this check, so a tl.load without a mask (or with one that lets rows past the end through) read them. "
    "Mask every load of K, V and Q with the row index < seq_k (seq_q for Q), other=0.0.",
    "kernel_future_blocks": "with CAUSAL the loop still visits key blocks that no query of the program may see "
    "(all masked, wasted work: the saving of causal FlashAttention is skipping them). Stop the loop after the "
    "block that holds the last key the program's last query may see (its index + S_k - S_q). Mind that Triton's // "
    "and % truncate toward zero, unlike Python's: in a kernel -1 // 16 is 0, so a bound computed as last // BLOCK "
    "+ 1 for a program whose queries see no key (last < 0) visits one block; compare before dividing.",
    "not_jitted": "the kernel is a plain Python function: decorate it with @triton.jit. The launcher calls it as "
    "kernel[grid](...), which only a Triton kernel supports.",
    "dot_dtypes": "tl.dot was given operands of two dtypes (e.g. p in float32, v in the inputs' float16): cast "
    "the first to the second's dtype, tl.dot(p.to(v.dtype), v) -- the product still accumulates in float32.",
    "kernel_half_internals": "your kernel computes in the inputs' {dtype}: its rounding inside (of the exponentials, "
    "the running sum, the division) shows in the result, which float32 inside rounds once, at the store. Convert "
    "after each load, x = tl.load(...).to(tl.float32), and keep the running max and sum in float32; the store "
    "converts to Out's dtype.",
    "kernel_boundary": "keys beyond S_k are not masked: a masked tl.load returns `other` (0) for them, which "
    "gives them score 0, not -inf. Set their scores to -inf with tl.where(offs_k[None, :] < seq_k, s, "
    "float('-inf')).",
}


# --------------------------------------------------------------------------------------
# References and the emulated tiled loop (float64, CPU)
# --------------------------------------------------------------------------------------


def causal_keep(seq_q: int, seq_k: int, device: Any = "cpu", offset: int | None = None,
                strict: bool = False) -> torch.Tensor:
    """``[S_q, S_k]`` boolean, True where query i may see key j: j <= i + (S_k - S_q)."""
    offset = seq_k - seq_q if offset is None else offset
    rows = torch.arange(seq_q, device=device)[:, None]
    cols = torch.arange(seq_k, device=device)[None, :]
    return cols < rows + offset if strict else cols <= rows + offset


def keyless_queries(seq_q: int, seq_k: int, causal: bool) -> int:
    """How many queries see no key: with causal and S_q > S_k, the first S_q - S_k (j <= i + S_k - S_q)."""
    return max(0, seq_q - seq_k) if causal else 0


def expect_keyless_rows(got: torch.Tensor, keyless: int, what: str, nan_hint: str, fill: float = 0.0,
                        wrong_hint: str | None = "no_key_finite_fill") -> None:
    """The first ``keyless`` query rows of ``got`` (query axis 2: out, lse, dq) must be ``fill``: SDPA's 0 for
    out and dq, -inf for lse. NaN there names ``nan_hint``, another value ``wrong_hint``."""
    if keyless <= 0:
        return
    rows = got.detach().to("cpu", torch.float64)[:, :, :keyless]
    if bool((rows == fill).all()):
        return
    seen = "NaN" if bool(torch.isnan(rows).any()) else f"{float(rows[rows != fill].flatten()[0]):.4g}"
    hint = nan_hint if seen == "NaN" else wrong_hint
    raise CheckFailure(f"{what}: queries 0 to {keyless - 1} see no key (causal: query i sees keys j <= i + "
                       f"(S_k - S_q), and S_q - S_k = {keyless}), so their rows should be {fill:g}, as "
                       f"F.scaled_dot_product_attention gives them; got {seen}."
                       + (f"\n  Likely mistake: {HINTS[hint]}" if hint else ""))


def expect_no_nan(got: torch.Tensor, what: str, hint: str) -> None:
    """A gradient with NaN where autograd through SDPA has none (a query that sees no key spread it)."""
    if bool(torch.isnan(got.detach()).any()):
        raise CheckFailure(f"{what} holds NaN where autograd through SDPA has none.\n  Likely mistake: {HINTS[hint]}")


def _f64(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().to("cpu", torch.float64) for t in tensors]


def _scores(q, k, causal: bool, scale: float, offset: int | None = None, strict: bool = False) -> torch.Tensor:
    """Scaled (and masked) scores in float64: [B, H, S_q, S_k]."""
    q, k = _f64(q, k)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if causal:
        keep = causal_keep(q.shape[-2], k.shape[-2], offset=offset, strict=strict)
        scores = scores.masked_fill(~keep, -math.inf)
    return scores


def reference_attention(q, k, v, causal: bool = False, scale: float | None = None,
                        **mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` in float64 on the CPU: SDPA's math backend and ``torch.logsumexp``."""
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    q64, k64, v64 = _f64(q, k, v)
    attn_mask = None
    if causal:
        attn_mask = causal_keep(q.shape[-2], k.shape[-2], **mask)
    out = reference_sdpa(q64, k64, v64, attn_mask=attn_mask, scale=scale)
    lse = torch.logsumexp(_scores(q64, k64, causal, scale, **mask), dim=-1)
    return out, lse


def tiled_attention(q, k, v, *, causal: bool, scale: float, block_q: int, block_k: int,
                    bug: str | None = None, guard: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's loop in float64, with one known ``bug`` (or none): ``(out, lse)``.

    Used only to name mistakes: each bug gives the output a student who made it gets. ``guard``: a row that saw no
    key (l = 0) gets out 0 and lse -inf, as the contract asks; without it, 0 / 0 (a student who also forgot that).
    """
    q, k, v = _f64(q, k, v)
    seq_q, seq_k = q.size(2), k.size(2)
    offset = 0 if bug == "top_left" else seq_k - seq_q
    outs, lses = [], []
    for q_start in range(0, q.size(2), block_q):
        q_block = q[..., q_start:q_start + block_q, :]
        rows = torch.arange(q_start, q_start + q_block.shape[-2])[:, None]
        m = torch.full(q_block.shape[:-1], -math.inf, dtype=torch.float64)
        l = torch.zeros_like(m)
        acc = torch.zeros(*q_block.shape[:-1], v.shape[-1], dtype=torch.float64)
        last_m = m
        for k_start in range(0, seq_k, block_k):
            if causal and k_start > rows[-1, 0] + offset:
                break
            if causal and bug == "skip_diagonal" and k_start + block_k - 1 > q_start + offset:
                break
            if causal and bug == "bound_no_offset" and k_start >= q_start + block_q:
                break  # range(0, (i + 1)·block_q, block_k): the offset S_k - S_q forgotten
            if causal and bug == "bound_no_offset_clamped" and k_start >= rows[-1, 0] + 1:
                break  # range(0, q_end, block_k), q_end clamped to S_q: the same, on a ragged last block
            if causal and bug == "bound_inclusive" and k_start >= rows[-1, 0] + offset:
                break  # range(0, q_end - 1 + offset, block_k): the last key used as an exclusive stop
            if causal and bug == "bound_first_query" and k_start > rows[0, 0] + offset:
                break  # range(0, q_start + 1 + offset, block_k): the bound of the block's first query
            scores = q_block @ k[..., k_start:k_start + block_k, :].transpose(-1, -2) * scale
            if causal:
                cols = torch.arange(k_start, k_start + scores.shape[-1])[None, :]
                keep = cols < rows + offset if bug == "strict_mask" else cols <= rows + offset
                scores = scores.masked_fill(~keep, -math.inf)
            m_new = torch.maximum(m, scores.amax(-1))
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - safe)
            p = torch.exp(scores - safe[..., None])
            l = (l if bug == "no_rescale_l" else l * alpha) + p.sum(-1)
            if bug == "normalise_terms":  # each block's terms divided by the l of their step, never rescaled after
                acc = acc * alpha[..., None] + p @ v[..., k_start:k_start + block_k, :] / l[..., None]
            else:
                acc = (acc if bug == "no_rescale_acc" else acc * alpha[..., None]) + p @ v[..., k_start:k_start + block_k, :]
            if bug in ("normalise_inside", "normalise_inside_twice", "normalise_reset"):
                acc = acc / l[..., None]
            if bug == "normalise_reset":  # normalised acc, and l restarted at 1 as if it were one term
                l = torch.ones_like(l)
            last_m = m_new
            if bug != "stale_max":
                m = m_new
        out = acc if bug in ("normalise_inside", "normalise_terms") else acc / l[..., None]
        lse = last_m + torch.log(l)
        if guard:
            out, lse = torch.where(l[..., None] > 0, out, 0.0), torch.where(l > 0, lse, -math.inf)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _lse_variants(q, k, causal: bool, scale: float) -> list[Variant]:
    """Wrong ``lse`` values: base 2, mixed bases, unscaled scores, the max left out."""
    scores = _scores(q, k, causal, scale)
    row_max = scores.amax(-1)
    row_sum = torch.exp(scores - row_max[..., None]).sum(-1)
    return [
        Variant(lambda: (row_max + torch.log(row_sum)) * LOG2_E, HINTS["lse_log2"]),
        Variant(lambda: row_max + torch.log2(row_sum), HINTS["lse_mixed"]),
        Variant(lambda: torch.logsumexp(_scores(q, k, causal, 1.0), -1), HINTS["lse_unscaled"]),
        Variant(lambda: torch.log(row_sum), HINTS["lse_no_max"]),
    ] + ([Variant(lambda: torch.logsumexp(_scores(q, k, False, scale), -1), HINTS["causal_ignored"])] if causal else [])


def _out_variants(q, k, v, causal: bool, scale: float, block_q: int, block_k: int,
                  extra: Sequence[tuple[str, float]] = ()) -> list[Variant]:
    """Wrong outputs of a tiled pass: the classic loop bugs, masks and scales."""

    def tiled(bug: str) -> Callable[[], torch.Tensor]:
        return lambda: tiled_attention(q, k, v, causal=causal, scale=scale, block_q=block_q, block_k=block_k,
                                       bug=bug)[0]

    variants = [Variant(tiled(bug), HINTS[bug]) for bug in ("no_rescale_acc", "no_rescale_l", "normalise_inside",
                                                              "stale_max")]
    if causal:  # loop bounds first: a bound short by S_k - S_q keys can coincide with "one block too early"
        variants += [Variant(tiled("bound_no_offset"), HINTS["bound_no_offset"]),
                     Variant(tiled("bound_no_offset_clamped"), HINTS["bound_no_offset"]),
                     Variant(tiled("bound_inclusive"), HINTS["bound_inclusive"]),
                     Variant(tiled("bound_first_query"), HINTS["bound_first_query"])]
    variants += [Variant(tiled(bug), HINTS["normalise_inside"])  # and divided by l again; other normalisations
                 for bug in ("normalise_inside_twice", "normalise_terms", "normalise_reset")]
    if causal:
        variants += [Variant(tiled(bug), HINTS[bug]) for bug in ("skip_diagonal", "top_left", "strict_mask")]
        # the same, by a student whose rows that lose every key are 0 / 0 (the contract's guard forgotten too)
        variants += [Variant(lambda bug=bug: tiled_attention(q, k, v, causal=True, scale=scale, block_q=block_q,
                                                             block_k=block_k, bug=bug, guard=False)[0], HINTS[bug])
                     for bug in ("skip_diagonal", "strict_mask")]
    variants.append(Variant(lambda: reference_attention(q, k, v, causal, 1.0)[0], HINTS["no_scale"]))
    if causal:
        variants.append(Variant(lambda: reference_attention(q, k, v, False, scale)[0], HINTS["causal_ignored"]))
    for hint_key, factor in extra:
        variants.append(Variant(lambda f=factor: reference_attention(q, k, v, causal, scale * f)[0], HINTS[hint_key]))
    return variants


# --------------------------------------------------------------------------------------
# Watching every operation: tables as wide as the keys, block products, full-row passes
# --------------------------------------------------------------------------------------

# Functions whose outputs are matrix products (their count measures the work of a pass).
_MATMULS = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "addmm", "addbmm", "einsum", "tensordot",
            "linear"}
# Reductions: applied to a whole row, they are a pass over it (a streaming answer reduces blocks only).
_REDUCTIONS = {"amax", "max", "sum", "logsumexp", "softmax", "log_softmax", "mean", "cumsum", "sort", "topk", "norm",
               "prod", "aminmax", "argmax", "nansum", "special_logsumexp"}


class OperationWatch(FunctionWatch):
    """Sees the inputs and outputs of every PyTorch function the student's code calls (a probe: in
    grading it watches the call in the student's kernel and sends back what it saw, as data).

    * ``table=(S_q, S_k)`` -> the first new (non-view) output as wide as the table (:meth:`is_wide`)
      is kept in ``offence`` as ``(function, shape, student line)``; ``narrow`` (sizes a tile or a
      row may have): any output with S_k columns (or rows) that is not ``narrow`` counts too, and with
      ``queries`` one with S_q columns (or rows);
    * ``row_width`` -> the first reduction (max, sum, logsumexp ...) over an input whose last axis is
      that wide is kept in ``row_read`` as ``(function, student line)``;
    * ``products[shape[-2:]]`` counts matrix products (a broadcast product summed over its last axis too) by the
      last two dims of their output.
    """

    def __init__(self, table: Sequence[int] | None = None, narrow: Sequence[int] | None = None,
                 queries: bool = False, row_width: int | None = None):
        super().__init__(table=None if table is None else list(table), narrow=None if narrow is None else list(narrow),
                         queries=bool(queries), row_width=row_width)
        self.table = None if table is None else (int(table[0]), int(table[1]))
        self.narrow = None if narrow is None else tuple(int(n) for n in narrow)
        self.queries = bool(queries)
        self.row_width = row_width
        self.offence: tuple[str, tuple[int, ...], str] | None = None
        self.row_read: tuple[str, str] | None = None
        self.products: Counter = Counter()

    def is_wide(self, shape: tuple[int, ...]) -> bool:
        if self.table is None or len(shape) < 2:
            return False
        seq_q, seq_k = self.table
        rows, cols = shape[-2:]
        if (rows, cols) in ((seq_q, seq_k), (seq_k, seq_q)):
            return True
        if self.narrow is None:
            return False
        wide = (cols == seq_k and rows not in self.narrow) or (rows == seq_k and cols not in self.narrow)
        return wide or (self.queries and ((cols == seq_q and rows not in self.narrow)
                                          or (rows == seq_q and cols not in self.narrow)))

    def reads_row(self, tensor: torch.Tensor) -> bool:
        return self.row_width is not None and tensor.dim() >= 1 and tensor.shape[-1] == self.row_width

    def findings(self) -> dict:
        return {"offence": None if self.offence is None else [self.offence[0], list(self.offence[1]), self.offence[2]],
                "row_read": None if self.row_read is None else list(self.row_read),
                "products": [[list(shape), count] for shape, count in self.products.items()][:probes.MAX_FINDINGS]}

    def accept(self, findings: Any) -> None:
        """What the kernel's watch saw, checked to be the data a watch reports (its numbers are the kernel's word)."""
        if not isinstance(findings, dict):
            raise wire.WireError("malformed operation watch")
        offence, row_read, products = findings.get("offence"), findings.get("row_read"), findings.get("products")
        if offence is not None:
            if not (isinstance(offence, list) and len(offence) == 3 and probes.strings([offence[0], offence[2]])
                    and isinstance(offence[1], list) and all(type(n) is int and n >= 0 for n in offence[1])
                    and self.is_wide(tuple(offence[1]))):
                raise wire.WireError("malformed operation watch")
            self.offence = (offence[0], tuple(offence[1]), offence[2])
        if row_read is not None:
            if self.row_width is None:
                raise wire.WireError("malformed operation watch")
            self.row_read = tuple(probes.strings(row_read, limit=2))
        if not isinstance(products, list) or len(products) > probes.MAX_FINDINGS:
            raise wire.WireError("malformed operation watch")
        for item in products:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], list) and len(item[0]) == 2
                    and all(type(n) is int and n >= 0 for n in item[0]) and type(item[1]) is int and item[1] > 0):
                raise wire.WireError("malformed operation watch")
            self.products[tuple(item[0])] += item[1]

    def saw(self, name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
            new_outputs: list[torch.Tensor]) -> None:
        if self.table is not None and self.offence is None:
            for tensor in new_outputs:
                if self.is_wide(tuple(tensor.shape)):
                    self.offence = (name, tuple(tensor.shape), student_line())
                    break
        if (self.row_width is not None and self.row_read is None and name in _REDUCTIONS
                and any(self.reads_row(t) for t in inputs)):
            self.row_read = (name, student_line())
        # A product: a matmul, or a broadcast product summed over its last axis ((q[:, None] * k[None]).sum(-1))
        contraction = name == "sum" and len(inputs) == 1 and len(outputs) == 1 \
            and tuple(outputs[0].shape) == tuple(inputs[0].shape[:-1])
        if name in _MATMULS or contraction:
            for tensor in outputs:
                if tensor.dim() >= 2:
                    self.products[tuple(tensor.shape[-2:])] += 1


def _watched_call(fn: Callable, *args: Any, call: str, watch: OperationWatch, **kwargs: Any) -> Any:
    return call_student(fn, *args, call=call, probes=[watch], **kwargs)


# --------------------------------------------------------------------------------------
# Exercise: attention_matrix_bytes
# --------------------------------------------------------------------------------------


def _matrix_bytes_reference(case: tuple[int, int, int, int]) -> int:
    """Allocate the score table of ``(batch_size, num_heads, seq_len, bytes_per_element)`` on the meta
    device (no memory) and count its bytes. It takes the case as one tuple, so that it is no answer
    to the exercise a student could import from here."""
    batch_size, num_heads, seq_len, bytes_per_element = case
    dtype = {1: torch.int8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[bytes_per_element]
    table = torch.empty(batch_size, num_heads, seq_len, seq_len, dtype=dtype, device="meta")
    return table.numel() * table.element_size()


@check("attention_matrix_bytes: B · H · S² · bytes of one layer's score table")
def check_attention_matrix_bytes(attention_matrix_bytes: Callable, *, seed: int = 0,
                                 device: torch.device | None = None) -> None:
    """attention_matrix_bytes: an int equal to the bytes of a [B, H, S, S] table."""
    parameters = ["batch_size", "num_heads", "seq_len", "bytes_per_element"]
    expect_signature(attention_matrix_bytes, "attention_matrix_bytes", parameters)
    generator = random_generator(seed)
    cases = [(1, 32, 8192, 2), (1, 32, 131072, 2), (1, 1, 1, 1), (3, 5, 7, 4)]
    for _ in range(5):
        cases.append((randint(2, 16, generator), randint(2, 64, generator), randint(2, 50000, generator),
                      2 ** randint(0, 3, generator)))
    for case in cases:
        batch, heads, seq_len, size = case
        call = "attention_matrix_bytes(" + ", ".join(f"{n}={v}" for n, v in zip(parameters, case)) + ")"
        got = call_student(attention_matrix_bytes, *case, call=call)
        expected = _matrix_bytes_reference(case)
        expect_true(is_integer(got), f"{call} should return an int (a number of bytes), got {describe(got)}.")
        hint = ""
        if heads > 1 and got * heads == expected:
            hint = HINTS["bytes_heads"]
        elif batch > 1 and got * batch == expected:
            hint = HINTS["bytes_batch"]
        elif seq_len > 1 and got * seq_len == expected:
            hint = HINTS["bytes_square"]
        elif size > 1 and got * size == expected:
            hint = HINTS["bytes_elements"]
        expect_true(got == expected, f"{call} should be {expected:,} bytes, got {got:,}."
                    + (f"\n  Likely mistake: {hint}" if hint else ""))


# --------------------------------------------------------------------------------------
# Exercise: chunked_attention
# --------------------------------------------------------------------------------------


def _chunked_variants(q, k, v, causal: bool, chunk_size: int) -> list[Variant]:
    scale = q.shape[-1] ** -0.5
    variants = [Variant(lambda: reference_attention(q, k, v, causal, 1.0)[0], HINTS["no_scale"])]
    if not causal:
        return variants
    seq_q, seq_k = q.size(2), k.size(2)

    def per_chunk(offset_of: Callable[[int], int]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            chunks = []
            for start in range(0, q.size(2), chunk_size):
                rows = q[..., start:start + chunk_size, :]
                keep = causal_keep(rows.shape[-2], seq_k, offset=offset_of(start))
                chunks.append(reference_sdpa(*_f64(rows, k, v), attn_mask=keep, scale=scale))
            return torch.cat(chunks, dim=-2)
        return run

    variants += [
        Variant(lambda: reference_attention(q, k, v, True, offset=0)[0], HINTS["top_left"]),
        Variant(lambda: reference_attention(q, k, v, True, strict=True)[0], HINTS["strict_mask"]),
        Variant(per_chunk(lambda start: 0), HINTS["sdpa_is_causal"]),
        Variant(per_chunk(lambda start: seq_k - seq_q), HINTS["chunk_rows"]),
    ]
    return variants


def _chunked_case(chunked_attention, shape_q, seq_k, chunk_size, causal, generator, device, dtype) -> None:
    batch, heads, seq_q, head_dim = shape_q
    q = randn(batch, heads, seq_q, head_dim, generator=generator, dtype=dtype, device=device)
    k = randn(batch, heads, seq_k, head_dim, generator=generator, dtype=dtype, device=device)
    v = randn(batch, heads, seq_k, head_dim, generator=generator, dtype=dtype, device=device)
    call = (f"chunked_attention(q, k, v, chunk_size={chunk_size}, causal={causal}) with q {shape_str(q.shape)}, "
            f"k and v {shape_str(k.shape)} ({str(dtype).replace('torch.', '')})")
    out = call_student(chunked_attention, q, k, v, chunk_size, causal=causal, call=call)
    short = seq_q - seq_q % chunk_size
    expect_tensor(out, what=call, shape=q.shape, dtype=dtype, device=device,
                  hints={(batch, heads, short, head_dim): HINTS["last_chunk"]} if short and short != seq_q else None)
    expect_keyless_rows(out, keyless_queries(seq_q, seq_k, causal), call, "no_key_softmax_nan")
    expected = reference_attention(q, k, v, causal)[0]
    expect_close(out, expected, what=call, against="F.scaled_dot_product_attention (float64)",
                           variants=_chunked_variants(q, k, v, causal, chunk_size))


def _expect_no_table(watch: OperationWatch, call: str, what: str, hint: str) -> None:
    if watch.offence is not None:
        operation, shape, line = watch.offence
        raise RuleFailure(f"{call} built a {shape_str(shape)} tensor (with {operation}){line}: {what}.\n"
                           f"  Likely mistake: {hint}")


@check("chunked_attention: exact attention chunk by chunk, ragged last chunk, causal bottom-right; no [S_q, S_k] table ({device})")
def check_chunked_attention(chunked_attention: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """chunked_attention equals SDPA (float64, then the device), with any chunk size; never builds [S_q, S_k]."""
    expect_signature(chunked_attention, "chunked_attention", ["q", "k", "v", "chunk_size", "causal"])
    generator = random_generator(seed)
    cpu = torch.device("cpu")
    seq_q = randint(33, 47, generator)
    for causal in (False, True):
        _chunked_case(chunked_attention, (2, 3, seq_q, 8), seq_q + randint(0, 20, generator), 16, causal,
                      generator, cpu, torch.float64)
    _chunked_case(chunked_attention, (1, 2, 10, 8), 10, 64, True, generator, cpu, torch.float64)  # one chunk
    _chunked_case(chunked_attention, (1, 2, 9, 4), 9, 1, True, generator, cpu, torch.float64)  # rows one by one
    # More queries than keys: queries 0-17 see no key (two whole chunks and part of a third) and get 0, as in SDPA.
    _chunked_case(chunked_attention, (1, 2, 30, 8), 12, 8, True, generator, cpu, torch.float64)
    _chunked_case(chunked_attention, (2, 2, 40, 16), 56, 12, True, generator, device, torch.float32)
    # Memory: no intermediate is the whole [S_q, S_k] table (chunks are [chunk, S_k]).
    for causal, (seq_q, seq_k) in ((False, (45, 70)), (True, (45, 70)), (True, (48, 48))):
        q = randn(1, 2, seq_q, 8, generator=generator)
        k = randn(1, 2, seq_k, 8, generator=generator)
        v = randn(1, 2, seq_k, 8, generator=generator)
        call = f"chunked_attention(q, k, v, chunk_size=16, causal={causal}) with S_q={seq_q}, S_k={seq_k}"
        watch = OperationWatch(table=(seq_q, seq_k))
        _watched_call(chunked_attention, q, k, v, 16, causal=causal, call=call, watch=watch)
        _expect_no_table(watch, call, "the whole score table (or mask) at once, which chunking exists to avoid",
                         HINTS["full_table"])


# --------------------------------------------------------------------------------------
# Exercise: streaming_logsumexp
# --------------------------------------------------------------------------------------


def _lse_stream_variants(x: torch.Tensor, block_size: int) -> list[Variant]:
    x64 = _f64(x)[0]

    def no_rescale() -> torch.Tensor:
        m = torch.full(x64.shape[:-1], -math.inf, dtype=torch.float64)
        s = torch.zeros_like(m)
        for start in range(0, x64.shape[-1], block_size):
            block = x64[..., start:start + block_size]
            m = torch.maximum(m, block.amax(-1))
            s = s + torch.exp(block - m[..., None]).sum(-1)
        return m + torch.log(s)

    return [Variant(no_rescale, HINTS["sum_not_rescaled"]),
            Variant(lambda: torch.logsumexp(x64, -1) * LOG2_E, HINTS["log2"]),
            Variant(lambda: torch.log2(torch.exp(x64).sum(-1)), HINTS["log2"])]


def _streaming_case(streaming_logsumexp, x: torch.Tensor, block_size: int, label: str,
                    watch_rows: bool) -> None:
    call = f"streaming_logsumexp(x, block_size={block_size}) with x {label} {shape_str(x.shape)}"
    width = x.shape[-1]
    watch = OperationWatch(row_width=width) if watch_rows else None
    if watch is not None:
        out = _watched_call(streaming_logsumexp, x, block_size, call=call, watch=watch)
    else:
        out = call_student(streaming_logsumexp, x, block_size, call=call)
    expect_tensor(out, what=call, shape=x.shape[:-1], dtype=x.dtype, device=x.device)
    expected = torch.logsumexp(_f64(x)[0], dim=-1)
    finite = torch.isfinite(expected)
    got = _f64(out)[0]
    if bool(torch.isnan(got).any()) and (x == -math.inf).any():
        raise CheckFailure(f"{call} returned NaN.\n  Likely mistake: {HINTS['neg_inf_block']}")
    if bool((~torch.isfinite(got) & finite).any()):
        raise CheckFailure(f"{call} returned inf or NaN where torch.logsumexp is finite.\n  Likely mistake: "
                           + HINTS["overflow"])
    expect_close(out, expected, what=call, against="torch.logsumexp (float64)",
                           variants=_lse_stream_variants(x, block_size))
    if watch is not None and watch.row_read is not None:
        operation, line = watch.row_read
        raise CheckFailure(f"{call}: {operation}() reduced a whole row of x{line}, but a streaming logsumexp reads x "
                           f"one block of {block_size} columns at a time.\n  Likely mistake: {HINTS['two_passes']}")


@check("streaming_logsumexp: one pass over column blocks with a running max and a rescaled sum; equals torch.logsumexp; no overflow; -inf allowed ({device})")
def check_streaming_logsumexp(streaming_logsumexp: Callable, *, seed: int = 0,
                              device: torch.device | None = None) -> None:
    """streaming_logsumexp equals torch.logsumexp, reads x block by block, survives ±1000 and -inf."""
    expect_signature(streaming_logsumexp, "streaming_logsumexp", ["x", "block_size"])
    generator = random_generator(seed)
    width = randint(45, 60, generator)
    x = randn(3, 4, width, generator=generator) * 3
    _streaming_case(streaming_logsumexp, x, 8, "of", watch_rows=True)
    # The max grows block after block (increasing rows): the sum must be rescaled each time.
    rising = torch.linspace(-5.0, 5.0, width, dtype=torch.float64).expand(2, width) + randn(2, width, generator=generator) * 0.1
    _streaming_case(streaming_logsumexp, rising, 7, "rising along each row,", watch_rows=True)
    big = torch.stack([x[0, 0] + 1000.0, x[0, 1] - 1000.0])
    _streaming_case(streaming_logsumexp, big, 8, "around +1000 and -1000,", watch_rows=False)
    masked = x[0, :3].clone()
    masked[0, :16] = -math.inf  # two whole blocks of -inf first: the running max is still -inf
    masked[1, 5::3] = -math.inf
    masked[2] = -math.inf  # a row with nothing: -inf, as torch.logsumexp gives
    _streaming_case(streaming_logsumexp, masked, 8, "with -inf entries,", watch_rows=False)
    _streaming_case(streaming_logsumexp, x[1, 1], 64, "(one block),", watch_rows=False)
    _streaming_case(streaming_logsumexp, x.to(device=device, dtype=torch.float32), 16, "float32",
                    watch_rows=False)


# --------------------------------------------------------------------------------------
# Exercise: online_softmax_step
# --------------------------------------------------------------------------------------


def _step_reference(m, l, acc, scores, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, l, acc, scores, v = _f64(m, l, acc, scores, v)
    m_new = torch.maximum(m, scores.amax(-1))
    safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - safe)
    p = torch.exp(scores - safe[..., None])
    return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + p @ v


def _step_variants(m, l, acc, scores, v, part: int) -> list[Variant]:
    """Wrong (m', l', acc') -- only the part being compared (0, 1 or 2)."""
    m, l, acc, scores, v = _f64(m, l, acc, scores, v)
    m_new, l_new, acc_new = _step_reference(m, l, acc, scores, v)
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[..., None])
    block_max = scores.amax(-1)
    if part == 0:
        return [Variant(m, HINTS["stale_max"]), Variant(block_max, HINTS["block_max_only"])]
    if part == 1:
        p_old = torch.exp(scores - m[..., None])
        return [Variant(l + p.sum(-1), HINTS["no_rescale_l"]),
                Variant(l * alpha + p_old.sum(-1), HINTS["old_max_in_exp"]),
                Variant(l * torch.exp(m - block_max) + torch.exp(scores - block_max[..., None]).sum(-1),
                        HINTS["block_max_only"])]
    p_old = torch.exp(scores - m[..., None])
    return [Variant(acc + p @ v, HINTS["no_rescale_acc"]),
            Variant(acc_new / l_new[..., None], HINTS["normalise_inside"]),
            Variant(acc * alpha[..., None] + p_old @ v, HINTS["old_max_in_exp"])]


def _step_case(online_softmax_step, m, l, acc, scores, v, label: str) -> tuple:
    call = (f"online_softmax_step(m, l, acc, scores_block, v_block) with {label}: m, l {shape_str(m.shape)}, "
            f"acc {shape_str(acc.shape)}, scores_block {shape_str(scores.shape)}, v_block {shape_str(v.shape)}")
    expected = _step_reference(m, l, acc, scores, v)
    variants = [_step_variants(m, l, acc, scores, v, part) for part in range(3)]
    result = call_student(online_softmax_step, m.clone(), l.clone(), acc.clone(), scores.clone(), v.clone(), call=call)
    expect_true(isinstance(result, (tuple, list)) and len(result) == 3,
                f"{call} should return the tuple (m, l, acc), got {describe(result)}.")
    names = ("m'", "l'", "acc'")
    for index, (got, want, like) in enumerate(zip(result, expected, (m, l, acc))):
        expect_tensor(got, what=f"{names[index]} from {call}", shape=like.shape, dtype=like.dtype, device=like.device)
        expect_close(got, want, what=f"{names[index]} from {call}",
                               against="the update formula (float64)", variants=variants[index])
    return tuple(result)


@check("online_softmax_step: m' = max(m, rowmax S), l' = l·e^(m−m') + rowsum e^(S−m'), acc' = acc·e^(m−m') + e^(S−m')@V; blocks chained equal softmax(S)@V ({device})")
def check_online_softmax_step(online_softmax_step: Callable, *, seed: int = 0,
                              device: torch.device | None = None) -> None:
    """online_softmax_step: one update from -inf/0/0, a later one with a growing max, and a chain of them."""
    expect_signature(online_softmax_step, "online_softmax_step", ["m", "l", "acc", "scores_block", "v_block"])
    generator = random_generator(seed)
    batch, heads, rows, width, d_v = 2, 3, 5, 4, 6

    def start(dtype=torch.float64, dev: Any = "cpu"):
        return (torch.full((batch, heads, rows), -math.inf, dtype=dtype, device=dev),
                torch.zeros(batch, heads, rows, dtype=dtype, device=dev),
                torch.zeros(batch, heads, rows, d_v, dtype=dtype, device=dev))

    scores = [randn(batch, heads, rows, width, generator=generator) * 2 for _ in range(4)]
    scores[2] = scores[2] + 4.0  # a block whose scores exceed the running max: everything must be rescaled
    scores[3][..., 1] = -math.inf  # masked keys
    values = [randn(batch, heads, width, d_v, generator=generator) for _ in range(4)]
    state = _step_case(online_softmax_step, *start(), scores[0], values[0], "the first block (m = -inf, l = 0, acc = 0)")
    state = tuple(t.detach().to(torch.float64) for t in state)
    for index in (1, 2, 3):
        state = _step_case(online_softmax_step, *state, scores[index], values[index],
                           f"block {index} (the max {'grows' if index == 2 else 'may change'})")
        state = tuple(t.detach().to(torch.float64) for t in state)
    m, l, acc = state
    all_scores, all_values = torch.cat(scores, dim=-1), torch.cat(values, dim=-2)
    expected = torch.softmax(all_scores, dim=-1) @ all_values
    expect_close(acc / l[..., None], expected, what="acc / l after four steps",
                 against="softmax(all scores) @ V (float64)")
    # On the device, in float32.
    m32, l32, acc32 = start(torch.float32, device)
    _step_case(online_softmax_step, m32, l32, acc32, scores[0].to(device, torch.float32),
               values[0].to(device, torch.float32), "float32 on the device")


# --------------------------------------------------------------------------------------
# Exercise: flash_attention_forward
# --------------------------------------------------------------------------------------


def _qkv(generator, batch, heads, seq_q, seq_k, head_dim, d_v=None, dtype=torch.float64, device: Any = "cpu"):
    d_v = head_dim if d_v is None else d_v
    return (randn(batch, heads, seq_q, head_dim, generator=generator, dtype=dtype, device=device),
            randn(batch, heads, seq_k, head_dim, generator=generator, dtype=dtype, device=device),
            randn(batch, heads, seq_k, d_v, generator=generator, dtype=dtype, device=device))


def _flash_call_text(q, k, v, block_q, block_k, causal, scale) -> str:
    blocks = "" if block_q is None else f"block_q={block_q}, block_k={block_k}, "
    scale_text = "" if scale is None else f", scale={scale}"
    return (f"flash_attention_forward(q, k, v, {blocks}causal={causal}{scale_text}) with q {shape_str(q.shape)}, "
            f"k {shape_str(k.shape)}, v {shape_str(v.shape)} ({str(q.dtype).replace('torch.', '')}, {q.device.type})")


def _call_flash(flash_attention_forward, q, k, v, block_q, block_k, causal, scale=None,
                watch: OperationWatch | None = None) -> tuple[torch.Tensor, torch.Tensor, str]:
    call = _flash_call_text(q, k, v, block_q, block_k, causal, scale)
    kwargs: dict[str, Any] = {"causal": causal}
    if block_q is not None:
        kwargs.update(block_q=block_q, block_k=block_k)
    if scale is not None:
        kwargs["scale"] = scale
    if watch is None:
        result = call_student(flash_attention_forward, q, k, v, call=call, **kwargs)
    else:
        result = _watched_call(flash_attention_forward, q, k, v, call=call, watch=watch, **kwargs)
    expect_true(isinstance(result, (tuple, list)) and len(result) == 2,
                f"{call} should return the tuple (out, lse), got {describe(result)}.")
    out, lse = result
    batch, heads, seq_q = q.shape[:3]
    expect_tensor(out, what=f"out from {call}", shape=(batch, heads, seq_q, v.shape[-1]), dtype=q.dtype,
                  device=q.device, dtype_hint=HINTS["cast_back"])
    expect_tensor(lse, what=f"lse from {call}", shape=(batch, heads, seq_q), device=q.device,
                  hints={(batch, heads, seq_q, 1): "lse has one number per query row: [B, H, S_q] (squeeze the last axis)."})
    expect_true(lse.dtype in (q.dtype, torch.float32),
                f"lse from {call} should be {q.dtype} (or float32, the usual dtype of lse), got {lse.dtype}.")
    return out, lse, call


def _lse_tolerance(out: torch.Tensor, lse: torch.Tensor) -> tuple[float, float]:
    """``(rtol, atol)`` for ``lse``: the looser of out's and its own.

    lse comes from the same pass as out, so it is as precise as out (float16 out: float16's
    tolerance); it may also be float32 next to a float64 out (the usual dtype of lse).
    """
    (out_rtol, out_atol), (own_rtol, own_atol) = tolerance(out.dtype, out.device), tolerance(lse.dtype, lse.device)
    return max(out_rtol, own_rtol), max(out_atol, own_atol)


def _flash_case(flash_attention_forward, q, k, v, block_q, block_k, causal, scale=None) -> tuple:
    out, lse, call = _call_flash(flash_attention_forward, q, k, v, block_q, block_k, causal, scale)
    keyless = keyless_queries(q.shape[-2], k.shape[-2], causal)
    expect_keyless_rows(out, keyless, f"out from {call}", "no_key_flash_nan")
    expect_keyless_rows(lse, keyless, f"lse from {call}", "no_key_flash_nan", fill=-math.inf)
    used_scale = q.shape[-1] ** -0.5 if scale is None else scale
    want_out, want_lse = reference_attention(q, k, v, causal, used_scale)
    blocks = (64, 64) if block_q is None else (block_q, block_k)
    try:
        expect_close(out, want_out, what=f"out from {call}",
                               against="F.scaled_dot_product_attention (float64)",
                               variants=_out_variants(q, k, v, causal, used_scale, *blocks))
    except CheckFailure as failure:
        ragged = q.shape[-2] % blocks[0] or k.shape[-2] % blocks[1]
        if not ragged or "Likely mistake" in str(failure):
            raise
        raise CheckFailure(f"{failure}\n  Likely mistake: {HINTS['block_dependent']}") from None
    if out.dtype in (torch.float16, torch.bfloat16):
        _expect_float32_inside(out, want_out, f"out from {call}")
    lse_rtol, lse_atol = _lse_tolerance(out, lse)
    expect_close(lse, want_lse, what=f"lse from {call}",
                           against="torch.logsumexp of the scaled, masked scores (float64)",
                           variants=_lse_variants(q, k, causal, used_scale), rtol=lse_rtol, atol=lse_atol)
    return out, lse


def _merge_halves(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-KV identity: softmax over all keys from the two halves' outputs and lse."""
    out_a, lse_a, out_b, lse_b = _f64(out_a, lse_a, out_b, lse_b)
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b, lse


# How far a float16 / bfloat16 result may be from the float64 reference of its own inputs, in units in the last
# place (ulp) of its dtype: computed in float32 inside and rounded once at the end it is at most half a unit off
# (measured: 0.4-0.5 on every case of these checks); computed in the inputs' dtype, 6-24 units.
HALF_PRECISION_ULPS = 2.0


def _expect_float32_inside(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """A half-precision ``got`` that passed its dtype's tolerance must also be as precise as float32 work inside
    gives: the contract "keeps dtype, computes in at least float32"."""
    eps = torch.finfo(got.dtype).eps
    unit = want.abs() * eps + eps * 0.05  # one ulp at each value (a floor near 0, where rounding is tiny too)
    ulps = float(((got.detach().cpu().double() - want).abs() / unit).max())
    if ulps > HALF_PRECISION_ULPS:
        dtype = str(got.dtype).replace("torch.", "")
        raise CheckFailure(f"{what} is {ulps:.0f} units in the last place of {dtype} away from the float64 reference "
                           f"of the same inputs; at most {HALF_PRECISION_ULPS:g} expected.\n  Likely mistake: "
                           + HINTS["half_internals"].format(dtype=dtype, ulps=ulps))


@check("flash_attention_forward: out equals SDPA and lse equals logsumexp (float64, then the device); ragged S; causal bottom-right; any block sizes; halves merge exactly with lse ({device})",
       uses=("online_softmax_step",))
def check_flash_attention_forward(flash_attention_forward: Callable, *, seed: int = 0,
                                  device: torch.device | None = None) -> None:
    """flash_attention_forward: numbers, ragged blocks, causal, block-size independence, split-KV merge."""
    expect_signature(flash_attention_forward, "flash_attention_forward",
                     ["q", "k", "v", "block_q", "block_k", "causal", "scale"])
    generator = random_generator(seed)
    seq = randint(40, 48, generator)
    # float64 ground truth: a multiple of the blocks, then ragged, then causal (square and decoding-shaped).
    _flash_case(flash_attention_forward, *_qkv(generator, 2, 3, 32, 32, 8), 16, 16, False)
    _flash_case(flash_attention_forward, *_qkv(generator, 2, 2, seq - 3, seq + 9, 8), 16, 32, False)
    _flash_case(flash_attention_forward, *_qkv(generator, 1, 2, seq, seq, 8), 16, 16, True)
    _flash_case(flash_attention_forward, *_qkv(generator, 2, 2, 29, seq, 8), 8, 16, True)
    _flash_case(flash_attention_forward, *_qkv(generator, 1, 2, 33, 33, 8), 16, 16, True)  # last block: 1 row
    _flash_case(flash_attention_forward, *_qkv(generator, 1, 2, 21, 21, 8, d_v=6), 8, 8, False, scale=0.3)
    _flash_case(flash_attention_forward, *_qkv(generator, 1, 1, 100, 100, 8), None, None, True)  # defaults
    # More queries than keys: queries 0-20 see no key (two whole query blocks and part of a third).
    _flash_case(flash_attention_forward, *_qkv(generator, 1, 2, 40, 19, 8), 8, 8, True)
    # Independent of the block sizes (including a block larger than the sequence).
    q, k, v = _qkv(generator, 1, 2, 37, 53, 8)
    reference = reference_attention(q, k, v, True)[0]
    for block_q, block_k in ((16, 16), (8, 32), (32, 8), (5, 7), (64, 64)):
        out, _, call = _call_flash(flash_attention_forward, q, k, v, block_q, block_k, True)
        try:
            expect_close(out, reference, what=f"out from {call}", against="SDPA (float64)",
                                   variants=_out_variants(q, k, v, True, 8 ** -0.5, block_q, block_k))
        except CheckFailure as failure:
            message = str(failure)
            if "Likely mistake" not in message:
                message += f"\n  Likely mistake: {HINTS['block_dependent']}"
            raise CheckFailure(message) from None
    # Split-KV / ring attention: the two halves of the keys, merged with their lse, are the whole.
    q, k, v = _qkv(generator, 2, 2, 24, 40, 8)
    half = 17
    out_a, lse_a, _ = _call_flash(flash_attention_forward, q, k[:, :, :half], v[:, :, :half], 8, 8, False)
    out_b, lse_b, _ = _call_flash(flash_attention_forward, q, k[:, :, half:], v[:, :, half:], 8, 8, False)
    merged, merged_lse = _merge_halves(out_a, lse_a, out_b, lse_b)
    try:
        expect_close(merged, reference_attention(q, k, v)[0],
                     what="the two halves of the keys (0..16 and 17..39) merged with their lse",
                     against="attention over all 40 keys (float64)")
    except CheckFailure as failure:
        raise CheckFailure(f"{failure}\n  Likely mistake: {HINTS['merge']}") from None
    # On the device: float32 (and float16 on a GPU), computed in at least float32.
    _flash_case(flash_attention_forward, *_qkv(generator, 2, 2, seq, seq + 5, 16, dtype=torch.float32, device=device),
                16, 16, True)
    # Half precision in, the same dtype out, float32 inside: on the CPU too (PyTorch's CPU kernels take both).
    for dtype in (torch.float16, torch.bfloat16):
        _flash_case(flash_attention_forward, *_qkv(generator, 1, 2, seq, seq + 3, 16, dtype=dtype), 16, 16, True)
    if device.type == "cuda":
        _flash_case(flash_attention_forward, *_qkv(generator, 2, 2, seq, seq, 16, dtype=torch.float16, device=device),
                    16, 16, True)


def _score_products(watch: OperationWatch, block: int) -> int:
    return watch.products[(block, block)]


def _tiles(counts: dict[bool, int], blocks: int) -> int:
    """How many tiles the causal pass computed: its [block, block] products over the products per tile of the
    non-causal pass (which computes all ``blocks²`` tiles). One unit per sentence of a message: tiles."""
    return round(counts[True] * blocks ** 2 / counts[False])


def _expect_tiles(counts: dict[bool, int], seq: int, block: int, call: str, no_tiles: str, future: str) -> None:
    """The work of a pass on S = ``seq`` in blocks of ``block``, by its [block, block] products (``counts``, without
    and with causal): the non-causal pass computes each of its tiles (a pass with none is not tiled, whatever its
    numbers: a "skips future tiles" measured on zero tiles says nothing), the causal one only those a query of the
    tile may see (one extra, fully masked tile per row of tiles is fine)."""
    blocks = seq // block
    visited = blocks * (blocks + 1) // 2
    expect_true(counts[False] >= blocks ** 2,
                f"{call.format(causal=False)} with S = {seq} computed {counts[False]} products of a [{block}, "
                f"{block}] tile's shape: each of its {blocks ** 2} tiles of scores (a query block against a key "
                f"block) needs one.\n  Likely mistake: {HINTS[no_tiles]}")
    allowed = counts[False] * (visited + blocks) / blocks ** 2
    expect_true(counts[True] <= allowed,
                f"{call.format(causal=True)} with S = {seq} computed {_tiles(counts, blocks)} [{block}, {block}] "
                f"tiles of scores, as many as the non-causal pass. Only {visited} of the {blocks ** 2} tiles hold a "
                f"key that some query of the tile may see.\n  Likely mistake: {HINTS[future]}")


@check("flash_attention_forward: never builds a tensor as wide as all the keys; the causal pass skips future key blocks")
def check_flash_attention_forward_memory(flash_attention_forward: Callable, *, seed: int = 0,
                                         device: torch.device | None = None) -> None:
    """Every operation's output is watched: no [S_q, S_k] table nor a row block of it; causal visits ~half the blocks."""
    generator = random_generator(seed)
    head_dim, heads = 8, 3
    # Sizes where every legitimate tensor ([B, H, S, d], tiles, [B, H, S_q] rows) differs from a table.
    narrow = (1, head_dim, heads)
    for causal, (seq_q, seq_k) in ((False, (48, 80)), (True, (48, 80)), (True, (64, 64))):
        q, k, v = _qkv(generator, 1, heads, seq_q, seq_k, head_dim)
        watch = OperationWatch(table=(seq_q, seq_k), narrow=narrow)
        _, _, call = _call_flash(flash_attention_forward, q, k, v, 16, 16, causal, watch=watch)
        _expect_no_table(watch, call, f"a table of scores against all {seq_k} keys. FlashAttention holds only one "
                         "[block_q, block_k] tile of scores at a time",
                         "loop over key blocks inside the loop over query blocks, and give each tile to "
                         "online_softmax_step; build masks for the tile only. (Scores for a block of queries against "
                         "every key is chunked attention, not FlashAttention.)")
    # Work: count the [16, 16] score products with and without the causal mask.
    seq, block = 96, 16
    q, k, v = _qkv(generator, 1, 2, seq, seq, head_dim)
    counts = {}
    for causal in (False, True):
        watch = OperationWatch()
        _call_flash(flash_attention_forward, q, k, v, block, block, causal, watch=watch)
        counts[causal] = _score_products(watch, block)
    _expect_tiles(counts, seq, block, f"flash_attention_forward(q, k, v, block_q={block}, block_k={block}, "
                  "causal={causal})", "no_tiles", "future_blocks")


# --------------------------------------------------------------------------------------
# Exercise: flash_attention_backward, and the autograd Function built on it
# --------------------------------------------------------------------------------------


def reference_gradients(q, k, v, dout, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dv)`` of SDPA (math backend) in float64, by torch.autograd."""
    q64, k64, v64, do64 = (t.requires_grad_(True) if i < 3 else t for i, t in enumerate(_f64(q, k, v, dout)))
    mask = causal_keep(q.shape[-2], k.shape[-2]) if causal else None
    with torch.enable_grad():
        out = reference_sdpa(q64, k64, v64, attn_mask=mask, scale=scale)
        return torch.autograd.grad(out, (q64, k64, v64), do64)


def tiled_backward(q, k, v, dout, *, causal: bool, scale: float, block_q: int, block_k: int,
                   bug: str | None = None, out_lse: tuple | None = None) -> tuple[torch.Tensor, ...] | None:
    """FlashAttention-2's backward loop in float64 with one known ``bug`` (or none); None where the bug
    cannot run on these shapes (a transposed product of tiles that are not square). ``out_lse``: the forward's
    (out, lse) it is given (default: those of attention with the same ``causal``)."""
    q, k, v, dout = _f64(q, k, v, dout)
    seq_q, seq_k = q.size(2), k.size(2)
    offset = 0 if bug == "top_left" else seq_k - seq_q
    out, lse = _f64(*out_lse) if out_lse is not None else reference_attention(q, k, v, causal, scale)
    delta = (dout * (dout if bug == "D_dout" else out)).sum(-1)
    if bug == "no_D":
        delta = torch.zeros_like(delta)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for k_start in range(0, seq_k, block_k):
        k_blk, v_blk = k[..., k_start:k_start + block_k, :], v[..., k_start:k_start + block_k, :]
        k_end = k_start + k_blk.size(2)
        first_seen = True
        for q_start in range(0, seq_q, block_q):
            q_end = min(seq_q, q_start + block_q)
            if causal and k_start > q_end - 1 + seq_k - seq_q:
                continue
            if causal and bug == "late_queries" and first_seen:  # the diagonal tile's query block skipped
                first_seen = False
                continue
            q_blk, do_blk = q[..., q_start:q_end, :], dout[..., q_start:q_end, :]
            s = q_blk @ k_blk.transpose(-1, -2) * scale
            if causal and bug != "no_mask":
                rows = torch.arange(q_start, q_end)[:, None]
                cols = torch.arange(k_start, k_end)[None, :]
                s = s.masked_fill(cols > rows + offset, -math.inf)
            if bug == "no_lse":
                p = torch.exp(s)
            elif bug == "exp2_natural":
                p = torch.exp2(s - lse[..., q_start:q_end, None])
            elif bug == "tile_softmax":
                p = torch.softmax(s, -1).nan_to_num(0.0)
            else:
                p = torch.exp(s - lse[..., q_start:q_end, None])
            dp = do_blk @ v_blk.transpose(-1, -2)
            row_delta = (p * dp).sum(-1) if bug == "D_tile" else delta[..., q_start:q_end]
            ds = p * (dp - row_delta[..., None])
            factor = 1.0 if bug == "no_scale" else scale
            transposed = {"P_not_transposed": p, "dS_not_transposed": ds}.get(bug)
            if transposed is not None and transposed.size(-1) != transposed.size(-2):
                return None
            dv[..., k_start:k_end, :] += (p if bug == "P_not_transposed" else p.transpose(-1, -2)) @ do_blk
            dq[..., q_start:q_end, :] += factor * ds @ k_blk
            dk[..., k_start:k_end, :] += factor * (ds if bug == "dS_not_transposed" else ds.transpose(-1, -2)) @ q_blk
    return dq, dk, dv


_BACKWARD_BUGS = {"D_dout": "bwd_D_dout", "no_D": "bwd_no_D", "no_scale": "bwd_no_scale", "no_lse": "bwd_no_lse",
                  "tile_softmax": "bwd_tile_softmax", "dS_not_transposed": "bwd_dS_not_transposed",
                  "P_not_transposed": "bwd_P_not_transposed", "no_mask": "bwd_no_mask", "top_left": "bwd_top_left",
                  "D_tile": "bwd_D_tile", "late_queries": "bwd_late_queries", "exp2_natural": "bwd_exp2_natural"}


def _backward_variants(q, k, v, dout, causal, scale, block_q, block_k) -> list[list[Variant]]:
    """Per gradient (dq, dk, dv): the known wrong ones, each computed once, lazily."""
    cache: dict[str, Any] = {}

    def part(bug: str, index: int) -> Callable[[], torch.Tensor | None]:
        def run() -> torch.Tensor | None:
            if bug not in cache:
                cache[bug] = tiled_backward(q, k, v, dout, causal=causal, scale=scale, block_q=block_q,
                                            block_k=block_k, bug=bug)
            return None if cache[bug] is None else cache[bug][index]
        return run

    bugs = [bug for bug in _BACKWARD_BUGS if causal or bug not in ("no_mask", "top_left", "late_queries")]
    return [[Variant(part(bug, index), HINTS[_BACKWARD_BUGS[bug]]) for bug in bugs] for index in range(3)]


def _backward_call_text(q, k, block_q, block_k, causal, scale) -> str:
    blocks = "" if block_q is None else f"block_q={block_q}, block_k={block_k}, "
    scale_text = "" if scale is None else f", scale={scale}"
    return (f"flash_attention_backward(q, k, v, out, lse, dout, {blocks}causal={causal}{scale_text}) with q "
            f"{shape_str(q.shape)}, k and v {shape_str(k.shape)} ({str(q.dtype).replace('torch.', '')}, "
            f"{q.device.type})")


def _backward_inputs(generator, shape, causal, dtype=torch.float64, device: Any = "cpu", scale=None):
    batch, heads, seq_q, seq_k, head_dim = shape
    q, k, v = _qkv(generator, batch, heads, seq_q, seq_k, head_dim, dtype=dtype, device=device)
    dout = randn(batch, heads, seq_q, head_dim, generator=generator, dtype=dtype, device=device)
    used = head_dim ** -0.5 if scale is None else scale
    out, lse = reference_attention(q, k, v, causal, used)
    return q, k, v, out.to(device, dtype), lse.to(device, torch.float32 if dtype != torch.float64 else dtype), dout


# What the backward pass may not call: the attention it differentiates, or autograd (torch.autograd.grad, .backward(),
# torch.func's transforms all call "grad" or "backward").
BACKWARD_BUILTINS = ("scaled_dot_product_attention", "grad", "backward")


def _call_backward(flash_attention_backward, inputs, block_q, block_k, causal, scale=None,
                   watch: OperationWatch | None = None, given: str = "") -> tuple[tuple[torch.Tensor, ...], str]:
    q, k, v, out, lse, dout = inputs
    call = _backward_call_text(q, k, block_q, block_k, causal, scale) + (f", given {given}" if given else "")
    kwargs: dict[str, Any] = {"causal": causal}
    if block_q is not None:
        kwargs.update(block_q=block_q, block_k=block_k)
    if scale is not None:
        kwargs["scale"] = scale
    args = tuple(t.clone() for t in inputs)
    try:
        result = call_student(flash_attention_backward, *args, call=call, forbidden=BACKWARD_BUILTINS,
                              probes=[] if watch is None else [watch], **kwargs)
    except RuleFailure as failure:
        raise RuleFailure(f"{failure}\n  Likely mistake: {HINTS['bwd_autograd']}") from None
    expect_true(isinstance(result, (tuple, list)) and len(result) == 3,
                f"{call} should return the tuple (dq, dk, dv), got {describe(result)}.")
    for name, got, like in zip(("dq", "dk", "dv"), result, (q, k, v)):
        expect_tensor(got, what=f"{name} from {call}", shape=like.shape, dtype=like.dtype, device=like.device,
                      dtype_hint=HINTS["cast_back"])
    return tuple(result), call


def gradients_from_saved(q, k, v, out, lse, dout, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dv)`` in float64 from the *given* out and lse (as FlashAttention's backward computes them): the
    reference for half-precision inputs, whose out and lse are themselves rounded."""
    q, k, v, out, lse, dout = _f64(q, k, v, out, lse, dout)
    scores = _scores(q, k, causal, scale)
    p = torch.exp(scores - lse[..., None])  # [B, H, S_q, S_k]
    ds = p * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    return scale * ds @ k, scale * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ dout


def _expect_keyless_gradients(grads: Sequence[torch.Tensor], keyless: int, call: str) -> None:
    """Queries that see no key: no NaN in any gradient, and their dq rows 0 (as autograd through SDPA)."""
    if keyless <= 0:
        return
    for name, got in zip(("dq", "dk", "dv"), grads):
        expect_no_nan(got, f"{name} from {call}", "no_key_bwd_nan")
    expect_keyless_rows(grads[0], keyless, f"dq from {call}", "no_key_bwd_nan", wrong_hint=None)


def _backward_case(flash_attention_backward, generator, shape, block_q, block_k, causal, scale=None,
                   dtype=torch.float64, device: Any = "cpu") -> None:
    inputs = _backward_inputs(generator, shape, causal, dtype, device, scale)
    grads, call = _call_backward(flash_attention_backward, inputs, block_q, block_k, causal, scale)
    q, k, v, _, _, dout = inputs
    _expect_keyless_gradients(grads, keyless_queries(q.shape[-2], k.shape[-2], causal), call)
    used = q.shape[-1] ** -0.5 if scale is None else scale
    half = dtype in (torch.float16, torch.bfloat16)
    want = gradients_from_saved(*inputs, causal, used) if half else reference_gradients(q, k, v, dout, causal, used)
    blocks = (64, 64) if block_q is None else (block_q, block_k)
    variants = _backward_variants(q, k, v, dout, causal, used, *blocks)
    for name, got, expected, wrong in zip(("dq", "dk", "dv"), grads, want, variants):
        expect_close(got, expected, what=f"{name} from {call}", against="torch.autograd through SDPA (float64)",
                     variants=wrong)
        if half:
            _expect_float32_inside(got, expected, f"{name} from {call}")


@check("flash_attention_backward: dq, dk, dv equal autograd through SDPA (float64, then the device); ragged; causal bottom-right; any blocks ({device})",
       uses=("flash_attention_forward",))
def check_flash_attention_backward(flash_attention_backward: Callable, *, seed: int = 0,
                                   device: torch.device | None = None) -> None:
    """flash_attention_backward: gradients against autograd, the classic mistakes named."""
    expect_signature(flash_attention_backward, "flash_attention_backward",
                     ["q", "k", "v", "out", "lse", "dout", "block_q", "block_k", "causal", "scale"])
    generator = random_generator(seed)
    seq = randint(33, 41, generator)
    _backward_case(flash_attention_backward, generator, (2, 2, 32, 32, 8), 16, 16, False)
    _backward_case(flash_attention_backward, generator, (1, 2, seq, seq + 11, 8), 16, 16, False)
    _backward_case(flash_attention_backward, generator, (1, 2, seq, seq, 8), 16, 16, True)
    _backward_case(flash_attention_backward, generator, (2, 1, 21, seq, 8), 8, 16, True)
    _backward_case(flash_attention_backward, generator, (1, 1, 19, 27, 4), 8, 8, False, scale=0.4)
    _backward_case(flash_attention_backward, generator, (1, 1, 70, 70, 8), None, None, True)  # default blocks
    # More queries than keys: queries 0-20 see no key (lse = -inf), and get no gradient.
    _backward_case(flash_attention_backward, generator, (1, 2, 40, 19, 8), 8, 8, True)
    _backward_case(flash_attention_backward, generator, (1, 2, seq, seq + 5, 16), 16, 16, True,
                   dtype=torch.float32, device=device)
    # Half precision in, the same dtype out, float32 inside: on the CPU too (PyTorch's CPU kernels take both).
    for dtype, causal in ((torch.float16, False), (torch.bfloat16, True)):
        _backward_case(flash_attention_backward, generator, (1, 2, seq, seq + 5, 16), 16, 16, causal, dtype=dtype)
    _expect_backward_from_saved(flash_attention_backward, generator)


def _expect_backward_from_saved(flash_attention_backward: Callable, generator: torch.Generator) -> None:
    """The method: given an out that is not the forward's, then an lse shifted by a known constant per query row,
    the gradients must change exactly as D = rowsum(dout ∘ out) and P = exp(scale · q kᵀ - lse) say. A backward
    that recomputes them (autograd through SDPA, a softmax, its own forward) returns attention's gradients whatever
    it is given. The checker chooses the inputs and compares the results itself: nothing measured in the kernel."""
    shape, scale = (1, 2, 40, 40, 8), 8 ** -0.5
    q, k, v, out, lse, dout = _backward_inputs(generator, shape, True)
    recomputed = reference_gradients(q, k, v, dout, True, scale)  # what a backward that ignores out or lse returns
    shift = 0.3 + 0.7 * torch.rand(lse.shape, generator=generator, dtype=torch.float64)
    changes = [("out", "out + a known change (not the forward's out)", out + 0.5 * randn(*out.shape, generator=generator),
                lse, "bwd_delta_recomputed"),
               ("lse", "lse + a known constant per query row", out, lse + shift, "bwd_lse_recomputed")]
    for name, given, changed_out, changed_lse, hint in changes:
        inputs = (q, k, v, changed_out, changed_lse, dout)
        grads, call = _call_backward(flash_attention_backward, inputs, 16, 16, True, given=given)
        expected = gradients_from_saved(*inputs, True, scale)
        for index in (2, 0, 1):
            if torch.allclose(expected[index], recomputed[index]):
                continue  # this gradient does not use what was changed (dv does not use out)
            expect_close(grads[index], expected[index], what=f"{('dq', 'dk', 'dv')[index]} from {call}",
                         against=f"the formula with the {name} it was given (float64)",
                         variants=[Variant(recomputed[index], HINTS[hint])])


@check("flash_attention_backward: never builds a tensor as wide as all the keys; the causal pass skips future tiles")
def check_flash_attention_backward_memory(flash_attention_backward: Callable, *, seed: int = 0,
                                          device: torch.device | None = None) -> None:
    """Every operation watched: no [S_q, S_k] table nor a row block of it; causal computes ~half the tiles."""
    generator = random_generator(seed)
    head_dim, heads = 8, 3
    narrow = (1, head_dim, heads)
    for causal, (seq_q, seq_k) in ((False, (48, 80)), (True, (48, 80))):
        inputs = _backward_inputs(generator, (1, heads, seq_q, seq_k, head_dim), causal)
        watch = OperationWatch(table=(seq_q, seq_k), narrow=narrow, queries=True)
        _, call = _call_backward(flash_attention_backward, inputs, 16, 16, causal, watch=watch)
        _expect_no_table(watch, call, "a table of scores or probabilities against all the keys (or all the queries). "
                         "The backward pass recomputes one [block_q, block_k] tile of P at a time from q, k and lse",
                         "loop over key blocks and query blocks; per tile recompute P = exp(scale · q kᵀ - lse), "
                         "and accumulate dV, dK (per key block) and dQ (per query block).")
    seq, block = 96, 16
    inputs = {causal: _backward_inputs(generator, (1, 2, seq, seq, head_dim), causal) for causal in (False, True)}
    counts = {}
    for causal in (False, True):
        watch = OperationWatch()
        _call_backward(flash_attention_backward, inputs[causal], block, block, causal, watch=watch)
        counts[causal] = _score_products(watch, block)
    _expect_tiles(counts, seq, block, f"flash_attention_backward(..., block_q={block}, block_k={block}, "
                  "causal={causal})", "bwd_no_tiles", "bwd_future_blocks")


class SavedForBackward(Probe):
    """What a custom Function's backward will see, taken where ``apply`` ran (in grading, the student's
    kernel): ``grad_fn`` (its text), ``backward`` (whether it is a custom Function's node), ``saved`` (the
    tensors saved with save_for_backward) and ``kept`` (``(name, shape)`` of the tensors kept as ctx attributes
    that are neither an input nor the output)."""

    def __init__(self) -> None:
        super().__init__()
        self.grad_fn, self.backward = "None", False
        self.saved: list[torch.Tensor] = []
        self.kept: list[tuple[str, tuple[int, ...]]] = []

    def returned(self, result: Any, args: tuple) -> None:
        node = getattr(result, "grad_fn", None)
        self.grad_fn = str(node)[:200]
        self.backward = node is not None and hasattr(node, "saved_tensors")
        self.saved = [t.detach() for t in getattr(node, "saved_tensors", ()) or ()] if self.backward else []
        attributes = vars(node).items() if hasattr(node, "__dict__") else ()
        self.kept = [(str(name)[:100], tuple(value.shape)) for name, value in attributes
                     if isinstance(value, torch.Tensor) and not any(value is x for x in (*args, result))]

    def findings(self) -> dict:
        return {"grad_fn": self.grad_fn, "backward": self.backward, "saved": self.saved,
                "kept": [[name, list(shape)] for name, shape in self.kept]}

    def accept(self, findings: Any) -> None:
        if not (isinstance(findings, dict) and isinstance(findings.get("backward"), bool)
                and probes.strings([findings.get("grad_fn")]) and isinstance(findings.get("saved"), list)
                and len(findings["saved"]) <= 100 and all(isinstance(t, torch.Tensor) for t in findings["saved"])
                and isinstance(findings.get("kept"), list) and len(findings["kept"]) <= 100):
            raise wire.WireError("a malformed report of what a Function saved")
        for item in findings["kept"]:
            if not (isinstance(item, list) and len(item) == 2 and probes.strings([item[0]])
                    and isinstance(item[1], list) and all(type(n) is int and n >= 0 for n in item[1])):
                raise wire.WireError("a malformed report of what a Function saved")
        self.grad_fn, self.backward, self.saved = findings["grad_fn"], findings["backward"], findings["saved"]
        self.kept = [(name, tuple(shape)) for name, shape in findings["kept"]]


class PassesCalled(Probe):
    """Which of the student's two passes a FlashAttention Function runs: ``flash_attention_forward`` during
    ``apply``, ``flash_attention_backward`` during autograd's backward (the call trace of the dependency notes, by
    code object). It measures the Function itself (``measure``), where it is: in grading the student's kernel, where
    its backward runs too. Its findings are the kernel's word: a lie costs the one test that reads them."""

    PASSES = {"forward": "flash_attention_forward", "backward": "flash_attention_backward"}

    def __init__(self, q: torch.Tensor | None = None, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                 dout: torch.Tensor | None = None, causal: bool = False):
        super().__init__(q=q, k=k, v=v, dout=dout, causal=bool(causal))
        self.namespace: Any = None  # the notebook's globals, where the passes are looked up
        self.called: dict[str, bool] = {}
        self.raised: str | None = None

    def bind(self, agent: Any) -> None:
        self.namespace = agent.namespace

    def measure(self, function: Any) -> dict:
        found: dict[str, Any] = {}
        q, k, v = (self.parameters[name].detach().clone().requires_grad_(True) for name in ("q", "k", "v"))
        try:
            with torch.enable_grad():
                with CallTrace([self.PASSES["forward"]]).watch(self.namespace) as trace:
                    out = function.apply(q, k, v, self.parameters["causal"])
                found["forward"] = self.PASSES["forward"] in trace.called
                with CallTrace([self.PASSES["backward"]]).watch(self.namespace) as trace:
                    torch.autograd.grad(out, (q, k, v), self.parameters["dout"])
                found["backward"] = self.PASSES["backward"] in trace.called
        except Exception as error:  # the Function's own failure: the checker says what it was
            found["raised"] = f"{type(error).__name__}: {error}"[:500]
        return found

    def accept(self, findings: Any) -> None:
        if not (isinstance(findings, dict) and set(findings) <= {"forward", "backward", "raised"}
                and all(isinstance(findings[key], bool) for key in findings if key != "raised")):
            raise wire.WireError("a malformed report of the passes a Function called")
        self.called = {key: value for key, value in findings.items() if key != "raised"}
        self.raised = probes.strings([findings["raised"]])[0] if "raised" in findings else None


def _expect_passes_called(FlashAttention: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          dout: torch.Tensor, causal: bool, call: str) -> None:
    """FlashAttention's forward runs the student's flash_attention_forward and its backward their
    flash_attention_backward (the contract), measured where the Function is."""
    probe = PassesCalled(q=q, k=k, v=v, dout=dout, causal=causal)
    if checker_side.is_remote(FlashAttention):
        checker_side.measure(FlashAttention, probe, f"the passes {call} runs")
    else:
        probe.namespace = _student_namespace(FlashAttention)
        probe.accept(probe.measure(FlashAttention))
    if probe.raised is not None:
        raise CheckFailure(f"{call} and its backward raised {probe.raised}")
    for phase, name in PassesCalled.PASSES.items():
        expect_true(probe.called.get(phase, False),
                    f"{'' if phase == 'forward' else 'the backward of '}{call} never called your {name}."
                    f"\n  Likely mistake: {HINTS['function_passes']}")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.detach(), b.detach()))


@check("FlashAttention: forward saves only q, k, v, out and lse; gradients equal autograd through SDPA; torch.autograd.gradcheck passes in float64",
       uses=("flash_attention_forward", "flash_attention_backward"))
def check_flash_attention_function(FlashAttention: Any, *, seed: int = 0, device: torch.device | None = None) -> None:
    """FlashAttention.apply(q, k, v, causal): what it saves, its gradients, gradcheck."""
    expect_true(isinstance(FlashAttention, type) and issubclass(FlashAttention, torch.autograd.Function),
                f"FlashAttention should be a subclass of torch.autograd.Function, got {describe(FlashAttention)}.")
    generator = random_generator(seed)
    forward_error = 0.0
    for causal, (seq_q, seq_k) in ((False, (20, 28)), (True, (24, 24)), (True, (13, 30)), (True, (30, 13))):
        q, k, v = (t.requires_grad_(True) for t in _qkv(generator, 1, 2, seq_q, seq_k, 8))
        dout = randn(1, 2, seq_q, 8, generator=generator)
        call = f"FlashAttention.apply(q, k, v, {causal}) with q {shape_str(q.shape)}, k and v {shape_str(k.shape)}"
        saved_for_backward = SavedForBackward()
        with torch.enable_grad():
            out = call_student(FlashAttention.apply, q, k, v, causal, call=call, probes=[saved_for_backward])
        expect_tensor(out, what=f"out from {call}", shape=q.shape, dtype=q.dtype, device=q.device)
        keyless = keyless_queries(seq_q, seq_k, causal)
        expect_keyless_rows(out, keyless, f"out from {call}", "no_key_flash_nan")
        ignored = [Variant(lambda: reference_attention(q, k, v, False)[0], HINTS["causal_ignored"])] if causal else []
        forward_error = max(forward_error, expect_close(out, reference_attention(q, k, v, causal)[0],
                                                        what=f"out from {call}",
                                                        against="F.scaled_dot_product_attention (float64)",
                                                        variants=ignored))
        expect_true(saved_for_backward.backward,
                    f"out from {call} has no backward of FlashAttention (grad_fn {saved_for_backward.grad_fn}): forward "
                    "must return the output tensor it computed, and apply (not forward) must be called.")
        saved = saved_for_backward.saved
        want_lse = reference_attention(q, k, v, causal)[1]
        named = [next((name for name, like in (("q", q), ("k", k), ("v", v), ("out", out)) if _same(tensor, like)),
                      None) for tensor in saved]
        rows = [index for index, tensor in enumerate(saved) if named[index] is None and tensor.shape == want_lse.shape
                and tensor.is_floating_point()]
        if len(rows) == 1:  # the one tensor where lse goes: its values, with the mistake named (not "saved the wrong
            lse = saved[rows[0]]  # thing"); two of them (m and l, say) are what bwd_saved below says
            rtol, atol = _lse_tolerance(out, lse)
            expect_close(lse, want_lse, what=f"the lse that the forward of {call} saved",
                         against="torch.logsumexp of the scaled, masked scores (float64)",
                         variants=_lse_variants(q, k, causal, 8 ** -0.5), rtol=rtol, atol=atol)
            named[rows[0]] = "lse"
        named = [name or shape_str(tensor.shape) for name, tensor in zip(named, saved)]
        kept = [f"ctx.{name} {shape_str(shape)}" for name, shape in saved_for_backward.kept]
        expect_true(sorted(named) == sorted(["q", "k", "v", "out", "lse"]) and not kept,
                    f"{call}: forward saved {', '.join(named) or 'nothing'} with save_for_backward"
                    + (f" and kept {', '.join(kept)}" if kept else "")
                    + f"; expected exactly q, k, v, out and lse [{seq_q} values per head].\n  Likely mistake: "
                    + HINTS["bwd_saved"])
        try:
            with torch.enable_grad():
                grads = torch.autograd.grad(out, (q, k, v), dout)
        except RuntimeError as error:
            text = str(error)
            hint = HINTS["bwd_gradients"] if "incorrect number of gradients" in text or "expected shape" in text else ""
            raise CheckFailure(f"the backward of {call} raised RuntimeError: {text}"
                               + (f"\n  Likely mistake: {hint}" if hint else "")) from None
        except CheckFailure:
            raise
        except Exception as error:
            raise CheckFailure(crash_message(f"the backward of {call}", error)) from None
        _expect_keyless_gradients(grads, keyless, f"the backward of {call}")
        want = reference_gradients(q, k, v, dout, causal, 8 ** -0.5)
        for index, (name, got, expected) in enumerate(zip(("dq", "dk", "dv"), grads, want)):
            # backward with causal=False on the forward's causal out and lse: what a lost ctx.causal gives
            not_kept = [Variant(lambda index=index: tiled_backward(q, k, v, dout, causal=False, scale=8 ** -0.5,
                                                                   block_q=64, block_k=64,
                                                                   out_lse=reference_attention(q, k, v, True))
                                [index], HINTS["bwd_causal_not_kept"])] if causal else []
            expect_close(got, expected, what=f"{name} from the backward of {call}",
                         against="torch.autograd through SDPA (float64)", variants=not_kept)
    # torch.autograd.gradcheck in float64 (fast mode: random directions, a few seconds at most). Finite
    # differences of a pass computed in float32 inside (allowed) need a float32-sized step and tolerance.
    q, k, v = (t.requires_grad_(True) for t in _qkv(generator, 1, 1, 6, 9, 4))
    steps = {"eps": 1e-6, "atol": 1e-5, "rtol": 1e-3}
    if forward_error > 1e-9:
        steps = {"eps": 1e-3, "atol": 1e-3, "rtol": 1e-2}
    for causal in (False, True):
        try:
            ok = torch.autograd.gradcheck(lambda a, b, c, causal=causal: FlashAttention.apply(a, b, c, causal),
                                          (q, k, v), fast_mode=True, raise_exception=True, **steps)
        except Exception as error:
            text = str(error).strip().splitlines()
            raise CheckFailure(f"torch.autograd.gradcheck(FlashAttention.apply, (q, k, v, causal={causal})) in float64 "
                               f"with q [1, 1, 6, 4], k and v [1, 1, 9, 4] failed: {' '.join(text[:3])[:400]}") from None
        expect_true(bool(ok), f"torch.autograd.gradcheck(FlashAttention.apply, causal={causal}) failed.")
    # The method: the two passes of the notebook run inside it (SDPA and autograd give the same numbers without).
    q, k, v = _qkv(generator, 1, 2, 20, 20, 8)
    _expect_passes_called(FlashAttention, q, k, v, randn(1, 2, 20, 8, generator=generator), True,
                          "FlashAttention.apply(q, k, v, True) with q, k and v [1, 2, 20, 8]")


# --------------------------------------------------------------------------------------
# The warm-up kernels: a masked load and store, a tiled matmul, a row softmax
# --------------------------------------------------------------------------------------


def _overrun_hint(overrun: Any, unmasked_load: str, unmasked_store: str) -> str:
    """The hint for a load or store that reached past the end, by what the interpreter saw of its lanes."""
    if overrun.cause == "no_mask":
        return HINTS[unmasked_load if overrun.operation == "load" else unmasked_store]
    return HINTS[{"last_lane": "mask_last_lane", "past_end": "mask_past_end"}.get(overrun.cause, "wrong_address")]


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first} … {last}"


# Which part of a tensor each program of a warm-up owns: name -> program -> a list of (axis, (first, last), word,
# index), one per axis it owns: axis 0 the heads (rows of a 2-D tensor), 1 the rows (its columns, a 1-D tensor's
# elements); ``index`` the program's own index along that axis (a program that starts there forgot * BLOCK).
Ownership = dict[str, Callable[[tuple[int, ...]], list[tuple[int, tuple[int, int], str, int]]]]


def _misplaced(watch: Any, owners: Ownership) -> str | None:
    """A message for the first program that reached outside its own part of a tensor, or None."""
    for name, own in owners.items():
        for program, box in sorted(watch.touched.get(name, {}).items()):
            for axis, (first, last), word, index in own(program):
                got = box[2 * axis], box[2 * axis + 1]
                if first <= got[0] and got[1] <= last:
                    continue
                forgot_block = got[0] == index != first  # it starts at its own index, not index · BLOCK
                hint = HINTS["program_offset"] if forgot_block else HINTS["wrong_address"]
                return (f"program {program} reached {word} {_span(*got)} of {name}, but its part is {word} "
                        f"{_span(first, last)}.\n"
                        f"  Likely mistake: {hint}")
    return None


@contextlib.contextmanager
def _blaming(call: str, misplaced: str | None):
    """Numbers checked inside fail, when a program reached outside its part, with that: the cause, not a symptom."""
    try:
        yield
    except CheckFailure:
        if misplaced:
            raise CheckFailure(f"{call}: {misplaced}") from None
        raise


def _ladder_launch(call: str, launcher: Callable, kernel: Any, *args: Any, owners: Ownership,
                   **kwargs: Any) -> tuple[torch.Tensor, str | None]:
    """Launch a warm-up kernel with NaN after its inputs, a sentinel after its output and a watch on its loads
    and stores; name what went wrong. Returns the result and, when a program reached outside its own part of a
    tensor (``owners``), what it reached: a diagnosis for wrong numbers only, never a failure on its own (Triton's
    matmul tutorial wraps the last blocks' rows around, % M, and is right)."""
    from attention_lab.triton_kernels import TRITON_AVAILABLE, TRITON_MISSING

    if not TRITON_AVAILABLE:
        raise CheckFailure(TRITON_MISSING)
    result, watch, stored_past = _launched(call, "Write the kernel.", launcher, kernel, *args, poison=POISON_ROWS,
                                          **kwargs)
    # What the interpreter saw names the mistake; natively only the sentinel after the output can.
    if watch.stray is not None:
        where = f" (your line: `{watch.stray.line}`)" if watch.stray.line else ""
        raise CheckFailure(f"{call}: program {watch.stray.program} tried to {watch.stray.operation} at an address "
                           f"outside every tensor of the launch{where}.\n  Likely mistake: {HINTS['wrong_address']}")
    misplaced = _misplaced(watch, owners)
    if misplaced and (watch.beyond or stored_past is not None):  # past the end because the address is wrong
        raise CheckFailure(f"{call}: {misplaced}")
    for name, overrun in watch.beyond.items():
        where = f" (your line: `{overrun.line}`)" if overrun.line else ""
        verb = "loaded" if overrun.operation == "load" else "stored"
        raise CheckFailure(f"{call}: program {overrun.program} {verb} elements of {name} past its end{where}.\n"
                           f"  Likely mistake: {_overrun_hint(overrun, 'ladder_unmasked_load', 'ladder_unmasked_store')}")
    if stored_past is not None:
        raise CheckFailure(f"{call} wrote past the end of {stored_past}.\n  Likely mistake: "
                           f"{HINTS['ladder_unmasked_store']}")
    return result, misplaced


def _unwritten(call: str, out: torch.Tensor, inputs_finite: bool = True) -> None:
    """Fail when elements of ``out`` still hold the launcher's NaN (inputs finite: no program stored them)."""
    missing = torch.isnan(out.detach().cpu())
    if inputs_finite and bool(missing.any()):
        first = tuple(int(i) for i in missing.nonzero()[0])
        raise CheckFailure(f"out from {call}: {int(missing.sum())} of {out.numel()} elements hold NaN, the first at "
                           f"index {first}.\n  Likely mistake: {HINTS['ladder_unwritten']}")


def _blocks_of(index: int, block: int, length: int) -> tuple[int, int]:
    return index * block, min(length, index * block + block) - 1


@check("scale_kernel: alpha · x with masked loads and stores, any length ({device})")
def check_scale_kernel(scale_kernel: Any, *, seed: int = 0, device: torch.device | None = None) -> None:
    """The first warm-up: a 1-D masked load and store, on lengths that are multiples of no block."""
    from attention_lab.triton_kernels import launch_scale

    generator = random_generator(seed)
    for n, block in ((100, 32), (randint(17, 63, generator), 16), (16, 16)):
        x = randn(n, generator=generator, dtype=torch.float32, device=device)
        call = f"your scale_kernel via launch_scale(scale_kernel, x, alpha=2.5, block={block}) with x [{n}]"
        own = lambda p, block=block: [(1, (p[0] * block, p[0] * block + block - 1), "elements", p[0])]  # noqa: E731
        out, misplaced = _ladder_launch(call, launch_scale, scale_kernel, x, 2.5, block=block,
                                        owners={"x": own, "out": own})
        with _blaming(call, misplaced):
            _unwritten(call, out)
            expect_close(out, 2.5 * x.double(), what=f"out from {call}", against="2.5 · x")


@check("matmul_kernel: a tiled A @ B with a float32 accumulator, ragged M, N and K ({device})")
def check_matmul_kernel(matmul_kernel: Any, *, seed: int = 0, device: torch.device | None = None) -> None:
    """The second warm-up: blocks of C, a loop over K, masks on every ragged edge."""
    from attention_lab.triton_kernels import launch_matmul

    generator = random_generator(seed)
    block = 16
    for (m, k, n), dtype in (((40, 50, 24), torch.float32), ((33, 70, 47), torch.float16), ((16, 16, 16), torch.float32)):
        a = randn(m, k, generator=generator, dtype=dtype, device=device)
        b = randn(k, n, generator=generator, dtype=dtype, device=device)
        call = (f"your matmul_kernel via launch_matmul(matmul_kernel, a, b, block_m=16, block_n=16, block_k=16) "
                f"with a [{m}, {k}] and b [{k}, {n}] ({str(dtype).replace('torch.', '')})")
        rows = lambda p: (0, (p[0] * block, p[0] * block + block - 1), "rows", p[0])  # noqa: E731
        columns = lambda p: (1, (p[1] * block, p[1] * block + block - 1), "columns", p[1])  # noqa: E731
        # program (i, j): rows i·16 … of A and C, columns j·16 … of B and C
        owners = {"A": lambda p: [rows(p)], "B": lambda p: [columns(p)], "C": lambda p: [rows(p), columns(p)]}
        c, misplaced = _ladder_launch(call, launch_matmul, matmul_kernel, a, b, owners=owners)
        with _blaming(call, misplaced):
            _matmul_numbers(c, a, b, call, dtype, block)


def _matmul_numbers(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, call: str, dtype: torch.dtype,
                    block: int) -> None:
    """C against a @ b in float64, the known mistakes named."""
    k = a.shape[1]
    if bool(torch.isnan(c.cpu()).any()):  # A and B are finite: the NaN was read after their ends, or never written
        hint = HINTS["ladder_nan_past_end"]
        if bool(torch.isnan(c.cpu()).all(-1).any()) and not bool(torch.isnan(c.cpu()).all()):
            hint = HINTS["ladder_unwritten"]
        raise CheckFailure(f"C from {call} holds NaN.\n  Likely mistake: {hint}")
    a64, b64 = _f64(a, b)
    last_slice = block * ((k - 1) // block)  # where the last K slice starts
    variants = [Variant(lambda a64=a64, b64=b64: a64[:, :block] @ b64[:block], HINTS["matmul_one_k_block"]),
                Variant(lambda a64=a64, b64=b64, s=last_slice: a64[:, :s] @ b64[:s], HINTS["matmul_last_slice"])]
    rtol, atol = tolerance(torch.float16 if dtype == torch.float16 or c.device.type == "cuda" else dtype, c.device)
    try:
        expect_close(c, a64 @ b64, what=f"C from {call}", against="a @ b (float64)", variants=variants,
                     rtol=rtol * 10, atol=atol * 10)
    except CheckFailure as failure:
        half_rtol, half_atol = tolerance(torch.float16, c.device)
        float32_case = dtype == torch.float32 and c.device.type == "cpu"
        if ("Likely mistake" in str(failure) or not float32_case
                or not torch.allclose(c.double().cpu(), a64 @ b64, rtol=half_rtol * 10, atol=half_atol * 10)):
            raise
        raise CheckFailure(f"{failure}\n  Likely mistake: {HINTS['matmul_half_accumulator']}") from None


@check("row_softmax_kernel: softmax of each row, stable at ±1000, any row length ({device})")
def check_row_softmax_kernel(row_softmax_kernel: Any, *, seed: int = 0, device: torch.device | None = None) -> None:
    """The third warm-up: one program per row, masked lanes at -inf, the max subtracted."""
    from attention_lab.triton_kernels import launch_row_softmax

    generator = random_generator(seed)
    cols = randint(33, 60, generator)
    x = randn(5, cols, generator=generator, dtype=torch.float32, device=device) * 3
    x[1] += 1000.0  # a row that overflows e^x without the max subtracted
    x[2] -= 1000.0
    own = lambda p: [(0, (p[0], p[0]), "row", -1)]  # noqa: E731  program r: row r (it has no BLOCK to forget)
    for label, values in (("of", x[[0, 3, 4]]), ("around ±1000,", x), ("(one block exactly)", x[:, :32])):
        call = (f"your row_softmax_kernel via launch_row_softmax(row_softmax_kernel, x) with x {label} "
                f"{shape_str(values.shape)}")
        out, misplaced = _ladder_launch(call, launch_row_softmax, row_softmax_kernel, values.contiguous(),
                                        owners={"x": own, "out": own})
        with _blaming(call, misplaced):
            _row_softmax_numbers(out, values, call)


def _row_softmax_numbers(out: torch.Tensor, values: torch.Tensor, call: str) -> None:
    """out against torch.softmax in float64, the known mistakes named."""
    x64 = _f64(values)[0]
    block = 1 << (values.shape[1] - 1).bit_length()
    padded = torch.cat([x64, torch.zeros(x64.shape[0], block - x64.shape[1], dtype=torch.float64)], -1)
    with_zeros = torch.exp(x64 - padded.amax(-1, keepdim=True))
    with_zeros = with_zeros / torch.exp(padded - padded.amax(-1, keepdim=True)).sum(-1, keepdim=True)
    if bool((~torch.isfinite(out.cpu())).any()):
        # Scores of ordinary size cannot overflow: NaN there came from the NaN stored after each row.
        hint = HINTS["softmax_no_max"] if float(values.abs().max()) > 100 else HINTS["ladder_nan_past_end"]
        raise CheckFailure(f"out from {call} holds inf or NaN.\n  Likely mistake: {hint}")
    expect_close(out, torch.softmax(x64, -1), what=f"out from {call}", against="torch.softmax (float64)",
                 variants=[Variant(with_zeros, HINTS["softmax_other_zero"])])


ONLINE_SOFTMAX_HINTS = {
    "no_rescale": "the running sum was not rescaled when the running max grew: l = l · e^(m - m_new) + Σ e^(x - "
    "m_new). Without the factor, the blocks read before the larger max keep sums taken against the old one.",
    "first_block_only": "the max and the sum come from the first column block only: loop over every block of the "
    "row, range(0, n_cols, BLOCK), before the second pass writes the output.",
    "other_zero": "the lanes past n_cols in the last block were loaded as 0 (other=0.0): they enter the max and add "
    "e^(0 - m) to the sum. Load them as other=float('-inf'), so that e^(-inf) = 0.",
    "normalise_first_loop": "the output is written in the first loop, each block with the running max and sum "
    "known at that block: the blocks before the row's maximum and its last block get a max and a sum that are not "
    "the row's yet. The first loop only updates m and l; a second loop over the blocks writes e^(x - m) / l with "
    "the final m and l.",
    "unwritten_last_block": "your loop stops before the last block: range(0, n_cols, BLOCK) visits every block, the "
    "last, shorter one too (its mask keeps the lanes past n_cols out); range(0, n_cols - BLOCK, BLOCK) stops a "
    "block early.",
    "unwritten_after_first_block": "only the first BLOCK columns were written: the row is longer than one BLOCK "
    "here (the launcher's BLOCK may be much shorter than the row), so both passes loop over the row's column "
    "blocks, for start in range(0, n_cols, BLOCK).",
}


def _online_softmax_variants(x64: torch.Tensor, block: int) -> list[Variant]:
    """Known mistakes of the loop over column blocks, computed in float64."""
    cols = x64.shape[-1]
    blocks = [x64[:, start:start + block] for start in range(0, cols, block)]

    def no_rescale() -> torch.Tensor:
        m = torch.full(x64.shape[:1], -math.inf, dtype=torch.float64)
        total = torch.zeros(x64.shape[:1], dtype=torch.float64)
        for part in blocks:
            m = torch.maximum(m, part.amax(-1))
            total = total + torch.exp(part - m[:, None]).sum(-1)
        return torch.exp(x64 - m[:, None]) / total[:, None]

    def first_block_only() -> torch.Tensor:
        m = blocks[0].amax(-1, keepdim=True)
        return torch.exp(x64 - m) / torch.exp(blocks[0] - m).sum(-1, keepdim=True)

    def other_zero() -> torch.Tensor:
        padded = torch.cat([x64, torch.zeros(x64.shape[0], -cols % block, dtype=torch.float64)], -1)
        m = padded.amax(-1, keepdim=True)
        return torch.exp(x64 - m) / torch.exp(padded - m).sum(-1, keepdim=True)

    def normalised_in_the_first_loop() -> torch.Tensor:
        m = torch.full(x64.shape[:1], -math.inf, dtype=torch.float64)
        total = torch.zeros(x64.shape[:1], dtype=torch.float64)
        written = []
        for part in blocks:
            new = torch.maximum(m, part.amax(-1))
            total = total * torch.exp(m - new) + torch.exp(part - new[:, None]).sum(-1)
            m = new
            written.append(torch.exp(part - m[:, None]) / total[:, None])
        return torch.cat(written, -1)

    variants = [Variant(no_rescale, ONLINE_SOFTMAX_HINTS["no_rescale"]),
                Variant(lambda: torch.softmax(x64 * LN_2, -1), HINTS["exp2_unscaled"])]
    if cols > block:
        variants.append(Variant(normalised_in_the_first_loop, ONLINE_SOFTMAX_HINTS["normalise_first_loop"]))
    if cols > block:
        variants.append(Variant(first_block_only, ONLINE_SOFTMAX_HINTS["first_block_only"]))
    if cols % block:
        variants.append(Variant(other_zero, ONLINE_SOFTMAX_HINTS["other_zero"]))
    return variants


# Of the values of a half-precision result computed in float32 and rounded once at the store, the share that is not
# the correctly rounded exact value: those within float32's error of a rounding midpoint, about 1 in 10,000
# (measured: none of 800 in the check's cases). Computed in float16 inside: 14-54% (measured on the same cases).
ROUNDED_TWICE_SHARE = 0.05


def _expect_rounded_once(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """A half-precision kernel result must be the inputs' dtype's rounding of the exact one (computed in float32,
    rounded once at the store), up to a few values near a rounding midpoint."""
    rounded = want.to(got.dtype).cpu()
    off = int((got.detach().cpu() != rounded).sum())
    if off > max(2, ROUNDED_TWICE_SHARE * got.numel()):
        dtype = str(got.dtype).replace("torch.", "")
        raise CheckFailure(f"{what}: {off} of its {got.numel()} values are not the {dtype} rounding of the exact "
                           f"softmax (float32 inside rounds once, at the store: a few in ten thousand may differ).\n"
                           f"  Likely mistake: " + HINTS["kernel_half_internals"].format(dtype=dtype))


def _expect_every_column_written(out: torch.Tensor, block: int, call: str) -> None:
    """The same last columns of every row still hold the launcher's NaN (the inputs are finite, and no load or
    store reached past the end: those are named first): the loop never reached them. Which ones says how."""
    missing = torch.isnan(out.detach().cpu())
    columns = missing.all(0)
    cols = out.shape[-1]
    if not bool(missing.any()) or not bool((missing == columns).all()):
        return
    first = int(columns.float().argmax())
    if not bool(columns[first:].all()):
        return
    last_block = block * ((cols - 1) // block)
    hint = {block: "unwritten_after_first_block", last_block: "unwritten_last_block"}.get(first)
    raise CheckFailure(f"out from {call}: columns {first} … {cols - 1} of every row were never written (they still "
                       "hold the launcher's NaN)." + (f"\n  Likely mistake: {ONLINE_SOFTMAX_HINTS[hint]}" if hint else ""))


@check("online_softmax_kernel: softmax of rows longer than one block, stable from -1000 to 1000 ({device})")
def check_online_softmax_kernel(online_softmax_kernel: Any, *, seed: int = 0,
                                device: torch.device | None = None) -> None:
    """The fourth warm-up: the online softmax inside one Triton program, a loop over column blocks with a
    running max and a rescaled running sum, then a second pass that writes exp(x - m) / l."""
    from attention_lab.triton_kernels import launch_online_softmax

    generator = random_generator(seed)
    cols = randint(70, 120, generator)
    x = randn(4, cols, generator=generator, dtype=torch.float32, device=device) * 3
    x[1, 40:] += 1000.0  # the max jumps by 1000 after the first blocks: the sum so far must be rescaled
    x[2, :16] += 1000.0  # the max comes first, a block at -1000 later
    x[2, 50:] -= 1000.0
    cases = [(x[[0, 3]], 32, "of ordinary scores"), (x, 32, "spanning -1000 ... 1000"),
             (x[:, :64], 16, "of four blocks exactly"), (x[[0, 3], :20], 32, "shorter than one block"),
             (x[[0, 1]].half(), 16, "in float16")]
    for values, block, label in cases:
        values = values.contiguous()
        call = (f"your online_softmax_kernel via launch_online_softmax(online_softmax_kernel, x, block={block}) "
                f"with x {label}, {shape_str(values.shape)} ({str(values.dtype).replace('torch.', '')})")
        own = lambda p: [(0, (p[0], p[0]), "row", -1)]  # noqa: E731  program r: row r, all its column blocks
        out, misplaced = _ladder_launch(call, launch_online_softmax, online_softmax_kernel, values, block=block,
                                        owners={"x": own, "out": own})
        x64 = _f64(values)[0]
        with _blaming(call, misplaced):
            _expect_every_column_written(out, block, call)
            if bool((~torch.isfinite(out.cpu())).any()):
                hint = HINTS["softmax_no_max"] if float(values.abs().max()) > 100 else HINTS["ladder_unmasked_load"]
                raise CheckFailure(f"out from {call} holds inf or NaN.\n  Likely mistake: {hint}")
            expect_close(out, torch.softmax(x64, -1), what=f"out from {call}", against="torch.softmax (float64)",
                         variants=_online_softmax_variants(x64, block))
            if out.dtype == torch.float16:  # float16 in, float16 out, float32 inside (the exercise's text)
                _expect_rounded_once(out, torch.softmax(x64, -1), f"out from {call}")


# --------------------------------------------------------------------------------------
# Exercise: the Triton kernel
# --------------------------------------------------------------------------------------


def _kernel_variants(q, k, v, causal: bool, block_q: int, block_k: int) -> list[Variant]:
    scale = q.shape[-1] ** -0.5
    variants = _out_variants(q, k, v, causal, scale, block_q, block_k,
                             extra=(("exp_with_log2e", LOG2_E), ("exp2_unscaled", LN_2)))
    seq_k = k.shape[-2]
    if seq_k % block_k:
        padded = math.ceil(seq_k / block_k) * block_k  # unmasked padding: zero keys with score 0, zero values
        k_pad = torch.cat([_f64(k)[0], torch.zeros(*k.shape[:2], padded - seq_k, k.shape[-1], dtype=torch.float64)], -2)
        v_pad = torch.cat([_f64(v)[0], torch.zeros(*v.shape[:2], padded - seq_k, v.shape[-1], dtype=torch.float64)], -2)
        offset_keep = causal_keep(q.shape[-2], padded, offset=seq_k - q.shape[-2]) if causal else None
        variants.append(Variant(lambda: reference_sdpa(_f64(q)[0], k_pad, v_pad, attn_mask=offset_keep, scale=scale),
                                HINTS["kernel_boundary"]))
    return variants


def _kernel_tolerance_basis(out: torch.Tensor) -> torch.Tensor:
    """fp32 tl.dot on a GPU runs in TF32 by default (10-bit mantissa): judge it like float16."""
    if out.device.type == "cuda" and out.dtype == torch.float32:
        return out.to(torch.float16)
    return out


# Rows of NaN after each head's rows of q, k and v in every kernel case (two of the largest blocks): a load
# without a mask reads them, on the CPU and on a GPU alike, whatever memory happens to follow the tensors.
POISON_ROWS = 64


def _visited_blocks_needed(seq_q: int, seq_k: int, block_q: int, block_k: int, heads: int) -> int:
    """Key blocks a causal kernel must visit: per query block, those that hold a key its last query sees."""
    needed = 0
    for q_start in range(0, seq_q, block_q):
        stop = min(seq_k, min(seq_q, q_start + block_q) + seq_k - seq_q)
        needed += max(0, math.ceil(stop / block_k))
    return needed * heads


def _launched(call: str, blank: str, launcher: Callable, kernel: Any, *args: Any, **kwargs: Any) -> tuple:
    """``(result, watch, name of the output stored past)`` of the course's ``launcher`` run on a student's
    ``kernel`` with a :class:`LoadWatch` (where the kernel is: in grading, in the student's process); a launch
    that fails otherwise fails the check, ``blank``: what to do when the kernel is not written yet."""
    from attention_lab.triton_kernels import LoadWatch, StoreOutOfBounds, TritonUnavailable, launch

    watch = LoadWatch()
    result, stored_past = None, None
    try:
        result = launch(launcher, kernel, *args, watch=watch, **kwargs)
    except TritonUnavailable as error:
        raise CheckFailure(str(error)) from None
    except NotImplementedError as error:
        raise CheckFailure(f"{call}: not implemented yet ({error}). {blank}") from None
    except StoreOutOfBounds as error:
        stored_past = error.name
    except checker_side.BridgeError as error:
        raise CheckFailure(f"{call}: {error}") from None
    except Exception as error:
        text = str(error).strip()
        hint = (HINTS["not_jitted"] if isinstance(error, TypeError) and "not subscriptable" in text
                else HINTS["dot_dtypes"] if "Both operands must be same dtype" in text else None)
        raise CheckFailure(f"{call} raised {type(error).__name__}:\n{text[-1500:]}"
                           + (f"\n  Likely mistake: {hint}" if hint else "")) from None
    return result, watch, stored_past


def _kernel_launch(call: str, blank: str, lengths: dict[str, tuple[str, int]], launcher: Callable, kernel: Any,
                   *args: Any, **kwargs: Any) -> tuple:
    """Run ``launcher(kernel, *args, **kwargs)`` (the course's launcher on a student's kernel, with NaN rows after
    each input and a sentinel after each output); name a load or a store past the end. ``lengths``: name ->
    (length's name, length) of every tensor the kernel reads or writes."""
    result, watch, stored_past = _launched(call, blank, launcher, kernel, *args, poison=POISON_ROWS, **kwargs)
    # The interpreter saw every load and store: one past the last row is named, whatever it did to the numbers.
    if watch.stray is not None:
        where = f" (your line: `{watch.stray.line}`)" if watch.stray.line else ""
        raise CheckFailure(f"{call}: program {watch.stray.program} tried to {watch.stray.operation} at an address "
                           f"outside every tensor of the launch{where}.\n  Likely mistake: {HINTS['wrong_address']}")
    for name, (length_name, length) in lengths.items():
        overrun = watch.beyond.get(name)
        if overrun is None:
            continue
        where = f" (your line: `{overrun.line}`)" if overrun.line else ""
        verb = "loaded" if overrun.operation == "load" else "stored"
        raise CheckFailure(f"{call}: program {overrun.program} {verb} rows of {name} at or past row {length_name} = "
                           f"{length}{where}, which {name} does not have.\n  Likely mistake: "
                           f"{_overrun_hint(overrun, 'unmasked_load', 'kernel_unmasked_store')}")
    if stored_past is not None:
        raise CheckFailure(f"{call} wrote past the end of {stored_past}.\n  Likely mistake: "
                           f"{HINTS['kernel_unmasked_store']}")
    return result, watch


def _kernel_case(kernel, launcher, shape, causal, block_q, block_k, dtype, device, generator) -> None:
    batch, heads, seq_q, seq_k, head_dim = shape
    q, k, v = _qkv(generator, batch, heads, seq_q, seq_k, head_dim, dtype=dtype, device=device)
    call = (f"your kernel via launch_flash_attention(flash_attention_kernel, q, k, v, causal={causal}, "
            f"block_q={block_q}, block_k={block_k}) with q {shape_str(q.shape)}, k and v {shape_str(k.shape)} "
            f"({str(dtype).replace('torch.', '')}, {device.type})")
    lengths = {"K": ("seq_k", seq_k), "V": ("seq_k", seq_k), "Q": ("seq_q", seq_q), "out": ("seq_q", seq_q),
               "lse": ("seq_q", seq_q)}
    (out, lse), watch = _kernel_launch(call, "Write the loop over key blocks.", lengths, launcher, kernel, q, k, v,
                                       causal=causal, block_q=block_q, block_k=block_k)
    keyless = keyless_queries(seq_q, seq_k, causal)
    expect_keyless_rows(out, keyless, f"out from {call}", "no_key_flash_nan")
    expect_keyless_rows(lse, keyless, f"lse from {call}", "no_key_flash_nan", fill=-math.inf)
    want_out, want_lse = reference_attention(q, k, v, causal)
    if bool((torch.isnan(out.detach().cpu()) & ~torch.isnan(want_out)).any()):
        raise CheckFailure(f"out from {call} holds NaN where attention is finite.\n  Likely mistake: "
                           f"{HINTS['nan_past_end']}")
    basis = _kernel_tolerance_basis(out)
    expect_close(out, want_out, what=f"out from {call}", against="F.scaled_dot_product_attention (float64)",
                 variants=_kernel_variants(q, k, v, causal, block_q, block_k),
                 rtol=tolerance(basis.dtype, device)[0], atol=tolerance(basis.dtype, device)[1])
    lse_rtol, lse_atol = tolerance(torch.float32 if basis.dtype == torch.float32 else torch.float16, device)
    expect_close(lse, want_lse, what=f"lse from {call}", against="torch.logsumexp of the scaled, masked scores",
                 variants=_lse_variants(q, k, causal, q.shape[-1] ** -0.5), rtol=lse_rtol, atol=lse_atol)
    # Work (seen by the interpreter): a causal kernel skips the key blocks no query of a program may see.
    if causal and watch.active:
        visited = len(watch.blocks.get("K", ()))
        needed = _visited_blocks_needed(seq_q, seq_k, block_q, block_k, batch * heads)
        every = math.ceil(seq_q / block_q) * math.ceil(seq_k / block_k) * batch * heads
        expect_true(visited <= needed,
                    f"{call} loaded {visited} blocks of K over all programs ({every} would be every block); only "
                    f"{needed} hold a key that some query of their program may see.\n  Likely mistake: "
                    f"{HINTS['kernel_future_blocks']}")


@check("flash_attention_kernel: equals SDPA and logsumexp in float32 and float16, ragged and causal, any block sizes ({device})")
def check_flash_attention_kernel(flash_attention_kernel: Any, *, seed: int = 0, device: torch.device | None = None,
                                 sizes: str = "small") -> None:
    """The student's Triton kernel, launched by the course's launcher: on the CPU through Triton's
    interpreter at small sizes (S <= 256), natively on CUDA. ``sizes="more"``: other, larger cases."""
    from attention_lab.triton_kernels import TRITON_AVAILABLE, TRITON_MISSING, launch_flash_attention

    if not TRITON_AVAILABLE:
        raise CheckFailure(TRITON_MISSING)
    generator = random_generator(seed)
    # (B, H, S_q, S_k, d), causal, block_q, block_k, dtype. The interpreter costs ~0.3 s a case. Every length is
    # a multiple of no block (the last blocks are ragged, and the rows after them hold NaN).
    cases = [
        ((1, 1, 45, 77, 16), False, 16, 32, torch.float32),
        ((1, 2, 61, 61, 16), True, 32, 32, torch.float32),
        ((1, 1, 33, 65, 16), True, 32, 16, torch.float32),  # causal bottom-right: offset 32, ends on a block start
        ((1, 2, 47, 47, 32), True, 16, 16, torch.float16),
        ((1, 1, 70, 37, 16), True, 16, 16, torch.float32),  # S_q > S_k: queries 0-32 see no key (out 0, lse -inf)
    ]
    if sizes == "more":  # the hidden test: longer and other shapes
        cases = [((1, 1, 21, 83, 16), True, 16, 16, torch.float32),
                 ((1, 1, 250, 250, 16), True, 32, 32, torch.float32),
                 ((2, 1, 100, 130, 32), False, 32, 16, torch.float16),
                 ((1, 2, 33, 50, 16), True, 16, 16, torch.float32)]
    for shape, causal, block_q, block_k, dtype in cases:
        _kernel_case(flash_attention_kernel, launch_flash_attention, shape, causal, block_q, block_k, dtype, device,
                     generator)


# --------------------------------------------------------------------------------------
# Challenge: the backward pass as two Triton kernels
# --------------------------------------------------------------------------------------


def _backward_kernel_case(kernel_dkdv, kernel_dq, shape, causal, block_q, block_k, dtype, device, generator) -> None:
    from attention_lab.triton_kernels import launch_flash_attention_backward

    q, k, v, out, lse, dout = _backward_inputs(generator, shape, causal, dtype, device)
    call = (f"your kernels via launch_flash_attention_backward(flash_attention_backward_kernel, "
            f"flash_attention_backward_dq_kernel, q, k, v, out, lse, dout, causal={causal}, block_q={block_q}, "
            f"block_k={block_k}) with q {shape_str(q.shape)}, k and v {shape_str(k.shape)} "
            f"({str(dtype).replace('torch.', '')}, {device.type})")
    seq_q, seq_k = q.shape[2], k.shape[2]
    lengths = {name: ("seq_k", seq_k) for name in ("K", "V", "dk", "dv")}
    lengths.update({name: ("seq_q", seq_q) for name in ("Q", "dout", "lse", "D", "dq")})
    grads, _ = _kernel_launch(call, "Write the two kernels.", lengths, launch_flash_attention_backward, kernel_dkdv,
                              kernel_dq, q, k, v, out, lse, dout, causal=causal, block_q=block_q, block_k=block_k)
    _expect_keyless_gradients(grads, keyless_queries(seq_q, seq_k, causal), call)
    scale = q.shape[-1] ** -0.5
    want = reference_gradients(q, k, v, dout, causal, scale)
    variants = _backward_variants(q, k, v, dout, causal, scale, block_q, block_k)
    for name, got, expected, wrong in zip(("dq", "dk", "dv"), grads, want, variants):
        if bool((torch.isnan(got.detach().cpu()) & ~torch.isnan(expected)).any()):
            raise CheckFailure(f"{name} from {call} holds NaN where the gradient is finite.\n  Likely mistake: "
                               f"{HINTS['nan_past_end']}")
        basis = _kernel_tolerance_basis(got)
        rtol, atol = tolerance(basis.dtype, device)
        expect_close(got, expected, what=f"{name} from {call}", against="torch.autograd through SDPA (float64)",
                     variants=wrong, rtol=rtol * 4, atol=atol * 4)


@check("flash_attention_backward_kernel: dq, dk, dv of two Triton kernels equal autograd through SDPA, float32 and float16, ragged, causal ({device})")
def check_flash_attention_backward_kernel(flash_attention_backward_kernel: Any,
                                          flash_attention_backward_dq_kernel: Any, *, seed: int = 0,
                                          device: torch.device | None = None, sizes: str = "small") -> None:
    """The challenge: dK/dV with one program per key block, dQ with one program per query block."""
    from attention_lab.triton_kernels import TRITON_AVAILABLE, TRITON_MISSING

    if not TRITON_AVAILABLE:
        raise CheckFailure(TRITON_MISSING)
    generator = random_generator(seed)
    cases = [((1, 1, 45, 61, 16), False, 16, 32, torch.float32),
             ((1, 2, 47, 47, 16), True, 32, 16, torch.float32),
             ((1, 1, 33, 65, 32), True, 16, 16, torch.float16),
             ((1, 1, 70, 37, 16), True, 16, 16, torch.float32)]  # S_q > S_k: queries 0-32 see no key
    if sizes == "more":
        cases = [((2, 1, 100, 90, 16), False, 32, 32, torch.float32),
                 ((1, 1, 21, 83, 16), True, 16, 16, torch.float32)]
    for shape, causal, block_q, block_k, dtype in cases:
        _backward_kernel_case(flash_attention_backward_kernel, flash_attention_backward_dq_kernel, shape, causal,
                              block_q, block_k, dtype, device, generator)



# --------------------------------------------------------------------------------------
# The backward pass's FLOPs, counted: FlashAttention-2's one kernel against two kernels
# --------------------------------------------------------------------------------------

BACKWARD_FLOPS_RATIOS = (2.5, 3.5)  # matmul FLOPs of the backward / the forward's: FA-2, two kernels
BACKWARD_FLOPS_HINTS = {
    "no_recompute": "the backward has no P to read: it recomputes the scores q kᵀ from q, k and lse before it "
    "can use them. Count that product too.",
    "products_not_ratio": "those are counts of [S, S] x d products; the question asks for the ratio to the "
    "forward's matmul FLOPs, and the forward has two such products (q kᵀ and P v).",
    "dq_kernel_reuses": "the dQ kernel has neither P nor dP from the first kernel (it only has q, k, v, dO, lse "
    "and D in memory): it recomputes q kᵀ and dP = dO vᵀ again before dQ = dS k.",
    "same_for_both": "the two-kernel design does more work than FlashAttention-2's single kernel: its dQ kernel "
    "cannot reuse the tiles of P and dP that the dK/dV kernel computed.",
    "swapped": "the pair is swapped: FlashAttention-2's single kernel is the cheaper one.",
}


@check("ANSWER_BACKWARD_FLOPS: the backward's matmul FLOPs against the forward's, for both designs")
def check_answer_backward_flops(answer, *, seed: int = 0, device: torch.device | None = None) -> None:
    """(2.5, 3.5): FA-2's backward runs 5 products of S²·d, the two-kernel backward 7, the forward 2. The
    count is printed only once the answer is right."""
    from attention_lab.checking import add_note

    name = "ANSWER_BACKWARD_FLOPS"
    if answer is None:
        raise CheckFailure(f"{name}: not implemented yet. Set {name} to a pair of numbers, e.g. (1.0, 1.0).")
    numbers = list(answer) if isinstance(answer, (tuple, list)) else None
    expect_true(numbers is not None and len(numbers) == 2
                and all(is_number(x) and math.isfinite(x) for x in numbers),
                f"{name} should be a pair of numbers (FlashAttention-2's ratio, the two kernels' ratio), got "
                f"{describe(answer)}.")
    single, split = numbers
    right_single, right_split = BACKWARD_FLOPS_RATIOS

    def near(x, y):
        return abs(x - y) < 0.01

    if not (near(single, right_single) and near(split, right_split)):
        if near(single, right_split) and near(split, right_single):
            hint = BACKWARD_FLOPS_HINTS["swapped"]
        elif near(single, 2 * right_single) or near(split, 2 * right_split):
            hint = BACKWARD_FLOPS_HINTS["products_not_ratio"]
        elif near(single, right_single) and near(split, right_single):
            hint = BACKWARD_FLOPS_HINTS["same_for_both"]
        elif near(single, right_single) and near(split, right_split - 0.5):
            hint = BACKWARD_FLOPS_HINTS["dq_kernel_reuses"]
        elif near(single, right_single - 0.5) or near(split, right_split - 1.0):
            hint = BACKWARD_FLOPS_HINTS["no_recompute"]
        else:
            hint = ""
        wrong = [label for label, got, want in (("FlashAttention-2's", single, right_single),
                                                ("the two kernels'", split, right_split)) if not near(got, want)]
        raise CheckFailure(f"{name} = {answer!r} is not right: " + " and ".join(wrong)
                           + (" ratio is" if len(wrong) == 1 else " ratios are") + " off."
                           + (f"\n  Likely mistake: {hint}" if hint else ""))
    add_note("  Why: the forward runs 2 products of S²·d multiply-adds (q kᵀ and P v). FlashAttention-2's "
             "backward runs 5: q kᵀ again (P is recomputed from lse), dV = Pᵀ dO, dP = dO vᵀ, dQ = dS k, "
             "dK = dSᵀ q: 2.5x. The two kernels run 7: the dK/dV kernel q kᵀ, dV, dP, dK; the dQ kernel q kᵀ and "
             "dP once more, then dQ: 3.5x. So one training step of attention costs 3.5x its forward (4.5x with two "
             "kernels), not the 3x of an ordinary matmul layer: the price of keeping no [S, S] table.")


freeze_module(__name__)
