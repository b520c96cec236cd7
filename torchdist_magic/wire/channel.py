"""Authenticated transport of event records between the driver and its ranks, both ways.

Wire format.  Every frame is a 4-byte big-endian length and a UTF-8 JSON object; nothing read
from a socket is ever unpickled.  A connection starts with a challenge: the server sends
``{"nonce": ...}``; the client answers ``{"mac": HMAC-SHA256(secret, nonce), "nonce": ...,
"run_id", "rank", "role", "protocol"}``, where ``secret`` is the key of that role and rank
(``rank_key``: derived from the run's secret of the role).  A worker is given only its own rank's
key of the run's ``secret``, so it cannot speak as another rank, nor as a launcher, which holds a
key of ``launcher_secret`` (a Spark task derives its rank's from it), so a worker cannot report
its own exit.  The server replies ``{"ok": true, "mac": HMAC-SHA256(secret, client's nonce)}``,
so that a rank obeys only the driver and not whatever took over its port, or ``{"ok": false,
"error": reason}`` and closes.  The first connection to authenticate as a role and rank owns
it for the channel's life: a second one is refused, and the rank's log says so (one that ends
before it sent a single frame lets go: its client tried again after a slow reply).  After that
every frame, in either direction, is ``{"events": [record, ...]}`` in the encoding of ``events``
(without TLS, inside authenticated records: "Without TLS" below).

Strangers.  The driver's port is open to anything on the cluster's network, so a connection that
has not authenticated may cost only a bounded amount.  One thread serves every connection (a
selector; no thread per connection); a hello may be at most ``MAX_HELLO`` bytes and must arrive
within ``HANDSHAKE_DEADLINE``; at most ``MAX_PENDING`` connections wait for their handshake, and
a new one evicts the oldest: connections that take a slot and say nothing cannot lock the ranks
out, and a rank whose handshake was cut off tries again.  They hold at most half of the process's
descriptors; when ``accept`` finds none left (``EMFILE``), the oldest of them gives its own up,
or, with none waiting, the channel stops accepting for ``ACCEPT_PAUSE`` rather than spin on a
listener that stays readable (``fdlimit`` raises the limit before a run).  Nothing a stranger
sends is printed or raised; it is counted in ``ChannelServer.stats``.

Ranks.  An authenticated peer may send frames of up to ``MAX_FRAME`` bytes.  Every record goes
through ``events.decode``; a malformed one, or one its role may not send (``events.SENDERS``), is
dropped and counted, and a delivered record's ``rank`` is the authenticated one, whatever the
record said.  Records to a rank wait in a per-connection outbox that the server thread writes
when the peer reads, so a rank that stops reading delays nobody.

The client never blocks the training loop: ``send`` puts the record on a bounded queue that a
background thread drains, dropping and counting what does not fit.  What a rank sends many of
(progress, metrics, output) it gathers for ``FLUSH_EVERY`` and sends as one batch, in as few
frames as fit, with only the newest update of each progress bar and every metric point of the
batch in one record (``Metrics.more``): the driver's cost is per batch more than per record.
Anything else goes at once.  A handshake the driver cut off, or one that took too long, is tried
again with a jittered, growing pause (``open_connection``), so that ranks connecting all at once
(2,048 connections for 1024 ranks) all get in.

TLS.  Given a ``tls.ChannelIdentity`` (the server) and its certificate (every client), all of
the above runs inside TLS 1.3: the TLS handshake first, then the challenge, the hello and the
frames, encrypted.  TLS gives privacy and tells a rank it reached the driver (the client trusts
the run's certificate and nothing else: ``tls.client_context``); the secrets still say who may
speak.  TLS is done in memory (``ssl.MemoryBIO`` and ``SSLContext.wrap_bio``), on
both sides.  The server keeps its raw, non-blocking sockets in the selector, so readiness means
what it says: with an ``SSLSocket`` a record already decrypted and buffered inside OpenSSL
(``pending()``) would not wake the selector, and a read could need a write (and the reverse).
The server reads only ciphertext, and decides how much: before authentication at most one TLS
record per read (OpenSSL holds at most one handshake message, and a ClientHello is at most
128 KiB), and it takes plaintext only up to the one hello it may buffer; the TLS handshake
happens while the connection waits in the pending table, so it counts against
``HANDSHAKE_DEADLINE`` and ``MAX_PENDING`` like any stranger's bytes, on the same one thread.
Plaintext queued for a rank is encrypted a chunk at a time, as its socket takes it, so the
ciphertext waiting for a slow rank stays small and ``MAX_OUTBOX`` still bounds the rest.  The
client's sender and reader threads share one TLS object (OpenSSL's are not safe to use from two
threads at once): one lock around it, and the socket's write side taken before that lock is let
go, so that records leave in the order they were made while the reader never waits for a send.

Without TLS.  The handshake goes as above; everything after its reply, both ways, travels in
authenticated records (``framemac``: an HMAC per record under a key of the connection's, from
the rank's key and both nonces, with a sequence number per direction), frames and file bytes
alike.  A record whose tag is wrong ends its connection and nothing of it is used: whoever is on
the network may read a run's records, but cannot change one or add one of theirs (a ``JobValue``
the driver would unpickle, a ``RunJob`` or a debugger line a rank would run).  ``stats``'s
``forged`` counts them; the rank's log, or the rank's stderr, says so.

Files.  A channel may serve files (``ChannelServer``'s ``files``: the notebook values out to the
ranks, which each machine of a cluster fetches once, ``hostcopy``).  A fetch is a connection
whose hello names the file (``"fetch"``); it authenticates as any other, then leaves the server's
thread for a thread of its own (``_FileTransfers``: at most ``FETCHES_AT_ONCE`` at a time), which
sends ``{"size": n}`` and the file's ``n`` bytes raw (``socket.sendfile`` on plain TCP; read
into one reused buffer and encrypted a chunk at a time with TLS) and closes.  A stranger gets
the refusal of any failed handshake and nothing of the file.

The other way, a channel takes the ranks' values (``receive_values``: a path for each rank whose
value the driver wants; ``upload``, from a Spark task on another machine).  An upload is a
launcher's connection whose hello names its own rank (``"upload"``, which must be the hello's
``"rank"``) and the value's size (``"size"``); the server refuses one for a rank whose value it
does not wait for, or no longer (each is taken once).  On a thread of the same pool, it answers ``{"ready": true}`` once it has checked
that the value's directory has room for it (else ``{"error": ...}``), reads the ``size`` bytes
into ``<path>.tmp`` through one reused buffer, renames that to ``path`` and answers
``{"ok": true}``.  What goes wrong (the disk fills, the connection is cut) removes the ``.tmp``;
a write that failed is answered with its error at once, and the rest of the value is read and
dropped, so that the rank hears why rather than a reset.  A rank can write nothing but its own
value's file, and no more bytes than it announced.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import errno
import functools
import hashlib
import hmac
import json
import logging
import os
import queue
import random
import secrets
import selectors
import socket
import ssl
import struct
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple, Union

from ..core import events, fdlimit
from ..core.rankenv import rank_key
from . import framemac, tls
from ..core.timing import CHANNEL_CLOSE_WAIT, CHANNEL_THREAD_WAIT, CLIENT_CLOSE_WAIT, FETCH_STALL, HANDSHAKE_DEADLINE
from ..core.names import CHANNEL_CERT_ENV, CHANNEL_ENV, RUN_ID_ENV, SECRET_ENV

#: largest frame after authentication (a batch of records)
MAX_FRAME = 4 * 1024 * 1024
#: largest frame before authentication (the challenge, the hello, the reply)
MAX_HELLO = 4 * 1024
#: connections waiting for their handshake at once; one more evicts the oldest.  Enough for
#: every connection of a 1024-rank run opened at once (a worker's and a launcher's per rank)
#: to wait its turn; each costs at most one hello of plaintext (``MAX_HELLO``) or one TLS record
#: of ciphertext (``_TLS_RECORD``) and its TLS state, so a flood of strangers costs a bounded
#: amount of memory
MAX_PENDING = 2048
#: bytes the driver may have queued for one rank that does not read them; more are refused
MAX_OUTBOX = 4 * MAX_FRAME
#: records a client sends in one batch at most (progress updates are coalesced within a batch,
#: metric points merged into one record)
BATCH = 10_000
#: how long a client gathers records before it sends them, as one batch: a rank's sender thread
#: wakes (and takes the interpreter from the training loop) ten times a second, not once a record,
#: and the driver gets few large frames rather than many small ones
FLUSH_EVERY = 0.1
#: the records a client gathers for ``FLUSH_EVERY``: those a rank sends many of.  Any other
#: (``Started``, ``Exit``, a warm job's end) goes at once, with whatever was gathered before it
GATHERED = (events.Progress, events.Metrics, events.Log)

_LEN = struct.Struct(">I")
_log = logging.getLogger("torchdist_magic")
_RECV_CHUNK = 256 * 1024
#: connections accepted in one round of the server's loop at most
_ACCEPT_PER_ROUND = 64
#: what the server reads from an authenticated connection at once: a read allocates its whole
#: size first, and 256 KiB costs over ten times what 64 KiB does
_READ_CHUNK = 64 * 1024
#: the most plaintext one TLS record holds: what the server takes out of TLS at once
_TLS_PLAINTEXT = 2 ** 14
#: the largest TLS 1.3 record on the wire (header, 16 KiB of data, padding and tag): what the
#: server reads at once from a connection that has not authenticated
_TLS_RECORD = 5 + 2 ** 14 + 256
#: a rank's handshake cut off (a flood of strangers evicted it) or not done in time (a driver
#: busy with many) is tried again after this pause, doubling, each pause drawn between half and
#: one and a half of it so that ranks evicted together do not come back together; for at most
#: ``CONNECT_ATTEMPTS`` times ``HANDSHAKE_DEADLINE`` in all
_RETRY_PAUSE, _RETRY_PAUSE_MAX = 0.05, 2.0
CONNECT_ATTEMPTS = 6
#: files sent or received at once at most (one thread each); more fetches and uploads wait their turn
FETCHES_AT_ONCE = 8
#: what a fetch over TLS reads from the file and encrypts at once, and what an upload reads at once
_FILE_CHUNK = 1 << 20
#: a full disk, as ``os.write`` says it (``EFBIG``: a file size limit)
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
#: ``accept`` out of descriptors (this process's, the system's) or of socket memory
_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
#: how long the channel stops accepting when it is out of descriptors and has no connection
#: in its handshake to give one up
ACCEPT_PAUSE = 0.1


class FrameError(Exception):
    """A peer sent something that is not a well-formed frame."""


class Refused(Exception):
    """The other end refused the handshake, with a reason worth telling the user."""


class NotTheDriver(Exception):
    """The other end could not prove, with the run's TLS certificate, that it is the driver."""


