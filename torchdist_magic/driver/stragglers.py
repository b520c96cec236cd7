"""Stragglers: ranks that step well below the others' pace, or fall behind them, for a while.

``Pace`` is fed every record a ``RunState`` applies (``saw``, O(1) per record, under the state's
lock): the time a rank was last heard from and, for each of its progress bars, its recent
``(time, n)`` samples.  A rank's step rate on a bar is measured over the last ``RATE_WINDOW``
seconds on the driver's clock, so a rank that goes quiet slows down too.

Step times.  ``RunState`` also gives each rank's smoothed seconds per step of its innermost
running bar (``step_time``): a rank whose step time is above ``SLOW_STEP_RATIO`` times the
median of the ranks on the same bar is slow too.  System samples (``SystemMetrics``) come from a
rank's launcher, not the rank: they are no sign of the rank's life.

Step splits.  ``RunState`` gives each rank's step split too (``step_split``: the shares of its
recent steps spent waiting for data, computing and waiting in collectives, ``stepsplit``), which
says why where the pace cannot: in a synchronous job every rank steps at the slowest one's pace.
A rank whose data share is ``SPLIT_MARGIN`` above the others' median (and ``SPLIT_RATIO`` times
it) is *waiting for data*; one whose communication share is that far below the others' median
(and its compute share above theirs) is *slow compute*: the others wait for it.  The ranks that
only wait are not listed.  These compare from ``MIN_SPLIT_PEERS`` ranks on.

Bars are told apart by their description: an inner loop's bar is a new bar every epoch (a new
id), and ranks in different epochs still compare on it; its count goes on across epochs (each
new bar of the same description starts where the last one ended).

At most every ``CHECK_EVERY`` seconds (when a record arrives, or when asked), each bar that
several ranks run is compared across them (O(ranks)): a rank is *slow* when its rate stays below
``SLOW_RATIO`` times the median rate of the ranks running that bar, *behind* when its count is
below ``1 - BEHIND_RATIO`` times the median count (and at least ``BEHIND_MIN_STEPS`` steps
short).  Either must hold for ``SLOW_FOR`` seconds before the rank is listed, with why; it is
unlisted once neither holds for ``SLOW_FOR`` seconds while it can still be compared.  When no
comparison is possible any more (the others have finished, the run ended) the list stays as it
was: the summary names who straggled.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..core import events

#: seconds over which a rank's step rate is measured
RATE_WINDOW = 5.0
#: a rank is slow below this fraction of the median rate of the ranks on the same bar
SLOW_RATIO = 0.5
#: a rank is behind when its count is below ``1 - BEHIND_RATIO`` times the median count...
BEHIND_RATIO = 0.2
#: ... and at least this many steps short of it
BEHIND_MIN_STEPS = 2
#: seconds a rank must stay slow or behind before it is listed (and fine before it is unlisted)
SLOW_FOR = 5.0
#: seconds between two comparisons across ranks (each costs O(ranks))
CHECK_EVERY = 0.5
#: fewest ranks running a bar for a median to mean anything
MIN_PEERS = 3
#: bars tracked per rank (the newest ones): nested loops rarely go deeper
MAX_BARS = 4
#: a rank is slow when its step time (``RunState``'s ``step_time``) is above this many times
#: the median step time of the ranks on the same bar
SLOW_STEP_RATIO = 2.0
#: a rank's share of its step (data waits; communication, below) must differ from the others'
#: median by this much (a fraction of the step) ...
SPLIT_MARGIN = 0.2
#: ... and by this factor, for it to say why the rank is slow
SPLIT_RATIO = 2.0
#: fewest ranks with a step split for it to be compared (one rank against the other)
MIN_SPLIT_PEERS = 2


class Straggler(NamedTuple):
    """A rank listed by ``RunState.stragglers()``: its number, host, and why in words."""

    rank: int
    host: str
    why: str


@dataclass
class _Bar:
    samples: Deque[Tuple[float, int]]  # (driver time, count), the oldest within RATE_WINDOW first
    n: int  # the count: this bar's and its earlier ones' steps
    running: bool
    bar_id: str  # the newest bar of this description
    base: int = 0  # the steps of its earlier bars


def _rate_text(rate: float) -> str:
    return f"{rate:.2f} it/s" if rate < 10 else f"{rate:.0f} it/s"


def _percent(share: float) -> str:
    return f"{share * 100:.0f} %"


def _seconds_text(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


class Pace:
    """Every rank's pace in one run attempt (see the module's docstring); not thread-safe: its
    ``RunState`` calls it under its lock."""

    def __init__(self, num_processes: int, clock: Callable[[], float]):
        self.clock = clock
        self.num_processes = num_processes
        #: per rank, the driver time of its last record (None: not heard from yet)
        self.last_seen: List[Optional[float]] = [None] * num_processes
        self._bars: List[Dict[str, _Bar]] = [{} for _ in range(num_processes)]
        self._odd_since: List[Optional[float]] = [None] * num_processes  # slow or behind since
        self._fine_since: List[Optional[float]] = [None] * num_processes  # a listed rank, fine since
        self.listed: Dict[int, str] = {}  # rank -> why
        self._checked = float("-inf")
        #: per rank, its smoothed seconds per step and the bar they are of (None: no running bar)
        self._step_times: List[Optional[Tuple[float, str]]] = [None] * num_processes
        #: per rank, its step split (``RunState``'s ``step_split``), None before any
        self._splits: List[Optional[Dict[str, float]]] = [None] * num_processes

    def step_time(self, rank: int, seconds: Optional[float], bar: str) -> None:
        """``rank``'s current step time on ``bar`` (None: it has no running bar)."""
        self._step_times[rank] = None if seconds is None else (seconds, bar)

    def step_split(self, rank: int, split: Optional[Dict[str, float]]) -> None:
        """``rank``'s current step split (``{"data": f, "compute": f, "comm": f}``; None: none)."""
        self._splits[rank] = split

    def saw(self, rank: int, event: events.Event) -> None:
        now = self.clock()
        if isinstance(event, events.SystemMetrics):  # sampled beside the rank: no sign of its life
            if now - self._checked >= CHECK_EVERY:
                self.check(now)
            return
        self.last_seen[rank] = now
        if isinstance(event, events.Progress):
            self._progress(rank, event, now)
        if now - self._checked >= CHECK_EVERY:
            self.check(now)

    def _progress(self, rank: int, e: events.Progress, now: float) -> None:
        bars = self._bars[rank]
        key = e.desc or e.bar
        if e.state == "cleared":
            if key in bars and bars[key].bar_id == e.bar:
                del bars[key]
            return
        bar = bars.get(key)
        if bar is None:
            if len(bars) >= MAX_BARS:
                del bars[next(iter(bars))]
            bar = bars[key] = _Bar(deque(), e.n, True, e.bar)
        elif bar.bar_id != e.bar:  # the next epoch's bar: counting goes on
            bar.base, bar.bar_id = bar.n, e.bar
        bar.n, bar.running = bar.base + e.n, e.state == "running"
        bar.samples.append((now, bar.n))
        # keep one sample older than the window: the rate spans the whole window
        while len(bar.samples) > 2 and bar.samples[1][0] <= now - RATE_WINDOW:
            bar.samples.popleft()

    @staticmethod
    def _rate(bar: _Bar, now: float) -> Optional[float]:
        """Steps per second over the window up to ``now`` (a quiet rank's rate falls); None
        until the bar has been seen for a while."""
        t0, n0 = bar.samples[0]
        if now - t0 < RATE_WINDOW / 2:
            return None
        return (bar.n - n0) / (now - t0)

    def check(self, now: Optional[float] = None) -> None:
        """Compare the ranks on each bar and update ``listed`` (O(ranks × bars))."""
        now = self.clock() if now is None else now
        self._checked = now
        # per rank, why it is odd on the bar that says most: slow before behind, then the
        # fastest bar (the innermost loop) first
        odd: Dict[int, Tuple[Tuple[int, float], str]] = {}

        def note(rank: int, priority: Tuple[int, float], why: str) -> None:
            if rank not in odd or odd[rank][0] < priority:
                odd[rank] = (priority, why)

        compared = set()
        for name in {b for bars in self._bars for b in bars}:
            on_bar = [(r, bars[name]) for r, bars in enumerate(self._bars) if name in bars]
            rates = {r: self._rate(b, now) for r, b in on_bar if b.running}
            rates = {r: v for r, v in rates.items() if v is not None}
            if len(rates) >= MIN_PEERS:
                median = statistics.median(rates.values())
                compared.update(rates)
                for r, rate in rates.items():
                    if rate < SLOW_RATIO * median:
                        note(r, (1, median), f"{_rate_text(rate)} against a median of {_rate_text(median)} ({name})")
            if len(on_bar) >= MIN_PEERS and any(b.running for _, b in on_bar):
                median_n = statistics.median(b.n for _, b in on_bar)
                for r, b in on_bar:
                    compared.add(r)
                    if b.running and b.n < (1 - BEHIND_RATIO) * median_n and median_n - b.n >= BEHIND_MIN_STEPS:
                        note(r, (0, median_n), f"at step {b.n} where the median is {median_n:g} ({name})")
        by_bar: Dict[str, Dict[int, float]] = {}
        for r, step in enumerate(self._step_times):
            if step is not None:
                by_bar.setdefault(step[1], {})[r] = step[0]
        for name, steps in by_bar.items():
            if len(steps) >= MIN_PEERS:
                median = statistics.median(steps.values())
                compared.update(steps)
                for r, seconds in steps.items():
                    if median > 0 and seconds > SLOW_STEP_RATIO * median:
                        # the rank's own measure: said when the driver's measures say nothing
                        note(
                            r,
                            (-1, seconds),
                            f"{_seconds_text(seconds)}/step against a median of {_seconds_text(median)}/step ({name})",
                        )
        self._check_splits(note, compared)
        for r in compared:
            if r in odd:
                self._fine_since[r] = None
                if self._odd_since[r] is None:
                    self._odd_since[r] = now
                if now - self._odd_since[r] >= SLOW_FOR:
                    self.listed[r] = f"{odd[r][1]}, for {now - self._odd_since[r]:.0f} s"
            else:
                self._odd_since[r] = None
                if r in self.listed:
                    if self._fine_since[r] is None:
                        self._fine_since[r] = now
                    if now - self._fine_since[r] >= SLOW_FOR:
                        del self.listed[r]
                        self._fine_since[r] = None

    def _check_splits(self, note: Callable[[int, Tuple[int, float], str], None], compared: set) -> None:
        """Name why a rank holds the others up, from the step splits (see the module's docstring)."""
        splits = {r: s for r, s in enumerate(self._splits) if s is not None}
        if len(splits) < MIN_SPLIT_PEERS:
            return
        compared.update(splits)
        for r, split in splits.items():
            others = [s for o, s in splits.items() if o != r]
            data = statistics.median(s["data"] for s in others)
            comm = statistics.median(s["comm"] for s in others)
            compute = statistics.median(s["compute"] for s in others)
            if split["data"] - data >= SPLIT_MARGIN and split["data"] >= SPLIT_RATIO * data:
                note(
                    r,
                    (2, split["data"]),
                    f"waiting for data: {_percent(split['data'])} of its step (others {_percent(data)})",
                )
            elif (
                comm - split["comm"] >= SPLIT_MARGIN
                and comm >= SPLIT_RATIO * split["comm"]
                and split["compute"] > compute
            ):
                note(
                    r,
                    (2, split["compute"]),
                    f"slow compute: {_percent(split['compute'])} of its step "
                    f"computing (others {_percent(compute)}), while the others "
                    f"wait in communication ({_percent(comm)} of their step)",
                )

    def stragglers(self, hosts: Sequence[str], check: bool = True) -> List[Straggler]:
        """The listed ranks, by rank (``check``: compared again first, when due)."""
        if check and self.clock() - self._checked >= CHECK_EVERY:
            self.check()
        return [Straggler(r, hosts[r], why) for r, why in sorted(self.listed.items())]
