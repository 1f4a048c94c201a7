"""Where a ViT's class token attends (notebook 04): pick an image, a block and a head (or rollout).

* :func:`plot_patch_attention` -- pure drawing: an image with a ``[grid, grid]`` attention map
  over its patches, and the map alone with its values.
* :func:`vit_attention_explorer` -- runs a trained ViT once, then redraws on every change of
  the image / block / head controls (a static PNG where no widget frontend runs).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import ipywidgets as widgets
import torch
from matplotlib.figure import Figure

from attention_lab.widgets.live import LiveFigure, wrap_title

MEAN_OF_HEADS = "mean of heads"
ROLLOUT = "rollout (all blocks)"


def _image_for_display(image: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    """[C, H, W] or [H, W] -> an array imshow understands, and its colour map."""
    image = image.detach().to("cpu", torch.float64)
    if image.dim() == 3 and image.shape[0] == 1:
        image = image[0]
    if image.dim() == 3:  # RGB: [C, H, W] -> [H, W, C], scaled to [0, 1]
        image = image.permute(1, 2, 0)
        low, high = image.min(), image.max()
        return (image - low) / (high - low if high > low else 1.0), None
    return image, "gray_r"


def plot_patch_attention(figure: Figure, image: torch.Tensor, attention_grid: torch.Tensor, title: str = "",
                         cmap: str = "inferno") -> None:
    """Draw ``image [C, H, W]`` (or ``[H, W]``) with ``attention_grid [grid, grid]`` over its patches.

    Left: the image, each patch tinted orange in proportion to its weight (opaque at the largest),
    with the patch grid drawn. Right: the weights alone, each written in its patch, on a colour
    scale from 0 to the largest weight.
    """
    shown, image_cmap = _image_for_display(image)
    grid = attention_grid.detach().to("cpu", torch.float64)
    if grid.dim() != 2 or grid.shape[0] != grid.shape[1]:
        raise ValueError(f"attention_grid should be [grid, grid], got {list(grid.shape)}")
    size = grid.shape[0]
    height, width = shown.shape[0], shown.shape[1]
    top = float(grid.max()) if float(grid.max()) > 0 else 1.0
    extent = (0, width, height, 0)

    ax_image, ax_grid = figure.subplots(1, 2)
    ax_image.imshow(shown.numpy(), cmap=image_cmap, extent=extent, interpolation="nearest")
    # Tint: one orange square per patch, opaque in proportion to its weight, so the digit stays
    # visible where attention is low.
    tint = torch.zeros(size, size, 4, dtype=torch.float64)
    tint[..., 0], tint[..., 1], tint[..., 2] = 1.0, 0.35, 0.0
    tint[..., 3] = 0.75 * grid / top
    ax_image.imshow(tint.numpy(), extent=extent, interpolation="nearest")
    for k in range(1, size):
        ax_image.axhline(k * height / size, color="white", linewidth=0.6, alpha=0.7)
        ax_image.axvline(k * width / size, color="white", linewidth=0.6, alpha=0.7)
    ax_image.set_title("image, patches tinted by attention", fontsize=9)
    ax_image.set_xticks([])
    ax_image.set_yticks([])

    heat = ax_grid.imshow(grid.numpy(), cmap=cmap, vmin=0.0, vmax=top, interpolation="nearest")
    if size <= 8:
        for r in range(size):
            for c in range(size):
                value = float(grid[r, c])
                ax_grid.text(c, r, f"{value:.2f}", ha="center", va="center", fontsize=8,
                             color="black" if value > 0.6 * top else "white")
    ax_grid.set_title("weight on each patch", fontsize=9)
    ax_grid.set_xticks(range(size))
    ax_grid.set_yticks(range(size))
    figure.colorbar(heat, ax=ax_grid, shrink=0.8, label="attention")
    if title:
        figure.suptitle(wrap_title(title, 80), fontsize=10)
        figure.subplots_adjust(top=0.78)


def vit_attention_explorer(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor,
                           cls_attention_map: Callable, attention_rollout: Callable,
                           class_names: Sequence[str] | None = None) -> LiveFigure:
    """Explore where ``model``'s class token attends, with *your* ``cls_attention_map`` and ``attention_rollout``.

    ``model(images, return_attention=True)`` must return ``(logits, [one [B, H, S, S] per block])``
    with ``S = grid² + 1`` (token 0 = [CLS]). Controls: ``image`` (index into ``images``),
    ``block`` (0-based), ``head`` (``"head h"``, ``"mean of heads"`` or ``"rollout (all blocks)"``,
    which uses every block: the block control is disabled while it is chosen).
    """
    model.eval()
    parameter = next(model.parameters())
    with torch.no_grad():
        logits, attentions = model(images.to(parameter.device, parameter.dtype), return_attention=True)
    probabilities = logits.softmax(dim=-1).detach().cpu()
    attentions = [weights.detach().cpu() for weights in attentions]
    num_images, num_heads, seq_len = attentions[0].shape[0], attentions[0].shape[1], attentions[0].shape[2]
    grid = math.isqrt(seq_len - 1)
    if grid * grid != seq_len - 1:
        raise ValueError(f"{seq_len} tokens are not a square grid of patches plus one class token")
    # Computed once with the student's functions, so errors show when the explorer is built.
    maps = [cls_attention_map(weights, grid).detach().cpu() for weights in attentions]  # each [B, H, g, g]
    rollout = attention_rollout(attentions).detach().cpu()  # [B, g, g]
    names = list(class_names) if class_names is not None else [str(k) for k in range(probabilities.shape[-1])]

    def draw(figure: Figure, image: int, block: int, head: str) -> None:
        if head == ROLLOUT:
            attention_grid, what = rollout[image], "rollout through all blocks"
        elif head == MEAN_OF_HEADS:
            attention_grid, what = maps[block][image].mean(dim=0), f"block {block + 1}, mean of {num_heads} heads"
        else:
            index = int(head.split()[-1])
            attention_grid, what = maps[block][image, index], f"block {block + 1}, head {index}"
        predicted = int(probabilities[image].argmax())
        title = (f"image {image}: true {names[int(labels[image])]}, predicted {names[predicted]} "
                 f"({float(probabilities[image, predicted]):.0%}) | [CLS] attention, {what}")
        plot_patch_attention(figure, images[image], attention_grid, title)

    controls = {
        "image": widgets.IntSlider(value=0, min=0, max=num_images - 1, description="image"),
        "block": widgets.Dropdown(options=[(f"block {k + 1}", k) for k in range(len(attentions))],
                                  value=len(attentions) - 1, description="block"),
        "head": widgets.Dropdown(options=[MEAN_OF_HEADS] + [f"head {h}" for h in range(num_heads)] + [ROLLOUT],
                                 value=MEAN_OF_HEADS, description="head"),
    }
    # Rollout runs through every block: the block control means nothing then, so it is disabled.
    controls["block"].disabled = controls["head"].value == ROLLOUT
    controls["head"].observe(lambda change: setattr(controls["block"], "disabled", change["new"] == ROLLOUT),
                             names="value")
    return LiveFigure(draw, controls, figsize=(8.5, 3.8))


__all__ = ["plot_patch_attention", "vit_attention_explorer", "MEAN_OF_HEADS", "ROLLOUT"]
