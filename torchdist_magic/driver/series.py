"""A rank's history of one metric, column by column (``MetricSeries``): its steps in one array of
machine integers, its values in one of machine floats.

A point costs 16 bytes and no object: the channel thread adds a record's column with two
``extend`` calls (no pair made, none for the garbage collector to follow or free), and a reader
gets ``(step, value)`` pairs made for what it reads only (``pairs``, ``thinned``), which is at
most the few hundred points a plot draws, or the new points since it read last (``after``).
"""

from __future__ import annotations

from array import array
from typing import Iterator, List, Optional, Sequence, Tuple

#: a point as a reader gets it
Point = Tuple[int, float]


class MetricSeries:
    """The points of one metric of one rank, oldest first.  ``halvings`` counts the times it
    was thinned (``halve``), ``added`` every point it was ever given: with its length they say
    where a reader that read it before is (``SeriesRead``)."""

    __slots__ = ("steps", "values", "halvings", "added")

    def __init__(self) -> None:
        self.steps = array("q")
        self.values = array("d")
        self.halvings = 0
        self.added = 0

    def add(self, steps: Sequence[int], column: Sequence[object]) -> Optional[float]:
        """Add the points of ``column`` that have a number (a float: a text, ``"nan"``, is shown,
        not plotted; ``None`` is a point that lacks this metric) at their ``steps``; the newest
        value added, ``None`` for none.  ``OverflowError``, with nothing added, for a step that
        is no 64-bit integer."""
        values, kept = self.values, len(self.values)
        try:
            values.extend(column)  # the common case: a number at every point
            taken = steps
        except TypeError:  # a text or a None among them: the numbers only, at their steps
            del values[kept:]
            pairs = [(step, v) for step, v in zip(steps, column) if type(v) is float]
            if not pairs:
                return None
            taken = [step for step, _ in pairs]
            values.extend([v for _, v in pairs])
        try:
            self.steps.extend(taken)
        except OverflowError:
            del values[kept:]
            del self.steps[kept:]
            raise
        self.added += len(taken)
        return values[-1]

    def halve(self) -> None:
        """Every other point goes; the first and the newest stay."""
        del self.steps[-2:0:-2]
        del self.values[-2:0:-2]
        self.halvings += 1

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self) -> Iterator[Point]:
        return zip(self.steps, self.values)

    def pairs(self, start: int = 0) -> List[Point]:
        """The points from index ``start`` on, as ``(step, value)``."""
        return list(zip(self.steps[start:], self.values[start:]))

    def thinned(self, points: Optional[int], start: int = 0) -> List[Point]:
        """The points from index ``start`` on, or with ``points`` about that many of them, evenly
        spread, the newest kept."""
        count = len(self.steps) - start
        if points is None or count <= points:
            return self.pairs(start)
        stride = -(-count // points)
        kept = list(zip(self.steps[start::stride], self.values[start::stride]))
        if (count - 1) % stride:  # the newest was not on the stride
            kept.append((self.steps[-1], self.values[-1]))
        return kept

    def after(self, read: Optional["SeriesRead"]) -> int:
        """The index of the first point after those ``read`` saw (all: 0)."""
        if read is None or read.series is not self:
            return 0
        if read.halvings == self.halvings:
            return read.length
        # thinned since (every other point went): after the newest point not past the step of the
        # one read last, found by halves (a rank's steps go up)
        steps, low, high = self.steps, 0, len(self.steps)
        while low < high:
            middle = (low + high) // 2
            if steps[middle] <= read.last_step:
                low = middle + 1
            else:
                high = middle
        return low


class SeriesRead:
    """Where a reader is in one ``MetricSeries``: the series it read (a restart makes new ones),
    how many points it had been given then (``added``), its length, its halvings and its newest
    step."""

    __slots__ = ("series", "added", "length", "halvings", "last_step")

    def __init__(self, series: MetricSeries):
        self.series = series
        self.added = series.added
        self.length = len(series)
        self.halvings = series.halvings
        self.last_step = series.steps[-1] if series.steps else 0

    def fresh(self, series: MetricSeries) -> bool:
        """Whether ``series`` has points this read did not see."""
        return series is not self.series or series.added != self.added
