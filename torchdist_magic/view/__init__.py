"""Renderers of a ``RunState``: ``text`` (terminals, CI, nbconvert) and ``widget`` (Jupyter)."""

from __future__ import annotations

import importlib.util
import sys
import warnings

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


def make_view(run, kind: str = "auto"):
    """The live view for ``run``: ``text`` always works; ``widget``/``auto`` use ipywidgets when
    running in a kernel that has them, and fall back to text otherwise (``widget`` says so once,
    ``auto`` silently)."""
    if kind not in VIEWS:
        raise ValueError(f"view must be one of {', '.join(VIEWS)}, got {kind!r}")
    if kind != "text":
        if kernel_with_widgets():
            from .widget import WidgetView

            return WidgetView(run)
        if kind == "widget":
            warnings.warn("the widget view needs a Jupyter kernel with ipywidgets; showing the run as text",
                          RuntimeWarning, stacklevel=2)
    from .text import TextView

    return TextView(run.state)
