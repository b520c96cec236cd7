"""Widget renderer of a RunState (ipywidgets 8): the live run view in a notebook.

Like tqdm's notebook bar, it is a second renderer of the same state the text view reads.  Most
of the view is HTML computed from the ``RunState`` by the pure functions below (``rank_rows``,
``rows_html``, ``plot_series``, ``plots_html``, ``log_lines``...), so the live widget and the
static summary left in the cell after the run are the same picture:

- a header (run state, job, backend, np, gpu, elapsed time) and a Stop button;
- one row per rank: host, state, a progress bar (green on success, red on failure) with
  ``n/total``, rate and ETA from ``progress()``, and the latest metrics from ``report()``;
- one small chart per reported metric against step, one line per rank;
- the logs of rank 0, of any rank or of all ranks, ``\\r``-lines collapsed, last lines only.

Updates are coalesced: whatever the event rate, the view refreshes at most every
``UPDATE_EVERY`` seconds and redraws plots at most every ``PLOT_EVERY`` seconds, from whichever
thread calls ``update()``.  While a cell blocks the kernel waiting for a run, ``update()`` (from
the kernel's main thread) also handles the widget messages waiting on the kernel's shell
channel, so the Stop button and the log selector work during the cell (see ``CommPump``).
"""

from __future__ import annotations

import html
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional, Tuple

import ipywidgets as widgets

from ..state import LogLine, RankState, RunState
from .text import format_duration, header, metrics_text, progress_text, summary

log = logging.getLogger(__name__)

UPDATE_EVERY = 0.1    # seconds between refreshes of the view (every part of it together)
PLOT_EVERY = 0.5      # seconds between redraws of the metric plots
LOG_LINES = 300       # lines the log pane shows; the complete logs stay on ``run.logs(rank)``
LOG_LINE_CHARS = 1000  # longer lines are cut in the pane (not in ``run.logs``)
LOG_SCAN = 20_000     # lines looked at from the end of a rank's log to fill the pane
PLOT_POINTS = 400     # points per line in a plot; longer histories are thinned
ALL_RANKS = -1        # log selector value for "all ranks"

#: colours of states (rank and run), as CSS
STATE_COLOURS = {
    "starting": "#9e9e9e", "running": "#1e88e5", "done": "#43a047", "succeeded": "#43a047",
    "failed": "#e53935", "cancelled": "#fb8c00", "timed out": "#fb8c00",
}
#: bar style of a rank (ipywidgets' bar_style names) by rank state
BAR_STYLES = {"starting": "info", "running": "info", "done": "success", "failed": "danger",
              "cancelled": "warning"}
BAR_COLOURS = {"info": "#1e88e5", "success": "#43a047", "danger": "#e53935", "warning": "#fb8c00"}
#: one colour per rank in plots and merged logs (matplotlib's tab10)
RANK_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")

_MUTED = "var(--jp-ui-font-color2, #757575)"
_TEXT = "var(--jp-ui-font-color1, #212121)"
_MONO = "var(--jp-code-font-family, SFMono-Regular, Menlo, Consolas, monospace)"
_TRACK = "var(--jp-layout-color3, #e0e0e0)"
_PANE = "var(--jp-layout-color2, #f5f5f5)"
_BORDER = "var(--jp-border-color2, #e0e0e0)"


def rank_colour(rank: int) -> str:
    return RANK_COLOURS[rank % len(RANK_COLOURS)]


# -- the model: what the view shows, read from a RunState ---------------------------------------
@dataclass
class BarView:
    """One progress bar, as shown."""

    desc: str
    n: int
    total: Optional[int]
    fraction: Optional[float]      # 0..1 of the bar that is filled; None: no total known
    text: str                      # tqdm-like "2/3 [00:04<00:02, 0.52 it/s]" (desc and % apart)
    title: str                     # all of it: "epoch 2/3 (66%) [00:04<00:02, 0.52 it/s]"


@dataclass
class RankRow:
    """One rank's row, as shown."""

    rank: int
    host: str
    state: str
    bar_style: str                 # info (running), success, danger (failed), warning (cancelled)
    bars: List[BarView]            # outer loop first; at most two (outer and innermost)
    metrics: str                   # "loss=0.31 acc=0.9"
    exit_code: Optional[int]
    dropped: int