def new_secret() -> str:
    return secrets.token_hex(32)


def _mac(secret: str, nonce: str) -> bytes:
    digest = hmac.new(secret.encode(), nonce.encode("utf-8", "surrogatepass"), hashlib.sha256)
    return digest.hexdigest().encode()


def _macs_equal(given: object, expected: bytes) -> bool:
    # compared as bytes: compare_digest refuses a str with non-ASCII characters (TypeError),
    # and whatever a stranger sends must be just a wrong MAC
    return isinstance(given, str) and hmac.compare_digest(given.encode("utf-8", "replace"), expected)


def _half_the_files() -> int:
    """Half of this process's soft limit on open files (``MAX_PENDING`` where there is none)."""
    current = fdlimit.limits()
    if current is None or current[0] < 0:  # RLIM_INFINITY
        return MAX_PENDING
    return max(16, current[0] // 2)


def _frame(obj: dict) -> bytes:
    data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return _LEN.pack(len(data)) + data


def _parse(body: bytes) -> Optional[dict]:
    """The JSON object ``body`` holds, or ``None`` for anything else."""
    try:
        obj = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return obj if isinstance(obj, dict) else None


def _decode(item: object) -> Optional[events.Event]:
    try:
        return events.decode(item)
    except Exception:  # noqa: BLE001  decode means to raise only MalformedEvent, but a peer's
        # record must not be able to stop a reader with anything else it provokes (a huge
        # integer where a float belongs raises OverflowError)
        return None


def _read_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, _RECV_CHUNK))
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket, limit: int) -> dict:
    """The next frame on a blocking ``sock`` (a handshake's, a file transfer's head): its JSON
    object; ``FrameError`` for one over ``limit`` bytes or not a JSON object, ``EOFError`` when
    the connection ends first."""
    (length,) = _LEN.unpack(_read_exact(sock, _LEN.size))
    if length > limit:
        raise FrameError(f"frame of {length} bytes is over the {limit} byte limit")
    obj = _parse(_read_exact(sock, length))
    if obj is None:
        raise FrameError("frame is not a UTF-8 JSON object")
    return obj


# -- driver side ------------------------------------------------------------------------------

class _Conn:
    """One accepted connection, as the server thread sees it."""

    __slots__ = ("sock", "deadline", "nonce", "inbuf", "outbox", "mask", "role", "rank", "open",
                 "tls", "tls_in", "tls_out", "wire", "secure", "heard", "sealer", "opener")

    def __init__(self, sock: socket.socket, deadline: float, context: Optional[ssl.SSLContext]):
        self.sock = sock
        self.deadline = deadline
        self.nonce = secrets.token_hex(16)
        self.inbuf = bytearray()           # plaintext read, not parsed yet
        self.outbox = bytearray()          # plaintext to send; guarded by the server's lock
        self.mask = selectors.EVENT_READ
        self.role: Optional[str] = None    # set once authenticated
        self.rank = -1
        self.open = True
        self.heard = False                 # a frame came after the handshake
        # with TLS: ciphertext arrives in tls_in, leaves from tls_out into wire (what the socket
        # has not taken yet); secure once the TLS handshake is done
        self.tls: Optional[ssl.SSLObject] = None
        self.wire = bytearray()
        self.secure = False
        # without TLS, once authenticated: what it sends and receives as authenticated records
        self.sealer: Optional[framemac.Sealer] = None
        self.opener: Optional[framemac.Opener] = None
        if context is not None:
            self.tls_in, self.tls_out = ssl.MemoryBIO(), ssl.MemoryBIO()
            self.tls = context.wrap_bio(self.tls_in, self.tls_out, server_side=True)


