"""A machine's own copy of the notebook values out to the ranks, fetched once from the driver.

Where a run's ranks may be on machines other than the driver's (a Spark cluster), the large
values a cell uses (or ``run()``'s arguments) do not travel in the job: the driver writes them
once into one file (``values.Buffers.in_file``), serves that file on the run's event channel
(``wire.transfers``: the channel's authentication, and TLS where the channel has it), and the
job names it (``values.Buffers.fetched``).  On each machine the Spark task of each rank, before it
starts its rank:

- ``join``: takes a shared ``flock`` on ``<copy>.users`` (``<copy>`` is ``copy_path``:
  ``values.host_copy_path``, in shared memory where the machine has room, else in its temporary
  directory; where another user made this user's directory there first, a directory of the run's
  launchers' own beside it, named by the run's secret).  The task hands that lock to its guard
  process (``spark_task``), which holds it until the task has ended; the kernel lets it go when they
  die, even by SIGKILL, so it counts the machine's users of the copy without any count to
  repair.
- ``fetch``: takes ``<copy>.lock`` exclusively.  The first task to get it fetches the file into
  ``<copy>.tmp``, checks its size and the blob's own header, renames it to ``<copy>`` and writes
  its rank into the lock file; every other task of the machine waits for the lock, then finds
  the copy there.  Each rank maps ``<copy>``
  copy-on-write (``values.Buffers.load``), so the machine holds the bytes once: the copy its
  launcher fetched or found whole, whose path the launcher hands it (``names.VALUES_COPY_ENV``).
  A task killed while fetching leaves a ``.tmp`` that the next one replaces.
- at the task's end (its guard does it, after a kill too: ``spark_task``'s ``_GUARD_MAIN``,
  which runs with the standard library alone): it lets go of its shared lock and tries to take it
  exclusively without waiting.  Only a task that finds no other user gets it, and it removes the
  copy, the ``.tmp``, the lock and the users file (and the run's own directory, where the copy
  went to one); of tasks ending together, each lets go before it tries, so the last always gets
  it.  A rank that already mapped the copy keeps its pages.

Nothing that arrives is unpickled: the file holds the values' raw buffers only (their pickle
stream is in the job, which travels through Spark), which the ranks' tensors and arrays view.

Each fetch says so in its rank's log: ``[torchdist] notebook values: 512.0 MiB fetched from the
driver in 0.6 s (850 MiB/s)``, the others ``... mapped (fetched by rank 0 on this host)``.  A
fetch that fails fails its rank with a message naming the machine, the size and the cause.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import os
import socket
import stat
import time
from typing import Callable, Optional

from ..wire import tls
from ..core.privdir import open_private, private_directory, usable_user_directory
from ..wire.frames import MAX_HELLO, FrameError, NotTheDriver, Refused, read_frame
from ..wire.handshake import open_connection
from ..core.rankenv import RunSpec, rank_key
from ..core.timing import FETCH_QUEUE_WAIT, FETCH_STALL
from ..core.values import blob_size, host_copy_path

#: what a fetch receives and writes at once
CHUNK = 1 << 20
#: how often a task waiting for another's fetch looks whether the run was stopped
LOCK_POLL = 0.02
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class ValuesNotFetched(RuntimeError):
    """The notebook values could not be fetched from the driver onto this machine."""


def copy_path(run: RunSpec, say: Optional[Callable[[str], None]] = None) -> str:
    """Where this machine keeps its copy of ``run``'s notebook values: ``values.host_copy_path``,
    in this user's private directory there; where another user made that directory first
    (``privdir.usable_user_directory``, which says so through ``say``), in a private directory
    beside it named by ``copy_token``, which every launcher of the run derives alike and no other
    user can: the machine's launchers still share one copy."""
    usual = host_copy_path(run.values_fetch, run.values_fetch_size)
    parent = os.path.dirname(os.path.dirname(usual))
    return os.path.join(usable_user_directory(parent, agreed=copy_token(run), say=say), run.values_fetch)


def copy_token(run: RunSpec) -> str:
    """A name for this attempt of ``run``'s own directory of copies: derived from the run's
    launcher secret, so the run's launchers agree on it and no other user can make it first."""
    text = f"torchdist host copy {run.run_id} {run.attempt}".encode()
    return hmac.new(run.launcher_secret.encode(), text, hashlib.sha256).hexdigest()[:24]


def join(copy: str) -> int:
    """A file descriptor holding a shared lock on the machine's users of the copy at ``copy``
    (see the module's docstring); the caller hands it to whatever outlives it."""
    path = copy + ".users"
    while True:
        private_directory(os.path.dirname(copy))
        try:
            fd = open_private(path, os.O_RDWR | os.O_CREAT)
        except FileNotFoundError:  # the run's own directory, removed by the last user of an earlier copy
            continue
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a last user removes the copy
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # removed by the last user of an earlier copy: join the next one


