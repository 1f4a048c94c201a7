"""What a trained Transformer's heads look at (notebook 03): one attention map per layer and head.

:func:`attention_maps` runs a model built on the notebook's ``TransformerLayer`` (attributes
``norm1`` and ``attn``, an ``nn.MultiheadAttention``) and returns, for every layer, the weights of
each head, ``[B, H, S, S]``: the layer's own input is caught on its way in (a forward pre-hook),
normalised with ``norm1`` and fed to ``attn`` once more with ``need_weights=True``.
:func:`trained_heads_explorer` shows them for one sequence at a time, with a control for the
model (e.g. "sinusoidal" / "no positions, causal mask"), the layer and the sequence.
The heatmaps are drawn by notebook 01's :func:`~attention_lab.widgets.attention_map.plot_attention_heads`.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import ipywidgets as widgets
import torch
import torch.nn as nn
from matplotlib.figure import Figure

from attention_lab.widgets.attention_map import plot_attention_heads
from attention_lab.widgets.live import LiveFigure

CONTROL_LAYOUT = {"width": "300px"}
CONTROL_STYLE = {"description_width": "90px"}


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The model's Transformer layers, in order: every submodule with ``norm1`` and an ``nn.MultiheadAttention`` ``attn``."""
    layers = [m for m in model.modules()
              if isinstance(getattr(m, "attn", None), nn.MultiheadAttention) and hasattr(m, "norm1")]
    if not layers:
        raise ValueError("the model holds no layer with `norm1` and an nn.MultiheadAttention `attn` "
                         "(the TransformerLayer of exercise 3.9)")
    return layers


def attention_maps(model: nn.Module, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per layer, the attention weights of every head, ``[B, H, S, S]`` (rows: queries), for ``model(tokens, mask)``."""
    layers = attention_layers(model)
    inputs: dict[int, torch.Tensor] = {}

    def catch(index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            # The layer's input, however it was passed: layer(x, mask), layer(x=x), layer(x, mask=mask).
            inputs[index] = args[0] if args else kwargs.get("x", next(iter(kwargs.values()), None))
        return hook

    hooks = [layer.register_forward_pre_hook(catch(index), with_kwargs=True) for index, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            model(tokens, mask)
            maps = []
            for index, layer in enumerate(layers):
                h = layer.norm1(inputs[index])                              # [B, S, D]
                blocked = None if mask is None else ~mask                  # nn.MultiheadAttention: True = blocked
                _, weights = layer.attn(h, h, h, attn_mask=blocked, need_weights=True,
                                        average_attn_weights=False)        # [B, H, S, S]
                maps.append(weights.detach().cpu())
    finally:
        for hook in hooks:
            hook.remove()
    return maps


def heads_figsize(num_heads: int, num_rows: int) -> tuple[float, float]:
    """Inches for ``num_rows`` rows of ``num_heads`` heatmaps (one row per layer shown)."""
    return 2.6 * num_heads + 2.5, 2.6 * num_rows + 0.8


def plot_trained_heads(figure: Figure, maps: Sequence[torch.Tensor], labels: Sequence[str], example: int,
                       layer: str = "all", title: str = "") -> None:
    """One row of heatmaps (one per head) for each layer shown: ``layer`` is "all" or a layer index. The figure
    takes the height of the rows shown (one layer: one row, no blank band below it)."""
    shown = list(range(len(maps))) if layer == "all" else [int(layer)]
    num_heads = maps[0].shape[1]
    figure.set_size_inches(*heads_figsize(num_heads, len(shown)))
    grid = figure.add_gridspec(len(shown), num_heads, left=0.1, right=0.84, bottom=0.12, top=0.88,
                               hspace=0.55, wspace=0.15)
    for row, index in enumerate(shown):
        axes = [figure.add_subplot(grid[row, head]) for head in range(num_heads)]
        plot_attention_heads(figure, maps[index][example], labels, axes=axes)
        for head, ax in enumerate(axes):
            ax.set_title(f"layer {index}, head {head}", fontsize=9)
    if title:
        figure.suptitle(title, fontsize=9)


def trained_heads_explorer(models: Mapping[str, nn.Module], tokens: torch.Tensor,
                           masks: Mapping[str, torch.Tensor | None] | None = None) -> LiveFigure:
    """Explore the heads of trained models on ``tokens [N, S]`` (long): model, layer and sequence controls.

    ``masks`` gives the mask each model was trained with (default: none). The axis labels are the
    tokens of the sequence shown, with their positions ("3:11" is token 11 at position 3).
    """
    masks = dict(masks or {})
    cache = {name: attention_maps(model, tokens.to(next(model.parameters()).device),
                                  None if masks.get(name) is None else masks[name])
             for name, model in models.items()}
    num_layers = len(next(iter(cache.values())))

    def draw(figure: Figure, model: str, layer: str, example: int) -> None:
        row = tokens[int(example)].tolist()
        labels = [f"{position}:{token}" for position, token in enumerate(row)]
        plot_trained_heads(figure, cache[model], labels, int(example), layer,
                           title=f"{model}: sequence {int(example)} (labels position:token)")

    controls = {
        "model": widgets.Dropdown(options=list(models), value=next(iter(models)), description="model",
                                  layout=CONTROL_LAYOUT, style=CONTROL_STYLE),
        "layer": widgets.Dropdown(options=["all"] + [str(i) for i in range(num_layers)], value="all",
                                  description="layer", layout=CONTROL_LAYOUT, style=CONTROL_STYLE),
        "example": widgets.IntSlider(value=0, min=0, max=tokens.shape[0] - 1, description="sequence",
                                     continuous_update=False, layout=CONTROL_LAYOUT, style=CONTROL_STYLE),
    }
    num_heads = next(iter(cache.values()))[0].shape[1]
    return LiveFigure(draw, controls, figsize=heads_figsize(num_heads, num_layers))