class ChannelServer:
    """Driver side: authenticates ranks, hands their records to ``on_event`` and sends records
    to them.

    ``on_event`` is called on the server's one thread with every record that passed
    ``events.decode`` and that its sender's role may send, its ``rank`` the authenticated one.
    ``stats`` counts what happened: ``accepted``, ``authenticated``, ``rejected`` (failed
    handshakes), ``evicted`` (unauthenticated connections closed to make room), ``frames`` and
    ``delivered`` (after authentication), ``malformed`` (undecodable frames or records),
    ``forbidden`` (records the connection's role may not send), ``callback_errors``,
    ``forged`` (records without TLS whose MAC was wrong: their connection ended),
    ``accept_failed`` and ``out_of_files`` (``accept`` found no descriptor left).  Nothing is
    refused in silence: the first refusal of each kind is logged (the ``torchdist_magic`` logger,
    a warning), and every one goes to ``on_refusal(kind, rank, detail)`` (the run's state counts
    them where the view and ``run.state.refusals`` show them).  With
    ``identity`` (a ``tls.ChannelIdentity``) every connection is TLS; a TLS handshake that fails
    is a failed handshake (``rejected``).  ``files`` (``{name: path}``) are the files an
    authenticated peer may fetch (see the module's "Files"); ``files_sent`` counts those sent
    whole, ``values_received`` the ranks' values taken whole (``receive_values``).  ``ranks``: the
    run's number of ranks, of which a hello must name one; with one connection per role and rank
    (the first, ``claims_refused`` counts the others), a run has at most two per rank.
    """

    def __init__(self, on_event: Callable[[events.Event], None], run_id: str, *,
                 host: str = "127.0.0.1", secret: str, launcher_secret: str,
                 identity: Optional[tls.ChannelIdentity] = None, files: Optional[Dict[str, str]] = None,
                 ranks: Optional[int] = None, on_refusal: Optional[Callable[[str, int, str], None]] = None):
        self._on_event = on_event
        self._on_refusal = on_refusal
        self._refusals_logged: set = set()
        self._run_id = run_id
        self._ranks = ranks
        self._secrets = {"worker": secret, "launcher": launcher_secret}
        self._tls = identity.server_context() if identity is not None else None
        #: whether every connection speaks TLS (``identity`` was given)
        self.encrypted = self._tls is not None
        self.stats: Dict[str, int] = dict.fromkeys(
            ("accepted", "authenticated", "rejected", "evicted", "frames", "delivered",
             "malformed", "forbidden", "callback_errors", "files_sent", "values_received",
             "accept_failed", "out_of_files", "claims_refused", "forged"), 0)
        self._files = _FileTransfers(dict(files or {}), self.stats)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener: Optional[socket.socket] = socket.create_server((host, 0), family=family, backlog=512)
        self._listener.setblocking(False)
        self.address: Tuple[str, int] = tuple(self._listener.getsockname()[:2])
        self.port: int = self.address[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        # only the server thread touches these two
        self._pending: "collections.OrderedDict[_Conn, None]" = collections.OrderedDict()  # oldest first
        # connections in their handshake hold at most half of this process's descriptors, so
        # that a flood of strangers leaves the kernel's own files and the ranks' connections room
        self._pending_cap = _half_the_files()
        self._accept_resume: Optional[float] = None  # while out of descriptors: when to accept again
        self._authed: set = set()
        # shared with send(); the outboxes too
        self._lock = threading.Lock()
        self._routes: Dict[Tuple[str, int], _Conn] = {}   # the connection of each role and rank
        # the connection that owns each role and rank (server thread only): the first to
        # authenticate as it; it lets go only if it ends before it sent a single frame (its client
        # gave up on a slow reply and tries again)
        self._claims: Dict[Tuple[str, int], _Conn] = {}
        self._dirty: set = set()                          # connections with new output
        self._close_deadline: Optional[float] = None
        self._thread = threading.Thread(target=self._serve, name="torchdist-channel", daemon=True)
        self._thread.start()

    # -- API ------------------------------------------------------------------------------

    def send(self, rank: int, record: events.Event, role: str = "launcher") -> bool:
        """Queue ``record`` for the connection of ``role`` and ``rank``; ``False`` when there is
        none (not connected, already gone, the channel closed) or it has stopped reading."""
        return self._send_to([(role, rank)], _frame({"events": [events.encode(record)]})) == 1

    def broadcast(self, record: events.Event, role: str = "launcher") -> int:
        """Queue ``record`` for every rank connected as ``role``; the number it was queued for."""
        with self._lock:
            keys = [key for key in self._routes if key[0] == role]
        return self._send_to(keys, _frame({"events": [events.encode(record)]}))

    def receive_values(self, paths: Dict[int, str]) -> None:
        """Take each rank's value (``{rank: path}``) over the channel into its path, once (see
        the module's "Files"), in place of those given before; a rank not named may upload
        nothing."""
        self._files.receive_values(paths)

    def close(self) -> None:
        """Stop accepting; give authenticated connections until ``CHANNEL_CLOSE_WAIT`` (one
        deadline for all) to deliver what they sent, then close them.  Idempotent."""
        with self._lock:
            if self._close_deadline is None:
                self._close_deadline = time.monotonic() + CHANNEL_CLOSE_WAIT
        self._wake()
        self._files.close()
        if threading.current_thread() is not self._thread:  # on_event may close the channel
            self._thread.join(CHANNEL_CLOSE_WAIT + CHANNEL_THREAD_WAIT)
            if self._thread.is_alive():
                _log.warning("run %s: the event channel's thread was still delivering a record "
                             "%g s after close; left behind", self._run_id,
                             CHANNEL_CLOSE_WAIT + CHANNEL_THREAD_WAIT)

    # -- server thread --------------------------------------------------------------------

    def _send_to(self, keys: List[Tuple[str, int]], data: bytes) -> int:
        sent = 0
        with self._lock:
            if self._close_deadline is not None:
                return 0
            for key in keys:
                conn = self._routes.get(key)
                if conn is not None and len(conn.outbox) + len(data) <= MAX_OUTBOX:
                    conn.outbox += data
                    self._dirty.add(conn)
                    sent += 1
        if sent:
            self._wake()
        return sent

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # a wake-up is already pending (buffer full), or the thread has ended
            pass

    def _serve(self) -> None:
        try:
            while not self._finished():
                for key, mask in self._selector.select(self._timeout()):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._drain_wake()
                    elif key.data.open:  # not closed earlier in this round
                        if mask & selectors.EVENT_WRITE:
                            self._write(key.data)
                        if mask & selectors.EVENT_READ and key.data.open:
                            self._read(key.data)
                self._expire()
                self._resume_accepting()
                self._flush_dirty()
        finally:
            for conn in list(self._pending) + list(self._authed):
                self._drop(conn)
            self._stop_accepting()
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _finished(self) -> bool:
        if self._close_deadline is None:
            return False
        if self._listener is not None:
            self._stop_accepting()
            for conn in list(self._pending):
                self._drop(conn)
        return not self._authed or time.monotonic() >= self._close_deadline

    def _stop_accepting(self) -> None:
        if self._listener is not None:
            if self._accept_resume is None:  # else out of the selector already
                self._selector.unregister(self._listener)
            self._accept_resume = None
            self._listener.close()
            self._listener = None

    def _timeout(self) -> Optional[float]:
        deadlines = [] if self._close_deadline is None else [self._close_deadline]
        if self._accept_resume is not None:
            deadlines.append(self._accept_resume)
        if self._pending:
            deadlines.append(next(iter(self._pending)).deadline)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _accept(self) -> None:
        # a few per round, so ranks are served between bursts
        for _ in range(_ACCEPT_PER_ROUND):
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:  # none left (BlockingIOError), or the peer already gave up
                if exc.errno in _OUT_OF_FILES:
                    self._out_of_files(exc)
                return
            self.stats["accepted"] += 1
            sock.setblocking(False)
            if len(self._pending) >= min(MAX_PENDING, self._pending_cap):
                oldest, _ = self._pending.popitem(last=False)
                self.stats["evicted"] += 1
                self._drop(oldest)
            conn = _Conn(sock, time.monotonic() + HANDSHAKE_DEADLINE, self._tls)
            self._pending[conn] = None
            self._selector.register(sock, conn.mask, conn)
            with self._lock:  # with TLS, it goes once the client's TLS handshake is done
                conn.outbox += _frame({"nonce": conn.nonce})
            self._write(conn)

    def _out_of_files(self, exc: OSError) -> None:
        """``accept`` failed for want of a descriptor: the connection stays in the listener's
        backlog, which stays readable, so accepting again at once would spin.  The oldest
        connection still in its handshake gives its descriptor up for it (strangers that say
        nothing cannot hold the run's ranks out); with none, the channel stops accepting for
        ``ACCEPT_PAUSE``.  Said once per channel, in the log."""
        self.stats["accept_failed"] += 1
        if not self.stats["out_of_files"]:
            _log.warning("run %s: this process is out of open files (%s): the event channel drops "
                         "the oldest connection still in its handshake, or stops accepting for "
                         "%g s at a time; raise the limit (ulimit -n) if ranks cannot connect",
                         self._run_id, exc.strerror, ACCEPT_PAUSE)
        self.stats["out_of_files"] += 1
        if self._pending:
            oldest, _ = self._pending.popitem(last=False)
            self.stats["evicted"] += 1
            self._drop(oldest)
        elif self._listener is not None and self._accept_resume is None:
            self._selector.unregister(self._listener)
            self._accept_resume = time.monotonic() + ACCEPT_PAUSE

    def _resume_accepting(self) -> None:
        if self._accept_resume is not None and time.monotonic() >= self._accept_resume:
            self._accept_resume = None
            if self._listener is not None:
                self._selector.register(self._listener, selectors.EVENT_READ)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            oldest = next(iter(self._pending))
            if oldest.deadline > now:
                return
            self._reject(oldest)

    def _flush_dirty(self) -> None:
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        for conn in dirty:
            if conn.open:
                self._write(conn)

    def _write(self, conn: _Conn) -> None:
        failed = False
        with self._lock:
            if conn.tls is not None:
                try:
                    self._seal(conn)
                except ssl.SSLError:
                    failed = True
                out = conn.wire
            elif conn.sealer is not None:
                while conn.outbox and len(conn.wire) < _RECV_CHUNK:  # a chunk at a time, as with TLS
                    chunk = conn.outbox[:_RECV_CHUNK]
                    conn.wire += conn.sealer.seal(chunk)
                    del conn.outbox[:len(chunk)]
                out = conn.wire
            else:
                out = conn.outbox
            if out and not failed:
                try:
                    sent = conn.sock.send(out)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError:
                    sent, failed = 0, True
                del out[:sent]
            # with TLS, plaintext waits for the handshake before it is anything to write
            more = bool(out) or ((conn.secure or conn.sealer is not None) and bool(conn.outbox))
            mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if more else 0)
        if failed:
            self._drop(conn)
        elif mask != conn.mask:
            conn.mask = mask
            self._selector.modify(conn.sock, mask, conn)

    @staticmethod
    def _seal(conn: _Conn) -> None:
        """Encrypt queued plaintext into ``conn.wire`` while the socket has taken what came
        before it (a chunk at a time: a rank that reads slowly holds little ciphertext), once
        the TLS handshake is done; and take what TLS itself has to send (its handshake, alerts)."""
        while conn.secure and conn.outbox and len(conn.wire) < _RECV_CHUNK:
            written = conn.tls.write(conn.outbox[:_RECV_CHUNK])
            del conn.outbox[:written]
        conn.wire += conn.tls_out.read()

    def _read(self, conn: _Conn) -> None:
        if conn.tls is not None:
            size = _TLS_RECORD if conn.role is None else _READ_CHUNK
        else:  # before authentication, never buffer more than one hello
            size = _LEN.size + MAX_HELLO - len(conn.inbuf) if conn.role is None else _READ_CHUNK
        try:
            data = conn.sock.recv(size)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            return self._ended(conn)
        if conn.tls is not None:
            conn.tls_in.write(data)
            return self._unseal(conn)
        if conn.opener is not None:
            try:
                data = conn.opener.open(data)
            except framemac.ForgedRecord as exc:
                return self._forged(conn, exc)
        conn.inbuf += data
        self._parse(conn)

    def _ended(self, conn: _Conn) -> None:
        """The peer closed its end (or broke the connection, or its TLS)."""
        if conn.role is None:
            self._reject(conn)
        else:
            self._drop(conn)

    def _parse(self, conn: _Conn) -> None:
        if conn.role is None:
            self._handshake(conn)
        else:
            self._frames(conn)

    def _unseal(self, conn: _Conn) -> None:
        """Take the plaintext of the ciphertext that arrived, all of it that is complete: the
        selector would not say that OpenSSL still holds some.  The TLS handshake comes first;
        before authentication no more plaintext than one hello is taken at a time."""
        while conn.open:
            room = _LEN.size + MAX_HELLO - len(conn.inbuf) if conn.role is None else _TLS_PLAINTEXT
            try:
                if not conn.secure:
                    conn.tls.do_handshake()
                    conn.secure = True
                data = conn.tls.read(room)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLError:  # a broken or refused TLS handshake, a bad record, the end
                data = b""
            if not data:
                return self._ended(conn)
            conn.inbuf += data
            self._parse(conn)
            if conn.secure and not conn.tls_in.pending and not conn.tls.pending():
                break  # all taken: no read that would only raise SSLWantReadError
        # the TLS handshake's answer, the challenge, the hello's reply; nothing at all, most of the
        # time, once a rank streams its records (then not even a look under the lock)
        if conn.open and (not conn.secure or conn.outbox or conn.wire or conn.tls_out.pending):
            self._write(conn)

    def _reject(self, conn: _Conn, reason: Optional[str] = None) -> None:
        """End a failed handshake, telling the client why when it deserves to know."""
        self.stats["rejected"] += 1
        data = _frame({"ok": False, "error": reason}) if reason is not None else b""
        try:  # a small write to a socket that has sent little else: it fits its buffer
            if conn.tls is not None:  # the reason (once TLS is up), or the TLS alert
                if data:
                    conn.tls.write(data)
                data = bytes(conn.wire) + conn.tls_out.read()
            if data:
                conn.sock.send(data)
        except OSError:  # ssl.SSLError too
            pass
        self._drop(conn)

    def _handshake(self, conn: _Conn) -> None:
        buf = conn.inbuf
        if len(buf) < _LEN.size:
            return
        (length,) = _LEN.unpack_from(buf)
        if length > MAX_HELLO:
            return self._reject(conn)
        if len(buf) < _LEN.size + length:
            return
        hello = _parse(bytes(buf[_LEN.size:_LEN.size + length]))
        del buf[:_LEN.size + length]
        if hello is None:
            return self._reject(conn)
        reason = self._check_hello(conn, hello)
        if reason is not None:
            return self._reject(conn, reason)
        if "fetch" in hello or "upload" in hello:
            del self._pending[conn]
            return self._hand_off(conn, hello)
        claim = (hello["role"], hello["rank"])
        if claim in self._claims:
            return self._second_claim(conn, *claim)
        del self._pending[conn]
        self._authed.add(conn)
        conn.role, conn.rank = claim
        self._claims[claim] = conn
        self.stats["authenticated"] += 1
        with self._lock:
            self._routes[claim] = conn
            proof = _mac(self._key(conn.role, conn.rank), hello["nonce"]).decode()
            conn.outbox += _frame({"ok": True, "mac": proof})
            if conn.tls is None:  # the reply goes as it is, all after it in records
                self._start_records(conn, hello)
        self._write(conn)
        if conn.open and buf:
            if conn.opener is not None:
                try:
                    rest = conn.opener.open(bytes(buf))
                except framemac.ForgedRecord as exc:
                    return self._forged(conn, exc)
                buf[:] = rest
            self._frames(conn)

    def _start_records(self, conn: _Conn, hello: dict) -> None:
        """From here on, ``conn`` (not TLS) speaks in authenticated records (``framemac``)."""
        key = framemac.session_key(self._key(hello["role"], hello["rank"]), conn.nonce, hello["nonce"])
        conn.wire += conn.outbox
        conn.outbox.clear()
        conn.sealer = framemac.Sealer(key, framemac.FROM_DRIVER)
        conn.opener = framemac.Opener(key, framemac.FROM_CLIENT)

    def _forged(self, conn: _Conn, exc: Exception) -> None:
        """A record that failed its authentication: someone on the path wrote into the
        connection.  It ends; the rank's log says so."""
        self.stats["forged"] += 1
        line = (f"torchdist: the event channel of rank {conn.rank}'s {conn.role} carried a record that failed its "
                f"authentication ({exc}); someone on the network may have written into it. The connection "
                "was closed, and nothing of that record was used")
        _log.warning("run %s: %s", self._run_id, line)
        rank = conn.rank
        self._drop(conn)
        try:
            self._on_event(events.Log(rank=rank, stream="stderr", line=line))
        except Exception:  # noqa: BLE001  the driver's handler must not stop the channel
            self.stats["callback_errors"] += 1

    def _key(self, role: str, rank: int) -> str:
        return rank_key(self._secrets[role], role, rank)

    def _second_claim(self, conn: _Conn, role: str, rank: int) -> None:
        """Refuse an authenticated connection as a role and rank that another connection owns,
        and say so in that rank's log, where the run's view shows it."""
        self.stats["claims_refused"] += 1
        try:
            host, port = conn.sock.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            peer = "a peer that has gone"
        line = (f"torchdist: refused a second connection as rank {rank}'s {role} (from {peer}): "
                f"another one already speaks for it; only the first is heard")
        _log.warning("run %s: %s", self._run_id, line)
        self._reject(conn, f"rank {rank}'s {role} is already connected to this run")
        try:
            self._on_event(events.Log(rank=rank, stream="stderr", line=line))
        except Exception:  # noqa: BLE001  the driver's handler must not stop the channel
            self.stats["callback_errors"] += 1

    def _check_hello(self, conn: _Conn, hello: dict) -> Optional[str]:
        """Why ``hello`` does not open this run's channel, or ``None`` when it does."""
        protocol = hello.get("protocol")
        if type(protocol) is not int or protocol != events.PROTOCOL_VERSION:
            return (f"event protocol version mismatch: the rank speaks version {protocol!r:.20}, "
                    f"the driver speaks version {events.PROTOCOL_VERSION}; the driver and the "
                    "executors need the same torchdist_magic version")
        role = hello.get("role")
        if not isinstance(role, str) or role not in self._secrets:
            return f"unknown role {role!r:.20}"
        rank, nonce = hello.get("rank"), hello.get("nonce")
        if type(rank) is not int or rank < 0 or not isinstance(nonce, str):
            return "a hello needs a rank and a nonce"
        if self._ranks is not None and rank >= self._ranks:
            return f"rank {rank} is not a rank of this run, which has {self._ranks}"
        if not _macs_equal(hello.get("mac"), _mac(self._key(role, rank), conn.nonce)):
            return f"authentication failed: wrong secret for role {role} of rank {rank}"
        if hello.get("run_id") != self._run_id:
            return f"wrong run: this channel serves run {self._run_id}"
        fetch = hello.get("fetch")
        if fetch is not None and not self._files.serves(fetch):
            return f"this channel serves no file named {fetch!r:.100}"
        if "upload" in hello:
            size = hello.get("size")
            if role != "launcher" or type(hello["upload"]) is not int or hello["upload"] != rank or fetch is not None:
                return "only a rank's launcher uploads, and only its own rank's value"
            if type(size) is not int or size < 0:
                return "an upload needs the value's size"
            if not self._files.takes_value(rank):
                return f"this channel waits for no value from rank {rank}"
        return None

    def _hand_off(self, conn: _Conn, hello: dict) -> None:
        """An authenticated fetch or upload: its reply queued, it leaves this thread for one of
        the file transfers'."""
        self.stats["authenticated"] += 1
        proof = _mac(self._key(hello["role"], hello["rank"]), hello["nonce"]).decode()
        conn.outbox += _frame({"ok": True, "mac": proof})
        if conn.tls is None:  # the file's bytes and the answers in records, after the reply
            self._start_records(conn, hello)
            conn.inbuf.clear()  # nothing comes before the reply but what a stranger wrote
        conn.open = False  # the server's loops let go of it
        self._selector.unregister(conn.sock)
        if "fetch" in hello:
            self._files.start(conn, hello["fetch"])
        else:
            self._files.start_upload(conn, hello["rank"], hello["size"])

    def _frames(self, conn: _Conn) -> None:
        buf, offset = conn.inbuf, 0
        while len(buf) - offset >= _LEN.size:
            (length,) = _LEN.unpack_from(buf, offset)
            if length > MAX_FRAME:  # the stream can no longer be split into frames
                self._refuse("malformed", conn, f"a frame of {length} bytes, over the channel's {MAX_FRAME}; "
                                                f"the connection was closed")
                return self._drop(conn)
            end = offset + _LEN.size + length
            if len(buf) < end:
                break
            body = bytes(buf[offset + _LEN.size:end])
            offset = end
            self._deliver(conn, body)
        del buf[:offset]

    def _deliver(self, conn: _Conn, body: bytes) -> None:
        self.stats["frames"] += 1
        conn.heard = True
        frame = _parse(body)
        items = frame.get("events") if frame is not None else None
        if not isinstance(items, list):
            self._refuse("malformed", conn, "a frame that is not a JSON object with a list of records")
            return
        allowed = events.SENDERS[conn.role]
        for item in items:
            record = _decode(item)
            if record is None:
                kind = item.get("type") if isinstance(item, dict) else None
                self._refuse("malformed", conn, f"a record that does not decode ({kind!r})"[:200])
            elif type(record) not in allowed:
                self._refuse("forbidden", conn, f"a {type(record).__name__} record, which a {conn.role} may not send")
            else:
                record.rank = conn.rank  # the record was made here, from the frame: no copy needed
                try:
                    self._on_event(record)
                except Exception as exc:  # noqa: BLE001  the driver's handler must not stop the channel
                    self._refuse("callback_errors", conn,
                                 f"a {type(record).__name__} record that the run's state could not take "
                                 f"({type(exc).__name__}: {exc})"[:300])
                else:
                    self.stats["delivered"] += 1

    def _refuse(self, kind: str, conn: _Conn, detail: str) -> None:
        """Count a refused record (``kind``: a ``stats`` key), say it once per kind in the log,
        and hand it to ``on_refusal``."""
        self.stats[kind] += 1
        if kind not in self._refusals_logged:
            self._refusals_logged.add(kind)
            _log.warning("run %s: the channel refused %s from rank %s's %s (further refusals of this kind "
                        "are counted in run.state.refusals)", self._run_id, detail, conn.rank, conn.role)
        if self._on_refusal is not None:
            try:
                self._on_refusal(kind, conn.rank, detail)
            except Exception:  # noqa: BLE001  counting must not stop the channel
                _log.exception("run %s: counting a refused record failed", self._run_id)

    def _drop(self, conn: _Conn) -> None:
        if not conn.open:
            return
        conn.open = False
        self._pending.pop(conn, None)
        self._authed.discard(conn)
        if not conn.heard and self._claims.get((conn.role, conn.rank)) is conn:
            del self._claims[(conn.role, conn.rank)]
        with self._lock:
            if self._routes.get((conn.role, conn.rank)) is conn:
                del self._routes[(conn.role, conn.rank)]
            self._dirty.discard(conn)
        self._selector.unregister(conn.sock)
        conn.sock.close()


