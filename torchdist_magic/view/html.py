"""HTML and SVG of a run view, shared by the live widget and the static summary left in the
notebook after a run (which nbviewer, GitHub and a reopened notebook show without a kernel).

Every function takes records of ``model`` (``summary_html`` takes the ``RunState`` and reads the
model itself; the plots are ``plots``'s) and returns an HTML fragment with inline styles only: no script, no stylesheet,
colours and fonts from ``style`` (JupyterLab's theme variables where it has them).  Class
names (``torchdist-*``) and ``data-*`` attributes are for tests and for anyone styling the view.
"""

from __future__ import annotations

import html
import re
from typing import Dict, List, Optional, Tuple

from ..driver.logstore import LogLine
from ..driver.state import RunState
from .model import (
    BarView,
    RankLog,
    RankRow,
    RankStacks,
    RunFacts,
    format_duration,
    metric_series,
    rank_log,
    rank_logs,
    rank_row,
    rank_rows,
    rank_stacks,
    root_cause_rank,
    run_facts,
    snapshot,
    system_series,
)
from ..driver.summary import LargeView, Overview, large_view
from .overview import LINE_RANKS, is_large, metric_bands
from .plots import bands_html, plots_html
from .style import (
    BAR_COLOURS,
    BORDER,
    ERROR,
    MONO,
    MUTED,
    PANE,
    STATE_COLOURS,
    STATE_TEXT,
    TEXT,
    TRACK,
    WARN,
    rank_colour,
)

LOG_LINE_CHARS = 1000  # longer lines are cut in a pane (not in the run's ``logs(rank)``)
LOG_PANE_CHARS = 24_000  # characters of a pane, newest lines kept: an update's size is bounded
SUMMARY_LOG_LINES = 40  # lines of each rank in the static summary
ROWS_SCROLL_AFTER = 16  # ranks; more rows scroll inside the view


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


def _pill(text: str, colour: str, cls: str) -> str:
    return (
        f'<span class="{cls}" style="background:{colour};color:#fff;border-radius:10px;'
        f'padding:1px 9px;font-weight:600;font-size:12px;white-space:nowrap">{_esc(text)}</span>'
    )


def header_html(facts: RunFacts) -> str:
    """Run state, job, backend, np, gpu and elapsed time: one line that wraps between its parts
    in a narrow pane (never inside one)."""
    parts = [f"<b>{_esc(facts.job_name)}</b>"] if facts.job_name else []
    parts += [
        f'<span class="torchdist-backend">{_esc(facts.backend)}</span>',
        f'<span class="torchdist-np">np={facts.num_processes}</span>',
        f'<span class="torchdist-gpu">{"gpu" if facts.use_gpu else "cpu"}</span>',
        f'<span class="torchdist-elapsed" title="elapsed">{format_duration(facts.elapsed)}</span>',
    ]
    if facts.tracking_url:
        parts.append(
            f'<a class="torchdist-mlflow" href="{_esc(facts.tracking_url)}" target="_blank" '
            f'rel="noopener" title="{_esc(facts.tracking_text)}">MLflow run</a>'
        )
    if facts.refused_text:
        parts.append(
            f'<span class="torchdist-refused" style="color:{WARN}" title="{_esc(facts.refused_text)}">'
            f'&#9888; refused records</span>'
        )
    if facts.attempt_text:
        parts.append(
            f'<span class="torchdist-attempt" data-attempt="{facts.attempt}">{_esc(facts.attempt_text)}</span>'
        )
    items = "".join(
        f'<span style="white-space:nowrap;min-width:0;overflow:hidden;text-overflow:ellipsis">{part}</span>'
        for part in parts
    )
    return (
        f'<div class="torchdist-header" data-run-id="{_esc(facts.run_id)}" data-state="{_esc(facts.state)}"'
        f' style="display:flex;flex-wrap:wrap;align-items:center;gap:2px 10px;font-size:13px;color:{TEXT};'
        f'line-height:22px;min-width:0">'
        f'<span style="font-weight:700;letter-spacing:.2px">torchdist</span>'
        f'{_pill(facts.state, STATE_COLOURS.get(facts.state, STATE_COLOURS["starting"]), "torchdist-run-state")}'
        f'{items}</div>'
    )