def bar_view(bar: dict) -> BarView:
    n, total = bar.get("n") or 0, bar.get("total")
    fraction = min(max(n / total, 0.0), 1.0) if total else None
    text = progress_text(dict(bar, desc=""))
    if total:  # the bar itself shows the percentage
        text = text.replace(f" ({100 * n // total}%)", "", 1)
    return BarView(desc=str(bar.get("desc") or ""), n=n, total=total, fraction=fraction, text=text,
                   title=progress_text(bar))


def rank_row(rs: RankState) -> RankRow:
    bars = [bar_view(b) for b in rs.shown_progress()]
    if not bars and rs.state == "done":
        # finished without progress(): a full (green) bar says "done"
        bars = [BarView(desc="", n=0, total=None, fraction=1.0, text="", title="done")]
    return RankRow(rank=rs.rank, host=rs.host, state=rs.state,
                   bar_style=BAR_STYLES.get(rs.state, "info"), bars=bars,
                   metrics=metrics_text(rs.metrics), exit_code=rs.exit_code, dropped=rs.dropped)


def rank_rows(state: RunState) -> List[RankRow]:
    with state._lock:
        return [rank_row(rs) for rs in state.ranks]


def metric_names(state: RunState) -> List[str]:
    """Every metric any rank reported, in order of first report."""
    names: Dict[str, None] = {}
    with state._lock:
        for rs in state.ranks:
            names.update(dict.fromkeys(rs.history))
    return list(names)


def thin(points: List[Tuple[int, float]], limit: int = PLOT_POINTS) -> List[Tuple[int, float]]:
    """At most ``limit`` of ``points``, evenly spread, always keeping the newest."""
    if len(points) <= limit:
        return list(points)
    stride = math.ceil(len(points) / (limit - 1))
    kept = points[::stride]
    if kept[-1] != points[-1]:
        kept.append(points[-1])
    return kept


def plot_series(state: RunState, metric: str, limit: int = PLOT_POINTS) -> Dict[int, List[Tuple[int, float]]]:
    """``{rank: [(step, value), ...]}`` of one metric, thinned to ``limit`` points per rank."""
    with state._lock:
        raw = {rs.rank: list(rs.history.get(metric, ())) for rs in state.ranks}
    return {r: thin([(x, y) for x, y in pts if math.isfinite(y)], limit) for r, pts in raw.items() if pts}


def log_lines(rs: RankState, limit: int = LOG_LINES) -> List[LogLine]:
    """The last ``limit`` lines of a rank as a terminal would show them: a ``\\r``-line is
    replaced by whatever comes after it, so only a trailing one (a bar in progress) shows."""
    logs = rs.logs
    end = len(logs)
    start = max(0, end - LOG_SCAN)
    tail = logs[start:end]
    shown = [line for line in tail[:-1] if not line.cr][-limit:]
    if tail:
        last = tail[-1]
        if not last.cr or last.text:
            shown.append(last)
    return shown[-limit:]


class MergedLog:
    """All ranks' lines in the order this view saw them (lines that came between two refreshes
    rank by rank), ``[rank N]``-prefixed, the last ``limit`` only.

    ``\\r``-lines are not kept in the order: each rank's latest one (its bar in progress) is
    shown after the finished lines until that rank writes a finished line.
    """

    def __init__(self, num_processes: int, limit: int = LOG_LINES):
        self.lines: Deque[Tuple[int, LogLine]] = deque(maxlen=limit)
        self.live: List[Optional[LogLine]] = [None] * num_processes
        self._cursor = [0] * num_processes

    def drain(self, state: RunState) -> bool:
        """Take the lines written since the last call; True when there were any."""
        changed = False
        for rs in state.ranks:
            end = len(rs.logs)
            if end == self._cursor[rs.rank]:
                continue
            start = max(self._cursor[rs.rank], end - 4 * (self.lines.maxlen or LOG_LINES))
            self._cursor[rs.rank] = end
            changed = True
            for line in rs.logs[start:end]:
                if line.cr:
                    self.live[rs.rank] = line if line.text else self.live[rs.rank]
                else:
                    self.live[rs.rank] = None
                    self.lines.append((rs.rank, line))
        return changed

    def shown(self) -> List[Tuple[int, LogLine]]:
        live = [(r, line) for r, line in enumerate(self.live) if line is not None]
        return list(self.lines) + live


