"""The spread of the scores and what it does to the softmax (notebook 02, after exercise 2.4).

``variance_explorer`` varies ``d_head``, the entries' standard deviation σ and the scaling,
and shows two things side by side:

* left: a histogram of the scores q·k (raw, or divided by sqrt(d_head)) for independent
  N(0, σ²) entries, with the student's own ``dot_product_variance`` measurement and the
  prediction d·σ⁴ (scaled: σ⁴);
* right: the softmax weights of one query over 16 keys, sorted, averaged over many queries:
  flat when the scores are narrow, one-hot when they are wide.

Dividing by sqrt(d_head) keeps the left panel's width fixed as d_head grows -- but only at
σ = 1 is that width 1; at σ = 2 the scaled scores still have variance 16.
"""

from __future__ import annotations

import math
from typing import Callable

import ipywidgets as widgets
import numpy as np
import torch
from matplotlib.figure import Figure

from attention_lab.widgets.live import LiveFigure, legend_outside, wrap_title

SCALED = "÷ sqrt(d_head)"
RAW = "none (raw q·k)"
NUM_KEYS = 16


def plot_score_spread(figure: Figure, scores: np.ndarray, sorted_weights: np.ndarray, predicted_variance: float,
                      title: str = "") -> None:
    """Left: histogram of ``scores`` with the normal density of ``predicted_variance``.
    Right: ``sorted_weights (num_keys,)``, the mean softmax weight of the largest, second largest, ... key.
    """
    hist_ax, weight_ax = figure.subplots(1, 2, gridspec_kw=dict(left=0.07, right=0.98, bottom=0.14, top=0.84,
                                                                 wspace=0.22))
    spread = max(4.0 * math.sqrt(predicted_variance), float(np.abs(scores).max(initial=1e-9)))
    hist_ax.hist(scores, bins=60, range=(-spread, spread), density=True, color="tab:blue", alpha=0.6,
                 label="sampled scores")
    grid = np.linspace(-spread, spread, 400)
    density = np.exp(-grid ** 2 / (2 * predicted_variance)) / math.sqrt(2 * math.pi * predicted_variance)
    hist_ax.plot(grid, density, color="black", label=f"normal, variance {predicted_variance:.3g}")
    hist_ax.set_xlabel("score")
    hist_ax.set_ylabel("density")
    legend_outside(hist_ax, ncol=2)
    ranks = np.arange(1, len(sorted_weights) + 1)
    weight_ax.bar(ranks, sorted_weights, color="tab:orange")
    weight_ax.axhline(1 / len(sorted_weights), color="gray", linestyle=":", label="uniform")
    weight_ax.set_ylim(0, 1)
    weight_ax.set_xlabel("key, by rank of its weight")
    weight_ax.set_ylabel("mean softmax weight")
    legend_outside(weight_ax)
    if title:
        figure.suptitle(wrap_title(title), fontsize=10)


def variance_explorer(dot_product_variance: Callable, *, d_heads=(1, 4, 16, 64, 256, 1024),
                      num_samples: int = 4000, seed: int = 0) -> LiveFigure:
    """Explore the scores' variance d·σ⁴ and the softmax it produces; your ``dot_product_variance``
    (exercise 2.4) measures the variance shown in the title.
    """

    def draw(figure: Figure, d_head: int, sigma: float, scaling: str) -> None:
        rng = np.random.default_rng(seed)
        factor = 1 / math.sqrt(d_head) if scaling == SCALED else 1.0
        q = rng.normal(0.0, sigma, size=(num_samples, d_head))
        k = rng.normal(0.0, sigma, size=(num_samples, d_head))
        scores = factor * np.sum(q * k, axis=-1)  # (num_samples,)
        # One query against NUM_KEYS keys per row: num_samples // NUM_KEYS softmax rows.
        rows = torch.from_numpy(scores[: num_samples // NUM_KEYS * NUM_KEYS].reshape(-1, NUM_KEYS))
        sorted_weights = torch.softmax(rows, dim=-1).sort(dim=-1, descending=True).values.mean(0).numpy()
        measured = factor ** 2 * float(dot_product_variance(d_head, sigma, num_samples, np.random.default_rng(seed)))
        predicted = factor ** 2 * d_head * sigma ** 4
        title = (f"d_head = {d_head}, σ = {sigma:g}, scores {scaling}: variance measured by your "
                 f"dot_product_variance {measured:.3g}, predicted {'σ⁴' if scaling == SCALED else 'd·σ⁴'} = "
                 f"{predicted:.3g}; largest weight {sorted_weights[0]:.2f} on average")
        plot_score_spread(figure, scores, sorted_weights, predicted, title)

    controls = {
        "d_head": widgets.Dropdown(options=list(d_heads), value=d_heads[min(3, len(d_heads) - 1)], description="d_head"),
        "sigma": widgets.FloatSlider(value=1.0, min=0.25, max=3.0, step=0.25, description="σ"),
        "scaling": widgets.Dropdown(options=[SCALED, RAW], value=SCALED, description="scaling"),
    }
    return LiveFigure(draw, controls, figsize=(9.5, 4.0))
