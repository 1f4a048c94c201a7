"""Checks for notebook 05 -- Llama attention: GQA, RoPE, QK norm, KV cache.

References are written differently from the idiomatic answers and computed in float64 at
check time: RoPE as explicit 2x2 rotations of feature pairs (no complex numbers), RMS
normalisation from ``F.rms_norm``, attention from ``F.scaled_dot_product_attention(...,
is_causal=True, enable_gqa=True)`` on the math backend, plain multi-head attention from
``nn.MultiheadAttention``, memory from tensors allocated on the ``meta`` device.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention_lab.checking import (
    CheckFailure,
    Variant,
    call_student,
    check,
    crash_message,
    describe,
    expect_close,
    expect_signature,
    expect_tensor,
    expect_true,
    expect_value_error,
    is_integer,
    is_number,
    freeze_module,
    randint,
    randn,
    random_generator,
    reference_sdpa,
    shape_str,
    tolerance,
)

# LlamaAttention is "from scratch": no fused attention, no built-in RMSNorm.
FROM_SCRATCH = ("scaled_dot_product_attention", "multi_head_attention_forward", "rms_norm")

HINTS = {
    # LlamaAttentionConfig
    "config_too_strict": "this config is valid. Do not require hidden_size to be divisible by the number of "
    "heads: head_dim is independent of hidden_size (Gemma-7B: hidden 3072, 16 heads of 256); only H % H_kv and "
    "an odd head_dim are errors.",
    "head_dim_derived": "head_dim must not be derived from hidden_size // num_attention_heads: it is a field of its "
    "own.",
    # Masks
    "mask_polarity": "polarity flipped: True means 'may attend' (the past and the token itself).",
    "mask_diagonal": "the diagonal must be True: each token may attend to itself.",
    "mask_upper": "that is the upper triangle: a query may see the keys at or *before* it (tril, not triu).",
    "mask_not_boolean": "masks in this course are boolean (True = may attend), not the study notes' float mask "
    "of 0 and -inf.",
    "mask_top_left": "that is the top-left alignment of is_causal=True: query i sees keys 0 … i. The queries are "
    "the *last* q_len of the kv_len tokens, so query i is token kv_len - q_len + i and sees keys 0 … "
    "kv_len - q_len + i: tril(diagonal=kv_len - q_len).",
    "mask_offset_sign": "the diagonal is shifted the wrong way: tril(diagonal=q_len - kv_len) hides even more "
    "keys. The queries come *after* the kv_len - q_len earlier tokens, so shift it up: "
    "tril(diagonal=kv_len - q_len).",
    # RoPE frequencies and layouts
    "not_complex": "build the complex numbers with torch.polar(torch.ones_like(angles), angles) (one unit complex "
    "number cos φ + i·sin φ per position and pair).",
    "factor_two": "θ_j = base^(-2j/head_dim): the exponent has a factor 2 (j counts pairs, 2j is the "
    "feature index); torch.arange(0, head_dim, 2) / head_dim gives 2j/head_dim directly.",
    "positive_exponent": "the frequencies must decrease: θ_j = base^(-2j/head_dim) = 1 / base^(2j/head_dim), "
    "not base^(+2j/head_dim).",
    "cos_sin_swapped": "cos and sin are swapped: exp(iφ) = cos φ + i·sin φ (real part cos, imaginary part sin).",
    "duplicated_table": "the complex table has one entry per *pair*: [max_positions, head_dim // 2]. The notes' "
    "torch.cat((freqs, freqs)) belongs to the rotate_half layout (and its [..., :d/2] slice just undoes it).",
    "base_ignored": "use the base argument (config.rope_theta), not a hard-coded 10000.",
    "pairing_half": "wrong pairing layout: the Meta layout rotates adjacent features (2j, 2j+1) as one complex "
    "number (x.reshape(..., head_dim // 2, 2) then torch.view_as_complex), not feature j with j + head_dim/2 "
    "(that is the rotate_half layout).",
    "pairing_interleaved": "wrong pairing layout: the rotate_half layout pairs feature j with j + head_dim/2 "
    "(the two halves), not adjacent features (2j, 2j+1).",
    "positions_ignored": "the rotation does not follow position_ids: index the table with the position_ids "
    "argument (freqs_cis[position_ids]), not with arange(S) or a global variable from the notebook.",
    "batch_positions": "each sequence of the batch has its own positions: freqs_cis[position_ids] is "
    "[B, S, head_dim/2]; add the head axis ([:, None]) rather than using one row for the whole batch.",
    "negative_angle": "you rotate by -angle (the conjugate): multiply by freqs_cis = exp(+i·p·θ), i.e. "
    "(a, b) -> (a·cos - b·sin, a·sin + b·cos).",
    "downcast": "do not convert to float32 (the notes' xq.float()): it silently downcasts float64. Compute in "
    "torch.promote_types(x.dtype, torch.float32) (float64 stays float64; half precision goes up to float32) "
    "and return .to(x.dtype).",
    "rotate_half_sign": "rotate_half sign: rotate_half(x) = cat(-x2, x1) with x1, x2 the two halves, so that "
    "x*cos + rotate_half(x)*sin rotates each pair (x1_j, x2_j) by +angle.",
    "rope_conjugate_half": "the pairs turn the wrong way (by -angle, the conjugate rotation). With "
    "rotate_half(x) = cat(-x2, x1), the rotation by +angle is x*cos + rotate_half(x)*sin: a minus before the sin "
    "term turns each pair backwards.",
    "conjugate_table": "the table holds exp(-i·p·θ_j), the conjugate: its sines have the wrong sign, so every pair "
    "would turn backwards; torch.polar(torch.ones_like(angles), angles) gives exp(+i·p·θ_j).",
    "rope_conjugate": "RoPE turns q and k the wrong way (by -position·θ_j: the conjugate table, freqs_cis.conj(), "
    "or a minus before the sin term). Each pair must turn by +position·θ_j, as apply_rope does.",
    "rotate_half_no_negation": "rotate_half must negate the second half: cat(-x2, x1), not cat(x2, x1).",
    "head_axis": "cos and sin are [B, S, head_dim] while x is [B, H, S, head_dim]: add the head axis "
    "(cos[:, None], or cos.unsqueeze(1)) so one rotation is shared by all heads.",
    "table_dtype": "cast cos and sin to x.dtype before using them (cos.to(x.dtype)), so the output keeps x's dtype.",
    "cos_sin_layout": "the rotate_half tables repeat the head_dim/2 angles as two halves, cat((angles, angles), "
    "dim=-1), so that feature j and feature j + head_dim/2 share angle j (not repeat_interleave).",
    "complex_not_flattened": "flatten the (real, imaginary) axis back: torch.view_as_real(...).flatten(-2).",
    "complex_returned": "convert the complex result back to real features with torch.view_as_real(...).flatten(-2).",
    "keep_dtype": "compute in x's dtype (do not call .float() or .double() on the result).",
    "rotate_half_adjacent": "rotate_half works on the two halves (j, j + d/2), not on adjacent pairs.",
    "cos_sin_width": "the rotate_half tables have head_dim columns: cat((angles, angles), dim=-1).",
    "not_a_permutation": "it is not even a permutation of 0 … head_dim - 1.",
    "inverse_permutation": "that is the inverse permutation. x[..., perm] *reads* feature perm[i] into place i; "
    "your list says where each feature goes to instead.",
    # QK norm
    "layer_norm": "that is LayerNorm (the mean subtracted, divided by the standard deviation). RMS "
    "normalisation does not centre: x * rsqrt(mean(x²) + eps), with no mean subtracted.",
    "odd_first": "the two halves are swapped: the first half of the places holds the *first* elements of the "
    "pairs, the second half their second elements.",
    "bytes_bits": "that is 8 times too much: the answer is in bytes, and bytes_per_element is already in bytes "
    "(2 for 16-bit numbers), with no factor 8 for bits.",
    "bytes_no_batch": "every sequence of the batch has its own keys and values: multiply by batch_size.",
    "l2": "that is L2 normalisation (output norm 1), but qk_norm is RMS normalisation: divide by "
    "sqrt(mean(x²) + eps), so the output's norm is sqrt(head_dim), not 1.",
    "eps_outside": "eps placement: eps goes inside the square root, x * rsqrt(mean(x²) + eps), not "
    "x / (sqrt(mean(x²)) + eps).",
    "eps_ignored": "eps is ignored: add it to the mean of squares, x * rsqrt(mean(x²) + eps).",
    "norm_axis": "normalise over the last axis (head_dim): mean(dim=-1, keepdim=True).",
    "norm_returned": "return the normalised x, not the norm itself.",
    # GQA
    "tiled": "tiled KV repeat: query head h uses KV head h // n_rep, so each KV head is repeated n_rep times "
    "*consecutively* (k0, k0, k0, k1, k1, k1, ...), while x.repeat(1, n_rep, 1, 1) tiles (k0, k1, ..., k0, k1, ...). "
    "Use x[:, :, None].expand(...).reshape(...) or repeat_interleave(n_rep, dim=1).",
    "repeat_sequence_axis": "repeat along the head axis (dim 1), not the sequence axis.",
    "repeat_not_merged": "merge the (H_kv, n_rep) axes into one: .reshape(B, H_kv * n_rep, S, d).",
    # LlamaAttention
    "square_projections": "the projections' width is heads × head_dim, not hidden_size (head_dim is independent "
    "of hidden_size).",
    "o_proj_square": "o_proj maps the merged heads, num_heads·head_dim features, back to hidden_size: "
    "nn.Linear(num_heads * head_dim, hidden_size). Here num_heads·head_dim is not hidden_size (head_dim is a "
    "field of its own), so Linear(hidden_size, hidden_size) does not fit.",
    "linear_in_out": "nn.Linear(in_features, out_features) stores its weight as [out, in]: the arguments are "
    "swapped.",
    "kv_heads": "k_proj and v_proj have num_key_value_heads heads, not num_attention_heads: "
    "nn.Linear(hidden_size, num_key_value_heads * head_dim).",
    "split_no_transpose": "the heads are split with a reshape straight to [B, heads, S, head_dim]: that cuts "
    "the projection's memory into blocks that mix tokens. View it as [B, S, heads, head_dim] first, then "
    "transpose(1, 2).",
    "merge_no_transpose": "the heads are merged with a reshape of [B, H, S, head_dim] straight to [B, S, H·head_dim], "
    "which mixes tokens: transpose(1, 2) back to [B, S, H, head_dim] first, then reshape.",
    "softmax_queries": "the softmax runs over the queries (dim=-2): each query's weights over the keys must sum "
    "to 1, so softmax over the last axis (dim=-1).",
    "no_o_proj": "the output projection is missing: apply self.o_proj to the merged heads.",
    "rope_on_v": "RoPE applied to V: rotate only the queries and keys (positions enter through q·k); the values "
    "are not rotated.",
    "no_mask": "the causal mask is missing: token i must not attend to tokens after it "
    "(scores.masked_fill(~mask, -inf) with mask = causal_mask(...)).",
    "scale_hidden": "the scale is 1/sqrt(head_dim), not 1/sqrt(hidden_size).",
    "no_scale": "the scores are not scaled: divide q @ kᵀ by sqrt(head_dim).",
    "qk_norm_missing": "QK norm is missing: with config.use_qk_norm, apply qk_norm to q and k (after RoPE).",
    "qk_norm_unwanted": "QK norm must be skipped when config.use_qk_norm is False.",
    "eps_config": "use config.rms_norm_eps as qk_norm's eps (the notes' SimpleL2Norm used its own 1e-6).",
    # KV cache
    "cache_offset": "missing cache offset: new tokens continue the positions of the cached ones, "
    "position_ids = kv_cache.seq_len + arange(S) (read seq_len *before* updating the cache).",
    "mask_offset": "mask offset: with past = kv_cache.seq_len cached tokens, new token i sits at position "
    "past + i and may see every cached key and the new keys up to itself: causal_mask(past + S)[past:], not "
    "causal_mask(S) or a mask that starts at key 0.",
    "cache_ignored": "the cache is not used: concatenate the cached keys/values with the new ones "
    "(k, v = kv_cache.update(k, v)) before attention.",
    "cache_new_only": "return everything cached so far (the old tokens and the new ones), not only the new ones.",
    "cache_prepend": "new tokens go at the end: torch.cat([cached, new], dim=2).",
    "cache_shared": "the instances share their storage. Create the tensors in __init__ (self.keys = None), not as "
    "class attributes.",
    "cache_axis": "append along the sequence axis (dim 2 of [B, H_kv, S, head_dim]): torch.cat([cached, new], dim=2).",
    "cache_mask_missing": "the causal mask is missing among the new tokens of a chunk: a chunk's token may see "
    "the cache and the chunk's tokens up to itself only.",
    # kv_cache_bytes
    "bytes_keys_only": "the cache holds keys *and* values: a factor 2.",
    "bytes_one_layer": "every layer has its own cache: multiply by num_layers.",
}


# --------------------------------------------------------------------------------------
# RoPE references: explicit rotations of feature pairs, float64
# --------------------------------------------------------------------------------------


def _inverse_frequencies(head_dim: int, base: float, device: Any = "cpu", factor: float = 2.0,
                         sign: float = -1.0) -> torch.Tensor:
    """θ_j = base^(-2j/head_dim), j = 0 ... head_dim/2 - 1 (float64)."""
    pair_index = torch.arange(head_dim // 2, dtype=torch.float64, device=device)
    return torch.exp(sign * factor * pair_index / head_dim * math.log(base))


def _angles(head_dim: int, positions: torch.Tensor, base: float, **kwargs: Any) -> torch.Tensor:
    """positions [...] -> angles [..., head_dim/2] = p · θ_j (float64)."""
    return positions.to(torch.float64)[..., None] * _inverse_frequencies(head_dim, base, positions.device, **kwargs)


def _pair_indices(head_dim: int, layout: str, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if layout == "interleaved":  # Meta: (2j, 2j+1)
        return (torch.arange(0, head_dim, 2, device=device), torch.arange(1, head_dim, 2, device=device))
    return torch.arange(head_dim // 2, device=device), torch.arange(head_dim // 2, head_dim, device=device)


def _rotate_pairs(x: torch.Tensor, angles: torch.Tensor, layout: str) -> torch.Tensor:
    """Rotate each 2-D pair of x's features by its angle: (a, b) -> (a cos - b sin, a sin + b cos)."""
    x = x.detach().to(torch.float64)
    first, second = _pair_indices(x.shape[-1], layout, x.device)
    a, b = x[..., first], x[..., second]
    cos, sin = angles.cos(), angles.sin()
    out = x.clone()
    out[..., first] = a * cos - b * sin
    out[..., second] = a * sin + b * cos
    return out