class _FileTransfers:
    """Sends the files a channel serves and takes the ranks' values (see the module's "Files"),
    each on a thread of its own, at most ``FETCHES_AT_ONCE`` at once: the channel's thread,
    which decodes the ranks' records, never waits for a file.  Sent from the file itself and
    written as it arrives, never held in memory."""

    def __init__(self, files: Dict[str, str], stats: Dict[str, int]):
        self._files = files
        self._stats = stats
        self._lock = threading.Lock()
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._sockets: set = set()   # of transfers started and not ended
        self._closed = False
        self._values: Dict[int, str] = {}  # where each rank's value goes

    def serves(self, name: object) -> bool:
        return isinstance(name, str) and name in self._files

    def receive_values(self, paths: Dict[int, str]) -> None:
        with self._lock:
            self._values = dict(paths)

    def takes_value(self, rank: int) -> bool:
        with self._lock:
            return rank in self._values

    def start(self, conn: _Conn, name: str) -> None:
        self._begin(conn, self._send, self._files[name])

    def start_upload(self, conn: _Conn, rank: int, size: int) -> None:
        with self._lock:  # each rank's value is taken once: no two uploads write one file
            path = self._values.pop(rank, None)
        if path is None:  # taken by another upload, or another attempt's paths, since the hello was checked
            conn.sock.close()
            return
        self._begin(conn, self._receive, path, size)

    def _begin(self, conn: _Conn, transfer: Callable, *args) -> None:
        with self._lock:
            if not self._closed:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(FETCHES_AT_ONCE, "torchdist-files")
                self._sockets.add(conn.sock)
                self._pool.submit(self._run, transfer, conn, *args)
                return
        conn.sock.close()

    def close(self) -> None:
        """End the transfers under way (their connections are shut) and those waiting."""
        with self._lock:
            self._closed = True
            sockets, pool = list(self._sockets), self._pool
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes its thread, which closes it
            except OSError:
                pass
        if pool is not None:
            pool.shutdown(wait=False)

    def _run(self, transfer: Callable, conn: _Conn, *args) -> None:
        sock = conn.sock
        try:
            with self._lock:
                if self._closed:
                    return
            sock.settimeout(FETCH_STALL)
            if conn.tls is not None:  # what the TLS handshake left to send comes first
                sock.sendall(bytes(conn.wire) + conn.tls_out.read())
            elif conn.wire:  # the handshake's reply, before the records
                sock.sendall(bytes(conn.wire))
            transfer(conn, *args)
        except framemac.ForgedRecord as exc:  # the file is not taken: the rank says what it saw
            with self._lock:
                self._stats["forged"] += 1
            _log.warning("rank %d's file transfer carried a record that failed its authentication (%s); "
                         "someone on the network may have written into it. It was dropped", conn.rank, exc)
        except (OSError, ssl.SSLError):  # the peer went, stalled, or close(): it says what it saw
            pass
        finally:
            with self._lock:
                self._sockets.discard(sock)
            sock.close()

    def _send(self, conn: _Conn, path: str) -> None:
        try:
            fh = open(path, "rb", buffering=0)
        except OSError as exc:
            self._sendall(conn, bytes(conn.outbox) + _frame({"error": f"the driver cannot read it: {exc}"}))
            return
        with fh:
            size = os.fstat(fh.fileno()).st_size
            self._sendall(conn, bytes(conn.outbox) + _frame({"size": size}))
            if conn.tls is None and conn.sealer is None:
                sent = conn.sock.sendfile(fh, 0, size)
            else:
                sent = self._send_sealed(conn, fh, size)
        if sent == size:
            with self._lock:
                self._stats["files_sent"] += 1

    def _receive(self, conn: _Conn, path: str, size: int) -> None:
        """A rank's value of ``size`` bytes into ``path``, through ``path.tmp``."""
        folder, tmp = os.path.dirname(path), path + ".tmp"
        try:
            room = os.statvfs(folder)
            free = room.f_bavail * room.f_frsize
            if size > free:
                return self._sendall(conn, bytes(conn.outbox) + _frame({"error": (
                    f"no room for it on the driver: {folder} has {free / 2**20:.1f} MiB free")}))
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            return self._sendall(conn, bytes(conn.outbox) + _frame({"error": f"the driver cannot write {tmp}: {exc}"}))
        written = False
        try:
            self._sendall(conn, bytes(conn.outbox) + _frame({"ready": True}))
            buffer = memoryview(bytearray(max(min(size, _FILE_CHUNK), 1)))
            wire = memoryview(bytearray(_FILE_CHUNK)) if conn.tls is not None or conn.opener is not None else buffer
            got, failure = 0, ""
            while got < size:
                n = self._recv_into(conn, buffer[:min(len(buffer), size - got)], wire)
                if not n:
                    return  # the rank went: it says what it saw
                if not failure:
                    try:
                        part = buffer[:n]
                        while part.nbytes:
                            part = part[os.write(out, part):]
                    except OSError as exc:
                        cause = f"no room for it in {folder}" if exc.errno in _NO_ROOM else f"cannot write {tmp}"
                        failure = f"{cause} on the driver after {got / 2**20:.1f} MiB ({exc})"
                        self._sendall(conn, _frame({"error": failure}))  # the rest is read and dropped
                got += n
            if not failure:
                os.close(out)
                out = -1
                os.rename(tmp, path)
                written = True
                with self._lock:
                    self._stats["values_received"] += 1
                self._sendall(conn, _frame({"ok": True}))
        finally:
            if out >= 0:
                os.close(out)
            if not written:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    @staticmethod
    def _recv_into(conn: _Conn, buffer: memoryview, wire: memoryview) -> int:
        """Plaintext of the connection into ``buffer``; 0 at its end.  With TLS, the
        ciphertext comes through ``wire``, reused as ``buffer`` is (a fresh 1 MiB per read
        would cost its pages' faults each time); so do the records of a connection without TLS."""
        if conn.opener is not None:
            while not conn.inbuf:
                n = conn.sock.recv_into(wire)
                if not n:
                    return 0
                conn.inbuf += conn.opener.open(wire[:n])
            n = min(len(buffer), len(conn.inbuf))
            buffer[:n] = conn.inbuf[:n]
            del conn.inbuf[:n]
            return n
        if conn.tls is None:
            return conn.sock.recv_into(buffer)
        while True:
            try:
                return conn.tls.read(len(buffer), buffer)
            except ssl.SSLWantReadError:
                n = conn.sock.recv_into(wire)
                if not n:
                    return 0
                conn.tls_in.write(wire[:n])
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0

    @staticmethod
    def _sendall(conn: _Conn, data: bytes) -> None:
        if conn.sealer is not None:
            conn.sock.sendall(conn.sealer.seal(data))
        elif conn.tls is None:
            conn.sock.sendall(data)
        else:
            conn.tls.write(data)
            conn.sock.sendall(conn.tls_out.read())

    @staticmethod
    def _send_sealed(conn: _Conn, fh, size: int) -> int:
        buffer = memoryview(bytearray(min(size, _FILE_CHUNK)))
        sent = 0
        while sent < size:
            n = fh.readinto(buffer)
            if not n:
                break
            _FileTransfers._sendall(conn, buffer[:n])
            sent += n
        return sent