# -- HTML: shared by the live widget and the static summary ---------------------------------------
def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


def _pill(text: str, colour: str, cls: str) -> str:
    return (f'<span class="{cls}" style="background:{colour};color:#fff;border-radius:10px;'
            f'padding:1px 9px;font-weight:600;font-size:12px;white-space:nowrap">{_esc(text)}</span>')


def header_html(state: RunState) -> str:
    """Run state, job, backend, np, gpu and elapsed time, on one line."""
    sep = f'<span style="color:{_MUTED}"> · </span>'
    parts = [f"<b>{_esc(state.job_name)}</b>"] if state.job_name else []
    parts += [
        f'<span class="torchdist-backend">{_esc(state.backend)}</span>',
        f'<span class="torchdist-np">np={state.num_processes}</span>',
        f'<span class="torchdist-gpu">{"gpu" if state.use_gpu else "cpu"}</span>',
        f'<span class="torchdist-elapsed" title="elapsed">{format_duration(state.elapsed())}</span>',
    ]
    return (f'<div class="torchdist-header" data-run-id="{_esc(state.run_id)}" data-state="{_esc(state.state)}"'
            f' style="display:flex;align-items:center;gap:8px;font-size:13px;color:{_TEXT};line-height:24px">'
            f'<span style="font-weight:700;letter-spacing:.2px">torchdist</span>'
            f'{_pill(state.state, STATE_COLOURS.get(state.state, "#9e9e9e"), "torchdist-run-state")}'
            f'<span>{sep.join(parts)}</span></div>')


def _bar_html(bar: BarView, style: str, width: int) -> str:
    """A bar with its description (in ``width`` pixels, the same for every row) and its text."""
    colour = BAR_COLOURS[style]
    if bar.fraction is None:
        # no known total: a striped track
        fill = f"width:100%;background:repeating-linear-gradient(45deg,{colour}55 0 6px,transparent 6px 12px)"
    else:
        fill = f"width:{100 * bar.fraction:.1f}%;background:{colour}"
    data = f' data-n="{bar.n}"' + (f' data-total="{bar.total}"' if bar.total else "")
    desc = (f'<span class="torchdist-bar-desc" style="flex:0 0 {width}px;overflow:hidden;'
            f'text-overflow:ellipsis;color:{_MUTED}">{_esc(bar.desc)}</span>') if width else ""
    return (f'<div style="display:flex;align-items:center;gap:7px;min-width:0" title="{_esc(bar.title)}">{desc}'
            f'<div class="torchdist-bar torchdist-bar-{style}"{data} style="flex:0 0 100px;height:10px;'
            f'background:{_TRACK};border-radius:5px;overflow:hidden">'
            f'<div class="torchdist-bar-fill" style="height:100%;border-radius:5px;{fill}"></div></div>'
            f'<span class="torchdist-progress" style="font-family:{_MONO};font-size:11px;overflow:hidden;'
            f'text-overflow:ellipsis">{_esc(bar.text)}</span></div>')


#: (heading, CSS of the column) of the rank table; rows are flex boxes, not a <table>, so that
#: the notebook's own table styles (right-aligned, striped) do not apply to the static summary
_COLUMNS = (("rank", "flex:0 0 30px"),
            ("host", "flex:0 1 96px;min-width:40px;overflow:hidden;text-overflow:ellipsis"),
            ("state", "flex:0 0 94px"),
            ("progress", "flex:1 1 360px;min-width:0;display:flex;flex-direction:column;gap:3px"),
            ("metrics", "flex:0 1 200px;min-width:90px;white-space:normal"))
_ROW = "display:flex;align-items:center;gap:12px;padding:3px 0;white-space:nowrap"
ROWS_SCROLL_AFTER = 16  # ranks; more rows scroll inside the view


