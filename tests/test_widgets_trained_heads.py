"""The trained-heads explorer of notebook 03 draws the attention maps of the model, layer and sequence
its controls select (set `.value`, then read what was drawn)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn as nn

from attention_lab.checks import positions_and_blocks as checks
from attention_lab.widgets.trained_heads import attention_layers, attention_maps, trained_heads_explorer
from tests.test_checks_positions_and_blocks import OrderNanoGPT


def _model(positions, seed):
    torch.manual_seed(seed)
    return OrderNanoGPT(16, 16, 2, 2, 8, positions=positions).eval()


def _manual_maps(model, tokens, mask):
    """The attention weights of every layer recomputed by running the layers by hand."""
    stack = model.parts["h"]
    x = model.parts["wte"](tokens)
    if model.kind == "sinusoidal":
        x = x + checks._sinusoidal_table(tokens.shape[1], 16, 10000.0).float()
    maps = []
    with torch.no_grad():
        for layer in stack.layers:
            h = layer.norm1(x)
            maps.append(layer.attn(h, h, h, attn_mask=None if mask is None else ~mask,
                                   average_attn_weights=False)[1])
            x = layer(x, mask)
    return maps


def test_attention_maps_are_the_weights_of_every_layer_and_head():
    model = _model("sinusoidal", 0)
    tokens, _ = checks.previous_token_batch(3, torch.Generator().manual_seed(1))
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    for mask in (None, causal):
        maps = attention_maps(model, tokens, mask)
        assert [tuple(m.shape) for m in maps] == [(3, 2, 8, 8)] * 2
        for got, want in zip(maps, _manual_maps(model, tokens, mask)):
            torch.testing.assert_close(got, want)
    assert torch.allclose(attention_maps(model, tokens, causal)[0].triu(1), torch.zeros(1))  # nothing above
    assert len(model._forward_pre_hooks) == 0 and all(not l._forward_pre_hooks for l in attention_layers(model))


def test_attention_layers_needs_the_notebooks_layers():
    with pytest.raises(ValueError, match="TransformerLayer of exercise 3.9"):
        attention_layers(nn.Sequential(nn.Linear(2, 2)))


def test_explorer_draws_what_its_controls_select():
    models = {"sinusoidal": _model("sinusoidal", 0), "no positions, causal": _model("none", 1)}
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    tokens, _ = checks.previous_token_batch(5, torch.Generator().manual_seed(2))
    widget = trained_heads_explorer(models, tokens, {"no positions, causal": causal})
    expected = {name: attention_maps(model, tokens, causal if "causal" in name else None)
                for name, model in models.items()}

    def drawn():
        maps = [ax for ax in widget.figure.axes if ax.images and ax.get_title().startswith("layer")]
        return {ax.get_title(): np.asarray(ax.images[0].get_array()) for ax in maps}, maps

    pictures, axes = drawn()
    assert sorted(pictures) == ["layer 0, head 0", "layer 0, head 1", "layer 1, head 0", "layer 1, head 1"]
    np.testing.assert_allclose(pictures["layer 1, head 0"], expected["sinusoidal"][1][0, 0].numpy(), rtol=1e-6)
    # The axis labels are position:token of the sequence shown.
    assert [t.get_text() for t in axes[0].get_xticklabels()] == [f"{p}:{t}" for p, t in enumerate(tokens[0].tolist())]

    widget.controls["example"].value = 4
    pictures, axes = drawn()
    np.testing.assert_allclose(pictures["layer 0, head 1"], expected["sinusoidal"][0][4, 1].numpy(), rtol=1e-6)
    assert [t.get_text() for t in axes[0].get_xticklabels()][1] == f"1:{tokens[4, 1].item()}"

    widget.controls["model"].value = "no positions, causal"
    pictures, _ = drawn()
    np.testing.assert_allclose(pictures["layer 1, head 1"], expected["no positions, causal"][1][4, 1].numpy(),
                               rtol=1e-6)
    assert np.allclose(np.triu(pictures["layer 1, head 1"], 1), 0.0)  # the causal mask was applied
    assert "no positions, causal: sequence 4" in widget.figure._suptitle.get_text()

    from PIL import Image

    def shown_height() -> int:  # pixels of the picture the widget shows
        return Image.open(io.BytesIO(widget._image.value)).height

    two_rows, two_rows_shown = widget.figure.get_figheight(), shown_height()
    widget.controls["layer"].value = "1"
    pictures, _ = drawn()
    assert sorted(pictures) == ["layer 1, head 0", "layer 1, head 1"]
    # One layer, one row: the figure is one row high, not two rows with a blank band (issue #34), and the
    # picture shown is that figure.
    one_row = widget.figure.get_figheight()
    assert one_row == pytest.approx(two_rows - 2.6), (one_row, two_rows)
    assert shown_height() < 0.7 * two_rows_shown, (shown_height(), two_rows_shown)
    widget.controls["layer"].value = "all"
    assert widget.figure.get_figheight() == pytest.approx(two_rows)

    # Controls are wide enough to use and labelled; the slider redraws on release only.
    for name, control in widget.controls.items():
        assert int(control.layout.width.rstrip("px")) >= 200 and control.description
    assert widget.controls["example"].continuous_update is False
    assert widget._repr_mimebundle_()["image/png"]


def test_attention_maps_catch_layers_called_by_keyword():
    """timm-style stacks call layer(x=x, mask=mask): the maps are the same as for positional calls."""
    model = _model("none", 3)
    stack = model.parts["h"]

    class KeywordStack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers, self.norm = stack.layers, stack.norm

        def forward(self, x, mask=None):
            for layer in self.layers:
                x = layer(x=x, mask=mask)
            return self.norm(x)

    tokens, _ = checks.previous_token_batch(2, torch.Generator().manual_seed(4))
    expected = attention_maps(model, tokens)
    model.parts["h"] = KeywordStack()
    for got, want in zip(attention_maps(model, tokens), expected):
        torch.testing.assert_close(got, want)
