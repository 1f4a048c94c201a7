"""Notebook 07's views: a paged cache's block tables, its memory against a contiguous cache, the cache bytes of
MHA, GQA and MLA per token, and the masks of inference (causal, window, sinks, draft trees).

Each view is a pure drawing function of numbers plus a thin wrapper (a :class:`LiveFigure`) that computes the
numbers with the student's answers:

* :func:`block_table_story` replays a short story (a prompt, growth, two forks, their first writes, a free) with
  the student's ``PagedKVCache`` and records what its public methods say after each step;
  :func:`plot_block_tables` draws one step; :func:`block_table_view` slides through them;
* :func:`measure_paged_memory` appends a batch of uneven lengths into the student's cache for several block
  sizes and counts the blocks it took; :func:`plot_cache_memory` draws them against a contiguous
  ``max_len`` cache; :func:`cache_memory_view` picks the block size;
* :func:`cache_bytes_per_token` and :func:`plot_cache_bytes` set MHA, GQA and MLA of real configurations side by
  side; :func:`cache_bytes_view` picks the precision;
* :func:`inference_mask` builds one of the masks with the student's functions, :func:`plot_mask` draws it,
  :func:`mask_explorer` switches between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import ipywidgets as widgets
import numpy as np
import torch
from matplotlib.figure import Figure

from attention_lab.widgets.live import LiveFigure, legend_outside, wrap_title

SEQUENCE_COLOURS = ("#2a9d8f", "#e76f51", "#8ab17d", "#9b5de5", "#f4a261", "#457b9d")
FREE_COLOUR = "#f0f0f0"


# --------------------------------------------------------------------------------------
# Block tables: a story replayed with the student's cache
# --------------------------------------------------------------------------------------


@dataclass
class CacheSnapshot:
    """What a paged cache says after one step: each sequence's block table and length, and its free blocks."""

    step: str
    tables: dict[str, list[int]] = field(default_factory=dict)
    lengths: dict[str, int] = field(default_factory=dict)
    free_blocks: int = 0


# (what happens, sequence, action, argument): "new" a sequence with a prompt of n tokens, "append" n tokens,
# "fork" from another sequence, "free".
STORY = (
    ("A takes its prompt of 6 tokens", "A", "new", 6),
    ("A decodes a token", "A", "append", 1),
    ("A decodes a token: its second block is full", "A", "append", 1),
    ("A decodes a token: a third block from the free list", "A", "append", 1),
    ("B = fork(A): the same blocks, one more owner each", "B", "fork", "A"),
    ("C = fork(A): a third owner", "C", "fork", "A"),
    ("B writes a token into the shared last block: copy-on-write", "B", "append", 1),
    ("C writes a token: another copy", "C", "append", 1),
    ("A writes a token: its last block is its own again", "A", "append", 1),
    ("B decodes 4 more tokens: a new block", "B", "append", 4),
    ("C is done: free(C) returns the blocks only C owned", "C", "free", None),
)


def block_table_story(cache_class: Callable, num_blocks: int = 12, block_size: int = 4) -> list[CacheSnapshot]:
    """Replay :data:`STORY` with ``cache_class`` (the student's ``PagedKVCache``); a snapshot after each step,
    read through its public methods only."""
    cache = cache_class(num_blocks, block_size, 1, 2)
    ids: dict[str, int] = {}
    snapshots = []
    generator = torch.Generator().manual_seed(0)
    for text, name, action, argument in STORY:
        if action == "new":
            ids[name] = cache.new_sequence()
        if action in ("new", "append"):
            tokens = torch.randn(1, argument, 2, generator=generator)
            cache.append(ids[name], tokens, tokens)
        elif action == "fork":
            ids[name] = cache.fork(ids[argument])
        elif action == "free":
            cache.free(ids.pop(name))
        snapshots.append(CacheSnapshot(text, {seq: list(cache.block_table(i)) for seq, i in ids.items()},
                                       {seq: int(cache.seq_len(i)) for seq, i in ids.items()},
                                       int(cache.num_free_blocks)))
    return snapshots


