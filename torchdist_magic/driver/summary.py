"""A run of many ranks summarised across its ranks (``Overview``), worked out where its state is.

Above ``view.overview.LARGE_RUN`` ranks a view shows, instead of a row per rank: counts by
state, the hosts, each progress bar across ranks (min / median / max, how many are behind), each
system number across ranks, and the ranks worth a look first, each with why (failed, straggling,
silent, slowest, furthest behind), at most ``LOOK_RANKS`` of them; any other rank is reached by
its number or by its host's page (``PAGE_RANKS`` at most).

``large_view`` gives a view all of that in one read (``LargeView``): the run without its ranks,
the overview, and the snapshots of only the ranks shown.  A run whose state is in another
process (``--channel process``, a detached run) works it out there (``feed``), so that the
kernel gets a few kilobytes and a few hundred objects a refresh, not a thousand ranks' snapshots
to unpickle, summarise and collect.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..core.failure import Failure
from ..core.formats import format_bytes, format_duration, format_step_time
from .snapshot import RankSnapshot, RunSnapshot
from .stragglers import BEHIND_MIN_STEPS, BEHIND_RATIO

#: ranks listed as worth a look, at most
LOOK_RANKS = 8
#: ranks of one host's page, at most (the rest are reached by number)
PAGE_RANKS = 16
#: seconds without a record after which a running rank is called silent
SILENT_AFTER = 10.0


@dataclass
class BarSummary:
    """One progress bar across the ranks that run it (those showing it at the same depth)."""

    desc: str
    ranks: int
    total: Optional[int]
    n_min: int
    n_median: float
    n_max: int
    behind: int  # ranks behind the median count (outer loop: inner ones restart)
    rate_median: Optional[float]  # steps per second (n / elapsed), median across ranks

    @property
    def fractions(self) -> Optional[Tuple[float, float, float]]:
        """(min, median, max) of the bar filled, 0..1; None without a total."""
        if not self.total:
            return None
        return tuple(min(max(v / self.total, 0.0), 1.0) for v in (self.n_min, self.n_median, self.n_max))

    @property
    def text(self) -> str:
        """``median 40/100 · min 12 · max 58 · 3 behind · 2.10 it/s``"""
        of = f"/{self.total}" if self.total else ""
        parts = [f"median {self.n_median:g}{of}", f"min {self.n_min}", f"max {self.n_max}"]
        if self.behind:
            parts.append(f"{self.behind} behind")
        if self.rate_median:
            parts.append(f"{self.rate_median:.2f} it/s")
        return " · ".join(parts)


@dataclass
class RankLook:
    """A rank worth a look, and why."""

    rank: int
    host: str
    state: str
    why: str
    kind: str  # failed, straggler, silent, slowest, behind


@dataclass
class Overview:
    """A large run at one moment (``overview``)."""

    num_processes: int
    states: List[Tuple[str, int]]  # (state, ranks), most common first
    hosts: List[Tuple[str, List[int]]]  # (host, its ranks), by host name
    bars: List[BarSummary]
    look: List[RankLook]
    stragglers: List[int] = field(default_factory=list)
    system: List["SystemSummary"] = field(default_factory=list)

    @property
    def counts_text(self) -> str:
        """``1024 ranks on 128 hosts: 1019 running, 3 done, 2 failed``"""
        hosts = f" on {len(self.hosts)} host{'s' if len(self.hosts) != 1 else ''}" if self.hosts else ""
        states = ", ".join(f"{count} {state}" for state, count in self.states)
        return f"{self.num_processes} ranks{hosts}: {states}"

    def host_ranks(self, host: str) -> List[int]:
        return next((ranks for name, ranks in self.hosts if name == host), [])


def _rate(bar: dict) -> Optional[float]:
    elapsed = bar.get("elapsed") or 0.0
    return (bar.get("n") or 0) / elapsed if elapsed > 0 else None


def bar_summaries(ranks: Sequence[RankSnapshot]) -> List[BarSummary]:
    """Each depth of bar (outer loop, innermost loop) across the ranks showing one."""
    by_depth: Dict[int, List[dict]] = {}
    for rs in ranks:
        for depth, bar in enumerate(rs.shown_progress()):
            by_depth.setdefault(depth, []).append(bar)
    out = []
    for depth, bars in sorted(by_depth.items()):
        counts = sorted(b.get("n") or 0 for b in bars)
        median = statistics.median(counts)
        rates = [r for r in map(_rate, bars) if r is not None]
        totals = Counter(b.get("total") for b in bars)
        descs = Counter(str(b.get("desc") or "") for b in bars)
        out.append(
            BarSummary(
                desc=descs.most_common(1)[0][0],
                ranks=len(bars),
                total=totals.most_common(1)[0][0],
                n_min=counts[0],
                n_median=median,
                n_max=counts[-1],
                # an inner loop's bar starts again every epoch: its count says nothing about who is behind
                behind=0
                if depth
                else sum(1 for n in counts if n < (1 - BEHIND_RATIO) * median and median - n >= BEHIND_MIN_STEPS),
                rate_median=statistics.median(rates) if rates else None,
            )
        )
    return out


@dataclass
class SystemSummary:
    """One system number across the ranks that have it (the latest sample of each): min,
    median and max, the extremes named by rank."""

    key: str  # cpu_percent, rss_bytes, gpu_memory_used_bytes, step_time, data, compute, comm
    label: str  # "rss"
    ranks: int
    low: float
    low_rank: int
    median: float
    high: float
    high_rank: int

    @property
    def text(self) -> str:
        """``rss: min 812 MiB (rank 7), median 1.1 GiB, max 2.3 GiB (rank 3), 1024 ranks``"""
        show = _SYSTEM_FORMATS[self.key]
        return (
            f"{self.label}: min {show(self.low)} (rank {self.low_rank}), median {show(self.median)}, "
            f"max {show(self.high)} (rank {self.high_rank}), {self.ranks} rank{'s' if self.ranks != 1 else ''}"
        )


def _share(value: float) -> str:
    return f"{value * 100:.0f}%"


_SYSTEM_FORMATS = {
    "cpu_percent": lambda v: f"{v:.0f}%",
    "rss_bytes": format_bytes,
    "gpu_memory_used_bytes": format_bytes,
    "gpu_util_percent": lambda v: f"{v:.0f}%",
    "step_time": format_step_time,
    "data": _share,
    "compute": _share,
    "comm": _share,
}
_SYSTEM_LABELS = {
    "cpu_percent": "cpu",
    "rss_bytes": "rss",
    "gpu_memory_used_bytes": "gpu memory",
    "gpu_util_percent": "gpu util",
    "step_time": "step time",
    # the step split's shares (``stepsplit``)
    "data": "waiting for data",
    "compute": "computing",
    "comm": "waiting in communication",
}


_SPLIT_KEYS = ("data", "compute", "comm")
_SAMPLE_KEYS = tuple(key for key in _SYSTEM_LABELS if key != "step_time" and key not in _SPLIT_KEYS)


def system_summaries(ranks: Sequence[RankSnapshot]) -> List[SystemSummary]:
    """Each system number (``_SYSTEM_LABELS``) across the ranks: one pass over the ranks."""
    found: Dict[str, List[Tuple[float, int]]] = {key: [] for key in _SYSTEM_LABELS}
    for rs in ranks:
        if rs.system:
            for key in _SAMPLE_KEYS:
                value = rs.system.get(key)
                if value is not None:
                    found[key].append((value, rs.rank))
        if rs.step_time is not None:
            found["step_time"].append((rs.step_time, rs.rank))
        if rs.step_split:
            for key in _SPLIT_KEYS:
                value = rs.step_split.get(key)
                if value is not None:
                    found[key].append((value, rs.rank))
    out = []
    for key, label in _SYSTEM_LABELS.items():
        values = sorted(found[key])
        if values:
            out.append(
                SystemSummary(
                    key,
                    label,
                    len(values),
                    values[0][0],
                    values[0][1],
                    statistics.median(v for v, _ in values),
                    values[-1][0],
                    values[-1][1],
                )
            )
    return out


def ranks_worth_a_look(snap: RunSnapshot, limit: int = LOOK_RANKS) -> List[RankLook]:
    """At most ``limit`` ranks, in this order: failed (root cause first), stragglers, silent
    longest, slowest, furthest behind; each rank once, with why."""
    out: List[RankLook] = []
    seen = set()

    def add(rank: int, why: str, kind: str) -> None:
        if rank not in seen and len(out) < limit:
            seen.add(rank)
            rs = snap.ranks[rank]
            out.append(RankLook(rank, rs.host, rs.state, why, kind))

    for failure in snap.failures():
        add(failure.rank, failure.summary(), "failed")
    for s in snap.stragglers:
        add(s.rank, f"\u26a0 straggler: {s.why}", "straggler")
    running = [rs for rs in snap.ranks if rs.state == "running"]
    quiet = snap.quiet or (None,) * len(snap.ranks)
    silent = sorted(
        (rs for rs in running if (quiet[rs.rank] or 0) >= SILENT_AFTER), key=lambda rs: -(quiet[rs.rank] or 0)
    )
    for rs in silent[:2]:
        add(rs.rank, f"silent for {format_duration(quiet[rs.rank])}", "silent")
    inner = [(rs, rs.shown_progress()[-1]) for rs in running if rs.shown_progress()]
    rates = [(r, rs) for rs, bar in inner for r in [_rate(bar)] if r is not None]
    if len(rates) >= 2:
        median = statistics.median(r for r, _ in rates)
        for rate, rs in sorted(rates, key=lambda item: item[0])[:2]:
            if rate < median:
                add(rs.rank, f"slowest: {rate:.2f} it/s, median {median:.2f}", "slowest")
    where = [(rs, pos) for rs in running for pos in [_position(rs)] if pos is not None]
    if len(where) >= 2:
        median_at = statistics.median(pos for _, pos in where)
        desc = str(where[0][0].shown_progress()[0].get("desc") or "step")
        for rs, pos in sorted(where, key=lambda item: item[1])[:2]:
            if pos < median_at:
                add(rs.rank, f"furthest behind: {desc} {pos:.4g}, median {median_at:.4g}", "behind")
    return out


def _position(rs: RankSnapshot) -> Optional[float]:
    """How far a rank got: its outer bar's count, plus the inner bar's fraction done (an inner
    loop's count alone starts again every epoch)."""
    bars = rs.shown_progress()
    if not bars:
        return None
    outer = bars[0].get("n") or 0
    inner = bars[-1] if len(bars) > 1 else None
    if inner is not None and inner.get("total"):
        return outer + min((inner.get("n") or 0) / inner["total"], 1.0)
    return float(outer)


def overview(state) -> Overview:
    """``state`` (a ``RunState`` or a ``RunSnapshot``) summarised: O(ranks)."""
    snap = state if isinstance(state, RunSnapshot) else state.snapshot()
    states = Counter(rs.state for rs in snap.ranks).most_common()
    hosts: Dict[str, List[int]] = {}
    for rs in snap.ranks:
        if rs.host:
            hosts.setdefault(rs.host, []).append(rs.rank)
    return Overview(
        num_processes=snap.num_processes,
        states=states,
        hosts=sorted(hosts.items()),
        bars=bar_summaries(snap.ranks),
        look=ranks_worth_a_look(snap),
        stragglers=[s.rank for s in snap.stragglers],
        system=system_summaries(snap.ranks),
    )


@dataclass(frozen=True)
class LargeView:
    """What a view of a large run shows at one moment (``large_view``)."""

    #: the run at that moment, without its ranks (``ranks`` and ``quiet`` are empty: they are
    #: summarised in ``overview``); ``changed`` and ``version`` as ``RunState.snapshot`` gives them
    snap: RunSnapshot
    overview: Overview
    #: the ranks shown: those worth a look, then the page's, by rank
    shown: Dict[int, RankSnapshot]
    #: the page asked for (a host's first ``PAGE_RANKS`` ranks, or the rank asked for)
    page: List[int]
    #: the failed ranks' failures, root cause first (``RunState.failures``)
    failures: Tuple[Failure, ...]


def page_ranks(ov: Overview, host: Optional[str] = None, rank: Optional[int] = None) -> List[int]:
    """The ranks of a page: ``rank`` alone when given, else ``host``'s first ``PAGE_RANKS``."""
    if rank is not None:
        return [rank] if 0 <= rank < ov.num_processes else []
    return ov.host_ranks(host)[:PAGE_RANKS] if host else []


def large_view(snap: RunSnapshot, host: Optional[str] = None, rank: Optional[int] = None) -> LargeView:
    """``snap`` summarised (``overview``) with the snapshots of the ranks a view shows: those
    worth a look and the page of ``host`` or of ``rank`` (``page_ranks``)."""
    ov = overview(snap)
    page = page_ranks(ov, host, rank)
    shown = {r: snap.ranks[r] for r in [look.rank for look in ov.look] + page}
    return LargeView(
        snap=dataclasses.replace(snap, ranks=(), quiet=()),
        overview=ov,
        shown=shown,
        page=page,
        failures=tuple(snap.failures()),
    )
