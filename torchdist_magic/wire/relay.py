"""A host relay (``HostRelay``): the ranks of one host reach the driver over one connection.

Without it every rank has two connections to the driver (its worker's, its launcher's): 2,048
for 1024 ranks, each read, checked and answered on the driver's one thread.  A host relay
listens on the host's loopback for that host's ranks, which connect to it exactly as they would
to the driver (their own keys, checked here: the relay's local server is a ``ChannelServer``
that knows the run's secrets and takes only its host's ranks), and passes what each sends on to
the driver over one connection, unread, several ranks' frames to a write (``fanin``: the
format, and what the driver checks).  What the driver sends a rank comes back the same way.

Trust.  A relay holds what a rank's launcher holds (the run's secrets), and authenticates to
the driver as role ``relay`` of the first of its ranks with a key of the launchers' secret; the
driver takes from it only records of the ranks its hello named, which no other relay may name,
each checked as that rank's worker or launcher would be.  The local connections are plain TCP
on loopback, their records authenticated (``framemac``) as they are on the driver's port
without TLS; the connection to the driver is TLS where the run's channel is.

Loss.  Where the driver cannot be reached, or the connection to it ends, the relay says so
once on stderr and closes its ranks' connections, which then behave as a lost channel does
(their launchers report through the backend).  A relay reads no more from its ranks while
``MAX_QUEUED`` bytes wait for the driver: a rank's client then queues, and drops and counts,
as it does when the driver itself is slow.

Standard library only (no msgspec): a relay runs where the ranks run.
"""

from __future__ import annotations

import socket
import sys
import threading
from typing import Dict, List, Optional, Sequence, Union

from ..core import events
from ..core.rankenv import rank_key
from ..core.timing import CLIENT_CLOSE_WAIT
from . import fanin, framemac, tls
from .connection import Connection
from .frames import MAX_FRAME, FrameError, NotTheDriver, Refused, read_body, take_frames
from .handshake import open_connection
from .server import ChannelServer
from .tls import TlsSocket

#: how long the relay gathers its ranks' frames before it sends them on together: each rank's
#: client already gathers for ``batching.FLUSH_EVERY``; this adds at most this much to a record's
#: way, and merges what the host's ranks send in that time into one write
RELAY_WINDOW = 0.05
#: bytes waiting for the driver before the relay stops reading from its ranks
MAX_QUEUED = 64 * 1024 * 1024


def _never(record: events.Event) -> None:  # the local server hands no record on: ``_Forward`` reads none
    raise AssertionError("a host relay decodes no record")


class _Forward:
    """The relay's local server's delivery (``ChannelServer``'s ``delivery``): every frame an
    authenticated rank sends goes on to the driver as a segment, unread."""

    def __init__(self, relay: "HostRelay"):
        self._relay = relay
        self.stats: Dict[str, int] = {}  # the local server's, once it is made

    def frames(self, conn: Connection) -> bool:
        bodies, whole = take_frames(conn.inbuf, MAX_FRAME)
        if bodies:
            conn.heard = True
            self.stats["frames"] = self.stats.get("frames", 0) + len(bodies)
            kind = fanin.KINDS[conn.role or ""]
            self._relay.queue([fanin.segment(kind, conn.rank, body) for body in bodies])
        if not whole:
            self.refuse("malformed", conn, f"a frame over the channel's {MAX_FRAME} bytes; the connection was closed")
        return whole

    def peer(self, conn: Connection, joined: bool) -> None:
        kind = fanin.JOINED if joined else fanin.LEFT
        self._relay.queue([fanin.segment(kind, conn.rank, bytes([fanin.KINDS[conn.role or ""]]))])

    def tell(self, rank: int, line: str) -> None:
        self._relay.queue([fanin.segment(fanin.NOTE, rank, line.encode("utf-8", "replace"))])

    def refuse(self, kind: str, conn: Connection, detail: str) -> None:
        self.stats[kind] = self.stats.get(kind, 0) + 1
        self.tell(conn.rank, f"torchdist: the host relay refused {detail} from rank {conn.rank}'s {conn.role}")


