"""Every rank's output as a view follows it: each rank's new lines (``LogCursor``), and all ranks'
lines merged in the order they were seen with every rank's errors and warnings (``MergedLog``).

Both read a run's state through its reads (``read_log``, ``read_logs``), so they follow a
``RunState`` in this process or one held by another (``feed``).  A run's supervising process
keeps the merged log of each kernel that shows the run (``handles.feed.FedMergedLog`` is the kernel's side):
at a thousand ranks a refresh's new lines stay in that process, and the kernel gets the few it
shows."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, Iterable, List, Optional, Tuple

from .logstore import LogLine

#: lines of the merged log a view shows (and of every rank's errors and warnings), by default
MERGED_LINES = 300
#: lines a drain of the merged log reads, at most, all ranks together (and one rank's more)
DRAIN_LINES = 4_000
#: ranks whose new lines one read of the state gives at most (``read_logs``)
DRAIN_BATCH = 256


def is_problem(text: str) -> bool:
    """Whether a stdout line is worth showing among every rank's errors and warnings (besides
    every stderr line): it says error, warning, traceback or exception, in any case (a lowered
    copy and four substring tests: a tenth of what a case-blind regular expression costs, on
    every line of a thousand ranks)."""
    low = text.lower()
    return "error" in low or "warning" in low or "traceback" in low or "exception" in low


class LogCursor:
    """Follows every rank's log: ``read`` gives the lines a rank wrote since the last read, each
    once.  A trailing ``\\r``-line (a bar in progress) may still be replaced in the log by the
    next line of its stream: its place is read again next time, and the line comes again only
    when it was replaced.  With ``keep``, a read skips all but the newest ``keep`` unread lines.
    """

    def __init__(self, num_processes: int, keep: Optional[int] = None):
        self.keep = keep
        self._cursor = [0] * num_processes
        self._trailing: List[Optional[LogLine]] = [None] * num_processes  # the \r-line read last
        #: per rank, the lines its log held after the last read that the read did not take
        self.unread = [0] * num_processes

    def skip(self, state: Any, rank: int, keep: int) -> int:
        """Pass over all but the newest ``keep`` of ``rank``'s unread lines; returns how many
        were passed over."""
        total = state.read_log(rank, self._cursor[rank], 0).total
        skipped = max(total - keep - self._cursor[rank], 0)
        self._cursor[rank] += skipped
        return skipped

    def read(self, state: Any, rank: int, limit: Optional[int] = None) -> List[LogLine]:
        """``rank``'s new lines, oldest first: at most ``limit`` (the rest are read next time,
        ``unread`` says how many there were)."""
        return self.took(rank, state.read_log(*self.asking(rank, limit)))

    def asking(self, rank: int, limit: Optional[int] = None) -> tuple:
        """The arguments of ``read_log`` that read ``rank``'s new lines."""
        if self.keep is not None:
            return (rank, self._cursor[rank], self.keep, True)
        return (rank, self._cursor[rank], limit, False)

    def took(self, rank: int, got) -> List[LogLine]:
        """The new lines of ``got`` (what ``asking``'s read gave), the cursor moved past them."""
        self.unread[rank] = got.total - got.stop
        if not got.lines:
            return []
        # the \r-line read last time, still the same: the log has not replaced it (lines are made
        # when read, so the same line is an equal one, not the same object)
        new = got.lines[1:] if got.lines[0] == self._trailing[rank] else got.lines
        last = got.lines[-1]
        self._trailing[rank] = last if last.cr else None
        self._cursor[rank] = got.stop - (1 if last.cr else 0)
        return new


