"""What a reader of a run's state gets and may ask: a rank's copy as a snapshot holds it
(``rank_snapshot``), where a reader of the metrics is (``MetricCursor``), and the one table of
the reads a kernel may ask of a state held by another process (``READS``, ``FACTS``).  The reads
themselves are ``RunState``'s methods, in ``state``."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from ..core import events

from .series import SeriesRead
from .snapshot import RankSnapshot


class MetricCursor:
    """Where a reader of ``metric_points`` is in each rank's history of each metric: by rank,
    then by name, what it read last (``series.SeriesRead``)."""

    def __init__(self):
        self.read: Dict[int, Dict[str, SeriesRead]] = {}


def rank_snapshot(rs) -> RankSnapshot:
    """``rs`` (a ``RankState``) copied.  Its bars' dicts are shared, not copied: the state
    replaces a bar's dict on each update and never changes one in place."""
    return RankSnapshot(
        rank=rs.rank,
        host=rs.host,
        pid=rs.pid,
        state=rs.state,
        exit_code=rs.exit_code,
        started=rs.started,
        ended=rs.ended,
        progress=dict(rs.progress),
        metrics=dict(rs.metrics),
        dropped=rs.dropped,
        failure=rs.failure,
        log_lines=len(rs.logs),
        system=dict(rs.system),
        step_time=rs.step_time,
        step_split=None if rs.step_split is None else dict(rs.step_split),
    )


def thinned(kept: list, points: Optional[int]) -> list:
    """A copy of ``kept``, or with ``points`` about that many of it, evenly spread, the newest kept."""
    if points is None or len(kept) <= points:
        return list(kept)
    last = kept[-1]
    kept = kept[:: -(-len(kept) // points)]
    if kept[-1] is not last:
        kept.append(last)
    return kept


#: the attributes of a run's state a kernel reads as they are (``facts``)
FACTS = (
    "run_id",
    "num_processes",
    "backend",
    "use_gpu",
    "job_name",
    "state",
    "started",
    "ended",
    "failure",
    "message",
    "attempt",
    "max_attempts",
    "attempts",
    "version",
    "finished",
)
#: the reads a kernel may ask of a run's state held by another process, each a function of the
#: state and the request (``events.ReadState``): the one place a read is declared.  The feed's
#: server (``supervise.feed``) answers with it, and so does its client (``handles.feed``) from
#: the state it rebuilt once that process has gone
READS: Dict[str, Callable[[Any, events.ReadState], Any]] = {
    "snapshot": lambda state, q: state.snapshot(q.since),
    "large_view": lambda state, q: state.large_view(
        q.since, q.names[0] if q.names else None, None if q.at < 0 else q.at
    ),
    "read_log": lambda state, q: state.read_log(q.at, q.start, q.limit, q.newest),
    "read_logs": lambda state, q: state.read_logs([tuple(read) for read in q.reads], q.limit),
    "recent_log": lambda state, q: state.recent_log(q.at, q.limit if q.limit is not None else 0),
    "metric_history": lambda state, q: state.metric_history(q.points, q.ranks, q.names),
    "system_history": lambda state, q: state.system_history(q.at, q.points),
    "logs": lambda state, q: state.logs(q.at, q.attempt),
    "profile": lambda state, q: state.profile(),
    "failures": lambda state, q: state.failures(),
    "goodput": lambda state, q: state.goodput(),
    "stragglers": lambda state, q: state.stragglers(),
    "running": lambda state, q: state.running(),
    "elapsed": lambda state, q: state.elapsed(),
    "idle": lambda state, q: state.idle(),
    "collectives": lambda state, q: dict(state.collectives),
    "facts": lambda state, q: {name: getattr(state, name) for name in FACTS},
}
