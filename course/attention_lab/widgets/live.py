"""LiveFigure: controls + a matplotlib figure redrawn on every change, with a static fallback.

Every widget of the course builds its controls and figure the same way, so that each is usable
at a laptop's width (1400 px with JupyterLab's file browser open, or a 1024 x 768 screen):

* :func:`fit_control` -- a control at least ``CONTROL_MIN_WIDTH_PX`` wide, its label in full,
  never squeezed by its neighbours (the row of controls wraps instead);
* the figure is drawn at ``DPI`` and shown at most at its natural size (never upscaled, so
  never soft; scaled down only when the notebook is narrower than the figure);
* :func:`legend_outside` -- a legend below its axes, off the data.
"""

from __future__ import annotations

import base64
import io
import re
from typing import Any, Callable, Mapping

import ipywidgets as widgets
from matplotlib.figure import Figure

from attention_lab.frontend import widget_view, widgets_render_here


DPI = 100
# A slider shorter than this cannot be dragged to a value between its ends.
CONTROL_MIN_WIDTH_PX = 200
CONTROL_WIDTH_PX = 300
SLIDER_WIDTH_PX = 420  # its label and readout included: a track of about 250 px


def figure_png(figure: Figure) -> bytes:
    """The figure as PNG bytes (Agg canvas: no pyplot state, no GUI backend needed)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
    return buffer.getvalue()


def warm_up() -> None:
    """Draw one small figure with text, as every widget's does: loads the fonts and glyphs that a
    process's first picture would otherwise load (grading's kernel server calls it once for all
    its kernels: autograder.isolation.kernel_forkserver)."""
    figure = Figure(figsize=(2, 1))
    axes = figure.add_subplot()
    axes.set_title("warm-up")
    axes.plot([0, 1], [0, 1])
    figure_png(figure)


def fit_control(control: widgets.Widget) -> widgets.Widget:
    """Size ``control`` for a narrow notebook: its description in full, at least
    ``CONTROL_MIN_WIDTH_PX`` wide, never shrunk by the row it sits in; returns it."""
    layout = control.layout
    style = getattr(control, "style", None)
    if style is not None and style.has_trait("description_width"):
        style.description_width = "initial"
    if isinstance(control, widgets.ToggleButtons):
        control.style.button_width = "auto"  # each option's label in full
        layout.width = "auto"
    elif isinstance(control, widgets.Checkbox):
        control.indent = False
        layout.width = "auto"
    elif isinstance(control, (widgets.IntSlider, widgets.FloatSlider, widgets.FloatLogSlider)):
        layout.width = f"{SLIDER_WIDTH_PX}px"
    else:
        layout.width = f"{CONTROL_WIDTH_PX}px"
    layout.min_width = f"{CONTROL_MIN_WIDTH_PX}px"
    layout.flex = "0 0 auto"
    layout.margin = "2px 18px 2px 0px"
    return control


def legend_outside(ax, ncol: int = 1, **kwargs: Any) -> None:
    """The legend of ``ax`` below it, where it covers no data."""
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=ncol, fontsize=8, frameon=False, **kwargs)


def wrap_title(text: str, width: int = 95) -> str:
    """A long title on as many lines as it needs, broken only after ``;``, ``:`` or ``|`` (a
    figure title never runs off the figure, and no phrase such as ``d_head = 16`` is cut)."""
    lines: list[str] = []
    for part in re.split(r"(?<=[;:|])\s+", text):
        if lines and len(lines[-1]) + 1 + len(part) <= width:
            lines[-1] += " " + part
        else:
            lines.append(part)
    return "\n".join(lines)


class LiveFigure:
    """Controls whose values are passed to ``draw(figure, **values)`` on every change.

    * ``controls`` -- name -> ipywidget; setting ``controls[name].value`` redraws. Sliders and
      text boxes report a new value only when released (``continuous_update=False``).
    * ``figure`` -- the matplotlib Figure as last drawn (tests inspect its axes).
    * Displayed, it offers the live widget *and* a PNG of the figure: JupyterLab and Colab
      render the widget; renderers without a widget manager fall back to the PNG. Where the page
      is known not to draw the widget (:func:`~attention_lab.frontend.widgets_render_here`), it
      offers the PNG alone.
    """

    def __init__(self, draw: Callable[..., None], controls: Mapping[str, widgets.ValueWidget],
                 figsize: tuple[float, float] = (8.0, 4.0)):
        self._draw = draw
        self.controls = dict(controls)
        self.figure = Figure(figsize=figsize)
        # Natural size at most (never upscaled), scaled down to the notebook's width when wider.
        self._image = widgets.Image(format="png", layout=widgets.Layout(width="auto", height="auto",
                                                                        max_width="100%"))
        controls_row = widgets.HBox([fit_control(control) for control in self.controls.values()],
                                    layout=widgets.Layout(flex_flow="row wrap", align_items="center"))
        # flex-start: a column box would otherwise stretch the picture to its width (upscaled, soft).
        self.widget = widgets.VBox([controls_row, self._image], layout=widgets.Layout(align_items="flex-start"))
        for control in self.controls.values():
            # Redraw once, when a slider is released: dragging would otherwise queue one
            # redraw per intermediate value and the figure would lag seconds behind.
            if control.has_trait("continuous_update"):
                control.continuous_update = False
            control.observe(self._on_change, names="value")
        self.redraw()

    @property
    def values(self) -> dict[str, Any]:
        return {name: control.value for name, control in self.controls.items()}

    def redraw(self) -> None:
        self.figure.clear()
        self._draw(self.figure, **self.values)
        self._image.value = figure_png(self.figure)

    def _on_change(self, _change: Mapping[str, Any]) -> None:
        self.redraw()

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        # Notebook JSON carries binary outputs as base64 text.
        bundle = {"text/plain": f"LiveFigure (controls: {', '.join(self.controls)})",
                  "image/png": base64.b64encode(self._image.value).decode("ascii")}
        return {**bundle, **widget_view(self.widget)} if widgets_render_here() else bundle