# -- rank side --------------------------------------------------------------------------------

class TlsSocket:
    """A client's TLS connection over its blocking socket, done in memory, with what
    ``ChannelClient`` uses of a socket (``sendall``, ``recv``, ``settimeout``, ``shutdown``,
    ``close``).  The sender and the reader thread share it (see the module's "TLS")."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext):
        self._sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._in, self._out, server_side=False)
        self._lock = threading.Lock()   # the TLS object
        self._wire = threading.Lock()   # the socket's write side

    def handshake(self) -> None:
        while True:
            try:
                return self._locked(self._tls.do_handshake)
            except ssl.SSLWantReadError:
                if not self._fill():
                    raise EOFError("connection closed during the TLS handshake") from None

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        for start in range(0, len(view), _RECV_CHUNK):
            self._locked(functools.partial(self._tls.write, view[start:start + _RECV_CHUNK]))

    def recv(self, n: int) -> bytes:
        while True:
            data = self._locked(functools.partial(self._plaintext, n))
            if data is not None:
                return data
            if not self._fill():
                with self._lock:
                    self._in.write_eof()

    def recv_into(self, buffer: memoryview) -> int:
        """Plaintext into ``buffer`` (a fetch's reused buffer); 0 at the end."""
        while True:
            data = self._locked(functools.partial(self._plaintext, len(buffer), buffer))
            if data is not None:
                return data
            if not self._fill():
                with self._lock:
                    self._in.write_eof()

    def _plaintext(self, n: int, buffer: Optional[memoryview] = None) -> Optional[Union[bytes, int]]:
        """Up to ``n`` bytes of plaintext; ``None`` when more ciphertext is needed first."""
        try:
            return self._tls.read(n) if buffer is None else self._tls.read(n, buffer)
        except ssl.SSLWantReadError:
            return None
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):  # closed, with or without TLS's goodbye
            return b"" if buffer is None else 0

    def _fill(self) -> bool:
        """Read ciphertext from the socket into TLS; False at the end of the connection."""
        data = self._sock.recv(_RECV_CHUNK)
        if data:
            with self._lock:
                self._in.write(data)
        return bool(data)

    def _locked(self, operation: Callable):
        """``operation()`` on the TLS object, then send what it wrote (also when it raised):
        the write side is taken before the TLS lock is let go, so records leave in the order
        they were made, and the TLS object is free again while the socket sends."""
        out = b""
        try:
            with self._lock:
                try:
                    return operation()
                finally:
                    out = self._out.read()
                    if out:
                        self._wire.acquire()
        finally:
            if out:
                try:
                    self._sock.sendall(out)
                finally:
                    self._wire.release()

    def settimeout(self, timeout: Optional[float]) -> None:
        self._sock.settimeout(timeout)

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()