def rows_html(rows: List[RankRow]) -> str:
    """The rank table (without a metrics column while no rank has reported any)."""
    columns = [(name, css) for name, css in _COLUMNS if name != "metrics" or any(r.metrics for r in rows)]
    cells = [f'<span style="{css}">{name}</span>' for name, css in columns]
    scroll = ";max-height:480px;overflow-y:auto" if len(rows) > ROWS_SCROLL_AFTER else ""
    out = [f'<div class="torchdist-rows" style="font-size:12.5px;line-height:18px;color:{_TEXT}">'
           f'<div style="{_ROW};color:{_MUTED};font-weight:600">{"".join(cells)}</div><div style="{scroll}">']
    css = dict(columns)
    descs = [len(b.desc) for row in rows for b in row.bars]
    desc_width = min(8 * max(descs) + 6, 84) if descs and max(descs) else 0
    for row in rows:
        colour = STATE_COLOURS.get(row.state, "#9e9e9e")
        state = _esc(row.state)
        if row.state == "failed" and row.exit_code is not None:
            state += f' <span style="color:{_MUTED}">(exit {row.exit_code})</span>'
        dropped = ""
        if row.dropped:
            dropped = (f'<span style="color:{STATE_COLOURS["cancelled"]}" title="{row.dropped} progress or '
                       f'metric events the rank could not send">&#9888;</span>')
        bars = "".join(_bar_html(bar, row.bar_style, desc_width) for bar in row.bars)
        metrics = (f'<span class="torchdist-metrics" style="{css["metrics"]};font-family:{_MONO};font-size:11.5px">'
                   f'{_esc(row.metrics)}</span>') if "metrics" in css else ""
        out.append(
            f'<div class="torchdist-rank-row" data-rank="{row.rank}" data-state="{_esc(row.state)}"'
            f' style="{_ROW};border-top:1px solid {_BORDER}">'
            f'<span style="{css["rank"]}"><span style="display:inline-block;width:8px;height:8px;border-radius:2px;'
            f'background:{rank_colour(row.rank)};margin-right:6px"></span><b>{row.rank}</b></span>'
            f'<span class="torchdist-host" style="{css["host"]}" title="{_esc(row.host)}">'
            f'{_esc(row.host) or "&ndash;"}</span>'
            f'<span class="torchdist-rank-state" style="{css["state"]}"><span style="color:{colour}">&#9679;</span>'
            f' {state} {dropped}</span>'
            f'<span style="{css["progress"]}">{bars}</span>{metrics}</div>')
    out.append("</div></div>")
    return "".join(out)


def failure_html(state: RunState) -> str:
    if state.failure is not None:
        text = f"root cause: {state.failure.summary()}"
    elif state.state in ("failed", "timed out", "cancelled") and state.message:
        text = state.message
    else:
        return ""
    colour = STATE_COLOURS.get(state.state, "#e53935")
    return (f'<div class="torchdist-failure" style="color:{colour};font-size:12.5px;margin-top:4px;'
            f'font-weight:600">{_esc(text)}</div>')


def _tick(value: float) -> str:
    return f"{value:.4g}"


def nice_ticks(low: float, high: float, count: int = 3) -> List[float]:
    """Round values (1, 2, 5 times a power of ten) between ``low`` and ``high``."""
    span = high - low
    if not span > 0:
        return [low]
    raw = span / count
    power = 10 ** math.floor(math.log10(raw))
    step = min((m * power for m in (1, 2, 5, 10)), key=lambda st: abs(math.log(st / raw)))
    first = math.ceil(low / step) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(round(value / step) * step)
        value += step
    return ticks


