"""HTML and SVG of a run view, shared by the live widget and the static summary left in the
notebook after a run (which nbviewer, GitHub and a reopened notebook show without a kernel).

Every function takes records of ``model`` (``summary_html`` takes the ``RunState`` and reads the
model itself) and returns an HTML fragment with inline styles only: no script, no stylesheet,
colours and fonts from ``style`` (JupyterLab's theme variables where it has them).  Class
names (``torchdist-*``) and ``data-*`` attributes are for tests and for anyone styling the view.
"""

from __future__ import annotations

import html
import math
import re
from typing import Dict, List, Optional, Tuple

from ..state import LogLine, RunState
from .model import (BarView, RankLog, RankRow, RankStacks, RunFacts, Series, format_duration, metric_series,
                    rank_logs, rank_rows, rank_stacks, root_cause_rank, run_facts)
from .style import BAR_COLOURS, BORDER, MONO, MUTED, PANE, RANK_COLOURS, STATE_COLOURS, TEXT, TRACK

LOG_LINE_CHARS = 1000   # longer lines are cut in a pane (not in the run's ``logs(rank)``)
SUMMARY_LOG_LINES = 40  # lines of each rank in the static summary
LEGEND_RANKS = 16       # ranks named in the plots' legend; more are counted
ROWS_SCROLL_AFTER = 16  # ranks; more rows scroll inside the view


def rank_colour(rank: int) -> str:
    return RANK_COLOURS[rank % len(RANK_COLOURS)]


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


def _pill(text: str, colour: str, cls: str) -> str:
    return (f'<span class="{cls}" style="background:{colour};color:#fff;border-radius:10px;'
            f'padding:1px 9px;font-weight:600;font-size:12px;white-space:nowrap">{_esc(text)}</span>')


def header_html(facts: RunFacts) -> str:
    """Run state, job, backend, np, gpu and elapsed time, on one line."""
    sep = f'<span style="color:{MUTED}"> · </span>'
    parts = [f"<b>{_esc(facts.job_name)}</b>"] if facts.job_name else []
    parts += [
        f'<span class="torchdist-backend">{_esc(facts.backend)}</span>',
        f'<span class="torchdist-np">np={facts.num_processes}</span>',
        f'<span class="torchdist-gpu">{"gpu" if facts.use_gpu else "cpu"}</span>',
        f'<span class="torchdist-elapsed" title="elapsed">{format_duration(facts.elapsed)}</span>',
    ]
    if facts.attempt_text:
        parts.append(f'<span class="torchdist-attempt" data-attempt="{facts.attempt}">'
                     f'{_esc(facts.attempt_text)}</span>')
    return (f'<div class="torchdist-header" data-run-id="{_esc(facts.run_id)}" data-state="{_esc(facts.state)}"'
            f' style="display:flex;align-items:center;gap:8px;font-size:13px;color:{TEXT};line-height:24px">'
            f'<span style="font-weight:700;letter-spacing:.2px">torchdist</span>'
            f'{_pill(facts.state, STATE_COLOURS.get(facts.state, "#9e9e9e"), "torchdist-run-state")}'
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
            f'text-overflow:ellipsis;color:{MUTED}">{_esc(bar.desc)}</span>') if width else ""
    return (f'<div style="display:flex;align-items:center;gap:7px;min-width:0" title="{_esc(bar.title)}">{desc}'
            f'<div class="torchdist-bar torchdist-bar-{style}"{data} style="flex:0 0 100px;height:10px;'
            f'background:{TRACK};border-radius:5px;overflow:hidden">'
            f'<div class="torchdist-bar-fill" style="height:100%;border-radius:5px;{fill}"></div></div>'
            f'<span class="torchdist-progress" style="font-family:{MONO};font-size:11px;overflow:hidden;'
            f'text-overflow:ellipsis">{_esc(bar.text)}</span></div>')


