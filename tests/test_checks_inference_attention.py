"""Tests of notebook 07's checks (attention_lab.checks.inference_attention), its Triton launcher, its widgets and
its part of `make gpu-check`.

Every exercise: the solution passes; correct answers written otherwise (float32 inside, einsum, loops, logaddexp
folds, a cache that keeps owner sets instead of counts, vLLM-like gathers ...) pass; each known mistake -- most
planted into the solution's own text, so that the rest of the answer is right -- is rejected with the hint that
names it. Every test that calls a check runs twice: in the lab, and through the bridge as grading runs it.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():  # kernels below must be defined in interpreter mode (as the setup cell does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from attention_lab.bridge import wire  # noqa: E402
from attention_lab.checking import HINTS as FRAMEWORK_HINTS  # noqa: E402
from attention_lab.checking import CheckFailure  # noqa: E402
from attention_lab.checks import inference_attention as checks  # noqa: E402
from attention_lab.checks.efficient_attention import HINTS as EFFICIENT_HINTS  # noqa: E402
from attention_lab.checks.inference_attention import (  # noqa: E402
    KERNEL_HINTS,
    MERGE_HINTS,
    MLA_HINTS,
    PAGED_HINTS,
    SPLIT_HINTS,
    TREE_HINTS,
    WINDOW_HINTS,
)
from attention_lab.hint_catalog import _normalise, hint_pattern  # noqa: E402
from attention_lab.triton_kernels import TRITON_AVAILABLE, launch_split_kv_decode  # noqa: E402
from tests.bridge_harness import run_both_ways  # noqa: E402
from tests.curriculum import demos_before_their_check, long_code_lines, solution_cells  # noqa: E402

where_checks_run = run_both_ways()

NOTEBOOK = "07_inference_attention"
CPU = {"device": "cpu", "quiet": True}
NEG_INF = float("-inf")
needs_triton = pytest.mark.skipif(not TRITON_AVAILABLE or torch.cuda.is_available(),
                                  reason="needs Triton's interpreter (no Triton here, or a GPU compiles natively)")


def rejects(check, answer, hint: str, *extra) -> str:
    """``check`` fails ``answer`` with a message that contains ``hint`` (its format fields match anything)."""
    with pytest.raises(CheckFailure) as failure:
        check(answer, *extra, **CPU)
    message = str(failure.value)
    assert hint_pattern(hint).search(_normalise(message)), message
    return message


# --------------------------------------------------------------------------------------
# The solution, and mistakes planted into its text
# --------------------------------------------------------------------------------------

PRELUDE = ("import math\n\nimport torch\nimport torch.nn.functional as F\n\n"
           "from attention_lab.latent_attention import MLAWeights\n"
           "from attention_lab.triton_kernels import launch_split_kv_decode, tl, triton\n\n\n")


def _solution_cells():
    return solution_cells(NOTEBOOK)


def _solution_source(replacements: tuple[tuple[str, str, str], ...] = ()) -> str:
    """The notebook's given helpers and every answer cell (solutions in), each (answer, old, new) replaced."""
    cells = _solution_cells()
    helpers = next(c.source for c in cells if c.cell_type == "code" and "def apply_rope_at" in c.source)
    answers = {c.metadata["answer"]: re.sub(r"\n *### (BEGIN|END) SOLUTION", "", c.source)
               for c in cells if "answer" in c.metadata}
    for name, old, new in replacements:
        assert old in answers[name], f"{name}: {old!r} is not in the solution"
        answers[name] = answers[name].replace(old, new)
    return PRELUDE + helpers + "\n\n\n" + "\n\n\n".join(answers.values()) + "\n"


_MODULES: dict = {}
_FOLDER = tempfile.TemporaryDirectory(prefix="attention-lab-07-")  # removed when this process ends


def solution(*replacements: tuple[str, str, str]):
    """The solution's answers as a module (a file: Triton reads a kernel's source), with mistakes planted."""
    if replacements in _MODULES:
        return _MODULES[replacements]
    path = Path(_FOLDER.name) / f"answers_{len(_MODULES)}.py"
    path.write_text(_solution_source(replacements))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _MODULES[replacements] = module
    return module


def planted(name: str, *pairs: str):
    """The solution's answer ``name`` with each ``old`` replaced by its ``new`` (pairs: old, new, old, new ...)."""
    return getattr(solution(*((name, old, new) for old, new in zip(pairs[::2], pairs[1::2]))), name)


def test_the_solution_passes_every_check():
    answers = solution()
    for check, name in (("merge_attention_states", "merge_attention_states"), ("split_kv_decode", "split_kv_decode"),
                        ("slot_mapping", "slot_mapping"), ("paged_kv_cache", "PagedKVCache"),
                        ("paged_kv_cache_fork", "PagedKVCache"), ("paged_decode_attention", "paged_decode_attention"),
                        ("sliding_window_mask", "sliding_window_mask"), ("attention_with_sinks", "attention_with_sinks"),
                        ("streaming_kept_positions", "streaming_kept_positions"),
                        ("streaming_decode", "streaming_decode"), ("mla_cache_entry", "mla_cache_entry"),
                        ("mla_attention_naive", "mla_attention_naive"),
                        ("mla_attention_absorbed", "mla_attention_absorbed"),
                        ("mla_attention_absorbed_memory", "mla_attention_absorbed"),
                        ("mla_cache_bytes", "mla_cache_bytes"), ("tree_attention_mask", "tree_attention_mask"),
                        ("tree_position_ids", "tree_position_ids")):
        getattr(checks, f"check_{check}")(getattr(answers, name), **CPU)


# --------------------------------------------------------------------------------------
# merge_attention_states
# --------------------------------------------------------------------------------------


def merge_pairwise(outs, lses):
    # One part at a time, as states arrive (cascade attention): logaddexp, and the two shares of each merge.
    out, lse = outs[0].double(), lses[0].double()
    for part_out, part_lse in zip(outs[1:].double(), lses[1:].double()):
        total = torch.logaddexp(lse, part_lse)
        safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
        mine, theirs = torch.exp(lse - safe)[..., None], torch.exp(part_lse - safe)[..., None]
        out = torch.where(mine > 0, mine * out, 0.0) + torch.where(theirs > 0, theirs * part_out, 0.0)
        lse = total
    return out.to(outs.dtype), lse.to(lses.dtype)


def merge_softmax_float32(outs, lses):
    # A softmax over the parts axis (float32 inside), empty parts zeroed first; all-empty rows guarded.
    weights = torch.softmax(lses.float(), dim=0).nan_to_num(0.0)  # a row of -inf only: NaN -> 0
    out = (weights[..., None] * outs.float().nan_to_num(0.0)).sum(0)
    return out.to(outs.dtype), torch.logsumexp(lses.float(), dim=0).to(lses.dtype)


@pytest.mark.parametrize("answer", [merge_pairwise, merge_softmax_float32])
def test_merge_correct_styles_pass(answer):
    checks.check_merge_attention_states(answer, **CPU)


def _merge(weights_of, lse_of):
    def merge(outs, lses):
        lse = lse_of(lses)
        return (weights_of(lses, lse)[..., None] * outs).sum(0), lse
    return merge


MERGE_MISTAKES = {
    "equal_weights": _merge(lambda lses, lse: torch.ones_like(lses) / lses.shape[0], lambda l: torch.logsumexp(l, 0)),
    "unnormalised": _merge(lambda lses, lse: torch.exp(lses), lambda l: torch.logsumexp(l, 0)),
    "lse_max": _merge(lambda lses, lse: torch.softmax(lses, 0), lambda l: l.amax(0)),
    "lse_sum": _merge(lambda lses, lse: torch.softmax(lses, 0), lambda l: l.sum(0)),
    "base2": _merge(lambda lses, lse: torch.exp2(lses - lse), lambda l: torch.log2(torch.exp2(l).sum(0))),
    # exp(lse_i - lse) times a NaN out: right weights, NaN products
    "empty_nan": _merge(lambda lses, lse: torch.exp(lses - lse), lambda l: torch.logsumexp(l, 0)),
    # nan_to_num on the outs, not on the weights: e^(-inf - (-inf)) = NaN where every part is empty
    "all_empty_nan": lambda outs, lses: _merge(lambda l, lse: torch.exp(l - lse), lambda l: torch.logsumexp(l, 0))(
        outs.nan_to_num(0.0), lses),
    "overflow": _merge(lambda lses, lse: torch.exp(lses) / torch.exp(lses).sum(0), lambda l: torch.log(torch.exp(l).sum(0))),
}


@pytest.mark.parametrize("mistake", sorted(MERGE_MISTAKES))
def test_merge_mistakes_are_named(mistake):
    rejects(checks.check_merge_attention_states, MERGE_MISTAKES[mistake], MERGE_HINTS[mistake])


def test_merge_keeps_each_inputs_dtype():
    def float64_out(outs, lses):
        out, lse = merge_pairwise(outs, lses)
        return out.double(), lse
    message = rejects(checks.check_merge_attention_states, float64_out, "out keeps outs' dtype")
    assert "should keep the input dtype" in message


