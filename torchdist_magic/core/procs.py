"""This machine's processes, as Linux's ``/proc`` shows them: whether one has exited, the members
of a process group, and the processes a rank started, found by the mark in their environment.

Stopping a rank signals its process group, which a process the rank started in a session of its
own (``start_new_session=True``, ``setsid``, a daemonising tool) has left.  Such a process still
carries the rank's environment, and with it ``MARK_VARIABLE``, which the launcher sets to a
value of that rank's alone: ``end_marked_processes`` ends what carries it.

Only the standard library, and nothing of this package: a Spark task's guard runs this module's
source on its own (``python -I -S``), where the package may not be importable.  Off Linux there
is no ``/proc``: whether a process exited is asked with ``os.kill(pid, 0)``, and no group member
nor marked process is found.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import List, Optional

#: the environment variable that marks every process a rank starts (its launcher sets it to
#: ``<run id>:<attempt>:<rank>``; children inherit it, also those in a session of their own).
#: Spelled here, not in ``names`` (which gives it on), since this module runs on its own.
MARK_VARIABLE = "TORCHDIST_RANK_MARK"

log = logging.getLogger("torchdist_magic")

_PROC = os.path.isdir("/proc/self")


def _stat(pid: int) -> Optional[List[bytes]]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, pgrp, ...);
    ``None`` when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()  # the name in () may hold anything
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return fields or None


def _pids() -> List[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def process_exited(pid: int) -> bool:
    """Whether process ``pid`` has exited; a zombie (exited, not yet reaped) has."""
    if _PROC:
        try:
            fields = _stat(pid)
        except OSError:  # /proc there but unreadable (hidepid): ask the process itself
            pass
        else:
            return fields is None or fields[0] == b"Z"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # there, but another user's
        return False
    return False


def rss_bytes(pid: int) -> int:
    """The resident memory of process ``pid`` in bytes; 0 when it is gone or unknown."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def group_members(pgid: int) -> List[int]:
    """The live processes (zombies left out) of process group ``pgid``."""
    found = []
    for pid in _pids():
        try:
            fields = _stat(pid)
        except OSError:
            continue
        if fields is not None and len(fields) > 2 and fields[0] != b"Z" and fields[2] == str(pgid).encode():
            found.append(pid)
    return found


def marked_processes(mark: str) -> List[int]:
    """The live processes of this user, this one left out, whose environment carries
    ``MARK_VARIABLE=mark`` (a process's environment as it was when it started its program)."""
    if not mark:
        return []
    wanted = f"{MARK_VARIABLE}={mark}".encode()
    me, uid = os.getpid(), os.getuid()
    found = []
    for pid in _pids():
        if pid == me:
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as fh:
                environ = fh.read().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if wanted in environ and not process_exited(pid):
            found.append(pid)
    return found


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            words = fh.read().rstrip(b"\0").split(b"\0")
    except OSError:
        return f"process {pid}"
    command = " ".join(w.decode("utf-8", "replace") for w in words)
    return f"process {pid} ({command[:200]})"


def _send(pid: int, sig: signal.Signals, mark: str, why: str) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it ended meanwhile
        return
    except OSError as exc:
        log.warning("rank %s: could not send %s to %s: %s", mark, sig.name, _describe(pid), exc)
        return
    log.info("rank %s: sent %s to %s, %s", mark, sig.name, _describe(pid), why)


def _wait_exited(pids: List[int], deadline: float) -> List[int]:
    """``pids`` that have not exited by ``deadline``."""
    left = [p for p in pids if not process_exited(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if not process_exited(p)]
    return left


def end_marked_processes(mark: str, grace: float, reap: float = 1.0) -> List[int]:
    """End every process that carries the rank's ``mark`` (``marked_processes``): SIGTERM, up to
    ``grace`` seconds for them to exit, then SIGKILL to those left (found again: a process may
    have started another meanwhile), and up to ``reap`` seconds for those to be gone.  Every
    signal sent, and every process that could not be signalled or did not end, is logged.
    Returns the processes that were signalled."""
    found = marked_processes(mark)
    for pid in found:
        _send(pid, signal.SIGTERM, mark, "a process the rank left running")
    if not found:
        return []
    _wait_exited(found, time.monotonic() + max(grace, 0.0))
    left = marked_processes(mark)
    for pid in left:
        _send(pid, signal.SIGKILL, mark, f"still running {max(grace, 0.0):g} s after SIGTERM")
    for pid in _wait_exited(left, time.monotonic() + max(reap, 0.0)):
        log.warning("rank %s: %s did not end within %g s of SIGKILL", mark, _describe(pid), reap)
    return sorted(set(found) | set(left))
