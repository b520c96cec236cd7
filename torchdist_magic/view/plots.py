"""The SVG plots of a run view: each metric of each rank against its steps, the system samples
against seconds, and a large run's median with its min-max band (``overview.metric_bands``);
a legend of ranks above them.  Inline styles only, colours from ``style``."""

from __future__ import annotations

import html
import math
from typing import Dict, Iterable, List, Optional

from .model import Series
from .overview import Band
from .style import BAR_COLOURS, MUTED, TEXT, rank_colour

LEGEND_RANKS = 16  # ranks named in the plots' legend; more are counted


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


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


def _seconds_tick(value: float, span: float) -> str:
    """``12 s``, ``3.5 s``: a time axis's tick, to a precision its ``span`` shows."""
    return f"{value:.0f} s" if span >= 10 else f"{value:.1f} s"


def plot_svg(
    metric: str,
    series: Series,
    width: int = 320,
    height: int = 160,
    band: Optional[Band] = None,
    over_time: bool = False,
) -> str:
    """One metric against step as inline SVG (``over_time``: against seconds since the run
    started, as system samples are): one polyline per rank of ``series``, over the median and
    min-max band of ``band`` (many ranks).  It scales down with its pane."""
    left, right, top, bottom = 52, 10, 22, 20
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    if band is not None:
        xs += band.steps
        ys += band.low + band.high
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

    label = f'style="fill:{MUTED}"'

    def x_text(x: float) -> str:
        if over_time:
            return _seconds_tick(x, x1 - x0)
        return str(int(x)) if float(x).is_integer() else _tick(x)

    # a cell of its grid (``_charts_html``) sets its width: every chart of a row is as wide
    out = [
        f'<svg class="torchdist-plot" data-metric="{_esc(metric)}" width="{width}" height="{height}"'
        f' viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg"'
        f' style="font-family:var(--jp-ui-font-family, sans-serif);font-size:10px;'
        f'max-width:{width + 100}px;min-width:0;width:100%;height:auto;color:{TEXT}">',
        f'<text x="{left}" y="13" style="font-size:12px;font-weight:600;fill:{TEXT}">{_esc(metric)}</text>',
    ]
    for value in nice_ticks(y0, y1):
        y = py(value)
        out.append(
            f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#9e9e9e"'
            f' stroke-opacity=".25"/><text x="{left - 4}" y="{y + 3:.1f}" text-anchor="end"'
            f' {label}>{_tick(value)}</text>'
        )
    base = top + ph
    out.append(f'<line x1="{left}" x2="{width - right}" y1="{base}" y2="{base}" stroke="#9e9e9e" stroke-opacity=".6"/>')
    for x, anchor in ((x0 if len(set(xs)) > 1 else xs[0], "start"), (max(xs), "end")):
        if anchor == "end" and len(set(xs)) == 1:
            break
        out.append(f'<text x="{px(x):.1f}" y="{height - 6}" text-anchor="{anchor}" {label}>{x_text(x)}</text>')
    out.append(
        f'<text x="{left + pw / 2:.1f}" y="{height - 6}" text-anchor="middle" {label}>'
        f'{"time since the start" if over_time else "step"}</text>'
    )
    if band is not None:
        edge = [f"{px(x):.1f},{py(y):.1f}" for x, y in zip(band.steps, band.high)]
        edge += [f"{px(x):.1f},{py(y):.1f}" for x, y in zip(reversed(band.steps), reversed(band.low))]
        out.append(
            f'<polygon class="torchdist-plot-band" points="{" ".join(edge)}" fill="{BAR_COLOURS["info"]}"'
            f' fill-opacity=".18" stroke="none"><title>min to max of {band.ranks} ranks</title></polygon>'
        )
        median = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(band.steps, band.median))
        out.append(
            f'<polyline class="torchdist-plot-median" points="{median}" fill="none" stroke="{TEXT}"'
            f' stroke-width="1.8" stroke-linejoin="round"><title>median of {band.ranks} ranks</title></polyline>'
        )
    for rank, pts in sorted(series.items()):
        colour = rank_colour(rank)
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        if len(pts) > 1:
            out.append(
                f'<polyline class="torchdist-plot-line" data-rank="{rank}" points="{coords}" fill="none"'
                f' stroke="{colour}" stroke-width="1.6" stroke-linejoin="round"/>'
            )
        lx, ly = pts[-1]
        out.append(
            f'<circle cx="{px(lx):.1f}" cy="{py(ly):.1f}" r="2.5" fill="{colour}">'
            f'<title>rank {rank}: {_esc(metric)}={_tick(ly)} at '
            f'{x_text(lx) if over_time else f"step {lx}"}</title></circle>'
        )
    out.append("</svg>")
    return "".join(out)


def _legend_html(ranks: List[int], more: str = "") -> str:
    """Rank swatches that wrap between entries (each entry is one unbreakable piece)."""
    items = [
        f'<span style="white-space:nowrap"><span style="color:{rank_colour(r)}">&#9644;</span> rank {r}</span>'
        for r in ranks[:LEGEND_RANKS]
    ]
    if len(ranks) > LEGEND_RANKS:
        items.append(f"<span>… {len(ranks) - LEGEND_RANKS} more ranks</span>")
    if more:
        items.append(more)
    return (
        f'<div class="torchdist-legend" style="display:flex;flex-wrap:wrap;gap:0 12px;font-size:11.5px;'
        f'color:{MUTED};margin:2px 0">{" ".join(items)}</div>'
    )


def _charts_html(charts: str, legend: str) -> str:
    # a grid, not a wrapping flex row: a chart alone on the last row is as wide as the others
    return (
        f'<div class="torchdist-plots" style="color:{TEXT}">{legend}'
        f'<div style="display:grid;grid-template-columns:repeat(auto-fill,minmax(260px,1fr));'
        f'gap:6px 16px;min-width:0">{charts}</div></div>'
    )


def plots_html(series: Dict[str, Series], over_time: Iterable[str] = ()) -> str:
    """A legend of ranks, then one chart per metric (``model.metric_series``), and per plot
    named in ``over_time`` against seconds since the run started (``model.system_series``);
    empty when nothing was reported."""
    if not series:
        return ""
    over_time = set(over_time)
    charts = "".join(plot_svg(metric, by_rank, over_time=metric in over_time) for metric, by_rank in series.items())
    return _charts_html(charts, _legend_html(sorted({rank for by_rank in series.values() for rank in by_rank})))


def bands_html(bands: Dict[str, Band]) -> str:
    """A large run's plots (``overview.metric_bands``): per metric the median and min-max band
    across ranks, and the chosen ranks' lines; empty when nothing was reported."""
    if not bands:
        return ""
    charts = "".join(plot_svg(metric, band.lines, band=band) for metric, band in bands.items())
    shown = sorted({rank for band in bands.values() for rank in band.lines})
    ranks = max(band.ranks for band in bands.values())
    key = (
        f'<span style="white-space:nowrap"><span style="color:{TEXT}">&#9644;</span> median, '
        f'<span style="color:{BAR_COLOURS["info"]}">&#9632;</span> min to max of {ranks} ranks</span>'
    )
    return _charts_html(charts, _legend_html(shown, key))