def _rope_reference(x: torch.Tensor, position_ids: torch.Tensor, base: float, layout: str = "interleaved",
                    angle_sign: float = 1.0) -> torch.Tensor:
    """x [B, H, S, d] rotated at position_ids [B, S] (float64, x's device)."""
    angles = angle_sign * _angles(x.shape[-1], position_ids.to(x.device), base)[:, None]  # [B, 1, S, d/2]
    return _rotate_pairs(x, angles, layout)


def _complex_table(head_dim: int, max_positions: int, base: float, *, dtype: torch.dtype, device: Any = "cpu",
                   **kwargs: Any) -> torch.Tensor:
    """exp(i·p·θ_j) [max_positions, head_dim/2] in the complex dtype the caller chooses."""
    angles = _angles(head_dim, torch.arange(max_positions), base, **kwargs)
    table = torch.complex(angles.cos(), angles.sin()).to(dtype)
    return table.to(device)


def _cos_sin_reference(head_dim: int, position_ids: torch.Tensor, base: float, *, layout: str, **kwargs):
    """cos and sin [B, S, head_dim] of the angles laid out as two halves ("half") or adjacent pairs."""
    angles = _angles(head_dim, position_ids, base, **kwargs)  # [B, S, d/2]
    if layout == "half":
        angles = torch.cat([angles, angles], dim=-1)
    else:
        angles = angles.repeat_interleave(2, dim=-1)
    return torch.cos(angles), torch.sin(angles)


def _angle_atol(dtype: torch.dtype, max_position: int, magnitude: float = 1.0) -> float:
    """Absolute tolerance for rotations at positions up to max_position.

    In float32 the angle p·θ itself is rounded (relative 6e-8), so the error grows with p:
    Meta's float32 table is correct, just less precise at large positions.
    """
    if dtype in (torch.float64, torch.complex128):
        return 1e-9 * max(1.0, magnitude) * max(1, max_position) ** 0.5
    return (2e-5 + 3e-7 * max_position) * max(1.0, magnitude)


def _positions_text(position_ids: torch.Tensor) -> str:
    if position_ids.numel() <= 12:
        return str(position_ids.tolist())
    return f"of shape {shape_str(position_ids.shape)}"


def _expect_same_dtype(out: Any, x: torch.Tensor, call: str, hint: str) -> None:
    if isinstance(out, torch.Tensor) and out.dtype != x.dtype and tuple(out.shape) == tuple(x.shape):
        raise CheckFailure(f"{call} returned {str(out.dtype).replace('torch.', '')}, but x is "
                           f"{str(x.dtype).replace('torch.', '')}: the output must keep x's dtype.\n"
                           f"  Likely mistake: {hint}")


def _likely(hint_name: str) -> str:
    """The line that names a likely mistake, appended to a message."""
    return f"\n  Likely mistake: {HINTS[hint_name]}"


def _add_hint_on_error(failure: CheckFailure, needle: str, hint: str) -> CheckFailure:
    if needle in str(failure):
        return CheckFailure(f"{failure}\n  Likely mistake: {hint}")
    return failure


# --------------------------------------------------------------------------------------
# Exercise: LlamaAttentionConfig
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Config:
    """The fields of LlamaAttentionConfig (the checks do not depend on the student's dataclass)."""

    hidden_size: int = 128
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 8
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    use_qk_norm: bool = True


# The contract's fields and defaults (the checks compare the student's dataclass with them).
CONFIG_DEFAULTS = dataclasses.asdict(_Config())


def _expect_config_error(cls: Callable, kwargs: dict, must_mention: tuple, why: str) -> None:
    call = "LlamaAttentionConfig(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"
    expect_value_error(cls, call=call, why=why, must_mention=must_mention, **kwargs)


