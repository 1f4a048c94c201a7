"""Per-head attention heatmaps (notebook 01): head, causal mask, d_head, scaling on/off, temperature.

The explorer answers "why 1/sqrt(d_head)?" by showing it: random queries and keys with
unit-variance entries, for several head widths, pushed through the student's own
``attention_weights``. Beside the heatmaps, the mean row entropy against ``d_head`` with and
without the scaling: the raw scores' entropy falls towards 0 (one-hot rows) as ``d_head``
grows, the scaled scores' entropy stays put.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import ipywidgets as widgets
import torch
from matplotlib.figure import Figure

from attention_lab.widgets.live import LiveFigure, legend_outside, wrap_title

SCALED = "÷ sqrt(d_head)"
RAW = "none (raw q·k)"


def plot_attention_heads(figure: Figure, weights: torch.Tensor, tokens: Sequence[str],
                         heads: Sequence[int] | None = None, title: str = "", axes=None) -> None:
    """Draw one heatmap per head of ``weights [H, S_q, S_k]`` (rows: queries, columns: keys).

    Only the maps of the first column carry the query labels, so neighbouring maps never overlap them.
    ``axes``: where to draw (default: one new row of subplots filling ``figure``).
    """
    weights = weights.detach().to("cpu", torch.float64)
    heads = list(range(weights.shape[0])) if heads is None else list(heads)
    if axes is None:
        axes = figure.subplots(1, len(heads), squeeze=False)[0]
    for index, (ax, head) in enumerate(zip(axes, heads)):
        image = ax.imshow(weights[head].numpy(), vmin=0.0, vmax=1.0, cmap="viridis")
        ax.set_title(f"head {head}", fontsize=9)
        ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=8)
        ax.set_xlabel("key", fontsize=8)
        spec = ax.get_subplotspec()
        if index == 0 or (spec is not None and spec.is_first_col()):
            ax.set_yticks(range(len(tokens)), tokens, fontsize=8)
            ax.set_ylabel("query", fontsize=8)
        else:
            ax.set_yticks(range(len(tokens)), [""] * len(tokens))
    figure.colorbar(image, ax=list(axes), shrink=0.8, label="weight")
    if title:
        figure.suptitle(wrap_title(title), fontsize=10)


def mean_row_entropy(weights: torch.Tensor) -> float:
    """Mean entropy of the rows in nats: log(S_k) is uniform attention, 0 is one-hot."""
    weights = weights.detach().to("cpu", torch.float64)
    return float(-(weights * weights.clamp_min(1e-300).log()).sum(-1).mean())


def attention_explorer(attention_weights: Callable, tokens: Sequence[str], *, num_heads: int = 4,
                       d_heads: Sequence[int] = (4, 16, 64, 256, 1024), seed: int = 0) -> LiveFigure:
    """Explore ``attention_weights(q, k, mask)`` (yours) on random unit-variance q, k ``[H, S, d_head]``.

    Controls: which head, the causal mask, ``d_head``, whether the scores are divided by
    sqrt(d_head) (your function always divides; "none" feeds it q·sqrt(d_head) so the
    division cancels), and an extra temperature factor on top. The right panel is the mean row
    entropy against d_head for both scalings, with the current setting marked.
    """
    seq_len = len(tokens)
    generator = torch.Generator().manual_seed(seed)
    # The heads shown, and a larger sample (32 more heads per width) for smooth entropy curves.
    shown_samples = {d: (torch.randn(num_heads, seq_len, d, generator=generator),
                         torch.randn(num_heads, seq_len, d, generator=generator)) for d in d_heads}
    curve_samples = {d: (torch.randn(32, seq_len, d, generator=generator),
                         torch.randn(32, seq_len, d, generator=generator)) for d in d_heads}

    def weights_for(d_head: int, scaling: str, factor: float, causal: bool, samples=shown_samples) -> torch.Tensor:
        q, k = samples[d_head]
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril() if causal else None
        # The student's function divides by sqrt(d_head); "none" undoes it.
        multiplier = factor * (math.sqrt(d_head) if scaling == RAW else 1.0)
        return attention_weights(q * multiplier, k, mask)  # [H, S, S]

    def draw(figure: Figure, head: str, causal: bool, d_head: int, scaling: str, factor: float) -> None:
        shown = list(range(num_heads)) if head == "all" else [int(head)]
        # The heads on two rows (a figure narrow enough for a laptop's notebook), the entropy
        # curve on their right. Fixed margins rather than a layout engine: a constrained layout
        # doubles the redraw time.
        rows = 2 if len(shown) > 2 else 1
        columns = math.ceil(len(shown) / rows)
        grid = figure.add_gridspec(rows, columns + 1, width_ratios=[1.0] * columns + [1.5 * columns / 2 + 0.4],
                                   left=0.07, right=0.98, bottom=0.2, top=0.84, wspace=0.6, hspace=0.75)
        map_axes = [figure.add_subplot(grid[i // columns, i % columns]) for i in range(len(shown))]
        weights = weights_for(d_head, scaling, factor, causal)
        title = (f"d_head = {d_head}, scores {scaling}, × {factor:.2f}: mean row entropy "
                 f"{mean_row_entropy(weights[shown]):.2f} nats (uniform: {math.log(seq_len):.2f}), "
                 f"mean largest weight {float(weights[shown].amax(-1).mean()):.2f}")
        plot_attention_heads(figure, weights, tokens, shown, title, axes=map_axes)
        curve_ax = figure.add_subplot(grid[:, columns])
        for mode, style in ((SCALED, "o-"), (RAW, "s--")):
            entropies = [mean_row_entropy(weights_for(d, mode, factor, causal, curve_samples)) for d in d_heads]
            curve_ax.plot(list(d_heads), entropies, style, label=f"scores {mode}")
        current = mean_row_entropy(weights_for(d_head, scaling, factor, causal, curve_samples))
        curve_ax.plot([d_head], [current], "r*", markersize=14, label="current setting")
        curve_ax.set_xscale("log", base=2)
        curve_ax.set_ylim(0, math.log(seq_len) * 1.05)
        curve_ax.set_xlabel("d_head", fontsize=8)
        curve_ax.set_ylabel("mean row entropy (nats)", fontsize=8)
        legend_outside(curve_ax)

    controls = {
        "head": widgets.Dropdown(options=["all"] + [str(h) for h in range(num_heads)], value="all", description="head"),
        "causal": widgets.Checkbox(value=False, description="causal mask"),
        "d_head": widgets.Dropdown(options=list(d_heads), value=d_heads[min(1, len(d_heads) - 1)], description="d_head"),
        "scaling": widgets.Dropdown(options=[SCALED, RAW], value=SCALED, description="scaling"),
        "factor": widgets.FloatLogSlider(value=1.0, base=10, min=-1, max=1, step=0.05, description="× factor",
                                         readout_format=".2f"),
    }
    # At most 10 inches (1000 px): shown at its natural size in a notebook at a laptop's width.
    return LiveFigure(draw, controls, figsize=(min(8.0, 1.6 * math.ceil(num_heads / 2) + 4.2), 5.4))
