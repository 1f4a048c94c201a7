"""Tests of notebook 05's checks (attention_lab.checks.llama_attention) and its widgets.

For every exercise: a correct answer written differently from the solution passes; the
mistakes the hints name are rejected with that hint; contract violations name what was
expected and what came back.
"""

from __future__ import annotations

import dataclasses
import math
import re
import textwrap
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from attention_lab.checking import CheckFailure
from attention_lab.checks import llama_attention as checks
from tests.bridge_harness import run_both_ways

# Every test twice: the checks in the student's kernel (the lab), and through the bridge (grading).
where_checks_run = run_both_ways()

CPU = "cpu"


# --------------------------------------------------------------------------------------
# Correct answers, written differently from the notebook's solutions
# --------------------------------------------------------------------------------------


def config_class(name, post_init=None):
    """A dataclass with the contract's fields and defaults (the checks hold the one table of them)."""
    fields = [(field, type(default), dataclasses.field(default=default))
              for field, default in checks.CONFIG_DEFAULTS.items()]
    namespace = {"__post_init__": post_init} if post_init else {}
    return dataclasses.make_dataclass(name, fields, namespace=namespace)


def _validate(self):
    problems = []
    if self.num_attention_heads % self.num_key_value_heads:
        problems.append(f"{self.num_attention_heads} query heads do not split into {self.num_key_value_heads} KV groups")
    if self.head_dim % 2:
        problems.append(f"odd head_dim {self.head_dim}")
    if problems:
        raise ValueError("; ".join(problems))


GoodConfig = config_class("GoodConfig", _validate)


def good_causal_mask(seq_len, device=None):
    index = torch.arange(seq_len, device=device)
    return index[None, :] <= index[:, None]


def good_rope_frequencies(head_dim, max_positions, base=10000.0):
    # Meta's own recipe: float32 angles, complex64 table (less precise, still correct).
    inverse = 1.0 / (base ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(max_positions).float(), inverse)
    return torch.polar(torch.ones_like(angles), angles)


def good_apply_rope(x, freqs_cis, position_ids):
    # Real arithmetic on the (even, odd) features instead of complex numbers.
    rotation = freqs_cis.to(x.device)[position_ids].unsqueeze(1)  # [B, 1, S, d/2]
    cos, sin = rotation.real, rotation.imag
    wide = torch.promote_types(x.dtype, cos.dtype)
    even, odd = x[..., 0::2].to(wide), x[..., 1::2].to(wide)
    out = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return out.to(x.dtype)


def good_rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def good_rope_cos_sin(head_dim, position_ids, base=10000.0):
    # Hugging Face's recipe: float32 tables.
    inverse = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim))
    freqs = position_ids[..., None].float() * inverse
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def good_apply_rope_rotate_half(x, cos, sin):
    cos, sin = cos.unsqueeze(1).type_as(x), sin.unsqueeze(1).type_as(x)
    return x * cos + good_rotate_half(x) * sin


def good_permutation(head_dim):
    return torch.arange(head_dim).view(-1, 2).T.reshape(-1)


def good_qk_norm(x, eps):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps)


def hf_rms_norm(x, eps):
    # Hugging Face's LlamaRMSNorm (without its weight): float32 inside, cast back.
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return (hidden * torch.rsqrt(variance + eps)).to(input_dtype)


def llama4_l2_norm(x, eps):
    # Llama 4's L2Norm: x.float(), normalise, .type_as(x).
    def norm(y):
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)

    return norm(x.float()).type_as(x)


def good_repeat_kv(x, n_rep):
    return torch.repeat_interleave(x, n_rep, dim=1)


class GoodKVCache:
    def __init__(self):
        self.k_parts, self.v_parts = [], []

    @property
    def seq_len(self):
        return sum(part.shape[2] for part in self.k_parts)

    def update(self, k, v):
        self.k_parts.append(k)
        self.v_parts.append(v)
        return torch.cat(self.k_parts, dim=2), torch.cat(self.v_parts, dim=2)


def good_kv_cache_bytes(num_layers, num_kv_heads, head_dim, seq_len, batch_size, bytes_per_element):
    return math.prod((2, num_layers, num_kv_heads, head_dim, seq_len, batch_size, bytes_per_element))