#: (heading, CSS of the column) of the rank table; rows are flex boxes, not a <table>, so that
#: the notebook's own table styles (right-aligned, striped) do not apply to the static summary
_COLUMNS = (("rank", "flex:0 0 30px"),
            ("host", "flex:0 1 96px;min-width:40px;overflow:hidden;text-overflow:ellipsis"),
            ("state", "flex:0 0 94px"),
            ("progress", "flex:1 1 360px;min-width:0;display:flex;flex-direction:column;gap:3px"),
            ("metrics", "flex:0 1 200px;min-width:90px;white-space:normal"))
_ROW = "display:flex;align-items:center;gap:12px;padding:3px 0;white-space:nowrap"


def rows_html(rows: List[RankRow]) -> str:
    """The rank table (without a metrics column while no rank has reported any)."""
    columns = [(name, css) for name, css in _COLUMNS if name != "metrics" or any(r.metrics for r in rows)]
    cells = [f'<span style="{css}">{name}</span>' for name, css in columns]
    scroll = ";max-height:480px;overflow-y:auto" if len(rows) > ROWS_SCROLL_AFTER else ""
    out = [f'<div class="torchdist-rows" style="font-size:12.5px;line-height:18px;color:{TEXT}">'
           f'<div style="{_ROW};color:{MUTED};font-weight:600">{"".join(cells)}</div><div style="{scroll}">']
    css = dict(columns)
    descs = [len(b.desc) for row in rows for b in row.bars]
    desc_width = min(8 * max(descs) + 6, 84) if descs and max(descs) else 0
    for row in rows:
        colour = STATE_COLOURS.get(row.state, "#9e9e9e")
        state = _esc(row.state)
        if row.state == "failed" and row.exit_code is not None:
            state += f' <span style="color:{MUTED}">(exit {row.exit_code})</span>'
        dropped = ""
        if row.dropped:
            dropped = (f'<span style="color:{STATE_COLOURS["cancelled"]}" title="{row.dropped} progress or '
                       f'metric events the rank could not send">&#9888;</span>')
        bars = "".join(_bar_html(bar, row.bar_style, desc_width) for bar in row.bars)
        metrics = (f'<span class="torchdist-metrics" style="{css["metrics"]};font-family:{MONO};font-size:11.5px">'
                   f'{_esc(row.metrics)}</span>') if "metrics" in css else ""
        out.append(
            f'<div class="torchdist-rank-row" data-rank="{row.rank}" data-state="{_esc(row.state)}"'
            f' style="{_ROW};border-top:1px solid {BORDER}">'
            f'<span style="{css["rank"]}"><span style="display:inline-block;width:8px;height:8px;border-radius:2px;'
            f'background:{rank_colour(row.rank)};margin-right:6px"></span><b>{row.rank}</b></span>'
            f'<span class="torchdist-host" style="{css["host"]}" title="{_esc(row.host)}">'
            f'{_esc(row.host) or "&ndash;"}</span>'
            f'<span class="torchdist-rank-state" style="{css["state"]}"><span style="color:{colour}">&#9679;</span>'
            f' {state} {dropped}</span>'
            f'<span style="{css["progress"]}">{bars}</span>{metrics}</div>')
    out.append("</div></div>")
    return "".join(out)


def failure_html(facts: RunFacts) -> str:
    """The root cause of each earlier attempt (a run that restarted), then the outcome line (root
    cause, or why the run stopped); empty while there is neither."""
    out = [f'<div class="torchdist-attempt-failure" style="color:{STATE_COLOURS["restarting"]};font-size:12px;'
           f'margin-top:2px">{_esc(line)} &rarr; restarted</div>' for line in facts.earlier]
    if facts.outcome:
        colour = STATE_COLOURS.get(facts.state, "#e53935")
        out.append(f'<div class="torchdist-failure" style="color:{colour};font-size:12.5px;margin-top:4px;'
                   f'font-weight:600">{_esc(facts.outcome)}</div>')
    return "".join(out)