def plot_block_tables(figure: Figure, snapshot: CacheSnapshot, num_blocks: int, block_size: int,
                      step: int | None = None) -> None:
    """The pool (top: each block coloured by its owners, hatched when shared, with the slots in use) and each
    sequence's block table (below, in order)."""
    names = sorted(snapshot.tables)
    colours = {name: SEQUENCE_COLOURS[ord(name[0]) % len(SEQUENCE_COLOURS)] for name in names}
    owners: dict[int, list[str]] = {}
    used: dict[int, int] = {}
    for name in names:
        for index, block in enumerate(snapshot.tables[name]):
            owners.setdefault(block, []).append(name)
            used[block] = max(used.get(block, 0), min(block_size, snapshot.lengths[name] - index * block_size))
    grid = figure.add_gridspec(2, 1, height_ratios=[1.0, 1.2], hspace=0.55, left=0.06, right=0.98, top=0.84,
                               bottom=0.06)
    pool = figure.add_subplot(grid[0])
    for block in range(num_blocks):
        who = owners.get(block, [])
        colour = colours[who[0]] if who else FREE_COLOUR
        pool.add_patch(_box(block, 0, colour, "//" if len(who) > 1 else None))
        filled = used.get(block, 0)
        for slot in range(block_size):  # a dot per slot that holds a token
            pool.plot(block + 0.15 + 0.7 * slot / max(1, block_size - 1), 0.25, "o", markersize=3,
                      color="black" if slot < filled else "0.8")
        pool.text(block + 0.5, 0.62, "+".join(who) if who else "free", ha="center", fontsize=8)
        pool.text(block + 0.5, -0.25, str(block), ha="center", fontsize=8, color="0.3")
    pool.set(xlim=(-0.1, num_blocks + 0.1), ylim=(-0.45, 1.05), xticks=[], yticks=[])
    pool.set_title(f"the pool: {num_blocks} blocks of {block_size} slots, {snapshot.free_blocks} free "
                   "(hatched: shared by several sequences)", fontsize=9)
    for spine in pool.spines.values():
        spine.set_visible(False)
    tables = figure.add_subplot(grid[1])
    width = max([len(snapshot.tables[name]) for name in names] + [1])
    for row, name in enumerate(names):
        table = snapshot.tables[name]
        tables.text(-0.2, -row + 0.5, f"{name} ({snapshot.lengths[name]} tokens)", ha="right", va="center",
                    fontsize=9)
        for index, block in enumerate(table):
            shared = len(owners.get(block, [])) > 1
            tables.add_patch(_box(index, -row, colours[name], "//" if shared else None))
            tables.text(index + 0.5, -row + 0.5, str(block), ha="center", va="center", fontsize=9)
    tables.set(xlim=(-2.6, width + 0.2), ylim=(-max(len(names), 1) + 0.9, 1.1), xticks=[], yticks=[])
    tables.set_title("block tables (the block of positions 0-3, 4-7, ... of each sequence)", fontsize=9)
    for spine in tables.spines.values():
        spine.set_visible(False)
    prefix = f"step {step}: " if step is not None else ""
    figure.suptitle(wrap_title(prefix + snapshot.step, 80), fontsize=11)


def _box(x: float, y: float, colour: str, hatch: str | None):
    from matplotlib.patches import Rectangle

    return Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, facecolor=colour, edgecolor="white" if hatch is None else "0.2",
                     hatch=hatch, linewidth=0.8)


def block_table_view(cache_class: Callable, num_blocks: int = 12, block_size: int = 4) -> LiveFigure:
    """A step slider through :func:`block_table_story` run with ``cache_class``."""
    snapshots = block_table_story(cache_class, num_blocks, block_size)

    def draw(figure: Figure, step: int) -> None:
        plot_block_tables(figure, snapshots[step], num_blocks, block_size, step=step)

    controls = {"step": widgets.IntSlider(value=0, min=0, max=len(snapshots) - 1, description="step")}
    return LiveFigure(draw, controls, figsize=(8.0, 4.6))


# --------------------------------------------------------------------------------------
# Memory: a contiguous max_len cache against a paged one
# --------------------------------------------------------------------------------------

BLOCK_SIZES = (1, 4, 8, 16, 32, 64, 128)


def measure_paged_memory(cache_class: Callable, lengths: Sequence[int], block_sizes: Sequence[int] = BLOCK_SIZES
                         ) -> dict[int, int]:
    """For each block size: the blocks ``cache_class`` took to hold every sequence of ``lengths`` (appended whole,
    one KV head of one feature: the count does not depend on the sizes of the tokens)."""
    taken = {}
    for block_size in block_sizes:
        num_blocks = sum(math.ceil(n / block_size) for n in lengths) + 1
        cache = cache_class(num_blocks, block_size, 1, 1, dtype=torch.float16)
        for length in lengths:
            tokens = torch.zeros(1, int(length), 1, dtype=torch.float16)
            cache.append(cache.new_sequence(), tokens, tokens)
        taken[block_size] = num_blocks - int(cache.num_free_blocks)
    return taken


