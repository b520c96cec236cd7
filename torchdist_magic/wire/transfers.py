"""Files over the driver's channel: the notebook's values out to the ranks (fetches) and the
ranks' values back (uploads), each on a thread of its own (``FileTransfers``).

Files.  A channel may serve files (``ChannelServer``'s ``files``: the notebook values out to the
ranks, which each machine of a cluster fetches once, ``hostcopy``).  A fetch is a connection
whose hello names the file (``"fetch"``); it authenticates as any other, then leaves the server's
thread for a thread of its own (``FileTransfers``: at most ``FETCHES_AT_ONCE`` at a time), which
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

Bounds.  Only a launcher fetches or uploads (a worker's key is refused at the hello), and one
rank's launcher has at most ``TRANSFERS_PER_RANK`` transfers open at once, waiting or under way
(``admit``); the server refuses one more, says so once in the log and counts it with the run's
refusals.  So a run holds at most that many descriptors per rank for transfers, as it holds at
most one channel connection per role and rank, and a key that leaked holds at most that many of
the ``FETCHES_AT_ONCE`` threads.  The hello's reply goes at once, not when the transfer's turn
comes, so a client waits for its turn (``FETCH_QUEUE_WAIT``) without trying its handshake again.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
import socket
import ssl
import threading
from typing import Callable, Dict, Optional, Tuple, Union, cast

from ..core.timing import FETCH_STALL
from . import framemac
from .connection import Connection
from .frames import pack_frame

_log = logging.getLogger("torchdist_magic")
#: files sent or received at once at most (one thread each); more fetches and uploads wait their turn
FETCHES_AT_ONCE = 8
#: file transfers one rank's launcher may have open at once, waiting for their turn or under way
#: (its fetch or its upload, and one more whose client tried its handshake again); one more is
#: refused, so that a launcher's key cannot hold the driver's descriptors or every transfer
#: thread (only launchers fetch or upload: ``handshake.check_hello``)
TRANSFERS_PER_RANK = 2
#: what a fetch over TLS reads from the file and encrypts at once, and what an upload reads at once
_FILE_CHUNK = 1 << 20
#: a full disk, as ``os.write`` says it (``EFBIG``: a file size limit)
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class FileTransfers:
    """Sends the files a channel serves and takes the ranks' values (see the module's docstring),
    each on a thread of its own, at most ``FETCHES_AT_ONCE`` at once: the channel's thread,
    which decodes the ranks' records, never waits for a file.  Sent from the file itself and
    written as it arrives, never held in memory."""

    def __init__(self, files: Dict[str, str], stats: Dict[str, int]):
        self._files = files
        self._stats = stats
        self._lock = threading.Lock()
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._sockets: set = set()  # of transfers started and not ended
        self._closed = False
        self._values: Dict[int, str] = {}  # where each rank's value goes
        self._open: Dict[Tuple[Optional[str], int], int] = {}  # transfers of each role and rank, not ended

    def serves(self, name: object) -> bool:
        return isinstance(name, str) and name in self._files

    def receive_values(self, paths: Dict[int, str]) -> None:
        with self._lock:
            self._values = dict(paths)

    def takes_value(self, rank: int) -> bool:
        with self._lock:
            return rank in self._values

    def admit(self, role: str, rank: int) -> bool:
        """Count one more transfer of ``role`` and ``rank``; ``False`` (and nothing counted)
        when it has ``TRANSFERS_PER_RANK`` open already."""
        with self._lock:
            count = self._open.get((role, rank), 0)
            if count >= TRANSFERS_PER_RANK:
                return False
            self._open[(role, rank)] = count + 1
            return True

    def start(self, conn: Connection, name: str) -> None:
        self._begin(conn, self._send, self._files[name])

    def start_upload(self, conn: Connection, rank: int, size: int) -> None:
        with self._lock:  # each rank's value is taken once: no two uploads write one file
            path = self._values.pop(rank, None)
        if path is None:  # taken by another upload, or another attempt's paths, since the hello was checked
            self._end(conn)
            return
        self._begin(conn, self._receive, path, size)

    def _begin(self, conn: Connection, transfer: Callable, *args) -> None:
        with self._lock:
            if not self._closed:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(FETCHES_AT_ONCE, "torchdist-files")
                self._sockets.add(conn.sock)
                self._pool.submit(self._run, transfer, conn, *args)
                return
        self._end(conn)

    def _end(self, conn: Connection) -> None:
        """Close a transfer's connection; its role and rank may open another."""
        key = (conn.role, conn.rank)
        with self._lock:
            self._sockets.discard(conn.sock)
            count = self._open.pop(key, 0) - 1
            if count > 0:
                self._open[key] = count
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

    def _run(self, transfer: Callable, conn: Connection, *args) -> None:
        sock = conn.sock
        try:
            with self._lock:
                if self._closed:
                    return
            sock.settimeout(FETCH_STALL)
            # what the server's thread could not send yet of the TLS handshake and of the
            # hello's reply comes first
            if conn.tls is not None:
                sock.sendall(bytes(conn.wire) + conn.tls_out.read())
            elif conn.wire:  # the reply, before the records
                sock.sendall(bytes(conn.wire))
            transfer(conn, *args)
        except framemac.ForgedRecord as exc:  # the file is not taken: the rank says what it saw
            with self._lock:
                self._stats["forged"] += 1
            _log.warning(
                "rank %d's file transfer carried a record that failed its authentication (%s); "
                "someone on the network may have written into it. It was dropped",
                conn.rank,
                exc,
            )
        except (OSError, ssl.SSLError):  # the peer went, stalled, or close(): it says what it saw
            pass
        finally:
            self._end(conn)

    def _send(self, conn: Connection, path: str) -> None:
        try:
            fh = open(path, "rb", buffering=0)
        except OSError as exc:
            self._sendall(conn, bytes(conn.outbox) + pack_frame({"error": f"the driver cannot read it: {exc}"}))
            return
        with fh:
            size = os.fstat(fh.fileno()).st_size
            self._sendall(conn, bytes(conn.outbox) + pack_frame({"size": size}))
            if conn.tls is None and conn.sealer is None:
                sent = conn.sock.sendfile(fh, 0, size)
            else:
                sent = self._send_sealed(conn, fh, size)
        if sent == size:
            with self._lock:
                self._stats["files_sent"] += 1

    def _receive(self, conn: Connection, path: str, size: int) -> None:
        """A rank's value of ``size`` bytes into ``path``, through ``path.tmp``."""
        folder, tmp = os.path.dirname(path), path + ".tmp"
        try:
            room = os.statvfs(folder)
            free = room.f_bavail * room.f_frsize
            if size > free:
                return self._sendall(
                    conn,
                    bytes(conn.outbox)
                    + pack_frame(
                        {"error": (f"no room for it on the driver: {folder} has {free / 2**20:.1f} MiB free")}
                    ),
                )
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            return self._sendall(
                conn, bytes(conn.outbox) + pack_frame({"error": f"the driver cannot write {tmp}: {exc}"})
            )
        written = False
        try:
            self._sendall(conn, bytes(conn.outbox) + pack_frame({"ready": True}))
            buffer = memoryview(bytearray(max(min(size, _FILE_CHUNK), 1)))
            wire = memoryview(bytearray(_FILE_CHUNK)) if conn.tls is not None or conn.opener is not None else buffer
            got, failure = 0, ""
            while got < size:
                n = self._recv_into(conn, buffer[: min(len(buffer), size - got)], wire)
                if not n:
                    return  # the rank went: it says what it saw
                if not failure:
                    try:
                        part = buffer[:n]
                        while part.nbytes:
                            part = part[os.write(out, part) :]
                    except OSError as exc:
                        cause = f"no room for it in {folder}" if exc.errno in _NO_ROOM else f"cannot write {tmp}"
                        failure = f"{cause} on the driver after {got / 2**20:.1f} MiB ({exc})"
                        self._sendall(conn, pack_frame({"error": failure}))  # the rest is read and dropped
                got += n
            if not failure:
                os.close(out)
                out = -1
                os.rename(tmp, path)
                written = True
                with self._lock:
                    self._stats["values_received"] += 1
                self._sendall(conn, pack_frame({"ok": True}))
        finally:
            if out >= 0:
                os.close(out)
            if not written:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    @staticmethod
    def _recv_into(conn: Connection, buffer: memoryview, wire: memoryview) -> int:
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
                return cast(int, conn.tls.read(len(buffer), buffer))  # with a buffer: the count read
            except ssl.SSLWantReadError:
                n = conn.sock.recv_into(wire)
                if not n:
                    return 0
                conn.tls_in.write(wire[:n])
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0

    @staticmethod
    def _sendall(conn: Connection, data: Union[bytes, memoryview]) -> None:
        if conn.sealer is not None:
            conn.sock.sendall(conn.sealer.seal(data))
        elif conn.tls is None:
            conn.sock.sendall(data)
        else:
            conn.tls.write(data)
            conn.sock.sendall(conn.tls_out.read())

    @staticmethod
    def _send_sealed(conn: Connection, fh, size: int) -> int:
        buffer = memoryview(bytearray(min(size, _FILE_CHUNK)))
        sent = 0
        while sent < size:
            n = fh.readinto(buffer)
            if not n:
                break
            FileTransfers._sendall(conn, buffer[:n])
            sent += n
        return sent