def _bar_html(bar: BarView, style: str, width: int) -> str:
    """A bar with its description (in ``width`` pixels, the same for every row) and its text."""
    colour = BAR_COLOURS[style]
    if bar.fraction is None:
        # no known total: a striped track
        fill = f"width:100%;background:repeating-linear-gradient(45deg,{colour}55 0 6px,transparent 6px 12px)"
    else:
        fill = f"width:{100 * bar.fraction:.1f}%;background:{colour}"
    data = f' data-n="{bar.n}"' + (f' data-total="{bar.total}"' if bar.total else "")
    desc = (
        (
            f'<span class="torchdist-bar-desc" style="flex:0 0 {width}px;overflow:hidden;'
            f'text-overflow:ellipsis;color:{MUTED}">{_esc(bar.desc)}</span>'
        )
        if width
        else ""
    )
    return (
        f'<div style="display:flex;align-items:center;gap:7px;min-width:0" title="{_esc(bar.title)}">{desc}'
        f'<div class="torchdist-bar torchdist-bar-{style}"{data} style="flex:0 1 100px;min-width:40px;height:10px;'
        f'background:{TRACK};border-radius:5px;overflow:hidden">'
        f'<div class="torchdist-bar-fill" style="height:100%;border-radius:5px;{fill}"></div></div>'
        f'<span class="torchdist-progress" style="font-family:{MONO};font-size:11px;min-width:0;'
        f'white-space:normal;overflow-wrap:anywhere">{_esc(bar.text)}</span></div>'
    )


#: (heading, CSS of the column) of the rank table; rows are flex boxes, not a <table>, so that
#: the notebook's own table styles (right-aligned, striped) do not apply to the static summary;
#: they wrap in a narrow pane (progress and metrics below the rank, host and state)
_COLUMNS = (
    ("rank", "flex:0 0 auto;font-variant-numeric:tabular-nums"),
    ("host", "flex:0 1 96px;min-width:40px;overflow:hidden;text-overflow:ellipsis"),
    ("state", "flex:0 0 112px"),
    ("progress", "flex:3 1 320px;min-width:0;display:flex;flex-direction:column;gap:3px"),
    ("metrics", "flex:1 1 140px;min-width:0;max-width:260px;white-space:normal;overflow-wrap:anywhere"),
    ("system", "flex:1 1 160px;min-width:0;max-width:300px;white-space:normal;overflow-wrap:anywhere"),
)
_ROW = "display:flex;flex-wrap:wrap;align-items:center;gap:2px 12px;padding:3px 0;white-space:nowrap"


def rows_html(
    rows: List[RankRow], why: Optional[Dict[int, str]] = None, digits: Optional[int] = None, scroll: bool = True
) -> str:
    """The rank table (without a metrics column while no rank has reported any).  ``why``: a
    line under a rank's row saying why it is shown; ``digits``: of the largest rank number, so
    that columns line up (by default, of the rows').  ``scroll``: many rows scroll in a box."""
    columns = [
        (name, css)
        for name, css in _COLUMNS
        if name not in ("metrics", "system") or any(getattr(r, name) for r in rows)
    ]
    digits = digits or max((len(str(row.rank)) for row in rows), default=1)
    rank_width = f"width:{digits + 2.2:.1f}ch"
    cells = [f'<span style="{css}{";" + rank_width if name == "rank" else ""}">{name}</span>' for name, css in columns]
    box = ";max-height:480px;overflow-y:auto" if scroll and len(rows) > ROWS_SCROLL_AFTER else ""
    out = [
        f'<div class="torchdist-rows" style="font-size:12.5px;line-height:18px;color:{TEXT}">'
        f'<div style="{_ROW};color:{MUTED};font-weight:600">{"".join(cells)}</div><div style="{box}">'
    ]
    css = dict(columns)
    descs = [len(b.desc) for row in rows for b in row.bars]
    desc_width = min(8 * max(descs) + 6, 84) if descs and max(descs) else 0
    for row in rows:
        state = _esc(row.state)
        if row.state == "failed" and row.exit_code is not None:
            state += f' <span style="color:{MUTED}">(exit {row.exit_code})</span>'
        dropped = ""
        if row.dropped:
            dropped = (
                f'<span style="color:{WARN}" title="{row.dropped} progress or '
                f'metric events the rank could not send">&#9888;</span>'
            )
        bars = "".join(_bar_html(bar, row.bar_style, desc_width) for bar in row.bars)
        metrics = (
            (
                f'<span class="torchdist-metrics" style="{css["metrics"]};font-family:{MONO};font-size:11.5px">'
                f'{_esc(row.metrics)}</span>'
            )
            if "metrics" in css
            else ""
        )
        system = (
            (
                f'<span class="torchdist-system" style="{css["system"]};font-family:{MONO};font-size:11.5px;'
                f'color:{MUTED}">{_esc(row.system)}</span>'
            )
            if "system" in css
            else ""
        )
        reason = (why or {}).get(row.rank)
        note = (
            (
                f'<div class="torchdist-why" style="flex:1 0 100%;box-sizing:border-box;white-space:normal;'
                f'color:{MUTED};font-size:11.5px;padding-left:{digits + 2.2:.1f}ch">{_esc(reason)}</div>'
            )
            if reason
            else ""
        )
        out.append(
            f'<div class="torchdist-rank-row" data-rank="{row.rank}" data-state="{_esc(row.state)}"'
            f'{" data-why" if reason else ""} style="{_ROW};border-top:1px solid {BORDER}">'
            f'<span style="{css["rank"]};{rank_width}"><span style="display:inline-block;width:8px;height:8px;'
            f'border-radius:2px;background:{rank_colour(row.rank)};margin-right:6px"></span><b>{row.rank}</b></span>'
            f'<span class="torchdist-host" style="{css["host"]}" title="{_esc(row.host)}">'
            f'{_esc(row.host) or "&ndash;"}</span>'
            f'<span class="torchdist-rank-state" style="{css["state"]}">'
            f'<span style="color:{BAR_COLOURS[row.bar_style]}">&#9679;</span> {state} {dropped}</span>'
            f'<span style="{css["progress"]}">{bars}</span>{metrics}{system}{note}</div>'
        )
    out.append("</div></div>")
    return "".join(out)