class ChannelClient:
    """Rank side (a worker, or the launcher of a rank): ``send`` never blocks, ``close``
    flushes what is queued; records from the driver go to ``on_message`` (on a thread of the
    client's), when given.

    If the driver cannot be reached, or refuses this client, one line says so on the process's
    stderr and records are dropped from then on.  With ``certificate`` (PEM: the run's, from
    ``tls.ChannelIdentity``) the connection is TLS and the driver must present exactly that
    certificate; a server that does not is not the driver, and nothing is sent to it.
    """

    def __init__(self, address: str, secret: str, run_id: str, rank: int, *, role: str = "worker",
                 on_message: Optional[Callable[[events.Event], None]] = None, maxsize: int = 100_000,
                 certificate: str = ""):
        if role not in events.SENDERS:
            raise ValueError(f"role is one of {sorted(events.SENDERS)}, not {role!r}")
        self._tls = tls.client_context(certificate) if certificate else None
        host, _, port = address.rpartition(":")
        self._address = (host.strip("[]"), int(port))
        self._secret = secret
        self._run_id = run_id
        self._rank = rank
        self._role = role
        self._on_message = on_message
        self._queue: "queue.Queue[Optional[events.Event]]" = queue.Queue(maxsize=maxsize)
        self._lock = threading.Lock()
        self._dropped = 0                      # records not sent since the last Dropped record
        self._lost = False                     # no driver to send to: drop everything
        self._closed = False
        self._flush_now = threading.Event()    # a record not to wait for, or close(): send what is queued
        self._sock: Optional[Union[framemac.MacSocket, TlsSocket]] = None
        self._reader: Optional[threading.Thread] = None
        self._settled = threading.Event()      # the first connection was made, or given up
        self._sender = threading.Thread(target=self._run, name=f"torchdist-channel-rank{rank}", daemon=True)
        self._sender.start()

    @property
    def lost(self) -> bool:
        """True once the driver could not be reached, refused this client, or the client was
        closed: nothing is sent from then on."""
        return self._lost

    def reaches_driver(self, timeout: float) -> bool:
        """Whether this client is connected to the driver, waiting at most ``timeout`` seconds
        for its first connection to be made or given up (a rank's debugger asks before it waits
        for the driver's lines)."""
        self._settled.wait(timeout)
        return self._settled.is_set() and not self._lost

    def send(self, event: events.Event) -> None:
        if not isinstance(event, events.Event):
            raise TypeError(f"the channel sends events.Event records, not {type(event).__name__}")
        if self._lost or self._closed:
            return
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            with self._lock:
                self._dropped += 1
        else:
            if not isinstance(event, GATHERED):
                self._flush_now.set()

    def close(self, timeout: float = CLIENT_CLOSE_WAIT) -> None:
        """Send what is queued and close, within ``timeout`` seconds; after that the rest is
        dropped (and one line says so)."""
        deadline = time.monotonic() + timeout
        if not self._closed:
            self._closed = True
            self._flush_now.set()
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                pass
        self._sender.join(max(0.0, deadline - time.monotonic()))
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():  # on_message may close
            reader.join(max(0.0, deadline - time.monotonic()))
        if self._sender.is_alive():
            self._give_up(f"the events of rank {self._rank} were not all sent within {timeout:g} s; "
                          "the rest are dropped")
        with self._lock:
            self._lost = True
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the client's threads blocked on it
            except OSError:
                pass
            sock.close()

    def _give_up(self, message: str) -> None:
        with self._lock:
            if self._lost:
                return
            self._lost = True
        print(f"torchdist_magic: {message}", file=sys.__stderr__, flush=True)

    # -- sender thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            sock = self._connect()
        finally:
            self._settled.set()
        if sock is not None:
            with self._lock:
                keep = not self._lost  # close() may have given up while this thread connected
                if keep:
                    self._sock = sock
            if not keep:
                sock.close()
            elif self._on_message is not None:
                self._reader = threading.Thread(target=self._read, args=(sock,),
                                                name=f"torchdist-channel-rank{self._rank}-in", daemon=True)
                self._reader.start()
        while True:
            batch = [self._queue.get()]
            if isinstance(batch[0], GATHERED) and self._queue.qsize() < BATCH:
                self._flush_now.wait(FLUSH_EVERY)  # what this interval brings goes in one batch
            if not self._closed:
                self._flush_now.clear()  # what set it is in the queue now, and goes in this batch
            while len(batch) < BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            end = next((i for i, item in enumerate(batch) if item is None), None)
            if end is not None:  # close(): what came before it is the last to send
                self._write(batch[:end])
                break
            self._write(batch)
        self._finish()

    def _connect(self) -> Optional[Union[framemac.MacSocket, TlsSocket]]:
        where = f"{self._address[0]}:{self._address[1]}"
        try:
            return open_connection(self._address, self._secret, self._run_id, self._rank, self._role, self._tls)
        except Refused as exc:
            self._give_up(f"the driver at {where} refused the event channel of rank {self._rank}: {exc}")
        except NotTheDriver as exc:
            self._give_up(f"the server at {where} is not this run's driver: {exc}; events of rank "
                          f"{self._rank} are not sent to it")
        except (OSError, EOFError, FrameError) as exc:
            self._give_up(f"cannot reach the driver's event channel at {where} ({exc}); "
                          f"events of rank {self._rank} are dropped")
        return None

    def _write(self, records: List[events.Event]) -> None:
        with self._lock:
            dropped, self._dropped = self._dropped, 0
        if self._lost or self._sock is None:
            return
        data = encode_batch(records, self._rank, dropped)
        if not data:
            return
        try:
            self._sock.sendall(data)
        except OSError as exc:
            self._give_up(f"the event channel of rank {self._rank} to the driver was lost ({exc}); "
                          "its events are dropped from now on")

    def _finish(self) -> None:
        """Half-close and wait for the driver to close its side: it closes a connection only
        after handling every record that came before the end of it."""
        sock = self._sock
        if sock is None or self._lost:
            return
        try:
            sock.shutdown(socket.SHUT_WR)
            if self._reader is None:
                while sock.recv(_RECV_CHUNK):
                    pass
        except OSError:
            pass

    # -- reader thread --------------------------------------------------------------------

    def _read(self, sock: Union[framemac.MacSocket, TlsSocket]) -> None:
        while True:
            try:
                frame = read_frame(sock, MAX_FRAME)
            except framemac.ForgedRecord as exc:
                self._give_up(f"a record to rank {self._rank} on the event channel failed its authentication "
                              f"({exc}): someone on the network may have written into it; nothing of it was "
                              "used, and the rank's events are dropped from now on")
                return
            except (OSError, EOFError, FrameError):  # the driver, or close(), ended the connection
                return
            items = frame.get("events")
            for item in items if isinstance(items, list) else ():
                record = _decode(item)
                if not isinstance(record, events.DRIVER_TO_RANK):
                    continue
                try:
                    self._on_message(record)
                except Exception as exc:  # noqa: BLE001  one bad message must not deafen the rank
                    print(f"torchdist_magic: rank {self._rank} could not handle {record.type!r} from "
                          f"the driver: {exc!r}", file=sys.__stderr__, flush=True)


