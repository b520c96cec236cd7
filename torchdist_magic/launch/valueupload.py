"""A rank's value back to the driver over the run's channel, from a machine other than the driver's.

Where a rank's Spark task shares the driver's machine, its rank writes its value into the
driver's value directory and the driver maps that file (``spark_task.BarrierTaskSpec``).  On
another machine the value would otherwise come back through Spark itself: the barrier stage's
result through the JVM (bounded by ``spark.driver.maxResultSize``, 1 GiB by default) or Spark
Connect's Arrow rows, at neither the network's speed nor beyond a few GiB.  So the task sends
the file its rank wrote (``worker.RESULT_FILE``, written straight from the value's memory by
``values.dump``) to the driver on a connection of its own to the run's channel (``wire.transfers``:
the launcher's authentication, TLS where the channel has it): ``socket.sendfile`` on
plain TCP, one reused buffer encrypted a chunk at a time with TLS.  The driver writes it into the
very file the rank would have written on its machine, which the stage's outcome then names, as
on the driver's machine.

The task reports its rank's exit only once the value is with the driver: a value that could not
be sent fails its rank, with a message naming the machine, the size and the cause.  The sending
says so in its rank's log, as it starts (``sending_line``: ``[torchdist] value of rank 0: sending
512.0 MiB to the driver``) and when it is done (``[torchdist] value of rank 0: 512.0 MiB sent to
the driver in 0.6 s (850 MiB/s)``).
"""

from __future__ import annotations

import os
import socket
import time

from ..wire.frames import MAX_HELLO, FrameError, read_frame
from .hostcopy import file_connection, mib_text
from ..core.rankenv import RunSpec
from ..core.timing import FETCH_QUEUE_WAIT, FETCH_STALL

#: what a send over TLS reads from the file and encrypts at once
CHUNK = 1 << 20


class ValueNotSent(RuntimeError):
    """A rank's value could not be sent to the driver."""


def sending_line(path: str, rank: int) -> str:
    """The line for the rank's log while its value at ``path`` goes to the driver (its exit
    waits for it)."""
    return f"[torchdist] value of rank {rank}: sending {mib_text(os.path.getsize(path))} to the driver"


def send(run: RunSpec, path: str, rank: int) -> str:
    """Send the value blob at ``path`` (``rank``'s) to the driver; the line for the rank's log.
    ``ValueNotSent`` when it could not."""
    size = os.path.getsize(path)
    mib = mib_text(size)

    def failed(cause: str) -> ValueNotSent:
        return ValueNotSent(
            f"rank {rank} could not send its value ({mib}) from {socket.gethostname()} to the driver "
            f"at {run.channel_address}: {cause}"
        )

    started = time.monotonic()
    sock = file_connection(run, rank, failed, upload=size)
    try:
        sock.settimeout(FETCH_QUEUE_WAIT)  # "ready" comes when the driver's turn for this upload does
        _answer(sock, failed, "before the value began")
        sock.settimeout(FETCH_STALL)
        with open(path, "rb", buffering=0) as fh:
            try:
                _send_file(sock, fh, size)
            except OSError as exc:  # the file's offset: what went (``sendfile`` leaves it there too)
                raise failed(
                    f"the connection failed after {mib_text(fh.tell())} of {mib} ({exc or type(exc).__name__})"
                ) from None
        _answer(sock, failed, "before the driver confirmed the value")
    finally:
        sock.close()
    took = max(time.monotonic() - started, 1e-6)
    return (
        f"[torchdist] value of rank {rank}: {mib} sent to the driver in {took:.1f} s ({size / took / 2**20:.0f} MiB/s)"
    )


def _send_file(sock, fh, size: int) -> None:
    """``size`` bytes of ``fh`` to ``sock``: ``sendfile`` on a bare socket, else (TLS, or the
    authenticated records of a connection without it) through one reused buffer."""
    if isinstance(sock, socket.socket):
        sock.sendfile(fh, 0, size)
        return
    buffer = memoryview(bytearray(max(min(size, CHUNK), 1)))
    sent = 0
    while sent < size:
        n = fh.readinto(buffer[: min(len(buffer), size - sent)])
        if not n:
            return
        sock.sendall(buffer[:n])
        sent += n


def _answer(sock, failed, when: str) -> None:
    """The driver's next frame (``{"ready": true}``, then ``{"ok": true}``); ``failed`` when it
    is an error or none comes."""
    try:
        head = read_frame(sock, MAX_HELLO)
    except (OSError, EOFError, FrameError) as exc:
        raise failed(f"the connection ended {when} ({exc or type(exc).__name__})") from None
    if "error" in head:
        raise failed(f"{head['error']!s:.500}")
