"""A run's state served from the process that holds it (the view's feed): ``FeedServer``, in a
run's supervising process; ``handles.feed.HostedState`` is its client in a kernel that shows the run.

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
import hmac
import os
import pickle
import socket
import struct
import threading
import time
from typing import Any, Callable, Optional

from ..core import events
from ..driver.merged import MERGED_LINES, FollowedMergedLog
from ..driver.reading import READS, MetricCursor

#: a request line's largest size
REQUEST_MAX_BYTES = 4096
#: an answer's header: its kind (``b"v"`` a value, ``b"e"`` an exception, ``b"r"`` refused), its
#: length, and the CPU seconds the answer cost the process that holds the state (a view that
#: reads often counts them as its own: ``HostedState.served_cpu``)
ANSWER = struct.Struct("!cQd")
#: what a feed keeps for its kernels' readers (``metric_points`` cursors, merged logs): the
#: newest used
CURSORS = 64
#: the most lines of a merged log a kernel may ask to be kept for it
MERGED_LINES_MAX = 10_000


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
            except Exception as exc:  # the reader's error (a rank out of range), raised in the kernel  # noqa: BLE001
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
