"""One connection the driver's channel accepted: its buffers, its TLS done in memory or its
authenticated records, and what it sends next.

TLS.  Given a ``tls.ChannelIdentity`` (the server) and its certificate (every client), the whole
channel runs inside TLS 1.3: the TLS handshake first, then the challenge, the hello and the
frames, encrypted.  TLS gives privacy and tells a rank it reached the driver (the client trusts
the run's certificate and nothing else: ``tls.client_context``); the secrets still say who may
speak.  TLS is done in memory (``ssl.MemoryBIO`` and ``SSLContext.wrap_bio``), on
both sides.  The server keeps its raw, non-blocking sockets in the selector, so readiness means
what it says: with an ``SSLSocket`` a record already decrypted and buffered inside OpenSSL
(``pending()``) would not wake the selector, and a read could need a write (and the reverse).
The server reads only ciphertext, and decides how much (``read_size``): before authentication at
most one TLS record per read (OpenSSL holds at most one handshake message, and a ClientHello is at
most 128 KiB), and it takes plaintext only up to the one hello it may buffer; the TLS handshake
happens while the connection waits in the pending table, so it counts against
``HANDSHAKE_DEADLINE`` and ``MAX_PENDING`` like any stranger's bytes, on the same one thread.
Plaintext queued for a rank is encrypted a chunk at a time, as its socket takes it, so the
ciphertext waiting for a slow rank stays small and ``MAX_OUTBOX`` still bounds the rest.  (A
client's end of TLS is ``tls.TlsSocket``.)

Without TLS.  The handshake goes as above; everything after its reply, both ways, travels in
authenticated records (``framemac``: an HMAC per record under a key of the connection's, from
the rank's key and both nonces, with a sequence number per direction), frames and file bytes
alike.  A record whose tag is wrong ends its connection and nothing of it is used: whoever is on
the network may read a run's records, but cannot change one or add one of theirs (a ``JobValue``
the driver would unpickle, a ``RunJob`` or a debugger line a rank would run).  ``ChannelServer.stats``'s
``forged`` counts them; the rank's log, or the rank's stderr, says so.
"""

from __future__ import annotations

import secrets
import selectors
import socket
import ssl
from typing import Any, Dict, FrozenSet, Optional, Tuple

from . import framemac
from .frames import LENGTH, MAX_HELLO, RECV_CHUNK

#: what the server reads from an authenticated connection at once: a read allocates its whole
#: size first, and 256 KiB costs over ten times what 64 KiB does
READ_CHUNK = 64 * 1024
#: the most plaintext one TLS record holds: what the server takes out of TLS at once
TLS_PLAINTEXT = 2**14
#: the largest TLS 1.3 record on the wire (header, 16 KiB of data, padding and tag): what the
#: server reads at once from a connection that has not authenticated
TLS_RECORD = 5 + 2**14 + 256


class Connection:
    """One accepted connection, as the server thread sees it."""

    __slots__ = (
        "sock",
        "deadline",
        "nonce",
        "inbuf",
        "outbox",
        "mask",
        "role",
        "rank",
        "open",
        "tls",
        "tls_in",
        "tls_out",
        "wire",
        "secure",
        "heard",
        "sealer",
        "opener",
        "relayed",
        "subs",
    )

    def __init__(self, sock: socket.socket, deadline: float, context: Optional[ssl.SSLContext]):
        self.sock = sock
        self.deadline = deadline
        self.nonce = secrets.token_hex(16)
        self.inbuf = bytearray()  # plaintext read, not parsed yet
        self.outbox = bytearray()  # plaintext to send; guarded by the server's lock
        self.mask = selectors.EVENT_READ
        self.role: Optional[str] = None  # set once authenticated
        self.rank = -1
        self.open = True
        self.heard = False  # a frame came after the handshake
        # with TLS: ciphertext arrives in tls_in, leaves from tls_out into wire (what the socket
        # has not taken yet); secure once the TLS handshake is done
        self.tls: Optional[ssl.SSLObject] = None
        self.wire = bytearray()
        self.secure = False
        # without TLS, once authenticated: what it sends and receives as authenticated records
        self.sealer: Optional[framemac.Sealer] = None
        self.opener: Optional[framemac.Opener] = None
        # a host relay's (``fanin``): the ranks its hello named, and each role and rank it connected
        self.relayed: FrozenSet[int] = frozenset()
        self.subs: Dict[Tuple[str, int], Any] = {}
        if context is not None:
            self.tls_in, self.tls_out = ssl.MemoryBIO(), ssl.MemoryBIO()
            self.tls = context.wrap_bio(self.tls_in, self.tls_out, server_side=True)

    def read_size(self) -> int:
        """How many bytes the server reads from the socket at once: before authentication never
        more than one hello (or one TLS record) can hold."""
        if self.tls is not None:
            return TLS_RECORD if self.role is None else READ_CHUNK
        return LENGTH.size + MAX_HELLO - len(self.inbuf) if self.role is None else READ_CHUNK

    def start_records(self, key: bytes) -> None:
        """From here on, this connection (not TLS) speaks in authenticated records (``framemac``)
        under ``key``; what is queued (the handshake's reply) goes as it is, before them."""
        self.wire += self.outbox
        self.outbox.clear()
        self.sealer = framemac.Sealer(key, framemac.FROM_DRIVER)
        self.opener = framemac.Opener(key, framemac.FROM_CLIENT)

    def output(self) -> Tuple[bytearray, bool]:
        """The bytes to write to the socket next (what is queued, sealed or encrypted a chunk at a
        time), and whether they could be made (``False``: TLS failed).  Under the server's lock."""
        if self.tls is not None:
            try:
                self._encrypt()
            except ssl.SSLError:
                return self.wire, False
            return self.wire, True
        if self.sealer is not None:
            while self.outbox and len(self.wire) < RECV_CHUNK:  # a chunk at a time, as with TLS
                chunk = self.outbox[:RECV_CHUNK]
                self.wire += self.sealer.seal(chunk)
                del self.outbox[: len(chunk)]
            return self.wire, True
        return self.outbox, True

    def more_to_write(self, out: bytearray) -> bool:
        """Whether anything waits for the socket after ``out`` (what ``output`` gave) was written
        as far as it took; with TLS, plaintext waits for the handshake before it is anything to
        write."""
        return bool(out) or ((self.secure or self.sealer is not None) and bool(self.outbox))

    def _encrypt(self) -> None:
        """Encrypt queued plaintext into ``wire`` while the socket has taken what came before it
        (a chunk at a time: a rank that reads slowly holds little ciphertext), once the TLS
        handshake is done; and take what TLS itself has to send (its handshake, alerts)."""
        tls = self.tls
        assert tls is not None  # called for a TLS connection only
        while self.secure and self.outbox and len(self.wire) < RECV_CHUNK:
            written = tls.write(self.outbox[:RECV_CHUNK])
            del self.outbox[:written]
        self.wire += self.tls_out.read()
