"""Shared test helpers: wait for a condition; find the processes of a run (by the run id in
their environment) and assert that none survives; a free port; a marker file; what a test
session's processes leave in shared memory (``SharedMemoryWatch``)."""

from __future__ import annotations

import glob
import os
import re
import socket
import tempfile
import textwrap
import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")

#: where Spark's Python workers make their temp dirs (taken at import, before a test redirects
#: ``tempfile``)
EXECUTOR_TMP = tempfile.gettempdir()


def wait_until(
    condition: Callable[[], T], timeout: float = 60.0, what: str = "the condition", interval: float = 0.05
) -> T:
    """Poll ``condition`` until it returns something true (which is returned); fail the test
    naming ``what`` when ``timeout`` seconds pass first.  Never a fixed sleep."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def _environ(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _ancestors(pid: int) -> list:
    """The pids above ``pid`` (its parent first), as far as they can be read."""
    found = []
    while pid > 1 and len(found) < 64:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                pid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
        found.append(pid)
    return found


def _is_zombie(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True


def pids_of_run(run_id: str) -> list:
    """Live processes (any depth) whose environment carries ``TORCHDIST_RUN_ID=run_id``."""
    marker = b"TORCHDIST_RUN_ID=" + run_id.encode() + b"\x00"
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid() and marker in _environ(pid) and not _is_zombie(pid):
            found.append(int(pid))
    return found


def alive(pid: int) -> bool:
    """``pid`` is a live process (not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not _is_zombie(str(pid))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now, for a server a test starts: chosen as a
    run's store port is (``launcher.reserve_port``), below the ephemeral range, where no other
    process's ``bind(0)`` or outgoing connection can take it before the server binds it."""
    from torchdist_magic.launch.launcher import reserve_port

    with reserve_port("127.0.0.1") as sock:
        return sock.getsockname()[1]


def touch(path: str) -> None:
    """Leave an empty marker file at ``path`` (a rank says where it got to)."""
    open(path, "w").close()


def one() -> int:
    """The smallest job: returns 1."""
    return 1


def rank_failure_of(run, timeout: float = 120.0):
    """The ``RankFailure`` ``run`` ends with; the run is cancelled and waited for whatever
    happens (its other ranks may be sleeping for minutes)."""
    from torchdist_magic import RankFailure

    try:
        run.result(timeout=timeout)
    except RankFailure as failure:
        return failure
    finally:
        run.cancel()
        run.wait(60)
    raise AssertionError(f"{run} did not fail")


def assert_no_survivors(run, extra_pids=(), wait: float = 5.0) -> None:
    """No process of ``run`` (ranks, their children) and none of ``extra_pids`` is alive."""

    def survivors():
        left = pids_of_run(run.run_id) + [p for p in extra_pids if alive(p)]
        left += [rs.pid for rs in run.state.snapshot().ranks if rs.pid and alive(rs.pid)]
        return sorted(set(left))

    try:
        wait_until(lambda: not survivors(), wait, "every process of the run to end")
    except AssertionError:
        raise AssertionError(f"processes of run {run.run_id} survived: {survivors()}") from None


def assert_nothing_survives(run_id: str, pid: int) -> None:
    """Neither the supervising process ``pid`` of run ``run_id`` (a detached run, or one whose
    channel is in a process of its own) nor any process of its ranks is alive, within 30 s."""
    wait_until(
        lambda: not alive(pid) and not pids_of_run(run_id),
        30,
        f"run {run_id}'s supervising process and ranks to end",
    )


def assert_nothing_left(run) -> None:
    """No process of the Spark run ``run`` survives, and its tasks left no directory behind."""
    assert_no_survivors(run)
    left = glob.glob(os.path.join(EXECUTOR_TMP, f"torchdist-{run.run_id}-*"))
    assert not left, f"task directories left behind: {left}"


class Collector:
    """An ``on_event`` callback that keeps what it gets, from any thread."""

    def __init__(self):
        self.records = []
        self.lock = threading.Lock()

    def __call__(self, record):
        with self.lock:
            self.records.append(record)

    def wait_for(self, n):
        """The records, once there are at least ``n``."""
        wait_until(lambda: len(self.records) >= n, 10, f"{n} records")
        with self.lock:
            return list(self.records)


def cell(ip, source):
    """Run a notebook cell (dedented) in the shell ``ip``, stored in its history."""
    return ip.run_cell(textwrap.dedent(source).strip("\n"), store_history=True)


def pipe_bytes(source: socket.socket, sink: socket.socket, limit=None) -> None:
    """Copy what ``source`` receives to ``sink`` until it ends or ``limit`` bytes went (a
    relay's one direction, in tests that cut a connection part way)."""
    passed = 0
    try:
        while limit is None or passed < limit:
            data = source.recv(65536 if limit is None else min(65536, limit - passed))
            if not data:
                break
            sink.sendall(data)
            passed += len(data)
    except OSError:
        pass


def rank_1_waits_for_data(steps):
    """A job whose rank 1 waits 20 ms for each item of its ``progress()`` loop; its rank."""
    import time

    from torchdist_magic import progress, rank

    def items():
        for i in range(steps):
            if rank() == 1:
                time.sleep(0.02)
            yield i

    for _ in progress(items(), total=steps, desc="step"):
        pass
    return rank()


class SteppedClock:
    """``time`` as the distributor sees it, and the offset added to a run state's quiet
    (``RunState.idle``), until ``expire()`` moves both a day on: a run's ``timeout`` and
    ``hang_timeout`` then pass when the test says so, once its ranks are where the test wants
    them, however long they took to start (conftest's ``run_clock``)."""

    def __init__(self):
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def expire(self) -> None:
        self.offset = 86400.0

    def advance(self, seconds: float) -> None:
        self.offset += seconds

    def __getattr__(self, name):
        return getattr(time, name)


#: the variable every process a test session starts inherits (``conftest``): its value is the
#: session's pytest pid, which tells the session's processes apart from another session's
SESSION_VARIABLE = "TORCHDIST_TESTS_SESSION"


class SharedMemoryWatch:
    """Notes the entries that the processes of test session ``session`` (a pytest pid) make in
    shared memory under torchdist_magic's names, there and in this user's private directory
    there (``torchdist-<uid>``, which itself stays): a name that carries its maker's pid
    (``-values-<pid>-``: a run's value directory, a machine's copy of its values), made by the
    session's pytest process or by a process whose environment carries ``SESSION_VARIABLE`` with
    the session's pid.  ``left()``: what of it is still there.  It looks every ``interval``
    seconds, in a thread of its own; a maker already reaped by then is not told apart (its
    entries are not named), and neither is another session's."""

    _PID = re.compile(r"^torchdist-.+-values-(\d+)-")

    def __init__(self, session: int, interval: float = 0.02):
        from torchdist_magic.core.privdir import user_path
        from torchdist_magic.core.values import SHARED_MEMORY

        self.session = session
        self.interval = interval
        self.folders = (SHARED_MEMORY, user_path(SHARED_MEMORY))
        self.made: set = set()
        self._seen = self._entries()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shared-memory-watch", daemon=True)
        self._thread.start()

    def _entries(self) -> set:
        found = set()
        for folder in self.folders:
            try:
                found |= {os.path.join(folder, name) for name in os.listdir(folder) if name.startswith("torchdist-")}
            except OSError:  # no private directory (yet)
                pass
        return found

    def _ours(self, path: str) -> bool:
        match = self._PID.match(os.path.basename(path))
        if match is None:
            return False
        pid = int(match.group(1))
        marker = f"{SESSION_VARIABLE}={self.session}\0".encode()
        # a killed maker's environment reads empty while it waits to be reaped: its parent tells
        return pid == self.session or marker in _environ(str(pid)) or self.session in _ancestors(pid)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self.look()

    def look(self) -> None:
        """Look now (the thread looks every ``interval``)."""
        entries = self._entries()
        self.made |= {path for path in entries - self._seen if self._ours(path)}
        self._seen = entries

    def left(self) -> list:
        return sorted(path for path in self.made if os.path.lexists(path))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.look()


#: the uid a test's process takes to act as another user of the machine (``nobody``)
OTHER_UID = 65534


def as_other_user(work, *args):
    """(As root.)  Fork a process that becomes uid ``OTHER_UID`` and runs ``work(*args)``; its pid once
    ``work`` has done what it does before it waits (it writes a byte to a pipe), then it stays
    until killed.  A failure in it is reported here."""
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(ready_r)
        code = 0
        try:
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            work(*args)
            os.write(ready_w, b"1")
            while True:
                time.sleep(3600)
        except BaseException as exc:  # noqa: BLE001
            os.write(ready_w, f"0{exc!r}".encode())
            code = 1
        finally:
            os._exit(code)
    os.close(ready_w)
    try:
        said = os.read(ready_r, 1000)  # the child's first word: it keeps the pipe open while it waits
    finally:
        os.close(ready_r)
    if said != b"1":
        os.waitpid(child, 0)
        raise AssertionError(f"the other user's process failed: {said[1:].decode(errors='replace')}")
    return child


def end_other_user(child):
    """End a process of ``as_other_user``."""
    os.kill(child, 9)
    os.waitpid(child, 0)
