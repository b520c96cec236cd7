"""The channel's frames and the proofs of its handshake, as both ends write and read them.

Wire format.  Every frame is a 4-byte big-endian length and a UTF-8 JSON object; nothing read
from a socket is ever unpickled.  A connection starts with a challenge: the server sends
``{"nonce": ...}``; the client answers ``{"mac": ..., "nonce": ..., "run_id", "rank", "role",
"protocol"}`` (and a file transfer's ``"fetch"``, or ``"upload"`` and ``"size"``), whose MAC is
HMAC-SHA256(secret, the nonce and every other field of the hello: ``hello_proof``), so that
without TLS nothing on the path can change what a hello asks for; ``secret`` is the key of that
role and rank
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
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import struct
from typing import List, Optional, Protocol, Tuple

from ..core import events

#: largest frame after authentication (a batch of records)
MAX_FRAME = 4 * 1024 * 1024
#: largest frame before authentication (the challenge, the hello, the reply)
MAX_HELLO = 4 * 1024
#: the length before each frame's JSON
LENGTH = struct.Struct(">I")
#: what a blocking read takes from a socket at once
RECV_CHUNK = 256 * 1024


class FrameError(Exception):
    """A peer sent something that is not a well-formed frame."""


class Refused(Exception):
    """The other end refused the handshake, with a reason worth telling the user."""


class NotTheDriver(Exception):
    """The other end could not prove, with the run's TLS certificate, that it is the driver."""


def new_secret() -> str:
    return secrets.token_hex(32)


def hello_mac(secret: str, nonce: str) -> bytes:
    digest = hmac.new(secret.encode(), nonce.encode("utf-8", "surrogatepass"), hashlib.sha256)
    return digest.hexdigest().encode()


def hello_proof(secret: str, challenge: str, hello: dict) -> Optional[str]:
    """The MAC a hello answering ``challenge`` carries (its ``"mac"``): over the challenge and
    every other field of ``hello``, as JSON with sorted keys, which both ends write alike from
    the same parsed values; ``None`` for a hello that cannot be written so (a stranger's)."""
    try:
        fields = json.dumps({k: v for k, v in hello.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    except (ValueError, TypeError, RecursionError):
        return None
    return hello_mac(secret, f"{challenge}\n{fields}").decode()


def macs_equal(given: object, expected: bytes) -> bool:
    # compared as bytes: compare_digest refuses a str with non-ASCII characters (TypeError),
    # and whatever a stranger sends must be just a wrong MAC
    return isinstance(given, str) and hmac.compare_digest(given.encode("utf-8", "replace"), expected)


def pack_frame(obj: dict) -> bytes:
    data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return LENGTH.pack(len(data)) + data


def parse_object(body: bytes) -> Optional[dict]:
    """The JSON object ``body`` holds, or ``None`` for anything else."""
    try:
        obj = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return obj if isinstance(obj, dict) else None


def decode_record(item: object) -> Optional[events.Event]:
    try:
        return events.decode(item)
    except Exception:  # noqa: BLE001  decode means to raise only MalformedEvent, but a peer's
        # record must not be able to stop a reader with anything else it provokes (a huge
        # integer where a float belongs raises OverflowError)
        return None


class Receiver(Protocol):
    """What ``read_frame`` reads from: a blocking socket, or one that decrypts or checks what
    it reads (``tls.TlsSocket``, ``framemac.MacSocket``)."""

    def recv(self, n: int) -> bytes: ...


def _read_exact(sock: Receiver, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, RECV_CHUNK))
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_body(sock: Receiver, limit: int) -> bytes:
    """The next frame's body on a blocking ``sock``, as bytes; ``FrameError`` for one over
    ``limit`` bytes, ``EOFError`` when the connection ends first."""
    (length,) = LENGTH.unpack(_read_exact(sock, LENGTH.size))
    if length > limit:
        raise FrameError(f"frame of {length} bytes is over the {limit} byte limit")
    return _read_exact(sock, length)


def take_frames(buf: bytearray, limit: int) -> Tuple[List[bytes], bool]:
    """The bodies of the whole frames at the start of ``buf`` (taken out of it), and ``False``
    when a frame's length is over ``limit`` (the stream can no longer be split into frames)."""
    bodies: List[bytes] = []
    offset, size = 0, len(buf)
    while size - offset >= LENGTH.size:
        (length,) = LENGTH.unpack_from(buf, offset)
        if length > limit:
            del buf[:offset]
            return bodies, False
        end = offset + LENGTH.size + length
        if size < end:
            break
        bodies.append(bytes(buf[offset + LENGTH.size : end]))
        offset = end
    del buf[:offset]
    return bodies, True


def read_frame(sock: Receiver, limit: int) -> dict:
    """The next frame on a blocking ``sock`` (a handshake's, a file transfer's head): its JSON
    object; ``FrameError`` for one over ``limit`` bytes or not a JSON object, ``EOFError`` when
    the connection ends first."""
    (length,) = LENGTH.unpack(_read_exact(sock, LENGTH.size))
    if length > limit:
        raise FrameError(f"frame of {length} bytes is over the {limit} byte limit")
    obj = parse_object(_read_exact(sock, length))
    if obj is None:
        raise FrameError("frame is not a UTF-8 JSON object")
    return obj
