"""Progress bars that read right wherever a notebook is shown: tqdm's bar, with its text kept current.

In a Jupyter kernel, ``tqdm.auto`` gives tqdm's notebook bar, an ipywidget. A page that cannot draw
widgets (nbconvert's HTML, GitHub's preview, a graded notebook opened later) shows instead the text
the bar had when it appeared -- "0%", forever. The course's bar is the same widget, displayed with a
display id, so that when it closes its output is replaced by its last text ("100% 20/20 ...") beside
the widget, or by nothing for a bar that was not to be left (``leave=False``): the picture-or-text
fallback of the course's widgets (:mod:`attention_lab.widgets.live`). Where the page is known not to
draw widgets at all (:func:`~attention_lab.frontend.widgets_render_here`: Colab with ipywidgets 8),
the bar is tqdm's text bar, which every page shows.

:func:`use_course_progress_bars` (run by :func:`attention_lab.setup`, in the first cell of every
notebook) makes these ``tqdm.auto``'s ``tqdm`` and ``trange``: the notebooks' own
``from tqdm.auto import tqdm`` gets them.
"""

from __future__ import annotations

import functools

from attention_lab.frontend import in_notebook_kernel, widget_view, widgets_render_here


@functools.cache
def notebook_progress_class() -> type:
    """tqdm's notebook bar (with its asyncio support, as ``tqdm.auto`` builds it), its text kept in its output."""
    from IPython.display import display
    from tqdm.asyncio import tqdm_asyncio
    from tqdm.notebook import tqdm_notebook

    class CourseProgress(tqdm_notebook, tqdm_asyncio):
        def __init__(self, *args, **kwargs):
            show = kwargs.pop("display", True)
            self._output = None  # the display handle, once shown
            super().__init__(*args, display=False, **kwargs)
            if show and not self.disable and self.delay <= 0:
                self._show()

        def _show(self) -> None:
            self._output = display(self._bundle(), raw=True, display_id=True)
            self.displayed = True

        def _bundle(self) -> dict:
            # The bar as text (TqdmHBox's pretty repr): "training:  40%|████      | 4/10 [00:01<00:01, 3.9it/s]"
            return {"text/plain": self.container.__repr__(pretty=True), **widget_view(self.container)}

        def display(self, msg=None, pos=None, close=False, bar_style=None, check_delay=True):
            super().display(msg, pos, close, bar_style, check_delay=False)
            if check_delay and self.delay > 0 and not self.displayed:  # tqdm shows a delayed bar here: ours
                self._show()

        def close(self):
            super().close()
            if self._output is not None:
                hidden = self.container.comm is None  # tqdm closed the widget: a bar not to be left
                self._output.update({"text/plain": ""} if hidden else self._bundle(), raw=True)
                self._output = None

    CourseProgress.__name__ = CourseProgress.__qualname__ = "tqdm"
    return CourseProgress


def use_course_progress_bars() -> None:
    """In a notebook's kernel, ``tqdm.auto.tqdm`` (and its ``trange``) become the course's bar; elsewhere
    (plain Python, a terminal, the checks' own process) tqdm's choice stands."""
    if not in_notebook_kernel():
        return
    import tqdm.auto

    if tqdm.auto.notebook_tqdm is tqdm.auto.std_tqdm:  # tqdm found no widgets here: its text bar stands
        return
    tqdm.auto.tqdm = notebook_progress_class() if widgets_render_here() else tqdm.auto.asyncio_tqdm
