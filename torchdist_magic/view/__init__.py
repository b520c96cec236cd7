"""Renderers of a ``RunState``: ``text`` (terminals, CI, nbconvert) and ``widget`` (Jupyter)."""
