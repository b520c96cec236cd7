"""The driver's side of the channel: one thread that accepts, authenticates and serves every
rank's connections (``ChannelServer``), handing their records to the run and sending records to
them.

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
through the driver's compiled decoder (``core.recorddecoder``: msgspec, which takes exactly what
``events.decode`` takes); a malformed one, or one its role may not send (``events.SENDERS``), is
dropped and counted, and a delivered record's ``rank`` is the authenticated one, whatever the
record said.  Records to a rank wait in a per-connection outbox that the server thread writes
when the peer reads, so a rank that stops reading delays nobody.
"""

from __future__ import annotations

import collections
import errno
import logging
import selectors
import socket
import ssl
import threading
import time
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

from ..core import events, fdlimit
from ..core.rankenv import rank_key
from ..core.timing import CHANNEL_CLOSE_WAIT, CHANNEL_THREAD_WAIT, HANDSHAKE_DEADLINE
from . import fanin, framemac, tls
from .connection import TLS_PLAINTEXT, Connection
from .frames import LENGTH, MAX_FRAME, MAX_HELLO, hello_mac, pack_frame, parse_object, take_frames
from .handshake import check_hello
from .transfers import TRANSFERS_PER_RANK, FileTransfers

#: connections waiting for their handshake at once; one more evicts the oldest.  Enough for
#: every connection of a 1024-rank run opened at once (a worker's and a launcher's per rank)
#: to wait its turn; each costs at most one hello of plaintext (``MAX_HELLO``) or one TLS record
#: of ciphertext (``_TLS_RECORD``) and its TLS state, so a flood of strangers costs a bounded
#: amount of memory
MAX_PENDING = 2048
#: bytes the driver may have queued for one rank that does not read them; more are refused
MAX_OUTBOX = 4 * MAX_FRAME

_log = logging.getLogger("torchdist_magic")
#: connections accepted in one round of the server's loop at most
_ACCEPT_PER_ROUND = 64
#: ``accept`` out of descriptors (this process's, the system's) or of socket memory
_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
#: how long the channel stops accepting when it is out of descriptors and has no connection
#: in its handshake to give one up
ACCEPT_PAUSE = 0.1