class Llama(nn.Module):
    """A correct LlamaAttention (einsum, per-group loop instead of repeat_kv); ``bugs`` injects known mistakes."""

    def __init__(self, config, bugs=()):
        super().__init__()
        self.config, self.bugs = config, set(bugs)
        h, h_kv, d, hidden = (config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                              config.hidden_size)
        out_q = hidden if "square_projections" in self.bugs else h * d
        out_kv = hidden if "square_projections" in self.bugs else h_kv * d
        self.q_proj = nn.Linear(hidden, out_q, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, out_kv, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, out_kv, bias=config.attention_bias)
        self.o_proj = nn.Linear(out_q, hidden, bias=config.attention_bias)
        if "o_proj_square" in self.bugs:  # Linear(D, D): right only when H·head_dim == hidden_size
            self.o_proj = nn.Linear(hidden, hidden, bias=config.attention_bias)
        if "o_proj_swapped" in self.bugs:
            self.o_proj = nn.Linear(hidden, out_q, bias=config.attention_bias)
        if "kv_with_h_heads" in self.bugs and out_q != hidden:  # (where H·d == D it is the square mistake)
            self.k_proj = nn.Linear(hidden, out_q, bias=config.attention_bias)
        if "meta_table" in self.bugs:  # not a bug: Meta's float32 angles, complex64 table
            self.table = good_rope_frequencies(d, config.max_position_embeddings, config.rope_theta)
        else:
            self.table = checks._complex_table(d, config.max_position_embeddings, config.rope_theta, dtype=torch.complex128)

    def rope(self, x, ids):
        if "half_layout" in self.bugs:
            cos, sin = good_rope_cos_sin(x.shape[-1], ids, self.config.rope_theta)
            return good_apply_rope_rotate_half(x, cos.double(), sin.double())
        return good_apply_rope(x, self.table, ids)

    def norm(self, x):
        if "l2" in self.bugs:
            return F.normalize(x, dim=-1)
        if "rms_norm_builtin" in self.bugs:
            return F.rms_norm(x, (x.shape[-1],), eps=self.config.rms_norm_eps)
        eps = 1e-6 if "fixed_eps" in self.bugs else self.config.rms_norm_eps
        if "float32_norm" in self.bugs:  # not a bug: Hugging Face's LlamaRMSNorm computes in float32
            return hf_rms_norm(x, eps)
        return good_qk_norm(x, eps)

    def forward(self, hidden_states, position_ids=None, kv_cache=None):
        c, bugs = self.config, self.bugs
        b, s, _ = hidden_states.shape
        h, h_kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        past = kv_cache.seq_len if kv_cache is not None else 0
        if "no_cache_offset" in bugs:
            past_for_positions = 0
        else:
            past_for_positions = past
        if position_ids is None or "ignore_position_ids" in bugs:
            position_ids = torch.arange(past_for_positions, past_for_positions + s,
                                        device=hidden_states.device).expand(b, s)
        q = self.q_proj(hidden_states).unflatten(-1, (h, d)).transpose(1, 2)
        k = self.k_proj(hidden_states).unflatten(-1, (h_kv, d)).transpose(1, 2)
        v = self.v_proj(hidden_states).unflatten(-1, (h_kv, d)).transpose(1, 2)
        if "split_reshape" in bugs:  # [B, S, H*d] reshaped straight to [B, H, S, d]
            q = self.q_proj(hidden_states).reshape(b, h, s, d)
        q, k = self.rope(q, position_ids), self.rope(k, position_ids)
        if "rope_conjugate" in bugs:  # rotated by -angle: the conjugate table
            table = self.table.conj()
            q, k = (good_apply_rope(t, table, position_ids) for t in (self.q_proj(hidden_states).unflatten(
                -1, (h, d)).transpose(1, 2), self.k_proj(hidden_states).unflatten(-1, (h_kv, d)).transpose(1, 2)))
        if "rope_on_v" in bugs:
            v = self.rope(v, position_ids)
        if (c.use_qk_norm and "no_qk_norm" not in bugs) or "always_qk_norm" in bugs:
            q, k = self.norm(q), self.norm(k)
        if kv_cache is not None:
            k_all, v_all = kv_cache.update(k, v)
            if "cache_ignored" not in bugs:
                k, v = k_all, v_all
        total = k.shape[2]
        if "tiled" in bugs:
            k, v = k.repeat(1, h // h_kv, 1, 1), v.repeat(1, h // h_kv, 1, 1)
        elif "own_repeat_kv" in bugs:  # the notebook's own repeat_kv, looked up where the class was defined
            repeat = self.forward.__globals__.get("repeat_kv", good_repeat_kv)
            k, v = repeat(k, h // h_kv), repeat(v, h // h_kv)
        else:
            k, v = good_repeat_kv(k, h // h_kv), good_repeat_kv(v, h // h_kv)
        if "sdpa" in bugs:
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scale = 1 / math.sqrt(c.hidden_size if "scale_hidden" in bugs else d)
            scale = 1.0 if "no_scale" in bugs else scale
            scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
            offset = 0 if "mask_top_left" in bugs else total - s
            blocked = torch.ones(s, total, dtype=torch.bool, device=q.device).triu(1 + offset)
            if "no_mask" not in bugs and not ("mask_only_prefill" in bugs and past > 0):
                scores = scores.masked_fill(blocked, -math.inf)
            weights = scores.float().softmax(-1).to(scores.dtype) if "softmax_float32" in bugs else scores.softmax(-1)
            if "softmax_queries" in bugs:
                weights = scores.softmax(-2).nan_to_num(0.0)
            context = torch.einsum("bhqk,bhkd->bhqd", weights, v)
        merged_width = c.hidden_size if "merge_hidden" in bugs else h * d
        out = context.transpose(1, 2).reshape(b, s, merged_width)
        if "merge_reshape" in bugs:
            out = context.reshape(b, s, merged_width)
        if "no_o_proj" not in bugs:
            out = self.o_proj(out)
        if "off_in_float32" in bugs and out.dtype == torch.float32:  # a small error no known mistake explains
            out = out * (1 + 5e-4)
        if kv_cache is not None and "no_tuple" not in bugs:
            return out, kv_cache
        if "always_tuple" in bugs:
            return out, None
        return out


def llama_with(*bugs):
    class Buggy(Llama):
        def __init__(self, config):
            super().__init__(config, bugs)

    return Buggy


# --------------------------------------------------------------------------------------
# LlamaAttentionConfig
# --------------------------------------------------------------------------------------


def test_config_correct_answer_passes():
    checks.check_llama_attention_config(GoodConfig, quiet=True)
    checks.check_llama_attention_config(GoodConfig, seed=3, quiet=True)


def test_config_without_validation_is_rejected():
    with pytest.raises(CheckFailure, match="should raise ValueError"):
        checks.check_llama_attention_config(config_class("NoValidation"), quiet=True)



def test_config_requiring_hidden_divisible_is_rejected():
    @dataclass
    class TooStrict(GoodConfig):
        def __post_init__(self):
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"{self.hidden_size} % {self.num_attention_heads}")
            super().__post_init__()

    with pytest.raises(CheckFailure, match="head_dim is independent of hidden_size"):
        checks.check_llama_attention_config(TooStrict, quiet=True)


def test_config_deriving_head_dim_is_rejected():
    @dataclass
    class Derived(GoodConfig):
        def __post_init__(self):
            self.head_dim = self.hidden_size // self.num_attention_heads

    with pytest.raises(CheckFailure, match="head_dim must not be derived"):
        checks.check_llama_attention_config(Derived, quiet=True)


def test_config_error_message_must_name_numbers():
    @dataclass
    class Vague(GoodConfig):
        def __post_init__(self):
            if self.num_attention_heads % self.num_key_value_heads or self.head_dim % 2:
                raise ValueError("bad config")

    with pytest.raises(CheckFailure, match="should name 6 and 4"):
        checks.check_llama_attention_config(Vague, quiet=True)


def test_config_contract_failures():
    @dataclass
    class WrongDefault(GoodConfig):
        rms_norm_eps: float = 1e-6

    with pytest.raises(CheckFailure, match=r"rms_norm_eps should be 1e-05 \(float\), got 1e-06"):
        checks.check_llama_attention_config(WrongDefault, quiet=True)

    class NotADataclass:
        pass

    with pytest.raises(CheckFailure, match="decorated with @dataclass"):
        checks.check_llama_attention_config(NotADataclass, quiet=True)


# --------------------------------------------------------------------------------------
# causal_mask
# --------------------------------------------------------------------------------------


def test_causal_mask_correct_answer_passes():
    checks.check_causal_mask(good_causal_mask, device=CPU, quiet=True)


@pytest.mark.parametrize("wrong, phrase", [
    (lambda seq_len, device=None: ~torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril(), "polarity flipped"),
    (lambda seq_len, device=None: torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril(-1), "diagonal must be True"),
    (lambda seq_len, device=None: torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(), "upper triangle"),
    (lambda seq_len, device=None: torch.full((seq_len, seq_len), -math.inf, device=device).triu(1),
     "(?s)should be a boolean mask.*not the study notes' float mask"),
    (lambda seq_len, device=None: torch.ones(1, seq_len, seq_len, dtype=torch.bool, device=device).tril(), r"shape \[5, 5\], got \[1, 5, 5\]"),
])
def test_causal_mask_mistakes_are_named(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_causal_mask(wrong, device=CPU, quiet=True)


# --------------------------------------------------------------------------------------
# rope_frequencies
# --------------------------------------------------------------------------------------


def test_rope_frequencies_correct_answers_pass():
    checks.check_rope_frequencies(good_rope_frequencies, quiet=True)  # complex64, float32 angles

    def complex128(head_dim, max_positions, base=10000.0):
        theta = torch.tensor(base, dtype=torch.float64) ** (-2 * torch.arange(head_dim // 2, dtype=torch.float64) / head_dim)
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * theta
        return torch.complex(angles.cos(), angles.sin())

    checks.check_rope_frequencies(complex128, seed=2, quiet=True)


def _frequencies(factor=2.0, sign=-1.0, fixed_base=None, swap=False):
    def rope_frequencies(head_dim, max_positions, base=10000.0):
        base = fixed_base or base
        theta = base ** (sign * factor * torch.arange(head_dim // 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), theta)
        if swap:
            return torch.complex(angles.sin(), angles.cos())
        return torch.polar(torch.ones_like(angles), angles)

    return rope_frequencies


def seed_rope_calculation(head_dim, max_positions, base=10000.0):
    # The notes' version: the duplicated table, [P, d] (the slice came later, in apply).
    inverse = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions).float(), inverse)
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.complex(emb.cos(), emb.sin())


@pytest.mark.parametrize("wrong, phrase", [
    (_frequencies(factor=1.0), "the exponent has a factor 2"),
    (_frequencies(sign=1.0), "the frequencies must decrease"),
    (_frequencies(swap=True), "cos and sin are swapped"),
    (lambda head_dim, max_positions, base=10000.0: _frequencies()(head_dim, max_positions, base).conj(),
     r"exp\(-i·p·θ_j\), the conjugate"),
    (_frequencies(fixed_base=10000.0), "use the base argument"),
    (seed_rope_calculation, r"one entry per \*pair\*"),
    (lambda head_dim, max_positions, base=10000.0: torch.outer(torch.arange(max_positions).double(), base ** (-torch.arange(0, head_dim, 2).double() / head_dim)),
     "should return a complex tensor"),
])
def test_rope_frequencies_mistakes_are_named(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_rope_frequencies(wrong, quiet=True)


# --------------------------------------------------------------------------------------
# apply_rope
# --------------------------------------------------------------------------------------


def test_apply_rope_correct_answer_passes():
    checks.check_apply_rope(good_apply_rope, device=CPU, quiet=True)
    checks.check_apply_rope(good_apply_rope, seed=7, device=CPU, quiet=True)


def _complex_rope(x, freqs_cis, position_ids):
    pairs = torch.view_as_complex(x.to(torch.promote_types(x.dtype, torch.float32)).reshape(*x.shape[:-1], -1, 2).contiguous())
    return pairs, freqs_cis.to(x.device)[position_ids][:, None]


def rope_downcast(x, freqs_cis, position_ids):  # the notes' xq.float()
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    rotated = pairs * freqs_cis[position_ids][:, None].to(torch.complex64)
    return torch.view_as_real(rotated).flatten(-2)


def rope_complex_unflattened(x, freqs_cis, position_ids):  # forgot view_as_real: a complex [..., d/2]
    pairs, rotation = _complex_rope(x, freqs_cis, position_ids)
    return pairs * rotation


def rope_meta_type_as(x, freqs_cis, position_ids):  # Meta's apply_rotary_emb: float32 inside, dtype kept
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = pairs * freqs_cis.to(x.device)[position_ids][:, None].to(torch.complex64)
    return torch.view_as_real(rotated).flatten(3).type_as(x)


def rope_conjugate(x, freqs_cis, position_ids):
    pairs, rotation = _complex_rope(x, freqs_cis, position_ids)
    return torch.view_as_real(pairs * rotation.conj()).flatten(-2).to(x.dtype)


def rope_arange(x, freqs_cis, position_ids):
    return good_apply_rope(x, freqs_cis, torch.arange(x.shape[2], device=x.device).expand(x.shape[0], -1))


GLOBAL_POSITION_IDS = torch.arange(5).expand(2, 5)  # a notebook global, as in the notes


def rope_global_positions(x, freqs_cis, position_ids):
    return good_apply_rope(x, freqs_cis, GLOBAL_POSITION_IDS)


def rope_first_row(x, freqs_cis, position_ids):
    return good_apply_rope(x, freqs_cis, position_ids[:1].expand_as(position_ids))


def rope_half_layout(x, freqs_cis, position_ids):
    angles = torch.angle(freqs_cis.to(x.device)[position_ids]).to(torch.float64)
    emb = torch.cat([angles, angles], dim=-1)
    return good_apply_rope_rotate_half(x, emb.cos(), emb.sin())


def rope_in_place(x, freqs_cis, position_ids):
    x.copy_(good_apply_rope(x, freqs_cis, position_ids))
    return x


def rope_complex_out(x, freqs_cis, position_ids):
    pairs, rotation = _complex_rope(x, freqs_cis, position_ids)
    return torch.view_as_real(pairs * rotation).to(x.dtype)


@pytest.mark.parametrize("wrong, phrase", [
    (rope_downcast, "silently downcasts float64"),
    (rope_conjugate, "you rotate by -angle"),
    (rope_arange, "does not follow position_ids"),
    (rope_global_positions, "does not follow position_ids"),
    (rope_first_row, "each sequence of the batch has its own positions"),
    (rope_half_layout, "wrong pairing layout: the Meta layout rotates adjacent features"),
    (rope_in_place, "changed its input x in place"),
    (rope_complex_out, r"flatten the \(real, imaginary\) axis back"),
    (rope_complex_unflattened, "convert the complex result back"),
    (rope_meta_type_as, "(?s)only to float32 precision.*keep float64"),
])
def test_apply_rope_mistakes_are_named(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_apply_rope(wrong, device=CPU, quiet=True)


def test_apply_rope_dtype_message_names_both_dtypes():
    with pytest.raises(CheckFailure, match="returned float32, but x is float64"):
        checks.check_apply_rope(rope_downcast, device=CPU, quiet=True)


# --------------------------------------------------------------------------------------
# rotate_half, rope_cos_sin, apply_rope_rotate_half
# --------------------------------------------------------------------------------------


def test_rotate_half_correct_answer_passes():
    checks.check_rotate_half(good_rotate_half, device=CPU, quiet=True)


@pytest.mark.parametrize("wrong, phrase", [
    (lambda x: torch.cat([x[..., x.shape[-1] // 2:], -x[..., : x.shape[-1] // 2]], -1), "rotate_half sign"),
    (lambda x: torch.cat([x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]], -1), "must negate the second half"),
    (lambda x: torch.stack([-x[..., 1::2], x[..., 0::2]], -1).flatten(-2), "works on the two halves"),
    (lambda x: torch.cat([-x[..., 1::2], x[..., 0::2]], -1), "works on the two halves"),
    (lambda x: good_rotate_half(x).float(), "returned float32, but x is float64"),
])
def test_rotate_half_mistakes_are_named(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_rotate_half(wrong, device=CPU, quiet=True)


def test_rope_cos_sin_correct_answers_pass():
    checks.check_rope_cos_sin(good_rope_cos_sin, device=CPU, quiet=True)  # float32 tables

    def float64_tables(head_dim, position_ids, base=10000.0):
        angles = checks._angles(head_dim, position_ids, base)
        return torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    checks.check_rope_cos_sin(float64_tables, seed=4, device=CPU, quiet=True)


def _cos_sin(layout="half", factor=2.0, swap=False, arange=False, half_width=False):
    def rope_cos_sin(head_dim, position_ids, base=10000.0):
        ids = torch.arange(position_ids.shape[1]).expand_as(position_ids) if arange else position_ids
        angles = checks._angles(head_dim, ids, base, factor=factor)
        if not half_width:
            angles = torch.cat([angles, angles], -1) if layout == "half" else angles.repeat_interleave(2, -1)
        cos, sin = angles.cos(), angles.sin()
        return (sin, cos) if swap else (cos, sin)

    return rope_cos_sin


@pytest.mark.parametrize("wrong, phrase", [
    (_cos_sin(layout="interleaved"), "repeat the head_dim/2 angles as two halves"),
    (_cos_sin(factor=1.0), "the exponent has a factor 2"),
    (_cos_sin(swap=True), "cos and sin are swapped"),
    (_cos_sin(arange=True), "does not follow position_ids"),
    (_cos_sin(half_width=True), r"should have shape \[2, 5, 8\], got \[2, 5, 4\]"),
    (lambda head_dim, position_ids, base=10000.0: torch.zeros(1), r"should return a tuple \(cos, sin\)"),
])
def test_rope_cos_sin_mistakes_are_named(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_rope_cos_sin(wrong, device=CPU, quiet=True)


def test_apply_rope_rotate_half_correct_answer_passes():
    checks.check_apply_rope_rotate_half(good_apply_rope_rotate_half, device=CPU, quiet=True)


def rotate_half_rope_meta_pairs(x, cos, sin):
    angles = torch.atan2(sin, cos)[..., : x.shape[-1] // 2].to(torch.float64)
    pos_table = torch.polar(torch.ones_like(angles), angles)  # per token, not per position
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * pos_table[:, None]).flatten(-2).to(x.dtype)


@pytest.mark.parametrize("wrong, phrase", [
    (lambda x, cos, sin: x * cos[:, None].type_as(x) - good_rotate_half(x) * sin[:, None].type_as(x), "pairs turn the wrong way"),
    (lambda x, cos, sin: x * cos + good_rotate_half(x) * sin, "add the head axis"),
    (lambda x, cos, sin: x * cos[:, None] + good_rotate_half(x) * sin[:, None], "cast cos and sin to x.dtype"),
    (rotate_half_rope_meta_pairs, "wrong pairing layout: the rotate_half layout pairs feature j"),
])
def test_apply_rope_rotate_half_mistakes_are_named(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_apply_rope_rotate_half(wrong, device=CPU, quiet=True)


# --------------------------------------------------------------------------------------
# interleave_to_half_permutation
# --------------------------------------------------------------------------------------


def test_permutation_correct_answer_passes():
    checks.check_interleave_to_half_permutation(good_permutation, device=CPU, quiet=True)


def inverse_permutation(head_dim):
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], -1).flatten()


@pytest.mark.parametrize("wrong, phrase", [
    (inverse_permutation, r"that is the inverse permutation. x\[..., perm\] \*reads\*"),
    (lambda head_dim: torch.arange(0, head_dim, 2).repeat(2), "not even a permutation"),
    (lambda head_dim: torch.cat([torch.arange(1, head_dim, 2), torch.arange(0, head_dim, 2)]), "the two halves are swapped"),
    (lambda head_dim: good_permutation(head_dim).int(), "should be a LongTensor"),
    (lambda head_dim: good_permutation(head_dim).tolist(), "should be a torch.Tensor, got list"),
])
def test_permutation_mistakes_are_named(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_interleave_to_half_permutation(wrong, device=CPU, quiet=True)


def test_layouts_agree_under_the_permutation_and_weight_rows():
    """The property the check states, on the reference implementations directly."""
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    ids = torch.tensor([[0, 1, 2, 3, 4], [5, 9, 2, 7, 100]])
    perm = good_permutation(8)
    meta = good_apply_rope(x, checks._complex_table(8, 128, 1e4, dtype=torch.complex128), ids)
    cos, sin = good_rope_cos_sin(8, ids)
    half = good_apply_rope_rotate_half(x[..., perm], cos.double(), sin.double())
    assert torch.allclose(meta[..., perm], half, atol=1e-5)
    assert (good_apply_rope_rotate_half(x, cos.double(), sin.double()) - meta).abs().max() > 0.5


# --------------------------------------------------------------------------------------
# qk_norm
# --------------------------------------------------------------------------------------


def test_qk_norm_correct_answer_passes():
    checks.check_qk_norm(good_qk_norm, device=CPU, quiet=True)


@pytest.mark.parametrize("norm", [hf_rms_norm, llama4_l2_norm])
def test_qk_norm_in_float32_inside_passes_with_a_note(norm, capsys):
    """HF's LlamaRMSNorm and Llama 4's L2Norm compute in float32 and cast back: accepted, with a note."""
    checks.check_qk_norm(norm, device=CPU)
    printed = capsys.readouterr().out
    assert printed.startswith("✓ qk_norm")
    assert "float32 precision" in printed


@pytest.mark.parametrize("wrong, phrase", [
    (lambda x, eps: F.normalize(x, dim=-1), "that is L2 normalisation"),
    (lambda x, eps: x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps), "that is L2 normalisation"),
    (lambda x, eps: x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps), "eps placement"),
    (lambda x, eps: x / x.pow(2).mean(-1, keepdim=True).sqrt(), "eps is ignored"),
    (lambda x, eps: x * torch.rsqrt(x.pow(2).mean(-2, keepdim=True) + eps), "normalise over the last axis"),
    (lambda x, eps: F.rms_norm(x, (x.shape[-1],), eps=eps), "from-scratch exercise.*rms_norm"),
    (lambda x, eps: nn.RMSNorm(x.shape[-1], eps=eps, elementwise_affine=False, dtype=x.dtype)(x),
     "from-scratch exercise.*rms_norm"),
    (lambda x, eps: good_qk_norm(x, eps).float(), "returned float32, but x is float64"),
    (lambda x, eps: x.pow(2).mean(-1, keepdim=True).sqrt(), "return the normalised x, not the norm"),
    (lambda x, eps: (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + eps),
     r"that is LayerNorm \(the mean subtracted"),
])
def test_qk_norm_mistakes_are_named(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_qk_norm(wrong, device=CPU, quiet=True)


# --------------------------------------------------------------------------------------
# repeat_kv
# --------------------------------------------------------------------------------------


def test_repeat_kv_correct_answer_passes():
    checks.check_repeat_kv(good_repeat_kv, device=CPU, quiet=True)


@pytest.mark.parametrize("wrong, phrase", [
    (lambda x, n_rep: x.repeat(1, n_rep, 1, 1), "tiled KV repeat"),
    (lambda x, n_rep: x.repeat_interleave(n_rep, dim=2), "repeat along the head axis"),
    (lambda x, n_rep: x[:, :, None].expand(-1, -1, n_rep, -1, -1), "merge the"),
    (lambda x, n_rep: good_repeat_kv(x, n_rep).float(), "should keep the input dtype torch.float64"),
])
def test_repeat_kv_mistakes_are_named(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_repeat_kv(wrong, device=CPU, quiet=True)


# --------------------------------------------------------------------------------------
# KVCache
# --------------------------------------------------------------------------------------


def test_kv_cache_correct_answer_passes():
    checks.check_kv_cache(GoodKVCache, device=CPU, quiet=True)


class SharedCache:
    k_parts, v_parts = [], []  # class attributes: shared by every instance

    @property
    def seq_len(self):
        return sum(p.shape[2] for p in self.k_parts)

    def update(self, k, v):
        self.k_parts.append(k)
        self.v_parts.append(v)
        return torch.cat(self.k_parts, 2), torch.cat(self.v_parts, 2)


class HeadAxisCache(GoodKVCache):
    def update(self, k, v):
        self.k_parts.append(k)
        self.v_parts.append(v)
        return torch.cat(self.k_parts, 1), torch.cat(self.v_parts, 1)


class NewOnlyCache(GoodKVCache):
    def update(self, k, v):
        super().update(k, v)
        return k, v


class PrependCache(GoodKVCache):
    def update(self, k, v):
        self.k_parts.insert(0, k)
        self.v_parts.insert(0, v)
        return torch.cat(self.k_parts, 2), torch.cat(self.v_parts, 2)


class TensorSeqLenCache(GoodKVCache):
    @property
    def seq_len(self):
        return torch.tensor(sum(p.shape[2] for p in self.k_parts))


@pytest.mark.parametrize("wrong, phrase", [
    (SharedCache, "share their storage"),
    (HeadAxisCache, "append along the sequence axis"),
    (NewOnlyCache, "return everything cached so far"),
    (PrependCache, "new tokens go at the end"),
    (TensorSeqLenCache, "seq_len should be an int"),
])
def test_kv_cache_mistakes_are_named(wrong, phrase):
    SharedCache.k_parts, SharedCache.v_parts = [], []
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_kv_cache(wrong, device=CPU, quiet=True)


class UnsendableSeqLenCache(GoodKVCache):
    @property
    def seq_len(self):
        return 2 ** 5000 + sum(p.shape[2] for p in self.k_parts)  # an integer too large for the wire


def test_a_seq_len_the_grader_cannot_receive_is_worded_as_the_kernels_failure(where_checks_run):
    with pytest.raises(CheckFailure) as failure:
        checks.check_kv_cache(UnsendableSeqLenCache, device=CPU, quiet=True)
    text = str(failure.value)
    assert "BridgeError" not in text, text  # a class of the course's, meaningless to a student
    if where_checks_run == "grading":
        assert re.search(r"reading KVCache\(\)\.seq_len: .*returned something the grader cannot receive", text), text
    else:
        assert "seq_len should be 0 for an empty cache" in text, text


# --------------------------------------------------------------------------------------
# LlamaAttention (full pass and with a cache)
# --------------------------------------------------------------------------------------


def test_llama_attention_correct_answer_passes():
    checks.check_llama_attention(Llama, device=CPU, quiet=True)
    checks.check_llama_attention(Llama, seed=11, device=CPU, quiet=True)


@pytest.mark.parametrize("bug, phrase", [
    ("half_layout", "wrong pairing layout"),
    ("ignore_position_ids", "does not follow position_ids"),
    ("tiled", "tiled KV repeat"),
    ("l2", "that is L2 normalisation"),
    ("no_qk_norm", "QK norm is missing"),
    ("always_qk_norm", "QK norm must be skipped"),
    ("fixed_eps", "use config.rms_norm_eps"),
    ("no_mask", "the causal mask is missing"),
    ("rope_on_v", "RoPE applied to V"),
    ("no_o_proj", "the output projection is missing"),
    ("scale_hidden", r"1/sqrt\(head_dim\), not 1/sqrt\(hidden_size\)"),
    ("sdpa", "from-scratch exercise.*scaled_dot_product_attention"),
    ("rms_norm_builtin", "from-scratch exercise.*rms_norm"),
    ("square_projections", "heads × head_dim, not hidden_size"),
    ("merge_hidden", "raised RuntimeError"),
    ("no_scale", "the scores are not scaled"),
    ("always_tuple", "should return the output tensor alone"),
    ("rope_conjugate", "RoPE turns q and k the wrong way"),
    ("split_reshape", r"split with a reshape straight to \[B, heads, S, head_dim\]"),
    ("merge_reshape", r"merged with a reshape of \[B, H, S, head_dim\] straight to"),
    ("softmax_queries", r"the softmax runs over the queries \(dim=-2\)"),
    ("o_proj_square", r"(?s)head_dim=8, .*o_proj.weight should be \[24, 32\].*got \[24, 24\].*o_proj maps the merged "
                      r"heads, num_heads·head_dim features, back to hidden_size"),
    ("o_proj_swapped", r"(?s)o_proj.weight should be \[24, 32\].*the arguments are swapped"),
    ("kv_with_h_heads", r"(?s)k_proj.weight should be \[16, 24\].*got \[32, 24\].*num_key_value_heads heads, not "
                        r"num_attention_heads"),
])
def test_llama_attention_mistakes_are_named(bug, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_llama_attention(llama_with(bug), device=CPU, quiet=True)


@pytest.mark.parametrize("idiom", ["softmax_float32", "float32_norm", "meta_table"])
def test_llama_attention_accepts_float32_internals(idiom):
    """The softmax or QK norm in float32 (HF), or Meta's complex64 RoPE table (which check_rope_frequencies
    accepts), on float64 input: float32-level accuracy, accepted -- a table one check accepts never fails
    a later exercise."""
    checks.check_llama_attention(llama_with(idiom), device=CPU, quiet=True)
    checks.check_llama_attention_kv_cache(llama_with(idiom), GoodKVCache, device=CPU, quiet=True)


def test_llama_attention_built_on_meta_table_and_float32_rope_helper():
    """The instructor's own LlamaAttention on Meta's float32 table and Meta's apply_rotary_emb (float32, type_as)."""

    class MetaLlama(Llama):
        def __init__(self, config):
            super().__init__(config, ("meta_table",))

        def rope(self, x, ids):
            return rope_meta_type_as(x, self.table, ids)

    checks.check_llama_attention(MetaLlama, device=CPU, quiet=True)
    checks.check_llama_attention_kv_cache(MetaLlama, GoodKVCache, device=CPU, quiet=True)


def test_llama_attention_contract_messages():
    class NotAModule:
        def __init__(self, config):
            pass

    with pytest.raises(CheckFailure, match="should be an nn.Module"):
        checks.check_llama_attention(NotAModule, device=CPU, quiet=True)

    class NoVProj(Llama):
        def __init__(self, config):
            super().__init__(config)
            del self.v_proj

    with pytest.raises(CheckFailure, match="attribute v_proj that is an nn.Linear"):
        checks.check_llama_attention(NoVProj, device=CPU, quiet=True)


def test_llama_attention_with_complex_buffer_is_checked_fairly():
    """A RoPE table registered as a buffer survives the check's dtype handling."""

    class BufferedLlama(Llama):
        def __init__(self, config):
            super().__init__(config)
            self.register_buffer("table_buffer", self.table, persistent=False)

        def rope(self, x, ids):
            return good_apply_rope(x, self.table_buffer, ids)

    checks.check_llama_attention(BufferedLlama, device=CPU, quiet=True)


def test_llama_kv_cache_correct_answer_passes():
    checks.check_llama_attention_kv_cache(Llama, GoodKVCache, device=CPU, quiet=True)


@pytest.mark.parametrize("bug, phrase", [
    ("no_cache_offset", "missing cache offset"),
    ("mask_top_left", "mask offset"),
    ("cache_ignored", "the cache is not used"),
    ("mask_only_prefill", "causal mask is missing among the new tokens"),
    ("no_tuple", r"should return \(out, kv_cache\)"),
])
def test_llama_kv_cache_mistakes_are_named(bug, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_llama_attention_kv_cache(llama_with(bug), GoodKVCache, device=CPU, quiet=True)


def test_prefill_chunk_names_no_cache_mistake():
    """On a prefill (nothing cached) the cache mistakes equal the right answer: a small unexplained error there
    must not be blamed on the mask offset, an ignored cache or the positions."""
    with pytest.raises(CheckFailure) as failure:
        checks.check_llama_attention_kv_cache(llama_with("off_in_float32"), GoodKVCache, device=CPU, quiet=True)
    message = str(failure.value)
    assert "chunk 1 of sizes [2, 1, 3]" in message
    assert "Likely mistake" not in message


def test_llama_kv_cache_blames_the_students_cache():
    with pytest.raises(CheckFailure, match="works with the course's reference cache but not with your KVCache"):
        checks.check_llama_attention_kv_cache(Llama, NewOnlyCache, device=CPU, quiet=True)


def test_llama_attention_names_the_failing_part_it_uses():
    """A LlamaAttention that repeats KV heads with the student's own (tiled) repeat_kv: the failure says so."""
    namespace = {"Llama": Llama}
    exec(textwrap.dedent("""
        def repeat_kv(x, n_rep):
            return x.repeat(1, n_rep, 1, 1)

        class LlamaAttention(Llama):
            def __init__(self, config):
                super().__init__(config, ("own_repeat_kv",))

            def forward(self, hidden_states, position_ids=None, kv_cache=None):
                return Llama.forward(self, hidden_states, position_ids, kv_cache)
    """), namespace)
    with pytest.raises(CheckFailure, match="(?s)tiled KV repeat.*uses your repeat_kv, which fails its own check"):
        checks.check_llama_attention(namespace["LlamaAttention"], device=CPU, quiet=True)


# --------------------------------------------------------------------------------------
# causal_mask_lower_right
# --------------------------------------------------------------------------------------


def good_lower_right(q_len, kv_len, device=None):
    if q_len > kv_len:
        raise ValueError(f"{q_len} queries > {kv_len} keys")
    query = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]  # absolute positions of the queries
    return torch.arange(kv_len, device=device)[None, :] <= query


def lower_right_from_causal_mask(q_len, kv_len, device=None):
    if q_len > kv_len:
        raise ValueError(f"q_len={q_len}, kv_len={kv_len}")
    return good_causal_mask(kv_len, device)[kv_len - q_len:]


def test_causal_mask_lower_right_correct_answers_pass():
    checks.check_causal_mask_lower_right(good_lower_right, device=CPU, quiet=True)
    checks.check_causal_mask_lower_right(lower_right_from_causal_mask, seed=3, device=CPU, quiet=True)


def _lower_right(fill=None, diagonal_shift=0, upper=False, top_left=False, check_lengths=True):
    def causal_mask_lower_right(q_len, kv_len, device=None):
        if check_lengths and q_len > kv_len:
            raise ValueError(f"{q_len} > {kv_len}")
        offset = 0 if top_left else kv_len - q_len
        ones = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
        mask = ones.triu(offset) if upper else ones.tril(offset + diagonal_shift)
        if fill is not None:
            return torch.zeros(q_len, kv_len, device=device).masked_fill(~mask, fill)
        return mask

    return causal_mask_lower_right


@pytest.mark.parametrize("wrong, phrase", [
    (_lower_right(top_left=True), "top-left alignment of is_causal=True"),
    (lambda q_len, kv_len, device=None: ~good_lower_right(q_len, kv_len, device), "polarity flipped"),
    (_lower_right(diagonal_shift=-1), "the diagonal must be True"),
    (_lower_right(upper=True), "that is the upper triangle"),
    (lambda q_len, kv_len, device=None: (good_lower_right(q_len, kv_len, device)
                                         if q_len > kv_len else torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
                                         .tril(q_len - kv_len)), "the diagonal is shifted the wrong way"),
    (_lower_right(fill=-math.inf), "should be a boolean mask"),
    (_lower_right(check_lengths=False), r"causal_mask_lower_right\(3, 2\) should raise ValueError"),
    (lambda q_len, kv_len, device=None: good_lower_right(q_len, kv_len).to("meta") if device is not None
     else good_lower_right(q_len, kv_len), "should be on cpu"),
])
def test_causal_mask_lower_right_mistakes_are_named(wrong, phrase):
    with pytest.raises(CheckFailure, match=phrase):
        checks.check_causal_mask_lower_right(wrong, device=CPU, quiet=True)


def test_causal_mask_lower_right_error_must_name_both_lengths():
    def vague(q_len, kv_len, device=None):
        if q_len > kv_len:
            raise ValueError("too many queries")
        return good_lower_right(q_len, kv_len, device)

    with pytest.raises(CheckFailure, match="should name 3 and 2"):
        checks.check_causal_mask_lower_right(vague, device=CPU, quiet=True)


def test_is_causal_is_top_left_when_lengths_differ():
    """The pitfall the exercise is about, on PyTorch itself."""
    q, k, v = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(top_left, F.scaled_dot_product_attention(q, k, v, attn_mask=_lower_right(top_left=True)(2, 5)))
    assert not torch.allclose(top_left, F.scaled_dot_product_attention(q, k, v, attn_mask=good_lower_right(2, 5)))


# --------------------------------------------------------------------------------------
# kv_cache_bytes
# --------------------------------------------------------------------------------------


def test_kv_cache_bytes_correct_answer_passes():
    checks.check_kv_cache_bytes(good_kv_cache_bytes, quiet=True)
    # a NumPy integer is an int (issue #52: "should be an int ... got int64")
    checks.check_kv_cache_bytes(lambda num_layers, num_kv_heads, head_dim, seq_len, batch_size, bytes_per_element:
                                np.int64(good_kv_cache_bytes(num_layers, num_kv_heads, head_dim, seq_len, batch_size,
                                                             bytes_per_element)), quiet=True)


@pytest.mark.parametrize("wrong, phrase", [
    (lambda L, h, d, s, b, e: L * h * d * s * b * e, r"keys \*and\* values"),
    (lambda L, h, d, s, b, e: 2 * h * d * s * b * e, "multiply by num_layers"),
    (lambda L, h, d, s, b, e: 8 * good_kv_cache_bytes(L, h, d, s, b, e), "no factor 8 for bits"),
    (lambda L, h, d, s, b, e: 2 * L * h * d * s * e, "multiply by batch_size"),
    (lambda L, h, d, s, b, e: float(good_kv_cache_bytes(L, h, d, s, b, e)), "should return an int"),
])
def test_kv_cache_bytes_mistakes_are_named(wrong, phrase):
    def kv_cache_bytes(num_layers, num_kv_heads, head_dim, seq_len, batch_size, bytes_per_element):
        return wrong(num_layers, num_kv_heads, head_dim, seq_len, batch_size, bytes_per_element)

    with pytest.raises(CheckFailure, match=phrase):
        checks.check_kv_cache_bytes(kv_cache_bytes, quiet=True)


def test_kv_cache_bytes_signature_is_checked():
    with pytest.raises(CheckFailure, match="should take the parameters"):
        checks.check_kv_cache_bytes(lambda layers, heads, d, s, b, e: 0, quiet=True)


def test_published_models():
    """The notebook's numbers: Llama-2-7B (MHA) vs Llama-3-8B (GQA), 16-bit, per token."""
    assert good_kv_cache_bytes(32, 32, 128, 1, 1, 2) == 512 * 2**10
    assert good_kv_cache_bytes(32, 8, 128, 8192, 1, 2) == 2**30


# --------------------------------------------------------------------------------------
# Widgets
# --------------------------------------------------------------------------------------


def test_rope_explorer_redraws_with_position_and_base():
    from attention_lab.widgets.rope import rope_explorer

    def frequencies(head_dim, max_positions, base=10000.0):
        return checks._complex_table(head_dim, max_positions, base, dtype=torch.complex128)

    explorer = rope_explorer(good_apply_rope, frequencies, head_dim=8, max_position=20)
    axes = explorer.figure.axes
    assert len(axes) == 5  # four pairs + the q·k panel
    arrow_before = axes[0].lines[-1].get_xydata().copy()
    curves = axes[-1].lines
    assert len(curves) == 2
    # RoPE: the q·k curve for the key at position 0 and at the slider's position coincide.
    assert torch.allclose(torch.tensor(curves[0].get_ydata()), torch.tensor(curves[1].get_ydata()), atol=1e-9)
    first_curve = torch.tensor(curves[0].get_ydata()).clone()

    explorer.controls["position"].value = 13
    axes = explorer.figure.axes
    arrow_after = axes[0].lines[-1].get_xydata()
    assert not torch.allclose(torch.tensor(arrow_before), torch.tensor(arrow_after))
    assert len(axes[0].lines[1].get_xdata()) == 14  # the trail: positions 0 ... 13
    assert "position 13" in explorer.figure._suptitle.get_text()

    explorer.controls["base"].value = 100.0
    new_curve = torch.tensor(explorer.figure.axes[-1].lines[0].get_ydata())
    assert not torch.allclose(new_curve, first_curve)


def test_kv_head_map_runs_the_students_repeat_kv_and_the_tiled_layout():
    from attention_lab.widgets.rope import LAYOUTS, kv_head_map

    def lines_to_kv(widget):
        """For each query head (top row, x = head), the x of the KV head its line ends at."""
        ends = {}
        for line in widget.figure.axes[0].lines:
            (x_top, x_bottom), (y_top, y_bottom) = line.get_xdata(), line.get_ydata()
            assert (y_top, y_bottom) == (1.0, 0.0)
            ends[int(x_top)] = x_bottom
        kv_positions = sorted(set(ends.values()))
        return [kv_positions.index(ends[head]) for head in sorted(ends)]

    widget = kv_head_map(good_repeat_kv, num_heads=8, num_kv_heads=2)
    assert lines_to_kv(widget) == [0, 0, 0, 0, 1, 1, 1, 1]  # h // n_rep
    assert "h // n_rep" in widget.figure.axes[0].get_title()
    widget.controls["layout"].value = LAYOUTS[1]
    assert lines_to_kv(widget) == [0, 1, 0, 1, 0, 1, 0, 1]  # h % H_kv
    widget.controls["num_kv_heads"].value = 1  # multi-query: everyone reads KV head 0
    assert lines_to_kv(widget) == [0] * 8
    assert list(widget.controls["num_kv_heads"].options) == [1, 2, 4, 8]
    # A wrong repeat_kv shows as what it does, not as the right picture.
    widget = kv_head_map(lambda x, n_rep: x.repeat(1, n_rep, 1, 1), num_heads=8, num_kv_heads=2)
    assert lines_to_kv(widget) == [0, 1, 0, 1, 0, 1, 0, 1]


def test_rope_explorer_slider_redraws_on_release():
    from attention_lab.widgets.rope import rope_explorer

    explorer = rope_explorer(good_apply_rope, good_rope_frequencies, head_dim=8, max_position=10)
    assert explorer.controls["position"].continuous_update is False


def test_kv_group_heatmaps_select_groups_and_scale():
    from attention_lab.widgets.rope import kv_group_heatmaps

    weights = torch.softmax(torch.randn(8, 5, 5).masked_fill(~good_causal_mask(5), -math.inf), dim=-1)
    widget = kv_group_heatmaps(weights, num_kv_heads=2, tokens=list("abcde"))
    axes = widget.figure.axes
    assert len(axes) == 8
    assert [ax.get_title() for ax in axes[:5]] == ["head 0 · KV 0", "head 1 · KV 0", "head 2 · KV 0",
                                                  "head 3 · KV 0", "head 4 · KV 1"]
    assert axes[0].images[0].get_cmap().name != axes[4].images[0].get_cmap().name  # one colour per KV group
    image = axes[0].images[0].get_array()
    assert image.mask[0, 1] or math.isnan(float(image[0, 1]))  # the future is blank
    assert axes[0].images[0].get_clim() == (0.0, 1.0)

    height_all = widget.figure.get_size_inches()[1]
    widget.controls["group"].value = "1"
    axes = widget.figure.axes
    assert [ax.get_title() for ax in axes] == ["head 4 · KV 1", "head 5 · KV 1", "head 6 · KV 1", "head 7 · KV 1"]
    assert widget.figure.get_size_inches()[1] < height_all / 1.5  # one row of heads: no blank figure below it
    expected = torch.nan_to_num(weights[4].masked_fill(weights[4] == 0, float("nan")), nan=-1.0)
    drawn = torch.nan_to_num(torch.tensor(axes[0].images[0].get_array().filled(float("nan"))), nan=-1.0)
    assert torch.allclose(drawn, expected.double())

    widget.controls["per_head_scale"].value = True
    # Scaled to the largest weight of a query that had a choice: row 0 (one visible key, weight 1)
    # would make every head's scale 1, and the control would change nothing.
    largest = float(weights[4][1:].max())
    assert largest < 1.0
    assert widget.figure.axes[0].images[0].get_clim() == (0.0, largest)
