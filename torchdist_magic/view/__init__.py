"""Views of a run: what a ``RunState`` looks like in a terminal and in a notebook.

``model`` computes what every view shows (``overview``: when a run has too many ranks for a
row each, and its plots' bands; the summary shown instead, ``driver.summary``, is worked out
where the run's state is); ``text`` prints it (terminals, CI, nbconvert); ``html`` draws it (the live
widget and the summary a notebook keeps), with the SVG charts of ``plots``, in the colours and
fonts of ``style``; ``widget`` is the live ipywidgets view, with ``kernel_poll`` letting its
Stop button work while a cell blocks the kernel; ``panel`` is the launch panel.  Importing this
package imports neither ipywidgets nor IPython.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from typing import Optional

VIEWS = ("auto", "widget", "text")


def kernel_with_widgets() -> bool:
    """True inside a Jupyter kernel (an IPython shell with a ``kernel``) where ipywidgets is
    installed; a terminal IPython or plain ``python`` gives False without importing anything."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return False
    return importlib.util.find_spec("ipywidgets") is not None


def make_view(run, kind: str = "auto", *, log_hint: Optional[str] = None):
    """The live view for ``run`` (an object with ``update()`` and ``close()``): ``text`` always
    works; ``widget``/``auto`` use ipywidgets when running in a kernel that has them, and fall
    back to text otherwise (``widget`` says so once, ``auto`` silently).

    ``log_hint`` tells the reader of a widget view where the complete logs are, the word ``rank``
    standing for a rank's number: ``_torchdist_run.logs(rank)`` gives captions such as
    ``full log: _torchdist_run.logs(1)``.
    """
    if kind not in VIEWS:
        raise ValueError(f"view must be one of {', '.join(VIEWS)}, got {kind!r}")
    if kind != "text":
        if kernel_with_widgets():
            from .widget import WidgetView

            return WidgetView(run, log_hint=log_hint)
        if kind == "widget":
            warnings.warn(
                "the widget view needs a Jupyter kernel with ipywidgets; showing the run as text",
                RuntimeWarning,
                stacklevel=2,
            )
    from .text import TextView

    return TextView(run.state)