def plot_svg(metric: str, series: Dict[int, List[Tuple[int, float]]], width: int = 320,
             height: int = 160) -> str:
    """One metric against step, one polyline per rank, as inline SVG."""
    left, right, top, bottom = 52, 10, 22, 20
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    pad = (y1 - y0) * 0.08 or (abs(y0) * 0.1 or 1.0)
    y0, y1 = y0 - pad, y1 + pad
    pw, ph = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    out = [f'<svg class="torchdist-plot" data-metric="{_esc(metric)}" width="{width}" height="{height}"'
           f' viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg"'
           f' style="font-family:var(--jp-ui-font-family, sans-serif);font-size:10px">',
           f'<text x="{left}" y="13" style="font-size:12px;font-weight:600" fill="currentColor">{_esc(metric)}</text>']
    for value in nice_ticks(y0, y1):
        y = py(value)
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#9e9e9e"'
                   f' stroke-opacity=".25"/><text x="{left - 4}" y="{y + 3:.1f}" text-anchor="end"'
                   f' fill="currentColor" fill-opacity=".6">{_tick(value)}</text>')
    base = top + ph
    out.append(f'<line x1="{left}" x2="{width - right}" y1="{base}" y2="{base}" stroke="#9e9e9e" stroke-opacity=".6"/>')
    for x, anchor in ((x0 if len(set(xs)) > 1 else xs[0], "start"), (max(xs), "end")):
        if anchor == "end" and len(set(xs)) == 1:
            break
        out.append(f'<text x="{px(x):.1f}" y="{height - 6}" text-anchor="{anchor}" fill="currentColor"'
                   f' fill-opacity=".6">{int(x) if float(x).is_integer() else _tick(x)}</text>')
    out.append(f'<text x="{left + pw / 2:.1f}" y="{height - 6}" text-anchor="middle" fill="currentColor"'
               f' fill-opacity=".45">step</text>')
    for rank, pts in sorted(series.items()):
        colour = rank_colour(rank)
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        if len(pts) > 1:
            out.append(f'<polyline class="torchdist-plot-line" data-rank="{rank}" points="{coords}" fill="none"'
                       f' stroke="{colour}" stroke-width="1.6" stroke-linejoin="round"/>')
        lx, ly = pts[-1]
        out.append(f'<circle cx="{px(lx):.1f}" cy="{py(ly):.1f}" r="2.5" fill="{colour}">'
                   f'<title>rank {rank}: {_esc(metric)}={_tick(ly)} at step {lx}</title></circle>')
    out.append("</svg>")
    return "".join(out)


def plots_html(state: RunState, limit: int = PLOT_POINTS) -> str:
    """A legend of ranks, then one chart per metric; empty when nothing was reported."""
    charts = []
    ranks = set()
    for metric in metric_names(state):
        series = plot_series(state, metric, limit)
        if series:
            ranks.update(series)
            charts.append(plot_svg(metric, series))
    if not charts:
        return ""
    shown = sorted(ranks)
    legend = "".join(f'<span style="margin-right:10px;white-space:nowrap"><span style="color:{rank_colour(r)}">'
                     f'&#9644;</span> rank {r}</span>' for r in shown[:16])
    if len(shown) > 16:
        legend += f"<span>… {len(shown) - 16} more ranks</span>"
    return (f'<div class="torchdist-plots" style="color:{_TEXT}">'
            f'<div style="font-size:11.5px;color:{_MUTED};margin:2px 0">{legend}</div>'
            f'<div style="display:flex;flex-wrap:wrap;gap:6px 16px">{"".join(charts)}</div></div>')


def _line_html(line: LogLine, rank: Optional[int] = None) -> str:
    text = line.text if len(line.text) <= LOG_LINE_CHARS else line.text[:LOG_LINE_CHARS] + " …"
    body = _esc(text)
    if line.stream == "stderr":
        body = f'<span style="color:#c62828">{body}</span>'
    if rank is not None:
        body = f'<span style="color:{rank_colour(rank)}">[rank {rank}]</span> {body}'
    return body


def logs_html(lines: List[Tuple[Optional[int], LogLine]], caption: str, finished: bool = False) -> str:
    """A scrolled pane that stays at its bottom, newest line last (a reversed flex column starts
    scrolled to its end, with no script)."""
    body = "\n".join(_line_html(line, rank) for rank, line in lines) or \
        f'<span style="color:{_MUTED}">{"(no output)" if finished else "(no output yet)"}</span>'
    return (f'<div style="font-size:11px;color:{_MUTED};margin:0 0 2px 2px">{_esc(caption)}</div>'
            f'<div class="torchdist-logs" style="max-height:220px;overflow:auto;display:flex;'
            f'flex-direction:column-reverse;background:{_PANE};border-radius:4px">'
            f'<pre style="flex:0 0 auto;overflow:visible;margin:0;padding:6px 8px;font-family:{_MONO};'
            f'font-size:11.5px;line-height:1.4;white-space:pre-wrap;word-break:break-all;color:{_TEXT};'
            f'background:transparent;border:0">{body}</pre></div>')


