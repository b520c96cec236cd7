"""The reading side of ``RunState`` (``RunStateReads``, a base of it): what views, the supervisor
and the summary ask a run's state, each answer a copy taken under the state's own lock, so that a
reader in any thread never holds it longer than the copy takes."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from ..core import events

from ..core.failure import Failure
from .goodput import AttemptTimes, goodput
from .logstore import LogRead
from .rootcause import root_cause_first
from .snapshot import SYSTEM_HISTORY_KEYS, RankSnapshot, Refusal, RunSnapshot
from .stragglers import Straggler
from .summary import LargeView, large_view


class RunStateReads:
    """The reading methods of ``RunState``; they read the fields its constructor sets."""

    #: CPU seconds that another process spent answering this state's reads (``HostedState``):
    #: none, for a state in this process
    served_cpu = 0.0

    @property
    def hosted(self) -> bool:
        """Whether the reads go to another process (``HostedState``): never, for this one."""
        return False

    @property
    def finished(self) -> bool:
        return self.ended is not None

    def elapsed(self) -> float:
        return (self.ended or time.time()) - self.started

    def idle(self) -> float:
        """Seconds since any rank last sent output, progress or metrics (or the attempt began)."""
        return time.monotonic() - self.last_activity

    def failures(self) -> List[Failure]:
        """Failed ranks, root cause first: the earliest failure that is not merely a peer
        noticing that another rank went away (clocks of different hosts may disagree)."""
        with self._lock:
            found = [rs.failure for rs in self.ranks if rs.failure is not None]
        return root_cause_first(found)

    def profile(self):
        """The current attempt's profile (``profiles.Profile``: ``--profile``), with each rank's
        step split; None without one, or before any rank's profile came."""
        profiles = self.profiles
        if profiles is None:
            return None
        with self._lock:
            splits = {rs.rank: None if rs.step_split is None else dict(rs.step_split) for rs in self.ranks}
        return profiles.profile(splits)

    def _data_stall(self) -> float:
        return max((rs.step_totals.get("data_s", 0.0) for rs in self.ranks), default=0.0)

    def goodput(self) -> Dict[str, float]:
        """Where the run's wall time went so far (``goodput``): ``startup_s``, ``training_s``,
        ``lost_to_restarts_s``, ``lost_to_hangs_s``, ``data_stall_s``, ``wall_s``,
        ``rank_seconds``, and with GPUs ``gpu_hours``."""
        with self._lock:
            end = self.ended or time.time()
            attempts = [
                AttemptTimes(a.started, a.ended, a.first_work, a.checkpoint, a.data_stall_s) for a in self.attempts
            ]
            attempts.append(
                AttemptTimes(self.attempt_started, end, self.first_work, self.last_checkpoint, self._data_stall())
            )
            return goodput(
                self.started,
                end,
                attempts,
                ranks=self.num_processes - len(self.idle_ranks),
                use_gpu=self.use_gpu,
                hang_lost_s=self.hang_lost_s,
            )

    def stragglers(self) -> List[Straggler]:
        """Ranks of the current attempt that step well below the others' pace or fall behind
        them, for several seconds (``stragglers`` names the thresholds): ``(rank, host, why)``
        by rank.  After the run, those that were listed when it ended."""
        with self._lock:
            return self._pace.stragglers([rs.host for rs in self.ranks], check=self.ended is None)

    def running(self) -> List[int]:
        """The ranks of the current attempt that have not exited."""
        with self._lock:
            return [
                rs.rank for rs in self.ranks if rs.exit_code is None and rs.state not in ("done", "failed", "cancelled")
            ]

    def all_exited(self) -> bool:
        with self._lock:
            return all(
                rs.exit_code is not None or rs.state in ("done", "failed", "cancelled", "idle") for rs in self.ranks
            )

    def all_exited_ok(self) -> bool:
        with self._lock:
            return all(rs.exit_code == 0 or rs.state == "idle" for rs in self.ranks)

    def snapshot(self, since: Optional[int] = None) -> RunSnapshot:
        """The run and every rank as they are now, copied at once; ``changed`` names the ranks
        changed after version ``since`` (every rank when ``since`` is None).  A rank unchanged
        since the last snapshot is the same ``RankSnapshot`` (they are frozen): a snapshot copies
        what changed, not every rank."""
        with self._lock:
            kept, kept_at = self._rank_snapshots
            versions = self._rank_versions
            ranks = tuple(
                rank_snapshot(rs) if kept is None or versions[rs.rank] > kept_at else kept[rs.rank] for rs in self.ranks
            )
            self._rank_snapshots = (ranks, self.version)
            changed = frozenset(r for r, v in enumerate(self._rank_versions) if since is None or v > since)
            now = self._pace.clock()
            quiet = tuple(None if seen is None else now - seen for seen in self._pace.last_seen)
            return RunSnapshot(
                version=self.version,
                run_id=self.run_id,
                num_processes=self.num_processes,
                backend=self.backend,
                use_gpu=self.use_gpu,
                job_name=self.job_name,
                state=self.state,
                started=self.started,
                ended=self.ended,
                failure=self.failure,
                message=self.message,
                attempt=self.attempt,
                max_attempts=self.max_attempts,
                attempts=tuple(self.attempts),
                ranks=ranks,
                stacks=dict(self.stacks),
                changed=changed,
                quiet=quiet,
                tracking=self.tracking,
                refusals=tuple(Refusal(r.kind, r.count, r.rank, r.detail) for r in self.refusals.values()),
                verdict=self.verdict,
                preflight=dict(self.preflight),
                goodput=self.goodput(),
                stragglers=tuple(self._pace.stragglers([rs.host for rs in self.ranks], check=self.ended is None)),
            )

    def changed_since(self, since: Optional[int] = None) -> Tuple[int, List[int]]:
        """The state's version now, and the ranks changed after version ``since`` (every rank
        when None): what ``snapshot(since).changed`` names, without the snapshot."""
        with self._lock:
            return self.version, [r for r, v in enumerate(self._rank_versions) if since is None or v > since]

    def large_view(
        self, since: Optional[int] = None, host: Optional[str] = None, rank: Optional[int] = None
    ) -> LargeView:
        """What a view of a large run shows (``summary.large_view``): ``snapshot(since)``
        summarised, with the snapshots of the ranks worth a look and of the page of ``host`` or
        ``rank`` only."""
        return large_view(self.snapshot(since), host, rank)

    def read_log(self, rank: int, start: int = 0, limit: Optional[int] = None, newest: bool = False) -> LogRead:
        """``rank``'s lines from index ``start`` to the end of its log, read at once (from memory
        and from its spill file, also while lines arrive and spill): at most ``limit`` of them,
        the first ones, or with ``newest`` the last ones."""
        self._check_rank(rank)
        with self._lock:
            store = self._logs[rank]
            total = len(store)
            start = min(max(start, 0), total)
            stop = total
            if limit is not None:
                if newest:
                    start = max(start, total - limit)
                else:
                    stop = min(total, start + limit)
            return LogRead(rank, start, store[start:stop], total, self.ranks[rank].state)

    def read_logs(
        self, reads: List[Tuple[int, int, Optional[int], bool]], budget: Optional[int] = None
    ) -> List[Optional[LogRead]]:
        """``read_log(rank, start, limit, newest)`` of each of ``reads``, in one go (a view that
        follows many ranks asks once, not once a rank); with ``budget``, once that many lines
        were read the rest are ``None`` (not read: asked again later)."""
        for rank, *_ in reads:
            self._check_rank(rank)
        got: List[Optional[LogRead]] = []
        lines = 0
        for rank, start, limit, newest in reads:
            if budget is not None and lines >= budget:
                got.append(None)
                continue
            read = self.read_log(rank, start, limit, newest)
            lines += len(read.lines)
            got.append(read)
        return got

    def recent_log(self, rank: int, limit: int) -> LogRead:
        """Up to ``limit`` of ``rank``'s newest lines, from memory only (what a view scans)."""
        self._check_rank(rank)
        with self._lock:
            store = self._logs[rank]
            lines = store.recent(limit)
            return LogRead(rank, len(store) - len(lines), lines, len(store), self.ranks[rank].state)

    def metric_history(
        self, points: Optional[int] = None, ranks: Optional[Iterable[int]] = None, names: Optional[Iterable[str]] = None
    ) -> Dict[str, Dict[int, List[Tuple[int, float]]]]:
        """``{metric: {rank: [(step, value), ...]}}`` of the current attempt, copied; metrics in
        order of first report, ranks that reported the metric only.  ``points``: about that many
        of each rank's points, evenly spread, the newest kept (a slice per rank: the lock is held
        for what is copied, not for the whole history); ``ranks``, ``names``: those only."""
        names = None if names is None else set(names)
        with self._lock:
            history: Dict[str, Dict[int, List[Tuple[int, float]]]] = {}
            for rs in self.ranks if ranks is None else [self.ranks[r] for r in ranks]:
                for name, kept in rs.history.items():
                    if names is not None and name not in names:
                        continue
                    history.setdefault(name, {})[rs.rank] = _thinned(kept, points)
            return history

    def metric_points(
        self, cursor: "MetricCursor", points: Optional[int] = None
    ) -> Dict[str, Dict[int, List[Tuple[int, float]]]]:
        """Like ``metric_history``, but only the points each rank's history of each metric got
        since ``cursor`` last read it (all of it the first time, and after a restart), and
        ``cursor`` moves past them: ``points``: about that many of each rank's new points,
        evenly spread, the newest kept.  Where a history was thinned past the point read last
        (``MAX_POINTS``), the new points are those after the newest one that survived."""
        with self._lock:
            new: Dict[str, Dict[int, List[Tuple[int, float]]]] = {}
            for rs in self.ranks:
                read = cursor.read.get(rs.rank)
                if read is None:
                    read = cursor.read[rs.rank] = {}
                for name, kept in rs.history.items():
                    seen = read.get(name)
                    if not kept or (seen is not None and seen[0] is kept and kept[-1] is seen[2]):
                        continue  # nothing new: the newest point is the one read last
                    length = len(kept)
                    if points == 1:
                        fresh = [kept[-1]]
                    else:
                        start = _after(kept, seen)
                        fresh = (
                            kept[start:]
                            if points is None or length - start <= points
                            else _thinned(kept[start:], points)
                        )
                    by_rank = new.get(name)
                    if by_rank is None:
                        by_rank = new[name] = {}
                    by_rank[rs.rank] = fresh
                    read[name] = (kept, length, kept[-1])
            return new

    def system_history(self, rank: int, points: Optional[int] = None) -> List[Dict[str, float]]:
        """``rank``'s system samples of the current attempt, oldest first, each a dict of
        ``time`` and the plotted keys it had (``SYSTEM_HISTORY_KEYS``); ``points``: about that
        many, evenly spread, the newest kept."""
        self._check_rank(rank)
        with self._lock:
            kept = _thinned(self.ranks[rank].system_samples, points)
        keys = ("time",) + SYSTEM_HISTORY_KEYS
        return [{k: v for k, v in zip(keys, sample) if v is not None} for sample in kept]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_processes:
            raise IndexError(f"rank {rank} is not in this run (ranks 0..{self.num_processes - 1})")

    def logs(self, rank: int, attempt: Optional[int] = None) -> str:
        """Everything ``rank`` printed, in order: in every attempt, or in attempt ``attempt``
        (1 for the first)."""
        self._check_rank(rank)
        with self._lock:
            if attempt is None:
                return self._logs[rank].text()
            if not 1 <= attempt <= self.attempt:
                raise IndexError(f"attempt {attempt} is not in this run (attempts 1..{self.attempt})")
            bounds = self._attempt_lines[rank] + [None]
            return self._logs[rank].text(bounds[attempt - 1], bounds[attempt])


class MetricCursor:
    """Where a reader of ``metric_points`` is in each rank's history of each metric: by rank,
    then by name, the history read (a restart makes new ones), its length then and its newest
    point, which the history keeps until newer points come."""

    def __init__(self):
        self.read: Dict[int, Dict[str, Tuple[list, int, tuple]]] = {}


def _after(kept: list, read: Optional[Tuple[list, int, tuple]]) -> int:
    """The index in ``kept`` of the first point after those ``read`` saw (``metric_points``)."""
    if read is None or read[0] is not kept:
        return 0
    _, length, last = read
    if length <= len(kept) and kept[length - 1] is last:
        return length
    # thinned since (every other point went): after the newest point not past the step of the
    # one read last, found by halves (a rank's steps go up)
    low, high = 0, len(kept)
    while low < high:
        middle = (low + high) // 2
        if kept[middle][0] <= last[0]:
            low = middle + 1
        else:
            high = middle
    return low


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


def _thinned(kept: list, points: Optional[int]) -> list:
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
    "facts": lambda state, q: {name: getattr(state, name) for name in FACTS},
}