def plot_cache_memory(figure: Figure, lengths: Sequence[int], max_len: int, taken: dict[int, int], block_size: int,
                      bytes_per_token: int) -> None:
    """Left: per sequence, the slots a contiguous cache reserves, those a paged cache of ``block_size`` holds, and
    the tokens. Right: the whole batch's memory against the block size (the paged points are ``taken``)."""
    order = np.argsort(lengths)
    lengths_sorted = np.asarray(lengths)[order]
    left, right = figure.subplots(1, 2, gridspec_kw={"width_ratios": [1.3, 1.0], "wspace": 0.35})
    rows = np.arange(len(lengths))
    paged = np.ceil(lengths_sorted / block_size) * block_size
    left.barh(rows, np.full(len(rows), max_len), color="#e9ecef", label=f"contiguous: max_len = {max_len}")
    left.barh(rows, paged, color="#f4a261", label=f"paged, blocks of {block_size}")
    left.barh(rows, lengths_sorted, color="#2a9d8f", height=0.5, label="tokens")
    left.set(xlabel="slots of one sequence", yticks=[], ylabel="sequences (sorted by length)")
    legend_outside(left, ncol=1)
    tokens = int(np.sum(lengths)) * bytes_per_token
    contiguous = len(lengths) * max_len * bytes_per_token
    sizes = sorted(taken)
    paged_bytes = [taken[size] * size * bytes_per_token for size in sizes]
    mib = 2 ** 20
    right.plot(sizes, [contiguous / mib] * len(sizes), color="0.5", label="contiguous max_len")
    right.plot(sizes, [p / mib for p in paged_bytes], "o-", color="#f4a261", label="paged (blocks your cache took)")
    right.plot(sizes, [tokens / mib] * len(sizes), "--", color="#2a9d8f", label="the tokens themselves")
    right.plot([block_size], [taken[block_size] * block_size * bytes_per_token / mib], "o", markersize=10,
               markerfacecolor="none", color="black")
    right.set(xscale="log", xlabel="block size (slots)", ylabel="MiB (one layer)", ylim=(0, contiguous / mib * 1.1))
    right.set_xticks(sizes, [str(size) for size in sizes])
    legend_outside(right, ncol=1)
    used = taken[block_size] * block_size * bytes_per_token
    figure.suptitle(wrap_title(f"{len(lengths)} sequences: contiguous reserves {contiguous / mib:.1f} MiB "
                               f"({100 * tokens / contiguous:.0f}% holds tokens); paged with blocks of {block_size}: "
                               f"{used / mib:.2f} MiB ({100 * tokens / used:.0f}% holds tokens), "
                               f"{taken[block_size]} table entries", 90), fontsize=10)


def cache_memory_view(cache_class: Callable, lengths: Sequence[int], max_len: int, block_size: int = 16,
                      kv_heads: int = 2, head_dim: int = 64, bytes_per_element: int = 2) -> LiveFigure:
    """The memory of a batch of ``lengths`` in a contiguous ``max_len`` cache and in ``cache_class``'s pool (one
    layer of ``kv_heads`` heads of ``head_dim``), with a block-size selector."""
    taken = measure_paged_memory(cache_class, lengths)
    per_token = 2 * kv_heads * head_dim * bytes_per_element

    def draw(figure: Figure, block_size: int) -> None:
        plot_cache_memory(figure, lengths, max_len, taken, block_size, per_token)

    controls = {"block_size": widgets.Dropdown(options=list(BLOCK_SIZES), value=block_size, description="block size")}
    return LiveFigure(draw, controls, figsize=(9.0, 4.4))


# --------------------------------------------------------------------------------------
# Cache bytes per token: MHA, GQA, MLA of real configurations
# --------------------------------------------------------------------------------------

