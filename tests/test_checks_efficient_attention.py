"""Tests of notebook 06's checks (attention_lab.checks.efficient_attention), its Triton launcher and its widgets.

For every exercise: correct answers written differently from the solution pass (float32
internals on float64 input, -1e9 / finfo.min / -inf masks, einsum, exp2 with log2(e), keyword
calls, other loop shapes); the classic mistakes are rejected with the hint that names them;
every hint of the module is reached by some test here.
"""

from __future__ import annotations

import functools
import math
import os
import re
import textwrap
from pathlib import Path

import numpy as np
import torch

if not torch.cuda.is_available():  # kernels below must be defined in interpreter mode (as the setup cell does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from einops import rearrange  # noqa: E402

from attention_lab import triton_kernels  # noqa: E402
from attention_lab.checking import CheckFailure  # noqa: E402
from attention_lab.checks import efficient_attention as checks  # noqa: E402
from attention_lab.checks.efficient_attention import HINTS  # noqa: E402
from attention_lab.hint_catalog import _normalise, hint_pattern  # noqa: E402
from attention_lab.triton_kernels import TRITON_AVAILABLE, tl, triton  # noqa: E402
from attention_lab.widgets import efficient_attention as views  # noqa: E402
from tests.bridge_harness import run_both_ways  # noqa: E402
from tests.curriculum import demos_before_their_check, long_code_lines, solution_cells  # noqa: E402

# Every test twice: the checks in the student's kernel (the lab), and through the bridge (grading), where the
# course's launchers run the student's Triton kernels in the student's process.
where_checks_run = run_both_ways()

CPU = {"device": "cpu", "quiet": True}
NEG_INF = float("-inf")


def rejects(check, answer, hint_key: str, *extra, device: str = "cpu") -> str:
    with pytest.raises(CheckFailure) as failure:
        check(answer, *extra, device=device, quiet=True)
    message = str(failure.value)
    assert hint_pattern(HINTS[hint_key]).search(_normalise(message)), message  # format fields match anything
    return message


# --------------------------------------------------------------------------------------
# attention_matrix_bytes
# --------------------------------------------------------------------------------------


def bytes_prod(batch_size, num_heads, seq_len, bytes_per_element):
    return math.prod((batch_size, num_heads, seq_len, seq_len)) * bytes_per_element


def test_attention_matrix_bytes_correct_answer_passes(capsys):
    checks.check_attention_matrix_bytes(bytes_prod, device="cpu")
    checks.check_attention_matrix_bytes(lambda batch_size, num_heads, seq_len, bytes_per_element:  # np.int64 (#52)
                                        np.prod([batch_size, num_heads, seq_len, seq_len, bytes_per_element]),
                                        device="cpu")
    assert "✓ attention_matrix_bytes" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, hint", [
    (lambda batch_size, num_heads, seq_len, bytes_per_element: batch_size * seq_len ** 2 * bytes_per_element, "bytes_heads"),
    (lambda batch_size, num_heads, seq_len, bytes_per_element: num_heads * seq_len ** 2 * bytes_per_element, "bytes_batch"),
    (lambda batch_size, num_heads, seq_len, bytes_per_element: batch_size * num_heads * seq_len * bytes_per_element, "bytes_square"),
    (lambda batch_size, num_heads, seq_len, bytes_per_element: batch_size * num_heads * seq_len ** 2, "bytes_elements"),
])
def test_attention_matrix_bytes_mistakes_are_named(wrong, hint):
    rejects(checks.check_attention_matrix_bytes, wrong, hint)


def test_attention_matrix_bytes_must_be_an_int():
    with pytest.raises(CheckFailure, match="should return an int"):
        checks.check_attention_matrix_bytes(lambda batch_size, num_heads, seq_len, bytes_per_element:
                                            float(bytes_prod(batch_size, num_heads, seq_len, bytes_per_element)), **CPU)


# --------------------------------------------------------------------------------------
# chunked_attention
# --------------------------------------------------------------------------------------


def chunked_sdpa(q, k, v, chunk_size, causal=False):
    # SDPA on each chunk with an explicit mask for the chunk's rows; float32 inside.
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    pieces = []
    for start in range(0, seq_q, chunk_size):
        rows = q[:, :, start:start + chunk_size].float()
        mask = None
        if causal:
            i = torch.arange(start, start + rows.shape[2], device=q.device)
            mask = torch.arange(seq_k, device=q.device)[None] <= i[:, None] + seq_k - seq_q
        pieces.append(F.scaled_dot_product_attention(rows, k.float(), v.float(), attn_mask=mask))
    return torch.cat(pieces, 2).to(q.dtype)


def make_chunked_einsum(zero_keyless=True):
    def chunked_einsum(q, k, v, chunk_size, causal=False):
        # einsum, a -1e9 additive mask, torch.split over the query axis; a query that sees no key is multiplied by 0
        # (the -1e9 fill alone gives it the mean of every value).
        seq_q, seq_k = q.shape[-2], k.shape[-2]
        out, start = [], 0
        for rows in torch.split(q, chunk_size, dim=-2):
            scores = torch.einsum("bhqd,bhkd->bhqk", rows, k) / math.sqrt(q.shape[-1])
            sees_a_key = torch.ones(rows.shape[-2], 1, dtype=scores.dtype, device=q.device)
            if causal:
                i = torch.arange(start, start + rows.shape[-2], device=q.device)[:, None]
                j = torch.arange(seq_k, device=q.device)[None, :]
                scores = scores + (j > i + (seq_k - seq_q)).to(scores.dtype) * -1e9
                if zero_keyless:
                    sees_a_key = (i + (seq_k - seq_q) >= 0).to(scores.dtype)
            out.append(torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v) * sees_a_key)
            start += rows.shape[-2]
        return torch.cat(out, dim=-2)
    return chunked_einsum


chunked_einsum = make_chunked_einsum()


def make_chunked(bug):
    def chunked(q, k, v, chunk_size, causal=False):
        seq_q, seq_k = q.shape[-2], k.shape[-2]
        scale = 1.0 if bug == "no_scale" else q.shape[-1] ** -0.5
        stop = seq_q - chunk_size + 1 if bug == "last_chunk" else seq_q
        full_mask = torch.ones(seq_q, seq_k, dtype=torch.bool).tril(seq_k - seq_q) if bug == "full_table" else None
        outs = []
        for start in range(0, stop, chunk_size):
            rows = q[..., start:start + chunk_size, :]
            if bug == "sdpa_is_causal":
                outs.append(F.scaled_dot_product_attention(rows, k, v, is_causal=causal))
                continue
            scores = rows @ k.transpose(-1, -2) * scale
            if causal:
                first = {"chunk_rows": 0}.get(bug, start)
                offset = 0 if bug == "top_left" else seq_k - seq_q
                i = torch.arange(first, first + rows.shape[-2])[:, None]
                j = torch.arange(seq_k)[None, :]
                keep = j < i + offset if bug == "strict_mask" else j <= i + offset
                if full_mask is not None:
                    keep = full_mask[start:start + rows.shape[-2]]
                scores = scores.masked_fill(~keep, NEG_INF)
            weights = scores.softmax(-1)
            outs.append((weights if bug == "no_key_nan" else weights.nan_to_num(0.0)) @ v)
        return torch.cat(outs, dim=-2)
    return chunked


@pytest.mark.parametrize("answer", [chunked_sdpa, chunked_einsum, make_chunked(None)])
def test_chunked_attention_correct_answers_pass(answer):
    checks.check_chunked_attention(answer, **CPU)


def test_chunked_attention_that_gives_a_query_without_keys_nan_or_a_mean_is_named():
    # numbers of rows that see no key (causal, S_q > S_k): SDPA gives them 0
    message = rejects(checks.check_chunked_attention, make_chunked("no_key_nan"), "no_key_softmax_nan")
    assert "queries 0 to 17 see no key" in message and "got NaN" in message, message
    rejects(checks.check_chunked_attention, make_chunked_einsum(zero_keyless=False), "no_key_finite_fill")


@pytest.mark.parametrize("bug", ["no_scale", "top_left", "strict_mask", "sdpa_is_causal", "chunk_rows", "last_chunk",
                                 "full_table"])
def test_chunked_attention_mistakes_are_named(bug):
    message = rejects(checks.check_chunked_attention, make_chunked(bug), bug)
    if bug == "full_table":
        assert "[45, 70] tensor (with ones)" in message and "full_mask = torch.ones" in message, message


def test_float32_internals_pass_with_a_note(capsys):
    checks.check_chunked_attention(chunked_sdpa, device="cpu")
    out = capsys.readouterr().out
    assert "✓ chunked_attention" in out and out.count("accurate to float32 precision, not float64") == 1, out


def test_float64_internals_print_no_note(capsys):
    checks.check_chunked_attention(make_chunked(None), device="cpu")
    assert "note:" not in capsys.readouterr().out


# --------------------------------------------------------------------------------------
# streaming_logsumexp
# --------------------------------------------------------------------------------------


def lse_logaddexp(x, block_size):
    # logaddexp of per-block logsumexps: also one pass over blocks.
    total = torch.full(x.shape[:-1], NEG_INF, dtype=x.dtype, device=x.device)
    for block in x.split(block_size, dim=-1):
        total = torch.logaddexp(total, torch.logsumexp(block, dim=-1))
    return total


def lse_exp2(x, block_size):
    # exp2/log2 in float32, converted back to the natural log at the end.
    y = x.float() * (1 / math.log(2))
    m = y.new_full(y.shape[:-1], NEG_INF)
    s = y.new_zeros(y.shape[:-1])
    for start in range(0, y.shape[-1], block_size):
        block = y[..., start:start + block_size]
        new_m = torch.maximum(m, block.max(dim=-1).values)
        safe = new_m.masked_fill(new_m == NEG_INF, 0.0)
        s = s * torch.exp2(m - safe) + torch.exp2(block - safe.unsqueeze(-1)).sum(-1)
        m = new_m
    return ((m + torch.log2(s)) * math.log(2)).to(x.dtype)


def make_streaming(bug):
    def streaming(x, block_size):
        m = torch.full(x.shape[:-1], NEG_INF, dtype=x.dtype)
        s = torch.zeros(x.shape[:-1], dtype=x.dtype)
        if bug == "overflow":
            for start in range(0, x.shape[-1], block_size):
                s = s + x[..., start:start + block_size].exp().sum(-1)
            return s.log()
        if bug == "two_passes":
            m = x.amax(-1)
        for start in range(0, x.shape[-1], block_size):
            block = x[..., start:start + block_size]
            new_m = m if bug == "two_passes" else torch.maximum(m, block.amax(-1))
            safe = new_m if bug == "neg_inf_block" else torch.where(new_m == NEG_INF, torch.zeros_like(new_m), new_m)
            rescale = 1.0 if bug == "sum_not_rescaled" else torch.exp(m - safe)
            safe_m = torch.where(m == NEG_INF, torch.zeros_like(m), m) if bug == "two_passes" else safe
            s = s * rescale + torch.exp(block - safe_m[..., None]).sum(-1)
            m = new_m
        result = m + torch.log(s)
        return result / math.log(2) if bug == "log2" else result
    return streaming