def straggler_notes(snap) -> Dict[int, str]:
    """The line under each straggler's row (a small run's rows)."""
    return {s.rank: f"\u26a0 straggler: {s.why}" for s in snap.stragglers}


def _aggregate_bar_html(bar) -> str:
    """One bar across ranks: the min-max range shaded, filled to the median."""
    fractions = bar.fractions
    if fractions is None:
        track = f"background:repeating-linear-gradient(45deg,{BAR_COLOURS['info']}55 0 6px,transparent 6px 12px)"
        inner = ""
    else:
        low, median, high = fractions
        track = f"background:{TRACK}"
        inner = (
            f'<div style="position:absolute;left:{100 * low:.1f}%;width:{100 * (high - low):.1f}%;top:0;'
            f'bottom:0;background:{BAR_COLOURS["info"]}55"></div>'
            f'<div class="torchdist-bar-fill" style="position:absolute;left:0;width:{100 * median:.1f}%;top:0;'
            f'bottom:0;background:{BAR_COLOURS["info"]}"></div>'
        )
    data = f' data-median="{bar.n_median:g}" data-min="{bar.n_min}" data-max="{bar.n_max}" data-behind="{bar.behind}"'
    return (
        f'<div class="torchdist-bar-summary"{data} style="display:flex;flex-wrap:wrap;align-items:center;'
        f'gap:2px 8px;min-width:0;padding:2px 0">'
        f'<span style="flex:0 0 auto;min-width:60px;color:{MUTED}">{_esc(bar.desc) or "progress"}</span>'
        f'<div style="position:relative;flex:1 1 120px;max-width:260px;min-width:80px;height:10px;border-radius:5px;'
        f'overflow:hidden;{track}">{inner}</div>'
        f'<span class="torchdist-progress" style="font-family:{MONO};font-size:11px;white-space:normal;'
        f'min-width:0;overflow-wrap:anywhere">{_esc(bar.text)} ({bar.ranks} ranks)</span></div>'
    )


