"""A run's state read from the process that holds it (the view's feed): ``FeedServer`` in that
process, ``HostedState`` in a kernel that shows the run.

A run whose channel is off the kernel (``--channel process``, ``--detach``) has its channel and
its state in its supervising process: that process receives, decodes and applies every record,
and a kernel asks it only for what its view shows, one round trip a read (``READS``: a snapshot,
a large run's overview with the few ranks its view shows, some of a rank's log lines, the
plots' history).  So the kernel's CPU is its view's own, and a
refresh never delays a record.  ``HostedState`` has the reading side of ``RunState`` (what
views, ``Run.logs`` and the summary read); once the process that held the state has gone, it
reads a state rebuilt in the kernel instead (``fallback``: the run's journal replayed).  Each
read has a connection of its own while it waits (one kept open between reads), so one slow
answer holds up no other reader: a read waits at most ``READ_TIMEOUT`` for its answer, asks once
more on a fresh connection, and then reads the fallback, which is made outside any lock that
another reader takes.

The socket is the run's control socket, in this user's private directory; it also takes the
``events.StopRun`` of ``%torchdist stop``.  A request is one JSON line, an ``events`` record of
role ``kernel`` with the run's token; each side checks that the other is a process of this user
(``SO_PEERCRED``).  The answers of reads are pickles, which only a process of this user can
have written: this socket is never a run's channel, where ranks' records are JSON only.
"""

from __future__ import annotations

import collections
import gc
import hmac
import os
import pickle
import secrets
import socket
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from ..core import events
from .merged import MERGED_LINES, FollowedMergedLog
from .reading import MetricCursor

#: a request line's largest size
REQUEST_MAX_BYTES = 4096
#: an answer's header: its kind (``b"v"`` a value, ``b"e"`` an exception, ``b"r"`` refused), its
#: length, and the CPU seconds the answer cost the process that holds the state (a view that
#: reads often counts them as its own: ``HostedState.served_cpu``)
ANSWER = struct.Struct("!cQd")
#: how long a read waits for the next bytes of its answer before it gives that answer up; it
#: asks once more, on a fresh connection, before the kernel gives up on the process that holds
#: the state (a busy one answers in well under a second: a snapshot of 1024 ranks is a few MB)
READ_TIMEOUT = 10.0
#: reads of one answer's worth the kernel makes before it reads the fallback instead
READ_ATTEMPTS = 2
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
#: what a kernel reads of a snapshot (``RunSnapshot``) when it asks the state for these
SNAPSHOT_FIELDS = ("ranks", "stacks", "verdict", "preflight", "tracking", "refusals", "changed")
#: the reads a kernel may ask, each a function of the state and the request
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
#: what a feed keeps for its kernels' readers (``metric_points`` cursors, merged logs): the
#: newest used
CURSORS = 64
#: the most lines of a merged log a kernel may ask to be kept for it
MERGED_LINES_MAX = 10_000


