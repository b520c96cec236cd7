"""What the driver's channel does with the frames of an authenticated connection: splits them,
decodes each record, checks that its sender's role may send it (``events.SENDERS``), hands it to
the run, and counts, says once and hands on every refusal."""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional, Protocol

from ..core import events
from ..core.recorddecoder import RecordDecoder
from .connection import Connection
from .frames import LENGTH, MAX_FRAME


class Sender(Protocol):
    """Who sent a frame: an authenticated connection, or a role and rank behind a host relay
    (``fanin.SubStream``)."""

    role: Optional[str]
    rank: int
    heard: bool


_log = logging.getLogger("torchdist_magic")


class Delivery:
    """Hands the records of authenticated connections to ``on_event`` (their ``rank`` the
    authenticated one) and refusals to ``on_refusal(kind, rank, detail)``, counting both in
    ``stats`` (the ``ChannelServer``'s).  Used on the server's one thread."""

    def __init__(
        self,
        on_event: Callable[[events.Event], None],
        on_refusal: Optional[Callable[[str, int, str], None]],
        stats: Dict[str, int],
        run_id: str,
    ):
        #: where delivered records go (the run's state)
        self.on_event = on_event
        self._on_refusal = on_refusal
        self._stats = stats
        self._run_id = run_id
        self._refusals_logged: set = set()
        self._decoder = RecordDecoder()

    def tell(self, rank: int, line: str) -> None:
        """Put ``line`` into ``rank``'s log, where the run's view shows it."""
        try:
            self.on_event(events.Log(rank=rank, stream="stderr", line=line))
        except Exception:  # noqa: BLE001  the driver's handler must not stop the channel
            self._stats["callback_errors"] += 1

    def frames(self, conn: Connection) -> bool:
        """Deliver the whole frames in ``conn``'s buffer; ``False`` when the connection must end
        (its stream can no longer be split into frames)."""
        buf, offset = conn.inbuf, 0
        while len(buf) - offset >= LENGTH.size:
            (length,) = LENGTH.unpack_from(buf, offset)
            if length > MAX_FRAME:  # the stream can no longer be split into frames
                self.refuse(
                    "malformed",
                    conn,
                    f"a frame of {length} bytes, over the channel's {MAX_FRAME}; the connection was closed",
                )
                return False
            end = offset + LENGTH.size + length
            if len(buf) < end:
                break
            body = bytes(buf[offset + LENGTH.size : end])
            offset = end
            self.deliver(conn, body)
        del buf[:offset]
        return True

    def peer(self, conn: Connection, joined: bool) -> None:
        """A role and rank authenticated (``joined``) or ended: nothing to do on the driver."""

    def deliver(self, conn: Sender, body: bytes) -> None:
        """Decode, check and hand on the records of one frame's ``body`` from ``conn``."""
        self._stats["frames"] += 1
        conn.heard = True
        items = self._decoder.frame(body)
        if items is None:
            self.refuse("malformed", conn, "a frame that is not a JSON object with a list of records")
            return
        assert conn.role is not None  # frames come after the hello that names the role
        decode, allowed, rank, on_event = self._decoder.record, events.SENDERS[conn.role], conn.rank, self.on_event
        delivered = 0
        for item in items:
            try:
                record = decode(item)
            except events.MalformedEvent:
                kind = self._decoder.kind_of(item)
                self.refuse("malformed", conn, f"a record that does not decode ({kind!r})"[:200])
                continue
            if type(record) not in allowed:
                self.refuse("forbidden", conn, f"a {type(record).__name__} record, which a {conn.role} may not send")
                continue
            record.rank = rank  # the record was made here, from the frame: no copy needed
            try:
                on_event(record)
            except Exception as exc:  # noqa: BLE001  the driver's handler must not stop the channel
                self.refuse(
                    "callback_errors",
                    conn,
                    f"a {type(record).__name__} record that the run's state could not take "
                    f"({type(exc).__name__}: {exc})"[:300],
                )
            else:
                delivered += 1
        self._stats["delivered"] += delivered

    def refuse(self, kind: str, conn: Sender, detail: str) -> None:
        """Count a refused record (``kind``: a ``stats`` key), say it once per kind in the log,
        and hand it to ``on_refusal``."""
        self._stats[kind] += 1
        if kind not in self._refusals_logged:
            self._refusals_logged.add(kind)
            _log.warning(
                "run %s: the channel refused %s from rank %s's %s (further refusals of this kind "
                "are counted in run.state.refusals)",
                self._run_id,
                detail,
                conn.rank,
                conn.role,
            )
        if self._on_refusal is not None:
            try:
                self._on_refusal(kind, conn.rank, detail)
            except Exception:  # noqa: BLE001  counting must not stop the channel
                _log.exception("run %s: counting a refused record failed", self._run_id)