def rank_logs_html(state: RunState, rank: int) -> str:
    rs = state.ranks[rank]
    lines = log_lines(rs)
    total = len(rs.logs)
    more = f"last {len(lines)} of {total} lines; " if total > len(lines) else ""
    caption = f"rank {rank} · {more}full log: torchdist_magic.last_run().logs({rank})"
    return logs_html([(None, line) for line in lines], caption, state.finished)


def merged_logs_html(merged: MergedLog, finished: bool = False) -> str:
    return logs_html(merged.shown(), f"all ranks · last {LOG_LINES} lines; full logs: "
                                     "torchdist_magic.last_run().logs(rank)", finished)


def summary_html(state: RunState, logs: str = "") -> str:
    """The whole view as static HTML: what stays in the cell after the run."""
    plots = plots_html(state)
    return (f'<div class="torchdist-summary" style="border:1px solid {_BORDER};border-radius:6px;'
            f'padding:8px 12px;max-width:1100px">{header_html(state)}'
            f'<div style="margin-top:6px">{rows_html(rank_rows(state))}</div>{failure_html(state)}'
            f'{f"<div style=margin-top:8px>{plots}</div>" if plots else ""}'
            f'{f"<div style=margin-top:8px>{logs}</div>" if logs else ""}</div>')


# -- the kernel while a cell waits ---------------------------------------------------------------
class CommPump:
    """Handles widget messages while the kernel's main thread is busy running a cell.

    A kernel reads its shell channel only between cells, so a click on a button (a ``comm_msg``)
    waits until the cell that shows the button ends.  ``pump()``, called from the cell's own
    thread while it waits, reads the messages queued for the main shell: comm messages are
    handled at once by the kernel's own comm handlers; every other message (the next cell's
    ``execute_request``, a completion, ``kernel_info``...) is kept, in order, and handed back to
    the kernel by ``release()`` ahead of anything that arrives later, so for the kernel it is as
    if those had arrived just after the cell.  ``release()`` also runs after the cell in any case
    (an IPython ``post_execute`` hook), so no request can be lost.

    Works with ipykernel 7 (messages reach the main thread from the shell-channel thread through
    an in-process socket) and ipykernel 6 (the main thread reads the shell socket itself); for
    other kernels ``for_kernel`` gives ``None`` and widgets answer when the cell ends.
    """

    COMM_TYPES = frozenset({"comm_open", "comm_msg", "comm_close"})
    _active: Optional["CommPump"] = None  # the pump of the cell running now (cells do not nest)

    def __init__(self, shell, kernel, socket, requeue: Callable[[list], None], reply_stream):
        self.shell = shell
        self.kernel = kernel
        self.socket = socket
        self.requeue = requeue
        self.reply_stream = reply_stream
        self.kept: List[list] = []
        self._released = False
        shell.events.register("post_execute", self._after_cell)

    @classmethod
    def for_kernel(cls, shell) -> Optional["CommPump"]:
        """A pump for ``shell``'s kernel when called from its main thread, else ``None``."""
        kernel = getattr(shell, "kernel", None)
        if kernel is None or getattr(kernel, "session", None) is None:
            return None
        if threading.current_thread() is not threading.main_thread() or cls._active is not None:
            return None
        channel_thread = getattr(kernel, "shell_channel_thread", None)
        if channel_thread is not None:  # ipykernel 7
            manager = channel_thread.manager
            socket = manager.get_shell_channel_to_subshell_pair(None).to_socket
            reply_stream = manager.get_subshell_to_shell_channel_socket(None)

            def requeue(frames: list) -> None:
                kernel.io_loop.add_callback(kernel.shell_main, None, frames)
        elif getattr(kernel, "shell_stream", None) is not None and hasattr(kernel, "schedule_dispatch"):
            socket = kernel.shell_stream.socket  # ipykernel 6
            reply_stream = kernel.shell_stream

            def requeue(frames: list) -> None:
                kernel.schedule_dispatch(kernel.dispatch_shell, frames)
        else:
            return None
        pump = cls(shell, kernel, socket, requeue, reply_stream)
        cls._active = pump
        return pump

    def pump(self, limit: int = 100) -> int:
        """Handle up to ``limit`` waiting messages; the number of comm messages handled."""
        import zmq

        if self._released:
            return 0
        handled = 0
        for _ in range(limit):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            msg = self._comm_message(frames)
            if msg is None:
                self.kept.append(frames)
                continue
            handler = self.kernel.shell_handlers.get(msg["header"]["msg_type"])
            try:
                handler(self.reply_stream, msg["idents"], msg)
            except Exception:  # a widget callback's error must not end the run
                log.exception("torchdist: error in a widget message handler")
            handled += 1
        return handled

    def _comm_message(self, frames: list) -> Optional[dict]:
        session = self.kernel.session
        try:
            idents, parts = session.feed_identities(frames, copy=False)
            head = session.deserialize(parts, content=False, copy=False)
            if head["header"]["msg_type"] not in self.COMM_TYPES:
                return None
            msg = session.deserialize(parts, content=True, copy=False)
        except Exception:  # not a message this pump understands: the kernel gets it unchanged
            return None
        msg["idents"] = idents
        return msg

    def release(self) -> None:
        """Hand the kept messages back to the kernel, in order; stop pumping."""
        if self._released:
            return
        self._released = True
        if CommPump._active is self:
            CommPump._active = None
        kept, self.kept = self.kept, []
        for frames in kept:
            self.requeue(frames)

    def _after_cell(self, *args) -> None:
        self.shell.events.unregister("post_execute", self._after_cell)
        self.release()