def _half_the_files() -> int:
    """Half of this process's soft limit on open files (``MAX_PENDING`` where there is none)."""
    current = fdlimit.limits()
    if current is None or current[0] < 0:  # RLIM_INFINITY
        return MAX_PENDING
    return max(16, current[0] // 2)


class ChannelServer:
    """Driver side: authenticates ranks, hands their records to ``on_event`` and sends records
    to them.

    ``on_event`` is called on the server's one thread with every record that passed
    ``events.decode`` and that its sender's role may send, its ``rank`` the authenticated one.
    ``stats`` counts what happened: ``accepted``, ``authenticated``, ``rejected`` (failed
    handshakes), ``evicted`` (unauthenticated connections closed to make room), ``frames`` and
    ``delivered`` (after authentication), ``malformed`` (undecodable frames or records),
    ``forbidden`` (records the connection's role may not send), ``callback_errors``,
    ``forged`` (records without TLS whose MAC was wrong: their connection ended; ``authenticated``
    also counts each role and rank that joined through a host relay),
    ``accept_failed`` and ``out_of_files`` (``accept`` found no descriptor left).  Nothing is
    refused in silence: the first refusal of each kind is logged (the ``torchdist_magic`` logger,
    a warning), and every one goes to ``on_refusal(kind, rank, detail)`` (the run's state counts
    them where the view and ``run.state.refusals`` show them).  With
    ``identity`` (a ``tls.ChannelIdentity``) every connection is TLS; a TLS handshake that fails
    is a failed handshake (``rejected``).  ``files`` (``{name: path}``) are the files an
    authenticated peer may fetch (see ``transfers``); ``files_sent`` counts those sent
    whole, ``values_received`` the ranks' values taken whole (``receive_values``).  ``ranks``: the
    run's number of ranks, of which a hello must name one; with one connection per role and rank
    (the first, ``claims_refused`` counts the others), a run has at most two per rank, and at
    most ``transfers.TRANSFERS_PER_RANK`` file transfers per rank's launcher
    (``transfers_refused`` counts the others).

    Host relays (``fanin``, ``relay``): with ``relays`` (the driver's channel) a relay may
    speak for the ranks its hello names and those that join it (no rank for two relays), each
    of its segments delivered as that rank's role would have sent it.  A relay's own local server passes ``relays=False``, ``only_ranks`` (its
    host's) and ``delivery`` (what takes its ranks' frames: ``relay``'s, which reads none).
    """

    def __init__(
        self,
        on_event: Callable[[events.Event], None],
        run_id: str,
        *,
        host: str = "127.0.0.1",
        secret: str,
        launcher_secret: str,
        identity: Optional[tls.ChannelIdentity] = None,
        files: Optional[Dict[str, str]] = None,
        ranks: Optional[int] = None,
        on_refusal: Optional[Callable[[str, int, str], None]] = None,
        relays: bool = True,
        only_ranks: Optional[FrozenSet[int]] = None,
        delivery: Any = None,
    ):
        self._run_id = run_id
        self._ranks = ranks
        self._only_ranks = only_ranks
        # a host relay speaks for its host's ranks with a key of the launchers' secret (``fanin``)
        self._secrets = {"worker": secret, "launcher": launcher_secret}
        if relays:
            self._secrets["relay"] = launcher_secret
        self._tls = identity.server_context() if identity is not None else None
        #: whether every connection speaks TLS (``identity`` was given)
        self.encrypted = self._tls is not None
        self.stats: Dict[str, int] = dict.fromkeys(
            (
                "accepted",
                "authenticated",
                "rejected",
                "evicted",
                "frames",
                "delivered",
                "malformed",
                "forbidden",
                "callback_errors",
                "files_sent",
                "values_received",
                "accept_failed",
                "out_of_files",
                "claims_refused",
                "transfers_refused",
                "forged",
            ),
            0,
        )
        if delivery is None:  # the driver's: it decodes (msgspec), which a host relay does not
            from .delivery import Delivery

            delivery = Delivery(on_event, on_refusal, self.stats, run_id)
        self._delivery = delivery
        # each rank's host relay (server thread only)
        self._relay_of: Dict[int, Connection] = {}
        self._files = FileTransfers(dict(files or {}), self.stats)
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
        self._pending: "collections.OrderedDict[Connection, None]" = collections.OrderedDict()  # oldest first
        # connections in their handshake hold at most half of this process's descriptors, so
        # that a flood of strangers leaves the kernel's own files and the ranks' connections room
        self._pending_cap = _half_the_files()
        self._accept_resume: Optional[float] = None  # while out of descriptors: when to accept again
        self._authed: set = set()
        # shared with send(); the outboxes too
        self._lock = threading.Lock()
        self._routes: Dict[Tuple[Optional[str], int], Connection] = {}  # the connection of each role and rank
        # the connection that owns each role and rank (server thread only): the first to
        # authenticate as it; it lets go only if it ends before it sent a single frame (its client
        # gave up on a slow reply and tries again)
        self._claims: Dict[Tuple[Optional[str], int], Connection] = {}
        self._dirty: set = set()  # connections with new output
        self._closing: set = set()  # connections to close (``close_peer``)
        self._close_deadline: Optional[float] = None
        self._thread = threading.Thread(target=self._serve, name="torchdist-channel", daemon=True)
        self._thread.start()

    # -- API ------------------------------------------------------------------------------

    def send(self, rank: int, record: events.Event, role: str = "launcher") -> bool:
        """Queue ``record`` for the connection of ``role`` and ``rank``; ``False`` when there is
        none (not connected, already gone, the channel closed) or it has stopped reading."""
        return self._send_to([(role, rank)], pack_frame({"events": [events.encode(record)]})) == 1

    def send_frame(self, role: str, rank: int, body: bytes) -> bool:
        """Queue one frame's ``body`` (already encoded) for the connection of ``role`` and
        ``rank``, as ``send`` does (a host relay passes on what the driver sent one of its
        ranks)."""
        return self._send_to([(role, rank)], LENGTH.pack(len(body)) + body) == 1

    def close_peer(self, role: str, rank: int) -> None:
        """Close the connection of ``role`` and ``rank``, if there is one."""
        with self._lock:
            conn = self._routes.get((role, rank))
            if conn is not None:
                self._closing.add(conn)
        self._wake()

    def broadcast(self, record: events.Event, role: str = "launcher") -> int:
        """Queue ``record`` for every rank connected as ``role``; the number it was queued for."""
        with self._lock:
            keys = [key for key in self._routes if key[0] == role]
        return self._send_to(keys, pack_frame({"events": [events.encode(record)]}))

    def receive_values(self, paths: Dict[int, str]) -> None:
        """Take each rank's value (``{rank: path}``) over the channel into its path, once (see
        ``transfers``), in place of those given before; a rank not named may upload
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
                _log.warning(
                    "run %s: the event channel's thread was still delivering a record %g s after close; left behind",
                    self._run_id,
                    CHANNEL_CLOSE_WAIT + CHANNEL_THREAD_WAIT,
                )

    # -- server thread --------------------------------------------------------------------

    def _send_to(self, keys: List[Tuple[Optional[str], int]], data: bytes) -> int:
        """Queue one frame, ``data``, for each connection of ``keys``; through its host relay
        (``fanin``) for a role and rank behind one."""
        sent = 0
        with self._lock:
            if self._close_deadline is not None:
                return 0
            for key in keys:
                conn = self._routes.get(key)
                if conn is None:
                    continue
                out = data
                if conn.role == "relay":
                    role, rank = key
                    body = memoryview(data)[LENGTH.size :]
                    head = fanin.SEGMENT.pack(fanin.KINDS[role or ""], rank, len(body))
                    out = LENGTH.pack(len(head) + len(body)) + head + body
                # a host relay's outbox serves each role and rank behind it
                limit = MAX_OUTBOX * max(1, len(conn.subs)) if conn.role == "relay" else MAX_OUTBOX
                if len(conn.outbox) + len(out) <= limit:
                    conn.outbox += out
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
        listener = self._listener
        if listener is None:  # closed in this round
            return
        # a few per round, so ranks are served between bursts
        for _ in range(_ACCEPT_PER_ROUND):
            try:
                sock, _ = listener.accept()
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
            conn = Connection(sock, time.monotonic() + HANDSHAKE_DEADLINE, self._tls)
            self._pending[conn] = None
            self._selector.register(sock, conn.mask, conn)
            with self._lock:  # with TLS, it goes once the client's TLS handshake is done
                conn.outbox += pack_frame({"nonce": conn.nonce})
            self._write(conn)

    def _out_of_files(self, exc: OSError) -> None:
        """``accept`` failed for want of a descriptor: the connection stays in the listener's
        backlog, which stays readable, so accepting again at once would spin.  The oldest
        connection still in its handshake gives its descriptor up for it (strangers that say
        nothing cannot hold the run's ranks out); with none, the channel stops accepting for
        ``ACCEPT_PAUSE``.  Said once per channel, in the log."""
        self.stats["accept_failed"] += 1
        if not self.stats["out_of_files"]:
            _log.warning(
                "run %s: this process is out of open files (%s): the event channel drops "
                "the oldest connection still in its handshake, or stops accepting for "
                "%g s at a time; raise the limit (ulimit -n) if ranks cannot connect",
                self._run_id,
                exc.strerror,
                ACCEPT_PAUSE,
            )
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
            closing, self._closing = self._closing, set()
        for conn in closing:
            self._drop(conn)
        for conn in dirty:
            if conn.open:
                self._write(conn)

    def _write(self, conn: Connection) -> None:
        with self._lock:
            out, sealed = conn.output()
            failed = not sealed
            if out and sealed:
                try:
                    sent = conn.sock.send(out)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError:
                    sent, failed = 0, True
                del out[:sent]
            mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.more_to_write(out) else 0)
        if failed:
            self._drop(conn)
        elif mask != conn.mask:
            conn.mask = mask
            self._selector.modify(conn.sock, mask, conn)

    def _read(self, conn: Connection) -> None:
        size = conn.read_size()
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

    def _ended(self, conn: Connection) -> None:
        """The peer closed its end (or broke the connection, or its TLS)."""
        if conn.role is None:
            self._reject(conn)
        else:
            self._drop(conn)

    def _parse(self, conn: Connection) -> None:
        if conn.role is None:
            self._handshake(conn)
        else:
            self._frames(conn)

    def _unseal(self, conn: Connection) -> None:
        """Take the plaintext of the ciphertext that arrived, all of it that is complete: the
        selector would not say that OpenSSL still holds some.  The TLS handshake comes first;
        before authentication no more plaintext than one hello is taken at a time."""
        tls = conn.tls
        assert tls is not None  # a TLS channel's connection
        while conn.open:
            room = LENGTH.size + MAX_HELLO - len(conn.inbuf) if conn.role is None else TLS_PLAINTEXT
            try:
                if not conn.secure:
                    tls.do_handshake()
                    conn.secure = True
                data = tls.read(room)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLError:  # a broken or refused TLS handshake, a bad record, the end
                data = b""
            if not data:
                return self._ended(conn)
            conn.inbuf += data
            self._parse(conn)
            if conn.secure and not conn.tls_in.pending and not tls.pending():
                break  # all taken: no read that would only raise SSLWantReadError
        # the TLS handshake's answer, the challenge, the hello's reply; nothing at all, most of the
        # time, once a rank streams its records (then not even a look under the lock)
        if conn.open and (not conn.secure or conn.outbox or conn.wire or conn.tls_out.pending):
            self._write(conn)

    def _reject(self, conn: Connection, reason: Optional[str] = None) -> None:
        """End a failed handshake, telling the client why when it deserves to know."""
        self.stats["rejected"] += 1
        data = pack_frame({"ok": False, "error": reason}) if reason is not None else b""
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

    def _handshake(self, conn: Connection) -> None:
        buf = conn.inbuf
        if len(buf) < LENGTH.size:
            return
        (length,) = LENGTH.unpack_from(buf)
        if length > MAX_HELLO:
            return self._reject(conn)
        if len(buf) < LENGTH.size + length:
            return
        hello = parse_object(bytes(buf[LENGTH.size : LENGTH.size + length]))
        del buf[: LENGTH.size + length]
        if hello is None:
            return self._reject(conn)
        reason = check_hello(
            hello, conn.nonce, run_id=self._run_id, ranks=self._ranks, role_secrets=self._secrets, files=self._files
        )
        if reason is None and self._only_ranks is not None and hello["rank"] not in self._only_ranks:
            reason = f"rank {hello['rank']} is not a rank of this host's relay"
        if reason is not None:
            return self._reject(conn, reason)
        if "fetch" in hello or "upload" in hello:
            conn.role, conn.rank = hello["role"], hello["rank"]
            if not self._files.admit(conn.role, conn.rank):
                return self._too_many_transfers(conn)
            del self._pending[conn]
            return self._hand_off(conn, hello)
        claim: Tuple[str, int] = (hello["role"], hello["rank"])
        if claim in self._claims:
            return self._second_claim(conn, *claim)
        if claim[0] == "relay":
            taken = sorted(r for r in hello["ranks"] if r in self._relay_of)
            if taken:
                self.stats["claims_refused"] += 1
                return self._reject(conn, f"rank {taken[0]} already has a host relay in this run")
            conn.relayed = frozenset(hello["ranks"])
            for r in conn.relayed:
                self._relay_of[r] = conn
        del self._pending[conn]
        self._authed.add(conn)
        conn.role, conn.rank = claim
        self._claims[claim] = conn
        self.stats["authenticated"] += 1
        self._delivery.peer(conn, True)
        with self._lock:
            self._routes[claim] = conn
            proof = hello_mac(self._key(conn.role, conn.rank), hello["nonce"]).decode()
            conn.outbox += pack_frame({"ok": True, "mac": proof})
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

    def _start_records(self, conn: Connection, hello: dict) -> None:
        conn.start_records(framemac.session_key(self._key(hello["role"], hello["rank"]), conn.nonce, hello["nonce"]))

    def _forged(self, conn: Connection, exc: Exception) -> None:
        """A record that failed its authentication: someone on the path wrote into the
        connection.  It ends; the rank's log says so."""
        self.stats["forged"] += 1
        line = (
            f"torchdist: the event channel of rank {conn.rank}'s {conn.role} carried a record that failed its "
            f"authentication ({exc}); someone on the network may have written into it. The connection "
            "was closed, and nothing of that record was used"
        )
        _log.warning("run %s: %s", self._run_id, line)
        rank = conn.rank
        self._drop(conn)
        self._delivery.tell(rank, line)

    def _key(self, role: str, rank: int) -> str:
        return rank_key(self._secrets[role], role, rank)

    def _second_claim(self, conn: Connection, role: str, rank: int) -> None:
        """Refuse an authenticated connection as a role and rank that another connection owns,
        and say so in that rank's log, where the run's view shows it."""
        self.stats["claims_refused"] += 1
        try:
            host, port = conn.sock.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            peer = "a peer that has gone"
        line = (
            f"torchdist: refused a second connection as rank {rank}'s {role} (from {peer}): "
            f"another one already speaks for it; only the first is heard"
        )
        _log.warning("run %s: %s", self._run_id, line)
        self._reject(conn, f"rank {rank}'s {role} is already connected to this run")
        self._delivery.tell(rank, line)

    def _too_many_transfers(self, conn: Connection) -> None:
        """Refuse an authenticated fetch or upload of a rank whose launcher has
        ``TRANSFERS_PER_RANK`` open already: said once in the log, counted with the run's
        refusals (``transfers_refused``)."""
        self._delivery.refuse(
            "transfers_refused",
            conn,
            f"a file transfer beyond the {TRANSFERS_PER_RANK} that one rank may have open at once",
        )
        self._reject(
            conn,
            f"rank {conn.rank}'s {conn.role} has {TRANSFERS_PER_RANK} file transfers open already, "
            "the most one rank may have",
        )

    def _hand_off(self, conn: Connection, hello: dict) -> None:
        """An authenticated fetch or upload: its reply sent (what the socket takes now; its
        client then waits for its turn, not for the reply), it leaves this thread for one of the
        file transfers'."""
        self.stats["authenticated"] += 1
        proof = hello_mac(self._key(hello["role"], hello["rank"]), hello["nonce"]).decode()
        conn.outbox += pack_frame({"ok": True, "mac": proof})
        if conn.tls is None:  # the file's bytes and the answers in records, after the reply
            self._start_records(conn, hello)
            conn.inbuf.clear()  # nothing comes before the reply but what a stranger wrote
        conn.open = False  # the server's loops let go of it
        self._selector.unregister(conn.sock)
        with self._lock:
            out, sealed = conn.output()
            if out and sealed:
                try:
                    del out[: conn.sock.send(out)]
                except OSError:  # not now (the transfer's thread sends the rest), or the peer went
                    pass
        if "fetch" in hello:
            self._files.start(conn, hello["fetch"])
        else:
            self._files.start_upload(conn, hello["rank"], hello["size"])

    def _frames(self, conn: Connection) -> None:
        if conn.role == "relay":
            return self._bundles(conn)
        if not self._delivery.frames(conn):
            self._drop(conn)

    # -- a host relay's connection (``fanin``) ----------------------------------------------

    def _bundles(self, conn: Connection) -> None:
        """Deliver the segments of a host relay's whole frames, each as its rank's role would
        have sent it; a frame that cannot be split ends the relay's connection."""
        bodies, whole = take_frames(conn.inbuf, fanin.MAX_BUNDLE)
        deliver = self._delivery.deliver
        try:
            for body in bodies:
                conn.heard = True
                for kind, rank, payload in fanin.segments(body):
                    if kind == fanin.WORKER or kind == fanin.LAUNCHER:
                        sub = conn.subs.get((fanin.ROLES[kind], rank))
                        if sub is None:
                            self._delivery.refuse(
                                "forbidden",
                                conn,
                                f"records of rank {rank}'s {fanin.ROLES[kind]}, which this relay has not connected",
                            )
                        else:
                            deliver(sub, payload)
                    elif kind == fanin.JOINED:
                        self._sub_joined(conn, rank, fanin.role_of(payload))
                    elif kind == fanin.LEFT:
                        role = fanin.role_of(payload)
                        if role is not None:
                            self._sub_left(conn, role, rank)
                    elif kind == fanin.NOTE and rank in conn.relayed:
                        self._delivery.tell(rank, payload.decode("utf-8", "replace")[:2000])
        except fanin.MalformedBundle as exc:
            whole = False
            self._delivery.refuse("malformed", conn, f"a relay's frame that cannot be split ({exc})")
        if not whole:
            self._drop(conn)

    def _sub_joined(self, conn: Connection, rank: int, role: Optional[str]) -> None:
        """A role and rank that authenticated with the relay: it speaks for them from now on,
        unless another relay speaks for that rank, or another connection for that role."""
        if role is None or (self._ranks is not None and rank >= self._ranks):
            self._delivery.refuse("forbidden", conn, f"a connection of no role or rank of this run ({rank})")
            return
        if self._relay_of.get(rank, conn) is not conn:
            self._delivery.refuse("forbidden", conn, f"a connection of rank {rank}, which another relay speaks for")
            return
        if (role, rank) in conn.subs:  # said twice: the first stands
            return
        if rank not in conn.relayed:  # not named in its hello: a launcher's relay learns its ranks as they come
            conn.relayed = conn.relayed | {rank}
            self._relay_of[rank] = conn
        key = (role, rank)
        owner = self._claims.get(key)
        if owner is not None and owner is not conn:
            self.stats["claims_refused"] += 1
            line = (
                f"torchdist: refused rank {rank}'s {role} through its host's relay: another "
                "connection already speaks for it; only the first is heard"
            )
            _log.warning("run %s: %s", self._run_id, line)
            self._delivery.tell(rank, line)
            with self._lock:
                conn.outbox += fanin.bundle([fanin.segment(fanin.DROP, rank, bytes([fanin.KINDS[role]]))])
                self._dirty.add(conn)
            return
        conn.subs[key] = fanin.SubStream(role, rank)
        self._claims[key] = conn
        self.stats["authenticated"] += 1
        with self._lock:
            self._routes[key] = conn

    def _sub_left(self, conn: Connection, role: str, rank: int) -> None:
        key = (role, rank)
        sub = conn.subs.pop(key, None)
        if sub is None:
            return
        if not sub.heard and self._claims.get(key) is conn:
            del self._claims[key]
        with self._lock:
            if self._routes.get(key) is conn:
                del self._routes[key]

    def _drop(self, conn: Connection) -> None:
        if not conn.open:
            return
        conn.open = False
        self._pending.pop(conn, None)
        if conn in self._authed:
            self._authed.discard(conn)
            self._delivery.peer(conn, False)
        for role, rank in list(conn.subs):
            self._sub_left(conn, role, rank)
        for rank in conn.relayed:
            if self._relay_of.get(rank) is conn:
                del self._relay_of[rank]
        if not conn.heard and self._claims.get((conn.role, conn.rank)) is conn:
            del self._claims[(conn.role, conn.rank)]
        with self._lock:
            if self._routes.get((conn.role, conn.rank)) is conn:
                del self._routes[(conn.role, conn.rank)]
            self._dirty.discard(conn)
        self._selector.unregister(conn.sock)
        conn.sock.close()