@pytest.mark.parametrize("answer", [lse_logaddexp, lse_exp2, make_streaming(None)])
def test_streaming_logsumexp_correct_answers_pass(answer):
    checks.check_streaming_logsumexp(answer, **CPU)


@pytest.mark.parametrize("bug", ["overflow", "sum_not_rescaled", "neg_inf_block", "two_passes", "log2"])
def test_streaming_logsumexp_mistakes_are_named(bug):
    message = rejects(checks.check_streaming_logsumexp, make_streaming(bug), bug)
    if bug == "two_passes":
        assert "amax() reduced a whole row" in message and "m = x.amax(-1)" in message, message


# --------------------------------------------------------------------------------------
# online_softmax_step
# --------------------------------------------------------------------------------------


def step_float32(m, l, acc, scores_block, v_block):
    # Hugging Face style: float32 inside, back to the input dtype; in-place updates.
    dtype = acc.dtype
    m32, l32, acc32 = m.float(), l.float(), acc.float()
    m_new = torch.max(m32, scores_block.float().max(dim=-1).values)
    alpha = (m32 - m_new).exp()
    p = (scores_block.float() - m_new.unsqueeze(-1)).exp()
    l32.mul_(alpha).add_(p.sum(-1))
    acc32.mul_(alpha.unsqueeze(-1)).add_(torch.einsum("...qk,...kd->...qd", p, v_block.float()))
    return m_new.to(dtype), l32.to(dtype), acc32.to(dtype)


def step_exp2(m, l, acc, scores_block, v_block):
    # exp2 with explicit log2(e) factors (the Triton tutorial's arithmetic), natural units in and out.
    log2e = 1.4426950408889634
    m_new = torch.maximum(m, scores_block.amax(-1))
    alpha = torch.exp2((m - m_new) * log2e)
    p = torch.exp2((scores_block - m_new[..., None]) * log2e)
    return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + p @ v_block


def make_step(bug):
    def step(m, l, acc, scores_block, v_block):
        block_max = scores_block.amax(-1)
        m_new = block_max if bug == "block_max_only" else torch.maximum(m, block_max)
        alpha = torch.exp(m - m_new)
        reference = m if bug == "old_max_in_exp" else m_new
        p = torch.exp(scores_block - reference[..., None])
        l_new = (l if bug == "no_rescale_l" else l * alpha) + p.sum(-1)
        acc_new = (acc if bug == "no_rescale_acc" else acc * alpha[..., None]) + p @ v_block
        if bug == "normalise_inside":
            acc_new = acc_new / l_new[..., None]
        return (m if bug == "stale_max" else m_new), l_new, acc_new
    return step


@pytest.mark.parametrize("answer", [step_float32, step_exp2, make_step(None)])
def test_online_softmax_step_correct_answers_pass(answer):
    checks.check_online_softmax_step(answer, **CPU)


@pytest.mark.parametrize("bug", ["no_rescale_acc", "no_rescale_l", "stale_max", "old_max_in_exp", "block_max_only",
                                 "normalise_inside"])
def test_online_softmax_step_mistakes_are_named(bug):
    rejects(checks.check_online_softmax_step, make_step(bug), bug)


def test_online_softmax_step_must_return_three_tensors():
    with pytest.raises(CheckFailure, match=r"should return the tuple \(m, l, acc\)"):
        checks.check_online_softmax_step(lambda m, l, acc, scores_block, v_block: acc, **CPU)


# --------------------------------------------------------------------------------------
# flash_attention_forward
# --------------------------------------------------------------------------------------


def make_flash(bug=None, step=None, base2=False, work=None):
    """A tiled pass; ``bug`` plants one classic mistake; ``base2`` computes with exp2 and log2(e); ``work`` forces
    the compute dtype."""
    step = step or make_step(None)

    def flash(q, k, v, block_q=64, block_k=64, causal=False, scale=None):
        causal = causal and bug != "causal_ignored"
        seq_q, seq_k = q.shape[-2], k.shape[-2]
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        dtype = work or torch.promote_types(q.dtype, torch.float32)
        offset = 0 if bug == "top_left" else seq_k - seq_q
        outs, lses = [], []
        for q0 in range(0, seq_q, block_q):
            qb = q[..., q0:q0 + block_q, :].to(dtype)
            q1 = q0 + qb.shape[-2]
            m = torch.full(qb.shape[:-1], NEG_INF, dtype=dtype)
            l = torch.zeros_like(m)
            acc = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=dtype)
            unscaled = []  # only for the planted "lse of unscaled scores" mistake
            stop = seq_k
            if causal and bug != "future_blocks":
                stop = min(seq_k, q1 + offset)
                if bug == "skip_diagonal":
                    stop = max(0, q0 + offset + 1 - block_k + 1)
                elif bug == "bound_no_offset":
                    stop = min(seq_k, q1)
                elif bug == "bound_inclusive":
                    stop = min(seq_k, q1 - 1 + offset)
            for k0 in range(0, stop, block_k):
                kb = k[..., k0:k0 + block_k, :].to(dtype)
                s = torch.einsum("bhqd,bhkd->bhqk", qb, kb) * scale
                if causal:
                    i = torch.arange(q0, q1)[:, None]
                    j = torch.arange(k0, k0 + kb.shape[-2])[None, :]
                    keep = (j < i + offset) if bug == "strict_mask" else (j <= i + offset)
                    s = s.masked_fill(~keep, NEG_INF)
                unscaled.append(s / scale)
                if base2:
                    s = s * (1 / math.log(2))
                m_new = torch.maximum(m, s.amax(-1))
                p = torch.exp2(s - m_new[..., None]) if base2 else torch.exp(s - m_new[..., None])
                alpha = torch.exp2(m - m_new) if base2 else torch.exp(m - m_new)
                if base2:
                    l = l * alpha + p.sum(-1)
                    acc = acc * alpha[..., None] + p @ v[..., k0:k0 + block_k, :].to(dtype)
                    m = m_new
                elif bug in ("normalise_terms", "normalise_reset"):  # two other ways to normalise inside the loop
                    l = l * alpha + p.sum(-1)
                    terms = p @ v[..., k0:k0 + block_k, :].to(dtype)
                    if bug == "normalise_terms":
                        acc = acc * alpha[..., None] + terms / l[..., None]
                    else:
                        acc = (acc * alpha[..., None] + terms) / l[..., None]
                        l = torch.ones_like(l)
                    m = m_new
                else:
                    m, l, acc = step(m, l, acc, s, v[..., k0:k0 + block_k, :].to(dtype))
            out_block = acc if bug == "normalise_terms" else acc / l[..., None]
            if bug != "no_key_nan":  # a query that saw no key: out 0 (and lse -inf below), as SDPA
                out_block = torch.where(l[..., None] > 0, out_block, 0.0)
            outs.append(out_block)
            if base2:
                lse = (m + torch.log2(l)) * math.log(2)
            elif bug == "lse_log2":
                lse = (m + torch.log(l)) / math.log(2)
            elif bug == "lse_mixed":
                lse = m + torch.log2(l)
            elif bug == "lse_no_max":
                lse = torch.log(l)
            elif bug == "lse_unscaled":
                lse = torch.logsumexp(torch.cat(unscaled, dim=-1), dim=-1)
            else:
                lse = m + torch.log(l)
            lses.append(lse if bug == "no_key_nan" else torch.where(l > 0, lse, NEG_INF))
        return torch.cat(outs, -2).to(q.dtype), torch.cat(lses, -1)
    return flash


def make_rearranged(flag_keyless=True):
    def flash(q, k, v, block_q=64, block_k=64, causal=False, scale=None):
        return rearranged_pass(q, k, v, block_q, block_k, causal, scale, flag_keyless)
    return flash


def rearranged_pass(q, k, v, block_q, block_k, causal, scale, flag_keyless):
    # while loops, einops, finfo.min masking, lse returned as float32; a flag per row says whether it saw a key (the
    # finite fill alone would give a query that sees none the mean of the values it was shown).
    b, h, seq_q, d = q.shape
    seq_k = k.shape[2]
    scale = scale or 1 / math.sqrt(d)
    q2, k2, v2 = (rearrange(t, "b h s d -> (b h) s d").double() for t in (q, k, v))
    outs, lses = [], []
    q0 = 0
    while q0 < seq_q:
        rows = q2[:, q0:q0 + block_q]
        n = rows.shape[1]
        m = torch.full((b * h, n), -torch.inf, dtype=torch.float64)
        l = torch.zeros(b * h, n, dtype=torch.float64)
        acc = torch.zeros(b * h, n, v.shape[-1], dtype=torch.float64)
        saw_a_key = torch.zeros(n, dtype=torch.bool) if causal else torch.ones(n, dtype=torch.bool)
        k0 = 0
        while k0 < seq_k and (not causal or k0 <= q0 + n - 1 + seq_k - seq_q):
            s = torch.bmm(rows, k2[:, k0:k0 + block_k].transpose(1, 2)) * scale
            if causal:
                keep = (torch.arange(k0, k0 + s.shape[-1])[None, :]
                        <= torch.arange(q0, q0 + n)[:, None] + seq_k - seq_q)
                s = torch.where(keep, s, torch.finfo(s.dtype).min)
                saw_a_key = saw_a_key | keep.any(-1)
            m, l, acc = make_step(None)(m, l, acc, s, v2[:, k0:k0 + block_k])
            k0 += block_k
        if not flag_keyless:  # guarded by l alone: the finite fill gives a query that sees no key l > 0
            saw_a_key = (l > 0).all(0)
        outs.append(torch.where(saw_a_key[:, None], acc / l[..., None], 0.0))
        lses.append(torch.where(saw_a_key, m + l.log(), -torch.inf))
        q0 += block_q
    out = rearrange(torch.cat(outs, 1), "(b h) s d -> b h s d", b=b).to(q.dtype)
    return out, rearrange(torch.cat(lses, 1), "(b h) s -> b h s", b=b).float()


flash_rearranged = make_rearranged()


@pytest.mark.parametrize("answer", [make_flash(), make_flash(step=step_float32), make_flash(base2=True), flash_rearranged])
def test_flash_attention_forward_correct_answers_pass(answer):
    checks.check_flash_attention_forward(answer, **CPU)
    checks.check_flash_attention_forward_memory(answer, **CPU)


@pytest.mark.parametrize("bug", ["top_left", "strict_mask", "skip_diagonal", "lse_log2", "lse_mixed", "lse_no_max",
                                 "lse_unscaled", "bound_no_offset", "bound_inclusive", "causal_ignored"])
