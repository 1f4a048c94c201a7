"""LiveFigure: controls + a matplotlib figure redrawn on every change, with a static fallback."""

from __future__ import annotations

import base64
import io
from typing import Any, Callable, Mapping

import ipywidgets as widgets
from matplotlib.figure import Figure


def figure_png(figure: Figure) -> bytes:
    """The figure as PNG bytes (Agg canvas: no pyplot state, no GUI backend needed)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    return buffer.getvalue()


class LiveFigure:
    """Controls whose values are passed to ``draw(figure, **values)`` on every change.

    * ``controls`` -- name -> ipywidget; setting ``controls[name].value`` redraws. Sliders and
      text boxes report a new value only when released (``continuous_update=False``).
    * ``figure`` -- the matplotlib Figure as last drawn (tests inspect its axes).
    * Displayed, it offers the live widget *and* a PNG of the figure: JupyterLab and Colab
      render the widget; renderers without a widget manager fall back to the PNG.
    """

    def __init__(self, draw: Callable[..., None], controls: Mapping[str, widgets.ValueWidget],
                 figsize: tuple[float, float] = (8.0, 4.0)):
        self._draw = draw
        self.controls = dict(controls)
        self.figure = Figure(figsize=figsize)
        self._image = widgets.Image(format="png")
        self.widget = widgets.VBox([widgets.HBox(list(self.controls.values())), self._image])
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
        bundle = self.widget._repr_mimebundle_(**kwargs)
        # Notebook JSON carries binary outputs as base64 text.
        bundle["image/png"] = base64.b64encode(self._image.value).decode("ascii")
        return bundle
