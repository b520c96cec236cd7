"""What a host relay and the driver say to each other (``relay``): the ranks of one host fanned
in over one connection.

A host relay authenticates as role ``relay`` of the first of its host's ranks, with the key
``rankenv.rank_key(launcher_secret, "relay", rank)``, and its hello names the ranks it speaks
for from the start (``"ranks"``, ``handshake.relay_ranks_problem``); no two relays speak for the
same rank.  The ranks of its host connect to the relay, on the host's loopback, as they would to
the driver (the same handshake, their own keys; the relay checks them), and the relay passes
what they send on, unread.  A relay holds what a launcher holds (the run's secrets): the driver
trusts it as far as it trusts a launcher, and no further than the ranks it speaks for.

After the handshake every frame on a relay's connection is a bundle of segments, each a kind,
a rank and a payload (``SEGMENT``, then the payload's bytes):

- ``WORKER``, ``LAUNCHER``: the body of one frame that rank's worker or launcher sent the relay
  (``{"events": [...]}``), which the driver decodes and checks as if that connection were its
  own: the sender's role decides what it may send, and the record's rank is the segment's;
  from the driver, a frame for that connection;
- ``JOINED``, ``LEFT`` (no payload): that rank's connection of role ``payload`` (``WORKER`` or
  ``LAUNCHER``, one byte) authenticated with the relay, or ended.  The driver takes records of a
  rank's role only between the two.  A rank the hello did not name becomes the relay's at its
  first ``JOINED`` (a launcher's relay learns its machine's ranks as they connect,
  ``launch.hostrelay``) unless another relay speaks for it; a role and rank connected to the
  driver some other way stays with it (the first to connect owns it, as on the driver's own
  port), and the driver answers with ``DROP``;
- ``NOTE`` (a line of UTF-8): something the relay has to say in that rank's log (a forged record
  on its local connection, a second connection as the same role and rank);
- ``DROP`` (from the driver, no payload but the role byte): close that rank's connection of
  that role.

Standard library only: a relay runs beside the ranks, on executors that lack the driver's
packages.
"""

from __future__ import annotations

import struct
from typing import Iterator, List, Optional, Tuple

from .frames import LENGTH, MAX_FRAME

#: each segment's head: its kind, its rank, its payload's length
SEGMENT = struct.Struct(">BII")

WORKER, LAUNCHER, JOINED, LEFT, NOTE, DROP = range(6)
#: the role of a ``WORKER`` or ``LAUNCHER`` segment, and back
ROLES = {WORKER: "worker", LAUNCHER: "launcher"}
KINDS = {role: kind for kind, role in ROLES.items()}
#: the largest frame on a relay's connection: one whole frame of a rank's, and its head
MAX_BUNDLE = MAX_FRAME + SEGMENT.size


class MalformedBundle(ValueError):
    """A relay's frame that cannot be split into segments."""


class SubStream:
    """One role and rank that a relay connected, as the driver sees it: what ``delivery``
    needs of a sender (its ``role``, ``rank``, whether it was ``heard``)."""

    __slots__ = ("role", "rank", "heard")

    def __init__(self, role: str, rank: int):
        self.role: Optional[str] = role
        self.rank = rank
        self.heard = False


def segment(kind: int, rank: int, payload: bytes = b"") -> bytes:
    """One segment, head and payload."""
    return SEGMENT.pack(kind, rank, len(payload)) + payload


def bundle(segments: List[bytes]) -> bytes:
    """``segments`` as frames of at most ``MAX_BUNDLE`` bytes, in order."""
    frames: List[bytes] = []
    chunk: List[bytes] = []
    size = 0
    for part in segments:
        if chunk and size + len(part) > MAX_BUNDLE:
            frames.append(LENGTH.pack(size) + b"".join(chunk))
            chunk, size = [], 0
        chunk.append(part)
        size += len(part)
    if chunk:
        frames.append(LENGTH.pack(size) + b"".join(chunk))
    return b"".join(frames)


def segments(body: bytes) -> Iterator[Tuple[int, int, bytes]]:
    """The segments of a relay's frame ``body``: (kind, rank, payload); ``MalformedBundle``
    where it cannot be split (a kind that does not exist, a payload past the end)."""
    offset, size = 0, len(body)
    while offset < size:
        if size - offset < SEGMENT.size:
            raise MalformedBundle("a segment's head cut short")
        kind, rank, length = SEGMENT.unpack_from(body, offset)
        offset += SEGMENT.size
        if kind > DROP:
            raise MalformedBundle(f"a segment of kind {kind}, which does not exist")
        if length > size - offset:
            raise MalformedBundle("a segment's payload past the end of its frame")
        yield kind, rank, body[offset : offset + length]
        offset += length


def role_of(payload: bytes) -> Optional[str]:
    """The role a ``JOINED``, ``LEFT`` or ``DROP`` segment's one byte names; ``None`` for none."""
    return ROLES.get(payload[0]) if len(payload) == 1 else None