def test_flash_attention_forward_mistakes_are_named(bug):
    rejects(checks.check_flash_attention_forward, make_flash(bug), bug)


def test_flash_attention_forward_that_gives_a_query_without_keys_nan_or_a_mean_is_named():
    message = rejects(checks.check_flash_attention_forward, make_flash("no_key_nan"), "no_key_flash_nan")
    assert "queries 0 to 20 see no key" in message, message
    rejects(checks.check_flash_attention_forward, make_rearranged(flag_keyless=False), "no_key_finite_fill")


@pytest.mark.parametrize("bug", ["normalise_terms", "normalise_reset"])
def test_flash_attention_forward_that_normalises_inside_the_loop_otherwise_is_named(bug):
    # numbers only before (issue #34)
    rejects(checks.check_flash_attention_forward, make_flash(bug), "normalise_inside")


@pytest.mark.parametrize("bug", ["no_rescale_acc", "no_rescale_l", "stale_max", "normalise_inside"])
def test_flash_attention_forward_names_the_step_it_is_built_on(bug):
    rejects(checks.check_flash_attention_forward, make_flash(step=make_step(bug)), bug)


def flash_in_a_notebook(step_bug=None, flash_bug=None) -> dict:
    """A notebook's namespace: its own online_softmax_step and a flash_attention_forward that calls it by name."""
    namespace = {"make_flash": make_flash, "online_softmax_step": make_step(step_bug)}
    exec(textwrap.dedent(f"""
        def flash_attention_forward(q, k, v, block_q=64, block_k=64, causal=False, scale=None):
            return make_flash({flash_bug!r}, step=online_softmax_step)(q, k, v, block_q, block_k, causal, scale)
    """), namespace)
    return namespace


def test_flash_names_the_failing_online_softmax_step_it_uses():
    flash = flash_in_a_notebook(step_bug="no_rescale_acc")["flash_attention_forward"]
    message = rejects(checks.check_flash_attention_forward, flash, "no_rescale_acc")
    assert "uses your online_softmax_step, which fails its own check" in message, message
    assert "Fix online_softmax_step first" in message, message


def test_flash_does_not_blame_a_correct_online_softmax_step():
    flash = flash_in_a_notebook(flash_bug="top_left")["flash_attention_forward"]
    message = rejects(checks.check_flash_attention_forward, flash, "top_left")
    assert "online_softmax_step" not in message, message


def in_float32(answer):
    """The same answer computed in float32 inside, given and returning float64 (``x.float() ... .to(x.dtype)``)."""
    @functools.wraps(answer)  # keeps the signature the check asks for
    def float32_inside(*args, **kwargs):
        dtype = args[0].dtype
        args = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
        result = answer(*args, **kwargs)
        if isinstance(result, tuple):
            return tuple(t.to(dtype) for t in result)
        return result.to(dtype)
    return float32_inside


@pytest.mark.parametrize("bug", ["no_rescale_acc", "normalise_inside", "top_left", "lse_log2"])
def test_flash_mistakes_are_named_with_float32_internals(bug):
    """The float32 leniency does not hide a mistake, nor its hint, when the wrong answer computes in float32."""
    answer = make_flash(step=make_step(bug)) if bug in ("no_rescale_acc", "normalise_inside") else make_flash(bug)
    rejects(checks.check_flash_attention_forward, in_float32(answer), bug)


@pytest.mark.parametrize("bug", ["no_rescale_l", "old_max_in_exp", "stale_max"])
def test_online_softmax_step_mistakes_are_named_with_float32_internals(bug):
    rejects(checks.check_online_softmax_step, in_float32(make_step(bug)), bug)


@pytest.mark.parametrize("bug", ["top_left", "chunk_rows"])
def test_chunked_attention_mistakes_are_named_with_float32_internals(bug):
    rejects(checks.check_chunked_attention, in_float32(make_chunked(bug)), bug)


def test_correct_answers_with_float32_internals_pass_with_one_note(capsys):
    checks.check_flash_attention_forward(in_float32(make_flash()), device="cpu")
    checks.check_online_softmax_step(in_float32(make_step(None)), device="cpu")
    out = capsys.readouterr().out
    assert out.count("accurate to float32 precision, not float64") == 2, out


def test_flash_without_scale_is_named():
    def unscaled(q, k, v, block_q=64, block_k=64, causal=False, scale=None):
        return make_flash()(q, k, v, block_q, block_k, causal, scale=1.0)
    rejects(checks.check_flash_attention_forward, unscaled, "no_scale")


def test_flash_that_loses_a_ragged_block_is_named():
    def loses_last_key_block(q, k, v, block_q=64, block_k=64, causal=False, scale=None):
        usable = k.shape[-2] - k.shape[-2] % block_k or k.shape[-2]
        return make_flash()(q, k[..., :usable, :], v[..., :usable, :], block_q, block_k, causal, scale)
    message = rejects(checks.check_flash_attention_forward, loses_last_key_block, "block_dependent")
    assert "block_q=16, block_k=32" in message, message


def test_flash_with_a_wrong_merge_is_named():
    def lse_off_by_a_constant(q, k, v, block_q=64, block_k=64, causal=False, scale=None):
        out, lse = make_flash()(q, k, v, block_q, block_k, causal, scale)
        return out, lse + (0.5 if k.shape[-2] == 23 else 0.0)  # only the second half of the merge test is wrong
    rejects(checks.check_flash_attention_forward, lse_off_by_a_constant, "merge")


def test_flash_that_masks_future_blocks_instead_of_skipping_them():
    message = rejects(checks.check_flash_attention_forward_memory, make_flash("future_blocks"), "future_blocks")
    # One unit per sentence (issue #34: "72 tile products ... only 21 of the 36 tiles"): tiles.
    assert "computed 36 [16, 16] tiles of scores" in message and "Only 21 of the 36 tiles" in message, message
    assert "products" not in message.split("Likely mistake")[0], message


def test_flash_built_on_query_chunks_is_not_flash():
    def chunk_rows(q, k, v, block_q=64, block_k=64, causal=False, scale=None):
        return make_flash()(q, k, v, block_q, k.shape[-2], causal, scale)  # one key block: [block_q, S_k] scores
    with pytest.raises(CheckFailure, match=r"built a \[1, 3, 16, 80\] tensor \(with einsum\)"):
        checks.check_flash_attention_forward_memory(chunk_rows, **CPU)


def forward_in_numpy(q, k, v, block_q=64, block_k=64, causal=False, scale=None):
    """Right numbers, computed in NumPy on the whole table: no tile (nor table) the checks' watch can see."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_, k_, v_ = (t.detach().cpu().double().numpy() for t in (q, k, v))
    s = q_ @ np.swapaxes(k_, -1, -2) * scale
    if causal:
        s = np.where(np.arange(k.shape[-2])[None, :] <= np.arange(q.shape[-2])[:, None] + k.shape[-2] - q.shape[-2],
                     s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - m)
    lse = m[..., 0] + np.log(e.sum(-1))
    return torch.from_numpy(e / e.sum(-1, keepdims=True) @ v_).to(q.dtype), torch.from_numpy(lse).to(q.dtype)


def test_flash_without_tiles_does_not_skip_future_tiles():
    """Its count of skipped tiles was satisfied by zero tiles (issue #52)."""
    message = rejects(checks.check_flash_attention_forward_memory, forward_in_numpy, "no_tiles")
    assert "causal=False) with S = 96 computed 0 products of a [16, 16] tile's shape" in message, message


def test_flash_contract_messages():
    with pytest.raises(CheckFailure, match=r"should return the tuple \(out, lse\)"):
        checks.check_flash_attention_forward(lambda q, k, v, block_q=64, block_k=64, causal=False, scale=None:
                                             F.scaled_dot_product_attention(q, k, v), **CPU)
    with pytest.raises(CheckFailure, match="lse has one number per query row"):
        checks.check_flash_attention_forward(
            lambda q, k, v, block_q=64, block_k=64, causal=False, scale=None:
            (lambda out, lse: (out, lse[..., None]))(*make_flash()(q, k, v, block_q, block_k, causal, scale)), **CPU)
    with pytest.raises(CheckFailure, match=r"parameters \(q, k, v, block_q, block_k, causal, scale\)"):
        checks.check_flash_attention_forward(lambda q, k, v, causal=False: None, **CPU)


def test_the_emulated_loop_is_exact_without_a_bug():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=generator, dtype=torch.float64) for n in (29, 45, 45))
    out, lse = checks.tiled_attention(q, k, v, causal=True, scale=0.3, block_q=8, block_k=16)
    want_out, want_lse = checks.reference_attention(q, k, v, True, 0.3)
    assert torch.allclose(out, want_out) and torch.allclose(lse, want_lse)


# --------------------------------------------------------------------------------------
# flash_attention_backward and FlashAttention
# --------------------------------------------------------------------------------------


