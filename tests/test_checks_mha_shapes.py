"""The checks of notebook 01 accept correct answers written differently and reject known mistakes.

Every wrong answer here is a mistake a student really makes; each must be rejected with
the hint that names it. The correct answers are deliberately written another way than the
solution notebook, so the checks are shown to test behaviour, not spelling.
"""

from __future__ import annotations

import math
import sys
import re

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from attention_lab.checking import CheckFailure, choice_digest
from attention_lab.checks import mha_shapes as checks
from tests.bridge_harness import run_both_ways

# Every test twice: the checks in the student's kernel (the lab), and through the bridge (grading).
where_checks_run = run_both_ways()

CPU = {"device": "cpu", "quiet": True}

# --------------------------------------------------------------------------------------
# split_heads / merge_heads / split_heads_einops
# --------------------------------------------------------------------------------------


def split_heads_unflatten(x, num_heads):
    if x.shape[-1] % num_heads:
        raise ValueError(f"D={x.shape[-1]} not divisible by H={num_heads}")
    return x.unflatten(-1, (num_heads, -1)).transpose(1, 2)


def split_heads_no_permute(x, num_heads):
    b, s, d = x.shape
    if d % num_heads:
        raise ValueError(f"{d} {num_heads}")
    return x.view(b, s, num_heads, d // num_heads)


def split_heads_reshape_only(x, num_heads):
    b, s, d = x.shape
    if d % num_heads:
        raise ValueError(f"{d} {num_heads}")
    return x.reshape(b, num_heads, s, d // num_heads)


def split_heads_strided(x, num_heads):
    b, s, d = x.shape
    if d % num_heads:
        raise ValueError(f"{d} {num_heads}")
    return x.reshape(b, s, d // num_heads, num_heads).permute(0, 3, 1, 2)


def split_heads_silent_on_bad_width(x, num_heads):
    return x.unflatten(-1, (num_heads, x.shape[-1] // num_heads)).transpose(1, 2) if x.shape[-1] % num_heads == 0 \
        else x[..., : (x.shape[-1] // num_heads) * num_heads].unflatten(-1, (num_heads, -1)).transpose(1, 2)


def split_heads_vague_error(x, num_heads):
    if x.shape[-1] % num_heads:
        raise ValueError("bad shape")
    return split_heads_unflatten(x, num_heads)


def split_heads_float32(x, num_heads):
    return split_heads_unflatten(x, num_heads).float()


def test_split_heads_accepts_a_correct_answer_written_differently():
    checks.check_split_heads(split_heads_unflatten, **CPU)


@pytest.mark.parametrize("wrong, phrase", [
    (split_heads_no_permute, r"should have shape \[2, 3, 5, 4\], got \[2, 5, 3, 4\][\s\S]*permute"),
    (split_heads_reshape_only, "reshape reads memory in order"),
    (split_heads_strided, "every H-th feature"),
    (split_heads_silent_on_bad_width, "should raise ValueError"),
    (split_heads_vague_error, "should name 10 and 4"),
    (split_heads_float32, "should keep the input dtype torch.float64, got torch.float32"),
])
def test_split_heads_rejects_known_mistakes(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_split_heads(wrong, **CPU)


def test_split_heads_reports_a_blank_as_not_implemented():
    def blank(x, num_heads):
        raise NotImplementedError("Exercise 1.1: implement split_heads")

    with pytest.raises(CheckFailure, match="not implemented yet"):
        checks.check_split_heads(blank, **CPU)


def test_split_heads_rejects_a_renamed_parameter():
    def renamed(tensor, heads):
        return split_heads_unflatten(tensor, heads)

    with pytest.raises(CheckFailure, match=r"should take the parameters \(x, num_heads\)"):
        checks.check_split_heads(renamed, **CPU)


def test_split_heads_einops_requires_rearrange():
    def with_einops(x, num_heads):
        if x.shape[-1] % num_heads:
            raise ValueError(f"D={x.shape[-1]} H={num_heads}")
        return rearrange(x, "b s (h d) -> b h s d", h=num_heads)

    checks.check_split_heads_einops(with_einops, **CPU)
    with pytest.raises(CheckFailure, match="never called einops"):
        checks.check_split_heads_einops(split_heads_unflatten, **CPU)

    def einops_wrong_grouping(x, num_heads):
        if x.shape[-1] % num_heads:
            raise ValueError(f"D={x.shape[-1]} H={num_heads}")
        return rearrange(x, "b s (d h) -> b h s d", h=num_heads)

    with pytest.raises(CheckFailure, match="every H-th feature"):
        checks.check_split_heads_einops(einops_wrong_grouping, **CPU)


def merge_heads_flatten(x):
    return x.permute(0, 2, 1, 3).flatten(2)


def merge_heads_view_without_contiguous(x):
    b, h, s, d = x.shape
    return x.transpose(1, 2).view(b, s, h * d)


def merge_heads_reshape_only(x):
    b, h, s, d = x.shape
    return x.reshape(b, s, h * d)


def test_merge_heads_accepts_flatten_and_rejects_mistakes():
    checks.check_merge_heads(merge_heads_flatten, **CPU)
    with pytest.raises(CheckFailure, match="not contiguous"):
        checks.check_merge_heads(merge_heads_view_without_contiguous, **CPU)
    with pytest.raises(CheckFailure, match="Move the head axis back"):
        checks.check_merge_heads(merge_heads_reshape_only, **CPU)


# --------------------------------------------------------------------------------------
# attention_weights / scaled_dot_product_attention
# --------------------------------------------------------------------------------------


def weights_einsum(q, k, mask=None):
    scores = torch.einsum("...qd,...kd->...qk", q, k) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = torch.where(mask, scores, torch.finfo(scores.dtype).min)
    weights = scores.softmax(-1)
    return weights if mask is None else weights.masked_fill(~mask, 0.0)


def weights_no_scale(q, k, mask=None):
    scores = q @ k.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1)


def weights_scale_by_d(q, k, mask=None):
    return weights_no_scale(q / q.shape[-1], k, mask)


def weights_wrong_axis(q, k, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-2).nan_to_num(0.0)


def weights_mask_flipped(q, k, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return scores.softmax(-1)


def weights_mask_ignored(q, k, mask=None):
    return weights_no_scale(q / q.shape[-1] ** 0.25, k / q.shape[-1] ** 0.25)


def weights_calling_sdpa(q, k, mask=None):
    identity = torch.eye(k.shape[-2], dtype=q.dtype, device=q.device).expand(*k.shape[:-2], -1, -1)
    return F.scaled_dot_product_attention(q, k, identity, attn_mask=mask)


def weights_zero_fill(q, k, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, 0.0)  # 0, not -inf: exp(0) = 1
    return scores.softmax(-1)


def weights_transpose_first_axes(q, k, mask=None):
    scores = q @ k.transpose(0, 1) / math.sqrt(q.shape[-1])  # the wrong pair of axes
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1)


def test_attention_weights_names_a_zero_fill_and_the_wrong_pair_of_axes():
    with pytest.raises(CheckFailure, match=r"Likely mistake: the masked scores were set to 0, not -inf"):
        checks.check_attention_weights(weights_zero_fill, **CPU)
    with pytest.raises(CheckFailure, match=r"raised RuntimeError[\s\S]*Likely mistake: k.transpose\(0, 1\) swaps"):
        checks.check_attention_weights(weights_transpose_first_axes, **CPU)


def test_the_wrong_pair_of_axes_is_named_when_it_runs_too():
    """q [S, S, d] with k [S, S, d]: q @ k.transpose(0, 1) has no shape error, only wrong numbers."""
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(4, 4, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    with pytest.raises(CheckFailure, match=r"Likely mistake: k.transpose\(0, 1\) swaps"):
        checks._check_weights(weights_transpose_first_axes(q, k), q, k, None, "attention_weights(q, k)")


def test_scaled_dot_product_attention_names_scores_times_v():
    def scores_times_v(q, k, v, mask=None):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores @ v, scores.softmax(-1)

    with pytest.raises(CheckFailure, match=r"Likely mistake: out = weights @ v: you multiplied the scores"):
        checks.check_scaled_dot_product_attention(scores_times_v, **CPU)


def test_attention_weights_accepts_einsum_with_finite_fill():
    checks.check_attention_weights(weights_einsum, **CPU)


@pytest.mark.parametrize("wrong, phrase", [
    (weights_no_scale, "no 1/sqrt\\(d_head\\) scaling"),
    (weights_scale_by_d, "you divided by d_head"),
    (weights_wrong_axis, "softmax over the wrong axis"),
    (weights_mask_flipped, "mask polarity flipped|weight exactly 0"),
    (weights_mask_ignored, "the mask was ignored|weight exactly 0"),
    (weights_calling_sdpa, "from-scratch exercise.*scaled_dot_product_attention"),
])
def test_attention_weights_rejects_known_mistakes(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_attention_weights(wrong, **CPU)


def test_attention_weights_names_the_missing_transpose_by_shape():
    def elementwise_scores(q, k, mask=None):
        return (q * k / math.sqrt(q.shape[-1])).softmax(-1)  # q * k, not q @ k^T

    with pytest.raises(CheckFailure, match=r"should have shape \[2, 3, 5, 5\], got \[2, 3, 5, 8\][\s\S]*k.transpose"):
        checks.check_attention_weights(elementwise_scores, **CPU)


def sdpa_separate_steps(q, k, v, mask=None):
    weights = weights_einsum(q, k, mask)
    return torch.einsum("...qk,...kd->...qd", weights, v), weights


def test_scaled_dot_product_attention_accepts_and_rejects():
    checks.check_scaled_dot_product_attention(sdpa_separate_steps, **CPU)

    def only_output(q, k, v, mask=None):
        return sdpa_separate_steps(q, k, v, mask)[0]

    with pytest.raises(CheckFailure, match=r"should return a tuple \(out, weights\)"):
        checks.check_scaled_dot_product_attention(only_output, **CPU)

    def unscaled(q, k, v, mask=None):
        weights = weights_no_scale(q, k, mask)
        return weights @ v, weights

    with pytest.raises(CheckFailure, match="no 1/sqrt"):
        checks.check_scaled_dot_product_attention(unscaled, **CPU)

    def builtin(q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), weights_einsum(q, k, mask)

    with pytest.raises(CheckFailure, match="from-scratch"):
        checks.check_scaled_dot_product_attention(builtin, **CPU)


# --------------------------------------------------------------------------------------
# MultiHeadSelfAttention and load_torch_mha_weights
# --------------------------------------------------------------------------------------


class SelfAttentionEinsum(nn.Module):
    """A correct answer written another way: einsum and rearrange, softmax with a finite fill."""

    def __init__(self, embed_dim, num_heads, bias=True, scale_width=None, use_out=True, flip_mask=False,
                 builtin=False, average_heads=False, drop_mask=False, reshape_split=None, values_from="v_linear"):
        super().__init__()
        self.q_linear, self.k_linear, self.v_linear, self.out_linear = (
            nn.Linear(embed_dim, embed_dim, bias=bias) for _ in range(4))
        self.num_heads = num_heads
        self.scale_width = scale_width
        self.use_out, self.flip_mask, self.builtin, self.average_heads = use_out, flip_mask, builtin, average_heads
        self.drop_mask, self.reshape_split, self.values_from = drop_mask, reshape_split, values_from

    def forward(self, x, mask=None, return_weights=False):
        if self.drop_mask:
            mask = None
        b, s, d = x.shape
        projections = (self.q_linear, self.k_linear, getattr(self, self.values_from))
        if self.reshape_split:  # heads cut by a reshape that does not move the head axis
            q, k, v = (f(x).reshape(b, self.num_heads, s, d // self.num_heads) for f in projections)
        else:
            q, k, v = (rearrange(f(x), "b s (h d) -> b h s d", h=self.num_heads) for f in projections)
        if self.builtin:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            weights = None
        else:
            width = self.scale_width(q.shape[-1], x.shape[-1]) if self.scale_width else q.shape[-1]
            scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(width)
            if mask is not None:
                scores = scores.masked_fill(mask if self.flip_mask else ~mask, float("-inf"))
            weights = scores.softmax(-1)
            context = weights @ v
        if self.reshape_split == "reshape back":
            merged = context.reshape(b, s, d)
        else:
            merged = rearrange(context, "b h s d -> b s (h d)")
        out = self.out_linear(merged) if self.use_out else merged
        if return_weights:
            return out, (weights.mean(1) if self.average_heads else weights)
        return out


def variant(**options):
    return lambda embed_dim, num_heads, bias=True: SelfAttentionEinsum(embed_dim, num_heads, bias, **options)


def test_multi_head_self_attention_accepts_a_correct_module():
    checks.check_multi_head_self_attention(SelfAttentionEinsum, **CPU)


@pytest.mark.parametrize("wrong, phrase", [
    (variant(use_out=False), "output projection is missing"),
    (variant(scale_width=lambda d_head, d_model: 1.0), "no 1/sqrt\\(d_head\\) scaling"),
    (variant(scale_width=lambda d_head, d_model: d_model), "scaled by 1/sqrt\\(embed_dim\\)"),
    (variant(flip_mask=True), "mask polarity flipped"),
    (variant(builtin=True), "from-scratch"),
    (variant(average_heads=True), "do not average over heads"),
    (variant(drop_mask=True), "the mask was not applied"),
    (variant(reshape_split="transpose back"), "cut by reshaping \\[B, S, D\\] straight to \\[B, H, S, d_head\\]"),
    (variant(reshape_split="reshape back"), "cut by reshaping \\[B, S, D\\] straight to \\[B, H, S, d_head\\]"),
    (variant(values_from="k_linear"), "the values must come from v_linear"),
    (variant(values_from="q_linear"), "the values must come from v_linear"),
])
def test_multi_head_self_attention_rejects_known_mistakes(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_multi_head_self_attention(wrong, **CPU)


def test_multi_head_self_attention_requires_the_contract_attributes():
    class Renamed(SelfAttentionEinsum):
        def __init__(self, embed_dim, num_heads, bias=True):
            super().__init__(embed_dim, num_heads, bias)
            self.o_proj = self.out_linear
            del self.out_linear

    with pytest.raises(CheckFailure, match="attribute out_linear that is an nn.Linear"):
        checks.check_multi_head_self_attention(Renamed, **CPU)


def load_by_index(module, torch_mha):
    d = module.q_linear.weight.shape[0]
    with torch.no_grad():
        for i, name in enumerate(["q_linear", "k_linear", "v_linear"]):
            getattr(module, name).weight[:] = torch_mha.in_proj_weight[i * d:(i + 1) * d]
            if torch_mha.in_proj_bias is not None:
                getattr(module, name).bias[:] = torch_mha.in_proj_bias[i * d:(i + 1) * d]
        module.out_linear.load_state_dict(torch_mha.out_proj.state_dict())


def load_transposed(module, torch_mha):
    d = module.q_linear.weight.shape[0]
    load_by_index(module, torch_mha)
    with torch.no_grad():
        for i, name in enumerate(["q_linear", "k_linear", "v_linear"]):
            getattr(module, name).weight.copy_(torch_mha.in_proj_weight[i * d:(i + 1) * d].T)


def load_wrong_order(module, torch_mha):
    load_by_index(module, torch_mha)
    with torch.no_grad():
        module.q_linear.weight.copy_(module.k_linear.weight.clone())


def load_by_sharing(module, torch_mha):
    load_by_index(module, torch_mha)
    d = module.q_linear.weight.shape[0]
    module.q_linear.weight = nn.Parameter(torch_mha.in_proj_weight[:d])


def load_plain_tensor(module, torch_mha):
    load_by_index(module, torch_mha)
    d = module.q_linear.weight.shape[0]
    del module.q_linear.weight
    module.q_linear.weight = torch_mha.in_proj_weight[:d].detach().clone()


def test_load_torch_mha_weights_accepts_and_rejects():
    checks.check_load_torch_mha_weights(load_by_index, SelfAttentionEinsum, **CPU)
    with pytest.raises(CheckFailure, match="do not transpose"):
        checks.check_load_torch_mha_weights(load_transposed, SelfAttentionEinsum, **CPU)
    with pytest.raises(CheckFailure, match="stacked in the order q, k, v"):
        checks.check_load_torch_mha_weights(load_wrong_order, SelfAttentionEinsum, **CPU)
    with pytest.raises(CheckFailure, match="shares memory"):
        checks.check_load_torch_mha_weights(load_by_sharing, SelfAttentionEinsum, **CPU)
    with pytest.raises(CheckFailure, match="should still be an nn.Parameter"):
        checks.check_load_torch_mha_weights(load_plain_tensor, SelfAttentionEinsum, **CPU)


def test_load_torch_mha_weights_blames_the_module_when_only_the_module_is_wrong():
    with pytest.raises(CheckFailure, match="check MultiHeadSelfAttention itself"):
        checks.check_load_torch_mha_weights(load_by_index, variant(use_out=False), **CPU)


# --------------------------------------------------------------------------------------
# attention_layer_flops and the crossover question
# --------------------------------------------------------------------------------------


def flops_by_products(batch_size, seq_len, d_model):
    """A correct answer written as a list of matrix products, 2·m·k·n each."""
    def product(m, k, n):
        return 2 * m * k * n

    tokens = batch_size * seq_len
    projections = 4 * product(tokens, d_model, d_model)
    attention = batch_size * (product(seq_len, d_model, seq_len) + product(seq_len, seq_len, d_model))
    return {"attention": attention, "projections": projections}


def _flops(projections, attention):
    return lambda batch_size, seq_len, d_model: {
        "projections": projections(batch_size, seq_len, d_model), "attention": attention(batch_size, seq_len, d_model)}


_P = lambda b, s, d: 8 * b * s * d * d  # noqa: E731
_A = lambda b, s, d: 4 * b * s * s * d  # noqa: E731


def test_attention_layer_flops_is_measured_on_the_students_own_module(capsys):
    checks.check_attention_layer_flops(flops_by_products, SelfAttentionEinsum, device="cpu")
    printed = capsys.readouterr().out
    assert printed.startswith("✓ attention_layer_flops") and "note:" not in printed


@pytest.mark.parametrize("module, why", [
    (None, "no MultiHeadSelfAttention is defined"),
    (variant(use_out=False), "FLOPs in q/k/v/out_linear and"),
    (variant(builtin=True), "from-scratch"),
])
def test_attention_layer_flops_falls_back_to_a_reference_layer_and_says_so(module, why, capsys):
    checks.check_attention_layer_flops(flops_by_products, module, device="cpu")
    printed = capsys.readouterr().out
    assert "could not be measured" in printed and why in printed and "reference layer" in printed


def test_attention_layer_flops_finds_the_module_in_the_students_notebook(capsys):
    namespace = {"nn": nn, "torch": torch, "SelfAttentionEinsum": SelfAttentionEinsum}
    exec("MultiHeadSelfAttention = SelfAttentionEinsum\n"
         "def attention_layer_flops(batch_size, seq_len, d_model):\n"
         "    return {'projections': 8 * batch_size * seq_len * d_model ** 2,\n"
         "            'attention': 4 * batch_size * seq_len ** 2 * d_model}\n", namespace)
    checks.check_attention_layer_flops(namespace["attention_layer_flops"], device="cpu")
    assert "note:" not in capsys.readouterr().out


@pytest.mark.parametrize("wrong, phrase", [
    (_flops(lambda b, s, d: 4 * b * s * d * d, lambda b, s, d: 2 * b * s * s * d), "a multiply-add counts as 2 FLOPs"),
    (_flops(lambda b, s, d: 2 * b * s * d * d, _A), "you counted one projection"),
    (_flops(lambda b, s, d: 6 * b * s * d * d, _A), "you left out the output projection"),
    (_flops(_P, lambda b, s, d: 4 * b * s * d), "grows with S², not S"),
    (_flops(_P, lambda b, s, d: 2 * b * s * s * d), "but not weights @ V"),
    (_flops(lambda b, s, d: 8 * s * d * d, lambda b, s, d: 4 * s * s * d), "multiply by batch_size"),
    (_flops(_A, _P), "the two entries are swapped"),
    (_flops(_P, lambda b, s, d: 4 * b * s * s * d + 5 * b * s * s), "counts matrix products only"),
    # two mistakes that used to get numbers only (issue #34)
    (_flops(lambda b, s, d: 8 * b * s * d * d + 4 * b * s * d, _A), "you counted the biases"),
    (_flops(_P, lambda b, s, d: 12 * 4 * b * s * s * d), r"multiplied by the number of heads \(by 12\)"),
    (_flops(lambda b, s, d: float(8 * b * s * d * d), _A), "should be an int"),
    (lambda batch_size, seq_len, d_model: {"proj": 1, "attention": 2}, r"missing \['projections'\]"),
    (lambda batch_size, seq_len, d_model: (1, 2), "should return a dict"),
])
def test_attention_layer_flops_names_the_mistake(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_attention_layer_flops(wrong, SelfAttentionEinsum, **CPU)


def test_attention_layer_flops_rejects_numbers_typed_in_for_one_size():
    def hard_coded_vit(batch_size, seq_len, d_model):
        return flops_by_products(8, 197, 768)

    with pytest.raises(CheckFailure, match="does not match FlopCounterMode's count"):
        checks.check_attention_layer_flops(hard_coded_vit, SelfAttentionEinsum, **CPU)


def block_flops_by_parts(batch_size, seq_len, d_model, mlp_ratio=4):
    """A correct answer: attention_layer_flops's two parts, and the MLP's two products."""
    hidden = int(mlp_ratio * d_model)
    return {**flops_by_products(batch_size, seq_len, d_model),
            "mlp": 2 * batch_size * seq_len * d_model * hidden * 2}


def _block(mlp):
    return lambda batch_size, seq_len, d_model, mlp_ratio=4: {
        **flops_by_products(batch_size, seq_len, d_model), "mlp": mlp(batch_size, seq_len, d_model, mlp_ratio)}


def test_block_flops_accepts_the_count_by_parts():
    checks.check_block_flops(block_flops_by_parts, **CPU)
    checks.check_block_flops(block_flops_by_parts, seed=1902, **CPU)


@pytest.mark.parametrize("wrong, phrase", [
    # the MLP at half the count: one product left out, or a multiply-add counted once: both named (issue #52)
    (_block(lambda b, s, d, r: 2 * b * s * d * int(r * d)), "a multiply-add was counted as 1 FLOP"),
    (_block(lambda b, s, d, r: 2 * b * s * d * int(r * d)), "one of its two matrix products is missing"),
    (_block(lambda b, s, d, r: 4 * s * d * int(r * d)), "multiply by batch_size"),  # the batch forgotten in the MLP
    (lambda batch_size, seq_len, d_model, mlp_ratio=4: {  # every part counted with a multiply-add as one FLOP
        key: value // 2 for key, value in block_flops_by_parts(batch_size, seq_len, d_model, mlp_ratio).items()},
     "a multiply-add counts as 2 FLOPs"),
    # attention over the pairs a causal mask keeps: S·(S+1)/2 of them, or half the table
    (lambda batch_size, seq_len, d_model, mlp_ratio=4: {
        **block_flops_by_parts(batch_size, seq_len, d_model, mlp_ratio),
        "attention": 2 * 2 * batch_size * d_model * seq_len * (seq_len + 1) // 2}, "a mask saves no product"),
    (lambda batch_size, seq_len, d_model, mlp_ratio=4: {
        **block_flops_by_parts(batch_size, seq_len, d_model, mlp_ratio),
        "attention": 2 * batch_size * seq_len * seq_len * d_model}, "or you halved it for a causal mask"),
    (_block(lambda b, s, d, r: 16 * b * s * d * d), "not d_model or 4 · d_model"),
    (_block(lambda b, s, d, r: 4 * b * s * d * d), "not d_model or 4 · d_model"),
    (_block(lambda b, s, d, r: 4 * b * s * d * r * d), "should be an int"),
    (lambda batch_size, seq_len, d_model, mlp_ratio=4: {**_flops(_P, lambda b, s, d: 2 * b * s * s * d)(
        batch_size, seq_len, d_model), "mlp": 16 * batch_size * seq_len * d_model ** 2}, "but not weights @ V"),
    (lambda batch_size, seq_len, d_model, mlp_ratio=4: flops_by_products(batch_size, seq_len, d_model),
     r"missing \['mlp'\]"),
    (lambda batch_size, seq_len, d_model: block_flops_by_parts(batch_size, seq_len, d_model), "mlp_ratio"),
])
def test_block_flops_names_the_mistake(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_block_flops(wrong, **CPU)


def test_flop_counts_may_be_numpy_integers():
    """np.int64 is an int (issue #52): a count computed with NumPy passes."""
    def block_flops_numpy(batch_size, seq_len, d_model, mlp_ratio=4):
        return {key: np.int64(value) for key, value in block_flops_by_parts(batch_size, seq_len, d_model,
                                                                            mlp_ratio).items()}

    checks.check_block_flops(block_flops_numpy, **CPU)
    checks.check_attention_layer_flops(lambda batch_size, seq_len, d_model: {
        key: np.int64(value) for key, value in flops_by_products(batch_size, seq_len, d_model).items()},
        SelfAttentionEinsum, **CPU)


def test_the_check_module_ships_no_function_that_answers_the_flop_questions():
    """The counts are FlopCounterMode's, measured on modules the checks build: no function of the package returns
    an answer when called with the exercise's sizes (issue #51: `_reference_count(b, s, d, h)` did)."""
    import inspect

    answers = [flops_by_products(3, 7, 16), block_flops_by_parts(3, 7, 16)]
    for name, function in vars(checks).items():
        if not inspect.isfunction(function) or function.__module__ != checks.__name__:
            continue
        required = [p for p in inspect.signature(function).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        for sizes in ((3, 7, 16), (3, 7, 16, 4), (3, 7, 16, 4, 64)):
            if len(required) != len(sizes):
                continue
            try:
                result = function(*sizes)
            except Exception:  # not a function of sizes
                continue
            found = dict(result.items()) if isinstance(result, dict) else None
            assert found not in answers, f"{name}{sizes} returns an answer: {found}"


def test_attention_crossover_takes_the_number_and_explains_only_once_right(capsys):
    checks.check_answer_attention_crossover(4608, device="cpu")
    checks.check_answer_attention_crossover(4608.0, device="cpu")
    checks.check_answer_attention_crossover(np.int64(4608), device="cpu")  # a NumPy integer is a number (#52)
    assert "S = 6·D = 4,608" in capsys.readouterr().out
    for value, hint in [(1536, "projections_only"), (3072, "mlp_only"), (768, "one_projection"),
                        (9216, "half_of_attention")]:
        with pytest.raises(CheckFailure, match=re.escape(checks.CROSSOVER_HINTS[hint])) as failure:
            checks.check_answer_attention_crossover(value, **CPU)
        assert "4,608" not in str(failure.value) and "6·D" not in str(failure.value)
    for wrong, phrase in [(None, "not implemented yet"), ("D", "should be a number"), (True, "should be a number"),
                          (float("nan"), "should be a number"), (5000, "is not right")]:
        with pytest.raises(CheckFailure, match=phrase):
            checks.check_answer_attention_crossover(wrong, **CPU)


# --------------------------------------------------------------------------------------
# Closing the loopholes and naming the mistakes (issue: checks that say what matters)
# --------------------------------------------------------------------------------------


def test_split_heads_einops_accepts_rearrange_then_transpose():
    def rearrange_then_transpose(x, num_heads):
        if x.shape[-1] % num_heads:
            raise ValueError(f"D={x.shape[-1]} is not divisible by H={num_heads}")
        return rearrange(x, "b s (h d) -> b s h d", h=num_heads).transpose(1, 2)

    checks.check_split_heads_einops(rearrange_then_transpose, **CPU)


def test_split_heads_einops_rejects_split_heads_plus_a_trivial_rearrange():
    def trivial_rearrange_after(x, num_heads):
        return rearrange(split_heads_unflatten(x, num_heads), "b h s d -> b h s d")

    def trivial_rearrange_before(x, num_heads):
        return split_heads_unflatten(rearrange(x, "b s d -> b s d"), num_heads)

    for cheat in (trivial_rearrange_after, trivial_rearrange_before):
        with pytest.raises(CheckFailure, match="einops must do the split itself"):
            checks.check_split_heads_einops(cheat, **CPU)


def _einops_layer_split(x, num_heads):
    from einops.layers.torch import Rearrange

    if x.shape[-1] % num_heads:
        raise ValueError(f"D={x.shape[-1]} is not divisible by H={num_heads}")
    return Rearrange("b s (h d) -> b h s d", h=num_heads)(x)


def _einops_repeat_split(x, num_heads):
    import einops

    if x.shape[-1] % num_heads:
        raise ValueError(f"D={x.shape[-1]} is not divisible by H={num_heads}")
    return einops.repeat(x, "b s (h d) -> b h s d", h=num_heads)  # repeat with nothing to repeat


def _einops_module_attribute_split(x, num_heads):
    import einops.einops

    if x.shape[-1] % num_heads:
        raise ValueError(f"D={x.shape[-1]} is not divisible by H={num_heads}")
    return einops.einops.rearrange(x, "b s (h d) -> b h s d", h=num_heads)


@pytest.mark.parametrize("answer", [_einops_layer_split, _einops_repeat_split, _einops_module_attribute_split])
def test_split_heads_einops_accepts_every_einops_entry_point(answer):
    checks.check_split_heads_einops(answer, **CPU)


@pytest.fixture
def einops_layers_not_imported_yet(monkeypatch):
    """As in a fresh kernel: the answer's own ``from einops.layers.torch import ...`` runs that
    module's code, inside the check (restored after the test)."""
    import einops.layers

    for name in [n for n in sys.modules if n.startswith("einops.layers.")]:
        monkeypatch.delitem(sys.modules, name)
    for name in [n for n in vars(einops.layers) if isinstance(getattr(einops.layers, n), type(sys))]:
        monkeypatch.delattr(einops.layers, name)


def test_split_heads_einops_accepts_a_layer_imported_for_the_first_time(einops_layers_not_imported_yet):
    checks.check_split_heads_einops(_einops_layer_split, **CPU)
    assert "einops.layers.torch" in sys.modules, "the answer did not import the layer inside the check"


def test_split_heads_einops_rejects_einops_that_does_not_split(einops_layers_not_imported_yet):
    import einops

    def pack_then_split_heads(x, num_heads):
        packed, _ = einops.pack([x], "b s *")
        return split_heads_unflatten(packed, num_heads)

    def layer_never_applied(x, num_heads):
        from einops.layers.torch import Rearrange

        Rearrange("b s (h d) -> b h s d", h=num_heads)
        return split_heads_unflatten(x, num_heads)

    with pytest.raises(CheckFailure, match=r"calls einops only as pack[\s\S]*einops must do the split itself"):
        checks.check_split_heads_einops(pack_then_split_heads, **CPU)
    with pytest.raises(CheckFailure, match=r"only as a layer that it never applies"):
        checks.check_split_heads_einops(layer_never_applied, **CPU)


def weights_untransposed(q, k, mask=None):
    scores = q @ k / math.sqrt(q.shape[-1])  # forgot k.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1)


def test_attention_weights_names_the_missing_transpose_when_q_at_k_raises():
    with pytest.raises(CheckFailure, match=r"raised RuntimeError[\s\S]*Likely mistake: use k.transpose\(-2, -1\)"):
        checks.check_attention_weights(weights_untransposed, **CPU)


def test_scaled_dot_product_attention_names_the_missing_transpose_and_the_transposed_weights():
    def untransposed(q, k, v, mask=None):
        weights = weights_untransposed(q, k, mask)
        return weights @ v, weights

    with pytest.raises(CheckFailure, match=r"Likely mistake: use k.transpose"):
        checks.check_scaled_dot_product_attention(untransposed, **CPU)

    def weights_transposed(q, k, v, mask=None):
        weights = weights_einsum(q, k, mask)
        return weights.transpose(-2, -1) @ v if q.shape[-2] == k.shape[-2] else weights @ v, weights

    with pytest.raises(CheckFailure, match=r"not its transpose"):
        checks.check_scaled_dot_product_attention(weights_transposed, **CPU)


def test_multi_head_self_attention_names_a_wrong_helper_it_uses():
    """A module built on a wrong split_heads fails, and the message says to fix split_heads first."""
    namespace = {"torch": torch, "nn": nn, "math": math}
    exec(  # the student's notebook: a wrong split_heads (no permute is caught by shape) used by the module
        "def split_heads(x, num_heads):\n"
        "    b, s, d = x.shape\n"
        "    return x.reshape(b, num_heads, s, d // num_heads)\n"
        "class MultiHeadSelfAttention(nn.Module):\n"
        "    def __init__(self, embed_dim, num_heads, bias=True):\n"
        "        super().__init__()\n"
        "        self.num_heads = num_heads\n"
        "        self.q_linear, self.k_linear, self.v_linear, self.out_linear = (\n"
        "            nn.Linear(embed_dim, embed_dim, bias=bias) for _ in range(4))\n"
        "    def forward(self, x, mask=None, return_weights=False):\n"
        "        q, k, v = (split_heads(f(x), self.num_heads) for f in (self.q_linear, self.k_linear, self.v_linear))\n"
        "        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])\n"
        "        if mask is not None:\n"
        "            scores = scores.masked_fill(~mask, float('-inf'))\n"
        "        weights = scores.softmax(-1)\n"
        "        out = self.out_linear((weights @ v).transpose(1, 2).flatten(2))\n"
        "        return (out, weights) if return_weights else out\n",
        namespace)
    with pytest.raises(CheckFailure, match=r"uses your split_heads, which fails its own check[\s\S]*Fix split_heads first"):
        checks.check_multi_head_self_attention(namespace["MultiHeadSelfAttention"], **CPU)


def test_multi_head_self_attention_names_the_missing_transpose():
    class Untransposed(SelfAttentionEinsum):
        def forward(self, x, mask=None, return_weights=False):
            q, k, v = (rearrange(f(x), "b s (h d) -> b h s d", h=self.num_heads)
                       for f in (self.q_linear, self.k_linear, self.v_linear))
            weights = weights_untransposed(q, k, mask)
            out = self.out_linear(rearrange(weights @ v, "b h s d -> b s (h d)"))
            return (out, weights) if return_weights else out

    with pytest.raises(CheckFailure, match=r"Likely mistake: use k.transpose"):
        checks.check_multi_head_self_attention(Untransposed, **CPU)


def test_no_reference_in_the_check_module_is_a_working_answer():
    """Every function the check module defines fails every check of notebook 01 (nothing to import)."""
    import inspect

    candidates = [obj for name, obj in vars(checks).items()
                  if inspect.isfunction(obj) and obj.__module__ == checks.__name__ and not name.startswith("check_")]
    single_answer = [checks.check_split_heads, checks.check_merge_heads, checks.check_split_heads_einops,
                     checks.check_attention_weights, checks.check_scaled_dot_product_attention,
                     checks.check_multi_head_self_attention, checks.check_attention_layer_flops]
    for candidate in candidates:
        for check in single_answer:
            with pytest.raises(Exception):
                check(candidate, **CPU)


def test_answer_draft_bug_accepts_the_peakier_prediction_and_names_what_to_reread():
    checks.check_answer_draft_bug(" b ", **CPU)
    for letter in "ACD":
        hint = checks.DRAFT_BUG_HINTS[choice_digest("ANSWER_DRAFT_BUG", letter)]
        with pytest.raises(CheckFailure, match=re.escape(hint)) as failure:
            checks.check_answer_draft_bug(letter, **CPU)
        assert '"B"' not in str(failure.value).split("is not right")[-1]  # never names the right letter
    with pytest.raises(CheckFailure, match="not implemented yet"):
        checks.check_answer_draft_bug(None, **CPU)


def test_attention_weights_accepts_hugging_face_eager_softmax_in_float32(capsys):
    """HF's eager attention: softmax in float32, cast back. On float64 input that is float32-accurate: accepted, with a note."""
    def eager(q, k, mask=None):
        scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
        if mask is not None:
            scores = scores + torch.zeros_like(scores).masked_fill(~mask, torch.finfo(scores.dtype).min)
        return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)

    checks.check_attention_weights(eager, device="cpu")
    printed = capsys.readouterr().out
    assert printed.startswith("✓ attention_weights") and "float32 precision" in printed


# --------------------------------------------------------------------------------------
# Inputs changed in place, and the keep-the-input's-dtype rule (framework behaviour, met in 01)
# --------------------------------------------------------------------------------------


def weights_scaling_q_in_place(q, k, mask=None):
    q *= q.shape[-1] ** -0.5  # changes the caller's q
    scores = q @ k.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1)


def weights_masking_k_in_place(q, k, mask=None):
    k.mul_(1.0 / math.sqrt(q.shape[-1]))
    return weights_no_scale(q, k, mask)


def test_an_in_place_scale_is_named_as_such_not_as_a_missing_scale():
    with pytest.raises(CheckFailure) as failure:
        checks.check_attention_weights(weights_scaling_q_in_place, **CPU)
    message = str(failure.value)
    assert "changed its input q in place" in message and "`q *= ...`" in message
    assert "no 1/sqrt" not in message
    with pytest.raises(CheckFailure, match=r"changed its input k in place[\s\S]*`k \*= ...` \(or `k.mul_\(...\)`\)"):
        checks.check_attention_weights(weights_masking_k_in_place, **CPU)

    def sdpa_in_place(q, k, v, mask=None):
        weights = weights_einsum(q, k, mask)
        return v.copy_(weights @ v) if weights.shape[-1] == v.shape[-2] == weights.shape[-2] else weights @ v, weights

    with pytest.raises(CheckFailure, match=r"changed its input v in place[\s\S]*`v.copy_\(...\)`"):
        checks.check_scaled_dot_product_attention(sdpa_in_place, **CPU)


def test_a_module_that_changes_its_input_in_place_is_told_so():
    class AddsInPlace(SelfAttentionEinsum):
        def forward(self, x, mask=None, return_weights=False):
            result = super().forward(x, mask, return_weights)
            x += 0.0 * x + 1.0  # a residual written in place on the caller's tensor
            return result

    with pytest.raises(CheckFailure, match=r"changed its input x in place[\s\S]*`x \+= ...`"):
        checks.check_multi_head_self_attention(AddsInPlace, **CPU)


def test_dtype_failures_in_01_name_the_rule():
    def weights_in_float32(q, k, mask=None):
        return weights_einsum(q.float(), k.float(), mask)

    with pytest.raises(CheckFailure, match=r"should keep the input dtype torch.float64, got torch.float32[\s\S]*"
                                           r"The rule of every notebook"):
        checks.check_attention_weights(weights_in_float32, **CPU)

    class CastsToFloat32(SelfAttentionEinsum):
        def forward(self, x, mask=None, return_weights=False):
            return super().forward(x.float(), mask, return_weights)  # float32 into float64 layers: a crash

    with pytest.raises(CheckFailure, match=r"raised RuntimeError[\s\S]*Likely mistake: your code mixes float32 and "
                                           r"float64[\s\S]*keep the input's dtype"):
        checks.check_multi_head_self_attention(CastsToFloat32, **CPU)


def test_a_self_contained_module_is_not_told_to_fix_a_helper_it_never_calls():
    namespace = {"torch": torch, "nn": nn, "math": math, "rearrange": rearrange}
    exec(  # a wrong split_heads in the notebook, and a module that never calls it (and forgets the scale)
        "def split_heads(x, num_heads):\n"
        "    b, s, d = x.shape\n"
        "    return x.reshape(b, num_heads, s, d // num_heads)\n"
        "class MultiHeadSelfAttention(nn.Module):\n"
        "    def __init__(self, embed_dim, num_heads, bias=True):\n"
        "        super().__init__()\n"
        "        self.num_heads = num_heads\n"
        "        self.q_linear, self.k_linear, self.v_linear, self.out_linear = (\n"
        "            nn.Linear(embed_dim, embed_dim, bias=bias) for _ in range(4))\n"
        "    def forward(self, x, mask=None, return_weights=False):\n"
        "        q, k, v = (rearrange(f(x), 'b s (h d) -> b h s d', h=self.num_heads)\n"
        "                   for f in (self.q_linear, self.k_linear, self.v_linear))\n"
        "        scores = q @ k.transpose(-2, -1)\n"
        "        if mask is not None:\n"
        "            scores = scores.masked_fill(~mask, float('-inf'))\n"
        "        weights = scores.softmax(-1)\n"
        "        out = self.out_linear(rearrange(weights @ v, 'b h s d -> b s (h d)'))\n"
        "        return (out, weights) if return_weights else out\n",
        namespace)
    with pytest.raises(CheckFailure) as failure:
        checks.check_multi_head_self_attention(namespace["MultiHeadSelfAttention"], **CPU)
    assert "no 1/sqrt(d_head) scaling" in str(failure.value) and "Note:" not in str(failure.value)
