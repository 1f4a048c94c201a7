"""The shared LiveFigure wrapper and notebook 01's attention explorer."""

from __future__ import annotations

import base64
import math

import numpy as np
import pytest
import torch

from attention_lab.widgets import LiveFigure, attention_explorer


def reference_weights(q, k, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1)


@pytest.fixture
def explorer():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(3, 5, 16, generator=generator)
    k = torch.randn(3, 5, 16, generator=generator)
    return attention_explorer(reference_weights, q, k, ["a", "b", "c", "d", "e"]), q, k


def heatmaps(figure):
    return [ax for ax in figure.axes if ax.images and ax.get_title().startswith("head")]


def test_explorer_draws_one_heatmap_per_head_with_the_student_weights(explorer):
    widget, q, k = explorer
    maps = heatmaps(widget.figure)
    assert [ax.get_title() for ax in maps] == ["head 0", "head 1", "head 2"]
    np.testing.assert_allclose(maps[1].images[0].get_array(), reference_weights(q, k)[1].numpy(), rtol=1e-6)


def test_head_selector_shows_a_single_head(explorer):
    widget, q, k = explorer
    widget.controls["head"].value = "2"
    maps = heatmaps(widget.figure)
    assert [ax.get_title() for ax in maps] == ["head 2"]
    np.testing.assert_allclose(maps[0].images[0].get_array(), reference_weights(q, k)[2].numpy(), rtol=1e-6)


def test_causal_toggle_zeroes_the_upper_triangle(explorer):
    widget, _q, _k = explorer
    widget.controls["causal"].value = True
    drawn = np.asarray(heatmaps(widget.figure)[0].images[0].get_array())
    assert np.all(np.triu(drawn, 1) == 0) and np.allclose(drawn.sum(-1), 1.0)


def test_scale_slider_sharpens_the_softmax(explorer):
    widget, _q, _k = explorer
    soft = np.asarray(heatmaps(widget.figure)[0].images[0].get_array()).max(-1).mean()
    widget.controls["scale"].value = 10 * widget.controls["scale"].value
    sharp = np.asarray(heatmaps(widget.figure)[0].images[0].get_array()).max(-1).mean()
    assert sharp > soft + 0.2
    assert "scale = 2.500" in widget.figure._suptitle.get_text()


def test_display_offers_the_live_widget_and_a_static_png(explorer):
    widget, _q, _k = explorer
    bundle = widget._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    png = base64.b64decode(bundle["image/png"])
    assert png.startswith(b"\x89PNG")
    before = bundle["image/png"]
    widget.controls["causal"].value = True
    assert widget._repr_mimebundle_()["image/png"] != before  # the fallback follows the controls


def test_live_figure_redraws_on_every_control_change():
    import ipywidgets

    calls = []

    def draw(figure, level):
        calls.append(level)
        figure.add_subplot().plot([0, 1], [0, level])

    live = LiveFigure(draw, {"level": ipywidgets.IntSlider(value=1, min=0, max=5)})
    live.controls["level"].value = 4
    assert calls == [1, 4]
    assert len(live.figure.axes) == 1  # cleared before each redraw
    assert list(live.figure.axes[0].lines[0].get_ydata()) == [0, 4]
