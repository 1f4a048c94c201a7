"""Notebook 05's views: a RoPE explorer, and per-head causal attention coloured by KV group.

* :func:`plot_rope` draws the 2-D feature pairs of one vector rotating with its position
  (one panel per frequency) and q·k against the offset between query and key;
  :func:`rope_explorer` wraps it with a position slider and a base selector, running *your*
  ``rope_frequencies`` and ``apply_rope``.
* :func:`plot_kv_head_map` draws which KV head each query head reads (a line per query head);
  :func:`kv_head_map` wraps it with a consecutive/tiled toggle and an ``H_kv`` selector,
  running *your* ``repeat_kv``.
* :func:`plot_kv_group_heads` draws one causal heatmap per query head, in one colour per
  KV group (query heads that share a K/V head share a colour); :func:`kv_group_heatmaps`
  wraps it with a group selector and a colour-scale toggle.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import ipywidgets as widgets
import numpy as np
import torch
from matplotlib.figure import Figure

from attention_lab.widgets.live import LiveFigure, wrap_title

GROUP_COLOURMAPS = ("Blues", "Oranges", "Greens", "Purples", "Reds", "Greys")


# --------------------------------------------------------------------------------------
# RoPE explorer
# --------------------------------------------------------------------------------------


def plot_rope(figure: Figure, pairs: torch.Tensor, position: int, offsets: torch.Tensor,
              scores: torch.Tensor, score_labels: Sequence[str], title: str = "") -> None:
    """Draw RoPE's rotations and its relative-position property.

    pairs: ``[P, d/2, 2]`` the feature pairs of one vector rotated at positions 0 … P-1;
    the top row shows pair j's path up to ``position`` (line) and where it is at ``position``
    (arrow from the origin). offsets ``[N]`` and scores ``[M, N]``: q·k against the offset
    between query and key, one curve per starting position (they coincide for RoPE).
    """
    pairs = pairs.detach().to("cpu", torch.float64)
    num_pairs = pairs.shape[1]
    # The top row's panels are square: the figure's height follows its width, so no empty band
    # opens between the two rows (see rope_figure_size).
    grid = figure.add_gridspec(2, num_pairs, height_ratios=[1.0, 1.1], hspace=0.3, left=0.08, right=0.98,
                               bottom=0.12, top=0.86)
    radius = float(pairs.norm(dim=-1).max()) * 1.15 or 1.0
    circle = np.linspace(0.0, 2.0 * math.pi, 120)
    for j in range(num_pairs):
        ax = figure.add_subplot(grid[0, j])
        norm = float(pairs[0, j].norm())
        ax.plot(norm * np.cos(circle), norm * np.sin(circle), color="0.85", linewidth=0.8)
        trail = pairs[: position + 1, j]
        ax.plot(trail[:, 0].numpy(), trail[:, 1].numpy(), color="tab:blue", linewidth=1.0, alpha=0.6)
        x, y = float(pairs[position, j, 0]), float(pairs[position, j, 1])
        ax.plot([0.0, x], [0.0, y], color="tab:red", linewidth=2.0)
        ax.set_xlim(-radius, radius)
        ax.set_ylim(-radius, radius)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(f"pair {j}", fontsize=9)
    ax = figure.add_subplot(grid[1, :])
    styles = ("-", "--", ":")
    for index, (row, label) in enumerate(zip(scores.detach().cpu().double(), score_labels)):
        ax.plot(offsets.cpu().numpy(), row.numpy(), styles[index % 3], linewidth=2.0 - 0.5 * index, label=label)
    ax.set_xlabel("offset m - n (query position minus key position)")
    ax.set_ylabel("q·k after RoPE")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    if title:
        figure.suptitle(wrap_title(title), fontsize=10)


def rope_explorer(apply_rope: Callable, rope_frequencies: Callable, head_dim: int = 8,
                  max_position: int = 48, seed: int = 0) -> LiveFigure:
    """Explore RoPE with *your* ``rope_frequencies(head_dim, max_positions, base)`` and
    ``apply_rope(x, freqs_cis, position_ids)`` on random q, k of ``head_dim`` features.

    Controls: ``position`` (where the top row shows the pairs; also the key position of the
    second q·k curve) and ``base`` (RoPE's θ: larger bases rotate the slow pairs slower).
    """
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(head_dim, generator=generator, dtype=torch.float64)
    k = q + 0.5 * torch.randn(head_dim, generator=generator, dtype=torch.float64)  # similar to q: a visible peak at 0
    table_size = 2 * max_position + 1

    def rotate(vector: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        x = vector.expand(1, 1, positions.numel(), head_dim)  # [1, 1, N, d]
        return apply_rope(x, table, positions[None])[0, 0]  # [N, d]

    def draw(figure: Figure, position: int, base: float) -> None:
        table = rope_frequencies(head_dim, table_size, base)
        positions = torch.arange(max_position + 1)
        pairs = rotate(q, positions, table).reshape(-1, head_dim // 2, 2)  # Meta layout: (2j, 2j+1)
        offsets = torch.arange(max_position)
        rows, labels = [], []
        for key_position in (0, position):
            rotated_q = rotate(q, key_position + offsets, table)  # query at key_position + offset
            rotated_k = rotate(k, torch.tensor([key_position]), table)  # [1, d]
            rows.append(rotated_q @ rotated_k[0])
            labels.append(f"key at position {key_position}")
        angles = [f"{float(torch.angle(table[1, j])):.2g}" for j in range(head_dim // 2)]
        title = (f"position {position}, base {base:g}: pair j turns by θ_j = ({', '.join(angles)}) rad per token; "
                 "the q·k curves coincide")
        plot_rope(figure, pairs, position, offsets, torch.stack(rows), labels, title)

    controls = {
        # Redraw when the slider is released, not at every intermediate value.
        "position": widgets.IntSlider(value=5, min=0, max=max_position, description="position",
                                      continuous_update=False),
        "base": widgets.Dropdown(options=[100.0, 10000.0, 500000.0], value=10000.0, description="base"),
    }
    return LiveFigure(draw, controls, figsize=rope_figure_size(head_dim // 2))


def rope_figure_size(num_pairs: int, width: float = 9.0) -> tuple[float, float]:
    """Width and height (inches) for :func:`plot_rope`: square top-row panels, no empty band."""
    panel = 0.9 * width / max(num_pairs, 1)
    return width, min(panel, 2.4) * 2.3 / 0.74


# --------------------------------------------------------------------------------------
# Which KV head each query head reads
# --------------------------------------------------------------------------------------

LAYOUTS = ("consecutive (your repeat_kv)", "tiled (x.repeat)")


def plot_kv_head_map(figure: Figure, kv_head_of_query: Sequence[int], num_kv_heads: int, title: str = "") -> None:
    """Query heads on the top row, KV heads on the bottom row, a line from each query head to
    the KV head it reads (``kv_head_of_query[h]``), coloured by KV head."""
    num_heads = len(kv_head_of_query)
    ax = figure.add_subplot(1, 1, 1)
    colours = [_kv_colour(g, num_kv_heads) for g in range(num_kv_heads)]
    # KV heads spread under the query heads, so that consecutive groups sit under their KV head.
    kv_x = [(g + 0.5) * num_heads / num_kv_heads - 0.5 for g in range(num_kv_heads)]
    for head, group in enumerate(kv_head_of_query):
        ax.plot([head, kv_x[group]], [1.0, 0.0], color=colours[group], linewidth=1.6, alpha=0.85)
    ax.scatter(range(num_heads), [1.0] * num_heads, s=120, color=[colours[g] for g in kv_head_of_query],
               edgecolor="black", zorder=3)
    ax.scatter(kv_x, [0.0] * num_kv_heads, s=260, marker="s", color=colours, edgecolor="black", zorder=3)
    for head in range(num_heads):
        ax.annotate(f"q{head}", (head, 1.0), textcoords="offset points", xytext=(0, 9), ha="center", fontsize=8)
    for group, x in enumerate(kv_x):
        ax.annotate(f"KV {group}", (x, 0.0), textcoords="offset points", xytext=(0, -16), ha="center", fontsize=8)
    ax.set_xlim(-1.0, num_heads)
    ax.set_ylim(-0.35, 1.3)
    ax.axis("off")
    if title:
        ax.set_title(wrap_title(title), fontsize=9)


def _kv_colour(index: int, count: int = 10) -> tuple[float, float, float, float]:
    """One distinct colour per KV head: tab10 up to 10 heads, tab20 up to 20, then evenly
    spaced hues (no two heads share a colour)."""
    from matplotlib import colormaps

    if count <= 10:
        return colormaps["tab10"](index)
    if count <= 20:
        return colormaps["tab20"](index)
    return colormaps["hsv"](index / count)


def kv_head_map(repeat_kv: Callable, num_heads: int = 16, num_kv_heads: int = 4) -> LiveFigure:
    """Which KV head each of ``num_heads`` query heads reads, computed by *your*
    ``repeat_kv(x, n_rep)`` (consecutive) or by ``x.repeat(1, n_rep, 1, 1)`` (tiled).

    Controls: ``layout`` (consecutive / tiled) and ``num_kv_heads`` (the divisors of
    ``num_heads``: 1 is multi-query attention, ``num_heads`` plain multi-head attention).
    """
    divisors = [h_kv for h_kv in range(1, num_heads + 1) if num_heads % h_kv == 0]
    if num_kv_heads not in divisors:
        raise ValueError(f"num_kv_heads = {num_kv_heads} must divide num_heads = {num_heads}")

    def draw(figure: Figure, layout: str, num_kv_heads: int) -> None:
        n_rep = num_heads // num_kv_heads
        labelled = torch.arange(num_kv_heads, dtype=torch.float64).view(1, num_kv_heads, 1, 1)  # KV head g holds g
        repeated = repeat_kv(labelled, n_rep) if layout == LAYOUTS[0] else labelled.repeat(1, n_rep, 1, 1)
        kv_head_of_query = [int(round(float(value))) for value in repeated.flatten()]
        rule = "h // n_rep" if layout == LAYOUTS[0] else "h % H_kv"
        title = (f"{num_heads} query heads, {num_kv_heads} KV heads (n_rep = {n_rep}), {layout.split()[0]}: "
                 f"query head h reads KV head {rule}")
        plot_kv_head_map(figure, kv_head_of_query, num_kv_heads, title)

    controls = {
        "layout": widgets.ToggleButtons(options=list(LAYOUTS), value=LAYOUTS[0], description="layout"),
        "num_kv_heads": widgets.Dropdown(options=divisors, value=num_kv_heads, description="H_kv"),
    }
    return LiveFigure(draw, controls, figsize=(max(7.0, 0.55 * num_heads), 2.8))


# --------------------------------------------------------------------------------------
# Causal heatmaps per head, coloured by KV group
# --------------------------------------------------------------------------------------


def _largest_chosen_weight(head_weights: torch.Tensor) -> float:
    """The largest weight of a query that had a choice (two or more visible keys).

    Under a causal mask the first query sees only itself, so its weight is always 1 and a
    plain per-head maximum would be 1 for every head: the scale would change nothing.
    """
    choosing = (head_weights > 0).sum(-1) > 1
    rows = head_weights[choosing] if bool(choosing.any()) else head_weights
    return float(rows.max())


def plot_kv_group_heads(figure: Figure, weights: torch.Tensor, num_kv_heads: int,
                        tokens: Sequence[str] | None = None, groups: Sequence[int] | None = None,
                        per_head_scale: bool = False) -> None:
    """One heatmap per query head of ``weights [H, S_q, S_k]``, one row (and colour) per KV group.

    Query head h reads KV head h // n_rep (n_rep = H / H_kv), so row g holds heads
    g·n_rep … (g+1)·n_rep - 1. Masked (future) positions have weight 0 and are left blank.
    """
    weights = weights.detach().to("cpu", torch.float64)
    num_heads, seq_len, num_keys = weights.shape
    n_rep = num_heads // num_kv_heads
    groups = list(range(num_kv_heads)) if groups is None else list(groups)
    # The figure's height follows the number of rows drawn: one group alone fills it, no blank below.
    figure.set_size_inches(_heatmap_width(n_rep, len(groups)), _heatmap_height(n_rep, len(groups)))
    axes = figure.subplots(len(groups), n_rep, squeeze=False)
    labels = list(tokens) if tokens is not None else [str(i) for i in range(num_keys)]
    for row_index, (row, group) in enumerate(zip(axes, groups)):
        colourmap = GROUP_COLOURMAPS[group % len(GROUP_COLOURMAPS)]
        for column, ax in enumerate(row):
            head = group * n_rep + column
            shown = weights[head].clone()
            shown[shown == 0] = float("nan")  # masked: blank, so the causal triangle is visible
            vmax = _largest_chosen_weight(weights[head]) if per_head_scale else 1.0
            ax.imshow(shown.numpy(), cmap=colourmap, vmin=0.0, vmax=vmax)
            ax.set_title(f"head {head} · KV {group}", fontsize=8)
            # Token labels on the outer axes only: rows are queries, columns keys.
            if row_index == len(groups) - 1:
                ax.set_xticks(range(num_keys), labels[-num_keys:], rotation=90, fontsize=7)
                ax.set_xlabel("key", fontsize=8)
            else:
                ax.set_xticks([])
            if column == 0:
                ax.set_yticks(range(seq_len), labels[-seq_len:], fontsize=7)
                ax.set_ylabel("query", fontsize=8)
            else:
                ax.set_yticks([])
    figure.suptitle(wrap_title(f"{num_heads} query heads, {num_kv_heads} KV heads: each row shares one K/V head "
                               f"(heads g·{n_rep} … g·{n_rep}+{n_rep - 1} read KV head g)", 80), fontsize=9)


def kv_group_heatmaps(weights: torch.Tensor, num_kv_heads: int, tokens: Sequence[str] | None = None) -> LiveFigure:
    """Per-head causal attention ``weights [H, S, S]`` coloured by KV group.

    Controls: ``group`` ("all" or one KV group) and ``per_head_scale`` (colours scaled to
    each head's largest weight of a query with a choice of keys, instead of 0 … 1).
    """
    num_heads = weights.shape[0]
    n_rep = num_heads // num_kv_heads

    def draw(figure: Figure, group: str, per_head_scale: bool) -> None:
        groups = None if group == "all" else [int(group)]
        plot_kv_group_heads(figure, weights, num_kv_heads, tokens, groups, per_head_scale)

    controls = {
        "group": widgets.Dropdown(options=["all"] + [str(g) for g in range(num_kv_heads)], value="all",
                                  description="KV group"),
        "per_head_scale": widgets.Checkbox(value=False, description="per-head colour scale"),
    }
    return LiveFigure(draw, controls, figsize=(_heatmap_width(n_rep, num_kv_heads),
                                               _heatmap_height(n_rep, num_kv_heads)))


def _heatmap_cell(n_rep: int, rows: int) -> float:
    """Inches per heatmap: as large as 1.9, but the whole grid within about 9 x 7 inches
    (900 x 700 px: the "all" view fits a laptop's window with its controls above it)."""
    return min(1.9, 6.0 / rows, 8.5 / n_rep)


def _heatmap_width(n_rep: int, rows: int = 1) -> float:
    return _heatmap_cell(n_rep, rows) * n_rep + 0.8


def _heatmap_height(n_rep: int, rows: int) -> float:
    return _heatmap_cell(n_rep, rows) * rows + 1.0
