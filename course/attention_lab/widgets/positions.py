"""Position encodings and pictures (notebook 03).

* :func:`plot_positions` / :func:`positions_explorer` -- the sinusoidal table as a heatmap, next to
  the dot product ``PE[p0] · PE[p]`` against ``p`` (it depends only on the offset ``p - p0``);
  sliders for the width, the base and ``p0``.
* :func:`plot_images` / :func:`show_images` -- pictures side by side (the target rose and the
  reconstructions of the coordinate MLPs).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import ipywidgets as widgets
import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from attention_lab.widgets.live import LiveFigure, wrap_title


def plot_positions(figure: Figure, table: torch.Tensor, position: int, title: str = "") -> None:
    """Left: ``table [P, D]`` as a heatmap. Right: ``table[position] · table[p]`` for every ``p``."""
    table = table.detach().to("cpu", torch.float64)
    num_positions, dim = table.shape
    position = int(min(max(position, 0), num_positions - 1))
    heatmap_axes, dot_axes = figure.subplots(1, 2, gridspec_kw={"width_ratios": [1.1, 1.0], "top": 0.78,
                                                                "wspace": 0.3})
    image = heatmap_axes.imshow(table.numpy(), aspect="auto", cmap="RdBu_r", vmin=-1.0, vmax=1.0,
                                interpolation="nearest")
    heatmap_axes.axhline(position, color="black", linewidth=0.8, linestyle="--")
    heatmap_axes.set_xlabel("feature (even: sin, odd: cos)")
    heatmap_axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # features are whole numbers, even at D = 2
    heatmap_axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    heatmap_axes.set_ylabel("position p")
    heatmap_axes.set_title(f"PE  [{num_positions}, {dim}]", fontsize=10)
    figure.colorbar(image, ax=heatmap_axes, shrink=0.8)

    dots = (table @ table[position]).numpy()  # [P]
    positions = np.arange(num_positions)
    dot_axes.plot(positions, dots, color="tab:blue", marker=".", markersize=3)
    dot_axes.axvline(position, color="black", linewidth=0.8, linestyle="--")
    dot_axes.set_xlabel("position p")
    dot_axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    dot_axes.set_ylabel(f"PE[{position}] · PE[p]")
    dot_axes.set_title(f"dot product with position p0 = {position}\n(peak: D/2 = {dim / 2:g})", fontsize=10)
    dot_axes.grid(alpha=0.3)
    if title:
        figure.suptitle(wrap_title(title), fontsize=11)


def positions_explorer(sinusoidal_positions: Callable, num_positions: int = 64, dim: int = 32) -> LiveFigure:
    """Explore ``sinusoidal_positions(num_positions, dim, base)`` (yours): width, base and ``p0`` sliders."""

    def draw(figure: Figure, dim: int, base: float, position: int) -> None:
        table = sinusoidal_positions(num_positions, int(dim), base=float(base))
        plot_positions(figure, table, position, title=f"sinusoidal positions, D = {int(dim)}, base = {base:g}")

    controls = {
        "dim": widgets.IntSlider(value=dim, min=2, max=128, step=2, description="D"),
        "base": widgets.FloatLogSlider(value=10000.0, base=10, min=1, max=5, step=0.25, description="base",
                                       readout_format=".0f"),
        "position": widgets.IntSlider(value=num_positions // 2, min=0, max=num_positions - 1, description="p0"),
    }
    return LiveFigure(draw, controls, figsize=(9.5, 4.0))


def _as_image(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().to("cpu", torch.float32).numpy()
    return np.clip(np.asarray(value, dtype=np.float32), 0.0, 1.0)


def plot_images(figure: Figure, images: Mapping[str, Any]) -> None:
    """One panel per ``[H, W, 3]`` picture (tensor or array, values in [0, 1]), titled by its key."""
    axes = figure.subplots(1, len(images), squeeze=False)[0]
    for ax, (title, image) in zip(axes, images.items()):
        ax.imshow(_as_image(image), interpolation="nearest")
        ax.set_title(title, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])


def show_images(images: Mapping[str, Any], panel_size: float = 3.0) -> LiveFigure:
    """Pictures side by side (a static figure: no controls)."""
    images = dict(images)
    return LiveFigure(lambda figure: plot_images(figure, images), {},
                      figsize=(panel_size * len(images), panel_size + 0.4))
