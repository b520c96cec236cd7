"""A rank's side of the channel (a worker's, or the launcher's of a rank): ``ChannelClient``,
and a worker's client from its environment (``client_from_env``).

The client never blocks the training loop: ``send`` puts the record on a bounded queue that a
background thread drains, dropping and counting what does not fit.  What a rank sends many of
(progress, metrics, output) it gathers for ``flush`` (``batching.flush_every``: longer in a
large run) and sends as one batch
(``batching``); anything else goes at once.  The client's sender and reader threads share one
connection (with TLS, one ``tls.TlsSocket``).
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import time
from typing import Callable, List, Optional, Union, cast

from ..core import events
from ..core.names import CHANNEL_CERT_ENV, CHANNEL_ENV, RUN_ID_ENV, SECRET_ENV
from ..core.timing import CLIENT_CLOSE_WAIT
from . import framemac, tls
from .batching import BATCH, FLUSH_EVERY, GATHERED, encode_batch, flush_every
from .frames import MAX_FRAME, RECV_CHUNK, FrameError, NotTheDriver, Refused, decode_record, read_frame
from .handshake import open_connection
from .tls import TlsSocket


class ChannelClient:
    """Rank side (a worker, or the launcher of a rank): ``send`` never blocks, ``close``
    flushes what is queued; records from the driver go to ``on_message`` (on a thread of the
    client's), when given.

    If the driver cannot be reached, or refuses this client, one line says so on the process's
    stderr and records are dropped from then on.  With ``certificate`` (PEM: the run's, from
    ``tls.ChannelIdentity``) the connection is TLS and the driver must present exactly that
    certificate; a server that does not is not the driver, and nothing is sent to it.
    """

    def __init__(
        self,
        address: str,
        secret: str,
        run_id: str,
        rank: int,
        *,
        role: str = "worker",
        on_message: Optional[Callable[[events.Event], None]] = None,
        maxsize: int = 100_000,
        certificate: str = "",
        flush: float = FLUSH_EVERY,
    ):
        if role not in events.SENDERS:
            raise ValueError(f"role is one of {sorted(events.SENDERS)}, not {role!r}")
        self._tls = tls.client_context(certificate) if certificate else None
        self._flush = flush
        host, _, port = address.rpartition(":")
        self._address = (host.strip("[]"), int(port))
        self._secret = secret
        self._run_id = run_id
        self._rank = rank
        self._role = role
        self._on_message = on_message
        self._queue: "queue.Queue[Optional[events.Event]]" = queue.Queue(maxsize=maxsize)
        self._lock = threading.Lock()
        self._dropped = 0  # records not sent since the last Dropped record
        self._lost = False  # no driver to send to: drop everything
        self._closed = False
        self._flush_now = threading.Event()  # a record not to wait for, or close(): send what is queued
        self._sock: Optional[Union[framemac.MacSocket, TlsSocket]] = None
        self._reader: Optional[threading.Thread] = None
        self._settled = threading.Event()  # the first connection was made, or given up
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
            self._give_up(
                f"the events of rank {self._rank} were not all sent within {timeout:g} s; the rest are dropped"
            )
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
                self._reader = threading.Thread(
                    target=self._read, args=(sock,), name=f"torchdist-channel-rank{self._rank}-in", daemon=True
                )
                self._reader.start()
        while True:
            batch = [self._queue.get()]
            if isinstance(batch[0], GATHERED) and self._queue.qsize() < BATCH:
                self._flush_now.wait(self._flush)  # what this interval brings goes in one batch
            if not self._closed:
                self._flush_now.clear()  # what set it is in the queue now, and goes in this batch
            while len(batch) < BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            end = next((i for i, item in enumerate(batch) if item is None), None)
            if end is not None:  # close(): what came before it is the last to send
                self._write(cast(List[events.Event], batch[:end]))
                break
            self._write(cast(List[events.Event], batch))
        self._finish()

    def _connect(self) -> Optional[Union[framemac.MacSocket, TlsSocket]]:
        where = f"{self._address[0]}:{self._address[1]}"
        try:
            return open_connection(self._address, self._secret, self._run_id, self._rank, self._role, self._tls)
        except Refused as exc:
            self._give_up(f"the driver at {where} refused the event channel of rank {self._rank}: {exc}")
        except NotTheDriver as exc:
            self._give_up(
                f"the server at {where} is not this run's driver: {exc}; events of rank {self._rank} are not sent to it"
            )
        except (OSError, EOFError, FrameError) as exc:
            self._give_up(
                f"cannot reach the driver's event channel at {where} ({exc}); events of rank {self._rank} are dropped"
            )
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
            self._give_up(
                f"the event channel of rank {self._rank} to the driver was lost ({exc}); "
                "its events are dropped from now on"
            )

    def _finish(self) -> None:
        """Half-close and wait for the driver to close its side: it closes a connection only
        after handling every record that came before the end of it."""
        sock = self._sock
        if sock is None or self._lost:
            return
        try:
            sock.shutdown(socket.SHUT_WR)
            if self._reader is None:
                while sock.recv(RECV_CHUNK):
                    pass
        except OSError:
            pass

    # -- reader thread --------------------------------------------------------------------

    def _read(self, sock: Union[framemac.MacSocket, TlsSocket]) -> None:
        on_message = self._on_message
        assert on_message is not None  # the reader runs only for a client that takes messages
        while True:
            try:
                frame = read_frame(sock, MAX_FRAME)
            except framemac.ForgedRecord as exc:
                self._give_up(
                    f"a record to rank {self._rank} on the event channel failed its authentication "
                    f"({exc}): someone on the network may have written into it; nothing of it was "
                    "used, and the rank's events are dropped from now on"
                )
                return
            except (OSError, EOFError, FrameError):  # the driver, or close(), ended the connection
                return
            items = frame.get("events")
            for item in items if isinstance(items, list) else ():
                record = decode_record(item)
                if not isinstance(record, events.DRIVER_TO_RANK):
                    continue
                try:
                    on_message(record)
                except Exception as exc:  # noqa: BLE001  one bad message must not deafen the rank
                    print(
                        f"torchdist_magic: rank {self._rank} could not handle {record.type!r} from the driver: {exc!r}",
                        file=sys.__stderr__,
                        flush=True,
                    )


def client_from_env(on_message: Optional[Callable[[events.Event], None]] = None) -> Optional[ChannelClient]:
    """A worker's client, from ``TORCHDIST_CHANNEL`` (host:port), ``TORCHDIST_SECRET``,
    ``TORCHDIST_RUN_ID``, ``RANK`` and ``TORCHDIST_CHANNEL_CERT`` (the run's certificate, when its
    channel is TLS); ``None`` when the rank runs without a channel.
    ``on_message`` gets what the driver sends the worker (a warm pool's ``RunJob``)."""
    address = os.environ.get(CHANNEL_ENV)
    if not address:
        return None
    return ChannelClient(
        address,
        os.environ.get(SECRET_ENV, ""),
        os.environ.get(RUN_ID_ENV, ""),
        int(os.environ.get("RANK", "0")),
        on_message=on_message,
        certificate=os.environ.get(CHANNEL_CERT_ENV, ""),
        flush=flush_every(int(os.environ.get("WORLD_SIZE", "1"))),
    )