class HostRelay:
    """One host's relay: ``address`` (``127.0.0.1:port``) is where the host's ``ranks`` connect
    in place of the driver's ``driver_address`` (without TLS: their client's certificate is
    ``""``), with the run's ``secret`` and ``launcher_secret`` keys as usual; ``certificate``:
    the run's, when its channel is TLS; ``world_size``: the run's number of ranks; ``others``:
    it takes any rank of the run that connects, not only ``ranks`` (a launcher's relay,
    ``launch.hostrelay``, knows only its own rank: the machine's others come as they start).
    ``close`` when the host's ranks are done."""

    def __init__(
        self,
        driver_address: str,
        secret: str,
        launcher_secret: str,
        run_id: str,
        ranks: Sequence[int],
        *,
        world_size: Optional[int] = None,
        certificate: str = "",
        window: float = RELAY_WINDOW,
        others: bool = False,
    ):
        self.ranks = sorted(set(ranks))
        if not self.ranks:
            raise ValueError("a host relay speaks for at least one rank")
        host, _, port = driver_address.rpartition(":")
        self._driver = (host.strip("[]"), int(port))
        self._key = rank_key(launcher_secret, "relay", self.ranks[0])
        self._run_id = run_id
        self._tls = tls.client_context(certificate) if certificate else None
        self._window = window
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._segments: List[bytes] = []
        self._queued = 0  # bytes in _segments
        self._closed = False
        self._lost = False
        self._sock: Optional[Union[framemac.MacSocket, TlsSocket]] = None
        self._reader: Optional[threading.Thread] = None
        self._closer: Optional[threading.Thread] = None  # closes the local server once the driver is lost
        forward = _Forward(self)
        self._local = ChannelServer(
            _never,
            run_id,
            host="127.0.0.1",
            secret=secret,
            launcher_secret=launcher_secret,
            ranks=world_size,
            relays=False,
            only_ranks=None if others else frozenset(self.ranks),
            delivery=forward,
        )
        forward.stats = self._local.stats
        #: where the host's ranks connect (``host:port``)
        self.address = f"127.0.0.1:{self._local.port}"
        self._sender = threading.Thread(target=self._run, name=f"torchdist-relay-{self.ranks[0]}", daemon=True)
        self._sender.start()

    @property
    def lost(self) -> bool:
        """True once the driver could not be reached, refused the relay, or its connection ended
        before ``close``."""
        return self._lost

    @property
    def stats(self) -> Dict[str, int]:
        """The local server's counts (``ChannelServer.stats``), with ``frames`` passed on."""
        return self._local.stats

    def queue(self, segments: List[bytes]) -> None:
        """Queue ``segments`` for the driver, in order; waits (the local server's thread: it
        stops reading from the ranks) while ``MAX_QUEUED`` bytes wait."""
        size = sum(map(len, segments))
        with self._changed:
            while self._queued > MAX_QUEUED and not self._lost and not self._closed:
                self._changed.wait(0.5)
            if self._lost:
                return
            self._segments += segments
            self._queued += size
            self._changed.notify_all()

    def close(self, timeout: float = CLIENT_CLOSE_WAIT) -> None:
        """Close the local server (its ranks have until ``CHANNEL_CLOSE_WAIT`` to finish), send
        what is queued, and close the connection to the driver once it has handled all of it.
        Idempotent."""
        self._local.close()  # its last segments (the ranks' ends) are queued when it returns
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._sender.join(timeout)
        for thread in (self._reader, self._closer):
            if thread is not None and thread.ident is not None:  # a closer made, maybe not started yet
                thread.join(timeout)
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    # -- sender thread ----------------------------------------------------------------------

    def _run(self) -> None:
        sock = self._connect()
        if sock is None:
            return self._local.close()
        with self._lock:
            self._sock = sock
        self._reader = threading.Thread(target=self._read, args=(sock,), name=f"{self._sender.name}-in", daemon=True)
        self._reader.start()
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._segments or self._closed or self._lost)
                if self._lost:
                    return
                if not self._closed:  # what the host's ranks send meanwhile goes in the same write
                    self._changed.wait_for(lambda: self._closed or self._lost, self._window)
                segments, self._segments, self._queued = self._segments, [], 0
                done = self._closed
                self._changed.notify_all()
            if segments:
                try:
                    sock.sendall(fanin.bundle(segments))
                except OSError as exc:
                    return self._give_up(f"the host relay's connection to the driver was lost ({exc})")
            if done:
                break
        try:
            sock.shutdown(socket.SHUT_WR)  # the driver closes its side once it has handled it all
        except OSError:
            pass

    def _connect(self) -> Optional[Union[framemac.MacSocket, TlsSocket]]:
        where = f"{self._driver[0]}:{self._driver[1]}"
        try:
            return open_connection(
                self._driver, self._key, self._run_id, self.ranks[0], "relay", self._tls, ranks=self.ranks
            )
        except Refused as exc:
            self._give_up(f"the driver at {where} refused the host relay of ranks {self._named()}: {exc}")
        except NotTheDriver as exc:
            self._give_up(f"the server at {where} is not this run's driver: {exc}")
        except (OSError, EOFError, FrameError) as exc:
            self._give_up(f"cannot reach the driver's event channel at {where} ({exc})")
        return None

    def _named(self) -> str:
        return ", ".join(map(str, self.ranks[:8])) + (", ..." if len(self.ranks) > 8 else "")

    def _give_up(self, message: str) -> None:
        """Say once why the relay cannot reach the driver; its ranks' connections end."""
        with self._changed:
            if self._lost or self._closed:
                return
            self._lost = True
            self._segments, self._queued = [], 0
            self._changed.notify_all()
            closer = self._closer = threading.Thread(
                target=self._local.close, name="torchdist-relay-close", daemon=True
            )
        print(
            f"torchdist_magic: {message}; the events of ranks {self._named()} are dropped",
            file=sys.__stderr__,
            flush=True,
        )
        closer.start()

    # -- reader thread ----------------------------------------------------------------------

    def _read(self, sock: Union[framemac.MacSocket, TlsSocket]) -> None:
        """What the driver sends the host's ranks, on to each; the end of the connection."""
        local = self._local
        while True:
            try:
                body = read_body(sock, fanin.MAX_BUNDLE)
                for kind, rank, payload in fanin.segments(body):
                    role = fanin.ROLES.get(kind)
                    if role is not None:
                        local.send_frame(role, rank, payload)
                    elif kind == fanin.DROP:
                        dropped = fanin.role_of(payload)
                        if dropped is not None:
                            local.close_peer(dropped, rank)
            except framemac.ForgedRecord as exc:
                return self._give_up(f"a record from the driver to the host relay failed its authentication ({exc})")
            except (OSError, EOFError, FrameError, fanin.MalformedBundle) as exc:
                with self._lock:
                    closing = self._closed
                if not closing:
                    self._give_up(f"the host relay's connection to the driver ended ({exc or 'closed'})")
                return