# -- the widget ----------------------------------------------------------------------------------
class WidgetView:
    """The live view of ``run`` as ipywidgets; ``update()`` and ``close()`` like ``TextView``.

    ``display=True`` shows it as an output of the running cell, replaced after the run by the
    static summary (HTML and text) so that a saved notebook, nbconvert or a frontend without
    widgets keeps the outcome.  ``display=False`` leaves placing ``view.widget`` to the caller
    (the launch panel) and keeps the live widget after the run.  ``stop=False`` leaves out the
    Stop button.
    """

    def __init__(self, run, *, display: bool = True, stop: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.run = run
        self.state: RunState = run.state
        self.clock = clock
        self.renders = 0
        self._lock = threading.RLock()
        self._last_render: Optional[float] = None
        self._last_plot: Optional[float] = None
        self._seen_version = -1
        self._plot_version = -1
        self._closed = False
        self._merged = MergedLog(self.state.num_processes)
        self._selecting = False

        self.header = widgets.HTML(layout=widgets.Layout(flex="1 1 auto"))
        self.stop_button = widgets.Button(description="Stop", icon="stop", button_style="danger",
                                          tooltip="stop every rank (like interrupting the kernel)",
                                          layout=widgets.Layout(width="auto", height="28px",
                                                                display="" if stop else "none"))
        self.stop_button.add_class("torchdist-stop")
        self.stop_button.on_click(self._on_stop)
        self.rows = widgets.HTML()
        self.rows.add_class("torchdist-rows-view")
        self.failure = widgets.HTML()
        self.plots = widgets.HTML(layout=widgets.Layout(margin="6px 0 0 0"))
        self.plots.add_class("torchdist-plots-view")
        options = [(f"rank {r}", r) for r in range(self.state.num_processes)] + [("all ranks", ALL_RANKS)]
        self.log_select = widgets.Dropdown(options=options, value=0, description="logs",
                                           layout=widgets.Layout(width="190px"),
                                           style={"description_width": "36px"})
        self.log_select.add_class("torchdist-log-select")
        self.log_select.observe(self._on_log_select, "value")
        self._log_chosen = False  # the user picked a log; until then a failing rank's log shows
        self.logs = widgets.HTML()
        self.logs.add_class("torchdist-logs-view")
        self.widget = widgets.VBox(
            [widgets.HBox([self.header, self.stop_button],
                          layout=widgets.Layout(align_items="center", justify_content="space-between")),
             self.rows, self.failure, self.plots,
             widgets.VBox([self.log_select, self.logs], layout=widgets.Layout(margin="6px 0 0 0"))],
            layout=widgets.Layout(border=f"1px solid {_BORDER}", padding="6px 12px 8px 12px",
                                  max_width="1100px"))
        self.widget.add_class("torchdist-view")
        self._render(self.clock(), force=True)

        self._handle = None
        self._pump: Optional[CommPump] = None
        if display:
            from IPython import get_ipython
            from IPython.display import display as show

            bundle = self.widget._repr_mimebundle_()
            bundle["text/plain"] = header(self.state)
            self._handle = show(bundle, raw=True, display_id=True)
            shell = get_ipython()
            if shell is not None:
                self._pump = CommPump.for_kernel(shell)

    # -- events from the frontend ---------------------------------------------------------------
    def _on_stop(self, _button=None) -> None:
        self.stop_button.disabled = True
        self.stop_button.description = "Stopping…"
        self.run.cancel()

    def _on_log_select(self, _change=None) -> None:
        with self._lock:
            self._log_chosen = not self._selecting
            self._render_logs()

    # -- rendering ------------------------------------------------------------------------------
    def update(self) -> None:
        """Refresh if ``UPDATE_EVERY`` has passed since the last refresh; handle waiting widget
        messages when called from a cell that blocks the kernel."""
        if self._pump is not None and threading.current_thread() is threading.main_thread():
            self._pump.pump()
        now = self.clock()
        with self._lock:
            if self._closed or (self._last_render is not None and now - self._last_render < UPDATE_EVERY):
                return
            self._render(now)

    def _render(self, now: float, force: bool = False) -> None:
        self._last_render = now
        self.renders += 1
        state = self.state
        _set(self.header, header_html(state))
        version = state.version
        if version != self._seen_version or force:
            self._seen_version = version
            _set(self.rows, rows_html(rank_rows(state)))
            _set(self.failure, failure_html(state))
            self._merged.drain(state)
            failed = state.failures()
            if failed and not self._log_chosen and self.log_select.value != failed[0].rank:
                self._selecting = True
                try:
                    self.log_select.value = failed[0].rank  # the root cause's output
                finally:
                    self._selecting = False
            self._render_logs()
        if self._plot_version != version and (force or self._last_plot is None or now - self._last_plot >= PLOT_EVERY):
            self._last_plot = now
            self._plot_version = version
            _set(self.plots, plots_html(state))
        if state.finished:
            self.stop_button.layout.display = "none"

    def _render_logs(self) -> None:
        selected = self.log_select.value
        if selected == ALL_RANKS:
            _set(self.logs, merged_logs_html(self._merged, self.state.finished))
        else:
            _set(self.logs, rank_logs_html(self.state, selected))

    def snapshot_html(self) -> str:
        """The view as static HTML (the logs pane as selected now)."""
        with self._lock:
            return summary_html(self.state, self.logs.value)

    def close(self) -> None:
        """Final refresh; a displayed view is replaced by the static summary and its widgets
        closed.  Messages the kernel has not seen yet are handed back to it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._render(self.clock(), force=True)
        if self._pump is not None:
            self._pump.pump()
            self._pump.release()
        if self._handle is not None:
            self._handle.update({"text/html": self.snapshot_html(), "text/plain": summary(self.state)},
                                raw=True)
            close_tree(self.widget)

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = summary(self.state) if self.state.finished else header(self.state)
        return bundle


def _set(widget, value: str) -> None:
    """Send ``value`` only when it differs from what the frontend has."""
    if widget.value != value:
        widget.value = value


def close_tree(widget) -> None:
    """Close ``widget`` and every widget under it (their comms with the frontend)."""
    for child in getattr(widget, "children", ()):
        close_tree(child)
    widget.close()


def follow_in_background(run, view, on_done: Optional[Callable[[object], None]] = None) -> threading.Thread:
    """Refresh ``view`` from a thread until ``run`` ends, then close it and call ``on_done(run)``;
    the kernel stays free meanwhile."""

    def loop() -> None:
        try:
            while not run.wait(UPDATE_EVERY):
                view.update()
        finally:
            view.close()
            if on_done is not None:
                on_done(run)

    thread = threading.Thread(target=loop, name=f"torchdist-view-{run.state.run_id}", daemon=True)
    thread.start()
    return thread