def stacks_html(stacks: List[RankStacks], open_rank: Optional[int] = None) -> str:
    """Where each rank was (a hang, a timeout): its innermost frames, and every thread's stack in
    a ``<details>`` (``open_rank``'s open); empty when no stacks were captured."""
    if not stacks:
        return ""
    out = [f'<div class="torchdist-stacks" style="margin-top:6px;font-size:11.5px;color:{TEXT}">'
           f'<div style="color:{MUTED};margin:0 0 2px 2px">where each rank was (innermost frame first)</div>']
    for item in stacks:
        body = _esc(item.text.strip()) or f'<span style="color:{MUTED}">(no stack)</span>'
        out.append(
            f'<details class="torchdist-rank-stack" data-rank="{item.rank}"{" open" if item.rank == open_rank else ""}'
            f' style="margin:1px 0"><summary style="cursor:pointer;padding:1px 2px">'
            f'<span style="color:{rank_colour(item.rank)}">&#9632;</span> rank {item.rank}: '
            f'<code style="font-size:11px">{_esc(item.where)}</code></summary>'
            f'<pre style="margin:0;padding:6px 8px;max-height:260px;overflow:auto;background:{PANE};'
            f'border-radius:4px;font-family:{MONO};font-size:11px;line-height:1.35;white-space:pre">{body}</pre>'
            f'</details>')
    out.append("</div>")
    return "".join(out)


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