def make_backward(bug=None, queries_outside=False, work=None, elementwise=False):
    """A tiled backward pass (FlashAttention-2's order: key blocks outside; ``queries_outside``: the other order);
    ``bug`` plants one classic mistake; ``work`` forces the compute dtype (float32 inside on float64 input);
    ``elementwise``: each tile's scores as a broadcast product summed over d, not a matmul."""

    def backward(q, k, v, out, lse, dout, block_q=64, block_k=64, causal=False, scale=None):
        seq_q, seq_k = q.shape[-2], k.shape[-2]
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        dtype = work or torch.promote_types(q.dtype, torch.float32)
        q_, k_, v_, o_, do_, lse_ = (t.to(dtype) for t in (q, k, v, out, dout, lse))
        if bug == "lse_recomputed":  # the row's max and sum again, block by block: the given lse never read
            lse_ = own_lse(q_, k_, block_k, causal, scale)
        if bug != "no_key_nan":  # a query that sees no key: lse = -inf, P = exp(-inf - 0) = 0
            lse_ = lse_.masked_fill(lse_ == NEG_INF, 0.0)
        offset = 0 if bug == "top_left" else seq_k - seq_q
        delta = (do_ * (do_ if bug == "D_dout" else o_)).sum(-1)
        if bug == "no_D":
            delta = torch.zeros_like(delta)
        if bug == "D_two_pass":  # D = Σ_j P_ij dP_ij over every key, in a first pass over the tiles: out never read
            delta = torch.zeros_like(delta)
            for k0 in range(0, seq_k, block_k):
                s = q_ @ k_[..., k0:k0 + block_k, :].mT * scale
                if causal:
                    keep = torch.arange(k0, min(seq_k, k0 + block_k))[None, :] <= torch.arange(seq_q)[:, None] + offset
                    s = s.masked_fill(~keep, NEG_INF)
                delta += (torch.exp(s - lse_[..., None]) * (do_ @ v_[..., k0:k0 + block_k, :].mT)).sum(-1)
        dq, dk, dv = torch.zeros_like(q_), torch.zeros_like(k_), torch.zeros_like(v_)
        tiles = [(q0, k0) for k0 in range(0, seq_k, block_k) for q0 in range(0, seq_q, block_q)]
        if queries_outside:
            tiles.sort()
        started = set()  # key blocks whose query loop has started
        for q0, k0 in tiles:
            q1, k1 = min(seq_q, q0 + block_q), min(seq_k, k0 + block_k)
            if causal and bug != "future_blocks" and k0 > q1 - 1 + seq_k - seq_q:
                continue
            if causal and bug == "late_queries" and k0 not in started:  # the query loop starts one block late
                started.add(k0)
                continue
            if elementwise:
                s = (q_[..., q0:q1, None, :] * k_[..., None, k0:k1, :]).sum(-1) * scale
            else:
                s = torch.einsum("bhqd,bhkd->bhqk", q_[..., q0:q1, :], k_[..., k0:k1, :]) * scale
            if causal and bug != "no_mask":
                keep = torch.arange(k0, k1)[None, :] <= torch.arange(q0, q1)[:, None] + offset
                s = s.masked_fill(~keep, NEG_INF)
            if bug == "no_lse":
                p = s.exp()
            elif bug == "exp2_natural":
                p = torch.exp2(s - lse_[..., q0:q1, None])
            elif bug == "tile_softmax":
                p = torch.softmax(s, -1).nan_to_num(0.0)
            else:
                p = torch.exp(s - lse_[..., q0:q1, None])
            dp = do_[..., q0:q1, :] @ v_[..., k0:k1, :].mT
            ds = p * (dp - ((p * dp).sum(-1, keepdim=True) if bug == "D_tile" else delta[..., q0:q1, None]))
            factor = 1.0 if bug == "no_scale" else scale
            dv[..., k0:k1, :] += (p if bug == "P_not_transposed" else p.mT) @ do_[..., q0:q1, :]
            dq[..., q0:q1, :] += factor * ds @ k_[..., k0:k1, :]
            dk[..., k0:k1, :] += factor * (ds if bug == "dS_not_transposed" else ds.mT) @ q_[..., q0:q1, :]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    return backward


def own_lse(q, k, block_k, causal, scale):
    """The logsumexp of every query's scores, by an online pass over the key blocks: what the given lse holds."""
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    rows = torch.arange(seq_q)[:, None]
    m = torch.full(q.shape[:-1], NEG_INF, dtype=q.dtype)
    total = torch.zeros_like(m)
    for k0 in range(0, seq_k, block_k):
        s = q @ k[..., k0:k0 + block_k, :].mT * scale
        if causal:
            s = s.masked_fill(torch.arange(k0, k0 + s.shape[-1])[None, :] > rows + seq_k - seq_q, NEG_INF)
        new = torch.maximum(m, s.amax(-1))
        safe = new.masked_fill(new == NEG_INF, 0.0)
        total = total * torch.exp(m - safe) + torch.exp(s - safe[..., None]).sum(-1)
        m = new
    return torch.where(total > 0, m + total.log(), NEG_INF)


def backward_by_autograd(q, k, v, out, lse, dout, block_q=64, block_k=64, causal=False, scale=None):
    """The numbers without the exercise: autograd through SDPA (causal_lower_right, as the notebook names it)."""
    from torch.nn.attention.bias import causal_lower_right

    with torch.enable_grad():
        q_, k_, v_ = (t.detach().float().requires_grad_(True) for t in (q, k, v))
        mask = causal_lower_right(q.shape[-2], k.shape[-2]) if causal else None
        o = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=scale)
        return tuple(g.to(q.dtype) for g in torch.autograd.grad(o, (q_, k_, v_), dout.float()))


def backward_in_numpy(q, k, v, out, lse, dout, block_q=64, block_k=64, causal=False, scale=None):
    """The recipe from out and lse, right, computed in NumPy on the whole table: no tile the checks can see."""
    import numpy as np

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_, k_, v_, o_, lse_, do_ = (t.detach().cpu().double().numpy() for t in (q, k, v, out, lse, dout))
    s = q_ @ np.swapaxes(k_, -1, -2) * scale
    if causal:
        s = np.where(np.arange(k.shape[-2])[None, :] <= np.arange(q.shape[-2])[:, None] + k.shape[-2] - q.shape[-2],
                     s, -np.inf)
    finite = np.isfinite(lse_)[..., None]
    p = np.where(finite, np.exp(s - np.where(finite, lse_[..., None], 0.0)), 0.0)
    ds = p * (do_ @ np.swapaxes(v_, -1, -2) - (do_ * o_).sum(-1, keepdims=True))
    grads = scale * ds @ k_, scale * np.swapaxes(ds, -1, -2) @ q_, np.swapaxes(p, -1, -2) @ do_
    return tuple(torch.from_numpy(g).to(q.dtype) for g in grads)


@pytest.mark.parametrize("answer", [make_backward(), make_backward(queries_outside=True),
                                    make_backward(work=torch.float32), make_backward(elementwise=True)])
def test_flash_attention_backward_correct_answers_pass(answer):
    checks.check_flash_attention_backward(answer, **CPU)
    checks.check_flash_attention_backward_memory(answer, **CPU)


@pytest.mark.parametrize("bug, hint", [("D_dout", "bwd_D_dout"), ("no_D", "bwd_no_D"), ("no_scale", "bwd_no_scale"),
                                       ("no_lse", "bwd_no_lse"), ("tile_softmax", "bwd_tile_softmax"),
                                       ("dS_not_transposed", "bwd_dS_not_transposed"),
                                       ("P_not_transposed", "bwd_P_not_transposed"), ("no_mask", "bwd_no_mask"),
                                       ("top_left", "bwd_top_left"), ("D_tile", "bwd_D_tile"),
                                       ("late_queries", "bwd_late_queries"), ("exp2_natural", "bwd_exp2_natural")])
def test_flash_attention_backward_mistakes_are_named(bug, hint):
    rejects(checks.check_flash_attention_backward, make_backward(bug), hint)


def test_flash_attention_backward_that_spreads_nan_from_a_query_without_keys_is_named():
    message = rejects(checks.check_flash_attention_backward, make_backward("no_key_nan"), "no_key_bwd_nan")
    assert "[1, 2, 40, 8], k and v [1, 2, 19, 8]" in message, message


def test_flash_attention_backward_mistakes_are_named_with_float32_internals():
    rejects(checks.check_flash_attention_backward, make_backward("no_D", work=torch.float32), "bwd_no_D")


def test_flash_attention_backward_that_computes_every_tile():
    message = rejects(checks.check_flash_attention_backward_memory, make_backward("future_blocks"), "bwd_future_blocks")
    assert "computed 36 [16, 16] tiles of scores, as many as the non-causal pass. Only 21 of the 36 tiles" in message, \
        message


def test_flash_attention_backward_by_autograd_is_named_by_its_rule():
    """Autograd through SDPA passed both checks (issue #52)."""
    rejects(checks.check_flash_attention_backward, backward_by_autograd, "bwd_autograd")


@pytest.mark.parametrize("bug, hint", [("lse_recomputed", "bwd_lse_recomputed"),
                                       ("D_two_pass", "bwd_delta_recomputed")])
def test_flash_attention_backward_must_use_the_out_and_lse_it_is_given(bug, hint):
    """Right numbers without the method: given a changed out, then a shifted lse, the gradients must change as the
    formula says (the checker's own inputs and comparison, whatever the kernel reports)."""
    message = rejects(checks.check_flash_attention_backward, make_backward(bug), hint)
    assert "given lse + a known constant per query row" in message or "given out + a known change" in message


def test_flash_attention_backward_without_tiles_does_not_skip_future_tiles():
    """A pass with no tile at all: its "skipped" count was satisfied by zero tiles (issue #52)."""
    message = rejects(checks.check_flash_attention_backward_memory, backward_in_numpy, "bwd_no_tiles")
    assert "causal=False) with S = 96 computed 0 products of a [16, 16] tile's shape" in message, message


def test_flash_attention_backward_through_the_whole_table_is_not_flash():
    def dense(q, k, v, out, lse, dout, block_q=64, block_k=64, causal=False, scale=None):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        p = torch.exp(q @ k.mT * scale - lse[..., None])  # [S_q, S_k]
        dp = dout @ v.mT
        ds = p * (dp - (dout * out).sum(-1, keepdim=True))
        return scale * ds @ k, scale * ds.mT @ q, p.mT @ dout

    with pytest.raises(CheckFailure, match=r"built a \[1, 3, 48, 80\] tensor"):
        checks.check_flash_attention_backward_memory(dense, **CPU)


FUNCTION_CELL = """
class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal=False):
        out, lse = flash_attention_forward(q, k, v, causal=causal)
        if save == "P":
            ctx.save_for_backward(q, k, v, out, lse, torch.softmax(q @ k.mT, -1))
        elif save == "attribute":
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.weights = torch.softmax(q @ k.mT, -1)
        elif save == "no_lse":
            ctx.save_for_backward(q, k, v, out)
        elif save == "lse_base2":
            ctx.save_for_backward(q, k, v, out, lse / math.log(2))
        else:
            ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out = ctx.saved_tensors[:4]
        lse = ctx.saved_tensors[4] if save != "no_lse" else torch.logsumexp(q @ k.mT * q.shape[-1] ** -0.5, -1)
        if save == "lse_base2":
            lse = lse * math.log(2)
        dq, dk, dv = flash_attention_backward(q, k, v, out, lse, dout, causal=ctx.causal if causal_kept else False)
        return (dq, dk, dv, None)[:grads]
"""

SDPA_FUNCTION_CELL = """
class FlashAttention(torch.autograd.Function):
    \"\"\"The numbers of FlashAttention without either pass: SDPA and a masked logsumexp forward, autograd backward.\"\"\"

    @staticmethod
    def forward(ctx, q, k, v, causal=False):
        mask = causal_lower_right(q.shape[-2], k.shape[-2]) if causal else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        scores = q @ k.mT * q.shape[-1] ** -0.5
        if causal:
            keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(k.shape[-2] - q.shape[-2])
            scores = scores.masked_fill(~keep, float("-inf"))
        ctx.save_for_backward(q, k, v, out, torch.logsumexp(scores, -1))
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_(True) for t in (q, k, v))
            mask = causal_lower_right(q.shape[-2], k.shape[-2]) if ctx.causal else None
            o = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask)
            return (*torch.autograd.grad(o, (q_, k_, v_), dout), None)
"""


