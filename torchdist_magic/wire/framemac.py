"""Every byte after the handshake of an unencrypted channel connection, authenticated.

Without TLS (``--no-tls``, or a local run on loopback), the handshake proves who opened a
connection, but whoever is on the path between the two ends could write into it afterwards: a
``JobValue`` the driver unpickles, a ``RunJob`` or a debugger line a rank runs, a rank's value
the driver maps.  So both ends turn what they send into records of at most ``MAX_RECORD`` bytes,
each ``length (4 bytes, big-endian) | payload | HMAC-SHA256(key, direction | sequence | length |
payload)`` under a key of the connection's own (``session_key``: from the rank's key and both
handshake nonces), with a sequence number per direction (no record can be dropped, replayed,
reordered or sent back to its sender).  The receiver takes a payload only once its tag is right;
one wrong tag ends the connection (``ForgedRecord``).  The records carry a stream: the channel's
frames, a file's bytes, cut wherever the sender's writes were.

``Sealer`` and ``Opener`` are the two directions, for the driver's non-blocking server;
``MacSocket`` is a client's blocking socket with both, with what the channel's clients use of a
socket (as ``tls.TlsSocket``).
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import threading
from typing import Optional

#: the most payload one record holds; a longer one is refused before it is read whole
MAX_RECORD = 1 << 20
#: the bytes of a record's tag
TAG = 32
_LEN = struct.Struct(">I")
_SEQ = struct.Struct(">Q")
#: what a client's records and the driver's are told apart by
FROM_CLIENT, FROM_DRIVER = b"C", b"D"
_RECV_CHUNK = 256 * 1024


class ForgedRecord(ConnectionError):
    """A record whose tag is wrong, or longer than any sender makes: someone else wrote it."""


def session_key(key: str, server_nonce: str, client_nonce: str) -> bytes:
    """The key of one connection's records: from the key its client authenticated with and the
    nonces of both ends' challenges."""
    return hmac.new(
        key.encode(),
        f"torchdist records {server_nonce} {client_nonce}".encode("utf-8", "surrogatepass"),
        hashlib.sha256,
    ).digest()


def _tag(key: bytes, direction: bytes, sequence: int, head: bytes, payload) -> bytes:
    mac = hmac.new(key, direction + _SEQ.pack(sequence) + head, hashlib.sha256)
    mac.update(payload)
    return mac.digest()


class Sealer:
    """One direction of a connection: what is sent, as authenticated records."""

    def __init__(self, key: bytes, direction: bytes):
        self._key = key
        self._direction = direction
        self._sequence = 0

    def seal(self, data) -> bytes:
        """``data`` as records (``b""`` for nothing)."""
        view = memoryview(data)
        out = bytearray()
        for start in range(0, len(view), MAX_RECORD):
            payload = view[start : start + MAX_RECORD]
            head = _LEN.pack(len(payload))
            out += head
            out += payload
            out += _tag(self._key, self._direction, self._sequence, head, payload)
            self._sequence += 1
        return bytes(out)


class Opener:
    """The other direction: records in, their payloads out once each tag is checked."""

    def __init__(self, key: bytes, direction: bytes):
        self._key = key
        self._direction = direction
        self._sequence = 0
        self._buffer = bytearray()

    def open(self, data) -> bytes:
        """The payloads of the records ``data`` completes (with what came before it); ``b""``
        while a record is incomplete.  ``ForgedRecord`` for a wrong tag or a record too long."""
        self._buffer += data
        buffer, offset, out = self._buffer, 0, bytearray()
        while len(buffer) - offset >= _LEN.size:
            (length,) = _LEN.unpack_from(buffer, offset)
            if length > MAX_RECORD:
                raise ForgedRecord(f"a record of {length} bytes, over the {MAX_RECORD} bytes any sender makes")
            end = offset + _LEN.size + length + TAG
            if len(buffer) < end:
                break
            head = bytes(buffer[offset : offset + _LEN.size])
            payload = memoryview(buffer)[offset + _LEN.size : end - TAG]
            try:
                expected = _tag(self._key, self._direction, self._sequence, head, payload)
                if not hmac.compare_digest(expected, bytes(buffer[end - TAG : end])):
                    raise ForgedRecord(f"record {self._sequence} failed its authentication")
                out += payload
            finally:
                payload.release()
            self._sequence += 1
            offset = end
        del buffer[:offset]
        return bytes(out)


class MacSocket:
    """A client's connection to the driver with authenticated records both ways, over its
    blocking socket.  A channel client's sender and reader threads share it: one sends, the
    other reads, each with a direction of its own; a lock keeps whole records together."""

    def __init__(self, sock: socket.socket, key: bytes):
        self._sock = sock
        self._sealer = Sealer(key, FROM_CLIENT)
        self._opener = Opener(key, FROM_DRIVER)
        self._plain = bytearray()  # payload taken, not yet read
        self._send_lock = threading.Lock()

    def sendall(self, data) -> None:
        with self._send_lock:
            self._sock.sendall(self._sealer.seal(data))

    def recv(self, n: int) -> bytes:
        if not self._fill():
            return b""
        out = bytes(self._plain[:n])
        del self._plain[:n]
        return out

    def recv_into(self, buffer: memoryview) -> int:
        if not self._fill():
            return 0
        n = min(len(buffer), len(self._plain))
        buffer[:n] = self._plain[:n]
        del self._plain[:n]
        return n

    def _fill(self) -> bool:
        """Payload to read; False at the end of the connection.  ``ForgedRecord`` as ``Opener``."""
        while not self._plain:
            data = self._sock.recv(_RECV_CHUNK)
            if not data:
                return False
            self._plain += self._opener.open(data)
        return True

    def settimeout(self, timeout: Optional[float]) -> None:
        self._sock.settimeout(timeout)

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()