class MergedLog:
    """All ranks' lines in the order this view saw them (lines that came between two refreshes
    rank by rank), the last ``limit`` only.

    ``\\r``-lines are not kept in the order: each rank's latest one (its bar in progress) is
    shown after the finished lines until that rank writes a finished line (``LogCursor`` reads
    a trailing one again until the log replaced it).

    A drain reads about ``budget`` lines at most, all ranks together: ranks with lines still
    to read wait for the next drain, taken in turn from where the last one stopped, so that a
    refresh of a thousand ranks that print costs what ``budget`` lines cost.  A rank that prints
    more than ``4 * limit`` lines before its turn comes is read from its newest ``4 * limit``.
    """

    def __init__(self, num_processes: int, limit: int = MERGED_LINES, budget: int = DRAIN_LINES):
        self.limit = limit
        self.budget = budget
        self.lines: Deque[Tuple[int, LogLine]] = deque(maxlen=limit)
        #: every rank's errors and warnings (stderr, or ``is_problem`` lines), the last ``limit``
        self.problems: Deque[Tuple[int, LogLine]] = deque(maxlen=limit)
        self.live: List[Optional[LogLine]] = [None] * num_processes
        self._cursor = LogCursor(num_processes, keep=4 * limit)
        self._pending: set = set()  # ranks that changed and were not read since
        self._next = 0  # the rank the next drain starts from (those after the last one read)
        # what ``delta`` has not given yet: lines and problems appended, ranks whose live line changed
        self._new_lines = self._new_problems = 0
        self._new_live: set = set()

    @property
    def pending(self) -> int:
        """Ranks whose lines wait for the next drain."""
        return len(self._pending)

    def drain(self, state: Any, ranks: Optional[Iterable[int]] = None) -> bool:
        """Take the lines written since the last call (by ``ranks``: those that changed, when
        the caller knows; every rank by default; and those the last drain left for this one),
        about ``budget`` of them; True when there were any."""
        self._pending.update(range(state.num_processes) if ranks is None else ranks)
        order = sorted(self._pending)
        turn = bisect.bisect_left(order, self._next)
        order = order[turn:] + order[:turn]
        changed = False
        taken = 0
        for at in range(0, len(order), DRAIN_BATCH):  # a read of the state per batch of ranks
            if taken >= self.budget:
                break
            batch = order[at : at + DRAIN_BATCH]
            got = state.read_logs([self._cursor.asking(rank) for rank in batch], self.budget - taken)
            for rank, one in zip(batch, got):
                if one is None or taken >= self.budget:  # not read, or not taken: its lines come next time
                    break
                self._pending.discard(rank)
                self._next = rank + 1
                new = self._cursor.took(rank, one)
                if not new:
                    continue
                changed = True
                taken += len(new)
                self._take(rank, new)
        if not self._pending:
            self._next = 0  # all read: the next drain takes its ranks in order again
        return changed

    def _take(self, rank: int, new: List[LogLine]) -> None:
        # most lines are neither on stderr nor a problem: one look at all of them tells
        problems = any(line.stream == "stderr" for line in new) or is_problem("\n".join(line.text for line in new))
        live = self.live[rank]
        for line in new:
            if line.cr:
                self.live[rank] = line if line.text else self.live[rank]
            else:
                self.live[rank] = None
                self.lines.append((rank, line))
                self._new_lines += 1
                if problems and (line.stream == "stderr" or is_problem(line.text)):
                    self.problems.append((rank, line))
                    self._new_problems += 1
        if self.live[rank] is not live:
            self._new_live.add(rank)

    def shown(self) -> List[Tuple[int, LogLine]]:
        """``[(rank, line), ...]``, oldest first."""
        live = [(r, line) for r, line in enumerate(self.live) if line is not None]
        return list(self.lines) + live

    def delta(self) -> "MergedDelta":
        """What this log took since the last ``delta``: its new lines and problems (the newest
        ``limit`` of each), the live lines of the ranks whose live line changed."""
        lines, problems = self.lines, self.problems
        delta = MergedDelta(
            lines=list(lines)[len(lines) - min(self._new_lines, len(lines)) :],
            problems=list(problems)[len(problems) - min(self._new_problems, len(problems)) :],
            live={rank: self.live[rank] for rank in self._new_live},
            pending=self.pending,
        )
        self._new_lines = self._new_problems = 0
        self._new_live = set()
        return delta

    def apply(self, delta: "MergedDelta") -> bool:
        """Take what another process's log took (its ``delta``); True when there was any."""
        self.lines.extend(delta.lines)
        self.problems.extend(delta.problems)
        for rank, line in delta.live.items():
            self.live[rank] = line
        return bool(delta.lines or delta.problems or delta.live)


@dataclass
class MergedDelta:
    """What a merged log took between two reads (``MergedLog.delta``)."""

    lines: List[Tuple[int, LogLine]]
    problems: List[Tuple[int, LogLine]]
    live: Dict[int, Optional[LogLine]]
    pending: int  # ranks whose lines wait for the next drain there


class FollowedMergedLog:
    """A merged log kept for a reader where the run's state is (a run's supervising process
    keeps one for each kernel that shows the run, ``feed``): each read drains the ranks
    changed since the last one and gives what the log took (``MergedDelta``)."""

    def __init__(self, num_processes: int, limit: int):
        self.log = MergedLog(num_processes, limit)
        self.since: Optional[int] = None

    def read(self, state: Any) -> MergedDelta:
        self.since, changed = state.changed_since(self.since)
        self.log.drain(state, changed)
        return self.log.delta()