def make_function(save="right", grads=4, causal_kept=True, forward_bug=None, cell=FUNCTION_CELL):
    """A FlashAttention cell run in a notebook of its own: its flash_attention_forward and flash_attention_backward
    are that notebook's globals (the check traces calls of them)."""
    from torch.nn.attention.bias import causal_lower_right

    notebook = {"torch": torch, "F": F, "math": math, "causal_lower_right": causal_lower_right,
                "flash_attention_forward": make_flash(forward_bug), "flash_attention_backward": make_backward(),
                "save": save, "grads": grads, "causal_kept": causal_kept}
    exec(cell, notebook)
    return notebook["FlashAttention"]


def test_flash_attention_function_passes_gradcheck(capsys):
    checks.check_flash_attention_function(make_function(), device="cpu")
    assert "✓ FlashAttention" in capsys.readouterr().out


@pytest.mark.parametrize("save", ["P", "attribute", "no_lse"])
def test_flash_attention_function_that_saves_other_tensors_is_named(save):
    rejects(checks.check_flash_attention_function, make_function(save=save), "bwd_saved")


@pytest.mark.parametrize("function, hint", [(make_function(causal_kept=False), "bwd_causal_not_kept"),
                                            (make_function(forward_bug="causal_ignored"), "causal_ignored")])
def test_flash_attention_function_that_loses_causal_is_named(function, hint):
    rejects(checks.check_flash_attention_function, function, hint)  # numbers only before (issue #34)


def test_flash_attention_function_with_too_few_gradients_is_named():
    rejects(checks.check_flash_attention_function, make_function(grads=3), "bwd_gradients")


def test_flash_attention_function_must_run_the_notebooks_two_passes():
    """SDPA and a masked logsumexp forward, autograd backward: FlashAttention's numbers, neither pass (issue #52)."""
    message = rejects(checks.check_flash_attention_function, make_function(cell=SDPA_FUNCTION_CELL), "function_passes")
    assert "never called your flash_attention_forward" in message, message


def test_flash_attention_function_whose_backward_skips_the_backward_pass_is_named():
    cell = FUNCTION_CELL.replace("dq, dk, dv = flash_attention_backward(", "dq, dk, dv = by_autograd(")
    function = make_function(cell=cell)
    function.forward.__globals__["by_autograd"] = backward_by_autograd
    message = rejects(checks.check_flash_attention_function, function, "function_passes")
    assert "the backward of FlashAttention.apply(q, k, v, True)" in message and "never called your " \
        "flash_attention_backward" in message, message


def test_flash_attention_function_that_saves_a_wrong_lse_is_told_its_values_not_what_it_saved():
    """A base-2 lse saved where lse goes: it saved the right thing, with the wrong values (issue #52)."""
    message = rejects(checks.check_flash_attention_function, make_function(save="lse_base2"), "lse_log2")
    assert "the lse that the forward of FlashAttention.apply" in message and HINTS["bwd_saved"] not in message


def test_the_emulated_backward_is_exact_without_a_bug():
    generator = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, 2, n, 8, generator=generator, dtype=torch.float64) for n in (21, 30, 30, 21))
    got = checks.tiled_backward(q, k, v, dout, causal=True, scale=0.3, block_q=8, block_k=16)
    for a, b in zip(got, checks.reference_gradients(q, k, v, dout, True, 0.3)):
        assert torch.allclose(a, b)


# --------------------------------------------------------------------------------------
# The Triton kernel (interpreter on the CPU)
# --------------------------------------------------------------------------------------

needs_triton = pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed (no wheel on this platform)")
# The kernels run where they were compiled for: the interpreter on the CPU, natively under `make gpu-check`.
KERNEL = {"device": "cuda" if torch.cuda.is_available() else "cpu", "quiet": True}
# What only Triton's interpreter can see: each load's addresses (an unmasked load whose NaN the kernel then hides
# with tl.where, a load of Q's missing rows) and the key blocks a program visits.
INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="natively, loads cannot be watched")


@triton.jit
def planted_kernel(Q, K, V, Out, Lse, stride_qh, stride_qs, stride_kh, stride_ks, stride_vh, stride_vs,
                   seq_q, seq_k, sm_scale, CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BUG: tl.constexpr = 0):
    # A correct kernel written with natural exp (BUG=0), or with one planted mistake:
    # 1 acc not rescaled, 2 exp on base-2 scores, 3 no boundary mask, 4 blank, 5 exp2 on natural scores,
    # 6 K loaded without a mask, 7 V without a mask, 8 Q without a mask, 9 the causal loop visits every key block,
    # 10 the causal bound forgets S_k - S_q, 11 the last visible key used as an exclusive stop,
    # 12 acc normalised inside the loop, 13 out stored without a mask, 14 tl.dot(p, v) with p in float32 and v in
    # the inputs' dtype, 15 the causal bound of the block's first query.
    pid_q, pid_h = tl.program_id(0), tl.program_id(1)
    rows = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    cols_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + pid_h * stride_qh + rows[:, None] * stride_qs + cols_d[None, :]
    if BUG == 8:
        q = tl.load(q_ptrs)
    else:
        q = tl.load(q_ptrs, mask=rows[:, None] < seq_q, other=0.0)
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)
    if BUG == 4:
        raise NotImplementedError("Exercise 6.10: implement flash_attention_kernel")
    hi = seq_k
    if CAUSAL:
        if BUG == 10:
            hi = tl.minimum(seq_k, (pid_q + 1) * BLOCK_Q)
        elif BUG == 11:
            hi = tl.minimum(seq_k, tl.minimum(seq_q, (pid_q + 1) * BLOCK_Q) - 1 + seq_k - seq_q)
        elif BUG == 15:
            hi = tl.minimum(seq_k, pid_q * BLOCK_Q + 1 + seq_k - seq_q)
        elif BUG != 9:
            hi = tl.minimum(seq_k, (pid_q + 1) * BLOCK_Q + seq_k - seq_q)
    for start in range(0, hi, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        k_ptrs = K + pid_h * stride_kh + cols[:, None] * stride_ks + cols_d[None, :]
        v_ptrs = V + pid_h * stride_vh + cols[:, None] * stride_vs + cols_d[None, :]
        if BUG == 6:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=cols[:, None] < seq_k, other=0.0)
        if BUG == 7:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=cols[:, None] < seq_k, other=0.0)
        s = tl.dot(q, tl.trans(k))
        if BUG == 2:
            s = s * sm_scale * 1.4426950408889634
        else:
            s = s * sm_scale
        if BUG != 3:
            s = tl.where(cols[None, :] < seq_k, s, float("-inf"))
        if CAUSAL:
            s = tl.where(cols[None, :] <= rows[:, None] + seq_k - seq_q, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if BUG == 5:
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
        else:
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if BUG == 1:
            acc = acc + tl.dot(p.to(v.dtype), v)
        elif BUG == 14:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        if BUG == 12:
            acc = acc / l_i[:, None]
        m_i = m_new
    # The course's epilogue expects base-2 m_i: convert (m_i is natural here).
    m_i = m_i * 1.4426950408889634
    sees_a_key = rows >= 0  # the given epilogue: a query that sees no key gets out 0, lse -inf
    if CAUSAL:
        sees_a_key = rows >= seq_q - seq_k
    acc = tl.where(sees_a_key[:, None], acc / l_i[:, None], 0.0)
    lse = tl.where(sees_a_key, (m_i + tl.log2(l_i)) * 0.6931471805599453, float("-inf"))
    if BUG == 13:
        tl.store(Out + pid_h * stride_qh + rows[:, None] * stride_qs + cols_d[None, :], acc.to(Out.dtype.element_ty))
    else:
        tl.store(Out + pid_h * stride_qh + rows[:, None] * stride_qs + cols_d[None, :],
                 acc.to(Out.dtype.element_ty), mask=rows[:, None] < seq_q)
    tl.store(Lse + pid_h * seq_q + rows, lse, mask=rows < seq_q)


class Planted:
    """The planted kernel with one BUG, launched like a student's kernel; like Triton's own wrappers
    (triton.heuristics, triton.autotune), it keeps the kernel it wraps as ``fn``."""

    def __init__(self, bug: int):
        self.fn, self.bug = planted_kernel, bug

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.fn[grid](*args, BUG=self.bug, **kwargs)


@needs_triton
def test_kernel_correct_answer_passes(capsys):
    checks.check_flash_attention_kernel(Planted(0), device=KERNEL["device"])
    assert "✓ flash_attention_kernel" in capsys.readouterr().out


@needs_triton
@pytest.mark.parametrize("bug, hint", [(1, "no_rescale_acc"), (2, "exp_with_log2e"), (3, "kernel_boundary"),
                                       (5, "exp2_unscaled"), pytest.param(6, "unmasked_load", marks=INTERPRETER_ONLY),
                                       pytest.param(7, "unmasked_load", marks=INTERPRETER_ONLY),
                                       pytest.param(8, "unmasked_load", marks=INTERPRETER_ONLY),
                                       pytest.param(9, "kernel_future_blocks", marks=INTERPRETER_ONLY),
                                       (10, "bound_no_offset"), (11, "bound_inclusive"), (12, "normalise_inside"),
                                       (13, "kernel_unmasked_store"),
                                       # numbers only, or the interpreter's raw AssertionError, before issue #52
                                       (14, "dot_dtypes"), (15, "bound_first_query")])
def test_kernel_mistakes_are_named(bug, hint):
    with pytest.raises(CheckFailure) as failure:
        checks.check_flash_attention_kernel(Planted(bug), **KERNEL)
    assert HINTS[hint] in str(failure.value), str(failure.value)


def plain_scale(X, Out, n, alpha, BLOCK):
    """A kernel written without @triton.jit."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Out + offsets, alpha * tl.load(X + offsets, mask=offsets < n), mask=offsets < n)


@needs_triton
def test_a_kernel_without_triton_jit_is_told_to_decorate_it():
    """TypeError: 'function' object is not subscriptable, with its cause named (issue #52)."""
    rejects(checks.check_scale_kernel, plain_scale, "not_jitted", device=KERNEL["device"])


@needs_triton
@INTERPRETER_ONLY
def test_the_given_epilogues_warnings_are_never_shown_as_the_students():
    """A query that sees no key: the given epilogue computes 0 / 0 and log2(0), and a correct loop -inf - (-inf),
    before tl.where discards them. NumPy warns of each in Triton's interpreter; a failing kernel's message listed
    them as the student's (issue #52). A launch by the checks shows none; other warnings stay."""
    import warnings

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, seq, 16, generator=generator) for seq in (70, 37, 37))

    def warned(launch) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            launch()
        return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

    raw = warned(lambda: triton_kernels.launch_flash_attention(Planted(0), q, k, v, causal=True, block_q=16,
                                                               block_k=16))
    assert any("invalid value" in text or "divide by zero" in text for text in raw), raw  # the interpreter does warn
    by_the_checks = warned(lambda: triton_kernels.launch(triton_kernels.launch_flash_attention, Planted(0), q, k, v,
                                                         watch=triton_kernels.LoadWatch(), causal=True, block_q=16,
                                                         block_k=16))
    assert not by_the_checks, by_the_checks  # (an overflow still shows: test_the_interpreters_warnings_come_after...)