def plot_svg(metric: str, series: Series, width: int = 320,
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


def plots_html(series: Dict[str, Series]) -> str:
    """A legend of ranks, then one chart per metric (``model.metric_series``); empty when
    nothing was reported."""
    if not series:
        return ""
    charts = "".join(plot_svg(metric, by_rank) for metric, by_rank in series.items())
    shown = sorted({rank for by_rank in series.values() for rank in by_rank})
    legend = "".join(f'<span style="margin-right:10px;white-space:nowrap"><span style="color:{rank_colour(r)}">'
                     f'&#9644;</span> rank {r}</span>' for r in shown[:LEGEND_RANKS])
    if len(shown) > LEGEND_RANKS:
        legend += f"<span>… {len(shown) - LEGEND_RANKS} more ranks</span>"
    return (f'<div class="torchdist-plots" style="color:{TEXT}">'
            f'<div style="font-size:11.5px;color:{MUTED};margin:2px 0">{legend}</div>'
            f'<div style="display:flex;flex-wrap:wrap;gap:6px 16px">{charts}</div></div>')


def _line_html(line: LogLine, rank: Optional[int] = None) -> str:
    text = line.text if len(line.text) <= LOG_LINE_CHARS else line.text[:LOG_LINE_CHARS] + " …"
    body = _esc(text)
    if line.stream == "stderr":
        body = f'<span style="color:#c62828">{body}</span>'
    if rank is not None:
        body = f'<span style="color:{rank_colour(rank)}">[rank {rank}]</span> {body}'
    return body


def log_pane_html(lines: List[Tuple[Optional[int], LogLine]], finished: bool = False) -> str:
    """A scrolled pane of ``(rank, line)`` (rank None: no ``[rank N]`` prefix) that stays at its
    bottom, newest line last (a reversed flex column starts scrolled to its end, with no script)."""
    body = "\n".join(_line_html(line, rank) for rank, line in lines) or \
        f'<span style="color:{MUTED}">{"(no output)" if finished else "(no output yet)"}</span>'
    return (f'<div class="torchdist-logs" style="max-height:220px;overflow:auto;display:flex;'
            f'flex-direction:column-reverse;background:{PANE};border-radius:4px">'
            f'<pre style="flex:0 0 auto;overflow:visible;margin:0;padding:6px 8px;font-family:{MONO};'
            f'font-size:11.5px;line-height:1.4;white-space:pre-wrap;word-break:break-all;color:{TEXT};'
            f'background:transparent;border:0">{body}</pre></div>')


def _caption_html(caption: str) -> str:
    return f'<div style="font-size:11px;color:{MUTED};margin:0 0 2px 2px">{_esc(caption)}</div>'


def full_log_hint(log_hint: Optional[str], rank: int) -> Optional[str]:
    """``log_hint`` for one rank: the word ``rank`` in it becomes the rank's number
    (``_torchdist_run.logs(rank)`` -> ``_torchdist_run.logs(1)``)."""
    return None if log_hint is None else re.sub(r"\brank\b", str(rank), log_hint)


def rank_log_caption(log: RankLog, log_hint: Optional[str]) -> str:
    """``rank 1 · last 40 of 5016 lines; full log: _torchdist_run.logs(1)``"""
    details = [f"last {len(log.lines)} of {log.total} lines"] if log.total > len(log.lines) else []
    hint = full_log_hint(log_hint, log.rank)
    if hint:
        details.append(f"full log: {hint}")
    return f"rank {log.rank} · {'; '.join(details)}" if details else f"rank {log.rank}"


def rank_log_html(log: RankLog, log_hint: Optional[str] = None, finished: bool = False) -> str:
    """One rank's pane with its caption (the live view's log pane)."""
    return _caption_html(rank_log_caption(log, log_hint)) + log_pane_html([(None, line) for line in log.lines], finished)


def merged_log_html(lines: List[Tuple[int, LogLine]], limit: int, log_hint: Optional[str] = None,
                    finished: bool = False) -> str:
    """All ranks' lines (``model.MergedLog.shown()``), ``[rank N]``-prefixed, with a caption."""
    caption = f"all ranks · last {limit} lines" + (f"; full logs: {log_hint}" if log_hint else "")
    return _caption_html(caption) + log_pane_html(list(lines), finished)


def rank_logs_html(logs: List[RankLog], log_hint: Optional[str] = None, open_rank: Optional[int] = None,
                   finished: bool = True) -> str:
    """Every rank's last lines, one collapsible ``<details>`` per rank (``open_rank``'s open),
    so that a reader without a kernel can see each rank's end."""
    out = [f'<div class="torchdist-rank-logs" style="margin-top:8px;font-size:11px;color:{MUTED}">'
           f'<div style="margin:0 0 2px 2px">logs of each rank</div>']
    for log in logs:
        state_colour = STATE_COLOURS.get(log.state, "#9e9e9e")
        out.append(
            f'<details class="torchdist-rank-log" data-rank="{log.rank}" data-state="{_esc(log.state)}"'
            f'{" open" if log.rank == open_rank else ""} style="margin:1px 0">'
            f'<summary style="cursor:pointer;padding:1px 2px">'
            f'<span style="color:{rank_colour(log.rank)}">&#9632;</span> {_esc(rank_log_caption(log, log_hint))}'
            f' <span style="color:{state_colour}">({_esc(log.state)})</span></summary>'
            f'{log_pane_html([(None, line) for line in log.lines], finished)}</details>')
    out.append("</div>")
    return "".join(out)


def summary_html(state: RunState, log_hint: Optional[str] = None, open_rank: Optional[int] = None,
                 log_lines: int = SUMMARY_LOG_LINES) -> str:
    """The whole view as static HTML: what stays in the cell after the run.  Each rank's last
    ``log_lines`` lines are in a ``<details>``; ``open_rank``'s (by default the root cause's, else
    rank 0's) is open."""
    if open_rank is None:
        open_rank = root_cause_rank(state) or 0
    facts = run_facts(state)
    plots = plots_html(metric_series(state))
    logs = rank_logs_html(rank_logs(state, log_lines), log_hint, open_rank, facts.finished)
    return (f'<div class="torchdist-summary" style="border:1px solid {BORDER};border-radius:6px;'
            f'padding:8px 12px;max-width:1100px">{header_html(facts)}'
            f'<div style="margin-top:6px">{rows_html(rank_rows(state))}</div>{failure_html(facts)}'
            f'{stacks_html(rank_stacks(state))}'
            f'{f"<div style=margin-top:8px>{plots}</div>" if plots else ""}{logs}</div>')