def overview_html(ov: Overview) -> str:
    """A large run at a glance: ranks by state and hosts, each bar across ranks."""
    states = " ".join(
        f'<span class="torchdist-state-count" data-state="{_esc(state)}" style="white-space:nowrap">'
        f'<span style="color:{BAR_COLOURS.get(_BAR_OF.get(state, "info"))}">&#9679;</span> {count} {_esc(state)}</span>'
        for state, count in ov.states
    )
    hosts = f'{len(ov.hosts)} host{"s" if len(ov.hosts) != 1 else ""}' if ov.hosts else "no host yet"
    stragglers = (
        f' <span class="torchdist-straggler-count" style="white-space:nowrap;color:{WARN}">'
        f'&#9888; {len(ov.stragglers)} straggler{"s" if len(ov.stragglers) != 1 else ""}</span>'
        if ov.stragglers
        else ""
    )
    bars = "".join(_aggregate_bar_html(bar) for bar in ov.bars)
    bars += "".join(
        f'<div class="torchdist-system-summary" data-key="{_esc(item.key)}" style="font-family:{MONO};'
        f'font-size:11.5px;color:{MUTED};white-space:normal">{_esc(item.text)}</div>'
        for item in ov.system
    )
    return (
        f'<div class="torchdist-overview" data-ranks="{ov.num_processes}" style="font-size:12.5px;'
        f'line-height:18px;color:{TEXT}">'
        f'<div style="display:flex;flex-wrap:wrap;gap:2px 12px"><b style="white-space:nowrap">'
        f'{ov.num_processes} ranks on {hosts}</b>{states}{stragglers}</div>{bars}</div>'
    )


#: the bar style of a rank state, for the dots of the counts by state
_BAR_OF = {"starting": "info", "running": "info", "done": "success", "failed": "danger", "cancelled": "warning"}


def _section(title: str, body: str, cls: str) -> str:
    return (
        f'<div class="{cls}" style="margin-top:6px"><div style="font-size:11.5px;color:{MUTED};'
        f'font-weight:600;margin:0 0 1px 0">{_esc(title)}</div>{body}</div>'
    )


def large_rows_html(view: LargeView, page_title: str = "") -> str:
    """For a large run (``summary.large_view``): the overview, the rows of the ranks worth a look
    (with why), then the rows of the view's page (a host's ranks, a rank asked for) under
    ``page_title``."""
    ov, shown, page = view.overview, view.shown, view.page
    digits = len(str(ov.num_processes - 1))
    out = [overview_html(ov)]
    if ov.look:
        rows = [rank_row(shown[look.rank]) for look in ov.look]
        out.append(
            _section(
                "worth a look", rows_html(rows, {look.rank: look.why for look in ov.look}, digits), "torchdist-look"
            )
        )
    if page:
        rows = [rank_row(shown[r]) for r in page]
        out.append(_section(page_title, rows_html(rows, digits=digits), "torchdist-page"))
    return "".join(out)


def failure_html(facts: RunFacts) -> str:
    """The culprit line (which rank held the others up) on top, the root cause of each earlier
    attempt (a run that restarted), the pre-flight check's figures and warnings, then the
    outcome line (root cause, or why the run stopped); empty while there is none of them."""
    out = (
        [
            f'<div class="torchdist-culprit" style="color:{ERROR};font-size:12.5px;margin-top:4px;'
            f'font-weight:600">{_esc(facts.culprit[:1].upper() + facts.culprit[1:])}</div>'
        ]
        if facts.culprit
        else []
    )
    out += [
        f'<div class="torchdist-attempt-failure" style="color:{STATE_TEXT["restarting"]};font-size:12px;'
        f'margin-top:2px">{_esc(line)} &rarr; restarted</div>'
        for line in facts.earlier
    ]
    out += [
        f'<div class="torchdist-excluded" style="color:{MUTED};font-size:12px;margin-top:2px">{_esc(line)}</div>'
        for line in facts.excluded
    ]
    out += [
        f'<div class="torchdist-preflight" style="color:{MUTED};font-size:12px;margin-top:2px;'
        f'white-space:pre-wrap">{_esc(line)}</div>'
        for line in facts.preflight
    ]
    if facts.outcome:
        colour = STATE_TEXT.get(facts.state, ERROR)
        out.append(
            f'<div class="torchdist-failure" style="color:{colour};font-size:12.5px;margin-top:4px;'
            f'font-weight:600">{_esc(facts.outcome)}</div>'
        )
    return "".join(out)