@needs_triton
def test_an_unmasked_load_fails_every_time(where_checks_run):
    # The rows after each head's last row hold NaN in every case, so the result is certain (issue: it used to
    # depend on whatever memory followed the launcher's tensors). Unmasked K, then V: 100 runs, 100 failures.
    # Natively (no interpreter), an unmasked K whose NaN scores tl.where replaces goes unseen: V only there.
    # Through the bridge the same launcher runs: 10 runs show that it is launched the same way there.
    bugs = (7,) if torch.cuda.is_available() else (6, 7)
    runs = 100 if where_checks_run == "lab" else 10
    failures = 0
    for run in range(runs):
        with pytest.raises(CheckFailure) as failure:
            checks.check_flash_attention_kernel(Planted(bugs[run % len(bugs)]), seed=run, **KERNEL)
        assert HINTS["unmasked_load"] in str(failure.value) or HINTS["nan_past_end"] in str(failure.value)
        failures += 1
    assert failures == runs


@needs_triton
def test_an_unmasked_load_shows_as_nan_where_loads_are_not_watched(monkeypatch):
    # Natively on a GPU the loads cannot be watched: the NaN rows after the tensors still name the mistake.
    monkeypatch.setattr(triton_kernels.LoadWatch, "__enter__", lambda self: self)
    rejects(checks.check_flash_attention_kernel, Planted(7), "nan_past_end", device=KERNEL["device"])


def test_a_launch_report_must_say_where_the_launch_ran():
    # Where it ran decides the device the checker judges its results on (TF32 on a GPU): a report without it,
    # or naming another device, is malformed.
    from attention_lab.bridge import wire

    probe = triton_kernels.KernelLaunch(launcher="launch_scale")
    report = {"result": torch.zeros(3), "raised": None, "warnings": [], "watch": None, "ran_on": "cpu"}
    probe.accept(report)
    for where in (None, "tpu", 1):
        with pytest.raises(wire.WireError, match="does not say where it ran"):
            probe.accept({**report, "ran_on": where})


def test_poisoned_rows_are_a_view_with_nan_after_each_head():
    x = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    view = triton_kernels.poisoned_rows(x, 4)
    assert torch.equal(view, x) and view.stride() == (14, 2, 1)
    storage = torch.as_strided(view, (2, 7, 2), (14, 2, 1))
    assert storage[:, 3:].isnan().all()


@needs_triton
def test_kernel_blank_is_not_implemented_yet_not_a_crash():
    with pytest.raises(CheckFailure, match="not implemented yet"):
        checks.check_flash_attention_kernel(Planted(4), **KERNEL)


@triton.jit
def planted_scale(X, Out, n, alpha, BLOCK: tl.constexpr, BUG: tl.constexpr = 0):
    # 0 correct, 1 load without a mask, 2 store without a mask, 3 masks of offsets <= n, 4 the program's offset
    # without * BLOCK
    if BUG == 4:
        offsets = tl.program_id(0) + tl.arange(0, BLOCK)
    else:
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    if BUG == 3:
        inside = offsets <= n
    if BUG == 1:
        x = tl.load(X + offsets)
    else:
        x = tl.load(X + offsets, mask=inside, other=0.0)
    if BUG == 2:
        tl.store(Out + offsets, x * alpha)
    else:
        tl.store(Out + offsets, x * alpha, mask=inside)


