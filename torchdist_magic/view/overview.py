"""A run with many ranks in a view: when a view summarises (``is_large``), and its plots.

Above ``LARGE_RUN`` ranks a view shows the run's overview (``driver.summary``: counts by state,
bars and system numbers across ranks, the ranks worth a look) instead of one row per rank, and
plots the median and a min-max band across ranks (``metric_bands``, ``BandBuilder``) plus a few
chosen ranks.  Everything here reads a bounded copy of the metric history, so that what a view
costs depends on what it shows, not on how many ranks there are.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

from ..driver.state import RunState
from .model import Series

#: ranks above which a view summarises instead of showing a row per rank
LARGE_RUN = 16
#: points of a plot's band (median, min, max across ranks) and of each rank's line in it
BAND_POINTS = 80
#: ranks drawn as lines over the band (the first of those worth a look)
LINE_RANKS = 5
#: points read for a band, all ranks together (each rank's history is thinned to its share)
BAND_BUDGET = 8_000
#: points read for a band at a later drawing of a live view, all ranks together (each rank's
#: points since the last drawing are thinned to its share, at least one: its newest)
BAND_READ = 1_024


def is_large(num_processes: int) -> bool:
    return num_processes > LARGE_RUN


# -- plots ----------------------------------------------------------------------------------------
@dataclass
class Band:
    """One metric across many ranks: per step bucket, the min, median and max of the ranks'
    values there; ``lines`` are the chosen ranks' own points."""

    steps: List[float]
    low: List[float]
    median: List[float]
    high: List[float]
    ranks: int  # ranks that reported the metric
    lines: Series


def metric_bands(state: RunState, lines: Iterable[int] = (), points: int = BAND_POINTS) -> Dict[str, Band]:
    """``{metric: Band}``: each metric's median and min-max band across ranks in at most
    ``points`` step buckets (``BandBuilder``), from a copy of the history thinned under the
    state's lock to ``BAND_BUDGET`` points in all, plus the ranks ``lines`` drawn on their own
    (at most ``points`` points each).  A live view keeps a ``BandBuilder`` instead and adds only
    the points that came since its last drawing."""
    builder = BandBuilder(points)
    builder.add(state.metric_history(band_share(state.num_processes, BAND_BUDGET)))
    return builder.bands(state, lines)


def band_share(ranks: int, budget: int, least: int = 8) -> int:
    """Points of each rank's history read for a band: its share of ``budget`` (``least`` to
    ``BAND_POINTS``)."""
    return max(least, min(BAND_POINTS, budget // max(ranks, 1)))


class _Bucket:
    """The points of one step bucket of one metric: the largest step, the lowest and highest
    value, and each rank's point of the largest step there (its value at the bucket's end)."""

    __slots__ = ("x", "low", "high", "last", "median")

    def __init__(self, step, value, rank, point):
        self.x, self.low, self.high = step, value, value
        self.last = {rank: point}
        self.median: Optional[float] = None  # None: to work out again (points came)

    def merge(self, later: "_Bucket") -> None:
        """Take in the bucket after this one (its steps all larger): its ranks' points are
        their points at the merged bucket's end."""
        self.x, self.low, self.high = max(self.x, later.x), min(self.low, later.low), max(self.high, later.high)
        self.last.update(later.last)  # one call, not one a rank: a thousand ranks coarsen at once
        self.median = None


class _MetricBuckets:
    """One metric's buckets: bucket ``b`` holds the steps ``b * width`` to ``(b + 1) * width - 1``;
    ``width`` doubles (two buckets become one) while the steps seen span more than ``points``
    buckets."""

    def __init__(self, points: int):
        self.points = points
        self.width = 1
        self.buckets: Dict[int, _Bucket] = {}
        self.ranks: set = set()
        self.first = self.last = None  # the lowest and highest bucket

    def add(self, rank: int, series: Iterable[Tuple[int, float]]) -> None:
        self.ranks.add(rank)
        buckets, width = self.buckets, self.width
        first, last = self.first, self.last
        for point in series:
            step, value = point
            if not math.isfinite(value):
                continue
            b = int(step // width)
            bucket = buckets.get(b)
            if bucket is None:
                buckets[b] = _Bucket(step, value, rank, point)
                if first is None or b < first:
                    first = b
                if last is None or b > last:
                    last = b
                continue
            # ``_Bucket.add``, inline: this runs for every point of every rank
            if step > bucket.x:
                bucket.x = step
            if value < bucket.low:
                bucket.low = value
            elif value > bucket.high:
                bucket.high = value
            had = bucket.last.get(rank)
            if had is None or step >= had[0]:
                bucket.last[rank] = point
            bucket.median = None
        self.first, self.last = first, last
        while self.last is not None and self.last - self.first >= self.points:
            self._coarsen()

    def _coarsen(self) -> None:
        """Twice as wide buckets: each pair of buckets merged (in order: the later into the
        earlier)."""
        self.width *= 2
        merged: Dict[int, _Bucket] = {}
        for b, bucket in sorted(self.buckets.items()):
            into = merged.get(b // 2)
            if into is None:
                merged[b // 2] = bucket  # alone in its pair: its median stands
            else:
                into.merge(bucket)
        self.buckets = merged
        self.first, self.last = self.first // 2, self.last // 2

    def band(self) -> Optional[Band]:
        if not self.buckets:
            return None
        steps, low, median, high = [], [], [], []
        for _, bucket in sorted(self.buckets.items()):
            if bucket.median is None:
                bucket.median = statistics.median([value for _, value in bucket.last.values()])
            steps.append(bucket.x)
            low.append(bucket.low)
            median.append(bucket.median)
            high.append(bucket.high)
        return Band(steps=steps, low=low, median=median, high=high, ranks=len(self.ranks), lines={})


class BandBuilder:
    """Each metric's band across ranks (``Band``), built as points come (``add``): per step
    bucket, the lowest and highest value of any rank there and the median of the ranks' values
    at the bucket's end (each rank's point of the largest step there), in at most ``points``
    buckets of a width that doubles as the steps grow.  Adding points updates the buckets they
    fall in; a drawing (``bands``) works out the medians of those buckets only."""

    def __init__(self, points: int = BAND_POINTS):
        self.points = points
        self.metrics: Dict[str, _MetricBuckets] = {}

    def add(self, history: Dict[str, Dict[int, List[Tuple[int, float]]]]) -> None:
        """``{metric: {rank: [(step, value), ...]}}`` (``metric_history``, ``metric_points``)."""
        for name, by_rank in history.items():
            metric = self.metrics.get(name)
            if metric is None:
                metric = self.metrics[name] = _MetricBuckets(self.points)
            for rank, series in by_rank.items():
                metric.add(rank, series)

    def bands(self, state: RunState, lines: Iterable[int] = ()) -> Dict[str, Band]:
        """``{metric: Band}`` of the points added, with the ranks ``lines`` drawn on their own
        (at most ``points`` points each, read from ``state``)."""
        lines = list(lines)
        chosen = state.metric_history(self.points, ranks=lines) if lines else {}
        bands = {}
        for name, metric in self.metrics.items():
            band = metric.band()
            if band is None:
                continue
            for rank, pts in chosen.get(name, {}).items():
                finite = [p for p in pts if math.isfinite(p[1])]
                if finite:
                    band.lines[rank] = finite
            bands[name] = band
        return bands
