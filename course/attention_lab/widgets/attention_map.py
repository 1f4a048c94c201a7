"""Per-head attention heatmaps (notebook 01): head selector, causal mask, scale slider."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import ipywidgets as widgets
import torch
from matplotlib.figure import Figure

from attention_lab.widgets.live import LiveFigure


def plot_attention_heads(figure: Figure, weights: torch.Tensor, tokens: Sequence[str],
                         heads: Sequence[int] | None = None, title: str = "") -> None:
    """Draw one heatmap per head of ``weights [H, S_q, S_k]`` (rows: queries, columns: keys)."""
    weights = weights.detach().to("cpu", torch.float64)
    heads = list(range(weights.shape[0])) if heads is None else list(heads)
    axes = figure.subplots(1, len(heads), squeeze=False)[0]
    for ax, head in zip(axes, heads):
        image = ax.imshow(weights[head].numpy(), vmin=0.0, vmax=1.0, cmap="viridis")
        ax.set_title(f"head {head}")
        ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=8)
        ax.set_yticks(range(len(tokens)), tokens, fontsize=8)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
    figure.colorbar(image, ax=list(axes), shrink=0.8, label="weight")
    if title:
        figure.suptitle(title)


def _entropy(weights: torch.Tensor) -> float:
    """Mean entropy of the rows in nats: log(S) is uniform attention, 0 is one-hot."""
    p = weights.clamp_min(1e-12)
    return float(-(weights * p.log()).sum(-1).mean())


def attention_explorer(attention_weights: Callable, q: torch.Tensor, k: torch.Tensor,
                       tokens: Sequence[str]) -> LiveFigure:
    """Explore ``attention_weights(q, k, mask)`` (yours) on ``q, k [H, S, d_head]``.

    The scale slider multiplies the scores by ``scale * sqrt(d_head)`` before your
    function divides by ``sqrt(d_head)``: at 1/sqrt(d_head) you see the real model; at
    larger scales the softmax saturates into one-hot rows (vanishing gradients).
    """
    num_heads, seq_len, d_head = q.shape
    default = 1.0 / math.sqrt(d_head)

    def draw(figure: Figure, head: str, causal: bool, scale: float) -> None:
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril() if causal else None
        weights = attention_weights(q * (scale * math.sqrt(d_head)), k, mask)
        shown = range(num_heads) if head == "all" else [int(head)]
        title = (f"scale = {scale:.3f}  (1/sqrt(d_head) = {default:.3f});  "
                 f"mean row entropy {_entropy(weights[list(shown)]):.2f} nats (uniform: {math.log(seq_len):.2f})")
        plot_attention_heads(figure, weights, tokens, shown, title)

    controls = {
        "head": widgets.Dropdown(options=["all"] + [str(h) for h in range(num_heads)], value="all", description="head"),
        "causal": widgets.Checkbox(value=False, description="causal mask"),
        "scale": widgets.FloatLogSlider(value=default, base=10, min=-2, max=1, step=0.05, description="scale",
                                        readout_format=".3f"),
    }
    return LiveFigure(draw, controls, figsize=(3.2 * num_heads + 1.5, 3.6))