def test_the_merge_demo_of_the_notebook_weights_a_base2_lse_by_powers_of_the_shares():
    """07's text: a base-2 lse merged as natural gives weights that sum to 1 and are proportional to share^1.44."""
    lse_a, lse_b = torch.tensor([1.3, -0.4], dtype=torch.float64), torch.tensor([0.2, 0.9], dtype=torch.float64)
    share_a = torch.exp(lse_a - torch.logaddexp(lse_a, lse_b))
    two_a, two_b = lse_a / math.log(2), lse_b / math.log(2)
    weight_a = torch.exp(two_a - torch.logaddexp(two_a, two_b))
    power = share_a ** (1 / math.log(2))
    expected = power / (power + (1 - share_a) ** (1 / math.log(2)))
    torch.testing.assert_close(weight_a, expected)
    assert bool(((weight_a - 0.5).abs() > (share_a - 0.5).abs()).all())  # pushed away from 1/2


# --------------------------------------------------------------------------------------
# split_kv_decode
# --------------------------------------------------------------------------------------


def split_einsum_float32(q, k, v, num_splits, scale=None):
    # float32 inside, einsum over the group axis, the parts merged by logaddexp folds of their own.
    b, hq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    if num_splits < 1 or length < 1 or hq % hkv:
        raise ValueError(f"bad sizes: num_splits={num_splits}, L={length}, H_q={hq}, H_kv={hkv}")
    scale = scale if scale is not None else d ** -0.5
    qg = q.float().view(b, hkv, hq // hkv, d)
    step = math.ceil(length / num_splits)
    out = torch.zeros(b, hkv, hq // hkv, d)
    lse = torch.full((b, hkv, hq // hkv), NEG_INF)
    for start in range(0, step * num_splits, step):
        kk, vv = k[:, :, start:start + step].float(), v[:, :, start:start + step].float()
        if kk.shape[2] == 0:
            continue  # an empty split: the identity of the merge
        s = torch.einsum("bgrd,bgnd->bgrn", qg, kk) * scale
        part_lse = torch.logsumexp(s, -1)
        part_out = torch.einsum("bgrn,bgnd->bgrd", torch.softmax(s, -1), vv)
        total = torch.logaddexp(lse, part_lse)
        out = out * torch.exp(lse - total)[..., None] + part_out * torch.exp(part_lse - total)[..., None]
        lse = total
    return out.reshape(b, hq, d).to(q.dtype), lse.reshape(b, hq)


def split_with_merge(q, k, v, num_splits, scale=None):
    # A loop over KV heads, torch.split over the keys, the notebook's merge_attention_states on the stacked parts.
    merge = solution().merge_attention_states
    b, hq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    if num_splits <= 0 or length == 0:
        raise ValueError(f"num_splits = {num_splits} and L = {length} must be positive")
    if hq % hkv:
        raise ValueError(f"H_q = {hq} is not a multiple of H_kv = {hkv}")
    group, size = hq // hkv, -(-length // num_splits)
    outs, lses = [], []
    for chunk in range(num_splits):
        part_out, part_lse = [], []
        for g in range(hkv):
            keys = k[:, g, chunk * size:(chunk + 1) * size].float()  # [B, n, d], float32 inside
            values = v[:, g, chunk * size:(chunk + 1) * size].float()
            scores = torch.bmm(q[:, g * group:(g + 1) * group].float(), keys.transpose(1, 2)) * (scale or d ** -0.5)
            weights = torch.softmax(scores, -1).nan_to_num(0.0)  # an empty part: no weights
            part_out.append(torch.bmm(weights, values))
            part_lse.append(torch.logsumexp(scores, -1))
        outs.append(torch.cat(part_out, 1))
        lses.append(torch.cat(part_lse, 1))
    out, lse = merge(torch.stack(outs), torch.stack(lses))
    return out.to(q.dtype), lse


@pytest.mark.parametrize("answer", [split_einsum_float32, split_with_merge])
def test_split_kv_decode_correct_styles_pass(answer):
    checks.check_split_kv_decode(answer, **CPU)


SPLIT_SOURCE = "split_kv_decode"
SPLIT_MISTAKES = {
    # query head r·H_kv + g grouped with KV head g (h % H_kv), outputs put back in head order
    "kv_head_modulo": ("grouped = q.to(compute).reshape(batch, kv_heads, heads // kv_heads, head_dim)",
                       "grouped = q.to(compute).reshape(batch, heads // kv_heads, kv_heads, head_dim).transpose(1, 2)",
                       "return out.reshape(batch, heads, head_dim).to(q.dtype), lse.reshape(batch, heads)",
                       "return out.transpose(1, 2).reshape(batch, heads, head_dim).to(q.dtype), "
                       "lse.transpose(1, 2).reshape(batch, heads)"),
    "no_scale": ("scale = head_dim ** -0.5 if scale is None else scale", "scale = 1.0 if scale is None else scale"),
    "floor_split": ("split_len = math.ceil(seq_len / num_splits)", "split_len = max(1, seq_len // num_splits)"),
    # each part's lse in base 2 (exp2 inside), merged as natural
    "base2": ("lses.append(lse)", "lses.append(lse * 1.4426950408889634)"),
}


@pytest.mark.parametrize("mistake", sorted(SPLIT_MISTAKES))
def test_split_kv_decode_mistakes_are_named(mistake):
    hint = MERGE_HINTS[mistake] if mistake == "base2" else SPLIT_HINTS[mistake]
    rejects(checks.check_split_kv_decode, planted(SPLIT_SOURCE, *SPLIT_MISTAKES[mistake]), hint)


def _parts_then(weigh):
    """split_kv_decode whose parts are combined by ``weigh(outs, lses, maxima, sizes) -> out`` (lse right)."""
    def decode(q, k, v, num_splits, scale=None):
        _, ref_lse = split_einsum_float32(q, k, v, 1, scale)
        b, hq, d = q.shape
        hkv, length = k.shape[1], k.shape[2]
        scale = scale if scale is not None else d ** -0.5
        index = torch.arange(hq) // (hq // hkv)  # each query head's KV head
        keys, values = k[:, index], v[:, index]
        size = math.ceil(length / num_splits)
        outs, lses, maxima, sizes = [], [], [], []
        for start in range(0, size * num_splits, size):
            s = torch.einsum("bhd,bhnd->bhn", q, keys[:, :, start:start + size]) * scale
            if s.shape[-1] == 0:
                continue
            outs.append(torch.einsum("bhn,bhnd->bhd", torch.softmax(s, -1), values[:, :, start:start + size]))
            lses.append(torch.logsumexp(s, -1))
            maxima.append(s.amax(-1))
            sizes.append(s.shape[-1])
        return weigh(torch.stack(outs), torch.stack(lses), torch.stack(maxima), sizes).to(q.dtype), ref_lse
    return decode


def test_split_kv_decode_parts_weighted_by_length_or_by_max_are_named():
    by_length = _parts_then(lambda outs, lses, maxima, sizes: sum(n * o for n, o in zip(sizes, outs)) / sum(sizes))
    rejects(checks.check_split_kv_decode, by_length, SPLIT_HINTS["by_length"])
    by_max = _parts_then(lambda outs, lses, maxima, sizes: (torch.softmax(maxima, 0)[..., None] * outs).sum(0))
    rejects(checks.check_split_kv_decode, by_max, SPLIT_HINTS["by_max"])


def test_split_kv_decode_must_not_copy_kv_per_query_head():
    copied = planted(SPLIT_SOURCE, "keys = k[:, :, split * split_len:(split + 1) * split_len].to(compute)",
                     "keys = k.repeat_interleave(heads // kv_heads, 1)[:, ::heads // kv_heads]"
                     "[:, :, split * split_len:(split + 1) * split_len].to(compute)")
    message = rejects(checks.check_split_kv_decode, copied, SPLIT_HINTS["per_head_copy"])
    assert "repeat_interleave" in message and "your line" in message


def test_split_kv_decode_must_split_the_scores():
    def whole_then_sliced(q, k, v, num_splits, scale=None):
        # every score at once: right numbers, no split-K
        b, hq, d = q.shape
        hkv = k.shape[1]
        if num_splits < 1 or k.shape[2] < 1 or hq % hkv:
            raise ValueError(f"num_splits = {num_splits}, L = {k.shape[2]}, H_q = {hq}, H_kv = {hkv}")
        qg = q.float().reshape(b, hkv, hq // hkv, d)
        scores = qg @ k.float().transpose(-2, -1) * (scale or d ** -0.5)  # [B, H_kv, n_rep, L]
        out = torch.softmax(scores, -1) @ v.float()
        return out.reshape(b, hq, d).to(q.dtype), torch.logsumexp(scores, -1).reshape(b, hq)
    rejects(checks.check_split_kv_decode, whole_then_sliced, SPLIT_HINTS["not_split"])


def test_split_kv_decode_lse_in_at_least_float32():
    half_lse = planted(SPLIT_SOURCE, "return out.reshape(batch, heads, head_dim).to(q.dtype), lse.reshape(batch, heads)",
                       "return out.reshape(batch, heads, head_dim).to(q.dtype), lse.reshape(batch, heads).to(q.dtype)")
    rejects(checks.check_split_kv_decode, half_lse, SPLIT_HINTS["lse_dtype"])


def test_split_kv_decode_bad_input_gets_a_clear_error():
    silent = planted(SPLIT_SOURCE, "if heads % kv_heads:", "if False:")
    message = rejects(checks.check_split_kv_decode, silent, "should raise ValueError")
    assert "H_q = 3 is not a multiple of H_kv = 2" in message


def test_split_kv_decode_names_a_failing_merge():
    broken = solution(("merge_attention_states", "lse = torch.logsumexp(lses_c, dim=0)",
                       "lse = lses_c.amax(dim=0)"))
    with pytest.raises(CheckFailure) as failure:
        checks.check_split_kv_decode(broken.split_kv_decode, **CPU)
    assert "uses your merge_attention_states, which fails its own check" in str(failure.value), str(failure.value)


# --------------------------------------------------------------------------------------
# split_kv_decode_kernel (Triton's interpreter) and its launcher
# --------------------------------------------------------------------------------------

KERNEL = "split_kv_decode_kernel"
KERNEL_MISTAKES = {
    "split_end_mask": ("inside = offs < end  # the split's end: the next keys are the next split's",
                       "inside = offs < seq_len"),
    "whole_keys": ("for block_start in range(start, end, BLOCK):", "for block_start in range(0, seq_len, BLOCK):",
                   "inside = offs < end  # the split's end: the next keys are the next split's",
                   "inside = offs < seq_len"),
    "empty_split": ("out = tl.where(has_keys, acc / l_safe, 0.0)", "out = acc / l_i"),
    "lse_base2": ("lse = tl.where(has_keys, m_i + tl.log(l_safe), float(\"-inf\"))",
                  "lse = tl.where(has_keys, m_i * 1.4426950408889634 + tl.log2(l_safe), float(\"-inf\"))"),
    "unnormalised": ("out = tl.where(has_keys, acc / l_safe, 0.0)", "out = tl.where(has_keys, acc, 0.0)"),
    "head_dim_mask": ("tile_ok = inside[:, None] & d_ok[None, :]", "tile_ok = inside[:, None]"),
}


@needs_triton
@pytest.mark.parametrize("mistake", sorted(KERNEL_MISTAKES))
def test_split_kv_decode_kernel_mistakes_are_named(mistake):
    rejects(checks.check_split_kv_decode_kernel, planted(KERNEL, *KERNEL_MISTAKES[mistake]), KERNEL_HINTS[mistake])


@needs_triton
def test_split_kv_decode_kernel_head_by_modulo_and_unmasked_loads_are_named():
    modulo = planted(KERNEL, "kv_head = h // (num_heads // num_kv_heads)", "kv_head = h % num_kv_heads")
    rejects(checks.check_split_kv_decode_kernel, modulo, SPLIT_HINTS["kv_head_modulo"])
    unmasked = planted(KERNEL, "k = tl.load(k_head + offs[:, None] * stride_ks + offs_d[None, :], mask=tile_ok, "
                               "other=0.0)", "k = tl.load(k_head + offs[:, None] * stride_ks + offs_d[None, :])")
    message = rejects(checks.check_split_kv_decode_kernel, unmasked, EFFICIENT_HINTS["unmasked_load"])
    assert "rows of K at or past seq_len" in message


@needs_triton
def test_split_kv_decode_kernel_of_the_solution_passes_and_its_launcher_merges_with_the_given_merge():
    answers = solution()
    checks.check_split_kv_decode_kernel(answers.split_kv_decode_kernel, **CPU)
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 21, 16), torch.randn(2, 2, 21, 16)
    out_parts, lse_parts = launch_split_kv_decode(answers.split_kv_decode_kernel, q, k, v, 5, block=4)
    assert out_parts.shape == (2, 4, 5, 16) and lse_parts.shape == (2, 4, 5)
    out, lse = launch_split_kv_decode(answers.split_kv_decode_kernel, q, k, v, 5, block=4,
                                      merge=answers.merge_attention_states)
    expected = F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert lse.shape == (2, 4)


@needs_triton
@pytest.mark.parametrize("args, words", [
    (((2, 3, 16), (2, 2, 9, 16), 2, 16), "H_q = 3 must be a multiple of H_kv = 2"),
    (((2, 4, 16), (2, 2, 9, 16), 0, 16), "num_splits = 0"),
    (((2, 4, 16), (2, 2, 9, 16), 2, 12), "block = 12: must be a power of two"),
])
def test_the_decode_launcher_refuses_bad_input_clearly(args, words):
    q_shape, k_shape, splits, block = args
    q, k = torch.randn(q_shape), torch.randn(k_shape)
    with pytest.raises(ValueError, match=re.escape(words)):
        launch_split_kv_decode(solution().split_kv_decode_kernel, q, k, k, splits, block=block)


# --------------------------------------------------------------------------------------
# slot_mapping
# --------------------------------------------------------------------------------------


def slots_by_comprehension(block_table, start, end, block_size):
    # vLLM's loop, one position at a time
    table = [int(b) for b in block_table]
    if start > end or end > len(table) * block_size:
        raise ValueError(f"positions {start} ... {end - 1} do not fit {len(table)} blocks of {block_size}")
    device = block_table.device if isinstance(block_table, torch.Tensor) else None
    return torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(start, end)],
                        dtype=torch.long, device=device)


def slots_by_repeat(block_table, start, end, block_size):
    # every slot of every block, then the range: a view of the table as blocks of consecutive slots
    table = torch.as_tensor(block_table)
    if not 0 <= start <= end <= table.numel() * block_size:
        raise ValueError(f"start={start}, end={end} and {table.numel()} blocks of {block_size} do not fit")
    every = (table[:, None] * block_size + torch.arange(block_size, device=table.device)).flatten()
    return every[start:end].long()


@pytest.mark.parametrize("answer", [slots_by_comprehension, slots_by_repeat])
def test_slot_mapping_correct_styles_pass(answer):
    checks.check_slot_mapping(answer, **CPU)


@pytest.mark.parametrize("mistake, old, new", [
    ("slot_no_table", "return table[positions // block_size] * block_size + positions % block_size",
     "return positions"),
    ("slot_no_block_size", "return table[positions // block_size] * block_size + positions % block_size",
     "return table[positions // block_size] + positions % block_size"),
    ("slot_from_zero", "positions = torch.arange(start, end, device=table.device)",
     "positions = torch.arange(end - start, device=table.device)"),
    ("slot_off_by_one", "positions = torch.arange(start, end, device=table.device)",
     "positions = torch.arange(start + 1, end + 1, device=table.device)"),
])
def test_slot_mapping_mistakes_are_named(mistake, old, new):
    rejects(checks.check_slot_mapping, planted("slot_mapping", old, new), PAGED_HINTS[mistake])


def test_slot_mapping_with_no_check_of_the_table_fails():
    rejects(checks.check_slot_mapping, planted("slot_mapping", "if end > table.numel() * block_size:", "if False:"),
            "should raise ValueError")


# --------------------------------------------------------------------------------------
# PagedKVCache: another correct style (owner sets), and mistakes planted in the solution
# --------------------------------------------------------------------------------------


class OwnerSetCache:
    """A correct cache written otherwise: each block's owners as a set, a deque of free blocks taken from the
    front, tokens written slot by slot."""

    def __init__(self, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32, device=None):
        from collections import deque

        self.block_size, self.heads, self.dim = block_size, num_kv_heads, head_dim
        self.k_pool = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v_pool = torch.zeros_like(self.k_pool)
        self.free_list = deque(range(num_blocks))
        self.owners = {block: set() for block in range(num_blocks)}
        self.sequences, self.counter = {}, 0

    @property
    def num_free_blocks(self):
        return len(self.free_list)

    def new_sequence(self):
        self.counter += 1
        self.sequences[self.counter] = {"blocks": [], "length": 0}
        return self.counter

    def block_table(self, seq):
        return list(self.sequences[seq]["blocks"])

    def seq_len(self, seq):
        return self.sequences[seq]["length"]

    def append(self, seq, k, v):
        state = self.sequences[seq]
        if k.ndim != 3 or k.shape[0] != self.heads or k.shape[2] != self.dim or v.shape != k.shape:
            raise ValueError(f"expected [{self.heads}, n, {self.dim}], got {tuple(k.shape)}, {tuple(v.shape)}")
        blocks, length, n = state["blocks"], state["length"], k.shape[1]
        fresh = math.ceil((length + n) / self.block_size) - len(blocks)
        copy = n > 0 and length % self.block_size and len(self.owners[blocks[-1]]) > 1
        if fresh + copy > len(self.free_list):
            raise MemoryError(f"need {fresh + copy} blocks but only {len(self.free_list)} are free")
        if copy:
            new = self.free_list.popleft()
            self.k_pool[new].copy_(self.k_pool[blocks[-1]])
            self.v_pool[new].copy_(self.v_pool[blocks[-1]])
            self.owners[blocks[-1]].discard(seq)
            self.owners[new] = {seq}
            blocks[-1] = new
        for _ in range(fresh):
            new = self.free_list.popleft()
            self.owners[new] = {seq}
            blocks.append(new)
        for index in range(n):
            position = length + index
            block, offset = blocks[position // self.block_size], position % self.block_size
            self.k_pool[block, offset] = k[:, index].to(self.k_pool.dtype)
            self.v_pool[block, offset] = v[:, index].to(self.v_pool.dtype)
        state["length"] = length + n

    def fork(self, seq):
        child = self.new_sequence()
        self.sequences[child] = {"blocks": list(self.sequences[seq]["blocks"]), "length": self.sequences[seq]["length"]}
        for block in self.sequences[seq]["blocks"]:
            self.owners[block].add(child)
        return child

    def free(self, seq):
        for block in self.sequences.pop(seq)["blocks"]:
            self.owners[block].discard(seq)
            if not self.owners[block]:
                self.free_list.append(block)


@pytest.mark.parametrize("check", ["check_paged_kv_cache", "check_paged_kv_cache_fork"])
def test_paged_kv_cache_owner_sets_pass(check):
    getattr(checks, check)(OwnerSetCache, **CPU)


CACHE = "PagedKVCache"
CACHE_MISTAKES = {
    "block_early": ("new_blocks = -(-new_length // self.block_size) - len(table)",
                    "new_blocks = new_length // self.block_size + 1 - len(table)"),
    "block_per_append": ("new_blocks = -(-new_length // self.block_size) - len(table)", "new_blocks = 1"),
    "contents": ("flat_k[slots] = k.transpose(0, 1).to(self.k_pool.dtype)",
                 "flat_k[slots] = k.reshape(-1, self.num_kv_heads, self.head_dim).to(self.k_pool.dtype)"),
    "append_dtype": ("flat_k = self.k_pool.view(-1, self.num_kv_heads, self.head_dim)  # a view of the pool",
                     "self.k_pool = self.k_pool.to(k.dtype)\n"
                     "        flat_k = self.k_pool.view(-1, self.num_kv_heads, self.head_dim)"),
    "id_reused": ("seq, self.next_id = self.next_id, self.next_id + 1", "seq = len(self.tables)"),
    "memory_error_partial": ("        if needed > len(self.free_blocks):\n",
                             "        if needed > len(self.free_blocks):\n"
                             "            table.append(self.free_blocks.pop())  # taken before the check\n"),
}


@pytest.mark.parametrize("mistake", sorted(CACHE_MISTAKES))
def test_paged_kv_cache_mistakes_are_named(mistake):
    rejects(checks.check_paged_kv_cache, planted(CACHE, *CACHE_MISTAKES[mistake]), PAGED_HINTS[mistake])


def test_paged_kv_cache_taking_a_block_late_is_named():
    # ceil((n - 1) / block_size) blocks: the token at position 4 lands in block 0, overwriting position 0
    late_slots = solution((CACHE, "new_blocks = -(-new_length // self.block_size) - len(table)",
                           "new_blocks = max(0, -(-(new_length - 1) // self.block_size) - len(table))"),
                          ("slot_mapping", "table[positions // block_size]",
                           "table[torch.clamp(positions // block_size, max=table.numel() - 1)]"),
                          ("slot_mapping", "if end > table.numel() * block_size:", "if False:"))
    rejects(checks.check_paged_kv_cache, late_slots.PagedKVCache, PAGED_HINTS["block_late"])


def test_paged_kv_cache_unknown_ids_and_bad_shapes():
    forgiving = planted(CACHE, "return list(self.tables[seq])", "return list(self.tables.get(seq, []))")
    message = rejects(checks.check_paged_kv_cache, forgiving, "should raise KeyError")
    assert "block_table" in message
    lax = planted(CACHE, "if k.dim() != 3 or tuple(k.shape) != expected or tuple(v.shape) != expected:",
                  "if k.dim() != 3:")
    rejects(checks.check_paged_kv_cache, lax, "should raise ValueError")


CACHE_FORK_MISTAKES = {
    "fork_no_cow": ("copy_last = k.shape[1] > 0 and length % self.block_size != 0 and self.owners[table[-1]] > 1",
                    "copy_last = False"),
    "fork_copies": ("        for block in table:\n            self.owners[block] += 1\n",
                    "        copies = []\n"
                    "        for block in table:\n"
                    "            new = self.free_blocks.pop()\n"
                    "            self.k_pool[new], self.v_pool[new] = self.k_pool[block], self.v_pool[block]\n"
                    "            self.owners[new] = 1\n"
                    "            copies.append(new)\n"
                    "        self.tables[child] = copies\n"),
    # a block stays "shared" once forked: its count is never lowered by a copy
    "cow_unneeded": ("            self.owners[shared] -= 1\n", ""),
    "cow_full_block": ("copy_last = k.shape[1] > 0 and length % self.block_size != 0 and self.owners[table[-1]] > 1",
                       "copy_last = k.shape[1] > 0 and length > 0 and self.owners[table[-1]] > 1"),
    "free_shared": ("            self.owners[block] -= 1\n            if self.owners[block] == 0:\n",
                    "            self.owners[block] = 0\n            if True:\n"),
    "cow_memory": ("        needed = new_blocks + copy_last\n", "        needed = new_blocks\n"),
}


@pytest.mark.parametrize("mistake", sorted(CACHE_FORK_MISTAKES))
def test_paged_kv_cache_fork_mistakes_are_named(mistake):
    rejects(checks.check_paged_kv_cache_fork, planted(CACHE, *CACHE_FORK_MISTAKES[mistake]), PAGED_HINTS[mistake])


# --------------------------------------------------------------------------------------
# paged_decode_attention
# --------------------------------------------------------------------------------------


def paged_vllm_like(q, k_pool, v_pool, block_tables, seq_lens, scale=None):
    # vLLM's reference: walk each sequence's table block by block, copying out the used slots; float32 inside.
    b, hq, d = q.shape
    block_size, hkv = k_pool.shape[1], k_pool.shape[2]
    scale = scale or 1.0 / math.sqrt(d)
    out = torch.empty(b, hq, d, dtype=torch.float32, device=q.device)
    for i in range(b):
        length, keys, values = int(seq_lens[i]), [], []
        for index in range(math.ceil(length / block_size)):
            block = int(block_tables[i, index])
            if block < 0:
                raise ValueError(f"sequence {i}: {length} tokens, but its table ends at block {index}")
            used = min(block_size, length - index * block_size)
            keys.append(k_pool[block, :used].float())
            values.append(v_pool[block, :used].float())
        keys, values = torch.cat(keys), torch.cat(values)  # [len, H_kv, d]
        for h in range(hq):
            g = h // (hq // hkv)
            weights = torch.softmax(keys[:, g] @ q[i, h].float() * scale, dim=0)
            out[i, h] = weights @ values[:, g]
    return out.to(q.dtype)


def paged_flat_gather(q, k_pool, v_pool, block_tables, seq_lens, scale=None):
    # FlashInfer-like: one index of every sequence's slots, SDPA with enable_gqa on each gathered sequence.
    block_size, hkv, d = k_pool.shape[1:]
    flat_k, flat_v = k_pool.flatten(0, 1), v_pool.flatten(0, 1)
    outs = []
    for i, length in enumerate(seq_lens.tolist()):
        blocks = block_tables[i, :math.ceil(length / block_size)]
        if (blocks < 0).any() or len(blocks) * block_size < length:
            raise ValueError(f"the block table of sequence {i} is too short for {length} tokens")
        slots = (blocks[:, None] * block_size + torch.arange(block_size, device=q.device)).flatten()[:length]
        keys = flat_k[slots].transpose(0, 1)  # [H_kv, len, d]
        values = flat_v[slots].transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(q[i][:, None], keys, values, enable_gqa=True, scale=scale)[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("answer", [paged_vllm_like, paged_flat_gather])
def test_paged_decode_attention_correct_styles_pass(answer):
    checks.check_paged_decode_attention(answer, **CPU)


PAGED = "paged_decode_attention"
PAGED_MISTAKES = {
    "slot_past_end": ("slots = slot_mapping(blocks, 0, length, block_size).to(q.device)",
                      "slots = slot_mapping(block_tables[b, :-(-(length + 1) // block_size)], 0, "
                      "min(length + 1, int((block_tables[b] >= 0).sum()) * block_size), block_size).to(q.device)"),
    "whole_blocks": ("slots = slot_mapping(blocks, 0, length, block_size).to(q.device)",
                     "slots = slot_mapping(blocks, 0, blocks.numel() * block_size, block_size).to(q.device)"),
    "padding_block": ("slots = slot_mapping(blocks, 0, length, block_size).to(q.device)",
                      "slots = slot_mapping(block_tables[b] % k_pool.shape[0], 0, "
                      "block_tables.shape[1] * block_size, block_size).to(q.device)"),
    "missing_last_token": ("slots = slot_mapping(blocks, 0, length, block_size).to(q.device)",
                           "slots = slot_mapping(blocks, 0, max(1, length - 1), block_size).to(q.device)"),
    "no_scale": ("scale = head_dim ** -0.5 if scale is None else scale", "scale = 1.0 if scale is None else scale"),
}


@pytest.mark.parametrize("mistake", sorted(PAGED_MISTAKES))
def test_paged_decode_attention_mistakes_are_named(mistake):
    rejects(checks.check_paged_decode_attention, planted(PAGED, *PAGED_MISTAKES[mistake]), PAGED_HINTS.get(mistake)
            or SPLIT_HINTS[mistake])


def test_paged_decode_attention_masking_after_reading_is_named():
    # every slot of the blocks read, the slots past the length masked with -inf: right until they hold NaN
    masked = planted(PAGED, "        scores = torch.einsum(\"grd,tgd->grt\", grouped, keys) * scale  # [H_kv, n_rep, len]\n",
                     "        slots = slot_mapping(blocks, 0, blocks.numel() * block_size, block_size).to(q.device)\n"
                     "        keys, values = flat_k[slots].to(compute), flat_v[slots].to(compute)\n"
                     "        scores = torch.einsum(\"grd,tgd->grt\", grouped, keys) * scale\n"
                     "        scores[..., length:] = float(\"-inf\")\n")
    rejects(checks.check_paged_decode_attention, masked, PAGED_HINTS["read_nan"])


def test_paged_decode_attention_copying_the_pool_and_the_kv_head_are_named():
    copied = planted(PAGED, "flat_k = k_pool.view(-1, kv_heads, head_dim)  # [num_blocks · block_size, H_kv, d]: a view",
                     "flat_k = k_pool.clone().view(-1, kv_heads, head_dim)")
    rejects(checks.check_paged_decode_attention, copied, PAGED_HINTS["pool_copy"])
    modulo = planted(PAGED, "grouped = q[b].to(compute).reshape(kv_heads, heads // kv_heads, head_dim)",
                     "grouped = q[b].to(compute).reshape(heads // kv_heads, kv_heads, head_dim).transpose(0, 1)",
                     'torch.einsum("grt,tgd->grd", weights, values).reshape(heads, head_dim)',
                     'torch.einsum("grt,tgd->grd", weights, values).transpose(0, 1).reshape(heads, head_dim)')
    rejects(checks.check_paged_decode_attention, modulo, SPLIT_HINTS["kv_head_modulo"])


def test_paged_decode_attention_short_table_must_raise():
    silent = planted(PAGED, "if blocks.numel() * block_size < length or bool((blocks < 0).any()):", "if False:")
    rejects(checks.check_paged_decode_attention, silent, "should raise ValueError")


# --------------------------------------------------------------------------------------
# sliding_window_mask, attention_with_sinks
# --------------------------------------------------------------------------------------


def window_by_triangles(q_len, kv_len, window):
    # tril/triu of a ones matrix, aligned bottom-right
    if window < 1:
        raise ValueError(f"window = {window} must be at least 1")
    ones = torch.ones(q_len, kv_len, dtype=torch.bool)
    return ones.tril(kv_len - q_len) & ones.triu(kv_len - q_len - window + 1)


def window_by_loops(q_len, kv_len, window):
    if window <= 0:
        raise ValueError(f"bad window {window}")
    keep = torch.zeros(q_len, kv_len, dtype=torch.bool)
    for i in range(q_len):
        p = i + kv_len - q_len
        for j in range(max(0, p - window + 1), min(p + 1, kv_len)):
            keep[i, j] = True
    return keep


@pytest.mark.parametrize("answer", [window_by_triangles, window_by_loops])
def test_sliding_window_mask_correct_styles_pass(answer):
    checks.check_sliding_window_mask(answer, **CPU)


@pytest.mark.parametrize("mistake, old, new", [
    ("window_plus_one", "(keys > positions - window)", "(keys >= positions - window)"),
    ("window_minus_one", "(keys > positions - window)", "(keys > positions - window + 1)"),
    ("window_top_left", "positions = torch.arange(q_len)[:, None] + (kv_len - q_len)",
     "positions = torch.arange(q_len)[:, None]"),
    ("window_symmetric", "return (keys <= positions) & (keys > positions - window)",
     "return (keys - positions).abs() < window"),
])
def test_sliding_window_mask_mistakes_are_named(mistake, old, new):
    rejects(checks.check_sliding_window_mask, planted("sliding_window_mask", old, new), WINDOW_HINTS[mistake])


def sinks_by_lse(q, k, v, sinks, window=None, scale=None):
    # plain attention's out and lse, then the sink's correction e^lse / (e^lse + e^sink) (FlashAttention-style)
    sq, sk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scores = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) * (scale or d ** -0.5)
    p = torch.arange(sq, device=q.device)[:, None] + sk - sq
    j = torch.arange(sk, device=q.device)[None]
    keep = (j <= p) & ((j > p - window) if window else True)
    scores = scores.masked_fill(~keep, -1e30)  # a finite fill: no NaN
    lse = torch.logsumexp(scores, -1, keepdim=True)
    out = torch.softmax(scores, -1) @ v.float()
    sink = sinks.float().view(1, -1, 1, 1)
    share = torch.sigmoid(lse - sink)  # e^lse / (e^lse + e^sink)
    out = out * share * keep.any(-1, keepdim=True)  # a query that sees no key: 0
    return out.to(q.dtype)


@pytest.mark.parametrize("answer", [sinks_by_lse, "solution"])
def test_attention_with_sinks_correct_styles_pass(answer):
    checks.check_attention_with_sinks(solution().attention_with_sinks if answer == "solution" else answer, **CPU)


SINKS = "attention_with_sinks"
SINK_MISTAKES = {
    "sink_ignored": ("weights = exps[..., :-1] / torch.where(total > 0, total, 1.0)",
                     "weights = exps[..., :-1] / exps[..., :-1].sum(-1, keepdim=True).clamp_min(1e-300)"),
    "sink_twice": ("logits = torch.cat([scores, sink], dim=-1)",  # two copies of e^sink: e^(sink + log 2)
                   "logits = torch.cat([scores, sink + math.log(2.0)], dim=-1)"),
    "sink_scaled": ("logits = torch.cat([scores, sink], dim=-1)", "logits = torch.cat([scores, sink * scale], dim=-1)"),
    "sinks_not_causal": ("allowed = sliding_window_mask(seq_q, seq_k, window if window is not None else seq_k + seq_q)",
                         "allowed = torch.ones(seq_q, seq_k, dtype=torch.bool)"),
    "no_key_nan": ("weights = exps[..., :-1] / torch.where(total > 0, total, 1.0)",
                   "weights = exps[..., :-1] / total"),
}


@pytest.mark.parametrize("mistake", sorted(SINK_MISTAKES))
def test_attention_with_sinks_mistakes_are_named(mistake):
    rejects(checks.check_attention_with_sinks, planted(SINKS, *SINK_MISTAKES[mistake]), WINDOW_HINTS[mistake])


def test_a_sink_in_the_numerator_is_named():
    def numerator(q, k, v, sinks, window=None, scale=None):
        sq, sk = q.shape[-2], k.shape[-2]
        scores = q @ k.transpose(-2, -1) * (scale or q.shape[-1] ** -0.5)
        keep = window_by_triangles(sq, sk, window or sk + sq)
        scores = scores.masked_fill(~keep, NEG_INF)
        lse = torch.logsumexp(scores, -1, keepdim=True)
        sink = sinks.view(1, -1, 1, 1)
        out = torch.softmax(scores, -1).nan_to_num(0.0) @ v
        return out * torch.exp(sink - torch.logaddexp(lse, sink.expand_as(lse)))  # the sink's share
    rejects(checks.check_attention_with_sinks, numerator, WINDOW_HINTS["sink_numerator"])


# --------------------------------------------------------------------------------------
# StreamingLLM
# --------------------------------------------------------------------------------------


def kept_by_set(seq_len, n_sink, n_recent):
    if min(seq_len, n_sink, n_recent) < 0:
        raise ValueError("negative sizes")
    return torch.tensor(sorted(set(range(min(n_sink, seq_len))) | set(range(max(0, seq_len - n_recent), seq_len))),
                        dtype=torch.long)


def test_streaming_kept_positions_correct_style_passes():
    checks.check_streaming_kept_positions(kept_by_set, **CPU)


def test_streaming_kept_positions_mistakes_are_named():
    duplicates = planted("streaming_kept_positions", "if seq_len <= n_sink + n_recent:", "if seq_len <= 0:")
    rejects(checks.check_streaming_kept_positions, duplicates, WINDOW_HINTS["kept_duplicates"])
    one_more = planted("streaming_kept_positions", "torch.arange(seq_len - n_recent, seq_len)",
                       "torch.arange(seq_len - n_recent - 1, seq_len)")
    rejects(checks.check_streaming_kept_positions, one_more, WINDOW_HINTS["kept_recent_off"])
    rejects(checks.check_streaming_kept_positions,
            planted("streaming_kept_positions", "if min(seq_len, n_sink, n_recent) < 0:", "if False:"),
            "should raise ValueError")


def streaming_rotate_half_permuted(q_raw, k_raw, v, n_sink, n_recent, rope_base=10000.0):
    # Hugging Face's rotate_half on features permuted to [0, 2, 4, ..., 1, 3, 5, ...] (notebook 05): the same rotation
    total, d = k_raw.shape[2], k_raw.shape[-1]
    kept = kept_by_set(total, n_sink, n_recent)
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    angles = torch.arange(len(kept), dtype=torch.float64)[:, None] * rope_base ** (-torch.arange(0, d, 2) / d)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rotate(x, rows):  # x [..., T, d] in the permuted order
        half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
        return (x * cos[rows].to(x.dtype) + half * sin[rows].to(x.dtype))

    keys = rotate(k_raw[:, :, kept][..., perm], slice(None))
    query = rotate(q_raw[..., perm][:, :, None], slice(len(kept) - 1, len(kept)))
    weights = torch.softmax(query @ keys.transpose(-2, -1) / math.sqrt(d), -1)
    return (weights @ v[:, :, kept])[:, :, 0]


def test_streaming_decode_correct_styles_pass():
    checks.check_streaming_decode(solution().streaming_decode, **CPU)
    checks.check_streaming_decode(streaming_rotate_half_permuted, **CPU)


STREAM = "streaming_decode"
STREAM_MISTAKES = {
    "keys_after_rope": ("keys = apply_rope_at(k_raw[:, :, kept], cache_positions, rope_base)",
                        "keys = apply_rope_at(k_raw[:, :, kept], kept, rope_base)"),
    "query_original_position": ("query = apply_rope_at(q_raw[:, :, None], cache_positions[-1:], rope_base)",
                                "query = apply_rope_at(q_raw[:, :, None], kept[-1:], rope_base)"),
    "query_at_len": ("query = apply_rope_at(q_raw[:, :, None], cache_positions[-1:], rope_base)",
                     "query = apply_rope_at(q_raw[:, :, None], cache_positions[-1:] + 1, rope_base)"),
    "original_positions": ("keys = apply_rope_at(k_raw[:, :, kept], cache_positions, rope_base)",
                           "keys = apply_rope_at(k_raw[:, :, kept], kept, rope_base)",
                           "query = apply_rope_at(q_raw[:, :, None], cache_positions[-1:], rope_base)",
                           "query = apply_rope_at(q_raw[:, :, None], kept[-1:], rope_base)"),
    "no_eviction": ("kept = streaming_kept_positions(k_raw.shape[2], n_sink, n_recent).to(k_raw.device)",
                    "kept = torch.arange(k_raw.shape[2], device=k_raw.device)"),
    "no_rope": ("out = F.scaled_dot_product_attention(query, keys, v[:, :, kept])",
                "out = F.scaled_dot_product_attention(q_raw[:, :, None], k_raw[:, :, kept], v[:, :, kept])"),
}


@pytest.mark.parametrize("mistake", sorted(STREAM_MISTAKES))
def test_streaming_decode_mistakes_are_named(mistake):
    rejects(checks.check_streaming_decode, planted(STREAM, *STREAM_MISTAKES[mistake]), WINDOW_HINTS[mistake])


def test_streaming_decode_in_the_rotate_half_layout_is_named():
    def half_layout(q_raw, k_raw, v, n_sink, n_recent, rope_base=10000.0):
        total, d = k_raw.shape[2], k_raw.shape[-1]
        kept = kept_by_set(total, n_sink, n_recent)
        angles = torch.arange(len(kept), dtype=torch.float64)[:, None] * rope_base ** (-torch.arange(0, d, 2) / d)
        cos, sin = torch.cat([angles.cos()] * 2, -1).to(q_raw.dtype), torch.cat([angles.sin()] * 2, -1).to(q_raw.dtype)
        rot = lambda x: torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)  # noqa: E731
        keys = k_raw[:, :, kept] * cos + rot(k_raw[:, :, kept]) * sin
        query = q_raw[:, :, None] * cos[-1:] + rot(q_raw[:, :, None]) * sin[-1:]
        return F.scaled_dot_product_attention(query, keys, v[:, :, kept])[:, :, 0]
    rejects(checks.check_streaming_decode, half_layout, WINDOW_HINTS["rotate_half"])


# --------------------------------------------------------------------------------------
# Latent attention
# --------------------------------------------------------------------------------------


def mla_entry_float32(x, w, positions):
    # float32 inside, F.rms_norm, RoPE by cos/sin of the pairs
    compressed = (x.float() @ w.w_dkv.float().T)
    latent = F.rms_norm(compressed[..., :w.kv_lora_rank], (w.kv_lora_rank,), w.kv_norm_weight.float(), w.norm_eps)
    k_pe = compressed[..., w.kv_lora_rank:]
    theta = w.rope_base ** (-torch.arange(0, w.qk_rope_dim, 2, device=x.device) / w.qk_rope_dim)
    angles = positions.to(x.device).float()[:, None] * theta
    even, odd = k_pe[..., 0::2], k_pe[..., 1::2]
    rotated = torch.stack([even * angles.cos() - odd * angles.sin(), even * angles.sin() + odd * angles.cos()], -1)
    return latent.to(x.dtype), rotated.flatten(-2).to(x.dtype)


def test_mla_cache_entry_correct_styles_pass():
    checks.check_mla_cache_entry(solution().mla_cache_entry, **CPU)
    checks.check_mla_cache_entry(mla_entry_float32, **CPU)


ENTRY = "mla_cache_entry"
ENTRY_MISTAKES = {
    "latent_no_norm": ("latent = latent * rms * w.kv_norm_weight", "latent = latent"),
    "latent_norm_no_weight": ("latent = latent * rms * w.kv_norm_weight", "latent = latent * rms"),
    "split_order": ("latent, k_pe = compressed.split([w.kv_lora_rank, w.qk_rope_dim], dim=-1)",
                    "k_pe, latent = compressed.split([w.qk_rope_dim, w.kv_lora_rank], dim=-1)"),
    "kpe_no_rope": ("return latent, apply_rope_at(k_pe, positions, w.rope_base)", "return latent, k_pe"),
    "kpe_index_positions": ("return latent, apply_rope_at(k_pe, positions, w.rope_base)",
                            "return latent, apply_rope_at(k_pe, torch.arange(x.shape[1]), w.rope_base)"),
    "kpe_per_head": ("return latent, apply_rope_at(k_pe, positions, w.rope_base)",
                     "return latent, apply_rope_at(k_pe, positions, w.rope_base)[:, :, None]"
                     ".expand(-1, -1, w.n_heads, -1)"),
    "cache_split": ("return latent, apply_rope_at(k_pe, positions, w.rope_base)",
                    "return compressed, apply_rope_at(k_pe, positions, w.rope_base)"),
}


@pytest.mark.parametrize("mistake", sorted(ENTRY_MISTAKES))
def test_mla_cache_entry_mistakes_are_named(mistake):
    rejects(checks.check_mla_cache_entry, planted(ENTRY, *ENTRY_MISTAKES[mistake]), MLA_HINTS[mistake])


def test_mla_cache_entry_in_the_rotate_half_layout_is_named():
    def half(x, w, positions):
        latent, _ = mla_entry_float32(x.double(), w, positions)
        k_pe = (x.double() @ w.w_dkv.double().T)[..., w.kv_lora_rank:]
        d = w.qk_rope_dim
        angles = positions.double()[:, None] * w.rope_base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        rotated = k_pe * cos + torch.cat([-k_pe[..., d // 2:], k_pe[..., :d // 2]], -1) * sin
        return latent.to(x.dtype), rotated.to(x.dtype)
    rejects(checks.check_mla_cache_entry, half, WINDOW_HINTS["rotate_half"])


def mla_naive_heads_loop(x, w, latent, k_pe, positions):
    # one head at a time, the up-projection as nn.functional.linear; a float mask (-inf added)
    b, tq, _ = x.shape
    tk = latent.shape[1]
    nope, rope, vd = w.qk_nope_dim, w.qk_rope_dim, w.v_dim
    q = F.linear(x, w.w_q).view(b, tq, w.n_heads, nope + rope)
    blocks = w.w_ukv.view(w.n_heads, nope + vd, -1)
    bias = torch.zeros(tq, tk, dtype=x.dtype, device=x.device).masked_fill(
        torch.ones(tq, tk, dtype=torch.bool, device=x.device).triu(tk - tq + 1), NEG_INF)
    heads = []
    for h in range(w.n_heads):
        q_pe = solution().apply_rope_at(q[:, :, h, nope:], positions, w.rope_base)
        query = torch.cat([q[:, :, h, :nope], q_pe], -1)  # [B, T_q, nope + rope]
        key = torch.cat([F.linear(latent, blocks[h, :nope]), k_pe], -1)  # [B, T_k, nope + rope]
        value = F.linear(latent, blocks[h, nope:])
        weights = torch.softmax(query @ key.transpose(1, 2) / math.sqrt(nope + rope) + bias, -1)
        heads.append(weights @ value)
    return F.linear(torch.cat(heads, -1), w.w_o)


def test_mla_attention_naive_correct_styles_pass():
    checks.check_mla_attention_naive(solution().mla_attention_naive, **CPU)
    checks.check_mla_attention_naive(mla_naive_heads_loop, **CPU)


NAIVE = "mla_attention_naive"
MLA_MISTAKES = {
    "scale_rank": ("scores = queries @ keys.transpose(-2, -1) / math.sqrt(nope + rope)",
                   "scores = queries @ keys.transpose(-2, -1) / math.sqrt(w.kv_lora_rank)"),
    "scale_nope": ("scores = queries @ keys.transpose(-2, -1) / math.sqrt(nope + rope)",
                   "scores = queries @ keys.transpose(-2, -1) / math.sqrt(nope)"),
    "uv_first": ("w_uk, w_uv = w.w_ukv.view(heads, nope + v_dim, -1).split([nope, v_dim], dim=1)",
                 "w_uv, w_uk = w.w_ukv.view(heads, nope + v_dim, -1).split([v_dim, nope], dim=1)"),
    "split_not_per_head": ("w_uk, w_uv = w.w_ukv.view(heads, nope + v_dim, -1).split([nope, v_dim], dim=1)",
                           "w_uk, w_uv = (part.reshape(heads, -1, w.kv_lora_rank) for part in "
                           "w.w_ukv.split([heads * nope, heads * v_dim], dim=0))"),
    "q_no_rope": ("q_pe = apply_rope_at(q_pe, positions, w.rope_base)", "q_pe = q_pe"),
    "causal_top_left": ("causal = torch.ones(seq_q, seq_k, dtype=torch.bool, device=x.device).tril(seq_k - seq_q)",
                        "causal = torch.ones(seq_q, seq_k, dtype=torch.bool, device=x.device).tril()"),
    "not_causal": ("weights = torch.softmax(scores.masked_fill(~causal, float(\"-inf\")), dim=-1)",
                   "weights = torch.softmax(scores, dim=-1)"),
}


@pytest.mark.parametrize("mistake", sorted(MLA_MISTAKES))
def test_mla_attention_naive_mistakes_are_named(mistake):
    rejects(checks.check_mla_attention_naive, planted(NAIVE, *MLA_MISTAKES[mistake]), MLA_HINTS[mistake])


def test_mla_attention_naive_without_the_output_projection_is_named():
    rejects(checks.check_mla_attention_naive, planted(NAIVE, "return heads_out @ w.w_o.T", "return heads_out"),
            "apply the output projection")


def mla_absorbed_by_matrices(x, w, latent, k_pe, positions):
    # W_UK folded into the query with matmuls over the head axis; W_UV applied per head after the sum (float64)
    b, tq, _ = x.shape
    nope, rope, vd, rank = w.qk_nope_dim, w.qk_rope_dim, w.v_dim, w.kv_lora_rank
    q = (x @ w.w_q.T).unflatten(-1, (w.n_heads, nope + rope)).transpose(1, 2)
    q_pe = solution().apply_rope_at(q[..., nope:], positions, w.rope_base)
    per_head = w.w_ukv.unflatten(0, (w.n_heads, nope + vd))
    absorbed = q[..., :nope] @ per_head[:, :nope]  # [B, H, T_q, rank]
    scores = (absorbed @ latent[:, None].transpose(-2, -1) + q_pe @ k_pe[:, None].transpose(-2, -1))
    scores = scores / math.sqrt(nope + rope)
    tk = latent.shape[1]
    keep = torch.arange(tk, device=x.device)[None] <= torch.arange(tq, device=x.device)[:, None] + tk - tq
    weights = torch.softmax(scores.masked_fill(~keep, NEG_INF), -1)
    summed = weights @ latent[:, None]  # [B, H, T_q, rank]
    heads = summed @ per_head[:, nope:].transpose(-2, -1)  # [B, H, T_q, v]
    return heads.transpose(1, 2).flatten(2) @ w.w_o.T


def test_mla_attention_absorbed_correct_styles_pass():
    for answer in (solution().mla_attention_absorbed, mla_absorbed_by_matrices):
        checks.check_mla_attention_absorbed(answer, **CPU)
        checks.check_mla_attention_absorbed_memory(answer, **CPU)


def test_mla_attention_absorbed_must_keep_float64():
    float32_inside = planted("mla_attention_absorbed", "return heads_out.reshape(batch, seq_q, heads * v_dim) @ w.w_o.T",
                             "return (heads_out.reshape(batch, seq_q, heads * v_dim).float() @ w.w_o.T.float())"
                             ".to(x.dtype)")
    rejects(checks.check_mla_attention_absorbed, float32_inside, FRAMEWORK_HINTS["downcast"])


def test_mla_attention_absorbed_that_rebuilds_the_heads_is_named():
    rejects(checks.check_mla_attention_absorbed_memory, solution().mla_attention_naive, MLA_HINTS["per_head_kv"])
    # and one that forms the values per head (keys absorbed)
    values_per_head = planted("mla_attention_absorbed", "latent_out = torch.einsum(\"bhqt,btr->bhqr\", weights, latent)",
                              "values = torch.einsum(\"btr,hvr->bhtv\", latent, w_uv)\n"
                              "    latent_out = torch.einsum(\"bhqt,btr->bhqr\", weights, latent)")
    message = rejects(checks.check_mla_attention_absorbed_memory, values_per_head, MLA_HINTS["per_head_kv"])
    assert "[2, 4, 11, 10]" in message


@pytest.mark.parametrize("mistake, answer", [
    ("bytes_twice", lambda num_layers, kv_lora_rank, qk_rope_dim, seq_len, batch_size, bytes_per_element:
        math.ceil(2 * num_layers * (kv_lora_rank + qk_rope_dim) * seq_len * batch_size * bytes_per_element)),
    ("bytes_no_rope", lambda num_layers, kv_lora_rank, qk_rope_dim, seq_len, batch_size, bytes_per_element:
        math.ceil(num_layers * kv_lora_rank * seq_len * batch_size * bytes_per_element)),
    ("bytes_floor", lambda num_layers, kv_lora_rank, qk_rope_dim, seq_len, batch_size, bytes_per_element:
        int(num_layers * (kv_lora_rank + qk_rope_dim) * seq_len * batch_size * bytes_per_element)),
])
def test_mla_cache_bytes_mistakes_are_named(mistake, answer):
    rejects(checks.check_mla_cache_bytes, answer, MLA_HINTS[mistake])


def test_mla_cache_bytes_styles():
    checks.check_mla_cache_bytes(solution().mla_cache_bytes, **CPU)
    from fractions import Fraction

    def exact(num_layers, kv_lora_rank, qk_rope_dim, seq_len, batch_size, bytes_per_element):
        total = Fraction(bytes_per_element) * num_layers * (kv_lora_rank + qk_rope_dim) * seq_len * batch_size
        return -(-total.numerator // total.denominator)
    checks.check_mla_cache_bytes(exact, **CPU)
    def as_float(num_layers, kv_lora_rank, qk_rope_dim, seq_len, batch_size, bytes_per_element):
        return float(exact(num_layers, kv_lora_rank, qk_rope_dim, seq_len, batch_size, bytes_per_element))
    rejects(checks.check_mla_cache_bytes, as_float, "should return an int")


# --------------------------------------------------------------------------------------
# Draft trees
# --------------------------------------------------------------------------------------


def tree_by_ancestors(parents, prefix_len):
    # walk up from each node (a Medusa-like loop), numpy-free
    parents = [int(p) for p in parents]
    if prefix_len < 0 or any(not -1 <= p < i for i, p in enumerate(parents)):
        raise ValueError(f"parents {parents} must come before their children; prefix_len {prefix_len} >= 0")
    keep = torch.zeros(len(parents), prefix_len + len(parents), dtype=torch.bool)
    keep[:, :prefix_len] = True
    for node in range(len(parents)):
        walker = node
        while walker >= 0:
            keep[node, prefix_len + walker] = True
            walker = parents[walker]
    return keep


def positions_by_walk(parents, prefix_len):
    parents = [int(p) for p in parents]
    depth = []
    for node in range(len(parents)):
        steps, walker = 0, parents[node]
        while walker >= 0:
            steps, walker = steps + 1, parents[walker]
        depth.append(steps)
    return torch.tensor(depth, dtype=torch.long) + prefix_len


def test_tree_correct_styles_pass():
    checks.check_tree_attention_mask(tree_by_ancestors, **CPU)
    checks.check_tree_attention_mask(solution().tree_attention_mask, **CPU)
    checks.check_tree_position_ids(positions_by_walk, **CPU)
    checks.check_tree_position_ids(solution().tree_position_ids, **CPU)


TREE = "tree_attention_mask"
TREE_MISTAKES = {
    "no_self": ("    return allowed", "    allowed[torch.arange(count), prefix_len + torch.arange(count)] = False\n"
                "    return allowed"),
    "siblings": ("            allowed[node] = allowed[parent]  # everything its parent sees (the ancestors) ...",
                 "            allowed[node, prefix_len:prefix_len + node] = True"),
    "parent_only": ("allowed[node] = allowed[parent]  # everything its parent sees (the ancestors) ...",
                    "allowed[node, prefix_len + parent] = True"),
    "no_prefix": ("allowed[:, :prefix_len] = True  # the prompt, for every node", "pass"),
    "flipped": ("    return allowed", "    return ~allowed"),
}


@pytest.mark.parametrize("mistake", sorted(TREE_MISTAKES))
def test_tree_attention_mask_mistakes_are_named(mistake):
    rejects(checks.check_tree_attention_mask, planted(TREE, *TREE_MISTAKES[mistake]), TREE_HINTS[mistake])


def test_tree_attention_mask_bad_parents_must_raise():
    rejects(checks.check_tree_attention_mask, planted(TREE, "if not -1 <= parent < node:", "if False:"),
            "should raise ValueError")


@pytest.mark.parametrize("mistake, new", [
    ("positions_index", "return prefix_len + torch.arange(len(depths))"),
    ("positions_plus_one", "return prefix_len + 1 + torch.tensor(depths, dtype=torch.long)"),
    ("positions_no_prefix", "return torch.tensor(depths, dtype=torch.long)"),
])
def test_tree_position_ids_mistakes_are_named(mistake, new):
    wrong = planted("tree_position_ids", "return prefix_len + torch.tensor(depths, dtype=torch.long)", new)
    rejects(checks.check_tree_position_ids, wrong, TREE_HINTS[mistake])


# --------------------------------------------------------------------------------------
# The tensor watch as a probe: its findings are checked when they arrive from a kernel
# --------------------------------------------------------------------------------------


def test_tensor_watch_takes_only_findings_that_break_its_rules():
    watch = checks.TensorWatch([[100, 11, None]])
    watch.accept(None)
    assert watch.offence is None
    watch.accept([0, "einsum", [2, 4, 11, 12], "x"])
    assert watch.offence == (0, "einsum", (2, 4, 11, 12), "x")
    for malformed in ([0, "einsum", [2, 4, 10, 12], "x"],  # breaks no rule: a lie
                      [1, "einsum", [2, 4, 11, 12], "x"], "text", [0, 3, [11, 100], "x"]):
        with pytest.raises(wire.WireError):
            checks.TensorWatch([[100, 11, None]]).accept(malformed)


def test_tensor_watch_ignores_views_of_the_inputs():
    latent = torch.randn(2, 11, 24)
    watch = checks.TensorWatch([[100, 11, None]])
    with watch:
        latent[:, None].expand(2, 4, 11, 24)  # a view: no memory of its own
    assert watch.offence is None
    with watch:
        latent[:, None].repeat(1, 4, 1, 1)
    assert watch.offence is not None and watch.offence[2] == (2, 4, 11, 24)


# --------------------------------------------------------------------------------------
# The widgets
# --------------------------------------------------------------------------------------


def test_block_table_story_shows_forks_sharing_and_copy_on_write():
    from attention_lab.widgets import inference_attention as views

    snapshots = views.block_table_story(solution().PagedKVCache)
    assert len(snapshots) == len(views.STORY)
    after_forks = snapshots[5]
    assert after_forks.tables["A"] == after_forks.tables["B"] == after_forks.tables["C"]  # shared, no copy
    assert after_forks.free_blocks == 12 - 3
    first_write = snapshots[6]  # B copies the partly filled last block
    assert first_write.tables["B"][:2] == first_write.tables["A"][:2] and \
        first_write.tables["B"][2] != first_write.tables["A"][2] and first_write.free_blocks == 8
    freed = snapshots[-1]
    assert "C" not in freed.tables and freed.free_blocks == 12 - len(set(sum(freed.tables.values(), [])))


def test_block_table_view_redraws_each_step():
    from attention_lab.widgets import inference_attention as views

    view = views.block_table_view(OwnerSetCache)
    assert "step 0" in view.figure._suptitle.get_text()
    view.controls["step"].value = 6
    assert "copy-on-write" in view.figure._suptitle.get_text()
    pool = view.figure.axes[0]
    assert any(text.get_text() == "A+B+C" for text in pool.texts)  # blocks still shared by all three


def test_cache_memory_view_counts_the_blocks_the_cache_took():
    from attention_lab.widgets import inference_attention as views

    lengths = [5, 17, 32, 1]
    taken = views.measure_paged_memory(OwnerSetCache, lengths, block_sizes=(1, 4, 16))
    assert taken == {1: 55, 4: 2 + 5 + 8 + 1, 16: 1 + 2 + 2 + 1}
    view = views.cache_memory_view(OwnerSetCache, lengths, max_len=64, block_size=16)
    title = " ".join(view.figure._suptitle.get_text().split())
    assert "6 table entries" in title
    view.controls["block_size"].value = 4
    assert "16 table entries" in " ".join(view.figure._suptitle.get_text().split())


def test_cache_bytes_per_token_of_the_real_configurations():
    from attention_lab.widgets import inference_attention as views

    rows = views.cache_bytes_per_token(solution().mla_cache_bytes, 2)
    assert rows["Llama-2-7B\n(MHA)"] == 32 * 32 * 256 * 2 == 524_288
    assert rows["Llama-3-70B\n(GQA)"] == 327_680
    assert rows["DeepSeek-V3\n(MLA)"] == 61 * 576 * 2 == 70_272
    assert views.cache_bytes_per_token(solution().mla_cache_bytes, 0.5)["DeepSeek-V3\n(MLA)"] == 17_568
    view = views.cache_bytes_view(solution().mla_cache_bytes)
    view.controls["precision"].value = "4-bit"
    assert "4-bit" in view.figure.axes[0].get_title()


def test_mask_explorer_draws_the_students_masks():
    from attention_lab.widgets import inference_attention as views

    answers = solution()
    view = views.mask_explorer(answers.sliding_window_mask, answers.streaming_kept_positions,
                               answers.attention_with_sinks, answers.tree_attention_mask, answers.tree_position_ids)

    def drawn():
        return view.figure.axes[0].images[0].get_array()

    assert (drawn().astype(bool) == answers.sliding_window_mask(12, 12, 4).numpy()).all()
    view.controls["kind"].value = "StreamingLLM"
    row = drawn()[11].astype(bool)
    assert row.nonzero()[0].tolist() == [0, 1, 8, 9, 10, 11]  # 2 sinks, 4 recent
    view.controls["kind"].value = "learned sink"
    weights = drawn()
    assert weights.shape == (12, 13) and abs(weights.sum(-1) - 1).max() < 1e-9
    view.controls["kind"].value = "draft tree"
    assert drawn().shape == (7, 12) and "pos 7" in view.figure.axes[0].get_yticklabels()[-1].get_text()
    before = view.figure.axes[0].get_title()
    view.controls["sink_logit"].value = 2.0  # every control changes the picture (the browser test drags each one)
    assert view.figure.axes[0].get_title() != before


# --------------------------------------------------------------------------------------
# make gpu-check: the decode kernel's timing, as a dry run in the interpreter
# --------------------------------------------------------------------------------------


@needs_triton
def test_gpu_check_times_the_decode_kernel_in_a_dry_run():
    import time

    from benchmarks import gpu_check

    namespace = gpu_check.solution_namespace(gpu_check.DECODE_NOTEBOOK)

    def clock(fn):
        started = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - started)

    rows = gpu_check.time_decode_against_sdpa(namespace, (40,), (2,), torch.device("cpu"),
                                              shape={"heads": 4, "kv_heads": 2, "head_dim": 16, "block": 16},
                                              timer=clock, dtype=torch.float32, programs=16)
    (row,) = rows
    assert row["B"] == 2 and row["L"] == 40 and row["splits"] == 2  # 16 programs over 2 · 4 query heads
    assert row["max_difference"] < 1e-5
    assert row["split_k_ms"] > 0 and row["sdpa_ms"] > 0 and row["one_split_ms"] > 0
    assert gpu_check.decode_splits(1, 32, 131072, 64, 264) == 9
    assert gpu_check.decode_splits(4, 32, 1024, 64, 264) == 3
    assert gpu_check.decode_splits(1, 32, 64, 64, 264) == 1  # never more splits than tiles of keys


# --------------------------------------------------------------------------------------
# The notebook's cells
# --------------------------------------------------------------------------------------


def test_no_code_line_of_notebook_07_is_longer_than_100_characters():
    assert not long_code_lines(NOTEBOOK)


def test_no_demo_of_notebook_07_runs_an_answer_before_its_check():
    assert not demos_before_their_check(NOTEBOOK)
