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


TOKENS = ["a", "b", "c", "d", "e"]


@pytest.fixture
def explorer():
    calls = []

    def recording_weights(q, k, mask=None):
        calls.append((q.clone(), k.clone(), mask))
        return reference_weights(q, k, mask)

    return attention_explorer(recording_weights, TOKENS, num_heads=3, d_heads=(4, 16, 256)), calls


def heatmaps(figure):
    return [ax for ax in figure.axes if ax.images and ax.get_title().startswith("head")]


def entropy_axes(figure):
    return next(ax for ax in figure.axes if ax.get_xlabel() == "d_head")


def test_explorer_draws_one_heatmap_per_head_with_the_student_weights(explorer):
    widget, calls = explorer
    maps = heatmaps(widget.figure)
    assert [ax.get_title() for ax in maps] == ["head 0", "head 1", "head 2"]
    q, k, mask = calls[0]  # the heads shown come first
    assert q.shape == (3, 5, 16) and mask is None
    np.testing.assert_allclose(maps[1].images[0].get_array(), reference_weights(q, k)[1].numpy(), rtol=1e-6)


def test_only_the_maps_of_the_first_column_carry_the_query_labels(explorer):
    widget, _calls = explorer
    maps = heatmaps(widget.figure)  # 3 heads: two rows, heads 0 and 2 in the first column
    for ax in (maps[0], maps[2]):
        assert ax.get_ylabel() == "query"
        assert [label.get_text() for label in ax.get_yticklabels()] == TOKENS
    assert maps[1].get_ylabel() == "" and all(label.get_text() == "" for label in maps[1].get_yticklabels())


def test_controls_are_wide_enough_to_use_and_fully_labelled(explorer):
    from attention_lab.widgets.live import CONTROL_MIN_WIDTH_PX

    widget, _calls = explorer
    row = widget.widget.children[0]
    assert row.layout.flex_flow == "row wrap"  # a narrow notebook wraps the controls, never squeezes them
    for control in widget.controls.values():
        assert int(control.layout.min_width.rstrip("px")) >= CONTROL_MIN_WIDTH_PX, control
        assert control.layout.flex == "0 0 auto", control
        assert control.style.description_width == "initial", control
    assert widget.widget.children[1].layout.max_width == "100%"  # shrinks to the notebook, never upscaled


def test_head_selector_shows_a_single_head(explorer):
    widget, calls = explorer
    widget.controls["head"].value = "2"
    maps = heatmaps(widget.figure)
    assert [ax.get_title() for ax in maps] == ["head 2"]
    q, k, _mask = calls[-1 - 2 * 3 - 1]  # the heads shown, before the two curves of 3 widths and the marker
    np.testing.assert_allclose(maps[0].images[0].get_array(), reference_weights(q, k)[2].numpy(), rtol=1e-6)


def test_causal_toggle_zeroes_the_upper_triangle(explorer):
    widget, _calls = explorer
    widget.controls["causal"].value = True
    drawn = np.asarray(heatmaps(widget.figure)[0].images[0].get_array())
    assert np.all(np.triu(drawn, 1) == 0) and np.allclose(drawn.sum(-1), 1.0)


def test_factor_slider_sharpens_the_softmax(explorer):
    widget, _calls = explorer
    soft = np.asarray(heatmaps(widget.figure)[0].images[0].get_array()).max(-1).mean()
    widget.controls["factor"].value = 10.0
    sharp = np.asarray(heatmaps(widget.figure)[0].images[0].get_array()).max(-1).mean()
    assert sharp > soft + 0.2
    assert "× 10.00" in widget.figure._suptitle.get_text()


def test_without_scaling_the_entropy_falls_as_d_head_grows(explorer):
    widget, calls = explorer
    scaled, raw = (line.get_ydata() for line in entropy_axes(widget.figure).lines[:2])
    assert raw[0] > raw[-1] + 0.5  # raw q·k: ever more peaked rows as d_head grows
    assert abs(scaled[0] - scaled[-1]) < 0.3  # divided by sqrt(d_head): about constant
    widget.controls["scaling"].value = "none (raw q·k)"
    widget.controls["d_head"].value = 256
    q, _k, _mask = calls[-1]
    assert q.shape[-1] == 256
    marker = entropy_axes(widget.figure).lines[2]
    assert list(marker.get_xdata()) == [256] and abs(marker.get_ydata()[0] - raw[-1]) < 1e-9


def test_display_offers_the_live_widget_and_a_static_png(explorer):
    widget, _calls = explorer
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
    assert live.controls["level"].continuous_update is False  # one redraw on release, not one per step
    live.controls["level"].value = 4
    assert calls == [1, 4]
    assert len(live.figure.axes) == 1  # cleared before each redraw
    assert list(live.figure.axes[0].lines[0].get_ydata()) == [0, 4]


