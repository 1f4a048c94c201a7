"""Checks for notebook 07 -- attention at inference scale.

Every answer is compared with plain attention over the whole context, computed here in float64:
``F.scaled_dot_product_attention`` (math backend, ``enable_gqa``) and ``torch.logsumexp`` for the
states, split-K decoding, the paged cache, windows, sinks and StreamingLLM; a contiguous copy of each
sequence for the paged cache; DeepSeek's layer written out in full for latent attention. Then:

* **properties**: merging is commutative and associative, an empty part is its identity; results do
  not depend on the number of splits; slots no sequence may read, and padding blocks, hold NaN and
  change nothing; copy-on-write leaves the other sequence as it was; the absorbed MLA equals the
  naive one for a prefill and decode steps;
* **memory watches** (a probe that sees every tensor the answer creates, where it runs): no copy of
  K/V per query head, no score table over all the keys at once in split-K decoding, no copy of the
  whole pool, no per-head key or value of MLA over the cache;
* **diagnosis**: each known mistake (a base-2 lse merged as natural, NaN from an empty part, parts
  weighted by their length or their max, ``%`` for the KV head, a window of ``W + 1`` keys, keys
  cached after RoPE, a sink counted twice, MLA's scale, the split of ``wkv_b``, a tree node that
  sees its sibling ...) is computed in float64 and named when an answer matches it.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import torch

from attention_lab.bridge import checker_side, probes, wire
from attention_lab.bridge.probes import Probe
from attention_lab.checking import (
    CheckFailure,
    FunctionWatch,
    RuleFailure,
    Variant,
    call_student,
    check,
    describe,
    expect_close,
    expect_signature,
    expect_tensor,
    expect_true,
    expect_value_error,
    freeze_module,
    randint,
    randn,
    random_generator,
    reference_sdpa,
    shape_str,
    student_line,
    tolerance,
)
from attention_lab.checks.efficient_attention import HINTS as EFFICIENT_HINTS
from attention_lab.checks.efficient_attention import POISON_ROWS, _launched, _overrun_hint
from attention_lab.latent_attention import MLAWeights

LN_2 = math.log(2.0)
LOG2_E = 1.0 / LN_2
NEG_INF = float("-inf")

MERGE_HINTS = {
    "equal_weights": "the parts are averaged with equal weights: weight each by its share of the softmax's mass, "
    "e^(lse_i - lse), where lse = log Σ_i e^(lse_i) is the merged lse.",
    "unnormalised": "the parts are weighted by e^(lse_i) without dividing by the total: weight each by "
    "e^(lse_i - lse), with lse = log Σ_i e^(lse_i) (these weights sum to 1).",
    "lse_max": "the merged lse is the largest part's lse: it is the log of the sum of every part's mass, "
    "lse = log Σ_i e^(lse_i) (torch.logsumexp(lses, dim=0)), not their max.",
    "lse_sum": "the merged lse adds the parts' lses (the log of a product of their sums): add their exponentials "
    "instead, lse = log Σ_i e^(lse_i).",
    "base2": "the lse is in base 2 and merged as if it were natural (or merged with exp2/log2 while it is natural): "
    "each part's weight comes out proportional to a power of its true share (share^1.44, or share^0.69), so the "
    "part with the most mass gets the wrong weight, and the merged lse is in neither unit. Keep one unit: natural "
    "logs with torch.exp/torch.log (multiply a base-2 lse by ln 2 first, and return a natural lse).",
    "empty_nan": "NaN from an empty part (lse = -inf, and an out that holds NaN, as a kernel's 0 / 0 leaves it): its "
    "weight e^(-inf) = 0 is right, but 0 · NaN = NaN. Choose instead of multiplying: torch.where(weight > 0, "
    "weight * out_i, 0.0).",
    "all_empty_nan": "NaN where every part is empty: e^(lse_i - lse) is e^(-inf - (-inf)) = e^NaN there. Where the "
    "merged lse is -inf, subtract 0 instead (torch.where(torch.isfinite(lse), lse, 0.0)): out is then 0 and lse "
    "-inf, the state of no key.",
    "overflow": "inf or NaN for large lses (around ±1000): e^(lse_i) overflows (or underflows to 0 / 0). Subtract "
    "the merged lse (or the largest lse_i) before exponentiating: every e^(lse_i - lse) is then at most 1.",
}

SPLIT_HINTS = {
    "kv_head_modulo": "query head h reads the wrong KV head: with grouped-query attention the query heads of one KV "
    "head are consecutive, so head h reads KV head h // (H_q // H_kv), not h % H_kv (as notebook 05's repeat_kv "
    "and SDPA's enable_gqa group them).",
    "by_length": "the parts are weighted by their number of keys: a part's weight is its share of the softmax's "
    "mass, e^(lse_i - lse), which depends on its scores, not on how many keys it holds.",
    "by_max": "the parts are weighted by e^(max score of the part): that is the largest term of a part's sum, not "
    "the sum. Return each part's lse = log Σ_j e^(s_j) (max + log of the rescaled sum) and merge with e^(lse_i - lse).",
    "no_scale": "the scores are not scaled: multiply q·k by scale (default 1/sqrt(d)).",
    "floor_split": "some keys are in no part: the parts hold ceil(L / num_splits) keys each (the last fewer), so "
    "that num_splits parts cover all L keys; L // num_splits leaves the last L % num_splits keys out.",
    "per_head_copy": "this copies K or V once per query head (what repeat_kv or repeat_interleave does): with "
    "grouped-query attention, reshape the queries instead, q.reshape(B, H_kv, H_q // H_kv, d), and let a matrix "
    "product (or einsum) score each KV head's group of query heads against its keys.",
    "not_split": "this scores the query against all L keys at once: compute each part's state on its own (its slice "
    "of the keys, k[:, :, start:start + split_len]) and merge the parts' (out, lse) with merge_attention_states.",
    "lse_dtype": "lse should be in at least float32 (float32 or float64): compute the parts in "
    "torch.promote_types(q.dtype, torch.float32).",
}

KERNEL_HINTS = {
    "split_end_mask": "a tile reads keys past its split's end: they belong to the next split, which counts them "
    "again. Mask every tile at the split's end, offs < min((split + 1)·split_len, seq_len), not only at seq_len.",
    "whole_keys": "every split attended to all the keys: a split's program covers only keys split·split_len ... "
    "min((split + 1)·split_len, seq_len) - 1; loop over range(start, end, BLOCK) with those bounds.",
    "empty_split": "an empty split (its start at or past seq_len: more splits than keys) must write out 0 and lse "
    "-inf, the state of no key: its l_i is 0, so divide by tl.where(l_i > 0, l_i, 1.0) and pick with "
    "tl.where(l_i > 0, ..., 0.0) and tl.where(l_i > 0, m_i + tl.log(l_safe), float('-inf')).",
    "lse_base2": "the split's lse is in base 2 (exp2 and scores times log2(e)): the launcher merges natural logs. "
    "Convert at the end, lse = (m_i + log2(l_i)) · ln 2, or compute with tl.exp and tl.log.",
    "unnormalised": "out is not normalised: divide the accumulator by l_i once, after the loop (acc / l_i).",
    "head_dim_mask": "NaN (or the state of no key) where the split has keys: the head size is not a power of two, "
    "and lanes offs_d >= head_dim were loaded (the check stores NaN after each row's head_dim features), so the "
    "scores became NaN. Mask the head dimension in every load of K and V: mask=inside[:, None] & (offs_d < "
    "head_dim)[None, :].",
}

PAGED_HINTS = {
    # slot_mapping
    "slot_no_table": "the slots ignore the block table: position p lives in block block_table[p // block_size], "
    "at offset p % block_size, so its slot is block_table[p // block_size] · block_size + p % block_size.",
    "slot_no_block_size": "the block's id is a block number, not a slot: multiply it by block_size, "
    "block_table[p // block_size] · block_size + p % block_size.",
    "slot_from_zero": "the positions start at 0: they run from start to end - 1, torch.arange(start, end).",
    "slot_off_by_one": "every slot is one position off: the positions are start ... end - 1 (torch.arange(start, "
    "end)), not start + 1 ... end.",
    # PagedKVCache
    "block_early": "a block is taken one token early: a sequence of n tokens needs ceil(n / block_size) blocks, so a "
    "new block is needed when the length passes a multiple of block_size (block_size + 1 tokens), not when it "
    "reaches it.",
    "block_late": "a block is taken one token late: the token at position block_size · k already needs block k "
    "(a sequence of n tokens needs ceil(n / block_size) blocks).",
    "block_per_append": "a block is taken at every append: take only the blocks the new length needs, "
    "ceil(new_length / block_size) - len(table) (often none: the last block has free slots).",
    "contents": "the pool does not hold the sequence's tokens in order: token p (column p of the k and v appended, "
    "[H_kv, n, d]) goes into slot block_table[p // block_size]·block_size + p % block_size of the pool seen as "
    "[num_blocks · block_size, H_kv, d] (slot_mapping), as a [H_kv, d] row: k.transpose(0, 1).",
    "append_dtype": "the pool keeps its dtype: cast what append writes to it (k.to(self.k_pool.dtype)), never the "
    "pool to the input's.",
    "id_reused": "a sequence id was handed out again: ids are never reused (a freed id must stay unknown, or a late "
    "request for the old sequence would read the new one). Count ids up from a counter.",
    "memory_error_partial": "after MemoryError the cache changed: check that the free list holds every block the "
    "append needs (the copy-on-write block included) before taking any block or writing any token.",
    "fork_copies": "fork took blocks: it shares every block of the sequence (one more owner for each) and copies "
    "nothing until one of the two writes.",
    "fork_no_cow": "fork without copy-on-write: the other sequence changed when this one appended. The last block "
    "is partly filled and shared, so the first sequence that writes into it must get a copy of it first (a new "
    "block from the free list, the shared block's contents copied, one owner fewer for the shared one).",
    "cow_unneeded": "a block was copied that only one sequence owns: copy-on-write copies the last block only when "
    "another sequence still shares it (its reference count is above 1).",
    "cow_full_block": "a full block was copied: when the last block is full the new tokens go into a new block, and "
    "the shared, full block is never written again (nothing to copy).",
    "free_shared": "free returned a block that another sequence still uses: count the owners of each block "
    "(fork adds one for every block) and put a block back on the free list only when its count reaches 0.",
    "cow_memory": "appending into a shared, partly filled block needs a block for the copy: count it among the blocks "
    "needed, and raise MemoryError (changing nothing) when the free list cannot give it.",
    # paged_decode_attention
    "slot_past_end": "the slot after the last token was read: sequence b has seq_lens[b] tokens, in slots of "
    "positions 0 ... seq_lens[b] - 1 (the new token included); the next slot holds another sequence's leftovers.",
    "whole_blocks": "every slot of the sequence's blocks was read: its last block is partly filled, and only the "
    "first seq_lens[b] positions hold its tokens (the rest is another sequence's leftovers).",
    "padding_block": "a padding entry (-1) of the block table was read as a block: -1 indexes the pool's last "
    "block. Use only the first ceil(seq_lens[b] / block_size) entries of the sequence's table.",
    "missing_last_token": "the newest token's key is missing: seq_lens[b] counts every cached token, the new one "
    "included (it was appended before the attention), so read positions 0 ... seq_lens[b] - 1.",
    "read_nan": "NaN in the output: the check filled every slot a sequence may not read (and every unused block) with "
    "NaN, so the code read a slot at or past seq_lens[b] or a padding entry. Masking such scores with -inf is not "
    "enough: their values still enter weights @ v, and 0 · NaN = NaN. Gather only the sequence's own slots.",
    "pool_copy": "this copies the whole pool (a cast, a permute or reshape that cannot be a view, a gather of every "
    "block): read each sequence's own slots from a view, k_pool.view(-1, H_kv, d)[slots].",
}

WINDOW_HINTS = {
    "window_plus_one": "the window holds window + 1 keys: the query at position p sees p - window < j <= p "
    "(exactly window keys, itself included), not p - window <= j.",
    "window_minus_one": "the window holds window - 1 keys: the query at position p sees p - window < j <= p, "
    "which includes the key at p - window + 1.",
    "window_top_left": "the window is aligned top-left: query i is at position p = i + kv_len - q_len (the last "
    "query is the last token, as in KV-cache decoding), not at position i.",
    "window_symmetric": "the window looks both ways: it is causal, the query at position p sees keys p - window < j "
    "<= p and none after p.",
    "sink_ignored": "the output equals attention without the sink: the sink logit joins the softmax's denominator "
    "(softmax over [scores, sink], then drop the sink's column). Dropping the column and renormalising, or adding "
    "the sink to every score, undoes it.",
    "sink_twice": "the sink is counted twice in the denominator: it is one extra logit per head, "
    "e^sink + Σ_j e^(s_j).",
    "sink_scaled": "the sink logit was multiplied by the scale: it is a learned logit, compared with the scaled "
    "scores as it is.",
    "sink_numerator": "the sink went into the numerator: each weight is e^(s_j) / (e^sink + Σ e^(s_j')), so the "
    "output is the plain attention times the mass left to the keys, e^lse / (e^lse + e^sink), not times the sink's "
    "share e^sink / (e^lse + e^sink).",
    "sinks_not_causal": "the attention is not causal: the query at position p (bottom-right: i + S_k - S_q) sees "
    "keys j <= p only.",
    "no_key_nan": "a query that sees no key (a window, or more queries than keys) with sink -inf is NaN: 0 / 0. "
    "Such a row's output is 0, as SDPA gives it: divide by 1 where the denominator is 0.",
    # StreamingLLM
    "kept_duplicates": "positions are kept twice: when seq_len <= n_sink + n_recent every token is kept once "
    "(the first n_sink and the last n_recent overlap).",
    "kept_recent_off": "the recent part has the wrong length: keep the last n_recent positions, seq_len - n_recent "
    "... seq_len - 1.",
    "keys_after_rope": "the keys are rotated at their original positions (a cache of keys after RoPE): StreamingLLM "
    "rotates the kept keys at their positions in the cache, 0 ... len - 1, at every step.",
    "query_original_position": "the query is rotated at its original position T - 1: it is the newest token of the "
    "cache, at cache position len - 1.",
    "query_at_len": "the query is rotated one position too far: the decode position is len - 1 (the newest token is "
    "already in the cache of len tokens), not len.",
    "original_positions": "the keys and the query are rotated at their original positions: StreamingLLM rotates at "
    "positions in the cache, keys at 0 ... len - 1 and the query at len - 1, so the distances stay within the "
    "cache's length.",
    "no_eviction": "every key was attended to: keep only the positions of streaming_kept_positions(T, n_sink, "
    "n_recent), rotated at 0 ... len - 1.",
    "rotate_half": "RoPE in the rotate_half layout (features j and j + d/2): this notebook, like 05's apply_rope, "
    "rotates adjacent pairs (2j, 2j + 1).",
    "no_rope": "no RoPE: rotate the kept keys at 0 ... len - 1 and the query at len - 1 (apply_rope_at).",
}

MLA_HINTS = {
    "kpe_per_head": "k_pe has a head axis: MLA caches one rotated key part per token, shared by every head, "
    "[B, T, qk_rope_dim] (the last qk_rope_dim outputs of x @ w_dkvᵀ).",
    "cache_split": "split x @ w_dkvᵀ in two: the first kv_lora_rank outputs are the latent, the last qk_rope_dim "
    "the key part RoPE rotates.",
    "latent_no_norm": "the latent is not normalised: MLA applies an RMSNorm to it, x · rsqrt(mean(x²) + norm_eps) "
    "· kv_norm_weight, over the kv_lora_rank axis.",
    "latent_norm_no_weight": "the latent's RMSNorm has no weight: multiply by w.kv_norm_weight.",
    "split_order": "the rows of w_dkv are in the other order: the latent's kv_lora_rank rows come first, then the "
    "qk_rope_dim rows of k_pe.",
    "kpe_no_rope": "k_pe is not rotated: apply RoPE to it at the tokens' positions (apply_rope_at(k_pe, positions, "
    "w.rope_base)).",
    "kpe_index_positions": "k_pe is rotated at 0 ... T - 1, not at the positions given: a decoding step's tokens sit "
    "after the cache.",
    "scale_rank": "the scores are scaled by 1/sqrt(kv_lora_rank): a head's score is q·k over qk_nope_dim + "
    "qk_rope_dim features, so the scale is 1/sqrt(qk_nope_dim + qk_rope_dim), also in the absorbed form.",
    "scale_nope": "the scores are scaled by 1/sqrt(qk_nope_dim) alone: each key has qk_nope_dim + qk_rope_dim "
    "features (the latent's part and the shared RoPE part), so the scale is 1/sqrt(qk_nope_dim + qk_rope_dim).",
    "uv_first": "W_UK and W_UV are split in the wrong order: per head, w_ukv holds its qk_nope_dim key rows first, "
    "then its v_dim value rows (w.w_ukv.view(H, qk_nope_dim + v_dim, kv_lora_rank).split([qk_nope_dim, v_dim], 1)).",
    "split_not_per_head": "w_ukv is split as two blocks (all heads' keys, then all values): it is per head, each "
    "head's qk_nope_dim key rows then its v_dim value rows, so view it as [H, qk_nope_dim + v_dim, kv_lora_rank] "
    "first.",
    "q_no_rope": "the query's RoPE part is not rotated: rotate q_pe at the queries' positions, as k_pe was.",
    "causal_top_left": "the causal mask is aligned top-left: the T_q new tokens are the last T_q of the cache, so "
    "query i sees keys j <= i + T_k - T_q.",
    "not_causal": "the attention is not causal: a new token sees the cache and the new tokens up to itself.",
    "per_head_kv": "this builds a per-head key or value over the whole cache (latent times W_UK or W_UV for every "
    "cached token), which the absorbed form exists to avoid: multiply the query by W_UK (q_nope @ W_UK, a "
    "kv_lora_rank vector per head), score it against the latents, sum the latents with the weights, then apply W_UV.",
    # mla_cache_bytes
    "bytes_twice": "MLA caches one latent per token, not a key and a value: no factor 2.",
    "bytes_no_rope": "the shared RoPE key part is cached too: kv_lora_rank + qk_rope_dim numbers per token and layer.",
    "bytes_floor": "round up: a 4-bit cache of an odd number of elements still needs the last byte (math.ceil).",
}

TREE_HINTS = {
    "no_self": "a node cannot see itself: node i's column prefix_len + i must be True.",
    "siblings": "a node sees nodes of other branches (earlier siblings and cousins): it sees the prefix, its "
    "ancestors (its parent, its parent's parent ...) and itself, nothing else. A causal mask over the drafts is "
    "right only for a chain.",
    "parent_only": "a node sees its parent but not the parent's ancestors: it sees every ancestor up to the prefix "
    "(copy its parent's row, then add itself).",
    "no_prefix": "the nodes do not see the prefix: every node sees all prefix_len tokens of the prompt.",
    "flipped": "the mask is flipped: True = may attend (as in F.scaled_dot_product_attention).",
    "positions_index": "the positions are numbered by index: a node's position is prefix_len + its depth in the "
    "tree (siblings share a position), not prefix_len + its index.",
    "positions_plus_one": "the positions are one too far: a child of the prompt's last token (at position "
    "prefix_len - 1) is at position prefix_len, depth 0.",
    "positions_no_prefix": "the positions forget the prompt: add prefix_len to each depth.",
}


# --------------------------------------------------------------------------------------
# Small helpers: float64 copies, exact comparisons with named variants, errors of calls
# --------------------------------------------------------------------------------------


def _f64(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().to("cpu", torch.float64) for t in tensors]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _likely(hint: str) -> str:
    return f"\n  Likely mistake: {hint}"


def expect_exact(got: torch.Tensor, want: torch.Tensor, what: str, variants: Sequence[tuple[torch.Tensor, str]] = ()
                 ) -> None:
    """Integers or booleans equal ``want`` element by element; else name the first variant ``got`` equals."""
    got_cpu = got.detach().cpu()
    if got_cpu.shape == want.shape and torch.equal(got_cpu, want):
        return
    hint = next((text for wrong, text in variants if wrong.shape == got_cpu.shape and torch.equal(got_cpu, wrong)
                 and not torch.equal(wrong, want)), None)
    show = (lambda t: t.int().tolist() if t.dtype == torch.bool else t.tolist())  # noqa: E731
    expected, shown = show(want), show(got_cpu)
    text = f"{what} should be\n    {expected}\n  got\n    {shown}." if want.numel() <= 60 else \
        f"{what} differs from the expected values at {int((got_cpu != want).sum())} of {want.numel()} places."
    raise CheckFailure(text + (_likely(hint) if hint else ""))


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.einsum("...qd,...kd->...qk", q, k) * scale


def _attention(q, k, v, keep: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Softmax attention in float64 with a boolean mask (True = may attend); a query that sees no key gets 0."""
    q, k, v = _f64(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return reference_sdpa(q, k, v, attn_mask=keep, scale=scale)


def _state(q, k, v, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q [..., S_q, d] over k, v [..., S_k, d] in float64 (no key: out 0, lse -inf)."""
    q, k, v = _f64(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = _scores(q, k, scale)
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    return torch.exp(scores - safe[..., None]) @ v, lse


def _merge(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference merge in float64: the state of the union of the parts."""
    outs, lses = _f64(outs, lses)
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - torch.where(torch.isfinite(lse), lse, 0.0))[..., None]
    return torch.where(weights > 0, weights * outs.nan_to_num(0.0), 0.0).sum(0), lse


def _expect_finite_where(got: torch.Tensor, want: torch.Tensor, what: str, hint: str) -> None:
    """NaN or inf in ``got`` where ``want`` is finite: the hint that names how it came."""
    bad = ~torch.isfinite(got.detach().cpu().double()) & torch.isfinite(want)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise CheckFailure(f"{what} holds {float(got.detach().cpu().double()[first])} at index {first} where the "
                           f"answer is finite ({float(want[first]):.4g}).{_likely(hint)}")


def _value_error(fn: Callable, call: str, why: str, *args: Any, must_mention: Sequence[Any] = (), **kwargs: Any
                 ) -> None:
    expect_value_error(fn, *args, call=call, why=why, must_mention=must_mention, **kwargs)


# --------------------------------------------------------------------------------------
# A probe: the first tensor the answer creates that a rule forbids
# --------------------------------------------------------------------------------------


class TensorWatch(FunctionWatch):
    """Sees every tensor the student's code creates (a function mode, where the code runs) and keeps the first
    new one (not a view of an input) that a rule forbids, as ``(rule index, function, shape, student line)``.

    A rule is ``[min_numel, axis, last]``: a tensor of at least ``min_numel`` elements that has an axis of size
    ``axis`` (None: any) and whose last axis is ``last`` (None: any) breaks it.
    """

    def __init__(self, rules: Sequence[Sequence[int | None]] = ()):
        super().__init__(rules=[list(rule) for rule in rules])
        self.rules = [tuple(rule) for rule in rules]
        for rule in self.rules:
            if not (len(rule) == 3 and type(rule[0]) is int and all(r is None or type(r) is int for r in rule[1:])):
                raise wire.WireError("a malformed tensor watch")
        self.offence: tuple[int, str, tuple[int, ...], str] | None = None

    def broken(self, shape: Sequence[int]) -> int | None:
        """The index of the first rule a tensor of ``shape`` breaks, or None."""
        numel = math.prod(shape)
        for index, (min_numel, axis, last) in enumerate(self.rules):
            if numel >= min_numel and (axis is None or axis in shape) and \
                    (last is None or (len(shape) >= 1 and shape[-1] == last)):
                return index
        return None

    def findings(self) -> Any:
        if self.offence is None:
            return None
        rule, name, shape, line = self.offence
        return [rule, name, list(shape), line]

    def accept(self, findings: Any) -> None:
        if findings is None:
            return
        if not (isinstance(findings, list) and len(findings) == 4 and type(findings[0]) is int
                and probes.strings([findings[1], findings[3]]) and isinstance(findings[2], list)
                and len(findings[2]) <= 8 and all(type(n) is int and n >= 0 for n in findings[2])
                and self.broken(findings[2]) == findings[0]):
            raise wire.WireError("malformed tensor watch")
        self.offence = (findings[0], findings[1], tuple(findings[2]), findings[3])

    def saw(self, name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
            new_outputs: list[torch.Tensor]) -> None:
        if self.offence is not None:
            return
        for tensor in new_outputs:
            rule = self.broken(tuple(tensor.shape))
            if rule is not None:
                self.offence = (rule, name, tuple(tensor.shape), student_line())
                break


def _watched(fn: Callable, *args: Any, call: str, rules: Sequence[Sequence[int | None]], **kwargs: Any
             ) -> tuple[Any, TensorWatch]:
    watch = TensorWatch(rules)
    return call_student(fn, *args, call=call, probes=[watch], **kwargs), watch


def _expect_no_offence(watch: TensorWatch, call: str, what: Sequence[str], hints: Sequence[str]) -> None:
    """Fail (a rule, not a number) when the watch saw a tensor a rule forbids: ``what[rule]``, ``hints[rule]``."""
    if watch.offence is not None:
        rule, operation, shape, line = watch.offence
        raise RuleFailure(f"{call} built a {shape_str(shape)} tensor (with {operation}){line}: "
                          f"{what[rule]}.{_likely(hints[rule])}")


# --------------------------------------------------------------------------------------
# Exercise: merge_attention_states
# --------------------------------------------------------------------------------------


def _disjoint_parts(generator: torch.Generator, seq_k: int, parts: int) -> list[torch.Tensor]:
    """``parts`` disjoint, non-empty, non-contiguous sets of key indices covering 0 ... seq_k - 1."""
    order = torch.randperm(seq_k, generator=generator)
    cuts = sorted(torch.randperm(seq_k - 1, generator=generator)[:parts - 1].add(1).tolist())
    return [order[start:stop].sort().values for start, stop in zip([0, *cuts], [*cuts, seq_k])]


def _merge_variants(outs: torch.Tensor, lses: torch.Tensor) -> tuple[list[Variant], list[Variant]]:
    """Wrong merges of float64 parts: (variants of out, variants of lse)."""
    outs, lses = _f64(outs, lses)

    def base2() -> tuple[torch.Tensor, torch.Tensor]:
        lse2 = torch.logsumexp(lses * LN_2, dim=0) * LOG2_E  # log2 Σ 2^(lse_i)
        return (torch.exp2(lses - lse2)[..., None] * outs).sum(0), lse2

    out_variants = [
        Variant(lambda: outs.mean(0), MERGE_HINTS["equal_weights"]),
        Variant(lambda: (torch.exp(lses)[..., None] * outs).sum(0), MERGE_HINTS["unnormalised"]),
        Variant(lambda: base2()[0], MERGE_HINTS["base2"]),
    ]
    lse_variants = [
        Variant(lambda: lses.amax(0), MERGE_HINTS["lse_max"]),
        Variant(lambda: lses.sum(0), MERGE_HINTS["lse_sum"]),
        Variant(lambda: base2()[1], MERGE_HINTS["base2"]),
    ]
    return out_variants, lse_variants


def _call_merge(merge_attention_states: Callable, outs: torch.Tensor, lses: torch.Tensor, label: str
                ) -> tuple[torch.Tensor, torch.Tensor, str]:
    call = (f"merge_attention_states(outs, lses) with outs {shape_str(outs.shape)} ({_dtype_name(outs.dtype)}) and "
            f"lses {shape_str(lses.shape)} ({_dtype_name(lses.dtype)}), {label}")
    result = call_student(merge_attention_states, outs, lses, call=call)
    expect_true(isinstance(result, tuple) and len(result) == 2,
                f"{call} should return a pair (out, lse), got {describe(result)}.")
    out, lse = result
    dtype_hint = "out keeps outs' dtype and lse keeps lses' dtype: compute in at least float32 inside, then cast back."
    expect_tensor(out, what=f"out from {call}", shape=outs.shape[1:], dtype=outs.dtype, device=outs.device,
                  dtype_hint=dtype_hint)
    expect_tensor(lse, what=f"lse from {call}", shape=lses.shape[1:], dtype=lses.dtype, device=lses.device,
                  dtype_hint=dtype_hint)
    return out, lse, call


def _merge_case(merge_attention_states: Callable, generator: torch.Generator, shape: tuple[int, ...], parts: int,
                dtype: torch.dtype, device: torch.device, lse_dtype: torch.dtype | None = None,
                shift: float = 0.0) -> None:
    """Keys split into ``parts`` disjoint random sets; their states merged against attention over all of them."""
    *batch, seq_q, seq_k, d = shape
    q = randn(*batch, seq_q, d, generator=generator)
    k = randn(*batch, seq_k, d, generator=generator)
    v = randn(*batch, seq_k, d, generator=generator)
    states = [_state(q, k[..., index, :], v[..., index, :]) for index in _disjoint_parts(generator, seq_k, parts)]
    outs = torch.stack([out for out, _ in states])
    lses = torch.stack([lse for _, lse in states]) + shift
    out, lse, call = _call_merge(merge_attention_states, outs.to(device, dtype),
                                 lses.to(device, lse_dtype or dtype),
                                 f"{parts} parts of {seq_k} keys" + (f", every lse shifted by {shift:g}" if shift else ""))
    want_out, want_lse = _state(q, k, v)
    _expect_finite_where(out, want_out, f"out from {call}", MERGE_HINTS["overflow"])
    _expect_finite_where(lse, want_lse + shift, f"lse from {call}", MERGE_HINTS["overflow"])
    out_variants, lse_variants = _merge_variants(outs, lses)
    expect_close(out, want_out, what=f"out from {call}", against="attention over all the keys (float64)",
                 variants=out_variants)
    expect_close(lse, want_lse + shift, what=f"lse from {call}", against="torch.logsumexp of all the scores",
                 variants=lse_variants, rtol=tolerance(lse.dtype, device)[0], atol=max(tolerance(lse.dtype, device)[1],
                                                                                   tolerance(lse.dtype, device)[0]))


def _merge_empty_parts(merge_attention_states: Callable, generator: torch.Generator, device: torch.device) -> None:
    """An empty part (lse -inf, out NaN) is the identity; rows where every part is empty give 0 and -inf."""
    q = randn(2, 3, 8, generator=generator)
    k, v = randn(2, 9, 8, generator=generator), randn(2, 9, 8, generator=generator)
    first, second = _state(q, k[:, :4], v[:, :4]), _state(q, k[:, 4:], v[:, 4:])
    nan_out, empty = torch.full_like(first[0], math.nan), torch.full_like(first[1], NEG_INF)
    outs = torch.stack([nan_out, first[0], nan_out, second[0]]).to(device)
    lses = torch.stack([empty, first[1], empty, second[1]]).to(device)
    out, lse, call = _call_merge(merge_attention_states, outs, lses, "parts 0 and 2 empty (lse -inf, out NaN)")
    want_out, want_lse = _state(q, k, v)
    _expect_finite_where(out, want_out, f"out from {call}", MERGE_HINTS["empty_nan"])
    expect_close(out, want_out, what=f"out from {call}", against="the merge of the two non-empty parts")
    expect_close(lse, want_lse, what=f"lse from {call}", against="the merge of the two non-empty parts")
    # Row 1 of sequence 0 sees no key in any part: its state is the empty state, out 0 and lse -inf.
    lses[:, 0, 1] = NEG_INF
    outs[:, 0, 1] = math.nan
    out, lse, call = _call_merge(merge_attention_states, outs, lses, "every part empty for query 1 of sequence 0")
    got_out, got_lse = out[0, 1].detach().cpu(), lse[0, 1].detach().cpu()
    if bool(torch.isnan(got_out).any()) or bool(torch.isnan(got_lse)):
        raise CheckFailure(f"{call}: where every part is empty the merged state is empty (out 0, lse -inf), got out "
                           f"{got_out[:3].tolist()}..., lse {float(got_lse)}.{_likely(MERGE_HINTS['all_empty_nan'])}")
    expect_true(bool((got_out == 0).all()) and float(got_lse) == NEG_INF,
                f"{call}: where every part is empty the merged state is empty: out 0 and lse -inf (what SDPA and "
                f"torch.logsumexp give a query without keys), got out {got_out[:3].tolist()}..., lse {float(got_lse)}.")
    expect_close(out[1], want_out[1], what=f"out of sequence 1 from {call}", against="the merge of the non-empty parts")


def _merge_properties(merge_attention_states: Callable, generator: torch.Generator, device: torch.device) -> None:
    """Commutative (any order of the parts) and associative (merging a merge)."""
    q = randn(3, 2, 8, generator=generator)
    k, v = randn(3, 12, 8, generator=generator), randn(3, 12, 8, generator=generator)
    states = [_state(q, k[:, i:i + 4], v[:, i:i + 4]) for i in (0, 4, 8)]
    outs = torch.stack([s[0] for s in states]).to(device)
    lses = torch.stack([s[1] for s in states]).to(device)
    out, lse, call = _call_merge(merge_attention_states, outs, lses, "three parts")
    order = torch.tensor([2, 0, 1], device=device)
    out_swapped, lse_swapped, swapped = _call_merge(merge_attention_states, outs[order], lses[order],
                                                    "the same three parts in the order 2, 0, 1")
    expect_close(out_swapped, out, what=f"out from {swapped}", against=f"out from {call} (merging is commutative)")
    pair_out, pair_lse, _ = _call_merge(merge_attention_states, outs[:2], lses[:2], "parts 0 and 1")
    nested_out, nested_lse, nested = _call_merge(merge_attention_states, torch.stack([pair_out, outs[2]]),
                                                 torch.stack([pair_lse, lses[2]]), "(the merge of 0 and 1) and 2")
    expect_close(nested_out, out, what=f"out from {nested}", against=f"out from {call} (merging is associative)")
    expect_close(nested_lse, lse, what=f"lse from {nested}", against=f"lse from {call} (merging is associative)")
    single_out, single_lse, single = _call_merge(merge_attention_states, outs[:1], lses[:1], "one part")
    expect_close(single_out, outs[0], what=f"out from {single}", against="the part itself")
    expect_close(single_lse, lses[0], what=f"lse from {single}", against="the part itself")


@check("merge_attention_states: the state of the union of disjoint key sets; empty parts are the identity; commutative and associative; no overflow ({device})")
def check_merge_attention_states(merge_attention_states: Callable, *, seed: int = 0,
                                 device: torch.device | None = None) -> None:
    """Random disjoint key sets against attention over all keys; empty parts; ±1000; dtypes; properties."""
    expect_signature(merge_attention_states, "merge_attention_states", ["outs", "lses"])
    generator = random_generator(seed)
    cpu = torch.device("cpu")
    _merge_case(merge_attention_states, generator, (2, 3, 17, 5), 3, torch.float64, cpu)
    _merge_case(merge_attention_states, generator, (2, 2, 4, 10, 8), randint(2, 5, generator), torch.float64, cpu)
    _merge_case(merge_attention_states, generator, (4, 7, 6), 2, torch.float64, cpu, shift=1000.0)
    _merge_case(merge_attention_states, generator, (2, 1, 9, 4), 4, torch.float64, cpu, shift=-1000.0)
    _merge_empty_parts(merge_attention_states, generator, cpu)
    _merge_properties(merge_attention_states, generator, cpu)
    _merge_case(merge_attention_states, generator, (2, 3, 11, 8), 3, torch.float32, device)
    _merge_case(merge_attention_states, generator, (2, 3, 11, 8), 3, torch.float16, device, lse_dtype=torch.float32)


# --------------------------------------------------------------------------------------
# Exercise: split_kv_decode
# --------------------------------------------------------------------------------------


def _decode_inputs(generator: torch.Generator, batch: int, heads: int, kv_heads: int, seq_len: int, d: int,
                   dtype: torch.dtype = torch.float64, device: Any = "cpu") -> tuple[torch.Tensor, ...]:
    q = randn(batch, heads, d, generator=generator, dtype=dtype, device=device)
    k = randn(batch, kv_heads, seq_len, d, generator=generator, dtype=dtype, device=device)
    v = randn(batch, kv_heads, seq_len, d, generator=generator, dtype=dtype, device=device)
    return q, k, v


def _kv_of_heads(k: torch.Tensor, heads: int, modulo: bool = False) -> torch.Tensor:
    """k [B, H_kv, L, d] repeated for the query heads: head h reads h // n_rep (or, wrongly, h % H_kv)."""
    kv_heads = k.shape[1]
    index = torch.arange(heads) % kv_heads if modulo else torch.arange(heads) // (heads // kv_heads)
    return k[:, index]


def decode_reference(q, k, v, scale: float | None = None, modulo: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H_q, d], lse [B, H_q]) of one query per sequence over all its keys, in float64 (SDPA with
    enable_gqa, torch.logsumexp)."""
    q, k, v = _f64(q, k, v)
    heads = q.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keys, values = _kv_of_heads(k, heads, modulo), _kv_of_heads(v, heads, modulo)
    out = reference_sdpa(q[:, :, None], keys, values, scale=scale)[:, :, 0]
    lse = torch.logsumexp(_scores(q[:, :, None], keys, scale), dim=-1)[:, :, 0]
    return out, lse


def _split_bounds(seq_len: int, num_splits: int, split_len: int | None = None) -> list[tuple[int, int]]:
    split_len = math.ceil(seq_len / num_splits) if split_len is None else split_len
    return [(min(s * split_len, seq_len), min((s + 1) * split_len, seq_len)) for s in range(num_splits)]


def _split_parts(q, k, v, bounds: Sequence[tuple[int, int]], scale: float, modulo: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each split's (out, lse) in float64: [n, B, H_q, d] and [n, B, H_q]."""
    q, k, v = _f64(q, k, v)
    keys, values = _kv_of_heads(k, q.shape[1], modulo), _kv_of_heads(v, q.shape[1], modulo)
    states = [_state(q[:, :, None], keys[:, :, a:b], values[:, :, a:b], scale) for a, b in bounds]
    return torch.stack([s[0][:, :, 0] for s in states]), torch.stack([s[1][:, :, 0] for s in states])