def open_connection(address: Tuple[str, int], secret: str, run_id: str, rank: int, role: str,
                    context: Optional[ssl.SSLContext] = None, fetch: str = "",
                    upload: Optional[int] = None) -> Union[framemac.MacSocket, TlsSocket]:
    """An authenticated connection to the driver at ``address`` as ``role`` of ``rank`` (TLS
    with ``context``; ``fetch``: to fetch the file of that name; ``upload``: to send the rank's
    value of that many bytes; see the module's "Files"): each
    handshake within ``HANDSHAKE_DEADLINE``; one that the driver cut off (evicted from its
    pending table) or that took too long is tried again after a jittered, growing pause, for at most ``CONNECT_ATTEMPTS`` times ``HANDSHAKE_DEADLINE``.  Raises
    ``Refused``, ``NotTheDriver``, ``FrameError``, ``EOFError`` or ``OSError`` (``TimeoutError``
    too)."""
    started = time.monotonic()
    give_up = started + CONNECT_ATTEMPTS * HANDSHAKE_DEADLINE
    pause = _RETRY_PAUSE
    while True:
        attempt = time.monotonic()
        try:
            return _handshake(address, secret, run_id, rank, role, context,
                              min(attempt + HANDSHAKE_DEADLINE, give_up), fetch, upload)
        except (EOFError, ConnectionResetError, BrokenPipeError, TimeoutError, socket.timeout) as exc:  # 3.9: not the same
            wait = pause * random.uniform(0.5, 1.5)
            if time.monotonic() + wait >= give_up:
                if isinstance(exc, (TimeoutError, socket.timeout)):  # a read's own says only "timed out"
                    raise TimeoutError(f"no handshake within {HANDSHAKE_DEADLINE:g} s") from exc
                raise
            time.sleep(wait)
            pause = min(2 * pause, _RETRY_PAUSE_MAX)