def test_the_numbers_notebook_01_quotes_from_the_explorer():
    """01's text quotes the explorer's mean largest weight; keep the sentences true."""
    import re

    widget = attention_explorer(reference_weights, ["the", "cat", "sat", "on", "the", "mat"])

    def largest_weight(**settings):
        for name, value in settings.items():
            widget.controls[name].value = value
        return float(re.search(r"mean largest weight ([0-9.]+)", " ".join(widget.figure._suptitle.get_text().split())).group(1))

    scaled = [largest_weight(d_head=d) for d in (4, 64, 1024)]
    assert all(0.35 <= value <= 0.45 for value in scaled), scaled  # "about 0.4 for every d_head"
    assert largest_weight(factor=10.0) == pytest.approx(0.9, abs=0.06)  # "at 10× ... about 0.9"
    widget.controls["factor"].value = 1.0
    raw = [largest_weight(scaling="none (raw q·k)", d_head=d) for d in (4, 64, 256)]
    assert raw[0] == pytest.approx(0.55, abs=0.03) and raw[1] == pytest.approx(0.88, abs=0.03) and raw[2] > 0.95, raw


@pytest.mark.parametrize("ipywidgets_version, live", [("7.7.1", True), ("8.1.9", False)])
def test_on_colab_a_widget_is_live_with_colabs_ipywidgets_and_a_picture_alone_with_ipywidgets_8(
        explorer, monkeypatch, ipywidgets_version, live):
    """Colab's page draws the widgets of ipywidgets 7 (what its runtimes ship) and not those of ipywidgets 8
    (googlecolab/colabtools#3020, #4525): there, a widget offers its picture alone, and setup says why."""
    import sys
    import types

    from attention_lab import frontend

    widget, _calls = explorer
    assert frontend.fallback_note() is None and "application/vnd.jupyter.widget-view+json" in widget._repr_mimebundle_()
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(frontend, "installed_version", lambda name: ipywidgets_version)
    bundle = widget._repr_mimebundle_()
    assert base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")
    assert ("application/vnd.jupyter.widget-view+json" in bundle) is live
    note = frontend.fallback_note()
    assert (note is None) is live
    if not live:
        assert "ipywidgets 8.1.9" in note and "picture" in note and "Disconnect and delete runtime" in note


PROGRESS_NOTEBOOK = [
    "import attention_lab\ndevice = attention_lab.setup()",
    "from tqdm.auto import tqdm, trange\nfor _ in tqdm(range(5), desc='kept'):\n    pass",
    "for _ in trange(7, desc='gone', leave=False):\n    pass",
    "bar = tqdm(total=4, desc='stopped')\nbar.update(2)\nbar.close()",
    # a Colab runtime with ipywidgets 8, whose page draws no widget of it: text bars, pictures, and a note
    "import sys, types\nsys.modules['google.colab'] = types.ModuleType('google.colab')\ndevice = attention_lab.setup()\n"
    "import tqdm.auto\nprint(tqdm.auto.tqdm.__module__)",
    "from attention_lab.widgets import attention_explorer\n"
    "attention_explorer(lambda q, k, mask=None: (q @ k.transpose(-2, -1)).softmax(-1), list('abc'), num_heads=2)",
]


def test_progress_bars_leave_their_last_text_where_no_widget_is_drawn(tmp_path):
    """tqdm's notebook bar (tqdm.auto, in a kernel) keeps its output's text current: at the end, a page
    without widgets shows the bar's last state (or nothing, for a bar not to be left), never "0%" forever."""
    import nbformat

    from autograder.grading.execute import execute_notebook

    path = tmp_path / "progress.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in PROGRESS_NOTEBOOK]), path)
    result = execute_notebook(path)
    assert not result.errors, result.summary()
    cells = result.notebook.cells
    kept, gone, stopped = (cell.outputs[-1].data for cell in cells[1:4])
    assert kept["text/plain"].startswith("kept: 100%|██████████| 5/5") and "application/vnd.jupyter.widget-view+json" in kept
    assert gone == {"text/plain": ""}
    assert stopped["text/plain"].startswith("stopped:  50%|█████     | 2/4")
    # on Colab, ipywidgets 8 (this environment's pin) is drawn by no page; ipywidgets 7 (Colab's own) is
    from attention_lab.frontend import installed_version, major_version

    live = major_version(installed_version("ipywidgets")) < 8
    colab = "".join(output.get("text", "") for output in cells[4].outputs)
    assert ("Colab's page does not draw" in colab) is not live
    assert colab.rstrip().endswith("attention_lab.progress" if live else "tqdm.asyncio")
    (shown,) = [output.data for output in cells[5].outputs if "data" in output]
    assert "image/png" in shown and ("application/vnd.jupyter.widget-view+json" in shown) is live