def _split_variants(q, k, v, num_splits: int, scale: float) -> tuple[list[Variant], list[Variant]]:
    """Wrong split-K decodes: (variants of out, variants of lse)."""
    seq_len = k.shape[2]
    bounds = _split_bounds(seq_len, num_splits)
    parts = lambda: _split_parts(q, k, v, bounds, scale)  # noqa: E731
    sizes = torch.tensor([b - a for a, b in bounds], dtype=torch.float64)[:, None, None, None]

    def by_max() -> torch.Tensor:
        q64, k64 = _f64(q, k)
        keys = _kv_of_heads(k64, q.shape[1])
        maxima = torch.stack([_scores(q64[:, :, None], keys[:, :, a:b], scale).amax(-1)[:, :, 0] for a, b in bounds])
        outs, _ = parts()
        return _merge(outs, maxima)[0]

    def base2() -> tuple[torch.Tensor, torch.Tensor]:
        outs, lses = parts()
        return _merge(outs, lses * LOG2_E)

    floor_len = max(1, seq_len // num_splits)
    out_variants = [
        Variant(lambda: decode_reference(q, k, v, scale, modulo=True)[0], SPLIT_HINTS["kv_head_modulo"]),
        Variant(lambda: base2()[0], MERGE_HINTS["base2"]),
        Variant(lambda: (parts()[0] * sizes).sum(0) / seq_len, SPLIT_HINTS["by_length"]),
        Variant(by_max, SPLIT_HINTS["by_max"]),
        Variant(lambda: decode_reference(q, k, v, 1.0)[0], SPLIT_HINTS["no_scale"]),
        Variant(lambda: _merge(*_split_parts(q, k, v, _split_bounds(seq_len, num_splits, floor_len), scale))[0],
                SPLIT_HINTS["floor_split"]),
        Variant(lambda: parts()[0].mean(0), MERGE_HINTS["equal_weights"]),
    ]
    lse_variants = [
        Variant(lambda: decode_reference(q, k, v, scale, modulo=True)[1], SPLIT_HINTS["kv_head_modulo"]),
        Variant(lambda: base2()[1], MERGE_HINTS["base2"]),
        Variant(lambda: parts()[1].amax(0), MERGE_HINTS["lse_max"]),
        Variant(lambda: decode_reference(q, k, v, 1.0)[1], SPLIT_HINTS["no_scale"]),
    ]
    return out_variants, lse_variants


def _split_call_text(q, k, num_splits, scale) -> str:
    return (f"split_kv_decode(q, k, v, num_splits={num_splits}" + (f", scale={scale:g}" if scale is not None else "")
            + f") with q {shape_str(q.shape)}, k and v {shape_str(k.shape)} ({_dtype_name(q.dtype)})")


def _expect_decode_result(result: Any, call: str, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    expect_true(isinstance(result, tuple) and len(result) == 2,
                f"{call} should return a pair (out, lse), got {describe(result)}.")
    out, lse = result
    expect_tensor(out, what=f"out from {call}", shape=q.shape, dtype=q.dtype, device=q.device)
    expect_tensor(lse, what=f"lse from {call}", shape=q.shape[:2], device=q.device)
    expect_true(lse.dtype in (torch.float32, torch.float64),
                f"lse from {call} should be in at least float32, got {lse.dtype}.{_likely(SPLIT_HINTS['lse_dtype'])}")
    return out, lse


def _split_case(split_kv_decode: Callable, generator: torch.Generator, sizes: tuple[int, ...], num_splits: int,
                dtype: torch.dtype = torch.float64, device: Any = "cpu", scale: float | None = None) -> None:
    batch, heads, kv_heads, seq_len, d = sizes
    q, k, v = _decode_inputs(generator, batch, heads, kv_heads, seq_len, d, dtype, device)
    call = _split_call_text(q, k, num_splits, scale)
    kwargs = {} if scale is None else {"scale": scale}
    out, lse = _expect_decode_result(call_student(split_kv_decode, q, k, v, num_splits, call=call, **kwargs), call, q)
    want_out, want_lse = decode_reference(q, k, v, scale)
    used = q.shape[-1] ** -0.5 if scale is None else scale
    out_variants, lse_variants = _split_variants(q, k, v, num_splits, used)
    _expect_finite_where(out, want_out, f"out from {call}", MERGE_HINTS["empty_nan"])
    expect_close(out, want_out, what=f"out from {call}",
                 against="F.scaled_dot_product_attention(..., enable_gqa=True) (float64)", variants=out_variants)
    expect_close(lse, want_lse, what=f"lse from {call}", against="torch.logsumexp of the scaled scores",
                 variants=lse_variants, **_lse_tolerance(lse, dtype))


def _lse_tolerance(lse: torch.Tensor, dtype: torch.dtype) -> dict:
    """An lse of a few units, judged at the precision of the inputs (float16 inputs: float16's)."""
    rtol, atol = tolerance(dtype if dtype in (torch.float16, torch.bfloat16) else lse.dtype, lse.device)
    return {"rtol": rtol, "atol": max(atol, rtol)}


@check("split_kv_decode: equals SDPA (enable_gqa) and logsumexp for any number of splits, empty splits included; no per-head copy of K/V; no scores over all the keys at once ({device})",
       uses=("merge_attention_states",))
def check_split_kv_decode(split_kv_decode: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """Flash-Decoding in PyTorch, against SDPA over all the keys; GQA, MQA, MHA; splits of every kind."""
    expect_signature(split_kv_decode, "split_kv_decode", ["q", "k", "v", "num_splits", "scale"])
    generator = random_generator(seed)
    seq_len = randint(31, 45, generator)
    for num_splits in (3, 1, 5):
        _split_case(split_kv_decode, generator, (2, 4, 2, seq_len, 8), num_splits)
    _split_case(split_kv_decode, generator, (1, 6, 1, 5, 8), 8)  # more splits than keys: 3 empty
    _split_case(split_kv_decode, generator, (1, 3, 3, 7, 6), 7, scale=0.3)  # MHA, one key a split
    _split_case(split_kv_decode, generator, (2, 4, 2, 23, 16), 4, torch.float32, device)
    _split_case(split_kv_decode, generator, (1, 4, 2, 19, 8), 2, torch.float16, "cpu")
    q, k, v = _decode_inputs(generator, 1, 4, 2, 6, 8)
    for splits, bad in ((0, 0), (-1, -1)):
        _value_error(split_kv_decode, f"split_kv_decode(q, k, v, num_splits={splits})",
                     "num_splits must be at least 1", q, k, v, splits, must_mention=[bad])
    _value_error(split_kv_decode, "split_kv_decode(q, k, v, 2) with q [1, 3, 8] and k [1, 2, 6, 8]",
                 "H_q = 3 is not a multiple of H_kv = 2", q[:, :3], k, v, 2, must_mention=[3, 2])
    _value_error(split_kv_decode, "split_kv_decode(q, k, v, 2) with L = 0 keys", "there is no key to attend to",
                 q, k[:, :, :0], v[:, :, :0], 2)
    # What the code builds: no copy of K or V per query head, no scores over all the keys at once.
    batch, heads, kv_heads, seq_len, d = 1, 8, 2, 41, 6  # every size differs: a tensor's shape says what it is
    q, k, v = _decode_inputs(generator, batch, heads, kv_heads, seq_len, d)
    copy = "more numbers than K itself, a copy of the keys or values per query head"
    table = "scores of every query head over all the keys at once, with no split"
    for num_splits in (2, 3):
        call = _split_call_text(q, k, num_splits, None)
        rules = [[batch * kv_heads * seq_len * d + 1, None, d],  # bigger than K, d features a row
                 [batch * heads * seq_len, heads, seq_len], [batch * heads * seq_len, heads // kv_heads, seq_len]]
        _, watch = _watched(split_kv_decode, q, k, v, num_splits, call=call, rules=rules)
        _expect_no_offence(watch, call, [copy, table, table],
                           [SPLIT_HINTS["per_head_copy"], SPLIT_HINTS["not_split"], SPLIT_HINTS["not_split"]])


# --------------------------------------------------------------------------------------
# Exercise: split_kv_decode_kernel
# --------------------------------------------------------------------------------------


def _parts_layout(parts: torch.Tensor) -> torch.Tensor:
    """[n, B, H_q, ...] (the splits first, as merged) -> [B, H_q, n, ...] (as the kernel writes them)."""
    return parts.permute(1, 2, 0, *range(3, parts.dim()))


def _kernel_part_variants(q, k, v, bounds, scale: float, block: int, seq_len: int
                          ) -> tuple[list[Variant], list[Variant]]:
    """Wrong parts of a decode kernel (float64, in the kernel's layout): (variants of out, variants of lse)."""
    tiled = [(a, min(seq_len, a + math.ceil((b - a) / block) * block)) if b > a else (a, b) for a, b in bounds]
    whole = [(0, seq_len)] * len(bounds)

    def parts(bounds_: Sequence[tuple[int, int]], which: int, scale_: float = scale, modulo: bool = False
              ) -> Callable[[], torch.Tensor]:
        return lambda: _parts_layout(_split_parts(q, k, v, bounds_, scale_, modulo)[which])

    def unnormalised() -> torch.Tensor:  # acc = out · l, with l = Σ e^(s - m) = e^(lse - m)
        outs, lses = _split_parts(q, k, v, bounds, scale)
        q64, k64 = _f64(q, k)
        keys = _kv_of_heads(k64, q.shape[1])
        maxima = torch.stack([_scores(q64[:, :, None], keys[:, :, a:b], scale).amax(-1)[:, :, 0] if b > a
                              else torch.zeros_like(lses[0]) for a, b in bounds])
        return _parts_layout(outs * torch.exp(lses - maxima)[..., None])

    out_variants = [Variant(parts(tiled, 0), KERNEL_HINTS["split_end_mask"]),
                    Variant(parts(whole, 0), KERNEL_HINTS["whole_keys"]),
                    Variant(parts(bounds, 0, modulo=True), SPLIT_HINTS["kv_head_modulo"]),
                    Variant(parts(bounds, 0, 1.0), SPLIT_HINTS["no_scale"]),
                    Variant(unnormalised, KERNEL_HINTS["unnormalised"])]
    lse_variants = [Variant(lambda: _parts_layout(_split_parts(q, k, v, bounds, scale)[1]) * LOG2_E,
                            KERNEL_HINTS["lse_base2"]),
                    Variant(parts(tiled, 1), KERNEL_HINTS["split_end_mask"]),
                    Variant(parts(whole, 1), KERNEL_HINTS["whole_keys"]),
                    Variant(parts(bounds, 1, modulo=True), SPLIT_HINTS["kv_head_modulo"])]
    return out_variants, lse_variants


def _kernel_parts_case(kernel: Any, generator: torch.Generator, sizes: tuple[int, ...], num_splits: int, block: int,
                       dtype: torch.dtype, device: torch.device) -> None:
    from attention_lab.triton_kernels import launch_split_kv_decode

    batch, heads, kv_heads, seq_len, d = sizes
    q, k, v = _decode_inputs(generator, batch, heads, kv_heads, seq_len, d, dtype, device)
    call = (f"your kernel via launch_split_kv_decode(split_kv_decode_kernel, q, k, v, num_splits={num_splits}, "
            f"block={block}) with q {shape_str(q.shape)}, k and v {shape_str(k.shape)} ({_dtype_name(dtype)}, "
            f"{device.type})")
    result, watch, stored_past = _launched(call, "Write the kernel's loop.", launch_split_kv_decode, kernel, q, k, v,
                                           num_splits, block=block, poison=POISON_ROWS)
    if watch.stray is not None:
        where = f" (your line: `{watch.stray.line}`)" if watch.stray.line else ""
        raise CheckFailure(f"{call}: program {watch.stray.program} tried to {watch.stray.operation} at an address "
                           f"outside every tensor of the launch{where}.")
    lengths = {"K": ("seq_len", seq_len), "V": ("seq_len", seq_len), "Q": ("one query row", 1),
               "out": ("num_splits", num_splits), "lse": ("num_splits", num_splits)}
    for name, (length_name, length) in lengths.items():
        overrun = watch.beyond.get(name)
        if overrun is not None:
            where = f" (your line: `{overrun.line}`)" if overrun.line else ""
            verb = "loaded" if overrun.operation == "load" else "stored"
            raise CheckFailure(f"{call}: program {overrun.program} {verb} rows of {name} at or past {length_name} = "
                               f"{length}{where}, which {name} does not have.{_likely(_overrun_hint(overrun, 'unmasked_load', 'kernel_unmasked_store'))}")
    if stored_past is not None:
        raise CheckFailure(f"{call} wrote past the end of {stored_past}.")
    out_parts, lse_parts = result
    split_len = math.ceil(seq_len / num_splits)
    bounds = _split_bounds(seq_len, num_splits)
    want_out, want_lse = (_parts_layout(t) for t in _split_parts(q, k, v, bounds, d ** -0.5))
    for s, (a, b) in enumerate(bounds):
        if a == b:  # an empty split: out 0, lse -inf
            got_out, got_lse = out_parts[:, :, s].detach().cpu(), lse_parts[:, :, s].detach().cpu()
            expect_true(bool((got_out == 0).all()) and bool((got_lse == NEG_INF).all()),
                        f"{call}: split {s} has no key (it starts at {s * split_len} >= seq_len = {seq_len}), so it "
                        f"should write out 0 and lse -inf; got out {got_out.flatten()[:3].tolist()}..., lse "
                        f"{got_lse.flatten()[:3].tolist()}....{_likely(KERNEL_HINTS['empty_split'])}")
    nan_hint = KERNEL_HINTS["head_dim_mask"] if d & (d - 1) else EFFICIENT_HINTS["nan_past_end"]
    _expect_finite_where(out_parts, want_out, f"out parts from {call}", nan_hint)
    _expect_finite_where(lse_parts, want_lse, f"lse parts from {call}", nan_hint)
    out_variants, lse_variants = _kernel_part_variants(q, k, v, bounds, d ** -0.5, block, seq_len)
    rtol, atol = tolerance(torch.float16 if dtype == torch.float16 else torch.float32, device)
    expect_close(out_parts, want_out, what=f"out parts [B, H_q, num_splits, d] from {call}",
                 against="each split's attention state (float64)", variants=out_variants, rtol=rtol,
                 atol=atol)
    expect_close(lse_parts, want_lse, what=f"lse parts [B, H_q, num_splits] from {call}",
                 against="each split's torch.logsumexp", variants=lse_variants, rtol=rtol,
                 atol=max(atol, rtol))


@check("split_kv_decode_kernel: each split's (out, lse) equals its attention state in float32 and float16, GQA, ragged splits and tiles, head sizes not a power of two, empty splits ({device})")
def check_split_kv_decode_kernel(split_kv_decode_kernel: Any, *, seed: int = 0, device: torch.device | None = None,
                                 sizes: str = "small") -> None:
    """The student's Triton kernel, launched by the course's launcher (in the interpreter on the CPU, natively on
    CUDA), with NaN after every head's keys, values and features; the parts judged one by one."""
    from attention_lab.triton_kernels import TRITON_AVAILABLE, TRITON_MISSING

    if not TRITON_AVAILABLE:
        raise CheckFailure(TRITON_MISSING)
    generator = random_generator(seed)
    # (B, H_q, H_kv, L, d), num_splits, block, dtype: no L a multiple of its splits or tiles. The interpreter runs
    # each program's tiles one after the other (~5 ms a tile): about 100 tiles a call of this check.
    cases = [((2, 4, 2, 37, 16), 3, 8, torch.float32),  # GQA; splits of 13, tiles of 8 cross the split ends
             ((1, 4, 1, 29, 24), 4, 16, torch.float32),  # MQA; d = 24; tiles of 16 wider than the splits of 8
             ((1, 2, 2, 5, 16), 8, 4, torch.float32),  # more splits than keys: 3 empty
             ((1, 4, 2, 50, 16), 3, 16, torch.float16)]
    if sizes == "more":
        cases = [((1, 8, 2, 100, 32), 5, 32, torch.float32), ((1, 6, 3, 77, 40), 6, 16, torch.float32),
                 ((3, 2, 1, 3, 16), 4, 16, torch.float32)]
    for shape, num_splits, block, dtype in cases:
        _kernel_parts_case(split_kv_decode_kernel, generator, shape, num_splits, block, dtype, device)


# --------------------------------------------------------------------------------------
# Exercise: slot_mapping
# --------------------------------------------------------------------------------------


def _slots(table: Sequence[int], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    table_t = torch.tensor(list(table), dtype=torch.long)
    return table_t[positions // block_size] * block_size + positions % block_size


@check("slot_mapping: block_table[p // block_size]·block_size + p % block_size for start <= p < end; ValueError for a table too short ({device})")
def check_slot_mapping(slot_mapping: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """Lists and tensors of block ids, any start and end; empty ranges; bad ranges."""
    expect_signature(slot_mapping, "slot_mapping", ["block_table", "start", "end", "block_size"])
    generator = random_generator(seed)
    table = torch.randperm(40, generator=generator)[:5].tolist()
    cases = [([7, 2], 2, 6, 4, "list"), (table, 0, 20, 4, "list"), (table, 5, 17, 4, "list"),
             (table, 3, 3, 4, "list"), (table[:3], 1, 16, 8, "tensor"), (table, 9, 10, 2, "tensor")]
    for block_table, start, end, block_size, kind in cases:
        given = block_table if kind == "list" else torch.tensor(block_table, device=device)
        call = f"slot_mapping({block_table if kind == 'list' else f'torch.tensor({block_table})'}, {start}, {end}, {block_size})"
        got = call_student(slot_mapping, given, start, end, block_size, call=call)
        expect_tensor(got, what=call, shape=(end - start,), dtype=torch.long,
                      device=device if kind == "tensor" else None)
        positions = torch.arange(start, end)
        variants = [(positions, PAGED_HINTS["slot_no_table"]),
                    (torch.tensor(block_table)[positions // block_size] + positions % block_size,
                     PAGED_HINTS["slot_no_block_size"])]
        if start > 0:
            variants.append((_slots(block_table, torch.arange(0, end - start), block_size), PAGED_HINTS["slot_from_zero"]))
        if end < len(block_table) * block_size:
            variants.append((_slots(block_table, positions + 1, block_size), PAGED_HINTS["slot_off_by_one"]))
        expect_exact(got, _slots(block_table, positions, block_size), call, variants)
    _value_error(slot_mapping, "slot_mapping([3, 1], 0, 9, 4)", "two blocks of 4 slots hold positions 0 ... 7 only",
                 [3, 1], 0, 9, 4)
    _value_error(slot_mapping, "slot_mapping([3, 1], 5, 2, 4)", "start comes after end", [3, 1], 5, 2, 4)


# --------------------------------------------------------------------------------------
# Exercise: PagedKVCache
# --------------------------------------------------------------------------------------


class _CacheUnderTest:
    """The student's cache, called through call_student, with the contents of each sequence read back from the
    pool (by its block table and length) and compared with what was appended (kept here, on the check's side)."""

    def __init__(self, cls: Callable, num_blocks: int, block_size: int, kv_heads: int, d: int, dtype: torch.dtype,
                 device: torch.device, name: str = "cache"):
        self.label = f"PagedKVCache({num_blocks}, {block_size}, {kv_heads}, {d}, dtype={dtype})"
        self.cache = call_student(cls, num_blocks, block_size, kv_heads, d, dtype=dtype, device=device,
                                  call=self.label)
        self.num_blocks, self.block_size, self.kv_heads, self.d = num_blocks, block_size, kv_heads, d
        self.dtype, self.device, self.name = dtype, device, name
        self.expected: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # seq -> (k, v) [H_kv, n, d], float64
        self.story: list[str] = []  # what was done so far, for the messages

    def where(self) -> str:
        return f"{self.label}, after " + (", ".join(self.story[-4:]) if self.story else "nothing else")

    def method(self, name: str, *args: Any, text: str | None = None) -> Any:
        call = text or f"{self.name}.{name}({', '.join(str(a) for a in args)})"
        return call_student(getattr(self.cache, name), *args, call=f"{call} ({self.where()})")

    def attribute(self, name: str) -> Any:
        try:
            return getattr(self.cache, name)
        except checker_side.BridgeError as error:
            raise CheckFailure(f"{self.name}.{name}: {error}") from None
        except Exception as error:
            raise CheckFailure(f"reading {self.name}.{name} raised {type(error).__name__}: {error}") from None

    def free_blocks(self) -> int:
        free = self.attribute("num_free_blocks")
        expect_true(type(free) is int, f"{self.name}.num_free_blocks should be an int, got {describe(free)} "
                                       f"({self.where()}).")
        return free

    def new(self) -> int:
        seq = self.method("new_sequence")
        expect_true(type(seq) is int, f"{self.name}.new_sequence() should return an int id, got {describe(seq)}.")
        self.expected[seq] = (torch.zeros(self.kv_heads, 0, self.d, dtype=torch.float64),) * 2
        self.story.append(f"new_sequence() -> {seq}")
        return seq

    def append(self, seq: int, n: int, generator: torch.Generator, dtype: torch.dtype | None = None) -> None:
        k = randn(self.kv_heads, n, self.d, generator=generator, dtype=dtype or self.dtype, device=self.device)
        v = randn(self.kv_heads, n, self.d, generator=generator, dtype=dtype or self.dtype, device=self.device)
        self.method("append", seq, k, v, text=f"{self.name}.append({seq}, k, v) with k and v {shape_str(k.shape)}")
        old_k, old_v = self.expected[seq]
        self.expected[seq] = (torch.cat([old_k, _f64(k)[0]], 1), torch.cat([old_v, _f64(v)[0]], 1))
        self.story.append(f"append({seq}, {n} tokens)")

    def fork(self, seq: int) -> int:
        child = self.method("fork", seq)
        expect_true(type(child) is int, f"{self.name}.fork({seq}) should return an int id, got {describe(child)}.")
        self.expected[child] = self.expected[seq]
        self.story.append(f"fork({seq}) -> {child}")
        return child

    def free(self, seq: int) -> None:
        self.method("free", seq)
        del self.expected[seq]
        self.story.append(f"free({seq})")

    def contents(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [H_kv, n, d] of a sequence, read from the pools by its block table and length."""
        table = self.method("block_table", seq)
        length = self.method("seq_len", seq)
        expect_true(isinstance(table, list) and all(type(b) is int for b in table),
                    f"{self.name}.block_table({seq}) should return a list of ints, got {describe(table)}.")
        expect_true(type(length) is int, f"{self.name}.seq_len({seq}) should return an int, got {describe(length)}.")
        expect_true(len(table) == math.ceil(length / self.block_size),
                    f"{self.name}.block_table({seq}) has {len(table)} blocks for {length} tokens in blocks of "
                    f"{self.block_size} ({self.where()}); it needs ceil({length} / {self.block_size}) = "
                    f"{math.ceil(length / self.block_size)}.")
        expect_true(all(0 <= b < self.num_blocks for b in table) and len(set(table)) == len(table),
                    f"{self.name}.block_table({seq}) = {table} should hold distinct block ids 0 ... "
                    f"{self.num_blocks - 1} ({self.where()}).")
        pools = []
        for name in ("k_pool", "v_pool"):
            pool = self.attribute(name)
            expect_tensor(pool, what=f"{self.name}.{name}", shape=(self.num_blocks, self.block_size, self.kv_heads,
                                                                   self.d), dtype=self.dtype, device=self.device,
                          dtype_hint=PAGED_HINTS["append_dtype"])
            gathered = pool.detach().cpu().double()[torch.tensor(table, dtype=torch.long)]
            pools.append(gathered.reshape(-1, self.kv_heads, self.d)[:length].transpose(0, 1))
        return pools[0], pools[1]

    def expect_contents(self, seq: int, hint: str = PAGED_HINTS["contents"], who: str = "") -> None:
        got_k, got_v = self.contents(seq)
        want_k, want_v = self.expected[seq]
        expect_true(got_k.shape == want_k.shape,
                    f"{self.name}.seq_len({seq}) is {got_k.shape[1]}, but {want_k.shape[1]} tokens were appended to "
                    f"it ({self.where()}).")
        rtol, atol = tolerance(self.dtype)
        for name, got, want in (("keys", got_k, want_k), ("values", got_v, want_v)):
            if not torch.allclose(got, want, rtol=rtol, atol=atol):
                bad = int((~torch.isclose(got, want, rtol=rtol, atol=atol)).any(-1).any(0).nonzero()[0])
                raise CheckFailure(f"the {name} of sequence {seq}{who}, read from the pool by its block table, differ "
                                   f"from what was appended to it, first at token {bad} ({self.where()})."
                                   + _likely(hint))

    def expect_free(self, expected: int, hints: dict[int, str] | None = None) -> None:
        got = self.free_blocks()
        if got != expected:
            hint = (hints or {}).get(got)
            raise CheckFailure(f"{self.name}.num_free_blocks should be {expected} ({self.where()}), got {got}."
                               + (_likely(hint) if hint else ""))


def _block_count_hints(lengths: Sequence[int], block_size: int, total: int) -> dict[int, str]:
    """num_free_blocks that each wrong rule for taking blocks would give after these appends."""
    final = lengths[-1]
    early = total - (final // block_size + 1)
    late = total - max(0, math.ceil((final - 1) / block_size))
    per_append = total - len(lengths)
    hints = {per_append: PAGED_HINTS["block_per_append"], late: PAGED_HINTS["block_late"],
             early: PAGED_HINTS["block_early"]}
    hints.pop(total - math.ceil(final / block_size), None)  # the right count names nothing
    return hints


@check("PagedKVCache: blocks taken from the free list exactly when needed; each sequence's K/V read back from the pool; free, MemoryError, KeyError, ValueError ({device})")
def check_paged_kv_cache(PagedKVCache: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """Appends of every size, two sequences in one pool, free, ids never reused, bad ids and shapes, MemoryError
    that changes nothing, the pool's dtype kept."""
    generator = random_generator(seed)
    cpu = torch.device("cpu")
    cache = _CacheUnderTest(PagedKVCache, 10, 4, 2, 8, torch.float64, cpu)
    expect_tensor(cache.attribute("k_pool"), what=f"{cache.label}.k_pool", shape=(10, 4, 2, 8), dtype=torch.float64)
    cache.expect_free(10)
    first = cache.new()
    expect_true(cache.method("seq_len", first) == 0 and cache.method("block_table", first) == [],
                f"a new sequence should have seq_len 0 and block_table [] ({cache.where()}).")
    lengths = []
    for n in (2, 1, 1, 1, 6, 4):  # 2, 3, 4, 5, 11, 15 tokens: 1, 1, 1, 2, 3, 4 blocks
        cache.append(first, n, generator)
        lengths.append(sum(lengths[-1:]) + n)
        cache.expect_free(10 - math.ceil(lengths[-1] / 4), _block_count_hints(lengths, 4, 10))
        cache.expect_contents(first)
    second = cache.new()
    expect_true(second != first, f"new_sequence() returned {second} twice ({cache.where()}).")
    cache.append(second, 5, generator)
    cache.expect_free(4)
    cache.expect_contents(second)
    cache.expect_contents(first, who=" (the other sequence)")
    cache.free(first)
    cache.expect_free(8)
    cache.expect_contents(second)
    for method, args in (("block_table", (first,)), ("seq_len", (first,)), ("free", (first,)), ("fork", (first,))):
        _expect_key_error(cache, method, args)
    third = cache.new()
    expect_true(third not in (first, second),
                f"new_sequence() returned {third}, an id already used ({cache.where()}).{_likely(PAGED_HINTS['id_reused'])}")
    _expect_key_error(cache, "seq_len", (max(first, second, third) + 17,))
    for shape in ((2, 3, 7), (3, 2, 8), (2, 8)):
        bad = torch.zeros(shape, dtype=torch.float64)
        _value_error(cache.cache.append, f"cache.append({second}, k, v) with k and v {shape_str(shape)} (the cache "
                     "holds [H_kv=2, n, d=8])", "k and v must be [H_kv, n, d]", second, bad, bad)
    cache.expect_contents(second)
    _expect_memory_error(PagedKVCache, generator)
    # The pool keeps its dtype: float64 tokens into a float32 pool.
    small = _CacheUnderTest(PagedKVCache, 4, 4, 2, 8, torch.float32, device, name="cache32")
    seq = small.new()
    small.append(seq, 6, generator, dtype=torch.float64)
    small.expect_contents(seq)


def _expect_raises(error_type: type, fn: Callable, *args: Any, call: str, why: str, hint: str = "") -> BaseException:
    """``fn(*args)`` must raise ``error_type`` (``why``: what makes it an error); returns what it raised."""
    try:
        fn(*args)
    except error_type as error:
        return error
    except checker_side.BridgeError as error:  # the kernel's failure, not the answer's exception
        raise CheckFailure(f"{call}: {error}") from None
    except Exception as error:
        raise CheckFailure(f"{call} should raise {error_type.__name__} ({why}), but raised {type(error).__name__}: "
                           f"{error}" + (_likely(hint) if hint else "")) from None
    raise CheckFailure(f"{call} should raise {error_type.__name__} ({why}), but it returned normally."
                       + (_likely(hint) if hint else ""))


def _expect_key_error(cache: _CacheUnderTest, method: str, args: tuple) -> None:
    call = f"{cache.name}.{method}({', '.join(str(a) for a in args)}) ({cache.where()})"
    _expect_raises(KeyError, getattr(cache.cache, method), *args, call=call, why="no such sequence")


def _expect_memory_error(cls: Callable, generator: torch.Generator) -> None:
    """An append that needs more blocks than are free raises MemoryError naming both numbers and changes nothing."""
    cache = _CacheUnderTest(cls, 5, 4, 1, 4, torch.float64, torch.device("cpu"))
    seq = cache.new()
    cache.append(seq, 9, generator)  # 3 blocks: 2 free
    k, v = (randn(1, 13, 4, generator=generator) for _ in range(2))  # 22 tokens would need 6 blocks: 3 more
    call = f"cache.append({seq}, k, v) with 13 tokens ({cache.where()})"
    text = str(_expect_raises(MemoryError, cache.cache.append, seq, k, v, call=call,
                              why="3 more blocks needed, 2 free"))
    cache.story.append("a MemoryError")
    cache.expect_free(2, {free: PAGED_HINTS["memory_error_partial"] for free in range(2)})
    cache.expect_contents(seq, hint=PAGED_HINTS["memory_error_partial"])
    expect_true("3" in text and "2" in text, f"{call} raised MemoryError, but its message {text!r} should name the "
                                             "blocks needed (3) and the blocks free (2).")


@check("PagedKVCache.fork: blocks shared by reference count; copy-on-write of the last, partly filled block only; the other sequence unchanged; free keeps shared blocks ({device})")
def check_paged_kv_cache_fork(PagedKVCache: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """Forks of a partly filled and of a full last block, writes on both sides, frees, and MemoryError for a copy."""
    generator = random_generator(seed)
    cache = _CacheUnderTest(PagedKVCache, 12, 4, 2, 8, torch.float64, torch.device("cpu"))
    parent = cache.new()
    cache.append(parent, 6, generator)  # 2 blocks, the last half full
    child = cache.fork(parent)
    cache.expect_free(10, {free: PAGED_HINTS["fork_copies"] for free in range(10)})
    cache.expect_contents(child)
    cache.append(child, 1, generator)  # into the shared block: copy it first
    cache.expect_contents(parent, hint=PAGED_HINTS["fork_no_cow"], who=" (the sequence forked from)")
    cache.expect_free(9, {10: PAGED_HINTS["fork_no_cow"]})
    cache.expect_contents(child)
    cache.append(parent, 1, generator)  # its last block is its own again: no copy
    cache.expect_free(9, {8: PAGED_HINTS["cow_unneeded"]})
    cache.expect_contents(parent)
    cache.expect_contents(child, hint=PAGED_HINTS["fork_no_cow"], who=" (the fork)")
    cache.append(parent, 1, generator)  # 8 tokens: two full blocks
    full = cache.fork(parent)
    cache.append(full, 2, generator)  # a new block, no copy of the full one
    cache.expect_free(8, {7: PAGED_HINTS["cow_full_block"]})
    cache.expect_contents(parent, hint=PAGED_HINTS["fork_no_cow"], who=" (the sequence forked from)")
    cache.expect_contents(full)
    cache.free(parent)  # its first block is still the child's and full's; its second is full's
    cache.expect_free(8, {free: PAGED_HINTS["free_shared"] for free in range(9, 13)})
    filler = cache.new()
    cache.append(filler, 4 * cache.free_blocks(), generator)  # takes every free block and writes into it
    for seq in (child, full):
        cache.expect_contents(seq, hint=PAGED_HINTS["free_shared"], who=" (a fork of the freed sequence)")
    for seq in (child, full, filler):
        cache.free(seq)
    cache.expect_free(12, {free: PAGED_HINTS["free_shared"] for free in range(12)})
    # Copy-on-write needs a block too: none free, so MemoryError, and nothing changes.
    tight = _CacheUnderTest(PagedKVCache, 3, 4, 1, 4, torch.float64, torch.device("cpu"), name="tight")
    first = tight.new()
    tight.append(first, 6, generator)
    second = tight.fork(first)
    other = tight.new()
    tight.append(other, 4, generator)
    k, v = (randn(1, 1, 4, generator=generator) for _ in range(2))
    call = f"tight.append({second}, k, v) with 1 token ({tight.where()})"
    _expect_raises(MemoryError, tight.cache.append, second, k, v, call=call,
                   why="the copy of the shared block needs a block, and none is free", hint=PAGED_HINTS["cow_memory"])
    tight.story.append("a MemoryError")
    for seq in (first, second):
        tight.expect_contents(seq, hint=PAGED_HINTS["cow_memory"])
    tight.expect_free(0)


# --------------------------------------------------------------------------------------
# Exercise: paged_decode_attention
# --------------------------------------------------------------------------------------


class _PagedBatch:
    """A pool with a few sequences written at random blocks, its tables padded with -1, and each sequence's K/V
    kept contiguous; every slot no sequence may read holds ``fill`` (a finite value, or NaN)."""

    def __init__(self, generator: torch.Generator, lengths: Sequence[int], num_blocks: int, block_size: int,
                 kv_heads: int, d: int):
        self.lengths, self.block_size = list(lengths), block_size
        needed = [math.ceil(n / block_size) for n in lengths]
        width = max(needed) + 1  # one padding column at least
        order = torch.randperm(num_blocks, generator=generator).tolist()
        self.tables = torch.full((len(lengths), width), -1, dtype=torch.long)
        for b, count in enumerate(needed):
            self.tables[b, :count] = torch.tensor(order[:count])
            order = order[count:]
        self.keys = [randn(n, kv_heads, d, generator=generator) for n in lengths]
        self.values = [randn(n, kv_heads, d, generator=generator) for n in lengths]
        self.garbage_k = randn(num_blocks, block_size, kv_heads, d, generator=generator) * 3
        self.garbage_v = randn(num_blocks, block_size, kv_heads, d, generator=generator) * 3

    def slots(self, b: int, count: int | None = None) -> torch.Tensor:
        count = self.lengths[b] if count is None else count
        return _slots(self.tables[b].tolist(), torch.arange(count), self.block_size)

    def pools(self, fill_nan: bool) -> tuple[torch.Tensor, torch.Tensor]:
        k_pool = torch.full_like(self.garbage_k, math.nan) if fill_nan else self.garbage_k.clone()
        v_pool = torch.full_like(self.garbage_v, math.nan) if fill_nan else self.garbage_v.clone()
        for b in range(len(self.lengths)):
            k_pool.view(-1, *k_pool.shape[2:])[self.slots(b)] = self.keys[b]
            v_pool.view(-1, *v_pool.shape[2:])[self.slots(b)] = self.values[b]
        return k_pool, v_pool

    def attend(self, q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               scale: float | None = None, modulo: bool = False) -> torch.Tensor:
        """[B, H_q, d] in float64: each sequence's query over its own keys [n, H_kv, d]."""
        outs = []
        for b, (k, v) in enumerate(zip(keys, values)):
            k4, v4 = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, H_kv, n, d]
            outs.append(decode_reference(_f64(q)[0][b:b + 1], k4, v4, scale, modulo)[0][0])
        return torch.stack(outs)

    def gathered(self, pool: torch.Tensor, b: int, count: int) -> torch.Tensor:
        return pool.view(-1, *pool.shape[2:])[self.slots(b, count)]

    def variants(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float) -> list[Variant]:
        batch = range(len(self.lengths))

        def counts(extra: int) -> list[int]:
            return [min(n + extra, int((self.tables[b] >= 0).sum()) * self.block_size) for b, n in enumerate(self.lengths)]

        def read(counts_: Sequence[int]) -> Callable[[], torch.Tensor]:
            return lambda: self.attend(q, [self.gathered(k_pool, b, counts_[b]) for b in batch],
                                       [self.gathered(v_pool, b, counts_[b]) for b in batch], scale)

        def padded() -> torch.Tensor:  # every entry of the table, -1 as the pool's last block, every slot
            keys, values = [], []
            for b in batch:
                blocks = self.tables[b] % k_pool.shape[0]
                keys.append(k_pool[blocks].reshape(-1, *k_pool.shape[2:]))
                values.append(v_pool[blocks].reshape(-1, *v_pool.shape[2:]))
            return self.attend(q, keys, values, scale)

        whole = [math.ceil(n / self.block_size) * self.block_size for n in self.lengths]
        return [Variant(read(counts(1)), PAGED_HINTS["slot_past_end"]),
                Variant(read(whole), PAGED_HINTS["whole_blocks"]),
                Variant(padded, PAGED_HINTS["padding_block"]),
                Variant(read([max(1, n - 1) for n in self.lengths]), PAGED_HINTS["missing_last_token"]),
                Variant(lambda: self.attend(q, self.keys, self.values, scale, modulo=True), SPLIT_HINTS["kv_head_modulo"]),
                Variant(lambda: self.attend(q, self.keys, self.values, 1.0), SPLIT_HINTS["no_scale"])]


def _paged_case(paged_decode_attention: Callable, generator: torch.Generator, lengths: Sequence[int], heads: int,
                kv_heads: int, dtype: torch.dtype, device: Any, num_blocks: int = 24, block_size: int = 4,
                d: int = 8, watch_pool: bool = False) -> None:
    batch = _PagedBatch(generator, lengths, num_blocks, block_size, kv_heads, d)
    q = randn(len(lengths), heads, d, generator=generator, dtype=dtype, device=device)
    want = batch.attend(q, batch.keys, batch.values)
    seq_lens = torch.tensor(lengths, dtype=torch.long, device=device)
    tables = batch.tables.to(device)
    for fill_nan in (False, True):
        k_pool, v_pool = (p.to(device, dtype) for p in batch.pools(fill_nan))
        what = "NaN" if fill_nan else "other values"
        call = (f"paged_decode_attention(q, k_pool, v_pool, block_tables, seq_lens) with q {shape_str(q.shape)}, pools "
                f"{shape_str(k_pool.shape)} ({_dtype_name(dtype)}), seq_lens {lengths}, block_tables "
                f"{batch.tables.tolist()}, every slot no sequence may read holding {what}")
        if watch_pool:
            out, watch = _watched(paged_decode_attention, q, k_pool, v_pool, tables, seq_lens, call=call,
                                  rules=[[k_pool.numel(), None, None]])
            _expect_no_offence(watch, call, ["as many numbers as the whole pool"], [PAGED_HINTS["pool_copy"]])
        else:
            out = call_student(paged_decode_attention, q, k_pool, v_pool, tables, seq_lens, call=call)
        expect_tensor(out, what=f"out from {call}", shape=q.shape, dtype=dtype, device=device)
        if fill_nan:
            _expect_finite_where(out, want, f"out from {call}", PAGED_HINTS["read_nan"])
        expect_close(out, want, what=f"out from {call}", against="SDPA over each sequence's own keys (float64)",
                     variants=[] if fill_nan else batch.variants(q, *_f64(k_pool, v_pool), d ** -0.5))


@check("paged_decode_attention: SDPA over each sequence's own slots (GQA); the slots past each length, padding entries and unused blocks are never read; no copy of the pool ({device})")
def check_paged_decode_attention(paged_decode_attention: Callable, *, seed: int = 0,
                                 device: torch.device | None = None) -> None:
    """Sequences of uneven lengths at random blocks; NaN everywhere they may not read; a table too short."""
    expect_signature(paged_decode_attention, "paged_decode_attention",
                     ["q", "k_pool", "v_pool", "block_tables", "seq_lens", "scale"])
    generator = random_generator(seed)
    cpu = torch.device("cpu")
    _paged_case(paged_decode_attention, generator, [6, 8, 1, randint(9, 11, generator)], 4, 2, torch.float64, cpu)
    _paged_case(paged_decode_attention, generator, [3, 13], 3, 3, torch.float64, cpu, block_size=8, d=6)  # MHA
    _paged_case(paged_decode_attention, generator, [5, 7, 2], 4, 1, torch.float32, device)  # MQA
    _paged_case(paged_decode_attention, generator, [7, 2, 5], 4, 2, torch.float64, cpu, num_blocks=64,
                watch_pool=True)
    batch = _PagedBatch(generator, [9], 8, 4, 2, 8)
    k_pool, v_pool = batch.pools(False)
    tables = torch.tensor([[batch.tables[0, 0], batch.tables[0, 1], -1]])
    q = randn(1, 2, 8, generator=generator)
    _value_error(paged_decode_attention, "paged_decode_attention(q, k_pool, v_pool, block_tables, seq_lens) with "
                 f"seq_lens [9] and block_tables {tables.tolist()} (two blocks of 4 slots for 9 tokens)",
                 "the table is too short for the sequence", q, k_pool, v_pool, tables, torch.tensor([9]))


# --------------------------------------------------------------------------------------
# Exercise: sliding_window_mask
# --------------------------------------------------------------------------------------


def window_keep(q_len: int, kv_len: int, window: int | None, offset: int | None = None, low: int = 0,
                causal: bool = True) -> torch.Tensor:
    """``[q_len, kv_len]``: True where the query at position p = i + offset sees key j, p - window + low < j <= p."""
    offset = kv_len - q_len if offset is None else offset
    positions = torch.arange(q_len)[:, None] + offset
    keys = torch.arange(kv_len)[None, :]
    keep = keys <= positions if causal else torch.ones(q_len, kv_len, dtype=torch.bool)
    if window is not None:
        near = keys > positions - window + low
        keep = keep & near if causal else near & (keys < positions + window)
    return keep


@check("sliding_window_mask: p - window < j <= p with p = i + kv_len - q_len; exactly window keys; ValueError for window < 1")
def check_sliding_window_mask(sliding_window_mask: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """Square, decode, chunk and q_len > kv_len masks, windows of 1 and wider than the context."""
    expect_signature(sliding_window_mask, "sliding_window_mask", ["q_len", "kv_len", "window"])
    generator = random_generator(seed)
    cases = [(6, 6, 3), (1, 10, 4), (3, 10, 4), (8, 5, 2), (5, 5, 1), (4, 6, 9),
             (randint(2, 6, generator), randint(7, 14, generator), randint(2, 5, generator))]
    for q_len, kv_len, window in cases:
        call = f"sliding_window_mask({q_len}, {kv_len}, {window})"
        got = call_student(sliding_window_mask, q_len, kv_len, window, call=call)
        expect_tensor(got, what=call, shape=(q_len, kv_len), dtype=torch.bool)
        variants = [(window_keep(q_len, kv_len, window, low=-1), WINDOW_HINTS["window_plus_one"]),
                    (window_keep(q_len, kv_len, window, low=1), WINDOW_HINTS["window_minus_one"]),
                    (window_keep(q_len, kv_len, window, offset=0), WINDOW_HINTS["window_top_left"]),
                    (window_keep(q_len, kv_len, window, causal=False), WINDOW_HINTS["window_symmetric"])]
        expect_exact(got, window_keep(q_len, kv_len, window), call, variants)
    for window in (0, -2):
        _value_error(sliding_window_mask, f"sliding_window_mask(4, 4, {window})", "a query must see at least itself",
                     4, 4, window, must_mention=[window])


# --------------------------------------------------------------------------------------
# Exercise: attention_with_sinks
# --------------------------------------------------------------------------------------


def sinks_reference(q, k, v, sinks, window=None, scale=None, sink_factor: float = 1.0, sink_count: int = 1,
                    offset: int | None = None, causal: bool = True) -> torch.Tensor:
    """Attention whose softmax has ``sink_count`` copies of each head's sink (times ``sink_factor``) in its
    denominator, in float64; a row of nothing gives 0."""
    q, k, v, sinks = _f64(q, k, v, sinks)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = _scores(q, k, scale)
    keep = window_keep(q.shape[-2], k.shape[-2], window, offset=offset, causal=causal)
    scores = scores.masked_fill(~keep, NEG_INF)
    sink = (sinks * sink_factor).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    logits = torch.cat([scores] + [sink] * sink_count, dim=-1)
    top = logits.amax(-1, keepdim=True)
    exps = torch.exp(logits - torch.where(torch.isfinite(top), top, 0.0))
    total = exps.sum(-1, keepdim=True)
    return (exps[..., :scores.shape[-1]] / torch.where(total > 0, total, 1.0)) @ v


def _sinks_variants(q, k, v, sinks, window, scale) -> list[Variant]:
    def numerator() -> torch.Tensor:
        q64, k64, sinks64 = _f64(q, k, sinks)
        scores = _scores(q64, k64, scale).masked_fill(~window_keep(q.shape[-2], k.shape[-2], window), NEG_INF)
        lse = torch.logsumexp(scores, -1, keepdim=True)
        sink = sinks64.view(1, -1, 1, 1)
        share = torch.exp(sink - torch.logaddexp(lse, sink.expand_as(lse))).nan_to_num(0.0)
        return sinks_reference(q, k, v, torch.full_like(sinks64, NEG_INF), window, scale) * share

    return [Variant(lambda: sinks_reference(q, k, v, torch.full_like(_f64(sinks)[0], NEG_INF), window, scale),
                    WINDOW_HINTS["sink_ignored"]),
            Variant(lambda: sinks_reference(q, k, v, sinks, window, scale, sink_count=2), WINDOW_HINTS["sink_twice"]),
            Variant(lambda: sinks_reference(q, k, v, sinks, window, scale, sink_factor=scale),
                    WINDOW_HINTS["sink_scaled"]),
            Variant(numerator, WINDOW_HINTS["sink_numerator"]),
            Variant(lambda: sinks_reference(q, k, v, sinks, window, scale, causal=False), WINDOW_HINTS["sinks_not_causal"])]


def _sinks_case(attention_with_sinks: Callable, generator: torch.Generator, shape: tuple[int, ...],
                window: int | None, sinks: torch.Tensor | None = None, dtype: torch.dtype = torch.float64,
                device: Any = "cpu") -> None:
    batch, heads, seq_q, seq_k, d = shape
    q = randn(batch, heads, seq_q, d, generator=generator, dtype=dtype, device=device)
    k = randn(batch, heads, seq_k, d, generator=generator, dtype=dtype, device=device)
    v = randn(batch, heads, seq_k, d, generator=generator, dtype=dtype, device=device)
    sinks = (randn(heads, generator=generator) * 1.5 + 0.5 if sinks is None else sinks).to(device, dtype)
    call = ("attention_with_sinks(q, k, v, sinks" + (f", window={window}" if window is not None else "")
            + f") with q {shape_str(q.shape)}, k and v {shape_str(k.shape)}, sinks {[round(s, 2) for s in sinks.tolist()]}"
            f" ({_dtype_name(dtype)})")
    kwargs = {} if window is None else {"window": window}
    out = call_student(attention_with_sinks, q, k, v, sinks, call=call, **kwargs)
    expect_tensor(out, what=call, shape=q.shape, dtype=dtype, device=device)
    want = sinks_reference(q, k, v, sinks, window)
    _expect_finite_where(out, want, call, WINDOW_HINTS["no_key_nan"])
    expect_close(out, want, what=call, against="softmax([scores, sink])[..., :-1] @ v (float64)",
                 variants=_sinks_variants(q, k, v, sinks, window, d ** -0.5) + [
                     Variant(lambda: sinks_reference(q, k, v, sinks, window, offset=0), WINDOW_HINTS["window_top_left"]),
                     Variant(lambda: sinks_reference(q, k, v, sinks, None if window is None else window + 1),
                             WINDOW_HINTS["window_plus_one"])])


@check("attention_with_sinks: one learned logit per head in the softmax's denominator, not scaled; causal bottom-right, windowed; sinks = -inf is plain attention; a query without keys gives 0 ({device})")
def check_attention_with_sinks(attention_with_sinks: Callable, *, seed: int = 0,
                               device: torch.device | None = None) -> None:
    """Against softmax([scores, sink]) in float64, with and without a window, fewer and more queries than keys."""
    expect_signature(attention_with_sinks, "attention_with_sinks", ["q", "k", "v", "sinks", "window", "scale"])
    generator = random_generator(seed)
    _sinks_case(attention_with_sinks, generator, (1, 3, 7, 7, 8), None)
    _sinks_case(attention_with_sinks, generator, (2, 2, 7, 7, 8), 3)
    _sinks_case(attention_with_sinks, generator, (1, 2, 2, 9, 8), 4)
    _sinks_case(attention_with_sinks, generator, (1, 2, 5, 5, 8), None, sinks=torch.full((2,), NEG_INF))
    _sinks_case(attention_with_sinks, generator, (1, 2, 6, 3, 8), None, sinks=torch.full((2,), NEG_INF))
    _sinks_case(attention_with_sinks, generator, (1, 2, 6, 3, 8), 2)
    _sinks_case(attention_with_sinks, generator, (2, 4, 5, 8, 16), 3, dtype=torch.float32, device=device)


# --------------------------------------------------------------------------------------
# StreamingLLM: streaming_kept_positions, streaming_decode
# --------------------------------------------------------------------------------------


def kept_positions(seq_len: int, n_sink: int, n_recent: int) -> torch.Tensor:
    if seq_len <= n_sink + n_recent:
        return torch.arange(seq_len)
    return torch.cat([torch.arange(n_sink), torch.arange(seq_len - n_recent, seq_len)])


@check("streaming_kept_positions: the first n_sink and the last n_recent positions, in order, no duplicates")
def check_streaming_kept_positions(streaming_kept_positions: Callable, *, seed: int = 0,
                                   device: torch.device | None = None) -> None:
    expect_signature(streaming_kept_positions, "streaming_kept_positions", ["seq_len", "n_sink", "n_recent"])
    generator = random_generator(seed)
    cases = [(10, 2, 3), (5, 2, 3), (4, 2, 3), (6, 0, 3), (6, 3, 0), (0, 2, 2), (7, 4, 4),
             (randint(30, 60, generator), 4, randint(5, 20, generator))]
    for seq_len, n_sink, n_recent in cases:
        call = f"streaming_kept_positions({seq_len}, {n_sink}, {n_recent})"
        got = call_student(streaming_kept_positions, seq_len, n_sink, n_recent, call=call)
        want = kept_positions(seq_len, n_sink, n_recent)
        if seq_len <= n_sink + n_recent:
            shape_hints = {(min(seq_len, n_sink) + min(seq_len, n_recent),): WINDOW_HINTS["kept_duplicates"]}
        else:
            shape_hints = {(n_sink + n_recent + 1,): WINDOW_HINTS["kept_recent_off"],
                           (n_sink + n_recent - 1,): WINDOW_HINTS["kept_recent_off"]}
        expect_tensor(got, what=call, shape=want.shape, dtype=torch.long, hints=shape_hints)
        variants = []
        if seq_len > n_sink + n_recent + 1:  # tokens evicted: a recent part one too long or short shows
            variants = [(torch.cat([torch.arange(n_sink), torch.arange(seq_len - count, seq_len)]),
                         WINDOW_HINTS["kept_recent_off"]) for count in (n_recent + 1, max(0, n_recent - 1))]
        expect_exact(got, want, call, variants)
    for args in ((-1, 2, 2), (5, -1, 2), (5, 2, -3)):
        _value_error(streaming_kept_positions, f"streaming_kept_positions{args}", "a length cannot be negative", *args)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0, half: bool = False) -> torch.Tensor:
    """RoPE in float64 at ``positions`` [T] of x [..., T, d]: Meta's pairs (2j, 2j+1), or (j, j + d/2)."""
    x = _f64(x)[0]
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.to(torch.float64)[:, None] * theta  # [T, d/2]
    cos, sin = angles.cos(), angles.sin()
    if half:
        first, second = x[..., :d // 2], x[..., d // 2:]
        return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def streaming_reference(q_raw, k_raw, v, n_sink, n_recent, base=10000.0, *, key_positions: str = "cache",
                        query_position: str = "cache", kept: bool = True, half: bool = False, rotate: bool = True
                        ) -> torch.Tensor:
    """StreamingLLM's step in float64, or a mistake: keys at their "cache" or "original" positions; the query at
    "cache" (len - 1), "original" (T - 1) or "len"."""
    q_raw, k_raw, v = _f64(q_raw, k_raw, v)
    total = k_raw.shape[2]
    index = kept_positions(total, n_sink, n_recent) if kept else torch.arange(total)
    length = len(index)
    if rotate:
        keys = rope(k_raw[:, :, index], torch.arange(length) if key_positions == "cache" else index, base, half)
        at = {"cache": length - 1, "original": total - 1, "len": length}[query_position]
        query = rope(q_raw[:, :, None], torch.tensor([at]), base, half)
    else:
        keys, query = k_raw[:, :, index], q_raw[:, :, None]
    return reference_sdpa(query, keys, v[:, :, index])[:, :, 0]


def _streaming_case(streaming_decode: Callable, generator: torch.Generator, shape: tuple[int, ...], n_sink: int,
                    n_recent: int, base: float | None = None, dtype: torch.dtype = torch.float64,
                    device: Any = "cpu") -> None:
    batch, heads, total, d = shape
    q = randn(batch, heads, d, generator=generator, dtype=dtype, device=device)
    k = randn(batch, heads, total, d, generator=generator, dtype=dtype, device=device)
    v = randn(batch, heads, total, d, generator=generator, dtype=dtype, device=device)
    kwargs = {} if base is None else {"rope_base": base}
    used = 10000.0 if base is None else base
    call = (f"streaming_decode(q_raw, k_raw, v, n_sink={n_sink}, n_recent={n_recent}"
            + (f", rope_base={base:g}" if base is not None else "")
            + f") with q_raw {shape_str(q.shape)}, k_raw and v {shape_str(k.shape)} ({_dtype_name(dtype)})")
    out = call_student(streaming_decode, q, k, v, n_sink, n_recent, call=call, **kwargs)
    expect_tensor(out, what=call, shape=q.shape, dtype=dtype, device=device)
    reference = functools.partial(streaming_reference, q, k, v, n_sink, n_recent, used)
    variants = [Variant(lambda: reference(key_positions="original", query_position="original"),
                        WINDOW_HINTS["original_positions"]),
                Variant(lambda: reference(key_positions="original"), WINDOW_HINTS["keys_after_rope"]),
                Variant(lambda: reference(query_position="original"), WINDOW_HINTS["query_original_position"]),
                Variant(lambda: reference(query_position="len"), WINDOW_HINTS["query_at_len"]),
                Variant(lambda: reference(kept=False), WINDOW_HINTS["no_eviction"]),
                Variant(lambda: reference(half=True), WINDOW_HINTS["rotate_half"]),
                Variant(lambda: reference(rotate=False), WINDOW_HINTS["no_rope"])]
    expect_close(out, reference(), what=call, against="attention over the kept keys rotated at cache positions "
                 "0 ... len - 1, the query at len - 1 (float64)", variants=variants)


@check("streaming_decode: the kept keys rotated at their cache positions 0 ... len - 1, the query at len - 1; causal attention before any eviction ({device})",
       uses=("streaming_kept_positions",))
def check_streaming_decode(streaming_decode: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    expect_signature(streaming_decode, "streaming_decode", ["q_raw", "k_raw", "v", "n_sink", "n_recent", "rope_base"])
    generator = random_generator(seed)
    _streaming_case(streaming_decode, generator, (1, 2, randint(18, 30, generator), 8), 2, 5)
    _streaming_case(streaming_decode, generator, (2, 2, 6, 8), 2, 5)  # nothing evicted yet
    _streaming_case(streaming_decode, generator, (1, 3, 40, 16), 4, 8, base=500.0)
    _streaming_case(streaming_decode, generator, (2, 2, 25, 16), 4, 6, dtype=torch.float32, device=device)


# --------------------------------------------------------------------------------------
# Latent attention (MLA)
# --------------------------------------------------------------------------------------

# Sizes whose every axis differs from the others: a tensor's shape says what it is.
MLA_SIZES = {"hidden_size": 36, "n_heads": 4, "kv_lora_rank": 24, "qk_nope_dim": 12, "qk_rope_dim": 6, "v_dim": 10}


def _mla_weights(generator: torch.Generator, dtype: torch.dtype, device: Any, base: float = 10000.0) -> MLAWeights:
    return MLAWeights.random(**MLA_SIZES, rope_base=base, dtype=dtype, device=device, generator=generator)


def mla_reference_entry(x, w: MLAWeights, positions, *, norm: str = "weight", order: str = "latent_first",
                        rotate: str = "positions", half: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(latent, k_pe) in float64, or a mistake: norm "weight" / "plain" / "none"; order "latent_first" /
    "rope_first"; rotate "positions" / "index" / "none"."""
    x, w_dkv, weight = _f64(x, w.w_dkv, w.kv_norm_weight)
    compressed = x @ w_dkv.T
    rank, rope_dim = w.kv_lora_rank, w.qk_rope_dim
    if order == "latent_first":
        latent, k_pe = compressed[..., :rank], compressed[..., rank:]
    else:
        k_pe, latent = compressed[..., :rope_dim], compressed[..., rope_dim:]
    if norm != "none":
        latent = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + w.norm_eps)
        if norm == "weight":
            latent = latent * weight
    if rotate != "none":
        at = positions.cpu() if rotate == "positions" else torch.arange(x.shape[1])
        k_pe = rope(k_pe, at, w.rope_base, half)
    return latent, k_pe


def mla_reference(x, w: MLAWeights, latent, k_pe, positions, *, scale: str = "both", split: str = "per_head",
                  rotate_q: bool = True, mask: str = "bottom_right") -> torch.Tensor:
    """DeepSeek's MLA in float64 (every head's keys and values rebuilt), or a mistake: scale "both" / "rank" /
    "nope"; split "per_head" / "uv_first" / "blocks"; mask "bottom_right" / "top_left" / "none"."""
    x, latent, k_pe, w_q, w_ukv, w_o = _f64(x, latent, k_pe, w.w_q, w.w_ukv, w.w_o)
    batch, seq_q, _ = x.shape
    seq_k = latent.shape[1]
    heads, nope, rope_dim, v_dim, rank = w.n_heads, w.qk_nope_dim, w.qk_rope_dim, w.v_dim, w.kv_lora_rank
    q = (x @ w_q.T).view(batch, seq_q, heads, nope + rope_dim).transpose(1, 2)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    if rotate_q:
        q_pe = rope(q_pe, positions.cpu(), w.rope_base)
    if split == "per_head":
        per_head = w_ukv.view(heads, nope + v_dim, rank)
        w_uk, w_uv = per_head[:, :nope], per_head[:, nope:]
    elif split == "uv_first":
        per_head = w_ukv.view(heads, nope + v_dim, rank)
        w_uv, w_uk = per_head[:, :v_dim], per_head[:, v_dim:]
    else:
        w_uk, w_uv = w_ukv[:heads * nope].view(heads, nope, rank), w_ukv[heads * nope:].view(heads, v_dim, rank)
    keys = torch.cat([torch.einsum("btr,hnr->bhtn", latent, w_uk), k_pe[:, None].expand(batch, heads, seq_k, rope_dim)],
                     dim=-1)
    values = torch.einsum("btr,hvr->bhtv", latent, w_uv)
    width = {"both": nope + rope_dim, "rank": rank, "nope": nope}[scale]
    keep = {"bottom_right": window_keep(seq_q, seq_k, None), "top_left": window_keep(seq_q, seq_k, None, offset=0),
            "none": None}[mask]
    heads_out = reference_sdpa(torch.cat([q_nope, q_pe], -1), keys, values, attn_mask=keep, scale=width ** -0.5)
    return heads_out.transpose(1, 2).reshape(batch, seq_q, heads * v_dim) @ w_o.T


def _mla_variants(x, w, latent, k_pe, positions) -> list[Variant]:
    run = functools.partial(mla_reference, x, w, latent, k_pe, positions)
    variants = [Variant(lambda: run(scale="rank"), MLA_HINTS["scale_rank"]),
                Variant(lambda: run(scale="nope"), MLA_HINTS["scale_nope"]),
                Variant(lambda: run(split="uv_first"), MLA_HINTS["uv_first"]),
                Variant(lambda: run(split="blocks"), MLA_HINTS["split_not_per_head"]),
                Variant(lambda: run(rotate_q=False), MLA_HINTS["q_no_rope"]),
                Variant(lambda: run(mask="top_left"), MLA_HINTS["causal_top_left"]),
                Variant(lambda: run(mask="none"), MLA_HINTS["not_causal"])]
    return variants


def _mla_inputs(generator: torch.Generator, w: MLAWeights, batch: int, seq_k: int, positions: torch.Tensor,
                dtype: torch.dtype, device: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x of the last len(positions) tokens and the cache of all seq_k tokens (the cache computed here)."""
    tokens = randn(batch, seq_k, w.hidden_size, generator=generator)
    latent, k_pe = mla_reference_entry(tokens, w, torch.arange(seq_k))
    x = tokens[:, seq_k - len(positions):]
    return x.to(device, dtype), latent.to(device, dtype), k_pe.to(device, dtype)


def _pristine(w: MLAWeights) -> MLAWeights:
    """A copy of the weights for the student's call: the check's own are never handed over (nor read back)."""
    return MLAWeights(**{name: getattr(w, name).clone() for name in ("w_q", "w_dkv", "kv_norm_weight", "w_ukv", "w_o")},
                      **{name: getattr(w, name) for name in ("n_heads", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim",
                                                             "v_dim", "rope_base", "norm_eps")})


def _mla_call(fn: Callable, name: str, x, w, latent, k_pe, positions, probes_: Sequence[Probe] = ()) -> tuple[Any, str]:
    call = (f"{name}(x, w, latent, k_pe, positions) with x {shape_str(x.shape)}, latent {shape_str(latent.shape)}, "
            f"k_pe {shape_str(k_pe.shape)}, positions {positions.tolist()} ({_dtype_name(x.dtype)}; w: H={w.n_heads}, "
            f"kv_lora_rank={w.kv_lora_rank}, qk_nope_dim={w.qk_nope_dim}, qk_rope_dim={w.qk_rope_dim}, "
            f"v_dim={w.v_dim})")
    return call_student(fn, x, _pristine(w), latent, k_pe, positions, call=call, probes=probes_), call


@check("mla_cache_entry: latent [B, T, kv_lora_rank] RMS-normed with its weight, k_pe [B, T, qk_rope_dim] rotated at the positions; no head axis ({device})")
def check_mla_cache_entry(mla_cache_entry: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    expect_signature(mla_cache_entry, "mla_cache_entry", ["x", "w", "positions"])
    generator = random_generator(seed)
    for dtype, where, positions in ((torch.float64, torch.device("cpu"), torch.arange(5)),
                                    (torch.float64, torch.device("cpu"), torch.tensor([3, 9, 10, 17, 40])),
                                    (torch.float32, device, torch.tensor([7, 8]))):
        w = _mla_weights(generator, dtype, where, base=10000.0 if dtype == torch.float64 else 500.0)
        x = randn(2, len(positions), w.hidden_size, generator=generator, dtype=dtype, device=where)
        call = (f"mla_cache_entry(x, w, positions) with x {shape_str(x.shape)}, positions {positions.tolist()} "
                f"({_dtype_name(dtype)}; kv_lora_rank={w.kv_lora_rank}, qk_rope_dim={w.qk_rope_dim}, "
                f"H={w.n_heads})")
        result = call_student(mla_cache_entry, x, _pristine(w), positions.to(where), call=call)
        expect_true(isinstance(result, tuple) and len(result) == 2,
                    f"{call} should return a pair (latent, k_pe), got {describe(result)}.")
        latent, k_pe = result
        batch, tokens = x.shape[:2]
        rank, rope_dim, heads = w.kv_lora_rank, w.qk_rope_dim, w.n_heads
        expect_tensor(latent, what=f"latent from {call}", shape=(batch, tokens, rank), dtype=dtype, device=where,
                      hints={(batch, tokens, rank + rope_dim): MLA_HINTS["cache_split"]})
        expect_tensor(k_pe, what=f"k_pe from {call}", shape=(batch, tokens, rope_dim), dtype=dtype, device=where,
                      hints={(batch, tokens, heads, rope_dim): MLA_HINTS["kpe_per_head"],
                             (batch, heads, tokens, rope_dim): MLA_HINTS["kpe_per_head"]})
        entry = functools.partial(mla_reference_entry, x, w, positions)
        expect_close(latent, entry()[0], what=f"latent from {call}", against="RMSNorm(x @ w_dkvᵀ[:, :kv_lora_rank]) · "
                     "kv_norm_weight (float64)",
                     variants=[Variant(lambda: entry(norm="none")[0], MLA_HINTS["latent_no_norm"]),
                               Variant(lambda: entry(norm="plain")[0], MLA_HINTS["latent_norm_no_weight"]),
                               Variant(lambda: entry(order="rope_first")[0], MLA_HINTS["split_order"])])
        expect_close(k_pe, entry()[1], what=f"k_pe from {call}", against="RoPE of x @ w_dkvᵀ[:, kv_lora_rank:] at "
                     "the positions (float64)",
                     variants=[Variant(lambda: entry(rotate="none")[1], MLA_HINTS["kpe_no_rope"]),
                               Variant(lambda: entry(order="rope_first")[1], MLA_HINTS["split_order"]),
                               Variant(lambda: entry(rotate="index")[1], MLA_HINTS["kpe_index_positions"]),
                               Variant(lambda: entry(half=True)[1], WINDOW_HINTS["rotate_half"])])


def _mla_attention_case(fn: Callable, name: str, generator: torch.Generator, seq_k: int, positions: torch.Tensor,
                        dtype: torch.dtype, device: Any, exact: bool = False) -> None:
    w = _mla_weights(generator, dtype, device)
    x, latent, k_pe = _mla_inputs(generator, w, 2, seq_k, positions, dtype, device)
    out, call = _mla_call(fn, name, x, w, latent, k_pe, positions.to(device))
    expect_tensor(out, what=call, shape=x.shape, dtype=dtype, device=device,
                  hints={(2, len(positions), w.n_heads * w.v_dim): "apply the output projection: heads @ w.w_oᵀ."})
    tolerances = {"rtol": 1e-10, "atol": 1e-10, "float64_internals": True} if exact else {}
    expect_close(out, mla_reference(x, w, latent, k_pe, positions), what=call,
                 against="DeepSeek's MLA with every head's keys and values rebuilt (float64)",
                 variants=_mla_variants(x, w, latent, k_pe, positions), **tolerances)


@check("mla_attention_naive: every head's keys [W_UK c ; k_pe] and values W_UV c rebuilt, scale 1/sqrt(qk_nope_dim + qk_rope_dim), causal bottom-right ({device})")
def check_mla_attention_naive(mla_attention_naive: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    expect_signature(mla_attention_naive, "mla_attention_naive", ["x", "w", "latent", "k_pe", "positions"])
    generator = random_generator(seed)
    cpu = torch.device("cpu")
    for seq_k, positions in ((5, torch.arange(5)), (7, torch.tensor([6])), (8, torch.tensor([5, 6, 7]))):
        _mla_attention_case(mla_attention_naive, "mla_attention_naive", generator, seq_k, positions, torch.float64, cpu)
    _mla_attention_case(mla_attention_naive, "mla_attention_naive", generator, 9, torch.tensor([7, 8]),
                        torch.float32, device)


@check("mla_attention_absorbed: equals the naive MLA in float64 (1e-10) for a prefill and four decoding steps ({device})")
def check_mla_attention_absorbed(mla_attention_absorbed: Callable, *, seed: int = 0,
                                 device: torch.device | None = None) -> None:
    expect_signature(mla_attention_absorbed, "mla_attention_absorbed", ["x", "w", "latent", "k_pe", "positions"])
    generator = random_generator(seed)
    cpu = torch.device("cpu")
    prompt = randint(4, 6, generator)
    _mla_attention_case(mla_attention_absorbed, "mla_attention_absorbed", generator, prompt, torch.arange(prompt),
                        torch.float64, cpu, exact=True)
    for step in range(4):
        _mla_attention_case(mla_attention_absorbed, "mla_attention_absorbed", generator, prompt + step + 1,
                            torch.tensor([prompt + step]), torch.float64, cpu, exact=True)
    _mla_attention_case(mla_attention_absorbed, "mla_attention_absorbed", generator, 9, torch.tensor([6, 7, 8]),
                        torch.float32, device)


@check("mla_attention_absorbed: no per-head key or value over the cache while decoding ([B, H, T_k, qk_nope_dim], [B, H, T_k, v_dim] in any layout)")
def check_mla_attention_absorbed_memory(mla_attention_absorbed: Callable, *, seed: int = 0,
                                        device: torch.device | None = None) -> None:
    generator = random_generator(seed)
    cpu = torch.device("cpu")
    seq_k = 11  # no other axis has this size
    for positions in (torch.tensor([10]), torch.tensor([9, 10])):
        w = _mla_weights(generator, torch.float64, cpu)
        x, latent, k_pe = _mla_inputs(generator, w, 2, seq_k, positions, torch.float64, cpu)
        per_head = 2 * w.n_heads * seq_k * min(w.qk_nope_dim, w.v_dim)
        watch = TensorWatch([[per_head, seq_k, None]])
        out, call = _mla_call(mla_attention_absorbed, "mla_attention_absorbed", x, w, latent, k_pe, positions, [watch])
        _expect_no_offence(watch, call, ["as many numbers as a per-head key or value of every cached token"],
                           [MLA_HINTS["per_head_kv"]])
        expect_tensor(out, what=call, shape=x.shape, dtype=x.dtype, device=x.device)  # the rule kept, by an answer
        expect_close(out, mla_reference(x, w, latent, k_pe, positions), what=call,
                     against="DeepSeek's MLA with every head's keys and values rebuilt (float64)",
                     variants=_mla_variants(x, w, latent, k_pe, positions))


def _mla_bytes_reference(case: tuple[int, int, int, int, int, float]) -> int:
    """Elements of [L, S·B, kv_lora_rank + qk_rope_dim] on the meta device (no memory), times the bytes, rounded
    up. One tuple, so that it is no answer a student could import."""
    layers, rank, rope_dim, seq_len, batch, size = case
    cache = torch.empty(layers, seq_len * batch, rank + rope_dim, device="meta")
    return math.ceil(cache.numel() * size)


@check("mla_cache_bytes: L · (kv_lora_rank + qk_rope_dim) · S · B · bytes, as an int rounded up")
def check_mla_cache_bytes(mla_cache_bytes: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    parameters = ["num_layers", "kv_lora_rank", "qk_rope_dim", "seq_len", "batch_size", "bytes_per_element"]
    expect_signature(mla_cache_bytes, "mla_cache_bytes", parameters)
    generator = random_generator(seed)
    cases = [(61, 512, 64, 4096, 1, 2), (1, 4, 2, 10, 1, 2), (61, 512, 64, 1, 1, 0.5), (1, 3, 2, 1, 1, 0.5),
             (27, 512, 64, 3, 5, 1)]
    for _ in range(4):
        cases.append((randint(1, 80, generator), 2 ** randint(6, 10, generator), 2 ** randint(4, 7, generator),
                      randint(1, 100000, generator), randint(1, 64, generator), [0.5, 1, 2, 4][randint(0, 3, generator)]))
    for case in cases:
        call = "mla_cache_bytes(" + ", ".join(f"{n}={v}" for n, v in zip(parameters, case)) + ")"
        got = call_student(mla_cache_bytes, *case, call=call)
        expected = _mla_bytes_reference(case)
        expect_true(isinstance(got, int) and not isinstance(got, bool),
                    f"{call} should return an int (a number of bytes), got {describe(got)}.")
        layers, rank, rope_dim, seq_len, batch, size = case
        hint = {2 * expected: MLA_HINTS["bytes_twice"],
                math.ceil(layers * rank * seq_len * batch * size): MLA_HINTS["bytes_no_rope"],
                math.floor(layers * (rank + rope_dim) * seq_len * batch * size): MLA_HINTS["bytes_floor"]}.get(got)
        expect_true(got == expected, f"{call} should be {expected:,} bytes, got {got:,}." + (_likely(hint) if hint else ""))


# --------------------------------------------------------------------------------------
# Speculative decoding: tree_attention_mask, tree_position_ids
# --------------------------------------------------------------------------------------


def tree_keep(parents: Sequence[int], prefix_len: int, *, self_visible: bool = True, ancestors: str = "all",
              prefix: bool = True) -> torch.Tensor:
    """The draft tree's mask, or a mistake: ancestors "all" / "parent" / "earlier" (every earlier node)."""
    count = len(parents)
    keep = torch.zeros(count, prefix_len + count, dtype=torch.bool)
    keep[:, :prefix_len] = prefix
    for node, parent in enumerate(parents):
        if ancestors == "earlier":
            keep[node, prefix_len:prefix_len + node] = True
        elif parent >= 0:
            if ancestors == "all":
                keep[node, prefix_len:] = keep[parent, prefix_len:] | _eye_row(parent, prefix_len, count)
            else:
                keep[node, prefix_len + parent] = True
        if self_visible:
            keep[node, prefix_len + node] = True
    return keep


def _eye_row(node: int, prefix_len: int, count: int) -> torch.Tensor:
    row = torch.zeros(count, dtype=torch.bool)
    row[node] = True
    return row


def tree_depths(parents: Sequence[int]) -> torch.Tensor:
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return torch.tensor(depths, dtype=torch.long)


def _tree_cases(generator: torch.Generator) -> list[tuple[list[int], int, str]]:
    """(parents, prefix_len, how the parents are given)."""
    grown = [-1]
    for node in range(1, randint(6, 9, generator)):
        grown.append(randint(-1, node - 1, generator))
    return [([-1, 0, 0], 1, "list"), ([-1, -1, 0, 0, 1, 2, 4], 5, "list"), ([-1, 0, 1, 2], 0, "list"),
            ([-1, -1, -1], 3, "list"), (grown, randint(0, 6, generator), "tensor")]


_BAD_PARENTS = (([0], 2, "node 0 has parent 0"), ([-1, 2, 0], 2, "node 1 has parent 2, after it"),
                ([-1, -2], 2, "node 1 has parent -2"))


def _tree_calls(fn: Callable, name: str, generator: torch.Generator):
    """``(parents, prefix_len, what fn returned, the call as text)`` for each tree of :func:`_tree_cases`."""
    for parents, prefix_len, kind in _tree_cases(generator):
        given = parents if kind == "list" else torch.tensor(parents)
        call = f"{name}({parents if kind == 'list' else f'torch.tensor({parents})'}, {prefix_len})"
        yield parents, prefix_len, call_student(fn, given, prefix_len, call=call), call


@check("tree_attention_mask: each draft node sees the prefix, its ancestors and itself, nothing else; ValueError for a parent after its child")
def check_tree_attention_mask(tree_attention_mask: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    expect_signature(tree_attention_mask, "tree_attention_mask", ["parents", "prefix_len"])
    for parents, prefix_len, got, call in _tree_calls(tree_attention_mask, "tree_attention_mask",
                                                      random_generator(seed)):
        want = tree_keep(parents, prefix_len)
        expect_tensor(got, what=call, shape=want.shape, dtype=torch.bool)
        expect_exact(got, want, call, [(tree_keep(parents, prefix_len, self_visible=False), TREE_HINTS["no_self"]),
                                       (tree_keep(parents, prefix_len, ancestors="earlier"), TREE_HINTS["siblings"]),
                                       (tree_keep(parents, prefix_len, ancestors="parent"), TREE_HINTS["parent_only"]),
                                       (tree_keep(parents, prefix_len, prefix=False), TREE_HINTS["no_prefix"]),
                                       (~want, TREE_HINTS["flipped"])])
    for parents, prefix_len, why in _BAD_PARENTS:
        _value_error(tree_attention_mask, f"tree_attention_mask({parents}, {prefix_len})",
                     f"{why}: a parent comes before its child", parents, prefix_len)
    _value_error(tree_attention_mask, "tree_attention_mask([-1, 0], -1)", "prefix_len cannot be negative", [-1, 0], -1)


@check("tree_position_ids: prefix_len + depth of each draft node (siblings share a position)")
def check_tree_position_ids(tree_position_ids: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    expect_signature(tree_position_ids, "tree_position_ids", ["parents", "prefix_len"])
    for parents, prefix_len, got, call in _tree_calls(tree_position_ids, "tree_position_ids", random_generator(seed)):
        depths = tree_depths(parents)
        expect_tensor(got, what=call, shape=depths.shape, dtype=torch.long)
        expect_exact(got, prefix_len + depths, call,
                     [(prefix_len + torch.arange(len(parents)), TREE_HINTS["positions_index"]),
                      (prefix_len + depths + 1, TREE_HINTS["positions_plus_one"]),
                      (depths, TREE_HINTS["positions_no_prefix"])])


freeze_module(__name__)