@triton.jit
def planted_matmul(A, B, C, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BUG: tl.constexpr = 0):
    # 0 correct (pointers advanced each step), 1 the K tail not masked, 2 only the first K block, 3 A's strides
    # swapped, 4 the K loop drops the last slice, 5 a float16 accumulator, 6 C stored without a mask
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    if BUG == 3:
        a_ptrs = A + rm[:, None] * stride_ak + rk[None, :] * stride_am
    else:
        a_ptrs = A + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = B + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    if BUG == 5:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float16)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    stop = K
    if BUG == 2:
        stop = BLOCK_K
    if BUG == 4:
        stop = K - BLOCK_K
    for k0 in range(0, stop, BLOCK_K):
        if BUG == 1:
            a = tl.load(a_ptrs, mask=rm[:, None] < M, other=0.0)
            b = tl.load(b_ptrs, mask=rn[None, :] < N, other=0.0)
        else:
            a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (k0 + rk[None, :] < K), other=0.0)
            b = tl.load(b_ptrs, mask=(k0 + rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if BUG == 5:
            acc += tl.dot(a, b).to(tl.float16)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if BUG == 6:
        tl.store(C + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc)
    else:
        tl.store(C + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc,
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def planted_softmax(X, Out, n_cols, stride_x, stride_out, BLOCK: tl.constexpr, BUG: tl.constexpr = 0):
    # 0 correct (exp2 with log2(e)), 1 masked lanes loaded as 0, 2 no max subtracted, 3 load without a mask,
    # 4 store without a mask, 5 rows n_cols apart (not stride_x), 6 masks of cols <= n_cols
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    if BUG == 6:
        inside = cols <= n_cols
    row_start = row * stride_x
    if BUG == 5:
        row_start = row * n_cols
    if BUG == 1:
        x = tl.load(X + row_start + cols, mask=inside, other=0.0)
    elif BUG == 3:
        x = tl.load(X + row_start + cols)
    else:
        x = tl.load(X + row_start + cols, mask=inside, other=float("-inf"))
    if BUG != 2:
        x = x - tl.max(x, axis=0)
    e = tl.exp2(x * 1.4426950408889634)
    if BUG == 4:
        tl.store(Out + row * stride_out + cols, e / tl.sum(e, axis=0))
    else:
        tl.store(Out + row * stride_out + cols, e / tl.sum(e, axis=0), mask=inside)


@triton.jit
def tutorial_matmul(A, B, C, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Correct, in the style of Triton's matmul tutorial: the rows and columns of the last blocks wrap around
    (% M, % N) instead of being masked, only K is masked, the pointers advance, the store is masked."""
    offs_am = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_bn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + (offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak)
    b_ptrs = B + (offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn)
    accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k * BLOCK_K, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_K, other=0.0)
        accumulator = tl.dot(a, b, accumulator)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    offs_cm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_cn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = C + stride_cm * offs_cm[:, None] + stride_cn * offs_cn[None, :]
    tl.store(c_ptrs, accumulator, mask=(offs_cm[:, None] < M) & (offs_cn[None, :] < N))


class PlantedLadder:
    """A planted warm-up kernel with one BUG; it keeps the kernel as ``fn``, as Planted does."""

    def __init__(self, kernel, bug: int):
        self.fn, self.bug = kernel, bug

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.fn[grid](*args, BUG=self.bug, **kwargs)


@needs_triton
def test_a_kernel_inside_tritons_wrappers_runs_where_it_was_compiled_for(monkeypatch):
    # make gpu-check found it: on a GPU, grading decided where a kernel runs by its type, and a wrapped kernel
    # (here the tests' own Planted; a student's triton.heuristics or triton.autotune) got the CPU tensors that
    # crossed: "ValueError: Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)", right code failed.
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    compiled, interpreted = JITFunction(planted_scale.fn), InterpretedFunction(planted_scale.fn)
    block_of_64 = {"BLOCK": lambda args: 64}
    for kernel, on_gpu in ((compiled, True), (interpreted, False)):
        for wrapped in (kernel, triton.heuristics(block_of_64)(kernel), PlantedLadder(kernel, 0),
                        triton.autotune(configs=[triton.Config({"BLOCK": 64})], key=["n"])(kernel)):
            assert triton_kernels._compiled_for_gpu(wrapped) is on_gpu, (wrapped, on_gpu)
    # launched as kernel[grid](...) with no kernel inside to read: what this process defines now; a plain function
    # (no @triton.jit): neither, and its launch fails with Python's own error
    class Launchable:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    launchable = Launchable()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_kernels._compiled_for_gpu(launchable) is False
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert triton_kernels._compiled_for_gpu(launchable) is True
    assert triton_kernels._compiled_for_gpu(planted_scale.fn) is False
    # a compiled kernel, wrapped, given CPU tensors: the course's message, not Triton's
    with pytest.raises(RuntimeError, match="compiled for a GPU, but the tensors are on the CPU"):
        triton_kernels.launch_scale(triton.heuristics({"BUG": lambda args: 0})(compiled), torch.ones(5), 2.0)


@needs_triton
def test_warm_up_kernels_pass_when_right(capsys):
    checks.check_scale_kernel(PlantedLadder(planted_scale, 0), device=KERNEL["device"])
    checks.check_matmul_kernel(PlantedLadder(planted_matmul, 0), device=KERNEL["device"])
    checks.check_matmul_kernel(tutorial_matmul, device=KERNEL["device"])  # reads other programs' rows: fine
    checks.check_row_softmax_kernel(PlantedLadder(planted_softmax, 0), device=KERNEL["device"])
    out = capsys.readouterr().out
    assert "✓ scale_kernel" in out and "✓ matmul_kernel" in out and "✓ row_softmax_kernel" in out


@needs_triton
@pytest.mark.parametrize("check, kernel, bug, hint", [
    pytest.param("check_scale_kernel", planted_scale, 1, "ladder_unmasked_load", marks=INTERPRETER_ONLY),
    ("check_scale_kernel", planted_scale, 2, "ladder_unmasked_store"),
    pytest.param("check_scale_kernel", planted_scale, 3, "mask_last_lane", marks=INTERPRETER_ONLY),
    pytest.param("check_scale_kernel", planted_scale, 4, "program_offset", marks=INTERPRETER_ONLY),
    pytest.param("check_matmul_kernel", planted_matmul, 1, "mask_past_end", marks=INTERPRETER_ONLY),
    ("check_matmul_kernel", planted_matmul, 2, "matmul_one_k_block"),
    pytest.param("check_matmul_kernel", planted_matmul, 3, "wrong_address", marks=INTERPRETER_ONLY),
    ("check_matmul_kernel", planted_matmul, 4, "matmul_last_slice"),
    # natively fp32 tl.dot runs in TF32, as coarse as a float16 accumulator: the check names it on the CPU only
    pytest.param("check_matmul_kernel", planted_matmul, 5, "matmul_half_accumulator", marks=INTERPRETER_ONLY),
    pytest.param("check_matmul_kernel", planted_matmul, 6, "ladder_unmasked_store", marks=INTERPRETER_ONLY),
    ("check_row_softmax_kernel", planted_softmax, 1, "softmax_other_zero"),
    ("check_row_softmax_kernel", planted_softmax, 2, "softmax_no_max"),
    pytest.param("check_row_softmax_kernel", planted_softmax, 3, "ladder_unmasked_load", marks=INTERPRETER_ONLY),
    # 6.9's unmasked store used to write past an unguarded out and kill the notebook's kernel (issue #34)
    ("check_row_softmax_kernel", planted_softmax, 4, "ladder_unmasked_store"),
    pytest.param("check_row_softmax_kernel", planted_softmax, 5, "wrong_address", marks=INTERPRETER_ONLY),
    pytest.param("check_row_softmax_kernel", planted_softmax, 6, "mask_last_lane", marks=INTERPRETER_ONLY),
])
def test_warm_up_kernel_mistakes_are_named(check, kernel, bug, hint):
    rejects(getattr(checks, check), PlantedLadder(kernel, bug), hint, device=KERNEL["device"])


@needs_triton
@pytest.mark.parametrize("check, kernel, bug, hint", [("check_matmul_kernel", planted_matmul, 1, "ladder_nan_past_end"),
                                                      ("check_row_softmax_kernel", planted_softmax, 3, "ladder_nan_past_end"),
                                                      ("check_scale_kernel", planted_scale, 4, "ladder_unwritten")])
def test_warm_up_mistakes_show_in_the_numbers_where_loads_are_not_watched(monkeypatch, check, kernel, bug, hint):
    # Natively on a GPU nothing watches the loads and stores: NaN after every input and in every output until a
    # program writes it still names the mistake.
    monkeypatch.setattr(triton_kernels.LoadWatch, "__enter__", lambda self: self)
    rejects(getattr(checks, check), PlantedLadder(kernel, bug), hint, device=KERNEL["device"])


def test_kernel_check_without_triton_points_to_colab(monkeypatch):
    monkeypatch.setattr(triton_kernels, "TRITON_AVAILABLE", False)
    with pytest.raises(CheckFailure, match="Colab"):
        checks.check_flash_attention_kernel(object(), **CPU)


def test_stand_in_triton_defines_kernels_and_explains_at_launch():
    stand_in, language = triton_kernels._MissingTriton("triton"), triton_kernels._MissingAttribute("triton.language")

    @stand_in.jit
    def kernel(X, N: language.constexpr):
        pass

    with pytest.raises(triton_kernels.TritonUnavailable, match="Colab"):
        triton_kernels.launch_flash_attention(kernel, *(torch.zeros(1, 1, 16, 16) for _ in range(3)))


@pytest.mark.parametrize("block_q, block_k, head_dim, dtype, phrase", [
    (8, 16, 16, torch.float32, "block_q = 8: must be a power of two >= 16"),
    (16, 24, 16, torch.float32, "block_k = 24"),
    (16, 16, 8, torch.float32, "head_dim = 8"),
    (16, 16, 16, torch.bfloat16, "bfloat16 tl.dot gives wrong results in Triton's interpreter"),
])
def test_launcher_rejects_what_a_gpu_would_reject(block_q, block_k, head_dim, dtype, phrase):
    tensors = [torch.zeros(1, 1, 32, head_dim, dtype=dtype) for _ in range(3)]
    with pytest.raises(ValueError, match=re_escape(phrase)):
        triton_kernels.launch_flash_attention(Planted(0), *tensors, block_q=block_q, block_k=block_k)


def re_escape(text: str) -> str:
    import re
    return re.escape(text)


# --------------------------------------------------------------------------------------
# Widgets and measurements
# --------------------------------------------------------------------------------------


def test_tile_states_skip_future_blocks_bottom_right():
    states = views.tile_states(64, 64, 16, 16, causal=True)
    assert (states == views.SKIPPED).sum() == 6 and (states == views.MASKED).sum() == 4
    decoding = views.tile_states(16, 64, 16, 16, causal=True)  # the last query sees every key
    assert (decoding != views.SKIPPED).all()
    assert (views.tile_states(64, 64, 16, 16, causal=False) == views.FULL).all()


def test_block_map_explorer_redraws_with_its_controls():
    explorer = views.block_map_explorer(seq_q=64, seq_k=64, block_q=16, block_k=16)
    assert explorer.figure.axes[0].get_title().startswith("10 of 16 tiles computed")
    explorer.controls["causal"].value = False
    assert explorer.figure.axes[0].get_title().startswith("16 of 16 tiles computed")
    # One row of tiles whatever block_q is (S_q = 16): the title still shows the change.
    explorer.controls["seq_q"].value = 16
    explorer.controls["block_q"].value = 64
    assert explorer.figure.axes[0].get_title().endswith("16 × 64 scores in 64 × 16 tiles")
    explorer.controls["block_q"].value = 128
    assert explorer.figure.axes[0].get_title().endswith("16 × 64 scores in 128 × 16 tiles")


def test_live_bytes_sees_the_score_table_and_not_the_tiles():
    q = torch.randn(1, 1, 256, 16)
    naive = views.peak_bytes(lambda: torch.softmax(q @ q.transpose(-1, -2), -1) @ q, torch.device("cpu"))
    tiled = views.peak_bytes(lambda: make_flash()(q, q, q, 32, 32)[0], torch.device("cpu"))
    assert naive >= 256 * 256 * 4 and tiled < 256 * 256 * 4 / 2, (naive, tiled)


def test_measurements_are_plotted():
    costs = views.measure_attention_costs({"naive": lambda q, k, v: torch.softmax(q @ k.mT, -1) @ v,
                                           "SDPA": F.scaled_dot_product_attention}, [32, 64], num_heads=1,
                                          head_dim=8, progress=False)
    assert len(costs["seconds"]["naive"]) == 2 and costs["bytes"]["naive"][1] > costs["bytes"]["naive"][0]
    assert all(low <= median <= high for (low, high), median in zip(costs["spread"]["naive"], costs["seconds"]["naive"]))
    view = views.attention_costs_view(costs)
    assert [ax.get_yscale() for ax in view.figure.axes] == ["log", "log"]
    labels = view.figure.axes[1].get_legend_handles_labels()[1]
    assert labels[0].startswith("naive (slope ") and labels[1].startswith("SDPA (slope "), labels
    view.controls["log_scale"].value = False
    assert [ax.get_yscale() for ax in view.figure.axes] == ["linear", "linear"]
    assert set(view.figure.axes[0].get_legend_handles_labels()[1]) == {"naive", "SDPA"}


def test_fitted_slope_reads_the_growth_and_timings_take_a_warm_up():
    assert views.fitted_slope([64, 128, 256], [1.0, 4.0, 16.0]) == pytest.approx(2.0)
    assert math.isnan(views.fitted_slope([64, 128], [math.nan, 1.0]))
    calls = []
    times = views.run_times(lambda: calls.append(1), torch.device("cpu"), repeats=3)
    assert len(times) == 3 and len(calls) == 4  # one warm-up, three timed


def test_achieved_tflops_against_a_peak():
    results = {"seq_lens": [1024], "seconds": {"naive": [0.001]}, "shape": (1, 1, 64)}
    text = views.achieved_tflops_text(results, peak_tflops=100.0)
    assert "naive 0.268 (0.27%)" in text, text


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200 NVL", 835.0), ("NVIDIA H200", 989.0), ("NVIDIA H100 NVL", 835.0), ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A10", 125.0), ("Tesla T4", 65.0),
    ("Some Future GPU", None),
])
def test_a_gpu_is_credited_the_peak_of_its_own_model(monkeypatch, name, peak):
    """The names are matched most specific first: an H200 NVL is not credited an H200 SXM's 989 TFLOP/s."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert views.gpu_peak_tflops("cuda") == peak
    assert views.gpu_peak_tflops("cpu") is None


def test_no_peak_table_key_is_shadowed_by_a_shorter_one_listed_before_it():
    keys = list(views.GPU_PEAK_TFLOPS)
    shadowed = [(short, long) for i, short in enumerate(keys) for long in keys[i + 1:] if short in long]
    assert not shadowed, f"a shorter name listed first matches the longer one's cards too: {shadowed}"


def test_naive_attention_moves_more_bytes_per_flop_than_tiled():
    traffic = views.attention_traffic(4096, 64, 2, block_q=128)
    (flops, naive), (_, tiled) = traffic["naive"], traffic["tiled"]
    # naive: about d/2 FLOPs per byte, far below any GPU's balance (> 150); tiled: about block_q
    assert 25 < flops / naive < 40 and flops / tiled > 3 * flops / naive


# --------------------------------------------------------------------------------------
# The course's setup and the GPU check
# --------------------------------------------------------------------------------------


def test_setup_selects_the_interpreter_without_a_gpu(monkeypatch):
    from attention_lab import device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # set, then deleted: pytest restores only what it saw set, and setup's "1" must not outlive this test on a
    # GPU machine (every kernel defined after it would be interpreted)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.delenv(device.DEVICE_ENV_VAR, raising=False)
    assert device.setup(verbose=False).type == "cpu"
    assert os.environ["TRITON_INTERPRET"] == "1"


@needs_triton
def test_gpu_check_defines_the_solutions_kernels_compiled_not_interpreted():
    # @triton.jit reads each kernel's source: exec'd from the solution's cells, it had none ("@jit functions should
    # be defined in a Python file"), and make gpu-check stopped before its kernel checks and timings.
    import subprocess
    import sys

    script = ("from benchmarks.gpu_check import solution_namespace\n"
              "kernels = {n: type(v).__name__ for n, v in solution_namespace().items() if n.endswith('_kernel')}\n"
              "print(sorted(set(kernels.values())), len(kernels))")
    environ = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environ,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["['JITFunction']", "7"], done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_check_refuses_clearly_without_cuda(capsys):
    from benchmarks import gpu_check

    assert gpu_check.main([]) == 2
    assert "needs a CUDA GPU, and there is none here" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# The notebook's cells
# --------------------------------------------------------------------------------------


def _solution_cells():
    return solution_cells("06_efficient_attention")


def test_no_code_line_of_notebook_06_is_longer_than_100_characters():
    assert not long_code_lines("06_efficient_attention")


def test_no_demo_of_notebook_06_runs_an_answer_before_its_check():
    assert not demos_before_their_check("06_efficient_attention")


# --------------------------------------------------------------------------------------
# The challenge: the backward pass as two Triton kernels (the solution's, and mistakes planted in it)
# --------------------------------------------------------------------------------------


def backward_kernels(tmp_path, *replacements):
    """The solution's two backward kernels, with each (old, new) text replaced, imported from a file (Triton
    reads a kernel's source)."""
    import importlib.util
    import re

    cell = next(c for c in _solution_cells() if c.metadata.get("answer") == "flash_attention_backward_kernel")
    source = re.sub(r"\n *### (BEGIN|END) SOLUTION", "", cell.source)
    for old, new in replacements:
        assert old in source, old
        source = source.replace(old, new)
    path = tmp_path / f"kernels_{abs(hash(replacements))}.py"
    path.write_text("from attention_lab.triton_kernels import tl, triton\n\n\n" + source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.flash_attention_backward_kernel, module.flash_attention_backward_dq_kernel


@needs_triton
def test_backward_kernels_pass_when_right(tmp_path, capsys):
    checks.check_flash_attention_backward_kernel(*backward_kernels(tmp_path), device=KERNEL["device"])
    assert "✓ flash_attention_backward_kernel" in capsys.readouterr().out


@needs_triton
@pytest.mark.parametrize("replacements, hint", [
    ((("ds = p * (dp - delta[:, None])", "ds = p * dp"),), "bwd_no_D"),
    ((("    dk = dk * sm_scale\n", ""), ("    dq = dq * sm_scale\n", "")), "bwd_no_scale"),
    ((("p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)", "p = tl.where(visible, tl.exp(s), 0.0)"),),
     "bwd_no_lse"),
    pytest.param((("k = tl.load(k_tile, mask=in_k[:, None], other=0.0)", "k = tl.load(k_tile)"),),
                 "unmasked_load", marks=INTERPRETER_ONLY),
    ((("dv.to(DV.dtype.element_ty), mask=key_ok[:, None])", "dv.to(DV.dtype.element_ty))"),),
     "kernel_unmasked_store"),
    # numbers only before (issue #34): a habit from 6.10, a classic, and a loop bound
    ((("tl.exp(s - lse[:, None])", "tl.exp2(s - lse[:, None])"),), "bwd_exp2_natural"),
    ((("ds = p * (dp - delta[:, None])", "ds = p * (dp - tl.sum(p * dp, axis=1)[:, None])"),), "bwd_D_tile"),
    ((("(seq_k - seq_q)) // BLOCK_Q * BLOCK_Q", "(seq_k - seq_q)) // BLOCK_Q * BLOCK_Q + BLOCK_Q"),),
     "bwd_late_queries"),
])
def test_backward_kernel_mistakes_are_named(tmp_path, replacements, hint):
    with pytest.raises(CheckFailure) as failure:
        checks.check_flash_attention_backward_kernel(*backward_kernels(tmp_path, *replacements), **KERNEL)
    assert HINTS[hint] in str(failure.value), str(failure.value)


@needs_triton
def test_backward_kernel_without_the_loops_is_not_implemented_yet(tmp_path):
    blank = ("    q_start_first = 0\n", "    raise NotImplementedError('Exercise 6.13')\n    q_start_first = 0\n")
    with pytest.raises(CheckFailure, match="not implemented yet"):
        checks.check_flash_attention_backward_kernel(*backward_kernels(tmp_path, blank), **KERNEL)


# --------------------------------------------------------------------------------------
# The dtype contract on the CPU: half precision in and out, at least float32 inside (issue #34)
# --------------------------------------------------------------------------------------


def in_the_inputs_dtype(make):
    """An answer computing in q's dtype (float16 in: float16 inside), built by ``make(work=...)``."""
    @functools.wraps(make())
    def answer(q, *args, **kwargs):
        return make(work=q.dtype)(q, *args, **kwargs)
    return answer


def test_flash_attention_backward_computing_in_half_precision_is_named():
    message = rejects(checks.check_flash_attention_backward, in_the_inputs_dtype(make_backward), "half_internals")
    assert "float16" in message


def test_flash_attention_backward_that_never_casts_back_is_named():
    def backward(q, k, v, out, lse, dout, block_q=64, block_k=64, causal=False, scale=None):
        work = torch.promote_types(q.dtype, torch.float32)
        return make_backward()(*(t.to(work) for t in (q, k, v, out, lse, dout)), block_q, block_k, causal, scale)

    rejects(checks.check_flash_attention_backward, backward, "cast_back")


def test_flash_attention_forward_computing_in_half_precision_is_named():
    rejects(checks.check_flash_attention_forward, in_the_inputs_dtype(make_flash), "half_internals")


@needs_triton
@INTERPRETER_ONLY
def test_the_interpreters_warnings_come_after_the_checks_message():
    # They printed above the message, in the notebook, in 6.9's overflow case (issue #34).
    import warnings

    with warnings.catch_warnings(record=True) as escaped:
        warnings.simplefilter("always")
        message = rejects(checks.check_row_softmax_kernel, PlantedLadder(planted_softmax, 2), "softmax_no_max")
    assert not [w for w in escaped if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in escaped]
    tail = message.split("Likely mistake:")[-1]
    assert "Warnings while your code ran:" in tail and "RuntimeWarning: overflow encountered in exp2" in tail, message


# --------------------------------------------------------------------------------------
# The backward pass's FLOPs, counted
# --------------------------------------------------------------------------------------


def test_answer_backward_flops_takes_the_pair_and_explains_only_once_right(capsys):
    checks.check_answer_backward_flops((2.5, 3.5), device="cpu")
    checks.check_answer_backward_flops((np.float32(2.5), np.float64(3.5)), device="cpu")  # NumPy numbers (#52)
    checks.check_answer_backward_flops([5 / 2, 7 / 2], device="cpu")
    assert "3.5x its forward" in capsys.readouterr().out
    for wrong, hint in [((3.5, 2.5), "swapped"), ((5, 7), "products_not_ratio"), ((2.0, 3.5), "no_recompute"),
                        ((2.5, 2.5), "same_for_both"), ((2.5, 3.0), "dq_kernel_reuses")]:
        with pytest.raises(CheckFailure, match=re.escape(checks.BACKWARD_FLOPS_HINTS[hint])) as failure:
            checks.check_answer_backward_flops(wrong, **CPU)
        assert "dK = dSᵀ q" not in str(failure.value)
    for wrong, phrase in [(None, "not implemented yet"), (2.5, "should be a pair"), ((2.5,), "should be a pair"),
                          (("2.5", "3.5"), "should be a pair"), ((1.0, 1.0), "ratios are off")]:
        with pytest.raises(CheckFailure, match=phrase):
            checks.check_answer_backward_flops(wrong, **CPU)


# --------------------------------------------------------------------------------------
# online_softmax_kernel: the online softmax inside one Triton program
# --------------------------------------------------------------------------------------


@triton.jit
def planted_online_softmax(X, Out, n_cols, stride_x, stride_out, BLOCK: tl.constexpr, BUG: tl.constexpr = 0):
    # 0 correct, 1 sum not rescaled, 2 first block only, 3 padding loaded as 0, 4 no max, 5 store unmasked,
    # 6 the inputs' dtype inside (float16 for float16), 7 both loops stop before the last block, 8 one block only
    # (the row assumed to fit), 9 written (normalised) in the first loop, 10 exp2 without log2(e)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    work = tl.float32
    if BUG == 6:
        work = X.dtype.element_ty
    m_i = tl.max(tl.full([BLOCK], float("-inf"), work), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK], work), axis=0)
    stop = n_cols
    if BUG == 2 or BUG == 8:
        stop = BLOCK
    if BUG == 7:
        stop = n_cols - BLOCK
    for start in range(0, stop, BLOCK):
        cols = start + offs
        if BUG == 3:
            x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=0.0).to(work)
        else:
            x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(work)
        if BUG == 4:
            l_i += tl.sum(tl.exp(x), axis=0)
        elif BUG == 10:
            m_new = tl.maximum(m_i, tl.max(x, axis=0))
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(x - m_new), axis=0)
            m_i = m_new
        else:
            m_new = tl.maximum(m_i, tl.max(x, axis=0))
            if BUG == 1:
                l_i = l_i + tl.sum(tl.exp(x - m_new), axis=0)
            else:
                l_i = (l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(x - m_new), axis=0)).to(work)
            m_i = m_new
        if BUG == 8 or BUG == 9:
            tl.store(Out + row * stride_out + cols, (tl.exp(x - m_i) / l_i).to(Out.dtype.element_ty),
                     mask=cols < n_cols)
    if BUG != 8 and BUG != 9:
        for start in range(0, stop if BUG == 7 else n_cols, BLOCK):
            cols = start + offs
            x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(work)
            if BUG == 4:
                y = (tl.exp(x) / l_i).to(Out.dtype.element_ty)
            elif BUG == 10:
                y = (tl.exp2(x - m_i) / l_i).to(Out.dtype.element_ty)
            else:
                y = (tl.exp(x - m_i) / l_i).to(Out.dtype.element_ty)
            if BUG == 5:
                tl.store(Out + row * stride_out + cols, y)
            else:
                tl.store(Out + row * stride_out + cols, y, mask=cols < n_cols)