def stacks_html(stacks: List[RankStacks], open_rank: Optional[int] = None) -> str:
    """Where each rank was (a hang, a timeout): its innermost frames, and every thread's stack in
    a ``<details>`` (``open_rank``'s open); empty when no stacks were captured."""
    if not stacks:
        return ""
    out = [
        f'<div class="torchdist-stacks" style="margin-top:6px;font-size:11.5px;color:{TEXT}">'
        f'<div style="color:{MUTED};margin:0 0 2px 2px">where each rank was (innermost frame first)</div>'
    ]
    for item in stacks:
        body = _esc(item.text.strip()) or f'<span style="color:{MUTED}">(no stack)</span>'
        out.append(
            f'<details class="torchdist-rank-stack" data-rank="{item.rank}"{" open" if item.rank == open_rank else ""}'
            f' style="margin:1px 0"><summary style="cursor:pointer;padding:1px 2px">'
            f'<span style="color:{rank_colour(item.rank)}">&#9632;</span> rank {item.rank}: '
            f'<code style="font-size:11px">{_esc(item.where)}</code></summary>'
            f'<pre style="margin:0;padding:6px 8px;max-height:260px;overflow:auto;background:{PANE};'
            f'border-radius:4px;font-family:{MONO};font-size:11px;line-height:1.35;white-space:pre">{body}</pre>'
            f'</details>'
        )
    out.append("</div>")
    return "".join(out)


def profile_html(profile) -> str:
    """A run's profile (``profiles.Profile``): where its merged trace is, then a line per rank."""
    head, *ranks = profile.lines()
    items = "".join(
        f'<div style="font-family:{MONO};font-size:11px;white-space:pre-wrap">{_esc(line)}</div>' for line in ranks
    )
    return (
        f'<div class="torchdist-profile" style="margin:4px 0;color:{TEXT}"><div style="font-weight:600">'
        f'{_esc(head)}</div>{items}</div>'
    )


def _line_html(line: LogLine, rank: Optional[int] = None) -> str:
    text = line.text if len(line.text) <= LOG_LINE_CHARS else line.text[:LOG_LINE_CHARS] + " …"
    body = _esc(text)
    if line.stream == "stderr":
        body = f'<span style="color:{ERROR}">{body}</span>'
    if rank is not None:
        # the rank's colour on a mark, the text in the text colour: readable in either theme
        body = (
            f'<span class="torchdist-rank-prefix" style="color:{TEXT};font-weight:600">'
            f'<span style="color:{rank_colour(rank)}">&#9612;</span>[rank {rank}]</span> {body}'
        )
    return body


def log_pane_html(lines: List[Tuple[Optional[int], LogLine]], finished: bool = False, empty: str = "") -> str:
    """A scrolled pane of ``(rank, line)`` (rank None: no ``[rank N]`` prefix) that stays at its
    bottom, newest line last (a reversed flex column starts scrolled to its end, with no script).
    The newest lines that fit ``LOG_PANE_CHARS`` are shown."""
    shown: List[str] = []
    size = 0
    for rank, line in reversed(lines):
        part = _line_html(line, rank)
        size += len(part) + 1
        if size > LOG_PANE_CHARS and shown:
            break
        shown.append(part)
    body = (
        "\n".join(reversed(shown))
        or f'<span style="color:{MUTED}">{empty or ("(no output)" if finished else "(no output yet)")}</span>'
    )
    return (
        f'<div class="torchdist-logs" style="max-height:220px;overflow:auto;display:flex;'
        f'flex-direction:column-reverse;background:{PANE};border-radius:4px">'
        f'<pre style="flex:0 0 auto;overflow:visible;margin:0;padding:6px 8px;font-family:{MONO};'
        f'font-size:11.5px;line-height:1.4;white-space:pre-wrap;word-break:break-all;color:{TEXT};'
        f'background:transparent;border:0">{body}</pre></div>'
    )


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


def _traceback_html(log: RankLog) -> str:
    if not log.traceback:
        return ""
    return (
        f'<div class="torchdist-traceback" style="font-size:11px;color:{MUTED};margin:4px 0 2px 2px">'
        f'the traceback rank {log.rank} sent with its failure</div>'
        + log_pane_html([(None, LogLine("stderr", text)) for text in log.traceback.rstrip().splitlines()])
    )


def rank_log_html(log: RankLog, log_hint: Optional[str] = None, finished: bool = False) -> str:
    """One rank's pane with its caption (the live view's log pane), and a failed rank's
    traceback when its lines do not hold it."""
    return (
        _caption_html(rank_log_caption(log, log_hint))
        + log_pane_html([(None, line) for line in log.lines], finished)
        + _traceback_html(log)
    )


def merged_log_html(
    lines: List[Tuple[int, LogLine]], limit: int, log_hint: Optional[str] = None, finished: bool = False
) -> str:
    """All ranks' lines (``merged.MergedLog.shown()``), ``[rank N]``-prefixed, with a caption."""
    caption = f"all ranks · last {limit} lines" + (f"; full logs: {log_hint}" if log_hint else "")
    return _caption_html(caption) + log_pane_html(list(lines), finished)