def _handshake(address: Tuple[str, int], secret: str, run_id: str, rank: int, role: str,
               context: Optional[ssl.SSLContext], deadline: float, fetch: str = "",
               upload: Optional[int] = None) -> Union[framemac.MacSocket, TlsSocket]:
    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no handshake within {HANDSHAKE_DEADLINE:g} s")
        return remaining

    sock = socket.create_connection(address, timeout=left())
    try:
        if context is not None:
            sock = TlsSocket(sock, context)
            try:
                sock.handshake()
            except ssl.SSLCertVerificationError as exc:
                raise NotTheDriver(f"its TLS certificate is not the one this run pinned "
                                    f"({exc.verify_message})") from None
            sock.settimeout(left())
        nonce = read_frame(sock, MAX_HELLO).get("nonce")
        if not isinstance(nonce, str):
            raise FrameError("the driver sent no challenge")
        own_nonce = secrets.token_hex(16)
        sock.settimeout(left())
        hello = {"mac": _mac(secret, nonce).decode(), "nonce": own_nonce, "run_id": run_id, "rank": rank,
                 "role": role, "protocol": events.PROTOCOL_VERSION}
        if fetch:
            hello["fetch"] = fetch
        if upload is not None:
            hello.update(upload=rank, size=upload)
        sock.sendall(_frame(hello))
        sock.settimeout(left())
        reply = read_frame(sock, MAX_HELLO)
        if reply.get("ok") is not True:
            raise Refused(f"{reply.get('error', 'no reason given')!s:.500}")
        if not _macs_equal(reply.get("mac"), _mac(secret, own_nonce)):
            raise Refused("it could not prove that it knows this run's secret")
        if context is None:  # no TLS: every byte from here on in authenticated records
            sock = framemac.MacSocket(sock, framemac.session_key(secret, nonce, own_nonce))
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


def encode_batch(records: List[events.Event], rank: int, dropped: int = 0) -> bytes:
    """The frames that carry ``records`` of ``rank`` (progress coalesced, ``_coalesce``), and a
    ``Dropped`` record for ``dropped`` plus those JSON cannot carry; ``b""`` for nothing."""
    parts = []
    for record in merge_logs(_merge_metrics(_coalesce(records))):
        part = _encoded(record)
        if part is None and type(record) is events.Metrics and record.more:  # only the bad points are lost
            pieces = [_encoded(events.Metrics(rank=record.rank, step=p.step, values=p.values, time=p.time))
                      for p in record.points()]
            dropped += pieces.count(None)
            parts += [piece for piece in pieces if piece is not None]
        elif part is None and type(record) is events.Log and record.more:  # only the lines too long to send
            pieces = [_encoded(events.Log(rank=record.rank, stream=o.stream, line=o.line, cr=o.cr))
                      for o in record.lines()]
            dropped += pieces.count(None)
            parts += [piece for piece in pieces if piece is not None]
        elif part is None:
            dropped += 1
        else:
            parts.append(part)
    if dropped:
        parts.append(events.dumps(events.Dropped(rank=rank, count=dropped)).encode("utf-8"))
    return _pack(parts) if parts else b""


def _encoded(record: events.Event) -> Optional[bytes]:
    """The JSON of ``record``; ``None`` when JSON cannot carry it (nan, an object) or it would
    not fit a frame."""
    try:
        part = events.dumps(record).encode("utf-8")
    except (TypeError, ValueError):
        return None
    return part if len(part) <= MAX_FRAME - 16 else None


def _pack(parts: List[bytes]) -> bytes:
    """Encoded records as ``{"events": [...]}`` frames of at most ``MAX_FRAME`` bytes."""
    frames, chunk, size = [], [], 0
    for part in parts:
        if chunk and size + len(part) + 16 > MAX_FRAME:
            frames.append(_events_frame(chunk))
            chunk, size = [], 0
        chunk.append(part)
        size += len(part) + 1
    if chunk:
        frames.append(_events_frame(chunk))
    return b"".join(frames)


def _events_frame(parts: List[bytes]) -> bytes:
    body = b'{"events":[' + b",".join(parts) + b"]}"
    return _LEN.pack(len(body)) + body


def _coalesce(records: List[events.Event]) -> List[events.Event]:
    """Keep only the newest update of each progress bar; everything else in order."""
    newest = {}
    for i, record in enumerate(records):
        if isinstance(record, events.Progress):
            newest[(record.rank, record.bar)] = i
    return [r for i, r in enumerate(records)
            if not isinstance(r, events.Progress) or newest[(r.rank, r.bar)] == i]


def _merge_metrics(records: List[events.Event]) -> List[events.Event]:
    """The ``Metrics`` records of each rank as one, at the place of its first (its points in
    the order they were reported, in ``more``): the driver decodes and applies one record per
    flush, not one per ``report()``.  Metrics only move ahead of other records, never behind."""
    out: List[events.Event] = []
    heads: Dict[int, int] = {}           # rank: index in out of its first Metrics
    copied = set()                       # indices in out of merged copies (the sender's records stay as they were)
    for record in records:
        if type(record) is not events.Metrics:
            out.append(record)
            continue
        at = heads.get(record.rank)
        if at is None:
            heads[record.rank] = len(out)
            out.append(record)
            continue
        if at not in copied:
            copied.add(at)
            out[at] = dataclasses.replace(out[at], more=list(out[at].more))
        out[at].more.append(events.MetricPoint(record.step, record.values, record.time))
        out[at].more.extend(record.more)
    return out


#: the most text ``merge_logs`` puts into one record (far below ``MAX_FRAME``)
MERGED_LOG_CHARS = 64 * 1024


def merge_logs(records: List[events.Event]) -> List[events.Event]:
    """Each run of a rank's ``Log`` records as one (its lines in order, in ``more``), at the
    place of the run's first: the driver decodes and applies one record per flush, not one per
    line.  A line moves ahead only of progress and metrics records; any other record (a warm
    job's ``OutputEnd``, an ``Exit``) ends the run, so no line ever crosses it."""
    out: List[events.Event] = []
    heads: Dict[int, Tuple[int, int]] = {}   # rank: (index in out of its open Log, its text so far)
    copied = set()                           # indices in out of merged copies (the sender's records stay as they were)
    for record in records:
        kind = type(record)
        if kind is not events.Log:
            if kind is not events.Progress and kind is not events.Metrics:
                heads.clear()
            out.append(record)
            continue
        head = heads.get(record.rank)
        size = len(record.line)
        if head is None or head[1] + size > MERGED_LOG_CHARS:
            heads[record.rank] = (len(out), size)
            out.append(record)
            continue
        at, text = head
        if at not in copied:
            copied.add(at)
            out[at] = dataclasses.replace(out[at], more=list(out[at].more))
        merged = out[at]
        merged.more.append(events.OutputLine(record.stream, record.line, record.cr))
        merged.more.extend(record.more)
        heads[record.rank] = (at, text + size + sum(len(o.line) for o in record.more))
    return out


def client_from_env(on_message: Optional[Callable[[events.Event], None]] = None) -> Optional[ChannelClient]:
    """A worker's client, from ``TORCHDIST_CHANNEL`` (host:port), ``TORCHDIST_SECRET``,
    ``TORCHDIST_RUN_ID``, ``RANK`` and ``TORCHDIST_CHANNEL_CERT`` (the run's certificate, when its
    channel is TLS); ``None`` when the rank runs without a channel.
    ``on_message`` gets what the driver sends the worker (a warm pool's ``RunJob``)."""
    address = os.environ.get(CHANNEL_ENV)
    if not address:
        return None
    return ChannelClient(address, os.environ.get(SECRET_ENV, ""),
                         os.environ.get(RUN_ID_ENV, ""), int(os.environ.get("RANK", "0")),
                         on_message=on_message, certificate=os.environ.get(CHANNEL_CERT_ENV, ""))