@needs_triton
def test_online_softmax_kernel_passes_when_right(capsys):
    checks.check_online_softmax_kernel(PlantedLadder(planted_online_softmax, 0), device=KERNEL["device"])
    checks.check_online_softmax_kernel(PlantedLadder(planted_online_softmax, 0), seed=6912, device=KERNEL["device"])
    assert capsys.readouterr().out.count("✓ online_softmax_kernel") == 2


@needs_triton
@pytest.mark.parametrize("bug, hint", [
    (1, checks.ONLINE_SOFTMAX_HINTS["no_rescale"]),
    (2, checks.ONLINE_SOFTMAX_HINTS["first_block_only"]),
    (3, checks.ONLINE_SOFTMAX_HINTS["other_zero"]),
    (4, HINTS["softmax_no_max"]),
    (5, HINTS["ladder_unmasked_store"]),
    # named since issue #52 (passed, or told "a tl.load without a mask", or numbers only)
    (6, HINTS["kernel_half_internals"].format(dtype="float16")),
    (7, checks.ONLINE_SOFTMAX_HINTS["unwritten_last_block"]),
    (8, checks.ONLINE_SOFTMAX_HINTS["unwritten_after_first_block"]),
    (9, checks.ONLINE_SOFTMAX_HINTS["normalise_first_loop"]),
    (10, HINTS["exp2_unscaled"]),
])
def test_online_softmax_kernel_mistakes_are_named(bug, hint):
    with pytest.raises(CheckFailure) as failure:
        checks.check_online_softmax_kernel(PlantedLadder(planted_online_softmax, bug), **KERNEL)
    assert hint in str(failure.value), str(failure.value)


@needs_triton
def test_kernels_given_their_constants_by_triton_heuristics_pass(capsys):
    # right code however written: a BLOCK or a flag from triton.heuristics (in grading on a GPU such a kernel once
    # got the CPU tensors that crossed the bridge, and failed)
    bug_free = {"BUG": lambda args: 0}
    checks.check_scale_kernel(triton.heuristics(bug_free)(planted_scale), device=KERNEL["device"])
    checks.check_flash_attention_kernel(triton.heuristics(bug_free)(planted_kernel), device=KERNEL["device"])
    out = capsys.readouterr().out
    assert "✓ scale_kernel" in out and "✓ flash_attention_kernel" in out, out


def test_online_softmax_launcher_takes_power_of_two_blocks_only():
    with pytest.raises(ValueError, match="power of two"):
        triton_kernels.launch_online_softmax(PlantedLadder(planted_online_softmax, 0),
                                             torch.zeros(2, 40, device=KERNEL["device"]), block=24)
