"""Scores next to weights (notebook 02): pick (b, h), drag the scale, watch the softmax sharpen.

``plot_scores_and_weights`` is the pure drawing function; ``scores_explorer`` wraps it in a
:class:`~attention_lab.widgets.live.LiveFigure` with a batch and a head selector and a scale
slider. Everything is NumPy: the inputs are the notebook's ``Q, K`` arrays of shape
``(B, H, S, d_head)``, and the softmax can be the student's own ``np_softmax``.
"""

from __future__ import annotations

import math
from typing import Callable

import ipywidgets as widgets
import numpy as np
from matplotlib.figure import Figure

from attention_lab.widgets.live import LiveFigure


def stable_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Softmax that subtracts each row's max (used when no softmax is passed in)."""
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _annotate(ax, matrix: np.ndarray, fmt: str, dark: Callable[[float], bool]) -> None:
    """Write each value in its cell (only for small matrices, where it stays readable)."""
    rows, columns = matrix.shape
    if rows > 8 or columns > 8:
        return
    for i in range(rows):
        for j in range(columns):
            value = float(matrix[i, j])
            ax.text(j, i, format(value, fmt), ha="center", va="center", fontsize=7,
                    color="white" if dark(value) else "black")


def plot_scores_and_weights(figure: Figure, scores: np.ndarray, weights: np.ndarray, title: str = "") -> None:
    """Draw ``scores (S_q, S_k)`` (scaled, before the softmax) next to ``weights (S_q, S_k)``.

    Left: the scaled scores on a diverging colour scale centred at 0. Right: the weights on a
    fixed [0, 1] scale, so a sharper softmax shows as brighter single cells.
    """
    scores = np.asarray(scores, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    score_ax, weight_ax = figure.subplots(1, 2)
    limit = float(np.max(np.abs(scores[np.isfinite(scores)]), initial=1e-12))
    score_image = score_ax.imshow(scores, cmap="RdBu_r", vmin=-limit, vmax=limit)
    score_ax.set_title("scaled scores  scale · Q Kᵀ")
    _annotate(score_ax, scores, ".1f", dark=lambda value: abs(value) > 0.6 * limit)
    weight_image = weight_ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0)
    weight_ax.set_title("weights  softmax(rows)")
    _annotate(weight_ax, weights, ".2f", dark=lambda value: value < 0.6)
    for ax in (score_ax, weight_ax):
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        ax.set_xticks(range(scores.shape[1]))
        ax.set_yticks(range(scores.shape[0]))
    figure.colorbar(score_image, ax=score_ax, shrink=0.8)
    figure.colorbar(weight_image, ax=weight_ax, shrink=0.8)
    if title:
        figure.suptitle(title, fontsize=10)


def scores_explorer(Q: np.ndarray, K: np.ndarray, softmax: Callable | None = None) -> LiveFigure:
    """Explore the attention scores and weights of ``Q, K (B, H, S, d_head)`` one (b, h) at a time.

    ``softmax(x, axis=-1)`` turns the scaled scores into weights; pass your ``np_softmax``
    to see your own function at work (default: a stable reference softmax). The scale
    slider multiplies ``Q Kᵀ``: at ``1/sqrt(d_head)`` you see the real model; larger scales
    saturate every row into one-hot weights, smaller ones flatten them towards uniform.
    """
    Q = np.asarray(Q)
    K = np.asarray(K)
    if Q.ndim != 4 or K.ndim != 4:
        raise ValueError(f"Q and K should have shape (B, H, S, d_head), got {Q.shape} and {K.shape}")
    softmax = softmax or stable_softmax
    batch, num_heads, seq_len, d_head = Q.shape
    default = 1.0 / math.sqrt(d_head)
    raw_scores = Q @ np.swapaxes(K, -1, -2)  # (B, H, S_q, S_k), computed once

    def draw(figure: Figure, b: int, h: int, scale: float) -> None:
        scores = scale * raw_scores[b, h]
        weights = softmax(scores, axis=-1)
        peak = float(np.mean(np.max(weights, axis=-1)))
        title = (f"b = {b}, h = {h}, scale = {scale:.3f} (1/sqrt(d_head) = {default:.3f}): "
                 f"mean max weight {peak:.2f} (uniform: {1 / raw_scores.shape[-1]:.2f}, one-hot: 1)")
        plot_scores_and_weights(figure, scores, weights, title)

    controls = {
        "b": widgets.Dropdown(options=list(range(batch)), value=0, description="batch b"),
        "h": widgets.Dropdown(options=list(range(num_heads)), value=0, description="head h"),
        "scale": widgets.FloatLogSlider(value=default, base=10, min=-2, max=1.5, step=0.05, description="scale",
                                        readout_format=".3f"),
    }
    return LiveFigure(draw, controls, figsize=(10.0, 4.2))
