"""Colours and fonts of every view (the run view, its static summary, the launch panel), defined
once: JupyterLab's theme variables where it has them, with a fallback for other frontends.

Every text colour reads at least 4.5:1 (WCAG AA) against the view's backgrounds in JupyterLab's
light and dark themes: an accent on text is a hue mixed half and half with the theme's text
colour (``color-mix``), so it darkens on a light page and lightens on a dark one, with inline
styles only (no stylesheet, which nbviewer and GitHub drop).  A pill is white on a fixed dark
colour.
"""

from __future__ import annotations

_TEXT_COLOUR = "var(--jp-ui-font-color1, #212121)"
_PAGE = "var(--jp-layout-color0, #fff)"


def _accent(hue: str) -> str:
    """``hue`` for text: half of it, half the theme's text colour."""
    return f"color-mix(in srgb, {_TEXT_COLOUR} 50%, {hue})"


#: background of state pills (white text on them: at least 4.5:1 in either theme)
STATE_COLOURS = {
    "starting": "#616161",
    "running": "#1565c0",
    "done": "#2e7d32",
    "succeeded": "#2e7d32",
    "failed": "#c62828",
    "cancelled": "#a84300",
    "timed out": "#a84300",
    "hung": "#a84300",
    "restarting": "#6a1b9a",
    "idle": "#616161",
}
#: text in the colour of a state (an outcome line, a rank's state)
STATE_TEXT = {
    "starting": _accent("#9e9e9e"),
    "running": _accent("#1e88e5"),
    "done": _accent("#43a047"),
    "succeeded": _accent("#43a047"),
    "failed": _accent("#e53935"),
    "cancelled": _accent("#fb8c00"),
    "timed out": _accent("#fb8c00"),
    "hung": _accent("#fb8c00"),
    "restarting": _accent("#8e24aa"),
    "idle": _accent("#9e9e9e"),
}
#: colours of ``model.RankRow.bar_style`` (bar fills: graphics, beside their text)
BAR_COLOURS = {"info": "#1e88e5", "success": "#43a047", "danger": "#e53935", "warning": "#fb8c00"}
#: a message that refuses a setting or a launch (the panel); stderr lines
ERROR = STATE_TEXT["failed"]
WARN = STATE_TEXT["cancelled"]

BORDER = "var(--jp-border-color2, #e0e0e0)"
#: secondary text: three quarters text colour, a quarter page colour
MUTED = f"color-mix(in srgb, {_TEXT_COLOUR} 75%, {_PAGE})"
TEXT = _TEXT_COLOUR
MONO = "var(--jp-code-font-family, SFMono-Regular, Menlo, Consolas, monospace)"
TRACK = "var(--jp-layout-color3, #e0e0e0)"
#: a log pane: the page with a touch of text colour (a dark pane keeps red text readable)
PANE = f"color-mix(in srgb, {_PAGE} 94%, {_TEXT_COLOUR})"


def rank_colour(rank: int) -> str:
    """One colour per rank in plots and markers, distinct for neighbouring ranks and never
    repeating (hues a golden angle apart, lightness that shows on light and dark alike)."""
    return f"hsl({rank * 137.508 % 360:.0f},70%,48%)"