# From each model's config.json on the Hugging Face Hub (meta-llama/Llama-2-7b-hf, meta-llama/Meta-Llama-3-70B,
# deepseek-ai/DeepSeek-V3). DeepSeek-V3 "as MHA": its 128 heads caching keys of 128 + 64 and values of 128.
KV_CONFIGS = {
    "Llama-2-7B\n(MHA)": {"layers": 32, "kv_heads": 32, "key_dim": 128, "value_dim": 128},
    "Llama-3-70B\n(GQA)": {"layers": 80, "kv_heads": 8, "key_dim": 128, "value_dim": 128},
    "DeepSeek-V3\nas MHA": {"layers": 61, "kv_heads": 128, "key_dim": 192, "value_dim": 128},
}
MLA_CONFIGS = {"DeepSeek-V3\n(MLA)": {"num_layers": 61, "kv_lora_rank": 512, "qk_rope_dim": 64}}
PRECISIONS = {"16-bit": 2, "8-bit": 1, "4-bit": 0.5}


def cache_bytes_per_token(mla_cache_bytes: Callable, bytes_per_element: float) -> dict[str, int]:
    """Bytes one token adds to the cache, for each model: keys and values per KV head and layer (MHA, GQA), and
    ``mla_cache_bytes`` (the student's) for MLA."""
    rows = {name: math.ceil(c["layers"] * c["kv_heads"] * (c["key_dim"] + c["value_dim"]) * bytes_per_element)
            for name, c in KV_CONFIGS.items()}
    for name, config in MLA_CONFIGS.items():
        rows[name] = int(mla_cache_bytes(**config, seq_len=1, batch_size=1, bytes_per_element=bytes_per_element))
    return rows


def plot_cache_bytes(figure: Figure, rows: dict[str, int], precision: str, context: int = 131072) -> None:
    """Bars of KiB per token, each labelled with the GiB of one sequence of ``context`` tokens."""
    ax = figure.add_subplot(1, 1, 1)
    names = list(rows)
    kib = [rows[name] / 2 ** 10 for name in names]
    colours = ["#e76f51" if "MHA" in name else "#f4a261" if "GQA" in name else "#2a9d8f" for name in names]
    bars = ax.bar(range(len(names)), kib, color=colours)
    for bar, name in zip(bars, names):
        gib = rows[name] * context / 2 ** 30
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{bar.get_height():,.0f} KiB\n"
                f"{gib:,.1f} GiB at {context // 1024}k", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names, fontsize=9)
    ax.set(ylabel="KiB per token (all layers)", ylim=(0, max(kib) * 1.3))
    ax.set_title(f"the KV cache per token, {precision} ({PRECISIONS[precision]:g} bytes a number)", fontsize=10)


def cache_bytes_view(mla_cache_bytes: Callable, precision: str = "16-bit") -> LiveFigure:
    def draw(figure: Figure, precision: str) -> None:
        plot_cache_bytes(figure, cache_bytes_per_token(mla_cache_bytes, PRECISIONS[precision]), precision)

    controls = {"precision": widgets.Dropdown(options=list(PRECISIONS), value=precision, description="precision")}
    return LiveFigure(draw, controls, figsize=(7.5, 4.0))


# --------------------------------------------------------------------------------------
# The masks of inference
# --------------------------------------------------------------------------------------

MASK_KINDS = ("causal", "sliding window", "StreamingLLM", "learned sink", "draft tree")