def fetch(run: RunSpec, copy: str, rank: int, stopped: Callable[[], bool]) -> str:
    """Make sure this machine has the copy of ``run.values_fetch`` at ``copy``, fetching it
    from the driver if no other task of the machine did; the line for the rank's log.  ``""``
    when the run was stopped while this task waited.  ``ValuesNotFetched`` when the fetch
    failed; ``privdir.UnsafePath`` when the copy's directory is not this user's own, or a link
    stands where one of its files goes."""
    private_directory(os.path.dirname(copy))
    lock = open_private(copy + ".lock", os.O_RDWR | os.O_CREAT)
    try:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if stopped():
                    return ""
                time.sleep(LOCK_POLL)
        size = mib_text(run.values_fetch_size)
        if _whole_copy(copy, run.values_fetch_size):
            fetcher = os.pread(lock, 32, 0).decode("ascii", "replace") or "?"
            return f"[torchdist] notebook values: {size} mapped (fetched by rank {fetcher} on this host)"
        started = time.monotonic()
        _fetch_into(run, rank, copy)
        os.ftruncate(lock, 0)
        os.pwrite(lock, str(rank).encode("ascii"), 0)
        took = max(time.monotonic() - started, 1e-6)
        return (
            f"[torchdist] notebook values: {size} fetched from the driver in {took:.1f} s "
            f"({run.values_fetch_size / took / 2**20:.0f} MiB/s)"
        )
    finally:
        os.close(lock)


def mib_text(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def file_connection(run: RunSpec, rank: int, failed: Callable[[str], Exception], **hello):
    """``rank``'s launcher connection to the run's driver for a file (``fetch=name`` here,
    ``upload=size`` in ``valueupload``), authenticated; ``failed(cause)`` raised when the driver
    refuses it, is not this run's, or cannot be reached."""
    host, _, port = run.channel_address.rpartition(":")
    context = tls.client_context(run.channel_cert) if run.channel_cert else None
    try:
        return open_connection(
            (host.strip("[]"), int(port)),
            rank_key(run.launcher_secret, "launcher", rank),
            run.run_id,
            rank,
            "launcher",
            context,
            **hello,
        )
    except Refused as exc:
        raise failed(f"the driver refused: {exc}") from None
    except NotTheDriver as exc:
        raise failed(f"the server there is not this run's driver: {exc}") from None
    except (OSError, EOFError, FrameError) as exc:
        raise failed(f"cannot reach the driver's event channel ({exc or type(exc).__name__})") from None


def _whole_copy(copy: str, size: int) -> bool:
    """Whether ``copy`` is a file of this user's of ``size`` bytes whose blob header says as much
    (a fetcher's whole copy); anything else there (a file of an earlier run of the same name) is
    removed, to be fetched again."""
    try:
        info = os.lstat(copy)
    except FileNotFoundError:
        return False
    if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and info.st_size == size:
        try:
            if blob_size(copy) == size:
                return True
        except (OSError, ValueError):
            pass
    os.unlink(copy)
    return False


def _fetch_into(run: RunSpec, rank: int, copy: str) -> None:
    """Fetch the file into ``copy`` (through ``copy.tmp``, renamed once whole and checked)."""
    size = run.values_fetch_size

    def failed(cause: str) -> ValuesNotFetched:
        return ValuesNotFetched(
            f"rank {rank} could not fetch the notebook values ({mib_text(size)}) from the driver at "
            f"{run.channel_address} onto {socket.gethostname()}: {cause}"
        )

    sock = file_connection(run, rank, failed, fetch=run.values_fetch)
    tmp = copy + ".tmp"
    try:
        sock.settimeout(FETCH_QUEUE_WAIT)  # the size comes when the driver's turn for this fetch does
        try:
            head = read_frame(sock, MAX_HELLO)
        except (OSError, EOFError, FrameError) as exc:
            raise failed(f"the connection ended before the values began ({exc or type(exc).__name__})") from None
        sock.settimeout(FETCH_STALL)
        if "error" in head:
            raise failed(f"{head['error']!s:.500}")
        if head.get("size") != size:
            raise failed(f"the driver offered {head.get('size')!r:.40} bytes where the job names {size}")
        try:
            if os.path.lexists(tmp):  # what a fetcher killed before left
                os.unlink(tmp)
            out = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except OSError as exc:
            raise failed(f"cannot write {tmp} ({exc})") from None
        try:
            _receive(sock, out, size, tmp, failed)
        finally:
            os.close(out)
        _check(tmp, size, failed)
        os.rename(tmp, copy)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:  # not there, or not ours to remove (a directory in its way)
            pass
        raise
    finally:
        sock.close()


def _receive(sock, out: int, size: int, tmp: str, failed: Callable[[str], ValuesNotFetched]) -> None:
    """The file's bytes from ``sock`` into ``out``, through one reused buffer.  (Taking the
    file's room first, ``posix_fallocate``, would fail a full disk sooner, but costs a fifth of
    the fetch in shared memory, which it zeroes.)"""
    buffer = memoryview(bytearray(min(max(size, 1), CHUNK)))
    got = 0
    while got < size:
        try:
            n = sock.recv_into(buffer[: min(len(buffer), size - got)])
        except OSError as exc:
            raise failed(
                f"the connection failed after {mib_text(got)} of {mib_text(size)} ({exc or type(exc).__name__})"
            ) from None
        if not n:
            raise failed(f"the connection was cut after {mib_text(got)} of {mib_text(size)}")
        part = buffer[:n]
        try:
            while part.nbytes:
                part = part[os.write(out, part) :]
        except OSError as exc:
            cause = f"no room for it in {os.path.dirname(tmp)}" if exc.errno in _NO_ROOM else f"cannot write {tmp}"
            raise failed(f"{cause} after {mib_text(got)} ({exc})") from None
        got += n


def _check(tmp: str, size: int, failed: Callable[[str], ValuesNotFetched]) -> None:
    """The file's size, and the size its blob's header gives, are the size the job names."""
    written = os.path.getsize(tmp)
    try:
        expected = blob_size(tmp)
    except ValueError:
        expected = -1
    if written != size or expected != size:
        raise failed(
            f"what arrived is not the values the job names ({written} bytes written, "
            f"{expected} by its header, {size} expected)"
        )
