"""A run's state read from the process that holds it (the view's feed), in a kernel that shows the
run: ``HostedState`` asks the process's ``supervise.feed.FeedServer``, and ``FedMergedLog`` is the
kernel's side of the merged log kept there.

The reads are declared once, in ``driver.reading.READS``: the server answers a request with that
table, and ``HostedState`` answers from it too once it reads a state rebuilt in the kernel (the
run's journal replayed).  Each read has a connection of its own while it waits (one kept open
between reads), so one slow answer holds up no other reader: a read waits at most
``READ_TIMEOUT`` for its answer, asks once more on a fresh connection, and then reads the
fallback, which is made outside any lock that another reader takes.
"""

from __future__ import annotations

import gc
import os
import pickle
import secrets
import socket
import struct
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional

from ..core import events
from ..driver.merged import MERGED_LINES, MergedLog
from ..driver.reading import FACTS, READS, MetricCursor
from ..supervise.feed import ANSWER, peer_uid

#: how long a read waits for the next bytes of its answer before it gives that answer up; it
#: asks once more, on a fresh connection, before the kernel gives up on the process that holds
#: the state (a busy one answers in well under a second: a snapshot of 1024 ranks is a few MB)
READ_TIMEOUT = 10.0
#: reads of one answer's worth the kernel makes before it reads the fallback instead
READ_ATTEMPTS = 2


class FeedGone(ConnectionError):
    """The process that held a run's state is gone (it ended, or never listened)."""


