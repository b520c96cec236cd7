"""Authenticated event transport, worker -> driver.

Wire format: every frame is a 4-byte big-endian length and a UTF-8 JSON object.  Nothing
read from a socket is ever unpickled.  A connection starts with a challenge: the server
sends ``{"nonce": ...}``, the client answers with ``HMAC-SHA256(secret, nonce)``, its run id
and rank; the server acknowledges with ``{"ok": true}`` or closes the connection.  After that each frame is
``{"events": [...]}``.  A malformed or oversized frame closes that one connection; the server
keeps serving the others.

The client never blocks the training loop: ``send`` puts the event on a bounded queue that a
background thread drains, coalescing progress updates of the same bar.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import queue
import secrets
import socket
import struct
import sys
import threading
import time
from typing import Callable, Optional

MAX_FRAME = 4 * 1024 * 1024
HANDSHAKE_TIMEOUT = 10.0
_LEN = struct.Struct(">I")


class FrameError(Exception):
    """A peer sent something that is not a well-formed frame."""


def new_secret() -> str:
    return secrets.token_hex(32)


def _mac(secret: str, nonce: str) -> str:
    return hmac.new(secret.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def write_frame(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj, separators=(",", ":"), default=str).encode("utf-8")
    if len(data) > MAX_FRAME:
        raise FrameError(f"frame of {len(data)} bytes is over the {MAX_FRAME} byte limit")
    sock.sendall(_LEN.pack(len(data)) + data)


def _read_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket) -> dict:
    (length,) = _LEN.unpack(_read_exact(sock, _LEN.size))
    if length > MAX_FRAME:
        raise FrameError(f"frame of {length} bytes is over the {MAX_FRAME} byte limit")
    try:
        obj = json.loads(_read_exact(sock, length).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise FrameError(f"frame is not UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise FrameError("frame is not a JSON object")
    return obj


class ChannelServer:
    """Driver side: accepts authenticated workers and hands their events to ``on_event``.

    ``on_event`` is called from the connection threads with a dict that always has
    ``type`` (str) and ``rank`` (int, taken from the authenticated hello, not from the event).
    """

    def __init__(self, on_event: Callable[[dict], None], run_id: str,
                 host: str = "127.0.0.1", secret: Optional[str] = None):
        self.on_event = on_event
        self.run_id = run_id
        self.secret = secret or new_secret()
        self.rejected = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(128)
        self.address = self._sock.getsockname()
        self._closed = threading.Event()
        self._conns: set = set()
        self._lock = threading.Lock()
        self._threads: list = []
        self._acceptor = threading.Thread(target=self._accept_loop, name="torchdist-channel", daemon=True)
        self._acceptor.start()

    @property
    def port(self) -> int:
        return self.address[1]

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            with self._lock:
                self._conns.add(conn)
                self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _handshake(self, conn: socket.socket) -> int:
        conn.settimeout(HANDSHAKE_TIMEOUT)
        nonce = secrets.token_hex(16)
        write_frame(conn, {"nonce": nonce})
        hello = read_frame(conn)
        mac = hello.get("mac")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(self.secret, nonce)):
            raise PermissionError("bad secret")
        if hello.get("run_id") != self.run_id:
            raise PermissionError("wrong run")
        rank = hello.get("rank")
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise FrameError("hello without a rank")
        write_frame(conn, {"ok": True})
        conn.settimeout(None)
        return rank

    def _serve(self, conn: socket.socket) -> None:
        try:
            try:
                rank = self._handshake(conn)
            except (PermissionError, FrameError, EOFError, OSError):
                self.rejected += 1
                return
            while True:
                frame = read_frame(conn)
                events = frame.get("events")
                if not isinstance(events, list):
                    raise FrameError("frame without an events list")
                for event in events:
                    if isinstance(event, dict) and isinstance(event.get("type"), str):
                        event["rank"] = rank
                        self.on_event(event)
        except (EOFError, FrameError, OSError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop accepting; wait briefly for open connections to deliver what they sent."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            threads = list(self._threads)
            conns = list(self._conns)
        deadline = time.monotonic() + 2.0  # one deadline for all, not 2 s per connection
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class ChannelClient:
    """Worker side.  ``send`` never blocks; ``close`` flushes what is queued."""

    def __init__(self, address: str, secret: str, run_id: str, rank: int, maxsize: int = 100_000):
        host, _, port = address.rpartition(":")
        self._addr = (host, int(port))
        self._secret = secret
        self._run_id = run_id
        self._rank = rank
        self._queue: "queue.Queue" = queue.Queue(maxsize=maxsize)
        self._dropped = 0
        self._sock: Optional[socket.socket] = None
        self._broken = False
        self._thread = threading.Thread(target=self._run, name="torchdist-events", daemon=True)
        self._thread.start()

    def send(self, event: dict) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self._dropped += 1

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self._addr, timeout=HANDSHAKE_TIMEOUT)
        nonce = read_frame(sock)["nonce"]
        write_frame(sock, {"mac": _mac(self._secret, nonce), "run_id": self._run_id, "rank": self._rank})
        try:
            read_frame(sock)
        except EOFError:
            raise PermissionError("the driver refused this rank's credentials") from None
        sock.settimeout(None)
        return sock

    def _run(self) -> None:
        stop = False
        while not stop:
            batch = [self._queue.get()]
            while len(batch) < 1000:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if any(e is None for e in batch):
                stop = True
                batch = [e for e in batch if e is not None]
            self._write(_coalesce(batch))

    def _write(self, events: list) -> None:
        if self._dropped:
            events.append({"type": "dropped", "count": self._dropped})
            self._dropped = 0
        if not events or self._broken:
            return
        try:
            if self._sock is None:
                self._sock = self._connect()
            write_frame(self._sock, {"events": events})
        except (OSError, EOFError, FrameError, KeyError, PermissionError) as exc:
            self._broken = True
            print(f"torchdist_magic: event channel to the driver lost ({exc}); "
                  "progress and metrics of this rank will not be shown", file=sys.__stderr__)

    def close(self, timeout: float = 5.0) -> None:
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass


def _coalesce(batch: list) -> list:
    """Keep only the newest progress update of each bar; everything else in order."""
    last = {}
    for i, e in enumerate(batch):
        if e.get("type") == "progress":
            last[e.get("bar")] = i
    return [e for i, e in enumerate(batch) if e.get("type") != "progress" or last[e.get("bar")] == i]


def client_from_env() -> Optional[ChannelClient]:
    """The channel client a worker builds from ``TORCHDIST_CHANNEL``/``_SECRET``/``_RUN_ID``."""
    address = os.environ.get("TORCHDIST_CHANNEL")
    if not address:
        return None
    return ChannelClient(address, os.environ.get("TORCHDIST_SECRET", ""),
                         os.environ.get("TORCHDIST_RUN_ID", ""), int(os.environ.get("RANK", "0")))
