"""Colours and fonts of every view (the run view, its static summary, the launch panel), defined
once: JupyterLab's theme variables where it has them, with a fallback for other frontends."""

from __future__ import annotations

#: colours of states (rank and run), as CSS
STATE_COLOURS = {
    "starting": "#9e9e9e", "running": "#1e88e5", "done": "#43a047", "succeeded": "#43a047",
    "failed": "#e53935", "cancelled": "#fb8c00", "timed out": "#fb8c00", "hung": "#fb8c00",
    "restarting": "#8e24aa",
}
#: colours of ``model.RankRow.bar_style``
BAR_COLOURS = {"info": "#1e88e5", "success": "#43a047", "danger": "#e53935", "warning": "#fb8c00"}
#: one colour per rank in plots and merged logs (matplotlib's tab10)
RANK_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
#: a message that refuses a setting or a launch (the panel)
ERROR = "#d32f2f"

BORDER = "var(--jp-border-color2, #e0e0e0)"
MUTED = "var(--jp-ui-font-color2, #757575)"
TEXT = "var(--jp-ui-font-color1, #212121)"
MONO = "var(--jp-code-font-family, SFMono-Regular, Menlo, Consolas, monospace)"
TRACK = "var(--jp-layout-color3, #e0e0e0)"
PANE = "var(--jp-layout-color2, #f5f5f5)"