def inference_mask(kind: str, length: int, window: int, n_sink: int, sink_logit: float, functions: dict[str, Callable],
                   draft_parents: Sequence[int]) -> tuple[np.ndarray, list[str], list[str], str]:
    """``(values [rows, columns], row labels, column labels, what it shows)`` of one mask, built with the student's
    ``functions``: booleans for the masks, weights for the learned sink (its last column: the sink's share)."""
    positions = [str(p) for p in range(length)]
    if kind == "causal":
        keep = functions["sliding_window_mask"](length, length, length)
        return keep.numpy(), positions, positions, "causal: query p sees keys 0 ... p"
    if kind == "sliding window":
        keep = functions["sliding_window_mask"](length, length, window)
        return keep.numpy(), positions, positions, f"sliding window of {window}: query p sees p - {window} < j <= p"
    if kind == "StreamingLLM":
        keep = torch.zeros(length, length, dtype=torch.bool)
        for row in range(length):  # decoding token `row`: the cache holds the kept positions of row + 1 tokens
            keep[row, functions["streaming_kept_positions"](row + 1, n_sink, window)] = True
        return keep.numpy(), positions, positions, (f"StreamingLLM: {n_sink} sinks + the {window} most recent "
                                                    "tokens, decoding one token a row")
    if kind == "learned sink":
        generator = torch.Generator().manual_seed(1)
        q = torch.randn(1, 1, length, length, generator=generator, dtype=torch.float64)
        k = torch.randn(1, 1, length, length, generator=generator, dtype=torch.float64)
        identity = torch.eye(length, dtype=torch.float64)[None, None]  # out = the weights themselves
        weights = functions["attention_with_sinks"](q, k, identity, torch.tensor([sink_logit], dtype=torch.float64),
                                                    window=window)[0, 0]
        sink_share = 1.0 - weights.sum(-1, keepdim=True)
        values = torch.cat([weights, sink_share], dim=-1).numpy()
        return values, positions, positions + ["sink"], (f"learned sink logit {sink_logit:g}, window {window}: "
                                                         "weights (the last column: the sink's share)")
    prefix = max(1, length - len(draft_parents)) if length > len(draft_parents) else 1
    keep = functions["tree_attention_mask"](list(draft_parents), prefix)
    ids = functions["tree_position_ids"](list(draft_parents), prefix).tolist()
    rows = [f"draft {i} (pos {p})" for i, p in enumerate(ids)]
    columns = [f"p{i}" for i in range(prefix)] + [f"d{i}" for i in range(len(draft_parents))]
    return keep.numpy(), rows, columns, (f"draft tree, parents {list(draft_parents)} after a prompt of {prefix}: "
                                         "each draft sees the prompt, its ancestors and itself")


def plot_mask(figure: Figure, values: np.ndarray, rows: Sequence[str], columns: Sequence[str], title: str,
              settings: str = "") -> None:
    """One mask (True dark) or one row-per-query table of weights, with its labels."""
    ax = figure.add_subplot(1, 1, 1)
    weights = values.dtype != bool
    image = ax.imshow(values.astype(float), cmap="viridis" if weights else "Greys", vmin=0.0, vmax=1.0,
                      aspect="auto")
    if weights:
        figure.colorbar(image, ax=ax, fraction=0.04, pad=0.02, label="weight")
    ax.set_xticks(range(len(columns)), columns, fontsize=7, rotation=90 if len(columns) > 16 else 0)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.set(xlabel="key", ylabel="query")
    ax.set_title(wrap_title(title + (f"\n{settings}" if settings else ""), 80), fontsize=9)


def mask_explorer(sliding_window_mask: Callable, streaming_kept_positions: Callable, attention_with_sinks: Callable,
                  tree_attention_mask: Callable, tree_position_ids: Callable,
                  draft_parents: Sequence[int] = (-1, -1, 0, 0, 1, 2, 4)) -> LiveFigure:
    """The masks of this notebook, drawn by the student's functions: a kind selector and its settings."""
    functions = {"sliding_window_mask": sliding_window_mask, "streaming_kept_positions": streaming_kept_positions,
                 "attention_with_sinks": attention_with_sinks, "tree_attention_mask": tree_attention_mask,
                 "tree_position_ids": tree_position_ids}

    def draw(figure: Figure, kind: str, length: int, window: int, n_sink: int, sink_logit: float) -> None:
        values, rows, columns, title = inference_mask(kind, length, window, n_sink, sink_logit, functions,
                                                      draft_parents)
        settings = f"(S = {length}, window or recent = {window}, n_sink = {n_sink}, sink logit = {sink_logit:g})"
        plot_mask(figure, values, rows, columns, title, settings)

    controls = {
        "kind": widgets.ToggleButtons(options=list(MASK_KINDS), value="sliding window", description="mask"),
        "length": widgets.IntSlider(value=12, min=4, max=24, description="S (tokens)"),
        "window": widgets.IntSlider(value=4, min=1, max=12, description="window"),
        "n_sink": widgets.IntSlider(value=2, min=0, max=4, description="n_sink"),
        "sink_logit": widgets.FloatSlider(value=0.0, min=-4.0, max=4.0, step=0.5, description="sink logit"),
    }
    return LiveFigure(draw, controls, figsize=(7.0, 6.0))


__all__ = ["CacheSnapshot", "block_table_story", "plot_block_tables", "block_table_view", "measure_paged_memory",
           "plot_cache_memory", "cache_memory_view", "cache_bytes_per_token", "plot_cache_bytes", "cache_bytes_view",
           "inference_mask", "plot_mask", "mask_explorer"]