def problems_html(
    lines: List[Tuple[int, LogLine]], limit: int, log_hint: Optional[str] = None, finished: bool = False
) -> str:
    """Every rank's errors and warnings (``merged.MergedLog.problems``), ``[rank N]``-prefixed."""
    caption = (
        f"errors and warnings of every rank (stderr, and lines saying error, warning, traceback or "
        f"exception) · last {limit}" + (f"; full logs: {log_hint}" if log_hint else "")
    )
    return (
        f'<div class="torchdist-problems">{_caption_html(caption)}'
        f'{log_pane_html(list(lines), finished, empty="(no errors or warnings)")}</div>'
    )


def rank_logs_html(
    logs: List[RankLog],
    log_hint: Optional[str] = None,
    open_rank: Optional[int] = None,
    finished: bool = True,
    title: str = "logs of each rank",
) -> str:
    """The ranks' last lines, one collapsible ``<details>`` per rank (``open_rank``'s open),
    so that a reader without a kernel can see each rank's end."""
    out = [
        f'<div class="torchdist-rank-logs" style="margin-top:8px;font-size:11px;color:{MUTED}">'
        f'<div style="margin:0 0 2px 2px">{_esc(title)}</div>'
    ]
    for log in logs:
        out.append(
            f'<details class="torchdist-rank-log" data-rank="{log.rank}" data-state="{_esc(log.state)}"'
            f'{" open" if log.rank == open_rank else ""} style="margin:1px 0">'
            f'<summary style="cursor:pointer;padding:1px 2px">'
            f'<span style="color:{rank_colour(log.rank)}">&#9632;</span> {_esc(rank_log_caption(log, log_hint))}'
            f' <span style="color:{STATE_TEXT.get(log.state, MUTED)}">({_esc(log.state)})</span></summary>'
            f'{log_pane_html([(None, line) for line in log.lines], finished)}{_traceback_html(log)}</details>'
        )
    out.append("</div>")
    return "".join(out)


def summary_html(
    state: RunState,
    log_hint: Optional[str] = None,
    open_rank: Optional[int] = None,
    log_lines: int = SUMMARY_LOG_LINES,
    problems: Optional[List[Tuple[int, LogLine]]] = None,
) -> str:
    """The whole view as static HTML: what stays in the cell after the run.  Each rank's last
    ``log_lines`` lines are in a ``<details>``; ``open_rank``'s (by default the root cause's, else
    rank 0's) is open.  A large run (``overview.is_large``) keeps its overview, the ranks worth
    a look and their logs with rank 0's, and ``problems`` (every rank's errors and warnings, as
    a live view gathered them): its size does not grow with its ranks."""
    snap = snapshot(state)
    if open_rank is None:
        open_rank = root_cause_rank(snap) or 0
    facts = run_facts(snap)
    if is_large(snap.num_processes):
        view = large_view(snap)
        chosen = [look.rank for look in view.overview.look]
        body = large_rows_html(view)
        plots = bands_html(metric_bands(state, chosen[:LINE_RANKS]))
        shown = list(dict.fromkeys([open_rank, 0] + chosen))
        logs = rank_logs_html(
            [rank_log(state, r, log_lines) for r in shown],
            log_hint,
            open_rank,
            facts.finished,
            title="logs of rank 0 and of the ranks worth a look",
        )
        if problems is not None:
            logs += problems_html(problems, len(problems), log_hint, facts.finished)
    else:
        body = rows_html(rank_rows(snap), straggler_notes(snap))
        system = system_series(state)
        plots = plots_html({**metric_series(state), **system}, over_time=system)
        logs = rank_logs_html(rank_logs(state, log_lines), log_hint, open_rank, facts.finished)
    return (
        f'<div class="torchdist-summary" style="border:1px solid {BORDER};border-radius:6px;'
        f'padding:8px 12px;max-width:1100px;min-width:0;overflow-wrap:anywhere">{header_html(facts)}'
        f'<div style="margin-top:6px">{body}</div>{failure_html(facts)}'
        f'{stacks_html(rank_stacks(snap))}'
        f'{f"<div style=margin-top:8px>{plots}</div>" if plots else ""}{logs}</div>'
    )