def _loads(body: bytes) -> Any:
    """An answer, unpickled with the collector off: a snapshot of a thousand ranks is tens of
    thousands of new containers, none in a cycle, and a collection started among them walks
    every object of the kernel (a view's refresh took 150 ms of collections at 1024 ranks)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return pickle.loads(body)
    finally:
        if enabled:
            gc.enable()


def _receive(conn: socket.socket, size: int) -> bytes:
    """``size`` bytes of an answer from ``conn``."""
    view = memoryview(bytearray(size))
    got = 0
    while got < size:
        n = conn.recv_into(view[got:])
        if not n:
            raise ConnectionResetError("the process that held the run's state closed the feed")
        got += n
    return view.obj


class HostedState:
    """A run's state held by another process (``FeedServer`` at ``path``), read through its
    feed: the reading side of ``RunState`` that views use, each read a round trip.  Once that
    process is gone, or has not answered a read twice (``READ_TIMEOUT``, ``READ_ATTEMPTS``), every
    read goes to ``fallback()``'s ``RunState`` (made once, when first needed).  Reads from several
    threads each wait on a connection of their own: none waits behind another's answer."""

    def __init__(self, path: Optional[str], token: str, num_processes: int, fallback: Callable[[], Any]):
        self.path = path
        self.num_processes = num_processes
        self._token = token
        self._fallback = fallback
        self._local: Any = None
        # held only to take or give back a connection, never through a socket's read
        self._lock = threading.Lock()
        self._idle: List[socket.socket] = []  # open connections that no read uses now
        self._closes = 0  # how many times close() was called: a read's connection from before is not kept
        self._replaying = threading.Lock()  # one replay of the journal, whoever needs it first
        #: CPU seconds the reads so far cost the process that holds the state
        self.served_cpu = 0.0

    def _ask(self, read: str, when_local: Optional[Callable[[Any], Any]] = None, **args: Any) -> Any:
        """The answer to a read, from the process that holds the state; once it has gone (or
        did not answer, twice), from the fallback's state (``when_local(state)`` where given)."""
        request = events.ReadState(rank=-1, token=self._token, read=read, **args)
        for attempt in range(READ_ATTEMPTS):
            if self._local is not None:
                break
            try:
                return self._remote(request, fresh=attempt > 0)
            except FeedGone:
                continue
        local = self._local if self._local is not None else self._fall_back()
        return READS[read](local, request) if when_local is None else when_local(local)

    def _fall_back(self) -> Any:
        """The fallback's state, made once: the replay runs outside ``_lock``, so a reader that
        still has its answer coming, or a ``close``, does not wait for it."""
        with self._replaying:
            if self._local is None:
                local = self._fallback()
                with self._lock:
                    self._local = local
                    idle, self._idle = self._idle, []
                for conn in idle:
                    conn.close()
        return self._local

    def _remote(self, request: events.ReadState, fresh: bool = False) -> Any:
        """The answer from the process that holds the state, on a connection no other read uses
        (``fresh``: a new one); ``FeedGone`` when none came."""
        if self.path is None:
            raise FeedGone("no process holds the run's state")
        with self._lock:
            conn = self._idle.pop() if self._idle and not fresh else None
            closes = self._closes
        try:
            if conn is None:
                conn = self._connect()
            conn.sendall((events.dumps(request) + "\n").encode())
            kind, size, cost = ANSWER.unpack(_receive(conn, ANSWER.size))
            body = _receive(conn, size)
        except (FileNotFoundError, ConnectionError, socket.timeout, struct.error) as exc:
            if conn is not None:
                conn.close()
            raise FeedGone(str(exc) or type(exc).__name__) from None
        with self._lock:
            self.served_cpu += cost
            kept = closes == self._closes and self._local is None
            if kept:
                self._idle.append(conn)
        if not kept:
            conn.close()
        if kind == b"v":
            return _loads(body)
        if kind == b"e":
            raise pickle.loads(body)
        raise PermissionError(f"the process that holds the run's state refused a read: {body.decode(errors='replace')}")

    def _connect(self) -> socket.socket:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(READ_TIMEOUT)
        try:
            conn.connect(self.path)
            if peer_uid(conn) != os.geteuid():
                raise PermissionError(f"{self.path} is not this user's: the run's state is not read from it")
        except BaseException:
            conn.close()
            raise
        return conn

    def close(self) -> None:
        """Close the feed (the process that holds the state may end); a later read opens it
        again, or reads the fallback once that process has gone."""
        with self._lock:
            self._closes += 1
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    @property
    def hosted(self) -> bool:
        """Whether reads still go to the process that holds the state."""
        return self._local is None

    # -- the reads of ``RunState`` (``reading.READS``) --------------------------------------------
    def snapshot(self, since: Optional[int] = None):
        return self._ask("snapshot", since=since)

    def large_view(self, since: Optional[int] = None, host: Optional[str] = None, rank: Optional[int] = None):
        """``RunState.large_view``, worked out in the process that holds the state: the kernel
        gets the overview and the few ranks shown, not every rank's snapshot."""
        return self._ask("large_view", since=since, names=[host] if host else None, at=-1 if rank is None else rank)

    def read_log(self, rank: int, start: int = 0, limit: Optional[int] = None, newest: bool = False):
        return self._ask("read_log", at=rank, start=start, limit=limit, newest=newest)

    def read_logs(self, reads, budget: Optional[int] = None):
        return self._ask(
            "read_logs", reads=[[rank, start, limit, newest] for rank, start, limit, newest in reads], limit=budget
        )

    def recent_log(self, rank: int, limit: int):
        return self._ask("recent_log", at=rank, limit=limit)

    def metric_history(self, points: Optional[int] = None, ranks=None, names=None):
        return self._ask(
            "metric_history",
            points=points,
            ranks=None if ranks is None else list(ranks),
            names=None if names is None else list(names),
        )

    def metric_points(self, cursor: MetricCursor, points: Optional[int] = None):
        """``RunState.metric_points``: the process that holds the state keeps the cursor's place
        (this ``cursor`` is the kernel's name for it).  Once that process has gone, a cursor it
        kept gets nothing more (the run has ended, its points were read); a new one reads the
        state rebuilt here."""
        with self._lock:
            remote = getattr(cursor, "remote", None)
            if self._local is None and remote is None:
                remote = cursor.remote = secrets.randbits(62)
        if remote is not None:
            return self._ask("metric_points", at=remote, points=points, when_local=lambda local: {})
        return self._local.metric_points(cursor, points)

    def merged_log(self, key: int, limit: int):
        """What the merged log kept for this kernel's reader ``key`` in the process that holds
        the state took since the last read (``merged.MergedDelta``); None once that process has
        gone (``merged.FedMergedLog`` then drains a log of its own)."""
        return self._ask("merged_log", at=key, limit=limit, when_local=lambda local: None)

    def system_history(self, rank: int, points: Optional[int] = None):
        return self._ask("system_history", at=rank, points=points)

    def logs(self, rank: int, attempt: Optional[int] = None) -> str:
        return self._ask("logs", at=rank, attempt=attempt)

    def profile(self):
        return self._ask("profile")

    def failures(self):
        return self._ask("failures")

    def goodput(self):
        return self._ask("goodput")

    def stragglers(self):
        return self._ask("stragglers")

    def running(self):
        return self._ask("running")

    def elapsed(self) -> float:
        return self._ask("elapsed")

    def idle(self) -> float:
        return self._ask("idle")

    @property
    def collectives(self) -> Dict[int, Any]:
        """``RunState.collectives``: each rank's latest collective record of the attempt, the
        records a verdict is worked out from where the run's state kept none (a journal's)."""
        return self._ask("collectives")

    def facts(self) -> Dict[str, Any]:
        """The run's facts (``reading.FACTS``: its id, state, start and end, failure, attempts,
        ...) in one read; each is also a property of this state, one such read each."""
        return self._ask("facts")


def _fact(name: str) -> property:
    return property(lambda self: self.facts()[name], doc=f"``RunState.{name}``, read through the feed (``facts``).")


for _name in FACTS:  # the facts' properties, declared by the table, not by a fallback for any name
    if _name != "num_processes":  # known before any read: the handle's own attribute
        setattr(HostedState, _name, _fact(_name))


class FedMergedLog(MergedLog):
    """The kernel's side of a merged log kept where the run's state is (``FollowedMergedLog``):
    a drain asks that process what the log took since the last drain, whatever ``ranks`` says.
    Once that process has gone, the log is drained here from the state rebuilt in the kernel,
    anew (the run has ended: its newest lines, rank by rank)."""

    def __init__(self, num_processes: int, limit: int = MERGED_LINES):
        super().__init__(num_processes, limit)
        self.key = secrets.randbits(62)  # the reader's name for the log kept there
        self._fed = True
        self._pending_there = 0

    @property
    def pending(self) -> int:
        return self._pending_there if self._fed else super().pending

    def drain(self, state: Any, ranks: Optional[Iterable[int]] = None) -> bool:
        if self._fed:
            delta = state.merged_log(self.key, self.limit)
            if delta is not None:
                self._pending_there = delta.pending
                return self.apply(delta)
            self._fed = False
            self.lines.clear()
            self.problems.clear()
            self.live = [None] * len(self.live)
            ranks = None
        return super().drain(state, ranks)
