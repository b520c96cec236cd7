"""Renderers of a ``RunState``: ``text`` (terminals, CI, nbconvert) and ``widget`` (Jupyter)."""

from __future__ import annotations

VIEWS = ("auto", "widget", "text")


def make_view(run, kind: str = "auto"):
    """The live view for ``run``: ``text`` always works; ``widget``/``auto`` use ipywidgets when
    running in a kernel that has them, and fall back to text otherwise."""
    if kind not in VIEWS:
        raise ValueError(f"view must be one of {', '.join(VIEWS)}, got {kind!r}")
    from .text import TextView

    return TextView(run.state)