class FeedGone(ConnectionError):
    """The process that held a run's state is gone (it ended, or never listened)."""


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket."""
    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]


def _read_line(conn: socket.socket, pending: bytearray) -> Optional[bytes]:
    """The next request line (``None`` at the end of the connection, or past
    ``REQUEST_MAX_BYTES`` without a line's end)."""
    while b"\n" not in pending:
        if len(pending) > REQUEST_MAX_BYTES:
            return None
        chunk = conn.recv(REQUEST_MAX_BYTES)
        if not chunk:
            return None
        pending += chunk
    line, _, rest = bytes(pending).partition(b"\n")
    pending[:] = rest
    return line


class FeedServer:
    """The run's control socket at ``path``, in the process that holds its ``state``: reads
    (``events.ReadState``) on connections that stay open, and one ``events.StopRun`` a
    connection, which calls ``stop(by)``; from processes of this user with the run's ``token``.
    A thread per connection (a few kernels at most)."""

    def __init__(self, path: str, token: str, state: Any, stop: Callable[[str], None]):
        self.path = path
        self.state = state
        self._token = token
        self._stop = stop
        self._cursors: "collections.OrderedDict[int, Any]" = collections.OrderedDict()
        self._open = 0  # connections that read, open now
        self._connections: set = set()
        self._last_read = time.monotonic()
        self._changed = threading.Condition()
        if os.path.lexists(path):
            os.unlink(path)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.bind(path)
        os.chmod(path, 0o600)
        self._socket.listen(16)
        self._thread = threading.Thread(target=self._accept, name="torchdist-feed", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._socket.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="torchdist-feed-reader", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reading = False
        with self._changed:
            self._connections.add(conn)
        try:
            with conn:
                conn.settimeout(None)
                if peer_uid(conn) != os.geteuid():
                    conn.sendall(b"refused\n")
                    return
                pending = bytearray()
                while True:
                    line = _read_line(conn, pending)
                    if line is None:
                        return
                    try:
                        record = events.loads(line)
                    except events.MalformedEvent:
                        record = None
                    if record is None or not self._is_token(getattr(record, "token", "")):
                        if type(record) is events.ReadState:
                            refusal = b"not the run's token"
                            conn.sendall(ANSWER.pack(b"r", len(refusal), 0.0) + refusal)
                        else:
                            conn.sendall(b"refused\n")
                        return
                    if type(record) is events.StopRun:
                        self._stop(record.by or "%torchdist stop")
                        conn.sendall(b"ok\n")
                        return
                    if not reading:
                        reading = True
                        with self._changed:
                            self._open += 1
                    self._answer(conn, record)
        except OSError:
            pass  # the kernel went away mid-read: nothing to tell anyone
        finally:
            with self._changed:
                self._connections.discard(conn)
                if reading:
                    self._open -= 1
                    self._changed.notify_all()

    def _is_token(self, given: object) -> bool:
        # compared as bytes: compare_digest raises TypeError on a str with non-ASCII characters,
        # which would end this connection's thread with a traceback instead of a refusal
        return isinstance(given, str) and hmac.compare_digest(
            given.encode("utf-8", "surrogatepass"), self._token.encode("utf-8", "surrogatepass")
        )

    def _answer(self, conn: socket.socket, request: events.ReadState) -> None:
        self._last_read = time.monotonic()
        began = time.thread_time()
        read = READS.get(request.read)
        if request.read == "metric_points":  # the kernel's cursor is kept here, by its number
            read = self._metric_points
        elif request.read == "merged_log":  # and its merged log
            read = self._merged_log
        if read is None:
            kind, body = b"r", f"no read {request.read!r:.40}".encode()
        else:
            try:
                kind, body = b"v", pickle.dumps(read(self.state, request), protocol=5)
            except Exception as exc:  # the reader's error (a rank out of range), raised in the kernel
                kind, body = b"e", pickle.dumps(exc, protocol=5)
        conn.sendall(ANSWER.pack(kind, len(body), time.thread_time() - began) + body)

    def _metric_points(self, state: Any, request: events.ReadState) -> Any:
        return state.metric_points(self._kept(request.at, MetricCursor), request.points)

    def _merged_log(self, state: Any, request: events.ReadState) -> Any:
        limit = min(max(request.limit or MERGED_LINES, 1), MERGED_LINES_MAX)
        return self._kept(request.at, lambda: FollowedMergedLog(state.num_processes, limit)).read(state)

    def _kept(self, key: int, make: Callable[[], Any]) -> Any:
        """What this process keeps for a kernel's reader named ``key`` (a cursor, a merged log),
        made when first asked; the ``CURSORS`` used last are kept."""
        with self._changed:
            kept = self._cursors.pop(key, None) or make()
            self._cursors[key] = kept
            while len(self._cursors) > CURSORS:
                self._cursors.popitem(last=False)
        return kept

    def readers(self) -> int:
        """Connections of kernels that read the state, open now."""
        with self._changed:
            return self._open

    def linger(self, seconds: float, quiet: float = 1.0) -> bool:
        """Wait until no kernel reads the state any more (each closed its feed, or none read
        for ``quiet`` seconds: their views took their last look), at most ``seconds``; True
        when none does."""
        deadline = time.monotonic() + seconds
        with self._changed:
            while self._open:
                now = time.monotonic()
                if now - self._last_read >= quiet:
                    return True
                if now >= deadline:
                    return False
                self._changed.wait(min(deadline - now, quiet))
        return True

    def close(self) -> None:
        """Stop listening and end every connection (a kernel's next read finds the state gone)."""
        self._socket.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        with self._changed:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


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

    # -- the reads of ``RunState`` (``reading.RunStateReads``) --------------------------------
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

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        local = self.__dict__.get("_local")
        if local is not None:  # the run's state itself, rebuilt here
            return getattr(local, name)
        if name in FACTS:
            return self._ask("facts")[name]
        if name in SNAPSHOT_FIELDS:
            return getattr(self.snapshot(), name)
        raise AttributeError(f"{name!r}: not a read of a run's state held by another process")