@check("LlamaAttentionConfig: the nine fields and defaults; ValueError for H % H_kv != 0 and odd head_dim; head_dim independent of hidden_size")
def check_llama_attention_config(LlamaAttentionConfig: Any, *, seed: int = 0, device: torch.device | None = None) -> None:
    """LlamaAttentionConfig: dataclass, field names and defaults, keyword construction, validation in __post_init__."""
    expect_true(isinstance(LlamaAttentionConfig, type) and dataclasses.is_dataclass(LlamaAttentionConfig),
                f"LlamaAttentionConfig should be a class decorated with @dataclass, got {describe(LlamaAttentionConfig)}.")
    names = [field.name for field in dataclasses.fields(LlamaAttentionConfig)]
    missing = [name for name in CONFIG_DEFAULTS if name not in names]
    expect_true(not missing, f"LlamaAttentionConfig is missing the fields {missing}; it has {names}.")
    config = call_student(LlamaAttentionConfig, call="LlamaAttentionConfig()")
    for name, default in CONFIG_DEFAULTS.items():
        value = getattr(config, name)
        right_type = {float: is_number, int: is_integer}.get(type(default), lambda v: type(v) is type(default))(value)
        expect_true(right_type and value == default,
                    f"LlamaAttentionConfig().{name} should be {default!r} ({type(default).__name__}), got {value!r}.")
    generator = random_generator(seed)
    valid = [
        {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "max_position_embeddings": randint(16, 4096, generator), "rope_theta": 500000.0, "rms_norm_eps": 1e-6,
         "attention_bias": True, "use_qk_norm": False},
        {"hidden_size": 20, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 6},  # MQA, D % H != 0
        {"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 4},  # MHA
    ]
    h_kv = randint(1, 8, generator)
    valid.append({"num_attention_heads": h_kv * randint(1, 4, generator), "num_key_value_heads": h_kv,
                  "head_dim": 2 * randint(1, 64, generator), "hidden_size": randint(1, 512, generator)})
    for custom in valid:
        call = "LlamaAttentionConfig(" + ", ".join(f"{k}={v!r}" for k, v in custom.items()) + ")"
        try:
            config = call_student(LlamaAttentionConfig, **custom, call=call)
        except CheckFailure as failure:
            if "ValueError" in str(failure):
                raise CheckFailure(f"{failure}{_likely('config_too_strict')}") from None
            raise
        for name, value in custom.items():
            got = getattr(config, name)
            hint = _likely("head_dim_derived") if name == "head_dim" else ""
            expect_true(got == value, f"{call}.{name} should be {value!r}, got {got!r}.{hint}")
    _expect_config_error(LlamaAttentionConfig, {"num_attention_heads": 6, "num_key_value_heads": 4}, (6, 4),
                         "6 query heads cannot be split into groups for 4 KV heads")
    _expect_config_error(LlamaAttentionConfig, {"num_attention_heads": 4, "num_key_value_heads": 8}, (4, 8),
                         "more KV heads than query heads")
    _expect_config_error(LlamaAttentionConfig, {"head_dim": 7}, (7,), "RoPE needs an even head_dim")
    odd = 2 * randint(1, 20, generator) + 1
    _expect_config_error(LlamaAttentionConfig, {"hidden_size": 4 * odd, "num_attention_heads": 4,
                                                "num_key_value_heads": 2, "head_dim": odd}, (odd,),
                         "RoPE needs an even head_dim")


# --------------------------------------------------------------------------------------
# Exercise: causal_mask
# --------------------------------------------------------------------------------------


def _expect_mask(mask: torch.Tensor, call: str, q_len: int, kv_len: int) -> None:
    """mask must be True exactly where key j <= query i + (kv_len - q_len); name the known wrong layouts."""
    offset = kv_len - q_len  # tokens before the first query
    query = torch.arange(q_len, device=mask.device)[:, None]
    key = torch.arange(kv_len, device=mask.device)[None, :]
    expected = key <= query + offset
    if torch.equal(mask, expected):
        return
    known = [(~expected, "mask_polarity"), (key < query + offset, "mask_diagonal"),
             (key >= query + offset, "mask_upper"), (key <= query, "mask_top_left"),
             (key <= query - offset, "mask_offset_sign")]
    hint_name = next((name for wrong, name in known if torch.equal(mask, wrong)), None)
    rows = "\n".join("    " + " ".join("1" if v else "0" for v in row[:16]) for row in mask.int().tolist()[:6])
    rule = "key <= query" if offset == 0 else f"key j <= query i + {offset}"
    message = f"{call} should be True exactly where {rule}; got (first rows, 1 = True):\n{rows}"
    raise CheckFailure(message + (_likely(hint_name) if hint_name else ""))


def _expect_boolean_mask(mask: Any, call: str, shape: tuple[int, int], device: torch.device) -> None:
    expect_tensor(mask, what=call, shape=shape)
    expect_true(mask.dtype == torch.bool, f"{call} should be a boolean mask (True = may attend), got "
                f"{describe(mask)}.{_likely('mask_not_boolean')}")
    expect_true(mask.device.type == device.type, f"{call} should be on {device.type}, got {mask.device.type}.")


@check("causal_mask: boolean [S, S], True on and below the diagonal, on the requested device ({device})")
def check_causal_mask(causal_mask: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """causal_mask: [S, S] bool, True = may attend, True on and below the diagonal."""
    expect_signature(causal_mask, "causal_mask", ["seq_len", "device"])
    generator = random_generator(seed)
    sizes = [5, 1, 2] + [randint(3, 40, generator) for _ in range(4)]
    for index, seq_len in enumerate(sizes):
        target = torch.device("cpu") if index == 1 else device
        call = f"causal_mask({seq_len})" if index == 1 else f"causal_mask({seq_len}, device={device.type!r})"
        args = {} if index == 1 else {"device": device}
        mask = call_student(causal_mask, seq_len, call=call, **args)
        _expect_boolean_mask(mask, call, (seq_len, seq_len), target)
        _expect_mask(mask, call, seq_len, seq_len)


# --------------------------------------------------------------------------------------
# Exercise: rope_frequencies
# --------------------------------------------------------------------------------------


@check("rope_frequencies: exp(i·p·θ_j), θ_j = base^(-2j/head_dim), [max_positions, head_dim/2] complex")
def check_rope_frequencies(rope_frequencies: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """rope_frequencies: complex table [P, d/2] of unit rotations at every position and frequency."""
    expect_signature(rope_frequencies, "rope_frequencies", ["head_dim", "max_positions", "base"])
    generator = random_generator(seed)
    cases = [(8, 16, 10000.0), (8, 256, 10000.0), (16, 40, 500000.0), (2, 5, 100.0), (4, 1, 10000.0)]
    for _ in range(4):
        cases.append((2 * randint(1, 32, generator), randint(1, 300, generator),
                      [100.0, 10000.0, 500000.0][randint(0, 2, generator)]))
    for head_dim, max_positions, base in cases:
        call = f"rope_frequencies({head_dim}, {max_positions}, base={base})"
        table = call_student(rope_frequencies, head_dim, max_positions, base=base, call=call)
        expect_tensor(table, what=call)
        if not table.is_complex():
            raise CheckFailure(f"{call} should return a complex tensor, got {describe(table)}.{_likely('not_complex')}")
        expect_tensor(table, what=call, shape=(max_positions, head_dim // 2),
                      hints={(max_positions, head_dim): HINTS["duplicated_table"]})
        real = torch.view_as_real(table.resolve_conj())  # [P, d/2, 2]: (cos, sin); a lazy .conj() resolved
        expected = torch.view_as_real(_complex_table(head_dim, max_positions, base, dtype=torch.complex128))
        variants = [
            Variant(lambda: torch.view_as_real(_complex_table(head_dim, max_positions, base, dtype=torch.complex128, factor=1.0)),
                    HINTS["factor_two"]),
            Variant(lambda: torch.view_as_real(_complex_table(head_dim, max_positions, base, dtype=torch.complex128, sign=1.0)),
                    HINTS["positive_exponent"]),
            Variant(lambda: expected.flip(-1), HINTS["cos_sin_swapped"]),
            Variant(lambda: expected * torch.tensor([1.0, -1.0], dtype=torch.float64), HINTS["conjugate_table"]),
        ]
        if base != 10000.0:
            variants.append(Variant(lambda: torch.view_as_real(_complex_table(head_dim, max_positions, 10000.0, dtype=torch.complex128)),
                                    HINTS["base_ignored"]))
        expect_close(real, expected, what=call + " (as view_as_real: [..., (cos, sin)])",
                     against="exp(i·p·θ_j) with θ_j = base^(-2j/head_dim)", variants=variants,
                     rtol=0.0, atol=_angle_atol(table.dtype, max_positions))


# --------------------------------------------------------------------------------------
# Exercise: apply_rope (Meta layout)
# --------------------------------------------------------------------------------------


def _rope_variants(x, position_ids, base, layout, rope_fn: Callable) -> list[Variant]:
    """Known wrong RoPE outputs; rope_fn(x, positions, layout, sign) gives a rotated x."""
    b, _h, s, _d = x.shape
    arange = torch.arange(s, device=position_ids.device).expand(b, s)
    other = "half" if layout == "interleaved" else "interleaved"
    variants = [
        Variant(lambda: rope_fn(x, position_ids, other, 1.0),
                HINTS["pairing_half"] if layout == "interleaved" else HINTS["pairing_interleaved"]),
        Variant(lambda: rope_fn(x, position_ids, layout, -1.0),
                HINTS["negative_angle"] if layout == "interleaved" else HINTS["rope_conjugate_half"]),
    ]
    if not torch.equal(position_ids, arange):
        variants.append(Variant(lambda: rope_fn(x, arange, layout, 1.0), HINTS["positions_ignored"]))
    if b > 1 and not bool((position_ids == position_ids[:1]).all()):
        variants.append(Variant(lambda: rope_fn(x, position_ids[:1].expand(b, s), layout, 1.0),
                                HINTS["batch_positions"]))
    return variants


def _meta_rope(x, positions, layout, sign, base):
    return _rope_reference(x, positions, base, layout, sign)


def _check_apply_rope_once(apply_rope: Callable, x: torch.Tensor, table: torch.Tensor, position_ids: torch.Tensor,
                           base: float) -> torch.Tensor:
    call = (f"apply_rope(x, freqs_cis, position_ids) with x a {describe(x)}, freqs_cis {shape_str(table.shape)} "
            f"({str(table.dtype).replace('torch.', '')}), position_ids {_positions_text(position_ids)}")
    out = call_student(apply_rope, x, table, position_ids, call=call)
    _expect_same_dtype(out, x, call, HINTS["downcast"])
    d = x.shape[-1]
    expect_tensor(out, what=call, shape=x.shape, dtype=x.dtype, device=x.device,
                  hints={(*x.shape[:-1], d // 2, 2): HINTS["complex_not_flattened"],
                         (*x.shape[:-1], d // 2): HINTS["complex_returned"]})
    max_position = int(position_ids.max()) if position_ids.numel() else 0
    rtol, atol = tolerance(x.dtype, x.device)
    atol = max(atol, _angle_atol(x.dtype, max_position, float(x.abs().max())))
    # The exercise asks to keep float64 throughout: float32 internals (the notes' xq.float()) fail here.
    expect_close(out, _rope_reference(x, position_ids, base), what=call,
                 against="each pair (x[2j], x[2j+1]) rotated by the angle position·θ_j",
                 variants=_rope_variants(x, position_ids, base, "interleaved",
                                         lambda *a: _meta_rope(*a, base=base)),
                 rtol=rtol, atol=atol, float64_internals=True)
    return out


@check("apply_rope: Meta-layout rotation of (2j, 2j+1) pairs at position_ids; norms kept; q·k depends only on the offset; dtype kept ({device})")
def check_apply_rope(apply_rope: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """apply_rope: values against explicit pair rotations, dtype kept, position_ids used, RoPE's properties."""
    expect_signature(apply_rope, "apply_rope", ["x", "freqs_cis", "position_ids"])
    generator = random_generator(seed)
    base = 10000.0
    table64 = _complex_table(8, 64, base, dtype=torch.complex128, device=device)
    table32 = _complex_table(8, 64, base, dtype=torch.complex64, device=device)
    positions = torch.tensor([[3, 4, 5, 6, 7], [0, 2, 4, 6, 8]], device=device)
    # float64 first: it must stay float64 (the notes' .float() would downcast it).
    _check_apply_rope_once(apply_rope, randn(2, 3, 5, 8, generator=generator, device=device), table64, positions, base)
    positions = torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]], device=device)
    _check_apply_rope_once(apply_rope, randn(2, 4, 6, 8, generator=generator, dtype=torch.float32, device=device),
                           table32, positions, base)
    # A non-contiguous input (heads split by view + transpose, as in the module) and one token, one head.
    x = randn(2, 5, 3, 8, generator=generator, device=device).transpose(1, 2)
    _check_apply_rope_once(apply_rope, x, table64, torch.arange(5, device=device).expand(2, 5), base)
    _check_apply_rope_once(apply_rope, randn(1, 1, 1, 8, generator=generator, device=device), table64,
                           torch.tensor([[40]], device=device), base)
    for _ in range(5):
        b, h, s, d = (randint(1, 3, generator), randint(1, 4, generator), randint(1, 7, generator),
                      2 * randint(1, 8, generator))
        theta = [100.0, 10000.0, 500000.0][randint(0, 2, generator)]
        ids = torch.randint(0, 64, (b, s), generator=generator).to(device)
        _check_apply_rope_once(apply_rope, randn(b, h, s, d, generator=generator, device=device),
                               _complex_table(d, 64, theta, dtype=torch.complex128, device=device), ids, theta)
    # Properties, stated on their own (they are why RoPE is built this way).
    d = 16
    table = _complex_table(d, 128, base, dtype=torch.complex128, device=device)
    x = randn(3, 2, 6, d, generator=generator, device=device) * 3.0
    ids = torch.randint(0, 128, (3, 6), generator=generator).to(device)
    out = call_student(apply_rope, x, table, ids, call="apply_rope(x, freqs_cis, position_ids)")
    expect_close(out.norm(dim=-1), x.norm(dim=-1), what="the norms of apply_rope's output vectors",
                 against="the norms of the input vectors (a rotation preserves length)")
    zero = torch.zeros(3, 6, dtype=torch.long, device=device)
    expect_close(call_student(apply_rope, x, table, zero, call="apply_rope(x, freqs_cis, zeros)"), x,
                 what="apply_rope at position 0", against="x itself (angle 0 is no rotation)")
    q = randn(1, 1, 1, d, generator=generator, device=device)
    k = randn(1, 1, 1, d, generator=generator, device=device)
    scores = []
    for shift in (0, 17, 60):
        pairs = []
        for m, n in ((5, 2), (9, 9), (3, 30)):
            rq = call_student(apply_rope, q, table, torch.tensor([[m + shift]], device=device), call="apply_rope(q, ...)")
            rk = call_student(apply_rope, k, table, torch.tensor([[n + shift]], device=device), call="apply_rope(k, ...)")
            pairs.append((rq * rk).sum())
        scores.append(torch.stack(pairs))
    for shift, value in zip((17, 60), scores[1:]):
        expect_close(value, scores[0], what=f"q·k with both positions shifted by {shift} (pairs (m, n) = (5, 2), (9, 9), (3, 30))",
                     against="q·k at the unshifted positions (RoPE makes q·k depend only on the offset m - n)")


# --------------------------------------------------------------------------------------
# Exercises: rotate_half, rope_cos_sin, apply_rope_rotate_half (Hugging Face layout)
# --------------------------------------------------------------------------------------


def _rotate_half_reference(x: torch.Tensor) -> torch.Tensor:
    """x @ R with R = [[0, I], [-I, 0]]: (x1, x2) -> (-x2, x1)."""
    half = x.shape[-1] // 2
    eye = torch.eye(half, dtype=torch.float64, device=x.device)
    zero = torch.zeros_like(eye)
    rotation = torch.cat([torch.cat([zero, eye], dim=1), torch.cat([-eye, zero], dim=1)], dim=0)
    return x.to(torch.float64) @ rotation


@check("rotate_half: (x1, x2) -> (-x2, x1) on the two halves of the last axis ({device})")
def check_rotate_half(rotate_half: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """rotate_half: values, shape and dtype kept, a quarter turn of every (j, j + d/2) pair."""
    expect_signature(rotate_half, "rotate_half", ["x"])
    generator = random_generator(seed)
    cases = [randn(2, 3, 5, 8, generator=generator, device=device),
             randn(2, 3, 5, 8, generator=generator, dtype=torch.float32, device=device),
             randn(4, 2, generator=generator, device=device),
             randn(2, 6, 3, 4, generator=generator, device=device).transpose(1, 2)]
    cases += [randn(randint(1, 3, generator), randint(1, 5, generator), 2 * randint(1, 10, generator),
                    generator=generator, device=device) for _ in range(4)]
    for x in cases:
        call = f"rotate_half(x) with x a {describe(x)}"
        out = call_student(rotate_half, x, call=call)
        _expect_same_dtype(out, x, call, HINTS["keep_dtype"])
        expect_tensor(out, what=call, shape=x.shape, dtype=x.dtype, device=x.device)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].double(), x[..., half:].double()
        even, odd = x[..., 0::2].double(), x[..., 1::2].double()
        expect_close(out, _rotate_half_reference(x), what=call, against="cat(-x2, x1) of the halves x1, x2",
                     variants=[Variant(torch.cat([x2, -x1], dim=-1), HINTS["rotate_half_sign"]),
                               Variant(torch.cat([x2, x1], dim=-1), HINTS["rotate_half_no_negation"]),
                               Variant(torch.stack([-odd, even], dim=-1).flatten(-2), HINTS["rotate_half_adjacent"]),
                               Variant(torch.cat([-odd, even], dim=-1), HINTS["rotate_half_adjacent"])])
    twice = call_student(rotate_half, call_student(rotate_half, cases[0], call="rotate_half(x)"), call="rotate_half(rotate_half(x))")
    expect_close(twice, -cases[0].double(), what="rotate_half(rotate_half(x))", against="-x (two quarter turns)")


@check("rope_cos_sin: [B, S, head_dim] cos/sin tables, angle j shared by features j and j + head_dim/2 ({device})")
def check_rope_cos_sin(rope_cos_sin: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """rope_cos_sin: (cos, sin) of cat(angles, angles) at position_ids, for the rotate_half layout."""
    expect_signature(rope_cos_sin, "rope_cos_sin", ["head_dim", "position_ids", "base"])
    generator = random_generator(seed)
    cases = [(8, torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]]), 10000.0),
             (16, torch.tensor([[255, 3, 100]]), 500000.0),
             (2, torch.tensor([[5]]), 100.0)]
    for _ in range(4):
        b, s = randint(1, 3, generator), randint(1, 8, generator)
        cases.append((2 * randint(1, 16, generator), torch.randint(0, 300, (b, s), generator=generator),
                      [100.0, 10000.0, 500000.0][randint(0, 2, generator)]))
    for head_dim, position_ids, base in cases:
        position_ids = position_ids.to(device)
        call = f"rope_cos_sin({head_dim}, position_ids, base={base}) with position_ids {_positions_text(position_ids)}"
        result = call_student(rope_cos_sin, head_dim, position_ids, base=base, call=call)
        expect_true(isinstance(result, tuple) and len(result) == 2, f"{call} should return a tuple (cos, sin), got {describe(result)}.")
        expected_cos, expected_sin = _cos_sin_reference(head_dim, position_ids, base, layout="half")
        b, s = position_ids.shape
        for name, table, expected, other in (("cos", result[0], expected_cos, expected_sin),
                                              ("sin", result[1], expected_sin, expected_cos)):
            what = f"{call} -> {name}"
            expect_tensor(table, what=what, shape=(b, s, head_dim), device=device,
                          hints={(b, s, head_dim // 2): HINTS["cos_sin_width"]})
            expect_true(table.dtype in (torch.float32, torch.float64),
                        f"{what} should be a float32 or float64 tensor, got {describe(table)}.")
            variant_cos, variant_sin = _cos_sin_reference(head_dim, position_ids, base, layout="interleaved")
            f1_cos, f1_sin = _cos_sin_reference(head_dim, position_ids, base, layout="half", factor=1.0)
            arange = torch.arange(s, device=device).expand(b, s)
            a_cos, a_sin = _cos_sin_reference(head_dim, arange, base, layout="half")
            pick = (lambda c, s_: c) if name == "cos" else (lambda c, s_: s_)
            variants = [Variant(pick(variant_cos, variant_sin), HINTS["cos_sin_layout"]),
                        Variant(pick(f1_cos, f1_sin), HINTS["factor_two"]),
                        Variant(other, HINTS["cos_sin_swapped"])]
            if not torch.equal(position_ids, arange):
                variants.append(Variant(pick(a_cos, a_sin), HINTS["positions_ignored"]))
            expect_close(table, expected, what=what, against=f"{name}(cat(angles, angles)) with angles = position·θ_j",
                         variants=variants, rtol=0.0,
                         atol=_angle_atol(table.dtype, int(position_ids.max())))


def _check_rotate_half_rope_once(fn: Callable, x: torch.Tensor, position_ids: torch.Tensor, base: float,
                                 table_dtype: torch.dtype) -> None:
    cos, sin = (t.to(table_dtype) for t in _cos_sin_reference(x.shape[-1], position_ids, base, layout="half"))
    call = (f"apply_rope_rotate_half(x, cos, sin) with x a {describe(x)}, cos/sin {shape_str(cos.shape)} "
            f"({str(table_dtype).replace('torch.', '')}), positions {_positions_text(position_ids)}")
    try:
        out = call_student(fn, x, cos, sin, call=call)
    except CheckFailure as failure:
        raise _add_hint_on_error(failure, "must match the size", HINTS["head_axis"]) from None
    _expect_same_dtype(out, x, call, HINTS["table_dtype"])
    expect_tensor(out, what=call, shape=x.shape, dtype=x.dtype, device=x.device)
    rtol, atol = tolerance(x.dtype, x.device)
    atol = max(atol, _angle_atol(min(x.dtype, table_dtype, key=lambda t: t.itemsize), int(position_ids.max()),
                                 float(x.abs().max())))
    expect_close(out, _rope_reference(x, position_ids, base, "half"), what=call,
                 against="each pair (x[j], x[j + d/2]) rotated by position·θ_j (x*cos + rotate_half(x)*sin)",
                 variants=_rope_variants(x, position_ids, base, "half", lambda *a: _meta_rope(*a, base=base)),
                 rtol=rtol, atol=atol)


@check("apply_rope_rotate_half: x*cos + rotate_half(x)*sin, pairs (j, j + head_dim/2), dtype kept ({device})",
       uses=("rotate_half",))
def check_apply_rope_rotate_half(apply_rope_rotate_half: Callable, *, seed: int = 0,
                                 device: torch.device | None = None) -> None:
    """apply_rope_rotate_half: Hugging Face layout, cos/sin [B, S, d] broadcast over heads, dtype kept."""
    expect_signature(apply_rope_rotate_half, "apply_rope_rotate_half", ["x", "cos", "sin"])
    generator = random_generator(seed)
    positions = torch.tensor([[3, 4, 5, 6, 7], [0, 2, 4, 6, 8]], device=device)
    fn = apply_rope_rotate_half
    _check_rotate_half_rope_once(fn, randn(2, 3, 5, 8, generator=generator, device=device), positions, 10000.0, torch.float64)
    _check_rotate_half_rope_once(fn, randn(2, 3, 5, 8, generator=generator, dtype=torch.float32, device=device),
                                 positions, 10000.0, torch.float32)
    # float64 tables (as rope_cos_sin may return) with float32 x: the output stays float32.
    _check_rotate_half_rope_once(fn, randn(2, 3, 5, 8, generator=generator, dtype=torch.float32, device=device),
                                 positions, 10000.0, torch.float64)
    x = randn(2, 5, 3, 8, generator=generator, device=device).transpose(1, 2)
    _check_rotate_half_rope_once(fn, x, torch.arange(5, device=device).expand(2, 5), 500000.0, torch.float64)
    for _ in range(4):
        b, h, s, d = (randint(1, 3, generator), randint(1, 4, generator), randint(1, 7, generator),
                      2 * randint(1, 8, generator))
        ids = torch.randint(0, 200, (b, s), generator=generator).to(device)
        _check_rotate_half_rope_once(fn, randn(b, h, s, d, generator=generator, device=device), ids, 10000.0, torch.float64)


# --------------------------------------------------------------------------------------
# Exercise: interleave_to_half_permutation
# --------------------------------------------------------------------------------------


@check("interleave_to_half_permutation: [0, 2, 4, …, 1, 3, 5, …]; the two RoPE layouts then agree, on x and on W_q/W_k rows ({device})")
def check_interleave_to_half_permutation(interleave_to_half_permutation: Callable, *, seed: int = 0,
                                         device: torch.device | None = None) -> None:
    """interleave_to_half_permutation: values; Meta RoPE and rotate_half RoPE agree under it."""
    expect_signature(interleave_to_half_permutation, "interleave_to_half_permutation", ["head_dim"])
    generator = random_generator(seed)
    sizes = [8, 2, 4, 128] + [2 * randint(1, 40, generator) for _ in range(4)]
    for head_dim in sizes:
        call = f"interleave_to_half_permutation({head_dim})"
        perm = call_student(interleave_to_half_permutation, head_dim, call=call)
        expect_tensor(perm, what=call, shape=(head_dim,))
        expect_true(perm.dtype == torch.long, f"{call} should be a LongTensor (int64, usable as an index), got {describe(perm)}.")
        expected = torch.tensor(sorted(range(head_dim), key=lambda i: (i % 2, i)))
        got = perm.cpu()
        if not torch.equal(got, expected):
            inverse = torch.empty_like(expected)
            inverse[expected] = torch.arange(head_dim)
            hint = ""
            if torch.equal(got, inverse):
                hint = _likely("inverse_permutation")
            elif torch.equal(got, expected.roll(head_dim // 2)):
                hint = _likely("odd_first")
            elif not torch.equal(got.sort().values, torch.arange(head_dim)):
                hint = _likely("not_a_permutation")
            shown = got.tolist()[:16]
            # Say where it goes wrong, not the whole answer (deriving it is the exercise).
            place = int((got != expected).nonzero()[0]) if got.shape == expected.shape else 0
            pair, which = (place, "first") if place < head_dim // 2 else (place - head_dim // 2, "second")
            raise CheckFailure(
                f"{call} returned {shown}{' ...' if head_dim > 16 else ''}: not the order under which the two "
                f"layouts agree. Place {place} holds feature {shown[place] if place < len(shown) else '?'}, but "
                f"rotate_half keeps the {which} element of its pair {pair} at place {place}, and Meta's pair "
                f"{pair} is features ({2 * pair}, {2 * pair + 1}).{hint}")
    # The point of it: the layouts agree after permuting features, or rows of W_q and W_k per head.
    head_dim, heads, hidden = 8, 3, 12
    perm = call_student(interleave_to_half_permutation, head_dim, call="interleave_to_half_permutation(8)").to(device)
    x = randn(2, heads, 5, head_dim, generator=generator, device=device)
    positions = torch.tensor([[0, 1, 2, 3, 4], [9, 10, 11, 12, 13]], device=device)
    meta = _rope_reference(x, positions, 10000.0, "interleaved")
    half = _rope_reference(x[..., perm], positions, 10000.0, "half")
    expect_close(half, meta[..., perm], what="rotate_half RoPE of x[..., perm]",
                 against="Meta RoPE of x, permuted the same way (apply_rope(x)[..., perm])")
    w_q = randn(heads * head_dim, hidden, generator=generator, device=device)
    w_k = randn(heads * head_dim, hidden, generator=generator, device=device)
    tokens = randn(2, 5, hidden, generator=generator, device=device)

    def heads_of(weight):
        return (tokens @ weight.T).view(2, 5, heads, head_dim).transpose(1, 2)

    def per_head_rows(weight):  # permute the rows of each head's [head_dim, hidden] block
        return weight.view(heads, head_dim, hidden)[:, perm].reshape(heads * head_dim, hidden)

    scores_meta = _rope_reference(heads_of(w_q), positions, 1e4) @ _rope_reference(heads_of(w_k), positions, 1e4).transpose(-2, -1)
    scores_half = (_rope_reference(heads_of(per_head_rows(w_q)), positions, 1e4, "half")
                   @ _rope_reference(heads_of(per_head_rows(w_k)), positions, 1e4, "half").transpose(-2, -1))
    expect_close(scores_half, scores_meta, what="attention scores of the rotate_half layout with W_q, W_k rows permuted per head",
                 against="the scores of the Meta layout with the original weights (how checkpoints are converted)")


# --------------------------------------------------------------------------------------
# Exercise: qk_norm
# --------------------------------------------------------------------------------------


def _qk_norm_variants(x: torch.Tensor, eps: float) -> list[Variant]:
    x64 = x.detach().double()
    mean_square = x64.pow(2).mean(-1, keepdim=True)
    variants = [
        Variant(lambda: x64 / x64.norm(dim=-1, keepdim=True).clamp_min(1e-12), HINTS["l2"]),
        Variant(lambda: x64 * torch.rsqrt(x64.pow(2).sum(-1, keepdim=True) + eps), HINTS["l2"]),
        Variant(lambda: x64 / (mean_square.sqrt() + eps), HINTS["eps_outside"]),
        Variant(lambda: x64 / mean_square.sqrt(), HINTS["eps_ignored"]),
        Variant(lambda: F.layer_norm(x64, (x64.shape[-1],), eps=eps), HINTS["layer_norm"]),
    ]
    if x.dim() >= 2 and x.shape[-2] > 1:
        variants.append(Variant(lambda: x64 * torch.rsqrt(x64.pow(2).mean(-2, keepdim=True) + eps), HINTS["norm_axis"]))
    return variants


@check("qk_norm: weightless RMS normalisation x·rsqrt(mean(x²) + eps); output norm sqrt(head_dim); from scratch ({device})")
def check_qk_norm(qk_norm: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """qk_norm: values against F.rms_norm (no weight), eps inside the root, dtype kept, norm sqrt(d)."""
    expect_signature(qk_norm, "qk_norm", ["x", "eps"])
    generator = random_generator(seed)
    cases = [
        (randn(2, 4, 5, 8, generator=generator, device=device), 1e-5),
        (randn(2, 4, 5, 8, generator=generator, dtype=torch.float32, device=device), 1e-5),
        # Tiny vectors: mean(x²) ~ 1e-6 is comparable to eps, which tells where eps goes.
        (randn(2, 3, 4, 8, generator=generator, device=device) * 1e-3, 1e-5),
        (randn(3, 16, generator=generator, device=device) * 0.05, 1e-2),
        (randn(2, 6, 3, 8, generator=generator, device=device).transpose(1, 2), 1e-6),
    ]
    for _ in range(4):
        shape = (randint(1, 3, generator), randint(1, 4, generator), randint(1, 6, generator), randint(1, 32, generator))
        cases.append((randn(*shape, generator=generator, device=device) * 10 ** (randint(-3, 1, generator)), 1e-5))
    for x, eps in cases:
        call = f"qk_norm(x, eps={eps:g}) with x a {describe(x)}"
        out = call_student(qk_norm, x, eps, call=call, forbidden=("rms_norm",))
        _expect_same_dtype(out, x, call, HINTS["keep_dtype"])
        expect_tensor(out, what=call, shape=x.shape, dtype=x.dtype, device=x.device,
                      hints={(*x.shape[:-1], 1): HINTS["norm_returned"]})
        expected = F.rms_norm(x.detach().double(), (x.shape[-1],), eps=eps)
        expect_close(out, expected, what=call, against="x / sqrt(mean(x², last axis) + eps) (F.rms_norm without weight)",
                     variants=_qk_norm_variants(x, eps))
    # Property: for vectors well above eps, the output has norm sqrt(d) (RMS 1), whatever x's scale.
    x = randn(4, 6, 32, generator=generator, device=device) * 7.0
    out = call_student(qk_norm, x, 1e-6, call="qk_norm(x, 1e-6)", forbidden=("rms_norm",))
    expect_close(out.norm(dim=-1), torch.full((4, 6), math.sqrt(32.0), dtype=torch.float64),
                 what="the norms of qk_norm(x) with head_dim = 32", against="sqrt(32) (RMS 1, so the norm is sqrt(d), not 1)",
                 rtol=1e-5, atol=1e-5, variants=[Variant(torch.ones(4, 6, dtype=torch.float64), HINTS["l2"])])


# --------------------------------------------------------------------------------------
# Exercise: repeat_kv
# --------------------------------------------------------------------------------------


def _kv_heads_for_query_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, H_kv, S, d] -> [B, num_heads, S, d]: query head h reads KV head h // (num_heads / H_kv)."""
    group = num_heads // x.shape[1]
    return torch.stack([x[:, h // group] for h in range(num_heads)], dim=1)


@check("repeat_kv: [B, H_kv, S, d] -> [B, H_kv·n_rep, S, d], each KV head repeated consecutively ({device})")
def check_repeat_kv(repeat_kv: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """repeat_kv: shape, consecutive grouping (h // n_rep), n_rep = 1, MQA, dtype and device kept."""
    expect_signature(repeat_kv, "repeat_kv", ["x", "n_rep"])
    generator = random_generator(seed)
    cases = [(randn(2, 4, 5, 8, generator=generator, device=device), 4),
             (randn(2, 4, 5, 8, generator=generator, dtype=torch.float32, device=device), 2),
             (randn(2, 3, 4, 6, generator=generator, device=device), 1),
             (randn(1, 1, 3, 4, generator=generator, device=device), 8),  # multi-query attention
             (randn(2, 5, 2, 4, generator=generator, device=device).transpose(1, 2), 3)]  # non-contiguous
    for _ in range(4):
        shape = (randint(1, 3, generator), randint(1, 4, generator), randint(1, 6, generator), randint(1, 8, generator))
        cases.append((randn(*shape, generator=generator, device=device), randint(1, 4, generator)))
    for x, n_rep in cases:
        b, h_kv, s, d = x.shape
        call = f"repeat_kv(x, n_rep={n_rep}) with x a {describe(x)}"
        out = call_student(repeat_kv, x, n_rep, call=call)
        expect_tensor(out, what=call, shape=(b, h_kv * n_rep, s, d), dtype=x.dtype, device=x.device,
                      hints={(b, h_kv, s * n_rep, d): HINTS["repeat_sequence_axis"],
                             (b, h_kv, n_rep, s, d): HINTS["repeat_not_merged"]})
        expect_close(out, _kv_heads_for_query_heads(x, h_kv * n_rep), what=call, against="query head h reading KV head h // n_rep",
                     variants=[Variant(lambda: x.repeat(1, n_rep, 1, 1), HINTS["tiled"])])


# --------------------------------------------------------------------------------------
# Exercise: KVCache
# --------------------------------------------------------------------------------------


def _seq_len(cache: Any, call: str) -> int:
    try:
        value = cache.seq_len
    except NotImplementedError:
        raise CheckFailure(f"{call}.seq_len: not implemented yet.") from None
    except Exception as error:
        raise CheckFailure(crash_message(f"reading {call}.seq_len", error)) from None
    expect_true(is_integer(value),
                f"{call}.seq_len should be an int (the number of cached tokens), got {describe(value)}.")
    return value


@check("KVCache: starts empty, update appends along the sequence axis and returns all K/V so far ({device})")
def check_kv_cache(KVCache: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """KVCache: seq_len, update(k, v) -> (k_all, v_all), independent instances, dtype/device kept."""
    generator = random_generator(seed)
    for dtype in (torch.float64, torch.float32):
        cache = call_student(KVCache, call="KVCache()")
        expect_true(_seq_len(cache, "KVCache()") == 0, f"KVCache().seq_len should be 0 for an empty cache, got {cache.seq_len!r}.")
        other = call_student(KVCache, call="KVCache()")
        keys, values, total = [], [], 0
        for step, new in enumerate((3, 1, 1, 2)):
            k = randn(2, 4, new, 8, generator=generator, dtype=dtype, device=device)
            v = randn(2, 4, new, 8, generator=generator, dtype=dtype, device=device)
            keys.append(k.clone())  # the check's own copies: what the student's cache keeps is its own
            values.append(v.clone())
            total += new
            call = f"KVCache.update(k, v) (update {step + 1}, k and v {describe(k)}, {total - new} tokens cached before)"
            try:
                result = call_student(cache.update, k, v, call=call)
            except CheckFailure as failure:
                raise _add_hint_on_error(failure, "Sizes of tensors must match", HINTS["cache_axis"]) from None
            expect_true(isinstance(result, tuple) and len(result) == 2,
                        f"{call} should return (k_all, v_all), got {describe(result)}.")
            for name, got, parts in (("k_all", result[0], keys), ("v_all", result[1], values)):
                hints = {(2, 4, new, 8): HINTS["cache_new_only"], (2, 4 * len(parts), 1, 8): HINTS["cache_axis"],
                         (2, 4, total, 8 * len(parts)): HINTS["cache_axis"]}
                expect_tensor(got, what=f"{call} -> {name}", shape=(2, 4, total, 8), dtype=dtype, device=device,
                              hints=hints)
                expect_close(got, torch.cat([p.double() for p in parts], dim=2), what=f"{call} -> {name}",
                             against=f"all {'keys' if name == 'k_all' else 'values'} so far, in order, along the sequence axis",
                             variants=[Variant(torch.cat([p.double() for p in reversed(parts)], dim=2),
                                               HINTS["cache_prepend"])])
            expect_true(_seq_len(cache, "cache") == total, f"after {call}, seq_len should be {total}, got {cache.seq_len!r}.")
        expect_true(_seq_len(other, "a second KVCache()") == 0,
                    f"a second KVCache() created before these updates now has seq_len {other.seq_len!r}."
                    f"{_likely('cache_shared')}")


# --------------------------------------------------------------------------------------
# Exercise: LlamaAttention
# --------------------------------------------------------------------------------------


_SHAPE_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def _config_text(config: _Config) -> str:
    """The config as the message shows it: the four sizes that set the shapes always, the rest if changed."""
    shown = [f"{name}={getattr(config, name)!r}" for name in _SHAPE_FIELDS]
    shown += [f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config)
              if f.name not in _SHAPE_FIELDS and getattr(config, f.name) != f.default]
    return "LlamaAttention(config with " + ", ".join(shown) + ")"


def _projection_hint(name: str, got: tuple, config: _Config) -> str:
    """The likely mistake behind a projection of the wrong shape, or ""."""
    h, h_kv, d, hidden = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size
    heads = h if name in ("q_proj", "o_proj") else h_kv
    if name == "o_proj" and got == (hidden, hidden):
        return _likely("o_proj_square")
    if name != "o_proj" and got == (hidden, hidden):
        return _likely("square_projections")
    swapped = (h * d, hidden) if name == "o_proj" else (hidden, heads * d)
    if got == swapped:
        return _likely("linear_in_out")
    if name in ("k_proj", "v_proj") and got == (h * d, hidden):
        return _likely("kv_heads")
    return ""


def _build_llama(cls: Callable, config: _Config, device: torch.device, dtype: torch.dtype,
                 generator: torch.Generator) -> tuple[nn.Module, str, types.SimpleNamespace]:
    """The student's LlamaAttention(config) with the check's random weights: (module, label, those weights,
    kept here: every reference comes from them, never from the module after the student's code ran).
    The module gets a copy of ``config``; the check keeps reading its own."""
    label = _config_text(config)
    module = call_student(cls, dataclasses.replace(config), call=label)
    expect_true(isinstance(module, nn.Module), f"{label} should be an nn.Module, got {describe(module)}.")
    h, h_kv, d, hidden = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size
    shapes = {"q_proj": (h * d, hidden), "k_proj": (h_kv * d, hidden), "v_proj": (h_kv * d, hidden), "o_proj": (hidden, h * d)}
    for name, shape in shapes.items():
        layer = getattr(module, name, None)
        expect_true(isinstance(layer, nn.Linear), f"{label} should have an attribute {name} that is an nn.Linear, got {describe(layer)}.")
        hint = _projection_hint(name, tuple(layer.weight.shape), config)
        expect_true(tuple(layer.weight.shape) == shape,
                    f"{label}.{name}.weight should be {shape_str(shape)} (nn.Linear stores [out, in]), got "
                    f"{shape_str(layer.weight.shape)}.{hint}")
        expect_true((layer.bias is not None) == config.attention_bias,
                    f"{label}.{name} should {'have' if config.attention_bias else 'have no'} bias (config.attention_bias).")
    # Move to the device first (safe for any buffer), then set the parameters in the wanted dtype.
    # (module.to(dtype) would also cast a complex RoPE buffer to real.)
    module.to(device)
    with torch.no_grad():
        for parameter in module.parameters():
            fan_in = parameter.shape[-1] if parameter.dim() > 1 else 10.0
            parameter.data = randn(*parameter.shape, generator=generator, dtype=dtype, device=device) / math.sqrt(fan_in)
    weights = types.SimpleNamespace(**{name: types.SimpleNamespace(weight=_cloned(layer.weight), bias=_cloned(layer.bias))
                                       for name in shapes for layer in [getattr(module, name)]})
    return module, label, weights


def _cloned(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().clone()


def _linear64(layer: nn.Linear):
    bias = None if layer.bias is None else layer.bias.detach().to("cpu", torch.float64)
    return layer.weight.detach().to("cpu", torch.float64), bias


def _llama_reference(weights: types.SimpleNamespace, config: _Config, x: torch.Tensor, positions: torch.Tensor,
                     n_new: int | None = None, *, mask: str = "causal", layout: str = "interleaved",
                     repeat: str = "consecutive", rope_on_v: bool = False, o_proj: bool = True,
                     scale: float | None = None, norm: str | None = None, eps: float | None = None,
                     angle_sign: float = 1.0, split: str = "transpose", merge: str = "transpose",
                     softmax_axis: int = -1) -> torch.Tensor:
    """LlamaAttention's output for the last n_new tokens of x [B, T, hidden] (earlier ones cached).

    q/k/v from the projections' ``weights`` (as :func:`_build_llama` set them), RoPE as pair rotations, QK norm from F.rms_norm, attention from
    F.scaled_dot_product_attention(..., enable_gqa=True) on the math backend; float64 on the CPU.
    The keyword arguments select known wrong variants for diagnosis.
    """
    h, h_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    x = x.detach().to("cpu", torch.float64)
    positions = positions.to("cpu")
    b, t, _ = x.shape
    n_new = t if n_new is None else n_new
    q = F.linear(x[:, t - n_new:], *_linear64(weights.q_proj))  # [B, n, H*d]
    k, v = F.linear(x, *_linear64(weights.k_proj)), F.linear(x, *_linear64(weights.v_proj))  # [B, T, H_kv*d]
    # split="reshape" (all three) or "reshape_q": heads cut in memory order, the sequence axis never moved.
    q = q.reshape(b, h, n_new, d) if split != "transpose" else q.view(b, n_new, h, d).transpose(1, 2)  # [B, H, n, d]
    if split == "reshape":
        k, v = k.reshape(b, h_kv, t, d), v.reshape(b, h_kv, t, d)
    else:
        k, v = k.view(b, t, h_kv, d).transpose(1, 2), v.view(b, t, h_kv, d).transpose(1, 2)  # [B, H_kv, T, d]
    q = _rope_reference(q, positions[:, t - n_new:], config.rope_theta, layout, angle_sign)
    k = _rope_reference(k, positions, config.rope_theta, layout, angle_sign)
    if rope_on_v:
        v = _rope_reference(v, positions, config.rope_theta, layout, angle_sign)
    norm = norm or ("rms" if config.use_qk_norm else "none")
    eps = config.rms_norm_eps if eps is None else eps
    if norm == "rms":
        q, k = F.rms_norm(q, (d,), eps=eps), F.rms_norm(k, (d,), eps=eps)
    elif norm == "l2":
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    if repeat == "tiled":
        k, v = k.repeat(1, h // h_kv, 1, 1), v.repeat(1, h // h_kv, 1, 1)
    if mask == "new_only":
        k, v = k[:, :, t - n_new:], v[:, :, t - n_new:]
    keys = k.shape[-2]
    enable_gqa = k.shape[1] != h
    if softmax_axis != -1:  # written out: SDPA has no softmax over the queries
        k_all = k.repeat_interleave(h // k.shape[1], dim=1)
        v_all = v.repeat_interleave(h // v.shape[1], dim=1)
        scores = q @ k_all.transpose(-2, -1) * (1 / math.sqrt(d) if scale is None else scale)
        allowed = torch.arange(keys)[None, :] <= torch.arange(n_new)[:, None] + (keys - n_new)
        out = scores.masked_fill(~allowed, -math.inf).softmax(dim=softmax_axis).nan_to_num(0.0) @ v_all
    elif mask == "causal" and keys == n_new:
        out = reference_sdpa(q, k, v, is_causal=True, enable_gqa=enable_gqa, scale=scale)
    else:
        query_index = torch.arange(n_new)[:, None]
        key_index = torch.arange(keys)[None, :]
        attn_mask = {"causal": key_index <= query_index + (keys - n_new),  # bottom-right: the cache is visible
                     "top_left": key_index <= query_index,
                     "none": None,
                     "new_only": key_index <= query_index}[mask]
        out = reference_sdpa(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa, scale=scale)
    out = out.reshape(b, n_new, h * d) if merge == "reshape" else out.transpose(1, 2).reshape(b, n_new, h * d)
    if o_proj:
        return F.linear(out, *_linear64(weights.o_proj))
    return out if h * d == config.hidden_size else None


def _llama_variants(weights, config, x, positions, n_new=None, chunk_positions=None) -> list[Variant]:
    h, h_kv = config.num_attention_heads, config.num_key_value_heads

    def variant(hint, **kwargs):
        return Variant(lambda: _llama_reference(weights, config, x, positions, n_new, **kwargs), hint)

    variants = []
    # The cache mistakes only show once something is cached (on a prefill they equal the right answer).
    if chunk_positions is not None:
        variants += [variant(HINTS["mask_offset"], mask="top_left"), variant(HINTS["cache_ignored"], mask="new_only"),
                     Variant(lambda: _llama_reference(weights, config, x, chunk_positions, n_new), HINTS["cache_offset"])]
        if n_new and n_new > 1:
            variants.append(variant(HINTS["cache_mask_missing"], mask="none"))
    variants += [
        variant(HINTS["no_o_proj"], o_proj=False),
        variant(HINTS["rope_on_v"], rope_on_v=True),
        variant(HINTS["no_mask"], mask="none"),
        variant(HINTS["scale_hidden"], scale=1 / math.sqrt(config.hidden_size)),
        variant(HINTS["no_scale"], scale=1.0),
        variant(HINTS["pairing_half"], layout="half"),
        variant(HINTS["rope_conjugate"], angle_sign=-1.0),
        variant(HINTS["split_no_transpose"], split="reshape"),
        variant(HINTS["split_no_transpose"], split="reshape_q"),
        variant(HINTS["merge_no_transpose"], merge="reshape"),
        variant(HINTS["softmax_queries"], softmax_axis=-2),
    ]
    if h_kv > 1 and h > h_kv:
        variants.append(variant(HINTS["tiled"], repeat="tiled"))
    b, t = positions.shape
    arange = torch.arange(t, device=positions.device).expand(b, t)
    if chunk_positions is None and not torch.equal(positions, arange):
        variants.append(Variant(lambda: _llama_reference(weights, config, x, arange, n_new), HINTS["positions_ignored"]))
    if config.use_qk_norm:
        variants += [variant(HINTS["l2"], norm="l2"), variant(HINTS["qk_norm_missing"], norm="none")]
        if config.rms_norm_eps != 1e-6:
            variants.append(variant(HINTS["eps_config"], eps=1e-6))
    else:
        variants.append(variant(HINTS["qk_norm_unwanted"], norm="rms"))
    return variants


def _call_llama(module, label, x, position_ids=None, kv_cache=None, what=""):
    """The student's forward (from scratch); a ``kv_cache`` is the one argument it writes (it fills it)."""
    kwargs = {}
    call = f"{label}(hidden_states"
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
        call += f", position_ids={_positions_text(position_ids)}"
    if kv_cache is not None:
        kwargs["kv_cache"] = kv_cache
        call += ", kv_cache"
    call += f") with hidden_states a {describe(x)}{what}"
    return call_student(module, x, call=call, forbidden=FROM_SCRATCH, writes=("kv_cache",), **kwargs), call


def _check_llama_forward(module, label, weights, config, x, position_ids=None) -> torch.Tensor:
    b, s, _ = x.shape
    out, call = _call_llama(module, label, x, position_ids)
    if isinstance(out, tuple):
        raise CheckFailure(f"{call} should return the output tensor alone when no kv_cache is given, got {describe(out)}.")
    expect_tensor(out, what=call, shape=(b, s, config.hidden_size), dtype=x.dtype, device=x.device)
    positions = torch.arange(s).expand(b, s) if position_ids is None else position_ids.cpu()
    rtol, atol = tolerance(x.dtype, x.device)
    expect_close(out, _llama_reference(weights, config, x, positions), what=call,
                 against="o_proj(SDPA(RoPE+QK-norm q, k; v; is_causal=True, enable_gqa=True)) with your weights",
                 variants=_llama_variants(weights, config, x, positions), rtol=rtol, atol=atol * 3)
    return out


# The earlier answers a LlamaAttention is usually built on: when it fails, the ones that fail their own check are named.
LLAMA_PARTS = ("rope_frequencies", "apply_rope", "qk_norm", "repeat_kv", "causal_mask")


@check("LlamaAttention: GQA + RoPE + QK norm + causal attention from scratch equals SDPA(is_causal, enable_gqa); "
       "H_kv == H is plain MHA; no future leak ({device})", uses=LLAMA_PARTS)
def check_llama_attention(LlamaAttention: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """LlamaAttention (no cache): attributes, values against PyTorch, MHA equivalence, causality, from scratch."""
    expect_signature(LlamaAttention, "LlamaAttention", ["config"])
    generator = random_generator(seed)
    # 1. The notebook's configuration, float64 then float32, default positions 0 ... S-1.
    for dtype in (torch.float64, torch.float32):
        config = _Config()
        module, label, weights = _build_llama(LlamaAttention, config, device, dtype, generator)
        _check_llama_forward(module, label, weights, config, randn(2, 6, 128, generator=generator, dtype=dtype, device=device))
    # 2. Other configurations: head_dim independent of hidden_size, bias, large eps, other theta, explicit positions.
    configs = [
        _Config(hidden_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True,
                rms_norm_eps=0.5, rope_theta=500000.0),
        _Config(hidden_size=16, num_attention_heads=6, num_key_value_heads=3, head_dim=4, use_qk_norm=False),
        _Config(hidden_size=20, num_attention_heads=3, num_key_value_heads=1, head_dim=6, max_position_embeddings=64),
    ]
    for config in configs:
        module, label, weights = _build_llama(LlamaAttention, config, device, torch.float64, generator)
        positions = torch.tensor([[7, 8, 9, 10, 11], [0, 3, 6, 9, 12]], device=device)
        _check_llama_forward(module, label, weights, config,
                             randn(2, 5, config.hidden_size, generator=generator, device=device), positions)
        _check_llama_forward(module, label, weights, config, randn(1, 1, config.hidden_size, generator=generator, device=device))
    # 3. With H_kv == H (and RoPE at position 0, no QK norm) it is plain causal multi-head attention.
    for h_kv in (4, 2):
        config = _Config(hidden_size=16, num_attention_heads=4, num_key_value_heads=h_kv, head_dim=4, use_qk_norm=False)
        module, label, weights = _build_llama(LlamaAttention, config, device, torch.float64, generator)
        n_rep = 4 // h_kv
        torch_mha = nn.MultiheadAttention(16, 4, bias=False, batch_first=True, device=device, dtype=torch.float64)
        with torch.no_grad():
            def repeated(weight):  # K/V rows of KV head g copied for query heads g*n_rep ... (g+1)*n_rep - 1
                return weight.view(h_kv, 4, 16).repeat_interleave(n_rep, dim=0).reshape(16, 16)
            torch_mha.in_proj_weight.copy_(torch.cat([weights.q_proj.weight, repeated(weights.k_proj.weight),
                                                      repeated(weights.v_proj.weight)]))
            torch_mha.out_proj.weight.copy_(weights.o_proj.weight)
        x = randn(2, 7, 16, generator=generator, device=device)
        causal = torch.ones(7, 7, dtype=torch.bool, device=device).tril()
        expected, _ = torch_mha(x, x, x, attn_mask=~causal, need_weights=False)  # its mask: True = blocked
        out, call = _call_llama(module, label, x, torch.zeros(2, 7, dtype=torch.long, device=device))
        what = ("plain causal MHA (nn.MultiheadAttention)" if h_kv == 4 else
                "nn.MultiheadAttention whose K/V heads are copies: query head h reads KV head h // n_rep")
        expect_close(out, expected, what=call + " (RoPE at position 0 is no rotation)", against=what,
                     variants=[Variant(lambda: _llama_reference(weights, config, x, torch.zeros(2, 7, dtype=torch.long),
                                                                repeat="tiled"), HINTS["tiled"])] if h_kv < 4 else [])
    # 4. Causality on random sizes: changing the last token changes no earlier output.
    for _ in range(3):
        h_kv = randint(1, 3, generator)
        config = _Config(hidden_size=randint(4, 24, generator), num_attention_heads=h_kv * randint(1, 3, generator),
                         num_key_value_heads=h_kv, head_dim=2 * randint(1, 4, generator))
        module, label, weights = _build_llama(LlamaAttention, config, device, torch.float64, generator)
        s = randint(2, 8, generator)
        x = randn(2, s, config.hidden_size, generator=generator, device=device)
        before = _check_llama_forward(module, label, weights, config, x)
        changed = x.clone()
        changed[:, -1] += 1.0
        after, call = _call_llama(module, label, changed, what=" (last token changed)")
        expect_close(after[:, :-1], before[:, :-1], what=call + " -> outputs of the earlier tokens",
                     against="the outputs before the change (no future token may influence the past)")


class _ReferenceCache:
    """A preallocated cache of ``capacity`` tokens, to check LlamaAttention independently of the student's
    KVCache (whose contract, ``KVCache()`` growing without limit, it deliberately does not offer)."""

    def __init__(self, batch: int, num_kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.keys = torch.zeros(batch, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.filled = 0

    @property
    def seq_len(self) -> int:
        return self.filled

    def update(self, k: torch.Tensor, v: torch.Tensor):
        end = self.filled + k.shape[-2]
        self.keys[:, :, self.filled:end] = k
        self.values[:, :, self.filled:end] = v
        self.filled = end
        # Contiguous copies, as a cache grown by torch.cat would return.
        return self.keys[:, :, :end].contiguous(), self.values[:, :, :end].contiguous()


def _decode(module, label, weights, config, x, chunks, cache=None, explicit_positions=None) -> None:
    """Feed x [B, T, hidden] through the cache (the course's own when None) in chunks; compare every chunk
    with one full causal pass."""
    b, t, _ = x.shape
    if cache is None:
        cache = _ReferenceCache(b, config.num_key_value_heads, t, config.head_dim, x.dtype, x.device)
    positions = torch.arange(t).expand(b, t) if explicit_positions is None else explicit_positions.cpu()
    chunk_positions = torch.cat([torch.arange(c) for c in chunks]).expand(b, t)
    start = 0
    for index, size in enumerate(chunks):
        end = start + size
        given = None if explicit_positions is None else explicit_positions[:, start:end]
        what = (f" (chunk {index + 1} of sizes {list(chunks)}: tokens {start}…{end - 1}, {start} cached before"
                f"{', default positions' if given is None else ''})")
        result, call = _call_llama(module, label, x[:, start:end], given, cache, what=what)
        expect_true(isinstance(result, tuple) and len(result) == 2,
                    f"{call} should return (out, kv_cache) when a cache is given, got {describe(result)}.")
        out, returned = result
        expect_tensor(out, what=call + " -> out", shape=(b, size, config.hidden_size), dtype=x.dtype, device=x.device)
        expect_true(_seq_len(returned, "the returned kv_cache") == end,
                    f"after {call}, the returned kv_cache should hold {end} tokens, got seq_len {returned.seq_len!r}. "
                    "Update the cache with the new (rotated, normed) keys and values: kv_cache.update(k, v).")
        rtol, atol = tolerance(x.dtype, x.device)
        expect_close(out, _llama_reference(weights, config, x[:, :end], positions[:, :end], size), what=call + " -> out",
                     against="the same tokens' outputs in one full causal pass over the whole sequence",
                     variants=_llama_variants(weights, config, x[:, :end], positions[:, :end], size,
                                              chunk_positions=chunk_positions[:, :end] if start else None),
                     rtol=rtol, atol=atol * 3)
        cache = returned
        start = end


@check("LlamaAttention with a KV cache: prefill, token-by-token and chunked decoding equal one full causal pass ({device})",
       uses=(*LLAMA_PARTS, "KVCache"))
def check_llama_attention_kv_cache(LlamaAttention: Callable, KVCache: Callable, *, seed: int = 0,
                                   device: torch.device | None = None) -> None:
    """LlamaAttention(..., kv_cache=...): positions continue from the cache; new tokens see all cached ones."""
    expect_signature(LlamaAttention, "LlamaAttention", ["config"])
    generator = random_generator(seed)
    config = _Config()
    module, label, weights = _build_llama(LlamaAttention, config, device, torch.float64, generator)
    x = randn(2, 9, 128, generator=generator, device=device)
    _decode(module, label, weights, config, x, (4, 1, 1, 1, 1, 1))  # prefill, then one token at a time
    _decode(module, label, weights, config, x, (3, 2, 3, 1))  # chunked
    _decode(module, label, weights, config, x, (1,) * 9)  # from an empty cache, token by token
    explicit = torch.tensor([[20 + i for i in range(9)], [i * 2 for i in range(9)]], device=device)
    _decode(module, label, weights, config, x, (5, 1, 3), explicit_positions=explicit)
    config = _Config(hidden_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True)
    module, label, weights = _build_llama(LlamaAttention, config, device, torch.float32, generator)
    _decode(module, label, weights, config, randn(1, 6, 24, generator=generator, dtype=torch.float32, device=device),
            (2, 1, 3))
    # Finally with the student's own KVCache.
    cache = call_student(KVCache, call="KVCache()")
    try:
        _decode(module, label, weights, config, randn(2, 5, 24, generator=generator, dtype=torch.float32, device=device),
                (3, 1, 1), cache)
    except CheckFailure as failure:
        raise CheckFailure(f"LlamaAttention works with the course's reference cache but not with your KVCache "
                           f"(run test_KVCache first):\n{failure}") from None


# --------------------------------------------------------------------------------------
# Exercise: causal_mask_lower_right
# --------------------------------------------------------------------------------------


@check("causal_mask_lower_right: [q_len, kv_len] bool aligned bottom right; a chunk of queries then equals the "
       "full causal pass; ValueError for q_len > kv_len ({device})", uses=("causal_mask",))
def check_causal_mask_lower_right(causal_mask_lower_right: Callable, *, seed: int = 0,
                                  device: torch.device | None = None) -> None:
    """causal_mask_lower_right: values for q_len <= kv_len (1, a chunk, all), device, the property it exists for."""
    expect_signature(causal_mask_lower_right, "causal_mask_lower_right", ["q_len", "kv_len", "device"])
    generator = random_generator(seed)
    cases = [(2, 5), (1, 6), (4, 4), (1, 1), (3, 9)]
    for _ in range(4):
        kv_len = randint(1, 40, generator)
        cases.append((randint(1, kv_len, generator), kv_len))
    for index, (q_len, kv_len) in enumerate(cases):
        target = torch.device("cpu") if index == 1 else device
        call = (f"causal_mask_lower_right({q_len}, {kv_len})" if index == 1
                else f"causal_mask_lower_right({q_len}, {kv_len}, device={device.type!r})")
        args = {} if index == 1 else {"device": device}
        mask = call_student(causal_mask_lower_right, q_len, kv_len, call=call, **args)
        _expect_boolean_mask(mask, call, (q_len, kv_len), target)
        _expect_mask(mask, call, q_len, kv_len)
    # What it is for: the last q_len queries, attending with this mask to all kv_len keys, get exactly
    # their rows of one full causal pass.
    q_len, kv_len = 3, 8
    q = randn(2, 4, kv_len, 8, generator=generator, device=device)
    k, v = randn(2, 4, kv_len, 8, generator=generator, device=device), randn(2, 4, kv_len, 8, generator=generator, device=device)
    call = f"causal_mask_lower_right({q_len}, {kv_len}, device={device.type!r})"
    mask = call_student(causal_mask_lower_right, q_len, kv_len, device=device, call=call)
    chunk = reference_sdpa(q[:, :, -q_len:], k, v, attn_mask=mask)
    expect_close(chunk, reference_sdpa(q, k, v, is_causal=True)[:, :, -q_len:],
                 what=f"SDPA of the last {q_len} queries with attn_mask={call}",
                 against="the same queries' rows of one full causal pass (is_causal=True over all tokens)")
    for q_len, kv_len in ((3, 2), (5, 1)):
        expect_value_error(causal_mask_lower_right, q_len, kv_len, call=f"causal_mask_lower_right({q_len}, {kv_len})",
                           why=f"{q_len} queries cannot be the last tokens of only {kv_len} keys",
                           must_mention=(q_len, kv_len))


# --------------------------------------------------------------------------------------
# Exercise: kv_cache_bytes
# --------------------------------------------------------------------------------------


def _cache_bytes_reference(num_layers, num_kv_heads, head_dim, seq_len, batch_size, dtype: torch.dtype) -> int:
    """Allocate (on the meta device: no memory) one layer's K and V in dtype, count their bytes, times layers."""
    one = torch.empty(batch_size, num_kv_heads, seq_len, head_dim, dtype=dtype, device="meta")
    return num_layers * 2 * one.numel() * one.element_size()


@check("kv_cache_bytes: 2 (K and V) · layers · H_kv · head_dim · S · B · bytes")
def check_kv_cache_bytes(kv_cache_bytes: Callable, *, seed: int = 0, device: torch.device | None = None) -> None:
    """kv_cache_bytes: an int equal to the bytes of the K and V tensors of every layer."""
    parameters = ["num_layers", "num_kv_heads", "head_dim", "seq_len", "batch_size", "bytes_per_element"]
    expect_signature(kv_cache_bytes, "kv_cache_bytes", parameters)
    generator = random_generator(seed)
    cases = [(32, 32, 128, 4096, 1, 2), (32, 8, 128, 8192, 1, 2), (1, 1, 1, 1, 1, 1), (2, 4, 8, 10, 3, 4)]
    for _ in range(5):
        cases.append((randint(1, 80, generator), randint(1, 16, generator), 2 ** randint(3, 8, generator),
                      randint(1, 100000, generator), randint(1, 64, generator), 2 ** randint(0, 3, generator)))
    for case in cases:
        call = "kv_cache_bytes(" + ", ".join(f"{n}={v}" for n, v in zip(parameters, case)) + ")"
        got = call_student(kv_cache_bytes, *case, call=call)
        dtype = {1: torch.int8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[case[-1]]
        expected = _cache_bytes_reference(*case[:-1], dtype)
        expect_true(is_integer(got), f"{call} should return an int (a number of bytes), got {describe(got)}.")
        hint = ""
        if got * 2 == expected:
            hint = _likely("bytes_keys_only")
        elif case[0] > 1 and got * case[0] == expected:
            hint = _likely("bytes_one_layer")
        elif got == 8 * expected:
            hint = _likely("bytes_bits")
        elif case[4] > 1 and got * case[4] == expected:
            hint = _likely("bytes_no_batch")
        expect_true(got == expected, f"{call} should be {expected:,} bytes, got {got:,}.{hint}")


freeze_module(__name__)
