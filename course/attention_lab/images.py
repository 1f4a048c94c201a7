"""Images the course draws itself (no downloads): the "rose" that notebook 03's coordinate MLP fits.

    image = draw_rose(64)                       # [64, 64, 3] float32 in [0, 1]
    coords, colors = image_dataset(image)       # [4096, 2] in [0, 1], [4096, 3]

The rose is drawn with NumPy from a few closed-form curves: layers of five-lobed petals
(rose curves, r = |cos(2.5 θ)|), each outlined by a thin dark edge, a spiral at the heart, a
stem and a leaf with a midrib. The thin edges and the spiral are the *fine detail*: a plain
MLP on raw (x, y) coordinates blurs them away, while Fourier features of the coordinates let
the same MLP reproduce them.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["draw_rose", "image_dataset", "pixel_coordinates"]

_BACKGROUND_TOP = np.array([0.97, 0.94, 0.86])
_BACKGROUND_BOTTOM = np.array([0.84, 0.90, 0.80])
_PETAL_OUTER = np.array([0.95, 0.35, 0.45])
_PETAL_INNER = np.array([0.55, 0.02, 0.12])
_EDGE = np.array([0.30, 0.00, 0.06])
_STEM = np.array([0.20, 0.50, 0.18])
_LEAF = np.array([0.35, 0.68, 0.25])
_MIDRIB = np.array([0.12, 0.32, 0.10])


def _paint(canvas: np.ndarray, where: np.ndarray, color: np.ndarray) -> None:
    canvas[where] = color


def _draw_supersampled(size: int) -> np.ndarray:
    """The rose on a [size, size] grid of points u (right), v (down) in [-1, 1]."""
    axis = (np.arange(size) + 0.5) / size * 2.0 - 1.0
    v, u = np.meshgrid(axis, axis, indexing="ij")  # [size, size] each
    canvas = np.empty((size, size, 3))
    # Background: a soft vertical gradient.
    t = ((v + 1.0) / 2.0)[..., None]
    canvas[:] = (1 - t) * _BACKGROUND_TOP + t * _BACKGROUND_BOTTOM

    # Stem: a gently curving band from the flower down to the bottom edge.
    stem_center = 0.04 * np.sin(3.0 * v)
    _paint(canvas, (np.abs(u - stem_center) < 0.035) & (v > 0.0), _STEM)
    # Leaf: a rotated ellipse on the stem, with a darker midrib.
    angle = -0.6
    lu, lv = u - 0.25, v - 0.62
    along = np.cos(angle) * lu + np.sin(angle) * lv
    across = -np.sin(angle) * lu + np.cos(angle) * lv
    leaf = (along / 0.26) ** 2 + (across / 0.10) ** 2 < 1.0
    _paint(canvas, leaf, _LEAF)
    _paint(canvas, leaf & (np.abs(across) < 0.012), _MIDRIB)

    # Flower head: four layers of five-lobed petals, outermost first, each one smaller,
    # darker and rotated; every layer gets a thin dark outline.
    cu, cv = u - 0.0, v + 0.18
    radius = np.hypot(cu, cv)
    theta = np.arctan2(cv, cu)
    num_layers = 4
    for layer in range(num_layers):
        fraction = layer / (num_layers - 1)
        size_of_layer = 0.62 * (1.0 - 0.2 * layer)
        rotation = 0.63 * layer
        boundary = size_of_layer * (0.70 + 0.30 * np.abs(np.cos(2.5 * (theta - rotation))))
        inside = radius < boundary
        shade = np.clip(radius / boundary, 0.0, 1.0)[..., None]  # lighter towards the rim
        color = (1 - fraction) * _PETAL_OUTER + fraction * _PETAL_INNER
        layer_colors = color * (0.75 + 0.25 * shade)
        canvas[inside] = layer_colors[inside]
        _paint(canvas, inside & (boundary - radius < 0.022), _EDGE)

    # The heart: a tight spiral of dark and light stripes.
    heart = radius < 0.16
    stripes = 0.5 + 0.5 * np.sin(2.0 * theta + 60.0 * radius)
    heart_colors = (stripes[..., None] * _PETAL_OUTER * 0.8 + (1 - stripes[..., None]) * _EDGE)
    canvas[heart] = heart_colors[heart]
    return canvas


def draw_rose(size: int = 64, supersample: int = 4) -> np.ndarray:
    """A rose drawn procedurally: ``[size, size, 3]`` float32 RGB in [0, 1] (row 0 is the top).

    ``supersample`` draws the picture ``supersample`` times finer and averages blocks of
    pixels (anti-aliasing), so the thin edges are smooth rather than jagged.
    """
    if size < 8:
        raise ValueError(f"size = {size} is too small to draw a rose (use at least 8)")
    fine = _draw_supersampled(size * supersample)
    image = fine.reshape(size, supersample, size, supersample, 3).mean(axis=(1, 3))
    return np.clip(image, 0.0, 1.0).astype(np.float32)


def pixel_coordinates(height: int, width: int) -> torch.Tensor:
    """The (x, y) coordinates of every pixel, in [0, 1]: ``[height, width, 2]`` (x right, y down)."""
    ys = torch.linspace(0.0, 1.0, height)
    xs = torch.linspace(0.0, 1.0, width)
    grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack([grid_x, grid_y], dim=-1)


def image_dataset(image: np.ndarray, device: torch.device | str | None = None,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A picture as a regression data set: ``coords [H*W, 2]`` in [0, 1] and ``colors [H*W, 3]``.

    Pixel ``(row, col)`` becomes the pair ``(x, y) = (col / (W-1), row / (H-1))`` and its RGB
    colour; reshape a prediction ``[H*W, 3]`` to ``[H, W, 3]`` to see it as a picture again.
    """
    height, width, channels = image.shape
    coords = pixel_coordinates(height, width).reshape(-1, 2)
    colors = torch.as_tensor(np.asarray(image), dtype=torch.float64).reshape(-1, channels)
    return coords.to(device=device, dtype=dtype), colors.to(device=device, dtype=dtype)
