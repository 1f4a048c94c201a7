"""What the page showing this kernel's outputs can draw: ipywidgets' widgets, or pictures and text only.

The course's widgets (:mod:`attention_lab.widgets.live`) and progress bars
(:mod:`attention_lab.progress`) display both a live widget and a fallback -- a picture, a line of
text -- and the page shows the widget where it can. One page cannot draw the widgets of
ipywidgets 8 and does not say so: Colab's. Its runtimes ship ipywidgets 7 (7.7.1 to this day:
github.com/googlecolab/backend-info, pip-freeze.txt), which its page draws; ipywidgets 8's widgets
are "third-party widgets" there, which it does not draw even with its custom widget manager turned
on (googlecolab/colabtools#3020, #4525). The course requires ``ipywidgets>=7.7``, so installing it
on Colab keeps Colab's own; a runtime that has ipywidgets 8 anyway (another package's install) gets
the fallbacks alone, never an empty space where a widget should be.

Nothing here imports ipywidgets: the setup cell asks, and it should stay quick.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (``"ipywidgets"``), or None where it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def major_version(version: str) -> int:
    """``8`` for ``"8.1.9"``."""
    return int(re.match(r"\d+", version).group())


def on_colab() -> bool:
    """Whether this kernel is a Colab runtime's (Colab imports its own ``google.colab`` at start)."""
    return "google.colab" in sys.modules


def in_notebook_kernel() -> bool:
    """Whether this process is a Jupyter kernel (where outputs go to a page), not plain Python or a terminal."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return getattr(shell, "kernel", None) is not None


def widgets_render_here() -> bool:
    """Whether the page can draw this kernel's ipywidgets: everywhere but Colab with ipywidgets 8 or newer."""
    version = installed_version("ipywidgets")
    return version is not None and not (on_colab() and major_version(version) >= 8)


def fallback_note() -> str | None:
    """What the setup cell says where the widgets show their pictures only (None elsewhere)."""
    version = installed_version("ipywidgets")
    if not on_colab() or version is None or major_version(version) < 8:
        return None
    return (f"Widgets: this Colab runtime has ipywidgets {installed_version('ipywidgets')}, whose widgets Colab's page "
            "does not draw: each widget shows its picture, without its controls. Runtime > Disconnect and delete "
            "runtime gives back Colab's own ipywidgets (7), with the controls.")


def widget_view(widget) -> dict:
    """The display data that asks the page to draw ``widget``: what ipywidgets 8's ``_repr_mimebundle_`` gives.
    ipywidgets 7 (Colab's) has no such method -- a widget displays itself there -- so the course builds it."""
    return {WIDGET_VIEW: {"version_major": 2, "version_minor": 0, "model_id": widget.model_id}}
